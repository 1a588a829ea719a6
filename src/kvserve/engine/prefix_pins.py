"""The engine's side of pinned prefixes (the operator's /v1/prefix_cache routes): the cap
checked before a prefix is computed, the pin taken once its blocks are cached, the listing.

The blocks themselves are held by the cache manager (kv/pins.py); this module turns its
errors into ParameterErrors that name the request field or the flag, as the server answers
them, and runs on the engine thread like every other engine command.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.errors import ParameterError
from kvserve.kv.block_hasher import BlockHashes
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.pins import Pin, PinLimitError

__all__ = ["Pin", "PinnedPrefixes", "PrefixPinning"]  # Pin: the server reads it through here

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class PinnedPrefixes:
    """GET /v1/prefix_cache/pins: the pins and what they hold."""

    pins: list[Pin]
    num_pinned_blocks: int
    max_pinned_blocks: int
    bytes_per_block: int


class PrefixPinning:
    def __init__(self, cache_manager: KVCacheManager, fraction: float, bytes_per_block: int):
        """`fraction`: --max-pinned-prefix-fraction, named in the cap's error."""
        self.cache_manager = cache_manager
        self.fraction = fraction
        self.bytes_per_block = bytes_per_block

    def check_room(self, token_ids: list[int], cache_salt: str | None) -> None:
        """ParameterError naming --max-pinned-prefix-fraction when pinning these tokens' full
        blocks would pass the cap (checked before the prefix is computed)."""
        cm = self.cache_manager
        try:
            keys = cm.pinnable_keys(self._hashes(token_ids, cache_salt))
        except ValueError as exc:  # caching off, or KV cache groups
            raise ParameterError("prompt", f"cannot be pinned: {exc}") from None
        try:
            cm.pins.check_room(keys)
        except PinLimitError as exc:
            raise self._limit_error(exc) from None

    def try_pin(self, pin_id: str, token_ids: list[int], cache_salt: str | None) -> Pin | None:
        """Pin the full blocks of `token_ids` (kv/pins.py); None when they are not all cached
        (run the prompt, then try again).  ParameterError past the cap or for an id in use."""
        if self.cache_manager.pins.get(pin_id) is not None:
            raise ParameterError("id", f"{pin_id!r} is already in use by a pinned prefix")
        try:
            hashes = self._hashes(token_ids, cache_salt)
            pin = self.cache_manager.try_pin_prefix(pin_id, hashes)
        except PinLimitError as exc:
            raise self._limit_error(exc) from None
        if pin is not None:
            logger.info("pinned prefix %s: %d tokens", pin_id, pin.num_tokens)
        return pin

    def _hashes(self, token_ids: list[int], cache_salt: str | None) -> BlockHashes:
        """The prefix's block hashes, its salt read once here as a request's is."""
        hashes = self.cache_manager.block_hasher.for_request(cache_salt)
        hashes.extend(token_ids)
        return hashes

    def unpin(self, pin_id: str) -> Pin | None:
        """Release a pin (its blocks stay cached, now evictable); None when unknown."""
        return self.cache_manager.pins.unpin(pin_id)

    def listing(self) -> PinnedPrefixes:
        """Every pin, the distinct blocks they hold, the cap and the bytes of one block."""
        pins = self.cache_manager.pins
        return PinnedPrefixes(pins.list_pins(), pins.num_pinned_blocks, pins.max_blocks,
                              self.bytes_per_block)  # fmt: skip

    def _limit_error(self, exc: PinLimitError) -> ParameterError:
        pins = self.cache_manager.pins
        return ParameterError(
            "--max-pinned-prefix-fraction",
            f"({self.fraction}) caps pinned prefixes at {pins.max_blocks} blocks: this one "
            f"needs {exc.num_new} more, {pins.num_pinned_blocks} are pinned; unpin a prefix or "
            "raise the flag",
        )
