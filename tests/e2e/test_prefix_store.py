"""The prefix cache as a store, through real servers on the embedded model: cache salts and
public prefixes, POST /reset_prefix_cache, miss reasons with exact token counts, KV events read
by a real ZMQ subscriber and decoded as vLLM's own subscriber decodes them, the store on disk
surviving a SIGTERM restart, a KV dtype change that does not load it, the 8-bit KV check, and
a store directory that turns into a file while serving.

One server (A) runs the first tests; then it is stopped and two start on its store: B (same
configuration, behind an API key), which takes the store's lock, then C (--kv-cache-dtype
int8), which only reads the store.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from e2e_server import ServerProcess, scrape

BLOCK = 16
SYSTEM = (
    "You are Captain Byte, the cheerful assistant of the harbour museum. You answer questions "
    "about ships, lighthouses and the sea in two short sentences, and you never give medical "
    "or legal advice."
)
PUBLIC = [{"role": "system", "content": SYSTEM}]
SMALL = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024"]
REASONS = ("below_block_size", "isolated", "evicted", "never_seen")


# vLLM 0.32's event classes (vllm/distributed/kv_events.py) in their field order, as its
# subscribers declare them: an array_like batch, each event a map tagged with its class name,
# block hashes of vLLM's ExternalBlockHash (bytes | int).
_EVENT = {"omit_defaults": True, "gc": False, "tag": True}
_HASH = bytes | int
BlockStored = msgspec.defstruct(
    "BlockStored",
    [("block_hashes", list[_HASH]), ("parent_block_hash", _HASH | None),
     ("token_ids", list[int]), ("block_size", int), ("lora_id", int | None),
     ("medium", str | None), ("lora_name", str | None),
     ("extra_keys", list[tuple[Any, ...] | None] | None, None), ("group_idx", int | None, None),
     ("kv_cache_spec_kind", str | None, None), ("kv_cache_spec_sliding_window", int | None, None)],
    **_EVENT,
)  # fmt: skip
BlockRemoved = msgspec.defstruct(
    "BlockRemoved",
    [("block_hashes", list[_HASH]), ("medium", str | None), ("group_idx", int | None, None)],
    **_EVENT,
)
AllBlocksCleared = msgspec.defstruct("AllBlocksCleared", [], **_EVENT)
KVEventBatch = msgspec.defstruct(
    "KVEventBatch",
    [("ts", float), ("events", list[BlockStored | BlockRemoved | AllBlocksCleared]),
     ("data_parallel_rank", int | None, None)],
    array_like=True, omit_defaults=True, gc=False,
)  # fmt: skip


def token_prompt(seed: int, num_tokens: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(num_tokens)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-store")
    public = root / "public.json"
    public.write_text(json.dumps([PUBLIC]))
    return {"public": public, "store": root / "store", "events": root / "events.sock"}


@pytest.fixture(scope="module")
def subscriber(files):
    """Subscribed before the server binds, so that no batch is missed."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"ipc://{files['events']}")
    yield sub
    context.destroy(linger=0)


def store_args(files: dict[str, Path]) -> list[str]:
    return [*SMALL, "--public-prefixes", str(files["public"]),
            "--prefix-cache-dir", str(files["store"])]  # fmt: skip


@pytest.fixture(scope="module")
def server_a(server_factory, files, subscriber) -> ServerProcess:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"ipc://{files['events']}"}  # fmt: skip
    server = server_factory(*store_args(files), "--kv-events-config", json.dumps(events))
    server.wait_healthy()
    return server


def client(server: ServerProcess, api_key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=server.base_url, timeout=120, headers=headers)


@pytest.fixture(scope="module")
def http(server_a) -> httpx.Client:
    """A's client: closed with the module (A stops before the module ends)."""
    yield (http := client(server_a))
    http.close()


def cached(http: httpx.Client, path: str, body: dict, salt: str | None = None, **kw) -> int:
    """cached_tokens of one greedy request."""
    body = {**body, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post(path, json=body, **kw)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def completion(http: httpx.Client, prompt: list[int], salt: str | None = None) -> int:
    return cached(http, "/v1/completions", {"prompt": prompt}, salt)


def chat(http: httpx.Client, user: str, salt: str | None = None) -> int:
    messages = [*PUBLIC, {"role": "user", "content": user}]
    return cached(http, "/v1/chat/completions", {"messages": messages}, salt)


def misses(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = {}
    for reason in REASONS:
        line = next(x for x in text.splitlines() if f'reason="{reason}"' in x)
        found[reason] = float(line.split()[-1])
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {r: int(after[r] - before[r]) for r in REASONS}


def test_salts_isolate_completions(http):
    prompt = token_prompt(1, 50)  # 3 full blocks a later request can hit
    assert completion(http, prompt, "tenant-a") == 0
    assert completion(http, prompt, "tenant-a") == 48
    assert completion(http, prompt, "tenant-b") == 0
    assert completion(http, prompt) == 0  # no salt is a namespace of its own
    response = http.post("/v1/completions", json={"prompt": prompt, "cache_salt": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_public_system_prompt_is_shared_across_salts_and_nothing_after(http, embedded_tokenizer):
    rendered = embedded_tokenizer.apply_chat_template(PUBLIC, tokenize=False)
    public_tokens = len(embedded_tokenizer.encode(rendered, add_special_tokens=False))
    shared = public_tokens // BLOCK * BLOCK
    assert shared >= 2 * BLOCK
    question = "Why do lighthouses have different flashing patterns at night?"
    assert chat(http, question, "tenant-a") == 0
    assert chat(http, question, "tenant-a") > shared  # the tenant's own blocks too
    assert chat(http, question, "tenant-b") == shared  # the system prompt's blocks only
    assert chat(http, "How tall is the tallest lighthouse?", "tenant-c") == shared
    assert chat(http, question) == shared


def test_each_miss_reason_is_counted_exactly(http, server_a):
    prompt = token_prompt(2, 50)  # 3 blocks a hit could cover + 2 tokens below a block
    before = misses(server_a.base_url)
    completion(http, prompt)
    after_new = misses(server_a.base_url)
    assert delta(after_new, before) == {"below_block_size": 2, "isolated": 0, "evicted": 0,
                                        "never_seen": 48}  # fmt: skip
    completion(http, prompt, "tenant-x")  # cached, but under no salt
    after_salt = misses(server_a.base_url)
    # Tenants apart: tenant-x reading /metrics cannot tell that another salt (here none) sent
    # this prompt: its miss counts as tokens nobody sent (--enable-cross-salt-miss-reason
    # would count them `isolated`).
    assert delta(after_salt, after_new) == {"below_block_size": 2, "isolated": 0, "evicted": 0,
                                            "never_seen": 48}  # fmt: skip
    assert http.post("/reset_prefix_cache").status_code == 200
    completion(http, prompt)  # was cached, then dropped
    after_reset = misses(server_a.base_url)
    assert delta(after_reset, after_salt) == {"below_block_size": 2, "isolated": 0,
                                              "evicted": 48, "never_seen": 0}  # fmt: skip
    # The status line is logged at the next tick (--log-stats-interval 2) after activity; on a
    # fast machine the requests above can all fall before the first one.
    deadline = time.monotonic() + 15
    while not (lines := [ln for ln in server_a.log().splitlines() if "Prefix cache misses" in ln]):
        assert time.monotonic() < deadline, "the status line splits the misses by reason"
        time.sleep(0.5)
    assert "below_block_size" in lines[-1] and "never_seen" in lines[-1], lines[-1]


def test_reset_drops_cached_blocks(http):
    prompt = token_prompt(3, 40)
    completion(http, prompt)
    assert completion(http, prompt) == 32
    response = http.post("/reset_prefix_cache")
    assert response.status_code == 200 and response.json()["num_blocks_dropped"] > 0
    assert completion(http, prompt) == 0


def receive(subscriber, want, timeout: float = 15.0) -> list:
    """Decoded events until one satisfies `want`; checks the frames and sequence numbers."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    seen, last_seq = [], -1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subscriber.poll(200):
            continue
        topic, seq_bytes, payload = subscriber.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        assert topic == b"kv" and len(seq_bytes) == 8 and seq > last_seq
        last_seq = seq
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        seen.extend(batch.events)
        if any(want(e) for e in batch.events):
            return seen
    raise AssertionError(f"no matching event in {seen!r:.2000}")


def test_kv_events_reach_a_zmq_subscriber(http, server_a, subscriber):
    prompt = token_prompt(4, 40)  # caches 2 full blocks
    completion(http, prompt)

    def ours(event) -> bool:
        return isinstance(event, BlockStored) and event.token_ids == prompt[:32]

    stored = next(e for e in receive(subscriber, ours) if ours(e))
    assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
    assert stored.block_size == BLOCK and stored.lora_id is None and stored.medium == "GPU"
    assert stored.extra_keys == [None, None] and stored.group_idx == 0
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored.block_hashes)
    completion(http, prompt, "tenant-e")  # the same blocks under a salt: no token ids

    def salted(event) -> bool:
        return isinstance(event, BlockStored) and event.token_ids == []

    tenant = next(e for e in receive(subscriber, salted) if salted(e))
    assert len(tenant.block_hashes) == 2
    assert not set(tenant.block_hashes) & set(stored.block_hashes)  # the salt's own keys
    http.post("/reset_prefix_cache")
    receive(subscriber, lambda e: isinstance(e, AllBlocksCleared | BlockRemoved))
    assert scrape(server_a.base_url)["kvserve:kv_events_dropped_batches_total"] == 0


RESTART_PROMPT = token_prompt(5, 50)


@pytest.fixture(scope="module")
def restarted(server_factory, server_a, http, files) -> tuple[ServerProcess, ServerProcess]:
    """A caches RESTART_PROMPT and stops (SIGTERM); B (same flags, an API key) and C (int8 KV)
    start on its store, C once B holds the store's lock."""
    completion(http, RESTART_PROMPT)
    assert server_a.stop() == 0
    assert "new blocks written at shutdown" in server_a.log()
    b = server_factory(*store_args(files), "--api-key", "secret")
    deadline = time.monotonic() + 120
    while "cached blocks from" not in b.log():  # B's store is open: it holds the lock
        assert b.process.poll() is None and time.monotonic() < deadline, b.log()[-4000:]
        time.sleep(0.2)
    c = server_factory(*store_args(files), "--kv-cache-dtype", "int8")
    b.wait_healthy()
    c.wait_healthy()
    return b, c


def test_a_restart_keeps_the_cache(restarted):
    b, _ = restarted
    with client(b, api_key="secret") as http_b:
        assert completion(http_b, RESTART_PROMPT) == 48  # the first request after the restart
        assert httpx.post(f"{b.base_url}/reset_prefix_cache").status_code == 401
        assert http_b.post("/reset_prefix_cache").status_code == 200
        assert completion(http_b, RESTART_PROMPT) == 0
    assert "3 cached blocks from 1 of 1 groups indexed" in b.log()


def test_another_kv_dtype_does_not_load_the_store(restarted):
    _, c = restarted
    log = c.log()
    assert "kv_cache_dtype: stored float32, now int8" in log
    assert f"held by another server (pid {restarted[0].process.pid})" in log  # B writes it
    assert "KV cache dtype check: int8 vs float32" in log and ": pass" in log
    before = misses(c.base_url)
    with client(c) as http_c:
        assert completion(http_c, RESTART_PROMPT) == 0
    assert delta(misses(c.base_url), before)["isolated"] == 48  # cached under float32 KV
    assert scrape(c.base_url)["kvserve:prefix_cache_hits_total"] == 0


def greedy_text(http: httpx.Client, prompt: list[int], max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_store_directory_replaced_by_a_file_while_serving(restarted, files):
    """B's store directory becomes a file: requests (one under way) finish with the same
    tokens, a reset answers at once, the store turns off and says so, the error is counted,
    and the shutdown says what was not written."""
    b, _ = restarted
    prompts = [token_prompt(6, 40), token_prompt(7, 40)]
    with client(b, api_key="secret") as http_b:
        before = [greedy_text(http_b, p) for p in prompts]
        long_before = greedy_text(http_b, prompts[0], 48)
        under_way: list[str] = []
        request = threading.Thread(
            target=lambda: under_way.append(greedy_text(http_b, prompts[0], 48))
        )
        request.start()
        shutil.rmtree(files["store"])
        files["store"].write_text("not a directory")
        started = time.monotonic()
        assert http_b.post("/reset_prefix_cache").status_code == 200
        assert time.monotonic() - started < 1.0
        request.join()
        deadline = time.monotonic() + 15
        while scrape(b.base_url)["kvserve:prefix_store_errors_total"] < 1:
            assert time.monotonic() < deadline, "the store's error is counted"
            greedy_text(http_b, token_prompt(8, 20), 1)  # a step refreshes the stats
        assert [greedy_text(http_b, p) for p in prompts] == before
    assert under_way == [long_before]
    assert f"prefix cache store {files['store']} is off" in b.log()
    assert b.stop() == 0
    assert "cached blocks not written (the store was turned off by an error)" in b.log()
