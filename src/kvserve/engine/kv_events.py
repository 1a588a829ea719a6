"""KV cache events on a ZMQ PUB socket, in the wire format of vLLM's ``KVEventBatch``, so that
subscribers written against vLLM (KV-aware routers) decode kvserve's events unchanged.

Wire version: vLLM 0.32's ``vllm/distributed/kv_events.py``, the format since vLLM pull request
#42892, where each event became a msgpack *map* tagged ``"type"`` (before it, each event was a
tagged array, which vLLM 0.32's decoder rejects: "Expected object, got array at $[1][0]").
Each message is three frames

    [topic, sequence number (8-byte big-endian), msgpack payload]

and the payload an array (msgspec ``array_like``) holding the events as maps:

    [ts,
     [{"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | null,
       "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
       "lora_name": null, "extra_keys": [null, ...], "group_idx": 0,
       "kv_cache_spec_kind": "full_attention"},
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU", "group_idx": 0},
      {"type": "AllBlocksCleared"}],
     data_parallel_rank]

A block hash is an unsigned integer, as vLLM sends by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
the low 64 bits of the block key.  ``extra_keys`` holds one null per block: kvserve has no LoRA
or multimodal keys and never publishes a cache salt (vLLM puts it in a block's entry).  Blocks
keyed under a cache salt are announced with empty ``token_ids`` unless
``publish_salted_token_ids``: subscribers learn that a tenant cached blocks, not what they hold.

The engine thread numbers each batch and puts it on a queue; it never blocks: a full queue
drops the batch, counts it (``num_dropped``) and leaves a gap in the sequence numbers that
subscribers see.  A thread of its own encodes and sends, keeps what it sent for replay when
there is a replay socket (at most ``buffer_steps`` batches and ``buffer_max_bytes``), and answers
replay requests on the ROUTER socket as vLLM does: [identity, b"", start sequence] -> the kept
[identity, b"", sequence, payload] from there, at most ``replay_max_batches`` (a subscriber still
behind asks again), then the sequence -1 with an empty payload.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count, islice
from typing import Any

import msgspec
import zmq

from kvserve.config import KVEventsConfig
from kvserve.errors import ParameterError
from kvserve.kv import events as kv

logger = logging.getLogger("kvserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REPLAY_REQUEST_BYTES = 64  # a request's frames: b"" and an 8-byte sequence number
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


def to_wire(event: kv.KVEvent, medium: str, publish_salted_token_ids: bool) -> KVCacheEvent:
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
            medium=medium,
            lora_name=None,
            extra_keys=[None] * len(event.block_hashes),
            group_idx=GROUP_IDX,
            kv_cache_spec_kind=SPEC_KIND,
        )
    if isinstance(event, kv.BlockRemoved):
        return BlockRemoved([external_hash(k) for k in event.block_hashes], medium, GROUP_IDX)
    return AllBlocksCleared()


class ReplayBuffer:
    """The latest encoded batches, for replay: at most `max_batches` of them and `max_bytes` of
    payload together; the oldest go first (a batch alone over `max_bytes` is not kept)."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._batches: deque[tuple[int, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, seq: int, payload: bytes) -> None:
        """Keep batch `seq` (sequence numbers only grow), dropping the oldest over the bounds."""
        self._batches.append((seq, payload))
        self.num_bytes += len(payload)
        while self._batches and (
            len(self._batches) > self.max_batches or self.num_bytes > self.max_bytes
        ):
            self.num_bytes -= len(self._batches.popleft()[1])

    def since(self, first: int, limit: int) -> list[tuple[int, bytes]]:
        """At most `limit` kept batches numbered `first` or more, oldest first."""
        return list(islice(((s, p) for s, p in self._batches if s >= first), limit))

    def check_invariants(self) -> None:
        seqs = [s for s, _ in self._batches]
        assert seqs == sorted(set(seqs)), "sequence numbers grow"
        assert self.num_bytes == sum(len(p) for _, p in self._batches) <= self.max_bytes
        assert len(self._batches) <= self.max_batches


class ZmqEventPublisher:
    """Publishes batches of KV events from a background thread (started by `start`)."""

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        """Binds (or connects) the sockets now, so that a bad endpoint fails at start-up
        (ParameterError naming --kv-events-config); only the publisher thread uses them."""
        self.medium = medium
        self._publish_salted = config.publish_salted_token_ids
        self._replay_max_batches = config.replay_max_batches
        self._sequence = count()  # drawn on the engine thread: a dropped batch leaves a gap
        self._num_queue_full = 0  # engine thread
        self._num_send_failed = 0  # publisher thread
        self._queue: queue.Queue[tuple[int, float, list[kv.KVEvent]] | None]
        self._queue = queue.Queue(config.max_queue_size)
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        try:
            self._pub, self.endpoint = self._open_pub(config)
            self._replay = self._open_replay(config)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ParameterError("--kv-events-config", f"cannot open the endpoint: {exc}") from None
        self._buffer = None
        if self._replay is not None:
            self._buffer = ReplayBuffer(config.buffer_steps, config.buffer_max_bytes)
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)

    @property
    def num_dropped(self) -> int:
        """Batches never sent: the queue was full, or the socket refused them."""
        return self._num_queue_full + self._num_send_failed

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: list[kv.KVEvent]) -> None:
        """Queue one batch (engine thread; never blocks)."""
        seq = next(self._sequence)
        try:
            self._queue.put_nowait((seq, time.time(), events))  # encoded on the publisher thread
        except queue.Full:
            self._num_queue_full += 1
            if self._num_queue_full == 1:
                logger.warning(
                    "KV events: the queue is full (max_queue_size %d): dropping batches, "
                    "counted in kvserve:kv_events_dropped_batches_total",
                    self._queue.maxsize,
                )

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        self._context.destroy(linger=0)

    def _open_pub(self, config: KVEventsConfig) -> tuple[zmq.Socket, str]:
        """The PUB socket and the endpoint it publishes on (as bound: a wildcard port named)."""
        pub = self._context.socket(zmq.PUB)
        pub.set_hwm(config.hwm)
        if not binds(config.endpoint):
            pub.connect(config.endpoint)
            logger.info("KV events: publishing to %s (topic %r)", config.endpoint, config.topic)
            return pub, config.endpoint
        pub.bind(config.endpoint)
        endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        logger.info("KV events: publishing on %s (topic %r)", endpoint, config.topic)
        if on_every_interface(config.endpoint):
            logger.info("KV events: %s accepts subscribers on every interface", endpoint)
        return pub, endpoint

    def _open_replay(self, config: KVEventsConfig) -> zmq.Socket | None:
        """The ROUTER socket of replay requests; it drops a peer that sends more than a request
        and queues at most one answer per peer (a peer that does not read loses the rest)."""
        if not config.replay_endpoint:
            return None
        replay = self._context.socket(zmq.ROUTER)
        replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
        replay.set_hwm(config.replay_max_batches + 1)
        replay.bind(config.replay_endpoint)
        return replay

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            self._send(encoder, *batch)

    def _send(self, encoder: msgspec.msgpack.Encoder, seq: int, ts: float, events: list) -> None:
        wire = [to_wire(e, self.medium, self._publish_salted) for e in events]
        payload = encoder.encode(EventBatch(ts, wire, 0))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self._num_send_failed += 1
            logger.exception("KV events: sending batch %d failed", seq)
        if self._buffer is not None:
            self._buffer.add(seq, payload)

    def _serve_replay(self) -> None:
        assert self._replay is not None and self._buffer is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        kept = self._buffer.since(int.from_bytes(start, "big"), self._replay_max_batches)
        for seq, payload in kept:
            self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def binds(endpoint: str) -> bool:
    """vLLM's rule (bind a wildcard, ipc or inproc address; connect to any other), plus the
    loopback and 0.0.0.0 addresses, which kvserve binds too: the default endpoint is this host
    only, and vLLM's rule would connect to it."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = _tcp_host(endpoint)
    return host in ("localhost", "0.0.0.0") or host.startswith("127.")


def on_every_interface(endpoint: str) -> bool:
    """Whether a bound endpoint accepts subscribers from other hosts (a wildcard host)."""
    return _tcp_host(endpoint) in ("*", "0.0.0.0", "[::]", "[*]")


def _tcp_host(endpoint: str) -> str:
    """The host of a tcp:// endpoint ("" for another transport)."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint.removeprefix("tcp://").rpartition(":")[0]
