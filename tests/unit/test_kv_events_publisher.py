"""The KV event publisher alone (no engine): vLLM's frames and encoding on the PUB socket, the
replay of buffered batches on the ROUTER socket, a bad endpoint named at start-up."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvserve.config import KVEventsConfig
from kvserve.engine.kv_events import END_SEQ, ZmqEventPublisher, external_hash
from kvserve.errors import ParameterError
from kvserve.kv import events

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


def test_batches_are_published_and_replayed(tmp_path):
    config = KVEventsConfig(True, "zmq", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay",
                            topic="kv")  # fmt: skip
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(config.endpoint)
    publisher = ZmqEventPublisher(config, "CPU")
    try:
        stored = events.BlockStored([KEY_A, KEY_B], None, list(range(8)), 4)
        for _ in range(50):  # a PUB socket drops what it sends before the SUB has joined
            publisher.publish([stored])
            if sub.poll(100):
                break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        assert msgspec.msgpack.decode(payload)[1:] == [
            [["BlockStored", [external_hash(KEY_A), external_hash(KEY_B)], None,
              list(range(8)), 4, None, "CPU"]],
            0,
        ]  # fmt: skip
        publisher.publish([events.BlockRemoved([KEY_A]), events.AllBlocksCleared()])
        sub.recv_multipart()
        replay = context.socket(zmq.DEALER)
        replay.connect(config.replay_endpoint)
        replay.send_multipart([b"", seq])  # from the first batch the SUB saw
        frames = [replay.recv_multipart() for _ in range(3)]
        assert [f[1] for f in frames[:2]] == [
            seq,
            (int.from_bytes(seq, "big") + 1).to_bytes(8, "big"),
        ]
        assert msgspec.msgpack.decode(frames[1][2])[1] == [
            ["BlockRemoved", [external_hash(KEY_A)], "CPU"],
            ["AllBlocksCleared"],
        ]
        assert frames[2][1:] == [END_SEQ, b""]
    finally:
        publisher.shutdown()
        context.destroy(linger=0)


def test_an_endpoint_that_cannot_be_bound_names_the_flag():
    with pytest.raises(ParameterError, match="--kv-events-config"):
        ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:not-a-port"), "CPU")
