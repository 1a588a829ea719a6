"""KV cache events on a ZMQ PUB socket, encoded as vLLM 0.32 encodes them
(engine/kv_event_wire.py), so that vLLM's subscribers read kvserve's events unchanged.

Each message is three frames, as vLLM sends them:

    [topic, sequence number (8-byte big-endian), msgpack payload]

The engine thread numbers each batch and puts it on a queue; it never blocks: a full queue
drops the batch, counts it (``num_dropped``) and leaves a gap in the sequence numbers that
subscribers see.  A thread of its own encodes and sends, keeps what it sent for replay when
there is a replay socket (at most ``buffer_steps`` batches and ``buffer_max_bytes``), and answers
replay requests on the ROUTER socket as vLLM does: [identity, b"", start sequence] -> the kept
[identity, b"", sequence, payload] from there, at most ``replay_max_batches`` (a subscriber still
behind asks again), then the sequence -1 with an empty payload.

A snapshot request, [identity, b"", b"snapshot"] on the same socket (the request of vLLM pull
request #50134, not in a vLLM release yet), gets the whole index the events describe
(kv/event_index.py: every tier's blocks) as payloads of the same format, each framed with the
*resume sequence* R, then the end marker:

    [identity, b"", R, payload]...  [identity, b"", -1, b""]

The first payload starts with AllBlocksCleared.  A subscriber that starts late (or lost batches
that replay no longer holds) applies the snapshot, then every batch numbered R or more (replay
from R, then the live stream).  A snapshot comes in at most ``replay_max_batches`` payloads of
at least SNAPSHOT_BLOCKS_PER_BATCH blocks each.  vLLM defines no heartbeat: none is sent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace
from itertools import islice

import msgspec
import zmq

from kvserve.config import KVEventsConfig
from kvserve.engine.kv_event_wire import EventBatch, to_wire
from kvserve.errors import ParameterError
from kvserve.kv import events as kv
from kvserve.kv.event_index import CacheIndex

logger = logging.getLogger("kvserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def end_of_replay(client: bytes) -> tuple[bytes, ...]:
    """The frames that end an answer on the replay socket.  vLLM 0.32 frames a replayed batch
    as the live ones (topic, sequence, payload) after the client's envelope, and the end as an
    empty topic, the sequence -1 and an empty payload: its subscribers read both that way."""
    return (client, b"", b"", END_SEQ, b"")


MAX_REPLAY_REQUEST_BYTES = 64  # a request's frames: b"" and an 8-byte sequence number
SNAPSHOT_REQUEST = b"snapshot"
SNAPSHOT_BLOCKS_PER_BATCH = 1024  # ~16k tokens, ~70 KB of msgpack a payload


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

    def __init__(self, config: KVEventsConfig, index: CacheIndex | None = None) -> None:
        """Binds (or connects) the sockets now, so that a bad endpoint fails at start-up
        (ParameterError naming --kv-events-config); only the publisher thread uses them.
        `index`: what the events describe, for snapshots (None: a snapshot is empty)."""
        self.index = index
        self._publish_salted = config.publish_salted_token_ids
        self._replay_max_batches = config.replay_max_batches
        self._next_seq = 0  # drawn on the engine thread: a dropped batch leaves a gap
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
        seq = self._next_seq
        self._next_seq = seq + 1
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
        payload = self._encode(encoder, ts, events)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self._num_send_failed += 1
            logger.exception("KV events: sending batch %d failed", seq)
        if self._buffer is not None:
            self._buffer.add(seq, payload)

    def _encode(self, encoder: msgspec.msgpack.Encoder, ts: float, events: list) -> bytes:
        wire = [to_wire(e, self._publish_salted) for e in events]
        return encoder.encode(EventBatch(ts, wire, 0))

    def _serve_snapshot(self, client: bytes) -> None:
        """The whole index, framed with the sequence number to resume from (read before the
        index is copied: every batch before it is in the copy, kv/event_index.py)."""
        resume = self._next_seq.to_bytes(8, "big")
        events = self.index.snapshot() if self.index is not None else []
        encoder, ts = msgspec.msgpack.Encoder(), time.time()
        for batch in snapshot_batches(events, self._replay_max_batches):
            payload = self._encode(encoder, ts, batch)
            self._replay.send_multipart((client, b"", self._topic, resume, payload))

    def _serve_replay(self) -> None:
        """Answer one replay request; a socket error is logged, never the end of the thread."""
        assert self._replay is not None and self._buffer is not None
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV events: ignoring a replay request of %d frames", len(frames))
                return
            client, _, start = frames
            if start == SNAPSHOT_REQUEST:
                self._serve_snapshot(client)
                self._replay.send_multipart(end_of_replay(client))
                return
            kept = self._buffer.since(int.from_bytes(start, "big"), self._replay_max_batches)
            for seq, payload in kept:
                answer = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(answer)
            self._replay.send_multipart(end_of_replay(client))
        except zmq.ZMQError:
            logger.exception("KV events: answering a replay request failed")


def snapshot_batches(events: list[kv.KVEvent], max_batches: int) -> list[list[kv.KVEvent]]:
    """`events` in batches of at most max(SNAPSHOT_BLOCKS_PER_BATCH, blocks / max_batches)
    blocks each (a long run is split, its second part naming the first's last block as
    parent), so that a snapshot is at most `max_batches` payloads."""
    num_blocks = sum(len(e.block_hashes) for e in events if isinstance(e, kv.BlockStored))
    limit = max(SNAPSHOT_BLOCKS_PER_BATCH, -(-num_blocks // max(1, max_batches)))
    batches: list[list[kv.KVEvent]] = [[]]
    room = limit
    for event in events:
        while isinstance(event, kv.BlockStored) and len(event.block_hashes) > room:
            if room:
                head, event = split_run(event, room)
                batches[-1].append(head)
            batches.append([])
            room = limit
        batches[-1].append(event)
        room -= len(event.block_hashes) if isinstance(event, kv.BlockStored) else 0
    return batches


def split_run(event: kv.BlockStored, num_blocks: int) -> tuple[kv.BlockStored, kv.BlockStored]:
    """A run's first `num_blocks` blocks, and the rest (their parent its first part's last)."""
    hashes, tokens = event.block_hashes, event.token_ids
    num_tokens = num_blocks * event.block_size if tokens else 0
    head = replace(event, block_hashes=hashes[:num_blocks], token_ids=tokens[:num_tokens])
    tail = replace(event, block_hashes=hashes[num_blocks:], token_ids=tokens[num_tokens:],
                   parent_block_hash=hashes[num_blocks - 1])  # fmt: skip
    return head, tail


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
