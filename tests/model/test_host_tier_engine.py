"""The host tier (--kv-offloading-size) through the whole engine, on a CPU: a tiny device
cache forces eviction and preemption; the blocks come back from host memory bit for bit, the
greedy tokens equal a run without the tier, and the counters say which tier served them.
Uncompressed (--kv-offloading-compression none) unless a test says int8, the CPU's default.

Tiny random Llama (2 layers, 2 KV heads of 16 dims, float32): 512 bytes/token, 8 KiB a block
of 16 tokens; the device cache holds 12 blocks (192 tokens), the host tier 1 MiB (128 blocks)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve import kv_quant as quant
from kvserve.engine.llm_engine import StepFailedError
from kvserve.errors import ParameterError
from kvserve.runner.disk_tier import block_file

BLOCK = 16
BLOCK_BYTES = BLOCK * 512
HOST_GIB = 2**-10  # 1 MiB
A = [(i * 7919) % 40000 + 7 for i in range(70)]  # 4 full blocks + 6 tokens
B = [(i * 104729) % 40000 + 11 for i in range(150)]  # with its outputs: 10 blocks


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    """Sharp attention (initializer_range 0.1): wrong K/V would change the tokens."""
    return str(tiny_model_dir("llama3", 0.1)[0])


def make(tiny_dir, offloading: float | None, num_blocks: int = 12, **kw) -> LLM:
    kw.setdefault("kv_offloading_compression", "none")
    return LLM(
        tiny_dir, dtype="float32", block_size=BLOCK, max_model_len=12 * BLOCK,
        kv_cache_memory=num_blocks * BLOCK_BYTES, kv_offloading_size=offloading, **kw,
    )  # fmt: skip


def block_kv(llm: LLM, block_ids: list[int]) -> torch.Tensor:
    """Every layer's K and V of these device blocks: [layers, 2, n, block, heads, dim]."""
    ids = torch.tensor(block_ids)
    caches = llm.engine.executor.kv_caches
    return torch.stack([torch.stack((c.key[ids], c.value[ids])) for c in caches])


def generate(llm: LLM, request_id: str, prompt: list[int], max_tokens: int):
    """(tokens, the K/V of the prompt's first 4 blocks right after its prefill)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    engine.step()  # the whole prompt in one step (once its disk reads, if any, are done)
    while request_id not in engine.cache_manager.block_tables:
        engine.step()
    kv = block_kv(llm, engine.cache_manager.block_tables[request_id][:4])
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done[0].outputs[0].token_ids, kv


def count_computed_tokens(llm: LLM) -> list[int]:
    """A one-element list that sums the tokens the model computes from now on."""
    total = [0]
    execute = llm.engine.executor.execute

    def counting(output):
        total[0] += output.num_scheduled_tokens
        return execute(output)

    llm.engine.executor.execute = counting
    return total


def test_evicted_prefix_blocks_come_back_from_host_memory(tiny_dir):
    llm, plain = make(tiny_dir, HOST_GIB), make(tiny_dir, None)
    assert llm.engine.sizing.num_host_blocks == 128
    assert "host tier: 128 blocks = 2,048 tokens (1.0 MiB)" in llm.engine.sizing.summary()
    first, kv_first = generate(llm, "a", A, 8)
    generate(llm, "b", B, 8)  # 10 blocks: evicts A's last two full blocks to the host
    stats = llm.engine.get_stats()
    assert stats.num_offloaded_blocks == 2 and stats.num_loaded_blocks == 0
    computed = count_computed_tokens(llm)
    again, kv_again = generate(llm, "a2", A, 8)
    stats = llm.engine.get_stats()
    # 4 full blocks hit (the 70th token is computed): 2 on the device, 2 from the host.
    assert stats.prefix_cache_hits == 64 and stats.prefix_cache_host_hits == 32
    assert stats.num_loaded_blocks == 2
    assert computed[0] == 6 + 7  # the 6 tokens after the hit, then 7 decodes
    assert torch.equal(kv_again, kv_first)  # the very K/V computed the first time
    assert again == first
    assert generate(plain, "a", A, 8)[0] == first
    generate(plain, "b", B, 8)
    assert generate(plain, "a2", A, 8)[0] == first  # recomputed: the same tokens
    assert plain.engine.get_stats().prefix_cache_hits == 32  # only the device's two blocks
    llm.engine.cache_manager.check_invariants()


def test_the_int8_tier_holds_3_2x_the_blocks_and_returns_the_dequantized_codes(tiny_dir):
    """The CPU's default: 1 MiB holds 409 int8 blocks (2,560 bytes: 1-byte codes + a float32
    scale per token and head) where float32 holds 128; a hit comes back as the stored codes
    dequantized, the greedy tokens here unchanged."""
    llm = make(tiny_dir, HOST_GIB, kv_offloading_compression=None)
    assert llm.engine.sizing.num_host_blocks == 2**20 // 2560 == 409
    first, kv_first = generate(llm, "a", A, 8)
    generate(llm, "b", B, 8)
    again, kv_again = generate(llm, "a2", A, 8)
    assert llm.engine.get_stats().num_loaded_blocks == 2
    assert torch.equal(kv_again[:, :, :2], kv_first[:, :, :2])  # still on the device
    stored = kv_first[:, :, 2:]
    codes, scale = quant.quantize(stored.reshape(-1, *stored.shape[-2:]), "int8")
    expected = quant.dequantize(codes, scale, "int8", torch.float32).view_as(stored)
    assert torch.equal(kv_again[:, :, 2:], expected) and not torch.equal(expected, stored)
    assert again == first


def test_a_preempted_request_resumes_from_host_memory_without_recompute(tiny_dir):
    prompts = [A[:60], B[:60]]  # 4 blocks each, growing to 9 with 70 outputs: 18 > 12
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    reference = make(tiny_dir, None, num_blocks=40).generate(prompts, params)
    runs = {}
    for offloading in (HOST_GIB, None):
        llm = make(tiny_dir, offloading)
        computed = count_computed_tokens(llm)
        outputs = llm.generate(prompts, params)
        stats = llm.engine.get_stats()
        assert stats.num_preemptions == 1
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in reference
        ]
        runs[offloading] = (computed[0] - 2 * (60 + 70 - 1), stats)
    recomputed, stats = runs[HOST_GIB]
    # The preempted request resumes with every full block a hit, most from the host: it
    # recomputes at most the tokens of its last, partial block.
    assert 0 <= recomputed < BLOCK
    assert stats.prefix_cache_host_hits > 0 and stats.num_loaded_blocks > 0
    assert runs[None][0] > 2 * BLOCK  # without the tier, the evicted blocks are recomputed


def test_a_step_failing_around_host_copies_forgets_both_tiers(tiny_dir):
    """The copies may not have run: a block loaded from the host (or a slot written) could hold
    anything.  The failed step's requests are aborted and nothing cached survives."""
    llm = make(tiny_dir, HOST_GIB)
    first, _ = generate(llm, "a", A, 8)
    generate(llm, "b", B, 8)
    engine = llm.engine
    execute = engine.executor.execute

    def failing(output):
        if output.blocks_from_host:
            raise RuntimeError("injected: the copies did not run")
        return execute(output)

    engine.executor.execute = failing
    engine.add_request("a2", A, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(StepFailedError):
        engine.step()
    engine.executor.execute = execute
    assert engine.cache_manager.host.num_used_slots == 0
    assert engine.cache_manager.pool.num_cached_blocks == 0
    assert generate(llm, "a3", A, 8)[0] == first  # recomputed from scratch
    engine.cache_manager.check_invariants()


def test_the_host_tier_needs_prefix_caching(tiny_dir):
    with pytest.raises(ParameterError, match="--kv-offloading-size"):
        make(tiny_dir, HOST_GIB, enable_prefix_caching=False)


def test_blocks_the_host_tier_drops_come_back_from_disk_and_after_a_restart(tiny_dir, tmp_path):
    """A 5-block host tier over a disk tier: A's blocks go device -> host -> disk as B and C
    pass; A again finds them on disk, bit for bit, and so does a new engine on the folder.
    (A hit's run goes through at most the host's unpinned slots: 5 >= A's 4 blocks.)"""
    C = [(i * 7727) % 40000 + 13 for i in range(150)]
    # threshold 1: every drop moves down (2 would keep A, seen once, in the full host)
    disk = dict(kv_offloading_dir=str(tmp_path), kv_offloading_dir_size=2**20,
                kv_offloading_store_threshold=1)  # fmt: skip
    llm = make(tiny_dir, 5 * BLOCK_BYTES / 2**30, **disk)
    assert llm.engine.sizing.num_disk_blocks == 128
    first, kv_first = generate(llm, "a", A, 8)
    generate(llm, "b", B, 8)
    generate(llm, "c", C, 8)
    host = llm.engine.cache_manager.host
    assert host.disk is not None and host.disk.stats.num_written_blocks >= 2
    again, kv_again = generate(llm, "a2", A, 8)
    stats = llm.engine.get_stats()
    assert host.disk.stats.num_read_blocks == 4  # all of A's blocks came back from disk
    assert stats.prefix_cache_host_hits == stats.prefix_cache_hits == 64
    assert torch.equal(kv_again, kv_first) and again == first
    llm.engine.executor.driver_worker.runner.disk_blocks.flush()
    restarted = make(tiny_dir, 5 * BLOCK_BYTES / 2**30, **disk)
    assert len(restarted.engine.cache_manager.host.disk) == host.disk.stats.num_written_blocks
    third, kv_third = generate(restarted, "a3", A, 8)
    assert restarted.engine.get_stats().prefix_cache_host_hits == 64  # all 4 blocks, from disk
    assert torch.equal(kv_third, kv_first) and third == first


def test_a_disk_hit_waits_while_others_run_and_a_file_gone_when_read_is_recomputed(
    tiny_dir, tmp_path
):
    """A's 4 blocks are on disk only; when A comes again another server deletes its third
    block's file after the lookup: A waits in the queue for its reads while D runs, then
    loads the first two and recomputes the rest, with the same tokens; no tier is cleared."""
    C = [(i * 7727) % 40000 + 13 for i in range(150)]
    D = [(i * 3571) % 40000 + 17 for i in range(20)]
    disk = dict(kv_offloading_dir=str(tmp_path), kv_offloading_dir_size=2**20,
                kv_offloading_store_threshold=1)  # fmt: skip
    llm = make(tiny_dir, 5 * BLOCK_BYTES / 2**30, **disk)
    first, _ = generate(llm, "a", A, 8)
    generate(llm, "b", B, 8)
    generate(llm, "c", C, 8)
    engine = llm.engine
    blocks = engine.executor.driver_worker.runner.disk_blocks
    blocks.flush()
    start_reads = blocks.start_reads
    read = []

    def deleting_the_third(keys_and_slots):
        assert len(keys_and_slots) == 4
        read.extend(key for key, _ in keys_and_slots)
        block_file(blocks.directory, keys_and_slots[2][0]).unlink()
        start_reads(keys_and_slots)

    blocks.start_reads = deleting_the_third
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a2", A, params)
    engine.add_request("d", D, params)
    engine.step()
    assert "d" in engine.cache_manager.block_tables  # d runs while a2 waits for its reads
    assert "a2" not in engine.cache_manager.block_tables
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert done["a2"] == first
    disk_tier = engine.cache_manager.host.disk
    assert disk_tier.stats.num_lost_blocks == 1 and blocks.num_failed_reads == 1
    assert engine.get_stats().prefix_cache_host_hits == 32  # 2 blocks; the rest recomputed
    assert [key in disk_tier for key in read] == [True, True, False, True]  # none cleared
    engine.cache_manager.check_invariants()


def test_the_prefix_store_is_read_lazily_under_a_host_tier_and_bit_for_bit(tiny_dir, tmp_path):
    """--prefix-cache-dir read when a request needs it: after a restart nothing is read at
    start-up; B fills the device, then A's stored blocks are read back into blocks evicted
    from B (whose K/V go to the host tier first), and both come back bit for bit."""
    store = dict(prefix_cache_dir=str(tmp_path))
    llm = make(tiny_dir, HOST_GIB, **store)
    first, kv_first = generate(llm, "a", A, 8)
    llm.engine.close()  # writes the store
    restarted = make(tiny_dir, HOST_GIB, **store)
    assert restarted.engine.cache_manager.pool.num_cached_blocks == 0  # indexed, not read
    b_first, kv_b = generate(restarted, "b", B, 8)
    again, kv_again = generate(restarted, "a2", A, 8)
    assert restarted.engine.get_stats().prefix_cache_hits == 64  # A's 4 blocks, from disk
    assert torch.equal(kv_again, kv_first) and again == first
    b_again, kv_b_again = generate(restarted, "b2", B, 8)
    assert torch.equal(kv_b_again, kv_b) and b_again == b_first
    restarted.engine.close()
