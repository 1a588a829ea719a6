"""The C paged-decode kernel against the PyTorch reference: every KV dtype, GQA shapes, odd
head sizes (SIMD tails), ragged lengths across block boundaries, scattered block tables, and
more than one thread."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    KV_DTYPES,
    SHAPES,
    decode_case,
    decode_metadata,
    decode_tolerance,
    filled_cache,
    mixed_step,
)

from kvserve import kv_quant as quant
from kvserve.attention import cpu_paged, select_backend
from kvserve.attention.base import AttentionMetadata
from kvserve.attention.kv_cache import LayerKVCache
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler here")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
def test_kernel_equals_reference(kv_dtype, heads, kv_heads, dim, block_size):
    query, cache, md, scale, expected = decode_case(kv_dtype, heads, kv_heads, dim, block_size)
    backend = select_backend("cpu-paged", torch.device("cpu"))
    got = backend._decode(query, cache, md, scale)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **decode_tolerance(kv_dtype))


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), SHAPES)
def test_int4_keys_relative_to_the_key_sink_equal_reference(heads, kv_heads, dim, block_size):
    """An int4 cache whose every fourth key lies near the layer's key sink (stored relative to
    it, kv_quant.py): the kernel's scores of those rows take q . sink (code and float paths)."""
    _, cache, md, scale, _ = decode_case("int4", heads, kv_heads, dim, block_size)
    gen = torch.Generator().manual_seed(dim)
    cache.key_sink = torch.randn(kv_heads, dim, generator=gen) * 5
    slots = torch.arange(0, cache.key.shape[0] * block_size, 4)
    keys = cache.key_sink + torch.randn(len(slots), kv_heads, dim, generator=gen)
    cache.write(slots, keys, torch.randn(len(slots), kv_heads, dim, generator=gen))
    assert (cache.key_scale < 0).sum() == len(slots) * kv_heads
    query = torch.randn(md.decode_block_tables.shape[0], heads, dim, generator=gen)
    expected = TorchRefBackend()._decode(query, cache, md, scale)
    got = select_backend("cpu-paged", torch.device("cpu"))._decode(query, cache, md, scale)
    torch.testing.assert_close(got, expected, **decode_tolerance("int4"))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 128, 8), (8, 1, 96, 32), (6, 2, 32, 16), (2, 2, 64, 4),
     (16, 2, 128, 16), (24, 3, 32, 32), (9, 3, 64, 64), (6, 2, 32, 128)],
)  # fmt: skip
def test_bfloat16_queries_equal_reference(kv_dtype, heads, kv_heads, dim, block_size):
    """The engine's bf16 case: queries that are bf16 values (widened to float32) over a bf16 or
    8-bit cache.  On a CPU with AVX512-BF16 (head size 32, 64 or 128) the kernel then takes
    its fast path: bf16 dot products (8-bit codes widened to bf16 exactly, times their
    scales), p x V in float32 with the heads of a group sharing each converted V chunk.  It
    must equal the float32 reference as closely as the float32 path does.  Group sizes 1-8
    (several passes over V when the accumulators do not fit the registers), tails shorter than
    16 rows and 1-token sequences included; blocks of 4 to 128 tokens (the kernel walks them in
    spans of 16 rows)."""
    gen = torch.Generator().manual_seed(heads * 100 + dim + block_size)
    seq_lens = [1, 2, block_size, block_size + 1, 17, 3 * block_size - 1, 77, 130]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim, gen)
    md = decode_metadata(seq_lens, num_blocks, block_size, gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen).bfloat16().float()
    scale = dim**-0.5
    expected = TorchRefBackend()._decode(query, cache, md, scale)
    got = select_backend("cpu-paged", torch.device("cpu"))._decode(query, cache, md, scale)
    torch.testing.assert_close(got, expected, **decode_tolerance(kv_dtype))


def _amx_decode_here() -> bool:
    if not ops.available():  # no kernel to ask (the module is skipped anyway)
        return False
    was = ops.kernels().use_amx_decode(True)
    ops.kernels().use_amx_decode(was)
    return was


@pytest.mark.skipif(not _amx_decode_here(), reason="the kernel has no AMX path on this CPU")
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(9, 3, 64, 16), (9, 3, 64, 32), (16, 2, 128, 16), (6, 2, 32, 16), (8, 8, 64, 64),
     (5, 1, 128, 16)],
)  # fmt: skip
def test_amx_scores_equal_the_vector_path_and_the_reference(
    kv_dtype, heads, kv_heads, dim, block_size
):
    """A bf16 or 8-bit cache on a CPU with AMX: the scores on tiles (every KV head's queries
    in one B tile's columns, zero where a head does not attend with that KV head), one softmax
    over all heads, p x V over the whole sequence.  8-bit K codes reach the tiles widened to
    bf16, their scales multiply each score's lane by its KV head's scale of that token, and V's
    scales the softmax weights.  Against the float32 reference as closely as the vdpbf16ps
    path, with the log-sum-exps the shared-prefix merge needs.  A B tile with a head in the
    wrong KV head's columns, a softmax over another lane, or a scale of another KV head or
    token fails here (every token and KV head has its own scale)."""
    gen = torch.Generator().manual_seed(heads * 10 + dim + block_size)
    seq_lens = [1, 15, 16, 17, block_size + 1, 3 * block_size - 1, 130, 301]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim, gen)
    md = decode_metadata(seq_lens, num_blocks, block_size, gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen).bfloat16().float()
    scale = dim**-0.5
    expected = TorchRefBackend()._decode(query, cache, md, scale)
    backend = select_backend("cpu-paged", torch.device("cpu"))
    tables, lens = md.decode_block_tables, md.decode_seq_lens
    results = {}
    try:
        for amx in (True, False):
            ops.kernels().use_amx_decode(amx)
            lse = torch.empty(len(seq_lens), heads)
            results[amx] = backend._kernel_decode(query, cache, tables, lens, scale, lse), lse
    finally:
        ops.kernels().use_amx_decode(True)
    for out, _ in results.values():
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_decodes_exactly(kv_dtype):
    """A 1-token sequence's output is its V row: 4 sequences whose V rows hold all 256 byte
    codes give back each code's value as torch decodes it (subnormals, -0 and the largest
    values included; the codes for inf/NaN, never written, are left out)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 1, 1, 64)
    cache = LayerKVCache(torch.zeros_like(codes), codes.clone(), None, None, kv_dtype)
    if kv_dtype in quant.SCALED_DTYPES:
        cache.key_scale = torch.ones(4, 1, 1)
        cache.value_scale = torch.full((4, 1, 1), 0.5)
    md = AttentionMetadata(
        torch.zeros(0, dtype=torch.long),
        4,
        torch.arange(4)[:, None],
        torch.ones(4, dtype=torch.long),
        (),
    )
    query = torch.randn(4, 2, 64).bfloat16().float()
    got = select_backend("cpu-paged", torch.device("cpu"))._decode(query, cache, md, 0.125)
    scale = 0.5 if kv_dtype in quant.SCALED_DTYPES else 1.0
    expected = codes.view(quant.FP8_TORCH_DTYPES[kv_dtype]).float().view(4, 1, 64) * scale
    finite = expected.isfinite().expand(4, 2, 64)
    assert torch.equal(got[finite], expected.expand(4, 2, 64)[finite])


@pytest.mark.parametrize("num_seqs", [1, 2, 12])
def test_threads_split_sequences_without_changing_results(num_seqs):
    """More threads than sequences included: the team is cut to the sequences (none for
    one, which runs on the caller), with the same results."""
    gen = torch.Generator().manual_seed(7)
    seq_lens = [40 + 13 * i for i in range(num_seqs)]
    num_blocks = sum(-(-n // 16) for n in seq_lens)
    cache = filled_cache("float32", num_blocks, 16, 2, 64, gen)
    md = decode_metadata(seq_lens, num_blocks, 16, gen)
    query = torch.randn(len(seq_lens), 6, 64, generator=gen)
    backend = select_backend("cpu-paged", torch.device("cpu"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend._decode(query, cache, md, 0.125)
        torch.set_num_threads(3)
        two = backend._decode(query, cache, md, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each sequence is computed by one thread, in the same order


def test_bfloat16_queries_come_back_in_bfloat16():
    gen = torch.Generator().manual_seed(3)
    cache = filled_cache("bfloat16", 8, 16, 1, 64, gen)
    md = decode_metadata([20, 33], 8, 16, gen)
    query = torch.randn(2, 2, 64, generator=gen).to(torch.bfloat16)
    got = select_backend("cpu-paged", torch.device("cpu"))._decode(query, cache, md, 0.125)
    expected = TorchRefBackend()._decode(query, cache, md, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_backend_choice():
    cpu = torch.device("cpu")
    assert type(select_backend("torch", cpu)) is TorchRefBackend
    assert type(select_backend("auto", cpu)).__name__ == "CpuPagedBackend"
    with pytest.raises(ValueError, match="--attention-backend cpu-paged runs on a CPU only"):
        select_backend("cpu-paged", torch.device("cuda"))


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_decode_step_stores_its_rows_and_attends_them(kv_dtype):
    """A decode-only step through forward(): the kernel stores each sequence's new K/V row
    itself (unquantized caches; an 8-bit one stores first, as before) and attends it.  The
    rows are strided like the model's: K its own tensor, V a view of the QKV projection.
    The cache must hold exactly what the reference's store puts there, and the outputs must
    match."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    seq_lens = [1, 16, 17, 40, 77, 130]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    ours = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim, gen)
    copy = [None if t is None else t.clone()
            for t in (ours.key, ours.value, ours.key_scale, ours.value_scale)]  # fmt: skip
    reference = LayerKVCache(*copy, kv_dtype=kv_dtype)
    decode = decode_metadata(seq_lens, num_blocks, block_size, gen)
    last = torch.tensor(seq_lens) - 1  # the new token's position in each sequence
    slots = decode.decode_block_tables[torch.arange(len(seq_lens)), last // block_size]
    md = AttentionMetadata(slots * block_size + last % block_size, len(seq_lens),
                           decode.decode_block_tables, decode.decode_seq_lens, ())  # fmt: skip
    model_dtype = (
        torch.float32 if kv_dtype in ("float32", "int8", "int4") else getattr(torch, kv_dtype)
    )
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = qkv.to(model_dtype).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q = q.reshape(-1, heads, dim)
    k, v = k.reshape(-1, kv_heads, dim) * 1, v.view(-1, kv_heads, dim)  # K: RoPE made a copy
    assert v.stride(0) == (heads + 2 * kv_heads) * dim != k.stride(0)
    backend = select_backend("cpu-paged", torch.device("cpu"))
    got = backend.forward(q, k, v, ours, md, dim**-0.5)
    expected = TorchRefBackend().forward(q, k, v, reference, md, dim**-0.5)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert torch.equal(mine, theirs)
    rounded = {"atol": 1e-2, "rtol": 1e-2}  # 16-bit queries
    tolerance = decode_tolerance(kv_dtype) if model_dtype == torch.float32 else rounded
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
@pytest.mark.parametrize("split_stored", [False, True])
def test_chunks_after_cached_context_equal_reference(kv_dtype, split_stored, monkeypatch):
    """A step of decodes and prefill chunks, two of them after cached context: a cache that
    keeps K/V as computed has its chunks attend their context and themselves in two calls
    merged by log-sum-exp; another (quantized, or 16-bit under float32 queries) takes the
    reference's masked call for chunks this small, and the two calls over the rows as stored
    past MIN_SPLIT_PAIRS_STORED (lowered to 0 here).  Outputs and caches must match the
    reference's."""
    if split_stored:
        monkeypatch.setattr(cpu_paged, "MIN_SPLIT_PAIRS_STORED", 0)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    md, num_blocks, num_tokens = mixed_step(block_size, gen)
    assert sum(span.seq_len > span.num_query for span in md.prefills) == 2
    dtype = torch.float32 if kv_dtype in ("float32", "int8", "int4") else getattr(torch, kv_dtype)
    q, k, v = (torch.randn(num_tokens, n, dim, generator=gen).to(dtype)
               for n in (heads, kv_heads, kv_heads))  # fmt: skip
    caches, outputs = [], []
    for backend in (TorchRefBackend(), select_backend("cpu-paged", torch.device("cpu"))):
        cache = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim, gen.manual_seed(9))
        outputs.append(backend.forward(q, k, v, cache, md, dim**-0.5))
        caches.append(cache)
    for mine, theirs in zip(caches[1].tensors, caches[0].tensors, strict=True):
        assert torch.equal(mine, theirs)
    rounded = {"atol": 1e-2, "rtol": 1e-2}  # 16-bit queries
    tolerance = decode_tolerance(kv_dtype) if dtype == torch.float32 else rounded
    torch.testing.assert_close(outputs[1], outputs[0], **tolerance)


def test_fresh_prompts_of_one_length_attend_in_one_call_as_they_do_alone(monkeypatch):
    """W1's steps: whole prompts of one length, adjacent in the batch, go to the bf16 kernel
    as one batch (here 3 x 37 and 2 x 20 tokens, beside decodes and a chunk after context).
    Outputs equal, bit for bit, those of one call per prompt, and the reference's."""
    from kvserve.attention import bf16_prefill

    if not bf16_prefill.prefill_kernel_available():
        pytest.skip("no bf16 prefill kernel on this CPU")
    gen = torch.Generator().manual_seed(11)
    prefills = [(0, 37), (0, 37), (0, 37), (21, 9), (0, 20), (0, 20)]
    md, num_blocks, num_tokens = mixed_step(16, gen, prefills=prefills)
    q, k, v = (torch.randn(num_tokens, n, 64, generator=gen).bfloat16() for n in (9, 3, 3))
    backend = select_backend("cpu-paged", torch.device("cpu"))
    batches = []
    real = type(backend)._fresh_prompts

    def counting(self, *args):
        done = real(self, *args)
        batches.append(done)
        return done

    outputs = []
    for fresh in (counting, lambda self, *args: False):
        monkeypatch.setattr(type(backend), "_fresh_prompts", fresh)
        cache = filled_cache("bfloat16", num_blocks, 16, 3, 64, gen.manual_seed(9))
        outputs.append(backend.forward(q, k, v, cache, md, 0.125))
    assert batches == [True, False, True]  # 3 x 37, the chunk after context, 2 x 20
    assert torch.equal(outputs[0], outputs[1])
    cache = filled_cache("bfloat16", num_blocks, 16, 3, 64, gen.manual_seed(9))
    expected = TorchRefBackend().forward(q, k, v, cache, md, 0.125)
    torch.testing.assert_close(outputs[0], expected, atol=1e-2, rtol=1e-2)
