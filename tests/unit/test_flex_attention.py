"""The FlexAttention backend against the PyTorch reference: the C kernel's grid of KV dtypes,
GQA shapes, head sizes and block sizes (test_cpu_paged_attention.py) for decodes, in each of
its key layouts; then whole steps (K/V written, decodes + prefills with cached context) and
the bookkeeping the layouts rest on (padding rows, block 0, blocks shared by sequences)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    KV_DTYPES,
    SHAPES,
    decode_case,
    decode_metadata,
    filled_cache,
    mixed_step,
)
from torch.nn.attention.flex_attention import flex_attention

from kvserve.attention import select_backend
from kvserve.attention.base import AttentionMetadata
from kvserve.attention.flex import FlexAttentionBackend
from kvserve.attention.flex_plan import IN_PLACE, PER_SEQUENCE, SHARED, plan_step
from kvserve.attention.torch_ref import TorchRefBackend


def attend(backend, query, cache, md, scale):
    """forward() with nothing new to write: the decode rows of `md` over the filled cache."""
    nothing = query[:0, : cache.key.shape[2]]
    return backend.forward(query, nothing, nothing, cache, md, scale)


def layouts_for(kv_dtype: str) -> list[str]:
    """In place reads the cache as the compute dtype: only a float32 cache for float32 queries."""
    return [PER_SEQUENCE, SHARED] + ([IN_PLACE] if kv_dtype == "float32" else [])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
def test_decode_equals_reference(kv_dtype, heads, kv_heads, dim, block_size):
    query, cache, md, scale, expected = decode_case(kv_dtype, heads, kv_heads, dim, block_size)
    for layout in layouts_for(kv_dtype):
        got = attend(FlexAttentionBackend(compiled=False, layout=layout), query, cache, md, scale)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=layout)


# Every KV dtype on the first shape, every shape in float32 (the decode test above has the
# full grid; a whole step costs more).
STEP_CASES = [(d, *SHAPES[0]) for d in KV_DTYPES] + [("float32", *s) for s in SHAPES[1:]]


@pytest.mark.parametrize(("kv_dtype", "heads", "kv_heads", "dim", "block_size"), STEP_CASES)
def test_step_with_decodes_and_prefills_equals_reference(
    kv_dtype, heads, kv_heads, dim, block_size
):
    """forward() as the model calls it: this step's K/V written through the (quantizing) cache,
    then every row attended; the caches hold the same earlier tokens for both backends."""
    gen = torch.Generator().manual_seed(dim + block_size)
    md, num_blocks, num_tokens = mixed_step(block_size, gen)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    results = {}
    for name, backend in [("torch", TorchRefBackend())] + [
        (layout, FlexAttentionBackend(compiled=False, layout=layout))
        for layout in layouts_for(kv_dtype)
    ]:
        cache = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim, gen.manual_seed(5))
        results[name] = backend.forward(q, k, v, cache, md, dim**-0.5)
    for name, got in results.items():
        torch.testing.assert_close(got, results["torch"], atol=2e-5, rtol=1e-4, msg=name)


def test_bfloat16_queries_over_a_bfloat16_cache_stay_bfloat16():
    gen = torch.Generator().manual_seed(3)
    cache = filled_cache("bfloat16", 8, 16, 1, 64, gen)
    md = decode_metadata([20, 33], 8, 16, gen)
    query = torch.randn(2, 2, 64, generator=gen).to(torch.bfloat16)
    expected = TorchRefBackend()._decode(query, cache, md, 0.125)
    for layout in (PER_SEQUENCE, SHARED, IN_PLACE):
        backend = FlexAttentionBackend(compiled=False, layout=layout)
        got = attend(backend, query, cache, md, 0.125)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_shared_blocks_are_gathered_once_and_block_zero_is_not_padding():
    """Three sequences share a 2-block prefix (blocks 0 and 5, as a prefix cache hit gives),
    the first also owns nothing else; padding entries are 0 too.  The shared layout reads 5
    distinct blocks, once each; the results equal the reference in every layout."""
    gen = torch.Generator().manual_seed(11)
    cache = filled_cache("int8", 10, 4, 2, 32, gen)
    tables = torch.tensor([[0, 5, 0, 0], [0, 5, 7, 0], [0, 5, 2, 9]])
    seq_lens = torch.tensor([7, 10, 16])
    md = AttentionMetadata(torch.zeros(0, dtype=torch.long), 3, tables, seq_lens, ())
    plan = plan_step(md, 10, 4, SHARED)
    assert plan.decode.gather.tolist() == [0, 2, 5, 7, 9] and plan.prefill is None
    query = torch.randn(3, 4, 32, generator=gen)
    expected = TorchRefBackend()._decode(query, cache, md, 0.2)
    for layout in (PER_SEQUENCE, SHARED):
        got = attend(FlexAttentionBackend(False, layout), query, cache, md, 0.2)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_the_plan_is_built_once_per_step():
    gen = torch.Generator().manual_seed(2)
    cache = filled_cache("float32", 12, 16, 2, 32, gen)
    backend = FlexAttentionBackend(compiled=False)
    md = decode_metadata([20, 33], 12, 16, gen)
    first = backend._plan(md, cache, torch.float32)
    assert backend._plan(md, cache, torch.float32) is first  # the next layer, same step
    again = decode_metadata([20, 33], 12, 16, gen)
    assert backend._plan(again, cache, torch.float32) is not first


def test_in_place_refuses_a_cache_in_another_dtype():
    gen = torch.Generator().manual_seed(1)
    cache = filled_cache("int8", 4, 16, 1, 32, gen)
    md = decode_metadata([20], 4, 16, gen)
    q = torch.randn(1, 2, 32)
    with pytest.raises(ValueError, match="in place needs a torch.float32 cache, not int8"):
        attend(FlexAttentionBackend(False, IN_PLACE), q, cache, md, 0.1)


def test_backend_choice_and_its_log(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with caplog.at_level("INFO", logger="kvserve.attention"):
        flex_cpu = select_backend("flex", cpu)
    assert type(flex_cpu) is FlexAttentionBackend and not flex_cpu.compiled
    assert "attention backend: flex (eager) (--attention-backend flex)" in caplog.text
    # Construction compiles nothing yet, so the CUDA choice can be checked on any machine.
    auto_cuda = select_backend("auto", cuda)
    assert type(auto_cuda) is FlexAttentionBackend and auto_cuda.compiled
    assert select_backend("flex", cuda).compiled


def test_the_compiled_kernel_reads_only_the_listed_blocks_correctly():
    """Eager FlexAttention evaluates the mask on every score and ignores the BlockMask's block
    lists; the compiled kernels (CUDA's path) visit only the listed blocks, skipping the mask
    on "full" ones.  torch.compile with static shapes works on a CPU (dynamic shapes do not
    build there: attention/flex.py), so one whole step checks the lists the CUDA path uses:
    decode rows, a 200-row span over two query tiles, and context before each span.  (About
    15 s the first time on a 2-core machine, then torch's compile cache.)"""
    gen = torch.Generator().manual_seed(80)
    md, num_blocks, num_tokens = mixed_step(16, gen)
    q, k, v = (torch.randn(num_tokens, h, 64, generator=gen) for h in (8, 2, 2))
    expected = TorchRefBackend().forward(
        q, k, v, filled_cache("float32", num_blocks, 16, 2, 64, gen.manual_seed(5)), md, 0.125
    )
    backend = FlexAttentionBackend(compiled=False, layout=IN_PLACE)
    backend._attend = torch.compile(flex_attention, dynamic=False)
    cache = filled_cache("float32", num_blocks, 16, 2, 64, gen.manual_seed(5))
    got = backend.forward(q, k, v, cache, md, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
