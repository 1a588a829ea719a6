"""The block hasher (kv/block_hasher.py) and the request-owned block hashes: a request's cache
salt is read once and each of its blocks hashed once, whatever the number of lookups,
preemptions and call sites; no cache manager method takes a salt; a request without its
hashes fails loudly instead of being keyed without its salt."""

from __future__ import annotations

import inspect

import pytest
from fake_runner import FakeRunner
from kv_requests import make_request

from kvserve.engine.scheduler import Scheduler
from kvserve.kv import block_hasher
from kvserve.kv.block_hasher import BlockHasher, hash_block, salted_namespace
from kvserve.kv.cache_manager import KVCacheManager
from kvserve.request import Request, SamplingParams

BS = 4


class CountingSalt(str):
    """A cache salt that counts how often it is read into a namespace (encoded)."""

    num_encodes: int

    def __new__(cls, value: str) -> CountingSalt:
        salt = super().__new__(cls, value)
        salt.num_encodes = 0
        return salt

    def encode(self, *args, **kwargs) -> bytes:
        self.num_encodes += 1
        return super().encode(*args, **kwargs)


def test_a_requests_salt_is_read_once_and_each_block_hashed_once(monkeypatch):
    """Twelve salted requests in a pool for about three: many preemptions, lookups and
    in-flight checks per request, yet one salt read per request and one SHA-256 per block."""
    num_hashed = 0

    def counting_hash_block(*args, **kwargs) -> bytes:
        nonlocal num_hashed
        num_hashed += 1
        return hash_block(*args, **kwargs)

    monkeypatch.setattr(block_hasher, "hash_block", counting_hash_block)
    cm = KVCacheManager(24, BS, extra_key=b"float32")
    s = Scheduler(16, 64, 256, cm)
    requests = [
        Request(
            f"r{i}",
            [(i * 7 + j * 13) % 500 + 1 for j in range(10 + 3 * i)],
            SamplingParams(temperature=0.0, max_tokens=20 + i),
            cache_salt=CountingSalt(f"tenant-{i % 3}"),
        )
        for i in range(12)
    ]
    for request in requests:
        s.add_request(request)
    runner = FakeRunner(BS)
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
        cm.check_invariants()
    assert s.num_preemptions > 0
    assert [r.cache_salt.num_encodes for r in requests] == [1] * 12  # type: ignore[union-attr]
    assert num_hashed == sum(r.num_tokens // BS for r in requests)


def test_no_cache_manager_method_takes_a_cache_salt():
    for name, method in inspect.getmembers(KVCacheManager, inspect.isfunction):
        params = inspect.signature(method).parameters
        assert not [p for p in params if p.endswith("salt")], name


def test_a_request_without_its_hashes_is_refused_not_keyed_unsalted():
    cm = KVCacheManager(8, BS)
    tokens = list(range(9))
    unhashed = Request("a", tokens, SamplingParams(), cache_salt="tenant")
    with pytest.raises(AssertionError, match="'a' has no block hashes of this cache manager"):
        cm.find_cached_prefix(unhashed)
    another = make_request(KVCacheManager(8, BS), "b", tokens, "tenant")
    with pytest.raises(AssertionError, match="'b' has no block hashes"):
        cm.find_cached_prefix(another)


def test_hashes_grow_with_the_tokens_as_one_pass_over_them_would():
    hasher = BlockHasher(BS, b"int8", public_prefixes=[list(range(6))])
    request = Request("a", list(range(6)), SamplingParams(), cache_salt="tenant")
    request.hash_blocks_with(hasher)
    for token in range(6, 14):
        request.append_output_token(token)
    grown = request.block_hashes
    assert grown is not None and len(grown.keys) == 3  # 14 tokens
    whole = hasher.for_request("tenant")
    whole.extend(list(range(14)))
    assert (grown.keys, grown.contents, grown.num_public) == (whole.keys, whole.contents, 1)
    salted = salted_namespace(b"int8", "tenant")
    assert grown.keys[0] == hash_block(None, [0, 1, 2, 3], b"int8")  # public: unsalted
    assert grown.keys[1] == hash_block(grown.keys[0], [4, 5, 6, 7], salted)
    assert grown.num_unsalted == 1
    unsalted = hasher.for_request(None)
    unsalted.extend(list(range(14)))
    assert unsalted.num_unsalted == 3 and unsalted.keys[0] == grown.keys[0]


def test_with_caching_off_nothing_is_hashed_and_no_salt_read():
    hasher = KVCacheManager(8, BS, enable_caching=False).block_hasher
    salt = CountingSalt("tenant")
    hashes = hasher.for_request(salt)
    hashes.extend(list(range(16)))
    assert hashes.keys == [] and salt.num_encodes == 0


def test_hashes_are_made_once_per_request():
    cm = KVCacheManager(8, BS)
    request = make_request(cm, "a", list(range(9)))
    with pytest.raises(AssertionError, match="made once"):
        request.hash_blocks_with(cm.block_hasher)
