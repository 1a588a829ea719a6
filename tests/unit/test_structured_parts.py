"""Constrained decoding's parts: request fields -> StructuredOutput (400s name the field),
grammar compilation and its errors, the bitmask llguidance fills, its application to the
logits, and a matcher that follows its request's output through preemption."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvserve.errors import ParameterError
from kvserve.request import Request, RequestStatus, SamplingParams, StructuredOutput
from kvserve.runner.sampling import (
    apply_token_bitmask,
    unpack_disallowed_host,
    unpack_disallowed_torch,
)
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.structured_fields import structured_output_of
from kvserve.step import ScheduledRequest, SchedulerOutput
from kvserve.structured.grammar import GrammarCompiler, lark_of_choices
from kvserve.structured.manager import StructuredOutputManager, make_ll_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def refused(request) -> APIError:
    with pytest.raises(APIError) as err:
        structured_output_of(request)
    assert err.value.status == 400
    return err.value


# ---------------------------------------------------------------------- request fields
def test_response_format_kinds():
    assert structured_output_of(chat()) is None
    assert structured_output_of(chat(response_format={"type": "text"})) is None
    assert structured_output_of(chat(response_format={"type": "json_object"})) == (
        StructuredOutput(json_object=True, source="response_format")
    )
    spec = {"name": "thing", "schema": SCHEMA, "strict": True}
    got = structured_output_of(chat(response_format={"type": "json_schema", "json_schema": spec}))
    assert got == StructuredOutput(
        json=json.dumps(SCHEMA), source="response_format.json_schema.schema"
    )


def test_structured_outputs_and_guided_fields_on_both_endpoints():
    for make in (chat, lambda **f: CompletionRequest(prompt="p", **f)):
        so = structured_output_of(make(structured_outputs={"regex": r"\d+"}))
        assert so == StructuredOutput(regex=r"\d+", source="structured_outputs.regex")
        so = structured_output_of(make(structured_outputs={"json": json.dumps(SCHEMA)}))
        assert so == StructuredOutput(json=json.dumps(SCHEMA), source="structured_outputs.json")
        so = structured_output_of(make(structured_outputs={"choice": ["a", "b"]}))
        assert so == StructuredOutput(choice=("a", "b"), source="structured_outputs.choice")
        so = structured_output_of(make(structured_outputs={"grammar": "start: /x+/"}))
        assert so == StructuredOutput(grammar="start: /x+/", source="structured_outputs.grammar")
        assert structured_output_of(make(guided_json=SCHEMA)) == StructuredOutput(
            json=json.dumps(SCHEMA), source="guided_json"
        )
        assert structured_output_of(make(guided_choice=["x"])).choice == ("x",)
        assert structured_output_of(make(guided_regex="a|b")).source == "guided_regex"
        assert structured_output_of(make(guided_grammar="start: /y/")).grammar == "start: /y/"
    with_format = CompletionRequest(prompt="p", response_format={"type": "json_object"})
    assert structured_output_of(with_format).json_object


def test_malformed_fields_are_400s_naming_the_field():
    cases = [
        (chat(guided_regex="a", guided_choice=["b"]), "guided_choice", "only one"),
        (
            chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "structured_outputs.regex", "only one",
        ),
        (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
         "exactly one"),
        (chat(structured_outputs={}), "structured_outputs", "exactly one"),
        (chat(structured_outputs={"structural_tag": "x"}), "structured_outputs.structural_tag",
         "not supported"),
        (chat(structured_outputs={"choice": []}), "structured_outputs.choice", "non-empty"),
        (chat(guided_json="{not json"), "guided_json", "not valid JSON"),
        (chat(guided_json="[1]"), "guided_json", "JSON schema"),
        (chat(response_format={"type": "xml"}), "response_format.type", "'xml'"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "object"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema", "JSON schema",
        ),
    ]  # fmt: skip
    for request, param, words in cases:
        error = refused(request)
        assert error.param == param, (param, error.message)
        assert words in error.message and error.message.startswith(param.split(".")[0])


# ---------------------------------------------------------------------- compilation
@pytest.fixture(scope="module")
def ll_tokenizer(embedded_tokenizer):
    return make_ll_tokenizer(embedded_tokenizer, frozenset({embedded_tokenizer.eos_token_id}))


def test_invalid_grammars_name_the_field_with_llguidance_reason(ll_tokenizer):
    compiler = GrammarCompiler(ll_tokenizer)
    cases = [
        (StructuredOutput(regex="a(b", source="structured_outputs.regex"), "unclosed group"),
        (StructuredOutput(json='{"type": "objekt"}', source="response_format.json_schema.schema"),
         "Invalid type: objekt"),
        (StructuredOutput(grammar="start: foo", source="guided_grammar"), 'unknown name: "foo"'),
        (StructuredOutput(grammar='root ::= "yes', source="guided_grammar"), "GBNF"),
    ]  # fmt: skip
    for so, reason in cases:
        with pytest.raises(ParameterError) as err:
            compiler.compile(so)
        assert err.value.param == so.source
        assert reason in err.value.reason, err.value.reason
        with pytest.raises(ParameterError):  # the error is cached too
            compiler.compile(so)
    assert compiler._compile.cache_info().hits == len(cases)
    assert compiler.compile(StructuredOutput(grammar='root ::= "yes" | "no"'))  # GBNF
    assert json.loads(compiler.compile(StructuredOutput(json=json.dumps(SCHEMA))))


def test_lark_of_choices_escapes():
    assert lark_of_choices(('a"b', "c\\d")) == 'start: "a\\"b" | "c\\\\d"\n'


# ---------------------------------------------------------------------- bitmask
def allowed_ids(bitmask_row: np.ndarray) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.fixture(scope="module")
def manager(embedded_tokenizer):
    return StructuredOutputManager(embedded_tokenizer, frozenset({embedded_tokenizer.eos_token_id}))


def test_bitmask_allows_exactly_the_prefixes_of_the_choices(manager):
    tok = manager.tokenizer
    grammar = manager.compile(StructuredOutput(choice=("yes", "no")))
    from llguidance import LLMatcher

    matcher = LLMatcher(tok, grammar)
    [row] = manager.fill_bitmask([matcher])
    assert row.shape == ((tok.vocab_size + 31) // 32,)
    prefixes = {"y", "ye", "yes", "n", "no"}
    expected = {
        t for t in range(tok.vocab_size)
        if not tok.is_special_token(t) and tok.decode_str([t]) in prefixes
    }  # fmt: skip
    assert allowed_ids(row) == expected and len(expected) >= 3
    assert matcher.consume_tokens(tok.tokenize_str("yes"))
    [row] = manager.fill_bitmask([matcher])
    assert allowed_ids(row) == {tok.eos_token} and matcher.is_stopped()


def test_apply_token_bitmask_masks_only_the_constrained_rows():
    logits = torch.arange(3 * 70, dtype=torch.float32).reshape(3, 70)
    original = logits.clone()
    bitmask = np.zeros((2, 2), dtype=np.int32)  # 64 bits: tokens 64..69 disallowed
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    bitmask[1, 1] = -(2**31)  # bit 31 of word 1: token 63
    apply_token_bitmask(logits, [0, 2], bitmask)
    inf = float("-inf")
    assert torch.equal(logits[1], original[1])
    assert [i for i in range(70) if logits[0, i] != inf] == [1, 3]
    assert [i for i in range(70) if logits[2, i] != inf] == [63]
    assert logits[0, 3] == original[0, 3] and logits[2, 63] == original[2, 63]
    wide = torch.zeros(1, 40)  # a mask wider than the logits: cut to them
    apply_token_bitmask(wide, [0], np.array([[1 << 5, -1]], dtype=np.int32))
    assert [i for i in range(40) if wide[0, i] != inf] == [5, *range(32, 40)]
    for dtype in (torch.bfloat16, torch.float16, torch.float64):  # 16-bit: by their bits
        half = torch.ones(2, 8, dtype=dtype)
        with torch.inference_mode():  # as the runner calls it
            apply_token_bitmask(half, [1], np.array([[0b100]], dtype=np.int32))
        assert half[1].tolist() == [inf, inf, 1.0, inf, inf, inf, inf, inf]
        assert half[0].tolist() == [1.0] * 8


def test_host_and_device_unpacking_agree():
    words = np.random.default_rng(0).integers(-(2**31), 2**31, (5, 7), dtype=np.int64)
    bitmask = words.astype(np.int32)
    host = unpack_disallowed_host(bitmask)
    assert torch.equal(host, unpack_disallowed_torch(bitmask, torch.device("cpu")))
    assert host.shape == (5, 224) and bool(host[0, 3]) == (not (bitmask[0, 0] >> 3) & 1)


# ---------------------------------------------------------------------- the manager
def make_request(request_id: str, so: StructuredOutput) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=32, structured=so)
    request = Request(request_id, [1, 2, 3], params, eos_token_ids=frozenset({0}))
    request.status = RequestStatus.RUNNING
    return request


def scheduled(request: Request, sample: bool = True) -> ScheduledRequest:
    start = request.num_computed_tokens
    return ScheduledRequest(
        request.request_id, request.all_token_ids[start:], start, [0], sample,
        request.sampling_params, request.num_output_tokens, request.eos_token_ids,
    )  # fmt: skip


def test_steps_follow_the_output_and_stop_when_the_grammar_is_complete(manager):
    tok = manager.tokenizer
    so = StructuredOutput(regex="ab|cd")
    request, other = make_request("r", so), make_request("plain", so)
    manager.add_request(request)
    step = SchedulerOutput([scheduled(other), scheduled(request, sample=False)], [], [])
    assert manager.with_bitmask(step) is step  # no sampled row has a grammar
    step = SchedulerOutput([scheduled(other), scheduled(request)], [], [])
    masked = manager.with_bitmask(step)
    assert masked.grammar_request_ids == ("r",) and masked.grammar_bitmask.shape[0] == 1
    assert {tok.decode_str([t]) for t in allowed_ids(masked.grammar_bitmask[0])} >= {"a", "c"}
    [a] = tok.tokenize_str("a")
    assert manager.advance(masked, {"r": a, "plain": 5}) == {}
    request.append_output_token(a)
    masked = manager.with_bitmask(SchedulerOutput([scheduled(request)], [], []))
    assert {tok.decode_str([t]) for t in allowed_ids(masked.grammar_bitmask[0])} == {"b"}
    [b] = tok.tokenize_str("b")
    assert manager.advance(masked, {"r": b}) == {"r": RequestStatus.FINISHED_STOPPED}
    request.append_output_token(b)
    # a token the grammar forbids (a bug: the mask allows none) aborts, never completes
    bad = make_request("bad", so)
    manager.add_request(bad)
    masked = manager.with_bitmask(SchedulerOutput([scheduled(bad)], [], []))
    assert manager.advance(masked, {"bad": b}) == {"bad": RequestStatus.FINISHED_ABORTED}
    request.status = bad.status = RequestStatus.FINISHED_STOPPED
    manager.with_bitmask(SchedulerOutput([], [], []))  # drops the finished ones
    assert "r" not in manager and "bad" not in manager


def test_preempted_request_masks_from_its_output_and_a_lost_matcher_replays(manager):
    """Recomputed after preemption (all its tokens again, sampling at the end), the request's
    mask is the one after its output; a matcher that missed tokens is reset and replays."""
    tok = manager.tokenizer
    so = StructuredOutput(json=json.dumps(SCHEMA))
    request = make_request("p", so)
    manager.add_request(request)
    for token in tok.tokenize_str('{"a":1'):
        masked = manager.with_bitmask(SchedulerOutput([scheduled(request)], [], []))
        assert token in allowed_ids(masked.grammar_bitmask[0])
        assert manager.advance(masked, {"p": token}) == {}
        request.append_output_token(token)
        request.num_computed_tokens = request.num_tokens - 1
    after_output = allowed_ids(
        manager.with_bitmask(SchedulerOutput([scheduled(request)], [], [])).grammar_bitmask[0]
    )
    request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
    request.status = RequestStatus.RUNNING  # readmitted: recomputes prompt + output
    recompute = manager.with_bitmask(SchedulerOutput([scheduled(request)], [], []))
    assert allowed_ids(recompute.grammar_bitmask[0]) == after_output
    assert {tok.decode_str([t]) for t in after_output} >= {"}", "0", "9"}
    # tokens appended behind the matcher's back (as if a step's advance was lost): replayed
    for token in tok.tokenize_str("}"):
        request.append_output_token(token)
    replayed = manager.with_bitmask(SchedulerOutput([scheduled(request)], [], []))
    assert allowed_ids(replayed.grammar_bitmask[0]) == {tok.eos_token}
    manager.remove("p")
