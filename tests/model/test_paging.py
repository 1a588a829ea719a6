"""Paging is exact: one prefill, chunks of 7 tokens and token-by-token decode over block
boundaries give the same logits; sequences batched together equal each run alone."""

from __future__ import annotations

import pytest
import torch
from helpers import forward_logits, make_cache, run_in_chunks

from kvserve.evaluation.paged import Piece
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_checkpoint

TOKENS = [(i * 7919) % 40000 + 5 for i in range(45)]  # 45 tokens: crosses 11 blocks of 4


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    directory, _ = tiny_model_dir("llama3")
    ckpt = load_checkpoint(str(directory))
    return LlamaForCausalLM.from_weights(
        ckpt.config, ckpt.weights, torch.float32, torch.device("cpu")
    )


@pytest.mark.parametrize("chunk_size", [7, 1, 4, 16])
def test_chunked_prefill_equals_one_shot(model, chunk_size):
    one_shot = run_in_chunks(model, TOKENS, chunk_size=len(TOKENS))
    chunked = run_in_chunks(model, TOKENS, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)


def test_batched_sequences_equal_each_alone(model):
    a, b, c = TOKENS[:13], TOKENS[5:30], TOKENS[20:21]
    alone = [run_in_chunks(model, t, chunk_size=len(t)) for t in (a, b, c)]
    cache = make_cache(model, num_blocks=20, block_size=4)
    # Scattered, non-contiguous block tables on purpose.
    tables = [[17, 3, 9, 12], [0, 19, 4, 8, 15, 2, 11], [6]]
    pieces = [Piece(n, t, 0, tb) for n, t, tb in zip("abc", (a, b, c), tables, strict=True)]
    together = forward_logits(model, cache, pieces)
    for x, y in zip(together, alone, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_mixed_decode_and_prefill_batch(model):
    """Decodes of two sequences share a step with a prefill chunk of a third."""
    cache = make_cache(model, num_blocks=30, block_size=4)
    ta, tb = [0, 1, 2], [3, 4, 5, 6, 7, 8]  # 11 and 21 tokens at block size 4
    forward_logits(model, cache, [Piece("a", TOKENS[:10], 0, ta), Piece("b", TOKENS[10:30], 0, tb)])
    step = forward_logits(
        model, cache,
        [Piece("a", TOKENS[10:11], 10, ta), Piece("b", TOKENS[30:31], 20, tb),
         Piece("c", TOKENS[31:40], 0, [20, 21, 22])],
    )  # fmt: skip
    ref_a = run_in_chunks(model, TOKENS[:11], chunk_size=11)[-1]
    ref_b = run_in_chunks(model, TOKENS[10:31], chunk_size=21)[-1]
    ref_c = run_in_chunks(model, TOKENS[31:40], chunk_size=9)
    torch.testing.assert_close(step[0][-1], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1][-1], ref_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[2], ref_c, atol=1e-5, rtol=1e-5)
