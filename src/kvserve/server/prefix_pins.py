"""The operator's pinned prefixes: POST /v1/prefix_cache/pin, POST /v1/prefix_cache/unpin,
GET /v1/prefix_cache/pins (behind the API key like every /v1 route).

Pinning a prefix that is not cached yet computes it first: it runs as a prompt with
max_tokens 1 (at the highest retention priority, so that it is the last thing evicted before
the pin takes it), then the engine holds its full blocks (kv/pins.py).  Should other traffic
evict them in between, it runs again, at most PIN_ATTEMPTS times.
"""

from __future__ import annotations

import uuid

from kvserve.config import MAX_RETENTION_PRIORITY
from kvserve.engine.prefix_pins import Pin, PinnedPrefixes
from kvserve.errors import ParameterError
from kvserve.request import RequestOutputKind, SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import PinInfo, PinList, PinRequest, UnpinRequest
from kvserve.server.serving import ServingContext
from kvserve.server.serving_chat import chat_token_ids

PIN_ATTEMPTS = 3
_COMPUTE = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)


def _info(pin: Pin, bytes_per_block: int) -> PinInfo:
    num_blocks = len(pin.block_ids)
    return PinInfo(id=pin.pin_id, num_tokens=pin.num_tokens, num_blocks=num_blocks,
                   bytes=num_blocks * bytes_per_block)  # fmt: skip


async def _token_ids(ctx: ServingContext, body: PinRequest) -> list[int]:
    """The prefix's tokens: the text tokenized, the ids checked, or the messages templated
    as the chat endpoint does."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        return await chat_token_ids(ctx, body.messages)
    if isinstance(body.prompt, str):
        ctx.check_text(len(body.prompt), "prompt")
        return await ctx.tokenizers.encode(body.prompt)
    ctx.check_token_ids(body.prompt, "prompt")
    return list(body.prompt)


async def pin_prefix(ctx: ServingContext, body: PinRequest) -> PinInfo:
    """Compute the prefix if it is not cached, then pin it (400 past the cap, naming it)."""
    ctx.check_model(body.model)
    token_ids = await _token_ids(ctx, body)
    block_size = ctx.async_llm.engine.cache_manager.block_size
    if len(token_ids) < block_size:
        raise APIError(
            f"the prefix has {len(token_ids)} tokens; pinning holds whole blocks of "
            f"{block_size} tokens",
            "prompt" if body.messages is None else "messages",
        )
    ctx.check_fits(len(token_ids), 1, "prompt", "max_tokens")
    pin_id = body.id or f"pin-{uuid.uuid4().hex[:16]}"
    salt = body.cache_salt
    llm = ctx.async_llm
    try:
        await llm.call(lambda engine: engine.pins.check_room(token_ids, salt))
        for attempt in range(PIN_ATTEMPTS):
            pin = await llm.call(lambda engine: engine.pins.try_pin(pin_id, token_ids, salt))
            if pin is not None:
                listing: PinnedPrefixes = await llm.call(lambda engine: engine.pins.listing())
                return _info(pin, listing.bytes_per_block)
            await _compute(ctx, f"{pin_id}-compute-{attempt}", token_ids, salt)
    except ParameterError as exc:  # past the cap, an id in use, a cache that cannot pin
        raise APIError(str(exc), exc.param) from None
    raise APIError("the prefix was evicted each time before it could be pinned; try again",
                   status=503)  # fmt: skip


async def _compute(
    ctx: ServingContext, request_id: str, token_ids: list[int], salt: str | None
) -> None:
    """Run the prefix as a prompt (one token of output) so that its blocks are cached."""
    stream = await ctx.async_llm.add_request(
        request_id, token_ids, _COMPUTE, cache_salt=salt,
        kv_retention_priority=MAX_RETENTION_PRIORITY,
    )  # fmt: skip
    async with stream:
        async for _ in stream:
            pass


async def unpin_prefix(ctx: ServingContext, body: UnpinRequest) -> PinInfo:
    listing: PinnedPrefixes = await ctx.async_llm.call(lambda engine: engine.pins.listing())
    pin = await ctx.async_llm.call(lambda engine: engine.pins.unpin(body.id))
    if pin is None:
        raise APIError(f"no pinned prefix has id {body.id!r}", "id", status=404)
    return _info(pin, listing.bytes_per_block)


async def list_pins(ctx: ServingContext) -> PinList:
    listing: PinnedPrefixes = await ctx.async_llm.call(lambda engine: engine.pins.listing())
    return PinList(
        data=[_info(pin, listing.bytes_per_block) for pin in listing.pins],
        num_pinned_blocks=listing.num_pinned_blocks,
        max_pinned_blocks=listing.max_pinned_blocks,
    )
