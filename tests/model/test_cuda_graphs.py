"""Decode steps through the CUDA graph runner (runner/cuda_graphs.py).

On a CPU the graphs cannot be recorded, but everything around them runs: the static buffers,
the padding of a batch to the next captured size and block-table width, the pad rows writing
into the scratch pad block outside the pool.  Greedy tokens must equal an engine without
graphs.  On CUDA (skipped without it) the graphs are recorded and replayed for real."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.runner import cuda_graphs

PROMPTS = [[(i * 7919 + j * 31) % 40000 + 7 for i in range(n)] for j, n in enumerate((10, 50, 70))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return str(tiny_model_dir("llama3")[0])


def make(tiny_dir, device: str, **kw) -> LLM:
    """Block size 4 and 256 tokens: widths 16, 32, 64 blocks; batch sizes 1, 2, 4, 8."""
    kw.setdefault("attention_backend", "torch")  # the graph-safe one
    return LLM(
        tiny_dir, device=device, dtype="float32", block_size=4, max_model_len=256,
        kv_cache_memory=200 * 4 * 512, max_num_seqs=8, **kw,
    )  # fmt: skip


def with_graphs(tiny_dir, device: str, monkeypatch) -> LLM:
    """An engine whose decode steps go through the graph runner (enforce_eager stays on in the
    suite, so torch.compile stays off and only the graphs differ)."""
    monkeypatch.setattr(cuda_graphs, "graphs_enabled", lambda device, enforce_eager: True)
    llm = make(tiny_dir, device)
    monkeypatch.undo()
    return llm


def count_graph_runs(llm: LLM) -> list[tuple[int, int]]:
    """The (batch size, longest table) of every decode step a graph served, from now on."""
    graphs = llm.engine.executor.driver_worker.runner.cuda_graphs
    served: list[tuple[int, int]] = []
    run = graphs.run

    def counting(input_ids, positions, slot_mapping, seq_lens, block_tables):
        out = run(input_ids, positions, slot_mapping, seq_lens, block_tables)
        if out is not None:
            served.append(tuple(block_tables.shape))
        return out

    graphs.run = counting
    return served


def check_graphs_match_eager(tiny_dir, device: str, monkeypatch) -> LLM:
    eager = make(tiny_dir, device)
    assert eager.engine.executor.driver_worker.runner.cuda_graphs is None
    reference = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, PARAMS)]
    llm = with_graphs(tiny_dir, device, monkeypatch)
    assert llm.engine.executor.driver_worker.graph_plan.batch_sizes == (1, 2, 4, 8)
    assert llm.engine.executor.driver_worker.graph_plan.block_widths == (16, 32, 64)
    pad = llm.engine.sizing.num_blocks  # the scratch block, outside the pool
    assert llm.engine.executor.kv_caches[0].key.shape[0] == pad + 1
    served = count_graph_runs(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    # 3 decodes (padded to 4) with tables of 4..23 blocks (padded to 16, then 32).
    assert len(served) == PARAMS.max_tokens - 1
    assert {rows for rows, _ in served} == {3} and max(c for _, c in served) > 16
    assert llm.generate([PROMPTS[1]], PARAMS)[0].outputs[0].token_ids == reference[1]  # alone
    llm.engine.cache_manager.check_invariants()
    return llm


def test_padded_decode_batches_give_the_eager_tokens_on_a_cpu(tiny_dir, monkeypatch):
    llm = check_graphs_match_eager(tiny_dir, "cpu", monkeypatch)
    graphs = llm.engine.executor.driver_worker.runner.cuda_graphs
    assert all(graph is None for graph, _ in graphs._graphs.values())


@CUDA
def test_cuda_graphs_replay_the_eager_tokens(tiny_dir, monkeypatch):
    llm = check_graphs_match_eager(tiny_dir, "cuda", monkeypatch)
    graphs = llm.engine.executor.driver_worker.runner.cuda_graphs._graphs
    assert len(graphs) == 12 and all(graph is not None for graph, _ in graphs.values())


def test_a_failed_capture_leaves_the_engine_eager_with_a_warning(tiny_dir, monkeypatch, caplog):
    def fail(self, record=True):
        raise RuntimeError("operation not permitted when stream is capturing\ndetails")

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", fail)
    with caplog.at_level("WARNING", logger="kvserve"):
        llm = with_graphs(tiny_dir, "cpu", monkeypatch)
    assert llm.engine.executor.driver_worker.runner.cuda_graphs is None
    assert "CUDA graph capture failed, decoding eagerly (RuntimeError: operation not " in (
        caplog.text
    )
    assert len(llm.generate([PROMPTS[0]], PARAMS)[0].outputs[0].token_ids) == 20


@CUDA
def test_enforce_eager_turns_the_graphs_off_on_cuda(tiny_dir):
    eager = make(tiny_dir, "cuda", enforce_eager=True)
    assert eager.engine.executor.driver_worker.runner.cuda_graphs is None


@CUDA
def test_a_replayed_graph_equals_the_eager_forward(tiny_dir, monkeypatch):
    llm = with_graphs(tiny_dir, "cuda", monkeypatch)
    graphs = llm.engine.executor.driver_worker.runner.cuda_graphs
    ids = torch.tensor([5, 6, 7], device="cuda")
    positions = torch.tensor([0, 0, 0], device="cuda")
    slots = torch.tensor([0, 4, 8], device="cuda")  # blocks 0, 1, 2: one token each
    seq_lens = torch.ones(3, dtype=torch.long, device="cuda")
    tables = torch.tensor([[0], [1], [2]], device="cuda")
    with torch.inference_mode():
        replayed = graphs.run(ids, positions, slots, seq_lens, tables).clone()
        graphs._fill(4, 16, ids, positions, slots, seq_lens, tables)
        eager = graphs.forward(4, 16)[:3]
    torch.testing.assert_close(replayed, eager)
