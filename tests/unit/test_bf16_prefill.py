"""The bf16 prefill kernel (attention/bf16_prefill.py), both its engines (AMX tiles where the
CPU has them, AVX512-BF16 vectors everywhere it runs), against attention in float64: causal
chunks that end their sequence, unmasked attention with log-sum-exps, GQA and head sizes
32-128, lengths that are not multiples of the kernel's 16-row and 32-key blocks.  Its
probabilities are rounded to bfloat16 before P x V, as SDPA's flash kernel rounds them: the
error bound is checked against SDPA's own on the same inputs."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import bf16_prefill
from kvserve.attention.torch_ref import _sequence_attention

pytestmark = pytest.mark.skipif(
    not bf16_prefill.prefill_kernel_available(), reason="no AVX512-BF16 kernel on this CPU"
)
ENGINES = {"best": bf16_prefill.BEST, "vectors": bf16_prefill.VECTORS}


def reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, H, D], [L, H]) in float64."""
    (num_query, num_heads, _), num_keys = query.shape, keys.shape[0]
    group = num_heads // keys.shape[1]
    q = query.double().transpose(0, 1)
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    if causal:
        visible = torch.arange(num_keys)[None, :] <= torch.arange(num_query)[:, None] + (
            num_keys - num_query
        )
        scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1), scores.logsumexp(-1).transpose(0, 1)


def inputs(num_query, num_keys, heads, kv_heads, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    return make(num_query, heads, dim), make(num_keys, kv_heads, dim), make(num_keys, kv_heads, dim)


CASES = [  # (L, S, H, Hkv, D, causal)
    (256, 256, 9, 3, 64, True),  # a fresh prompt of the embedded model
    (37, 37, 9, 3, 64, True),  # tails of both blocks
    (20, 300, 4, 2, 32, True),  # a chunk after 280 cached tokens
    (1, 1, 9, 3, 64, True),
    (33, 70, 8, 8, 128, False),  # unmasked (a shared prefix), MHA, two passes of 64 dims
    (100, 1100, 9, 3, 64, False),
    (45, 45, 6, 2, 96, True),  # six 16-dimension blocks: the vector engine's 4 + 2
]


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize(("num_query", "num_keys", "heads", "kv_heads", "dim", "causal"), CASES)
def test_the_kernel_is_as_close_to_exact_attention_as_sdpa(
    num_query, num_keys, heads, kv_heads, dim, causal, engine
):
    q, k, v = inputs(num_query, num_keys, heads, kv_heads, dim)
    scale = dim**-0.5
    want, want_lse = reference(q, k, v, causal, scale)
    got, lse = bf16_prefill.attend(q, k, v, causal, scale, with_lse=True, engine=engine)
    assert got.dtype == torch.float32 and lse is not None
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-6)
    # SDPA's error on the same inputs (the trailing causal mask as a boolean mask).
    mask = None
    if causal and num_keys != num_query:
        mask = torch.arange(num_keys)[None, :] <= torch.arange(num_query)[:, None] + (
            num_keys - num_query
        )
    elif not causal:
        mask = torch.ones(num_query, num_keys, dtype=torch.bool)
    sdpa = _sequence_attention(q, k, v, mask, scale)
    sdpa_error = (sdpa.double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= max(2 * sdpa_error, 1e-3)
    # The bfloat16 output is the float32 one, rounded.
    rounded, no_lse = bf16_prefill.attend(q, k, v, causal, scale, engine=engine)
    assert no_lse is None and torch.equal(rounded, got.to(torch.bfloat16))


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_the_kernel_reads_strided_rows_and_declines_what_it_does_not_fit(engine):
    """V as a view of a fused QKV projection (rows spaced by q + k + v); float32, a head size
    not a multiple of 32 and more queries than keys for a causal chunk return None."""
    q, k, _ = inputs(40, 40, 9, 3, 64, seed=1)
    qkv = torch.randn(40, (9 + 6) * 64).to(torch.bfloat16)
    v = qkv[:, 12 * 64 :].view(40, 3, 64)
    assert v.stride(0) == 15 * 64
    got, _ = bf16_prefill.attend(q, k, v, True, 0.125, engine=engine)
    contiguous, _ = bf16_prefill.attend(q, k, v.contiguous(), True, 0.125, engine=engine)
    torch.testing.assert_close(got, contiguous, rtol=0, atol=0)
    assert bf16_prefill.attend(q.float(), k.float(), v.float(), True, 0.125) is None
    q48, k48, v48 = inputs(8, 8, 2, 1, 48)
    assert bf16_prefill.attend(q48, k48, v48, True, 0.125) is None
    assert bf16_prefill.attend(q, k[:10], v[:10], True, 0.125) is None


def test_the_kernels_and_torchs_own_amx_calls_interleave():
    """SDPA's flash kernel and oneDNN also run on AMX tiles (where the CPU has them), in the
    same threads, and may keep a tile configuration between calls; the kvserve kernels
    configure and release theirs.  Interleaved in a random order, every call gives the same
    bits as its first one (on any CPU: the vector engine, too, must not depend on history)."""
    import random

    from kvserve.models.packed_linear import PackedLinear

    torch.manual_seed(0)
    q, k, _ = inputs(256, 256, 9, 3, 64, seed=2)
    layer = PackedLinear((torch.randn(960, 576) * 0.05).to(torch.bfloat16), None)
    rows16, rows512 = (torch.randn(n, 576).to(torch.bfloat16) for n in (16, 512))
    calls = {
        "sdpa flash": lambda: _sequence_attention(q, k, k, None, 0.125),
        "kernel attention": lambda: bf16_prefill.attend(q, k, k, True, 0.125)[0],
        "vector attention": lambda: bf16_prefill.attend(q, k, k, True, 0.125, engine=1)[0],
        "amx (or oneDNN) linear (16 rows)": lambda: layer(rows16),
        "onednn linear (512 rows)": lambda: layer(rows512),
    }
    first = {name: call() for name, call in calls.items()}
    rng = random.Random(0)
    for _ in range(400):
        name = rng.choice(list(calls))
        assert torch.equal(calls[name](), first[name]), name


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_a_batch_of_sequences_gives_each_sequences_own_attention(engine):
    """N same-shape sequences in one call (W3's suffixes) give, bit for bit, what N calls
    give; the queries may be a strided view (rows of a fused projection)."""
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 37, (9 + 6) * 64, generator=generator).to(torch.bfloat16)
    q = qkv[..., : 9 * 64].unflatten(-1, (9, 64))
    k = torch.randn(5, 40, 3, 64, generator=generator).to(torch.bfloat16)
    v = torch.randn(5, 40, 3, 64, generator=generator).to(torch.bfloat16)
    out, lse = bf16_prefill.attend_batch(q, k, v, True, 0.125, with_lse=True, engine=engine)
    assert out.shape == (5, 37, 9, 64) and lse.shape == (5, 37, 9)
    for i in range(5):
        one, one_lse = bf16_prefill.attend(q[i], k[i], v[i], True, 0.125, True, engine)
        assert torch.equal(out[i], one) and torch.equal(lse[i], one_lse)
    want, want_lse = reference(q[4], k[4], v[4], True, 0.125)
    torch.testing.assert_close(lse[4].double(), want_lse, atol=2e-5, rtol=2e-6)
    assert bf16_prefill.attend_batch(q, k[:4], v[:4], True, 0.125) is None


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize(
    ("block_size", "num_keys", "causal"),
    [(16, 1024, False), (32, 77, True), (16, 300, True), (64, 100, False)],
)
def test_keys_read_in_place_from_a_paged_cache_equal_the_gathered_keys(
    engine, block_size, num_keys, causal
):
    """Two sequences whose keys lie on scattered blocks of a paged cache (a W3 prefix, chunks
    after cached context): the kernel reads them through the block tables and gives, bit for
    bit, what it gives on the keys gathered first.  A table read a block off, or a slot of the
    wrong KV head, fails here."""
    generator = torch.Generator().manual_seed(block_size + num_keys)
    blocks_per_seq = -(-num_keys // block_size)
    cache = torch.randn(2 * blocks_per_seq + 5, 2, block_size, 3, 64, generator=generator)
    key_cache, value_cache = (c.contiguous() for c in cache.to(torch.bfloat16).unbind(1))
    tables = torch.randperm(2 * blocks_per_seq + 5, generator=generator)[: 2 * blocks_per_seq]
    tables = tables.view(2, blocks_per_seq)
    query = torch.randn(2, 20, 9, 64, generator=generator).to(torch.bfloat16)
    got = bf16_prefill.attend_paged(
        query, key_cache, value_cache, tables, num_keys, causal, 0.125, True, engine
    )
    gathered_k, gathered_v = (
        c[tables].flatten(1, 2)[:, :num_keys] for c in (key_cache, value_cache)
    )
    want = bf16_prefill.attend_batch(query, gathered_k, gathered_v, causal, 0.125, True, engine)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    odd = key_cache.view(-1, 8, 3, 64)  # blocks of 8 tokens: the kernel declines them
    assert bf16_prefill.attend_paged(query, odd, odd, tables, 16, causal, 0.125) is None
