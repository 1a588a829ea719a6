"""The KV event publisher alone (no engine): vLLM's frames, payloads decoded as vLLM's own
subscriber decodes them, salted blocks without their token ids, the replay socket's bounds, a
dropped batch counted and seen as a gap, the localhost default, bad options named."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from kv_requests import make_request

from kvserve.config import KVEventsConfig, parse_kv_events_config
from kvserve.engine.kv_event_wire import external_hash, to_wire
from kvserve.engine.kv_events import END_SEQ, ReplayBuffer, ZmqEventPublisher, binds
from kvserve.errors import ParameterError
from kvserve.kv import events
from kvserve.kv.cache_manager import KVCacheManager

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


# vLLM 0.32's event classes (vllm/distributed/kv_events.py), mirrored field for field without
# importing vllm: the batch array_like, each event a map tagged with its class name ("type"),
# block hashes of its ExternalBlockHash type (bytes | int).  The class names are the tags.
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
TOPIC = b"kv"


def ipc_config(tmp_path, **kw) -> KVEventsConfig:
    return KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay",
                          topic=TOPIC.decode(), **kw)  # fmt: skip


@pytest.fixture
def context():
    yield (ctx := zmq.Context())
    ctx.destroy(linger=0)


def subscribe(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    return sub


def first_message(publisher: ZmqEventPublisher, sub: zmq.Socket, batch: list) -> list[bytes]:
    """Publish `batch` until the SUB sees it (a PUB drops what it sends before a SUB joined)."""
    for _ in range(50):
        publisher.publish(batch)
        if sub.poll(100):
            return sub.recv_multipart()
    raise AssertionError("the subscriber saw nothing")


def next_batch_after(sub: zmq.Socket, topic_seq: bytes):  # noqa: ANN201 - a KVEventBatch
    """The first batch numbered after `topic_seq` (first_message may have sent its batch more
    than once); a bounded wait, never a hang."""
    while True:
        assert sub.poll(5000), "the subscriber saw nothing more"
        _, seq, payload = sub.recv_multipart()
        if seq > topic_seq:
            return DECODER.decode(payload)


def replay(context: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """[sequence, payload] of every answer to one replay request, the end marker included.
    Each answer is framed as vLLM 0.32's publisher frames it: an empty delimiter, the topic
    (empty on the end marker), the sequence, the payload."""
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames = []
        while not frames or frames[-1][0] != END_SEQ:
            assert dealer.poll(5000), "the replay socket did not answer"
            delimiter, topic, seq, payload = dealer.recv_multipart()
            assert delimiter == b"" and topic == (b"" if seq == END_SEQ else TOPIC)
            frames.append([seq, payload])
        return frames
    finally:
        dealer.close(linger=0)


def wait_sent(context: zmq.Context, endpoint: str, seq: int) -> None:
    """Until batch `seq` was sent (the publisher thread sends a little later)."""
    deadline = time.monotonic() + 10
    while len(replay(context, endpoint, seq)) < 2:
        assert time.monotonic() < deadline, f"batch {seq} was never sent"
        time.sleep(0.01)


def test_payloads_decode_as_vllms_kv_event_batch(tmp_path, context):
    sub = subscribe(context, f"ipc://{tmp_path}/pub")
    publisher = ZmqEventPublisher(ipc_config(tmp_path))
    publisher.start()
    try:
        stored = events.BlockStored([KEY_A, KEY_B], None, list(range(8)), 4)
        topic, seq, payload = first_message(publisher, sub, [stored])
        assert topic == b"kv" and len(seq) == 8
        batch = DECODER.decode(payload)
        assert batch.ts > 0 and batch.data_parallel_rank == 0
        assert batch.events == [
            BlockStored(block_hashes=[external_hash(KEY_A), external_hash(KEY_B)],
                        parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
                        group_idx=0, kv_cache_spec_kind="full_attention")
        ]  # fmt: skip
        [raw] = msgspec.msgpack.decode(payload)[1]  # a map, tagged; defaults left out
        assert raw["type"] == "BlockStored" and "kv_cache_spec_sliding_window" not in raw
        publisher.publish([events.BlockRemoved([KEY_B]), events.AllBlocksCleared()])
        assert next_batch_after(sub, topic_seq=seq).events == [
            BlockRemoved([external_hash(KEY_B)], "GPU", 0),
            AllBlocksCleared(),
        ]
    finally:
        publisher.shutdown()


def test_a_block_hash_is_the_low_64_bits_of_the_key_as_vllm_sends_it():
    assert external_hash(KEY_A) == int.from_bytes(KEY_A, "big") & (2**64 - 1)
    assert external_hash(b"\xff" * 32) == 2**64 - 1


def test_salted_blocks_go_out_without_their_token_ids_unless_asked():
    system = list(range(100, 108))  # two public blocks
    cm = KVCacheManager(16, block_size=4, extra_key=b"f32", public_prefixes=[system],
                        enable_events=True)  # fmt: skip
    prompt = system + list(range(500, 509))  # then two salted blocks and a partial one
    for request_id, salt in (("a", "tenant-a"), ("b", None)):
        request = make_request(cm, request_id, prompt, salt)
        hit = cm.find_cached_prefix(request)
        cm.allocate_slots(request_id, hit.num_tokens, len(prompt) - hit.num_tokens, hit)
        cm.cache_full_blocks(request, len(prompt))
    public, tenant, unsalted = cm.take_events()  # b's public blocks were cached already
    assert (public.salted, tenant.salted, unsalted.salted) == (False, True, False)
    assert len(public.block_hashes) == len(tenant.block_hashes) == 2
    assert tenant.parent_block_hash == public.block_hashes[-1]

    def token_ids(event: events.BlockStored, publish_salted: bool) -> list[int]:
        wire = to_wire(event, publish_salted)
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=BlockStored)
        assert decoded.block_hashes == [external_hash(k) for k in event.block_hashes]
        return decoded.token_ids

    assert token_ids(public, False) == system
    assert token_ids(tenant, False) == []
    assert token_ids(tenant, True) == prompt[8:16]
    assert token_ids(unsalted, False) == prompt[8:16]


def test_the_replay_buffer_keeps_at_most_n_batches_and_bytes():
    buffer = ReplayBuffer(max_batches=3, max_bytes=10)
    for seq in range(5):
        buffer.add(seq, b"ab")
        buffer.check_invariants()
    assert [s for s, _ in buffer.since(0, 100)] == [2, 3, 4]
    buffer.add(5, b"x" * 7)  # 2 + 2 + 7 > 10: the two oldest go
    buffer.check_invariants()
    assert [s for s, _ in buffer.since(0, 100)] == [4, 5] and buffer.num_bytes == 9
    assert [s for s, _ in buffer.since(5, 100)] == [5]
    assert buffer.since(0, 1) == [(4, b"ab")]
    buffer.add(6, b"y" * 11)  # alone over the bound: kept nowhere
    buffer.check_invariants()
    assert len(buffer) == 0


def test_one_replay_request_gets_at_most_replay_max_batches(tmp_path, context):
    config = ipc_config(tmp_path, buffer_steps=4, replay_max_batches=2)
    publisher = ZmqEventPublisher(config)
    publisher.start()
    try:
        for i in range(6):
            publisher.publish([events.BlockRemoved([bytes([i]) * 32])])
        wait_sent(context, config.replay_endpoint, 5)
        frames = replay(context, config.replay_endpoint, 0)
        seqs = [int.from_bytes(seq, "big", signed=True) for seq, _ in frames]
        assert seqs[-1] == -1 and frames[-1][1] == b"" and len(seqs) == 3
        assert seqs[:2] == [2, 3]  # buffer_steps (4) kept: 0 and 1 are gone
        removed = DECODER.decode(frames[0][1]).events[0]
        assert removed.block_hashes == [external_hash(bytes([seqs[0]]) * 32)]
        rest = replay(context, config.replay_endpoint, seqs[1] + 1)  # asks again from there
        assert [int.from_bytes(s, "big") for s, _ in rest[:-1]] == list(range(seqs[1] + 1, 6))
    finally:
        publisher.shutdown()


def test_a_full_queue_drops_and_counts_the_batch_and_leaves_a_gap(tmp_path, context):
    config = ipc_config(tmp_path, max_queue_size=1)
    publisher = ZmqEventPublisher(config)  # not started: the queue fills
    try:
        for i in range(3):
            publisher.publish([events.BlockRemoved([bytes([i]) * 32])])
        assert publisher.num_dropped == 2
        publisher.start()
        wait_sent(context, config.replay_endpoint, 0)  # the queue has room again
        publisher.publish([events.AllBlocksCleared()])
        wait_sent(context, config.replay_endpoint, 3)
        frames = replay(context, config.replay_endpoint, 0)
        assert [int.from_bytes(s, "big", signed=True) for s, _ in frames] == [0, 3, -1]
    finally:
        publisher.shutdown()


def test_the_default_endpoint_binds_this_host_only(context):
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq"}') == (
        KVEventsConfig(True, "zmq", "tcp://127.0.0.1:5557")
    )
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://localhost:6000")
    assert binds("tcp://*:5557") and binds("tcp://[::1]:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://10.0.0.7:5557") and not binds("tcp://router.internal:5557")
    config = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", topic="kv")  # any free port
    publisher = ZmqEventPublisher(config)
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        sub = subscribe(context, publisher.endpoint)
        publisher.start()
        first_message(publisher, sub, [events.AllBlocksCleared()])
    finally:
        publisher.shutdown()


@pytest.mark.parametrize(
    "bad",
    ['{"endpoint": "tcp://*:not-a-port"}', '{"buffer_steps": 0}', '{"replay_max_batches": -1}',
     '{"publish_salted_token_ids": "yes"}', '{"buffer_max_bytes": true}', '{"topic": null}'],
)  # fmt: skip
def test_bad_options_name_the_flag(bad):
    with pytest.raises(ParameterError, match="--kv-events-config"):
        config = parse_kv_events_config(
            bad.replace("{", '{"enable_kv_cache_events": true, "publisher": "zmq", ', 1)
        )
        ZmqEventPublisher(config).shutdown()
