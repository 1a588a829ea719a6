"""Tensor parallelism: the ranks' shards against the whole model, in one process.

Each rank runs on a thread of its own with a real gloo process group (the same code the
worker processes run, minus the process start-up, which the e2e tests cover): greedy tokens
must equal one rank's exactly, logits agree within LOGITS_TOLERANCE, and each rank holds its
share of the weights and the KV cache, counted from the tensors' sizes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.config import ModelConfig
from kvserve.errors import ParameterError
from kvserve.executor import layer_kernels
from kvserve.executor.base import split_cpu_plan
from kvserve.executor.collective import make_process_group
from kvserve.executor.layer_kernels import choose_layer_kernels
from kvserve.kv.spec import kv_cache_spec
from kvserve.models.llama import EAGER, LlamaForCausalLM
from kvserve.models.loader import load_checkpoint
from kvserve.models.parallel import TPGroup, build_sharded_model, shard_plan
from kvserve.native.platform import CpuThreadPlan
from kvserve.request import SamplingParams
from kvserve.runner.model_runner import build_attention_metadata, build_batch_input
from kvserve.step import ScheduledRequest

CPU = torch.device("cpu")
BLOCK_SIZE = 4
PROMPT = [1, 504, 3224, 282, 4649, 314, 5483, 30, 2, 1000, 1003, 1006, 1009]
NUM_TOKENS = 8
# float32: the ranks sum the same products in another order (partial sums all-reduced);
# observed max |difference| 2.5e-5 on the embedded model (logits up to 34), 1.3e-6 on the
# random one: 1e-3 leaves a margin of 40x.
LOGITS_TOLERANCE = 1e-3

RANDOM_8Q_2KV = ModelConfig(
    architecture="llama", vocab_size=8000, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip


def random_weights(config: ModelConfig, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Weights under our names; scale 0.1 gives sharp attention (see tests/conftest.py)."""
    gen = torch.Generator().manual_seed(0)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    shapes = {"embed_tokens.weight": (config.vocab_size, h), "norm.weight": (h,),
              "lm_head.weight": (config.vocab_size, h)}  # fmt: skip
    for i in range(config.num_layers):
        shapes |= {
            f"layers.{i}.qkv_proj.weight": (qkv, h),
            f"layers.{i}.o_proj.weight": (h, config.num_heads * d),
            f"layers.{i}.gate_up_proj.weight": (2 * inter, h),
            f"layers.{i}.down_proj.weight": (h, inter),
            f"layers.{i}.input_layernorm.weight": (h,),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
        }
    return {
        name: 1 + torch.randn(shape, generator=gen) * scale
        if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * scale
        for name, shape in shapes.items()
    }  # fmt: skip


@pytest.fixture(scope="module")
def embedded():
    checkpoint = load_checkpoint(None)
    return checkpoint.config, checkpoint.weights


@torch.inference_mode()
def greedy(model, config: ModelConfig, num_kv_heads: int) -> tuple[list[int], torch.Tensor]:
    """Prefill PROMPT, then NUM_TOKENS greedy decode steps through the paged cache; the tokens
    and the logits of every step [NUM_TOKENS, vocab]."""
    spec = replace(
        kv_cache_spec(config.num_layers, config.num_kv_heads, config.head_dim, "auto",
                      "float32", BLOCK_SIZE),
        num_kv_heads=num_kv_heads,
    )  # fmt: skip
    caches = allocate_kv_caches(spec, 16, CPU)
    table = list(range(16))
    tokens, logits, step_ids, start = [], [], list(PROMPT), 0
    for _ in range(NUM_TOKENS):
        request = ScheduledRequest("r", step_ids, start, table, True,
                                   SamplingParams(temperature=0.0), 0, frozenset())  # fmt: skip
        batch = build_batch_input([request], BLOCK_SIZE, CPU)
        metadata = build_attention_metadata(batch, BLOCK_SIZE)
        hidden = model(batch.input_ids, batch.positions, caches, metadata, TorchRefBackend())
        row = model.compute_logits(hidden[batch.logits_indices])[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
        start += len(step_ids)
        step_ids = [tokens[-1]]
    return tokens, torch.stack(logits)


def on_ranks(tp: int, work: Callable[[int, TPGroup], object]) -> list[object]:
    """`work(rank, group)` on `tp` threads joined by a gloo group; the results by rank."""
    master = dist.TCPStore("127.0.0.1", 0, tp, True, wait_for_workers=False)
    results: list[object] = [None] * tp
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            store = master if rank == 0 else dist.TCPStore("127.0.0.1", master.port, tp, False)
            group = TPGroup(make_process_group(store, "device", "gloo", rank, tp), rank, tp)
            results[rank] = work(rank, group)
        except BaseException as exc:  # noqa: BLE001 - re-raised below on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(tp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


def sharded_greedy(config: ModelConfig, weights, tp: int) -> list[tuple[list[int], torch.Tensor]]:
    shards = shard_plan(config, tp)

    def work(rank: int, group: TPGroup):
        model = build_sharded_model(LlamaForCausalLM, config, weights, shards[rank], group,
                                    torch.float32, CPU)  # fmt: skip
        return greedy(model, config, len(shards[rank].kv_heads))

    return on_ranks(tp, work)  # type: ignore[return-value]


def whole_greedy(config: ModelConfig, weights) -> tuple[list[int], torch.Tensor]:
    model = LlamaForCausalLM.from_weights(config, weights, torch.float32, CPU)
    return greedy(model, config, config.num_kv_heads)


def assert_parity(config: ModelConfig, weights, tp: int) -> None:
    tokens, logits = whole_greedy(config, weights)
    for rank_tokens, rank_logits in sharded_greedy(config, weights, tp):
        assert rank_tokens == tokens
        assert (rank_logits - logits).abs().max().item() < LOGITS_TOLERANCE


def test_embedded_model_tp2_equals_tp1(embedded):
    """SmolLM2: 9 query / 3 KV heads on 2 ranks, split 6+3 / 2+1."""
    assert_parity(*embedded, tp=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_random_8q_2kv_model_equals_tp1(tp):
    """8 query / 2 KV heads: split 4+1 each at TP 2; at TP 4 each KV head is replicated on two
    ranks, which split its four query heads."""
    assert_parity(RANDOM_8Q_2KV, random_weights(RANDOM_8Q_2KV), tp)


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
def test_tiny_checkpoints_equal_tp1(tiny_model_dir, arch):
    """Qwen2 (QKV bias, tied embeddings) and Llama 3 (RoPE scaling, untied LM head) from
    their saved checkpoints: 4 query / 2 KV heads on 2 ranks."""
    checkpoint = load_checkpoint(str(tiny_model_dir(arch, 0.1)[0]))
    assert checkpoint.config.attention_bias == (arch == "qwen2")
    assert_parity(checkpoint.config, checkpoint.weights, tp=2)


def test_the_cpu_thread_plan_is_shared_out_among_the_ranks():
    pinned = CpuThreadPlan((1, 2, 3, 4, 5), pin=True, server_cpus=(0,))
    assert split_cpu_plan(pinned, 2, pin_workers=True) == (
        CpuThreadPlan((1, 2, 3), pin=True, server_cpus=(0,)),
        CpuThreadPlan((4, 5), pin=True),
    )
    assert split_cpu_plan(pinned, 2, pin_workers=False)[1] == CpuThreadPlan((4, 5), pin=False)
    two = CpuThreadPlan((0, 1), pin=False)  # `auto` on this 2-core machine: one thread each
    assert split_cpu_plan(two, 2, True) == (CpuThreadPlan((0,), False), CpuThreadPlan((1,), False))
    one = CpuThreadPlan((0,), pin=False)
    assert split_cpu_plan(one, 2, True) == (one, one)
    assert split_cpu_plan(None, 3, True) == (None, None, None)  # OMP_NUM_THREADS decides


def test_shard_plan_of_the_head_rules():
    smol = shard_plan(replace(RANDOM_8Q_2KV, num_heads=9, num_kv_heads=3), 2)
    assert [(s.q_heads, s.kv_heads) for s in smol] == [
        (range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]  # fmt: skip
    replicated = shard_plan(RANDOM_8Q_2KV, 4)
    assert [(s.q_heads, s.kv_heads) for s in replicated] == [
        (range(0, 2), range(0, 1)), (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)), (range(6, 8), range(1, 2))]  # fmt: skip
    assert [s.vocab for s in replicated] == [range(0, 2000), range(2000, 4000), range(4000, 6000),
                                             range(6000, 8000)]  # fmt: skip
    with pytest.raises(ParameterError, match="--tensor-parallel-size"):
        shard_plan(RANDOM_8Q_2KV, 3)  # 2 KV heads cannot be replicated evenly on 3 ranks


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_each_rank_holds_its_share_of_weights_and_kv(embedded):
    """Bytes counted from the tensors each rank allocates: the MLP and vocabulary split in
    halves, the attention by heads (6/9 and 3/9 of the query heads, 2/3 and 1/3 of the KV
    heads: 3 KV heads cannot split evenly in two), the norms replicated."""
    config, weights = embedded
    whole = LlamaForCausalLM.from_weights(config, weights, torch.float32, CPU)
    whole_bytes = tensor_bytes(whole.parameters())
    shards = shard_plan(config, 2)

    def work(rank: int, group: TPGroup):
        model = build_sharded_model(LlamaForCausalLM, config, weights, shards[rank], group,
                                    torch.float32, CPU)  # fmt: skip
        return tensor_bytes(model.parameters())

    rank_bytes = on_ranks(2, work)
    h, d, L = config.hidden_size, config.head_dim, config.num_layers  # noqa: N806
    norms = 4 * (2 * L + 1) * h
    mlp_and_vocab = 4 * (L * 3 * config.intermediate_size * h // 2 + config.vocab_size * h // 2)
    attention = [4 * L * h * d * (2 * q + 2 * kv) for q, kv in ((6, 2), (3, 1))]
    assert rank_bytes == [
        norms + mlp_and_vocab + attention[0],
        norms + mlp_and_vocab + attention[1],
    ]
    assert sum(rank_bytes) == whole_bytes + norms  # nothing duplicated but the norms
    assert max(rank_bytes) / whole_bytes < 0.56  # 0.548: rank 0 holds the extra KV head

    num_blocks = 10
    whole_spec = kv_cache_spec(L, config.num_kv_heads, d, "auto", "float32", BLOCK_SIZE)
    tp_spec = kv_cache_spec(L, config.num_kv_heads, d, "auto", "float32", BLOCK_SIZE, 2)
    assert tp_spec.num_kv_heads == 2  # sized for the largest share, rank 0's
    kv_bytes = [
        tensor_bytes(t for c in allocate_kv_caches(replace(tp_spec, num_kv_heads=len(s.kv_heads)),
                                                   num_blocks, CPU) for t in (c.key, c.value))
        for s in shards
    ]  # fmt: skip
    whole_kv = num_blocks * whole_spec.bytes_per_block
    assert kv_bytes == [whole_kv * 2 // 3, whole_kv // 3]
    assert kv_bytes[0] == num_blocks * tp_spec.bytes_per_block  # the accounting's per-rank bytes


def test_ranks_compile_together_or_run_eagerly_together(monkeypatch):
    """N ranks cannot fall back apart (executor/layer_kernels.py): where one rank cannot
    compile, no rank compiles nor warms up; a compile that fails later on is raised (the
    start-up ends) where one rank alone falls back to eager."""
    model = LlamaForCausalLM.from_weights(RANDOM_8Q_2KV, random_weights(RANDOM_8Q_2KV),
                                          torch.float32, CPU)  # fmt: skip
    monkeypatch.setattr(layer_kernels, "_compiles_here", lambda model: True)

    def never() -> None:
        pytest.fail("no warm-up: another rank cannot compile")

    def failing() -> None:
        raise RuntimeError("inductor failed")

    choose_layer_kernels(model, never, False, 2, all_ranks=lambda ok: False)
    assert model.kernels is EAGER and model.native_layers is None
    with pytest.raises(RuntimeError, match="inductor failed"):
        choose_layer_kernels(model, failing, False, 2, all_ranks=lambda ok: ok)
    alone = LlamaForCausalLM.from_weights(RANDOM_8Q_2KV, random_weights(RANDOM_8Q_2KV),
                                          torch.float32, CPU)  # fmt: skip
    choose_layer_kernels(alone, failing, False, 1, all_ranks=lambda ok: pytest.fail("asked"))
    assert alone.kernels is EAGER
