"""The prefix cache store fails safe (engine/prefix_store.py, engine/store_writer.py), with tiny
KV tensors and no model: an error of any type in the writer turns the store off with one error
line and a count while the cached blocks in memory stay usable, a reset never waits for the
writer, the copies waiting for it stay bounded, nothing in the directory stops the start-up,
one server writes a directory at a time, and a file's stored fingerprint is checked."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kv_requests import make_request
from safetensors import safe_open
from safetensors.torch import save_file
from test_prefix_store_files import PRINT, cache_prompt, engine

from kvserve.engine import store_writer
from kvserve.engine.prefix_store import PrefixStore
from kvserve.engine.store_writer import StoreState

PROMPTS = [list(range(9)), list(range(50, 59)), list(range(100, 109))]  # 2 full blocks each
LOCK = "kvserve.lock"
NUM_BLOCKS = 16


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def returns_within(fn: Callable[[], object], seconds: float) -> bool:
    """Whether `fn()` returns within `seconds` (run on a thread, so that a hang fails the
    test instead of stalling it)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_cached(manager, tokens: list[int]) -> None:
    """The blocks cached in memory are still found (nothing lost with the store)."""
    hit = manager.find_cached_prefix(make_request(manager, "probe", tokens))
    assert hit.num_tokens == len(tokens) // 4 * 4


class DiskTrouble(Exception):
    """Not an OSError, as safetensors' own errors are not."""


@pytest.mark.parametrize("fault", ["raises DiskTrouble", "directory removed", "replaced by file"])
def test_a_writer_error_turns_the_store_off_and_serving_goes_on(
    tmp_path, monkeypatch, caplog, fault
):
    root = tmp_path / "store"
    caches, manager = engine(NUM_BLOCKS)
    store = PrefixStore(root, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", PROMPTS[0])
    store.save(manager)
    store.writer.join()
    if fault == "raises DiskTrouble":
        monkeypatch.setattr(store_writer, "save_file", _raise(DiskTrouble("no space left")))
    else:
        shutil.rmtree(root)
        if fault == "replaced by file":
            root.write_text("not a directory")
    cache_prompt(caches, manager, "b", PROMPTS[1])
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert store.save(manager) == 2
        wait_until(lambda: store.state is StoreState.OFF)
        assert returns_within(store.clear, 1.0)  # a reset answers whatever the writer did
        cache_prompt(caches, manager, "c", PROMPTS[2])
        assert store.save(manager) == 0 and store.writer.num_pending_bytes == 0
        store.close(manager)
    assert store.num_errors == 1
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert str(root) in error.getMessage() and "serving goes on" in error.getMessage()
    assert "4 cached blocks not written (the store was turned off by an error)" in caplog.text
    assert_cached(manager, PROMPTS[1])
    assert_cached(manager, PROMPTS[2])


def _raise(exc: Exception) -> Callable[..., None]:
    def save(*args: object, **kwargs: object) -> None:
        raise exc

    return save


def test_copies_waiting_for_a_slow_writer_stay_bounded_and_all_are_written(tmp_path, monkeypatch):
    release = threading.Event()

    def slow_save(*args: object, **kwargs: object) -> None:
        release.wait(10)
        save_file(*args, **kwargs)

    monkeypatch.setattr(store_writer, "save_file", slow_save)
    caches, manager = engine(NUM_BLOCKS)
    store = PrefixStore(tmp_path, PRINT, 2**30, caches, max_pending_bytes=1)
    group_bytes = 2 * store._block_bytes
    for i, prompt in enumerate(PROMPTS):
        cache_prompt(caches, manager, f"r{i}", prompt)
        assert store.save(manager) == (2 if i == 0 else 0)  # one group at a time
        assert store.writer.num_pending_bytes == group_bytes
    assert returns_within(store.clear, 1.0)  # even while the writer is stuck
    manager.reset_prefix_cache()  # the rest of a reset (engine/cache_services.py)
    for i, prompt in enumerate(PROMPTS):  # cached again after the reset
        cache_prompt(caches, manager, f"s{i}", prompt)
        store.save(manager)
        assert store.writer.num_pending_bytes <= group_bytes
    release.set()
    store.close(manager)  # gives the writer time to make room: everything is written
    caches2, manager2 = engine(NUM_BLOCKS)
    assert PrefixStore(tmp_path, PRINT, 2**30, caches2).index(manager2) == 6


def test_nothing_in_the_directory_stops_the_start_up_and_strays_are_kept(tmp_path, caplog):
    caches, manager = engine(NUM_BLOCKS)
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", PROMPTS[0])
    store.close(manager)
    [group] = store.directory.glob("group-*.safetensors")
    shutil.copy(group, store.directory / "group-7 (copy).safetensors")
    (store.directory / "group-0000000003.safetensors").mkdir()  # a directory named as a group
    (store.directory / "notes.txt").write_text("mine")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "fingerprint.json").write_text("[1, 2]")
    (tmp_path / "other" / "group-0000000000.safetensors").write_bytes(b"truncated")
    (tmp_path / "README").write_text("kv store")
    strays = files_under(tmp_path)

    caches2, manager2 = engine(NUM_BLOCKS)
    store2 = PrefixStore(tmp_path, PRINT, 2**30, caches2)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert store2.index(manager2) == 2
    assert "group-7 (copy).safetensors (not a group file)" in caplog.text
    assert "group-0000000003.safetensors (not a group file)" in caplog.text
    assert "holds a JSON list" in caplog.text
    cache_prompt(caches2, manager2, "b", PROMPTS[1])
    store2.close(manager2)  # writes after the stray names, never over them
    after = files_under(tmp_path)
    assert all(after.get(p) == data for p, data in strays.items() if p.name != LOCK)
    assert (store.directory / "group-0000000003.safetensors").is_dir()
    assert (store.directory / "group-0000000004.safetensors").is_file()


def test_a_second_server_on_the_directory_says_who_holds_it_and_writes_nothing(tmp_path, caplog):
    caches, manager = engine(NUM_BLOCKS)
    first = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", PROMPTS[0])
    first.save(manager)
    first.writer.join()
    (first.directory / ".tmp-group-0000000099.safetensors").write_bytes(b"a write under way")
    (first.directory / "group-0000000050.safetensors").write_bytes(b"not readable")
    before = files_under(tmp_path)

    caches2, manager2 = engine(NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        second = PrefixStore(tmp_path, PRINT, 2**30, caches2)
        assert second.state is StoreState.READ_ONLY
        assert f"held by another server (pid {os.getpid()})" in caplog.text
        assert second.index(manager2) == 2  # it reads what the first wrote
        cache_prompt(caches2, manager2, "b", PROMPTS[1])
        assert second.save(manager2) == 0
        assert returns_within(second.clear, 1.0)
        second.close(manager2)
    assert files_under(tmp_path) == before  # the first's files untouched
    assert f"not written (the directory is held by pid {os.getpid()})" in caplog.text

    cache_prompt(caches, manager, "c", PROMPTS[2])
    assert first.save(manager) == 2  # the first goes on writing
    first.close(manager)
    assert len(files_under(tmp_path)) == len(before) + 1
    caches3, manager3 = engine(NUM_BLOCKS)
    assert PrefixStore(tmp_path, PRINT, 2**30, caches3).state is StoreState.WRITING


def test_the_lock_names_the_process_that_holds_it_and_dies_with_it(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path / LOCK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        caches, manager = engine(NUM_BLOCKS)
        with caplog.at_level(logging.WARNING, logger="kvserve"):
            store = PrefixStore(tmp_path, PRINT, 2**30, caches)
        assert store.state is StoreState.READ_ONLY and store.holder == str(holder.pid)
        assert f"pid {holder.pid}" in caplog.text
        store.close(manager)
    finally:
        holder.kill()  # like a crashed server: the kernel releases its lock
        holder.wait()
    caches, manager = engine(NUM_BLOCKS)
    assert PrefixStore(tmp_path, PRINT, 2**30, caches).state is StoreState.WRITING


_HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("stored", ["another model", "none"])
def test_a_group_whose_stored_fingerprint_differs_is_not_loaded_and_kept(tmp_path, caplog, stored):
    caches, manager = engine(NUM_BLOCKS)
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", PROMPTS[0])
    store.close(manager)
    [group] = store.directory.glob("group-*.safetensors")
    with safe_open(str(group), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    metadata = {"fingerprint": json.dumps({**PRINT, "model_files": "other"})}
    save_file(tensors, str(group), metadata=metadata if stored == "another model" else None)
    data = group.read_bytes()

    caches2, manager2 = engine(NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert PrefixStore(tmp_path, PRINT, 2**30, caches2).index(manager2) == 0
    reason = "model_files: stored other, now None" if stored != "none" else "format: stored None"
    assert "the fingerprint it holds differs" in caplog.text and reason in caplog.text
    assert group.read_bytes() == data
    assert manager2.find_cached_prefix(make_request(manager2, "b", PROMPTS[0])).num_tokens == 0


def test_a_directory_that_cannot_be_used_leaves_the_server_without_the_store(tmp_path, caplog):
    root = tmp_path / "store"
    root.write_text("a file where the directory should be")
    caches, manager = engine(NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        store = PrefixStore(root, PRINT, 2**30, caches)
        assert store.index(manager) == 0
        cache_prompt(caches, manager, "a", PROMPTS[0])
        assert store.save(manager) == 0
        store.clear()
        store.close(manager)
    assert store.state is StoreState.OFF and store.num_errors == 1
    assert f"prefix cache store {root} is off: opening the directory failed" in caplog.text
    assert root.read_text() == "a file where the directory should be"
    assert_cached(manager, PROMPTS[0])


def test_a_group_not_written_yet_is_a_miss_then_read_once_written(tmp_path, monkeypatch):
    """The writer is slow: a request needing a block saved but not on disk yet computes it,
    and the group stays indexed; once written, it is read back."""
    release = threading.Event()

    def slow_save(*args: object, **kwargs: object) -> None:
        release.wait(10)
        save_file(*args, **kwargs)

    monkeypatch.setattr(store_writer, "save_file", slow_save)
    caches, manager = engine(4)
    store = PrefixStore(tmp_path, PRINT, 2**30, caches)
    cache_prompt(caches, manager, "a", PROMPTS[0])
    assert store.save(manager) == 2
    cache_prompt(caches, manager, "b", PROMPTS[1] + PROMPTS[2][:4])  # evicts a's blocks
    request = make_request(manager, "c", PROMPTS[0])
    assert store.fetch([request], manager, lambda: None) == 0  # still queued: a miss
    release.set()
    store.writer.join()
    assert store.fetch([request], manager, lambda: None) == 2
    assert manager.find_cached_prefix(request).num_tokens == 8
    store.close(manager)
