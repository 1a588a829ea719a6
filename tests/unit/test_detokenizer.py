"""IncrementalDetokenizer: the tokenizers library's DecodeStream gives, token by token, the
text of the windowed transformers decodes it replaced, and of one decode of all the tokens."""

from __future__ import annotations

import random

import pytest

from kvserve.tokenizer import IncrementalDetokenizer


def _sequences(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    texts = ["héllo wörld, 日本語のテキスト 🎉🎉 and emoji", "  spaces\n\nand\ttabs  "]
    texts.append("naïve café")
    sequences = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    turn = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    special = [tokenizer.eos_token_id, *turn]
    sequences.append(special + sequences[0])
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(40)] for _ in range(30)]
    return sequences


def _streamed(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk: int) -> str:
    for start in range(0, len(token_ids), chunk):
        detokenizer.add(token_ids[start : start + chunk])
    return detokenizer.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stream_gives_the_windowed_decodes_text(embedded_tokenizer, skip_special_tokens):
    for token_ids in _sequences(embedded_tokenizer):
        stream = IncrementalDetokenizer(embedded_tokenizer, skip_special_tokens)
        assert stream._stream is not None  # the embedded model's tokenizer is a fast one
        windowed = IncrementalDetokenizer(embedded_tokenizer, skip_special_tokens)
        windowed._stream = None
        expected = embedded_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        got = _streamed(stream, token_ids, 1)
        assert got == _streamed(windowed, token_ids, 1)
        assert expected.startswith(got)  # all of it but a trailing incomplete character
        assert stream.token_ids == token_ids
        again = IncrementalDetokenizer(embedded_tokenizer, skip_special_tokens)
        assert _streamed(again, token_ids, 3) == got  # several tokens a call


def test_a_failing_stream_hands_over_to_windows_without_losing_text(embedded_tokenizer):
    token_ids = embedded_tokenizer.encode("one two three four five six", add_special_tokens=False)

    class Failing:
        def __init__(self, real, fail_at):
            self.real, self.calls, self.fail_at = real, 0, fail_at

        def step(self, backend, token_id):
            self.calls += 1
            if self.calls > self.fail_at:
                raise RuntimeError("Invalid prefix encountered")
            return self.real.step(backend, token_id)

    detokenizer = IncrementalDetokenizer(embedded_tokenizer)
    detokenizer._stream = Failing(detokenizer._stream, fail_at=3)
    assert _streamed(detokenizer, token_ids, 2) == embedded_tokenizer.decode(token_ids)
    assert detokenizer._stream is None and detokenizer.token_ids == token_ids
