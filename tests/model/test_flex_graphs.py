"""The flex backend's decodes through the CUDA graph runner (runner/cuda_graphs.py): its
padded batches (pad rows on the scratch block past the pool, tables padded to the graph's
width with it) give the tokens of flex without graphs.  On a CPU the runner pads but does not
record; on CUDA (skipped without it) the graphs record compiled flex and replay it."""

from __future__ import annotations

import pytest
from test_cuda_graphs import CUDA, PARAMS, PROMPTS, count_graph_runs, make

from kvserve.attention.flex import FlexAttentionBackend
from kvserve.runner import cuda_graphs


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return str(tiny_model_dir("llama3")[0])


def check_flex_graphs(tiny_dir, device: str, kv_cache_dtype: str, monkeypatch):
    kw = dict(attention_backend="flex", kv_cache_dtype=kv_cache_dtype, kv_cache_dtype_check="off")
    plain = make(tiny_dir, device, **kw)
    assert plain.engine.executor.driver_worker.runner.cuda_graphs is None
    reference = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS)]
    monkeypatch.setattr(cuda_graphs, "graphs_enabled", lambda device, enforce_eager: True)
    llm = make(tiny_dir, device, **kw)
    monkeypatch.undo()
    assert isinstance(llm.engine.executor.driver_worker.backend, FlexAttentionBackend)
    worker = llm.engine.executor.driver_worker
    assert worker.runner.cuda_graphs is not None  # flex declares a graph-safe decode
    served = count_graph_runs(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference
    assert len(served) == PARAMS.max_tokens - 1  # every decode step went through a graph
    return llm


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_flex_through_the_graph_runner_gives_its_tokens_on_a_cpu(
    tiny_dir, kv_cache_dtype, monkeypatch
):
    check_flex_graphs(tiny_dir, "cpu", kv_cache_dtype, monkeypatch)


@CUDA
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_flex_cuda_graphs_replay_its_tokens(tiny_dir, kv_cache_dtype, monkeypatch):
    llm = check_flex_graphs(tiny_dir, "cuda", kv_cache_dtype, monkeypatch)
    graphs = llm.engine.executor.driver_worker.runner.cuda_graphs._graphs
    assert graphs and all(graph is not None for graph, _ in graphs.values())
    backend = llm.engine.executor.driver_worker.backend
    assert backend.compiled  # recorded the compiled kernel, no eager fall-back
