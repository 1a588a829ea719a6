"""The host tier's copies (--kv-offloading-size): the tensor side of kv/host_tier.py.

The scheduler's output lists (device block, host slot) pairs; the runner copies every
offload (device -> host) and then every load (host -> device) before the step's copy-on-write
copies and forward pass: a device block evicted and reused as a load's destination in the same
step is saved before it is overwritten.  The same code runs on a CPU, where the host tier is
just another CPU tensor, and on CUDA, where it is pinned memory.
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
            device.copy_blocks_to(host, blocks, slots)
    if from_host:
        blocks, slots = _ids(from_host)
        for device, host in pairs:
            host.copy_blocks_to(device, slots, blocks)


def _ids(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(device block ids, host slot ids) as CPU long tensors; copy_blocks_to moves each to the
    device of the tensor it indexes."""
    blocks, slots = torch.tensor(pairs, dtype=torch.long).unbind(1)
    return blocks, slots
