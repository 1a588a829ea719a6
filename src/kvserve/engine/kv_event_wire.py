"""The wire format of KV events: what vLLM's subscribers (KV-aware routers) decode.

Matches vLLM 0.32's ``KVEventBatch`` (``vllm/distributed/kv_events.py``), the format since vLLM
pull request #42892, where each event became a msgpack *map* tagged ``"type"``; before it each
event was a tagged array, which vLLM 0.32's decoder rejects ("Expected object, got array at
$[1][0]").  A payload is an array (msgspec ``array_like``) holding the events as maps:

    [ts,
     [{"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | null,
       "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
       "lora_name": null, "extra_keys": [null, ...], "group_idx": 0,
       "kv_cache_spec_kind": "full_attention"},
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU", "group_idx": 0},
      {"type": "AllBlocksCleared"}],
     data_parallel_rank]

`medium` is the tier (kv/events.py): "GPU" for the KV cache (on every platform, as vLLM's block
pool sends it), "CPU" for the host tier, "DISK" for a tier on disk.

A block hash is an unsigned integer, as vLLM sends by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
the low 64 bits of the block key.  ``extra_keys`` holds one null per block: kvserve has no LoRA
or multimodal keys and never publishes a cache salt (vLLM puts it in a block's entry).  Blocks
keyed under a cache salt go out with empty ``token_ids`` unless ``publish_salted_token_ids``:
subscribers learn that a tenant cached blocks and their hashes, not what they hold.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.kv import events as kv

GROUP_IDX = 0  # kvserve's one KV cache group
SPEC_KIND = "full_attention"  # what vLLM names that group's kind


# The wire structs, in vLLM 0.32's field order and struct options.  vLLM declares more fields
# after these (kv_cache_spec_sliding_window, locality, session_id...), all defaulting to None:
# with omit_defaults they would not be sent, so they are left out.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events: a map whose "type" is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(key: bytes) -> int:
    """A block key as vLLM's events carry a hash by default: its low 64 bits, unsigned
    (vLLM's ``int.from_bytes(hash, "big") & (2**64 - 1)``)."""
    return int.from_bytes(key[-8:], "big")


def to_wire(event: kv.KVEvent, publish_salted_token_ids: bool) -> KVCacheEvent:
    """One event as vLLM sends it; a salted BlockStored without its token ids unless asked."""
    if isinstance(event, kv.BlockStored):
        parent = event.parent_block_hash
        keep_tokens = publish_salted_token_ids or not event.salted
        return BlockStored(
            block_hashes=[external_hash(k) for k in event.block_hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=event.token_ids if keep_tokens else [],
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
            extra_keys=[None] * len(event.block_hashes),
            group_idx=GROUP_IDX,
            kv_cache_spec_kind=SPEC_KIND,
        )
    if isinstance(event, kv.BlockRemoved):
        hashes = [external_hash(k) for k in event.block_hashes]
        return BlockRemoved(hashes, event.medium, GROUP_IDX)
    return AllBlocksCleared()
