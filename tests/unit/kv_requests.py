"""Requests for tests that drive a KVCacheManager directly, without a scheduler."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv.cache_manager import KVCacheManager
from kvserve.request import Request, SamplingParams


def make_request(
    cm: KVCacheManager, request_id: str, token_ids: Sequence[int], cache_salt: str | None = None
) -> Request:
    """A request whose prompt is `token_ids`, its block hashes made by `cm`'s block hasher
    with `cache_salt` (what Scheduler.add_request does)."""
    request = Request(request_id, list(token_ids), SamplingParams(), cache_salt=cache_salt)
    request.hash_blocks_with(cm.block_hasher)
    return request
