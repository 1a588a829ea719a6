"""Attention split at a prefix that every sequence of the step shares (CPU backend): the
shared blocks attended once for all queries, each suffix alone, merged by log-sum-exp; it
must equal the reference, which attends each sequence over its whole table."""

from __future__ import annotations

import pytest
import torch
from attention_cases import filled_cache

from kvserve.attention import select_backend
from kvserve.attention.kv_cache import LayerKVCache
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.native import ops
from kvserve.request import SamplingParams
from kvserve.runner.model_runner import build_attention_metadata, build_batch_input
from kvserve.step import ScheduledRequest

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler here")

BLOCK = 16


def scheduled(name: str, num_tokens: int, start: int, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=name, token_ids=[1] * num_tokens, start_position=start, block_table=table,
        sample=True, sampling_params=SamplingParams(temperature=0.0), num_output_tokens=0,
        eos_token_ids=frozenset(),
    )  # fmt: skip


def step(prefix_blocks: int, decode_lens: list[int], prefills: list[tuple[int, int]]):
    """Decodes of the given context lengths and prefill chunks (cached, new), all starting
    with the same `prefix_blocks` blocks; each suffix on blocks of its own."""
    next_block = prefix_blocks
    requests = []

    def table(total: int) -> list[int]:
        nonlocal next_block
        own = -(-total // BLOCK) - prefix_blocks
        next_block += own
        return list(range(prefix_blocks)) + list(range(next_block - own, next_block))

    for i, n in enumerate(decode_lens):
        requests.append(scheduled(f"d{i}", 1, n - 1, table(n)))
    for i, (cached, new) in enumerate(prefills):
        requests.append(scheduled(f"p{i}", new, cached, table(cached + new)))
    requests.sort(key=lambda r: r.num_tokens > 1)  # the runner's order: decodes first
    return requests, next_block


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "decode_lens", "prefills"),
    [
        (9, 3, [300, 289, 257, 400, 333], []),  # decodes only
        (9, 3, [], [(256, 32), (256, 17), (260, 5), (300, 40)]),  # prefill chunks only
        (4, 2, [270, 290], [(288, 32), (256, 1), (300, 64)]),  # mixed
        (8, 8, [513, 600, 700, 800], [(520, 3)]),  # no GQA
        # suffixes of one shape attend in one batched call (W3's), beside one-offs
        (9, 3, [300], [(256, 32)] * 4 + [(256, 17), (270, 16), (270, 16), (300, 1)]),
    ],
)
def test_split_at_shared_prefix_equals_reference(kv_dtype, heads, kv_heads, decode_lens, prefills):
    gen = torch.Generator().manual_seed(heads + len(decode_lens) * 7 + len(prefills))
    requests, num_blocks = step(16, decode_lens, prefills)
    batch = build_batch_input(requests, BLOCK, torch.device("cpu"))
    md = build_attention_metadata(batch, BLOCK)
    assert md.shared_prefix_blocks == 16  # found by the runner from the block tables
    dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    cache = filled_cache(kv_dtype, num_blocks + 1, BLOCK, kv_heads, 64, gen)
    tokens = batch.input_ids.shape[0]
    query = torch.randn(tokens, heads, 64, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads, 64, generator=gen).to(dtype)
    value = torch.randn(tokens, kv_heads, 64, generator=gen).to(dtype)
    # Each backend on a cache of its own: a decode-only step's rows are stored by the kernel
    # (not before it), and must then be in the cache as the reference wrote them.
    own = LayerKVCache(*(None if t is None else t.clone() for t in _tensors(cache)), cache.kv_dtype)
    expected = TorchRefBackend().forward(query, key, value, cache, md, 0.125)
    got = select_backend("cpu-paged", torch.device("cpu")).forward(
        query, key, value, own, md, 0.125
    )
    for mine, reference in zip(_tensors(own), _tensors(cache), strict=True):
        assert mine is None and reference is None or torch.equal(mine, reference)
    assert got.dtype == dtype
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def _tensors(cache: LayerKVCache) -> tuple[torch.Tensor | None, ...]:
    return cache.key, cache.value, cache.key_scale, cache.value_scale


def test_prefill_spans_group_by_their_shape_in_order():
    from kvserve.attention.base import PrefillSpan
    from kvserve.attention.cpu_paged import same_shape_groups

    table = torch.zeros(20, dtype=torch.long)
    a, b, c, d = (PrefillSpan(i * 8, i * 8 + n, 300 + n, table) for i, n in enumerate([8, 4, 8, 8]))
    e = PrefillSpan(40, 48, 290, table)  # same query tokens, other context length
    assert same_shape_groups((a, b, c, d, e)) == [[a, c, d], [b], [e]]


def test_no_shared_prefix_when_a_sequence_has_no_cached_context():
    """A fresh prefill shares no cached blocks with anyone: nothing is split."""
    requests, _ = step(16, [300, 300, 300], [])
    requests.append(scheduled("fresh", 64, 0, [900, 901, 902, 903]))
    md = build_attention_metadata(build_batch_input(requests, BLOCK, torch.device("cpu")), BLOCK)
    assert md.shared_prefix_blocks == 0


def forward_both(requests, num_blocks, kv_dtype, heads, kv_heads, seed):
    """(reference, cpu-paged) outputs of one step over a cache filled at random."""
    gen = torch.Generator().manual_seed(seed)
    batch = build_batch_input(requests, BLOCK, torch.device("cpu"))
    md = build_attention_metadata(batch, BLOCK)
    dtype = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
    cache = filled_cache(kv_dtype, num_blocks + 1, BLOCK, kv_heads, 64, gen)
    tokens = batch.input_ids.shape[0]
    qkv = [torch.randn(tokens, h, 64, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)]
    expected = TorchRefBackend().forward(*qkv, cache, md, 0.125)
    got = select_backend("cpu-paged", torch.device("cpu")).forward(*qkv, cache, md, 0.125)
    return md, got, expected


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_the_chunk_computing_the_prefix_attends_alone_and_the_others_share_it(kv_dtype):
    """W3's first step: one request computes the shared prompt while others, admitted in the
    same step, read it.  That one keeps the usual path, the rest are split at the prefix; all
    must equal the reference.  (Only one request can write a block in a step, so at most the
    one computing the prefix starts inside it.)"""
    requests, _ = step(16, [300, 290], [(256, 32), (256, 17), (260, 5)])
    table = requests[0].block_table[:16]  # the shared blocks
    requests.insert(2, scheduled("prompt", 16 * BLOCK + 9, 0, table + [200, 201]))
    md, got, expected = forward_both(requests, 202, kv_dtype, 9, 3, seed=5)
    assert md.shared_prefix_blocks == 16
    tolerance = 2e-5 if kv_dtype == "float32" else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_a_decode_inside_the_common_blocks_limits_the_prefix_to_what_precedes_it():
    requests, _ = step(16, [300, 290, 280], [(256, 32)])
    requests.append(scheduled("early", 1, 70, requests[0].block_table[:16]))  # at block 4
    requests.sort(key=lambda r: r.num_tokens > 1)
    md = build_attention_metadata(build_batch_input(requests, BLOCK, torch.device("cpu")), BLOCK)
    assert md.shared_prefix_blocks == 70 // BLOCK
