"""A router's view of the KV events: a subscriber that starts after blocks were cached asks
the replay socket for a snapshot, rebuilds the index of every tier from it, then follows the
live events (host-tier stores and removals with medium CPU among them) and ends with exactly
the cache manager's own index.  The wire is decoded with vLLM's event classes
(test_kv_events_publisher.py); the cache manager runs without an engine."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from kv_requests import make_request
from test_kv_events_publisher import (
    DECODER,
    AllBlocksCleared,
    BlockStored,
    ipc_config,
    subscribe,
)

from kvserve.engine.kv_event_wire import external_hash
from kvserve.engine.kv_events import END_SEQ, ZmqEventPublisher, snapshot_batches
from kvserve.kv import events
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.event_index import CacheIndex, IndexEntry

BLOCK = 4


class Router:
    """What a KV-aware router keeps: medium -> block hash -> (parent, token ids)."""

    def __init__(self) -> None:
        self.media: dict[str, dict[int, tuple[int | None, list[int]]]] = {}
        self.next_seq: int | None = None  # the batch to apply next

    def apply(self, payload: bytes) -> None:
        for event in DECODER.decode(payload).events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
            elif isinstance(event, BlockStored):
                held = self.media.setdefault(event.medium, {})
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    held[block_hash] = (parent, event.token_ids[i * BLOCK : (i + 1) * BLOCK])
                    parent = block_hash
            else:
                for block_hash in event.block_hashes:
                    self.media.get(event.medium, {}).pop(block_hash, None)

    def hashes(self) -> dict[str, set[int]]:
        return {medium: set(held) for medium, held in self.media.items() if held}


def ask(context: zmq.Context, endpoint: str, request: bytes) -> list[tuple[int, bytes]]:
    """(sequence, payload) of every answer to one request on the replay socket, up to the end
    marker (left out)."""
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", request])
        answers = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return answers
            answers.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def follow(router: Router, sub: zmq.Socket, context: zmq.Context, replay: str, last: int) -> None:
    """Apply live batches in sequence order up to batch `last`; a batch missed (before the
    SUB joined, or a gap) is fetched from the replay socket, as a router does."""
    deadline = time.monotonic() + 10
    while router.next_seq <= last:
        assert time.monotonic() < deadline, f"batch {router.next_seq} never came"
        if sub.poll(100):
            _, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < router.next_seq:
                continue  # the snapshot holds it already
            if seq == router.next_seq:
                router.apply(payload)
                router.next_seq += 1
                continue
        for seq, payload in ask(context, replay, router.next_seq.to_bytes(8, "big")):
            if seq == router.next_seq:
                router.apply(payload)
                router.next_seq += 1


def truth(cm: KVCacheManager) -> dict[str, set[int]]:
    """The cache manager's own index: what the device pool and the host tier hold."""
    media = {"GPU": {external_hash(k) for k in cm.pool.cached_keys}}
    assert cm.host is not None
    media["CPU"] = {external_hash(k) for k in cm.host.keys}
    return {medium: held for medium, held in media.items() if held}


def run(cm: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Admit a request as the scheduler does, compute all its tokens, free it."""
    request = make_request(cm, request_id, tokens)
    cached = cm.find_cached_prefix(request)
    new = cm.allocate_slots(request_id, cached.num_tokens, len(tokens) - cached.num_tokens, cached)
    assert new is not None
    cm.take_host_transfers()
    cm.cache_full_blocks(request, len(tokens))
    cm.free(request_id)
    cm.check_invariants()


@pytest.fixture
def context():
    yield (ctx := zmq.Context())
    ctx.destroy(linger=0)


def test_a_late_subscriber_rebuilds_every_tier_from_a_snapshot_then_follows(tmp_path, context):
    config = ipc_config(tmp_path)
    index = CacheIndex(BLOCK, threading.Lock())
    cm = KVCacheManager(6, BLOCK, enable_events=True, num_host_blocks=3, event_index=index)
    publisher = ZmqEventPublisher(config, index)
    publisher.start()

    def step() -> int:
        """The engine's after_step: this step's events as one batch; its sequence number."""
        publisher.publish(cm.take_events())
        return publisher._next_seq - 1

    try:
        a, b, c = (list(range(n * 100, n * 100 + 13)) for n in (1, 2, 3))  # 3 blocks + 1 each
        run(cm, "a", a)
        step()
        run(cm, "b", b)  # b's blocks evict a's last one to the host (a CPU store)
        step()
        a_keys = make_request(cm, "a", a).block_hashes.keys
        assert cm.host.keys == [a_keys[2]]

        router = Router()
        sub = subscribe(context, config.endpoint)  # starts late: batches 0 and 1 went by
        answers = ask(context, config.replay_endpoint, b"snapshot")
        assert [seq for seq, _ in answers] == [2]  # one payload; resume from the next batch
        assert isinstance(DECODER.decode(answers[0][1]).events[0], AllBlocksCleared)
        router.apply(answers[0][1])
        router.next_seq = 2
        assert router.hashes() == truth(cm) and len(router.media["GPU"]) == 5
        assert router.media["CPU"] == {
            external_hash(a_keys[2]): (external_hash(a_keys[1]), a[8:12])
        }

        run(cm, "c", c)  # c evicts to the host, which drops a's last block (a CPU removal)
        run(cm, "a2", a)  # a's first two blocks are host hits: loaded back (GPU stores)
        last = step()
        follow(router, sub, context, config.replay_endpoint, last)
        assert router.hashes() == truth(cm)
        assert router.media["GPU"][external_hash(a_keys[1])] == (external_hash(a_keys[0]), a[4:8])
        assert cm.host.stats.num_loaded_blocks == 2
        [(_, payload)] = ask(context, config.replay_endpoint, (2).to_bytes(8, "big"))
        media = {(type(e).__name__, e.medium) for e in DECODER.decode(payload).events}
        assert media == {("BlockStored", "GPU"), ("BlockStored", "CPU"),
                         ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU")}  # fmt: skip

        cm.reset_prefix_cache()  # nothing held by a request: every tier empties
        follow(router, sub, context, config.replay_endpoint, step())
        assert router.hashes() == truth(cm) == {}
    finally:
        publisher.shutdown()


def test_a_snapshot_puts_parents_before_children_and_keeps_runs_alike_in_saltedness():
    index = CacheIndex(BLOCK)
    k = [bytes([i]) * 32 for i in range(6)]
    index.store("GPU", k[2], IndexEntry(k[1], (8, 9, 10, 11), True))  # a child first
    index.store("GPU", k[1], IndexEntry(k[0], (4, 5, 6, 7), False))
    index.store("GPU", k[3], IndexEntry(k[1], (12, 13, 14, 15), False))  # k1's second child
    index.store("CPU", k[0], IndexEntry(None, (0, 1, 2, 3), False))
    index.store("CPU", k[1], IndexEntry(k[0], (4, 5, 6, 7), False))
    assert index.snapshot() == [
        events.AllBlocksCleared(),
        events.BlockStored([k[1]], k[0], [4, 5, 6, 7], BLOCK),  # k0: not on the GPU
        events.BlockStored([k[2]], k[1], [8, 9, 10, 11], BLOCK, salted=True),
        events.BlockStored([k[3]], k[1], [12, 13, 14, 15], BLOCK),
        events.BlockStored([k[0], k[1]], None, list(range(8)), BLOCK, medium="CPU"),
    ]


def test_snapshot_batches_split_long_runs_and_stay_within_the_bound(monkeypatch):
    monkeypatch.setattr("kvserve.engine.kv_events.SNAPSHOT_BLOCKS_PER_BATCH", 2)
    k = [bytes([i]) * 32 for i in range(5)]
    run = events.BlockStored(k, None, list(range(20)), BLOCK)
    batches = snapshot_batches([events.AllBlocksCleared(), run], max_batches=10)
    assert batches == [
        [events.AllBlocksCleared(), events.BlockStored(k[:2], None, list(range(8)), BLOCK)],
        [events.BlockStored(k[2:4], k[1], list(range(8, 16)), BLOCK)],
        [events.BlockStored(k[4:], k[3], list(range(16, 20)), BLOCK)],
    ]
    assert len(snapshot_batches([run], max_batches=2)) == 2  # 3 blocks a batch, not 2
