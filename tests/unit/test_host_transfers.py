"""The host tier's copies (runner/host_transfers.py) on small CPU caches: a block that goes to
the host tier and comes back holds exactly the bytes stored, the int8 tier's dequantized codes
when it is compressed, and the compressed tier holds ~3.6x the blocks of a float32 cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvserve import kv_quant as quant
from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.engine import sizing
from kvserve.executor.memory import GIB, HostMemory
from kvserve.kv.spec import kv_cache_spec
from kvserve.runner.host_transfers import apply_host_transfers

CPU = torch.device("cpu")
HOST = HostMemory(total=20 * GIB, available=12 * GIB)
SPEC = kv_cache_spec(2, 2, 16, "auto", "float32", 16)  # 8 KiB a block in float32


def filled_caches(spec, num_blocks: int, seed: int = 0):
    """Device caches whose every token row holds random values (written as a step writes)."""
    caches = allocate_kv_caches(spec, num_blocks, CPU)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(num_blocks * spec.block_size)
    for cache in caches:
        k, v = (torch.randn(len(slots), 2, 16, generator=gen) * 3 for _ in range(2))
        cache.write(slots, k.to(cache.key.dtype), v.to(cache.key.dtype))
    return caches


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_uncompressed_block_comes_back_with_exactly_the_stored_bytes(dtype):
    spec = kv_cache_spec(2, 2, 16, "auto", dtype, 16)
    device, host = filled_caches(spec, 6), allocate_kv_caches(spec, 3, CPU)
    before = [(c.key[2].clone(), c.value[2].clone()) for c in device]
    apply_host_transfers(device, host, to_host=[(2, 1)], from_host=[])
    apply_host_transfers(device, host, to_host=[], from_host=[(5, 1)])
    for cache, (key, value) in zip(device, before, strict=True):
        assert torch.equal(cache.key[5], key) and torch.equal(cache.value[5], value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_compressed_block_comes_back_as_exactly_its_dequantized_int8_codes(dtype):
    spec = kv_cache_spec(2, 2, 16, "auto", dtype, 16)
    device, host = filled_caches(spec, 6), allocate_kv_caches(replace(spec, dtype="int8"), 3, CPU)
    before = [(c.key[2].clone(), c.value[2].clone()) for c in device]
    apply_host_transfers(device, host, to_host=[(2, 1), (4, 0)], from_host=[])
    apply_host_transfers(device, host, to_host=[], from_host=[(5, 1)])
    for cache, hcache, original in zip(device, host, before, strict=True):
        for stored, back, host_rows, host_scale in (
            (original[0], cache.key[5], hcache.key[1], hcache.key_scale[1]),
            (original[1], cache.value[5], hcache.value[1], hcache.value_scale[1]),
        ):
            codes, scale = quant.quantize(stored, "int8")
            assert torch.equal(host_rows, codes) and torch.equal(host_scale, scale)
            assert torch.equal(back, quant.dequantize(codes, scale, "int8", back.dtype))
            assert (back.float() - stored.float()).abs().max() <= scale.max() * 0.51 + 0.02
    assert not torch.equal(device[0].key[0], device[0].key[5])  # blocks elsewhere untouched


def test_the_compressed_host_tier_holds_3_6x_the_blocks_of_a_float32_cache():
    base = sizing.KVCacheSizing(SPEC, num_blocks=12, max_model_len=192)
    cuda = torch.device("cuda")  # (sized only: nothing is allocated)
    plain = sizing.size_host_tier(base, 1.0, cuda, HOST, "none")
    int8 = sizing.size_host_tier(base, 1.0, cuda, HOST, "int8")
    # float32: 2 layers x 16 tokens x 2 heads x (K, V) x 16 dims x 4 bytes = 8,192 bytes a
    # block; int8: the same rows in 1 byte + a 4-byte scale per token and head = 2,560 bytes.
    assert plain.num_host_blocks == GIB // 8192 == 131072 and plain.host_dtype == "float32"
    assert int8.num_host_blocks == GIB // 2560 == 419430 and int8.host_dtype == "int8"
    assert int8.summary().endswith(
        "host tier: 419,430 blocks = 6,710,880 tokens (1024.0 MiB, int8)"
    )
    # On a CPU int8 is the default; a quantized cache is stored as it is.
    assert sizing.host_tier_dtype("float32", None, CPU) == "int8"
    assert sizing.host_tier_dtype("float32", None, cuda) == "float32"
    assert sizing.host_tier_dtype("fp8_e4m3", "int8", CPU) == "fp8_e4m3"
