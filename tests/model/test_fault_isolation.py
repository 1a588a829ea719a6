"""The engine under faults and parallel sampling (tiny random Llama, float32):

* a step that raises aborts only the user requests it computed (blocks freed, invariants
  hold), names them in StepFailedError, and the engine goes on: the other requests finish
  with the same tokens as when run alone;
* bad ids never reach the model: an out-of-vocabulary stop token id is a ParameterError;
* cached_tokens counts prefix-cache hits only: 0 with caching off, and forked siblings of
  n > 1 are not hits.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import StepFailedError
from kvserve.errors import ParameterError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPT = [(i * 7919) % 40000 + 7 for i in range(40)]  # 2 full 16-token blocks + 8 tokens
POISON = 4242


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return str(tiny_model_dir("llama3")[0])


def make(tiny_dir: str, caching: bool = True) -> LLM:
    return LLM(tiny_dir, enable_prefix_caching=caching, max_model_len=256, block_size=16,
               kv_cache_memory=4 * 2**20, dtype="float32")  # fmt: skip


def poison_runner(llm: LLM) -> None:
    """Make the model raise in any step that computes POISON (as a kernel bug would)."""
    runner = llm.engine.executor.driver_worker.runner
    execute = runner.execute

    def poisoned(output):  # noqa: ANN001, ANN202
        if any(POISON in item.token_ids for item in output.scheduled):
            raise RuntimeError("injected failure")
        return execute(output)

    runner.execute = poisoned


def test_a_failing_step_aborts_only_its_requests(tiny_dir):
    llm = make(tiny_dir)
    engine = llm.engine
    alone = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    poison_runner(llm)
    engine.add_request("good", PROMPT, GREEDY)
    engine.step()  # good's prefill
    engine.step()  # and one decode: it is running when the poisoned request arrives
    engine.add_request("bad", [1, 2, POISON], GREEDY)
    with pytest.raises(StepFailedError) as failure:
        engine.step()
    assert sorted(failure.value.request_ids) == ["bad", "good"]  # the step computed both
    assert isinstance(failure.value.cause, RuntimeError)
    engine.cache_manager.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.cache_manager.num_free_blocks == engine.sizing.num_blocks
    # The engine goes on: the same request again gives the tokens it gives alone.
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == alone


def test_a_request_in_another_step_is_not_failed(tiny_dir):
    llm = make(tiny_dir)
    engine = llm.engine
    alone = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    poison_runner(llm)
    engine.add_request("bad", [1, 2, POISON], GREEDY)
    with pytest.raises(StepFailedError) as failure:
        engine.step()
    assert failure.value.request_ids == ["bad"]
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == alone


def test_out_of_vocabulary_stop_token_id_never_reaches_the_model(tiny_dir):
    llm = make(tiny_dir)
    params = SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[1_000_000_000])
    with pytest.raises(ParameterError) as err:
        llm.engine.add_request("x", [1, 2, 3], params)
    assert err.value.param == "stop_token_ids" and "1000000000" in str(err.value)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("caching", [True, False])
def test_cached_tokens_count_only_prefix_cache_hits(tiny_dir, n, caching):
    llm = make(tiny_dir, caching)
    params = SamplingParams(n=n, temperature=1.0, seed=3, max_tokens=4)
    first = llm.generate([PROMPT], params)[0]
    assert len(first.outputs) == n
    assert first.num_cached_tokens == 0  # siblings share the prompt by fork, not by hit
    again = llm.generate([PROMPT], params)[0]
    assert again.num_cached_tokens == (32 if caching else 0)
