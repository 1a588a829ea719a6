"""KV cache events on a ZMQ PUB socket, encoded as vLLM encodes them, so that vLLM's own
subscribers (KV-aware routers) read kvserve's events unchanged.

Wire format (vLLM's ``vllm/distributed/kv_events.py``): each message is three frames

    [topic, sequence number (8-byte big-endian), msgpack payload]

and the payload is an ``array_like`` msgspec Struct: ``[ts, [events...], data_parallel_rank]``.
Each event is an array whose first element is its tag, the class name:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A block hash is an integer: the first 8 bytes (big-endian, unsigned) of kvserve's SHA-256
block key.  The engine thread only puts a batch on a queue (never blocks: a full queue drops
the batch and counts it); a thread of its own encodes and sends, and answers replay requests
on the optional ROUTER socket ([identity, b"", start sequence] -> every buffered
[identity, b"", sequence, payload] from there, then the sequence -1 with an empty payload).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from kvserve.config import KVEventsConfig
from kvserve.errors import ParameterError
from kvserve.kv import events as kv

logger = logging.getLogger("kvserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(key: bytes) -> int:
    """A block key as the integer vLLM's events carry."""
    return int.from_bytes(key[:8], "big")


def to_wire(event: kv.KVEvent, medium: str) -> KVCacheEvent:
    if isinstance(event, kv.BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=[external_hash(k) for k in event.block_hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=None,
            medium=medium,
        )
    if isinstance(event, kv.BlockRemoved):
        return BlockRemoved([external_hash(k) for k in event.block_hashes], medium)
    return AllBlocksCleared()


class ZmqEventPublisher:
    """Publishes batches of KV events from a background thread."""

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        """Binds (or connects) the sockets now, so that a bad endpoint fails at start-up
        (ParameterError naming --kv-events-config); only the publisher thread uses them."""
        self.medium = medium
        self.num_dropped = 0
        self._queue: queue.Queue[tuple[float, list[kv.KVEvent]] | None]
        self._queue = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            self._replay = None
            if config.replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ParameterError("--kv-events-config", f"cannot open the endpoint: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r)", config.endpoint, config.topic)

    def publish(self, events: list[kv.KVEvent]) -> None:
        """Queue one batch (engine thread; never blocks)."""
        try:
            self._queue.put_nowait((time.time(), events))  # encoded on the publisher thread
        except queue.Full:
            self.num_dropped += 1

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        sequence = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(sequence)
            ts, events = batch
            wire = EventBatch(ts, [to_wire(e, self.medium) for e in events], 0)
            payload = encoder.encode(wire)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV events: sending batch %d failed", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
