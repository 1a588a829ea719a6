"""The host tier's copies (--kv-offloading-size): the tensor side of kv/host_tier.py.

The scheduler's output lists (device block, host slot) pairs; the runner copies every
offload (device -> host) and then every load (host -> device) before the step's copy-on-write
copies and forward pass: a device block evicted and reused as a load's destination in the same
step is saved before it is overwritten.  The same code runs on a CPU, where the host tier is
just another CPU tensor, and on CUDA, where it is pinned memory.

A compressed tier (--kv-offloading-compression int8: the host caches are int8 while the
device's hold full-precision rows) quantizes each offloaded block's rows as the int8 KV cache
does (LayerKVCache.write: kv_quant.py's codes, through the native library on a CPU) and
dequantizes a loaded block's rows into the device block: a block comes back as exactly the
dequantized codes that were stored.
"""

from __future__ import annotations

import torch

from kvserve.attention.kv_cache import LayerKVCache


def apply_host_transfers(
    device_caches: list[LayerKVCache],
    host_caches: list[LayerKVCache] | None,
    to_host: list[tuple[int, int]],
    from_host: list[tuple[int, int]],
) -> None:
    """Make one step's offloads, then its loads; each pair is (device block, host slot).  Each
    distinct cache once (layers of KV cache groups share theirs)."""
    if not (to_host or from_host):
        return
    if host_caches is None:
        raise RuntimeError("the scheduler asked for host-tier copies but the runner has no tier")
    pairs = list({id(d): (d, h) for d, h in zip(device_caches, host_caches, strict=True)}.values())
    if to_host:
        blocks, slots = _ids(to_host)
        for device, host in pairs:
            if host.kv_dtype == device.kv_dtype:
                device.copy_blocks_to(host, blocks, slots)
            else:
                _copy_converting(device, host, blocks, slots)
    if from_host:
        blocks, slots = _ids(from_host)
        for device, host in pairs:
            if host.kv_dtype == device.kv_dtype:
                host.copy_blocks_to(device, slots, blocks)
            else:
                _copy_converting(host, device, slots, blocks)


def _copy_converting(
    src: LayerKVCache, dst: LayerKVCache, src_blocks: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """Whole blocks src[src_blocks[i]] -> dst[dst_blocks[i]] between caches of two dtypes
    (one of them full precision): the rows are read as values and written as `dst` writes a
    step's K/V, quantizing (offload to a compressed tier) or not (a load from it)."""
    block_size = src.key.shape[1]
    out_dtype = dst.key.dtype if not dst.quantized else torch.float32
    key, value = src.gather(src_blocks.to(src.key.device), out_dtype)
    slots = _token_slots(dst_blocks, block_size).to(dst.key.device)
    dst.write(slots, key.to(dst.key.device), value.to(dst.key.device))


def _token_slots(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Every token slot of these blocks, block by block: [n] -> [n * block_size]."""
    offsets = torch.arange(block_size, dtype=torch.long)
    return (block_ids[:, None] * block_size + offsets).reshape(-1)


def _ids(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device block ids, host slot ids) as CPU long tensors; copy_blocks_to moves each to the
    device of the tensor it indexes."""
    blocks, slots = torch.tensor(pairs, dtype=torch.long).unbind(1)
    return blocks, slots
