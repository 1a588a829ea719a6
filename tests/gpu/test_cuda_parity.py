"""CUDA parity (run by benchmarks/gpu_check.sh on a GPU machine; skipped without CUDA):

* the embedded model's greedy tokens on CUDA in float32 equal the CPU float32 path's, with
  the reference backend and with FlexAttention;
* its logits in float16 and bfloat16 on CUDA stay within tolerance of the CPU float32 logits
  (the tolerances were measured with the same code on a CPU: see LOGIT_TOL);
* the compiled FlexAttention backend equals the reference on CUDA for a whole step (decodes
  and prefills with cached context), for each KV dtype;
* the article's configuration (float16, fp8 KV, prefix caching, backend auto) starts on CUDA
  with FlexAttention and generates.
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_cases import KV_DTYPES, SHAPES, filled_cache, mixed_step

from kvserve import LLM, SamplingParams
from kvserve.attention import describe, select_backend
from kvserve.attention.flex import FlexAttentionBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.evaluation.paged import Piece, allocate_cache, contiguous_tables, forward_hidden
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import load_checkpoint

# KVSERVE_GPU_CHECK_DRY_RUN=1 runs the same tests on the CPU (flex eager there): the GPU
# check's --dry-run, so that this module is known to run before a GPU is spent on it.
DRY_RUN = os.environ.get("KVSERVE_GPU_CHECK_DRY_RUN") == "1"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not DRY_RUN,
    reason="needs CUDA (KVSERVE_GPU_CHECK_DRY_RUN=1 runs it on the CPU)",
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda") if torch.cuda.is_available() else CPU  # CPU: the dry run
COMPILED = CUDA.type == "cuda"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Max |logit - float32 logit| over a 40-token prompt of the embedded model, measured on a
# CPU with this module's prompt_logits: bfloat16 1.03, float16 0.090, and the argmax a
# float32 argmax each time (2026-12-01); the bounds leave about 2x for a GPU's other kernels.
LOGIT_TOL = {torch.bfloat16: 2.0, torch.float16: 0.25}
TEXT = "A paged KV cache stores keys and values in fixed-size blocks, so memory is " * 3


def engine_tokens(device: torch.device, backend: str, **kwargs) -> list[list[int]]:
    llm = LLM(
        device=str(device), attention_backend=backend, kv_cache_memory=256 * 2**20,
        max_model_len=1024, **kwargs,
    )  # fmt: skip
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def cpu_float32_tokens():
    return engine_tokens(CPU, "torch", dtype="float32")


@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_float32_greedy_tokens_on_cuda_equal_the_cpu(cpu_float32_tokens, backend):
    assert engine_tokens(CUDA, backend, dtype="float32") == cpu_float32_tokens


def prompt_logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    """All logits [L, vocab] (float32, on the CPU) of one prefill through a paged cache."""
    (table,) = contiguous_tables(1, len(ids), 16)
    dtype = next(model.parameters()).dtype
    cache = allocate_cache(model.config, "auto", dtype, 16, len(table) + 1, device)
    (hidden,) = forward_hidden(model, cache, [Piece("r", ids, 0, table)], device)
    with torch.inference_mode():
        return model.compute_logits(hidden).float().cpu()


def embedded_model(dtype: torch.dtype, device: torch.device):
    ckpt = load_checkpoint(None)
    return LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_on_cuda_stay_near_float32(embedded_tokenizer, dtype):
    ids = embedded_tokenizer.encode(TEXT)[:40]
    reference = prompt_logits(embedded_model(torch.float32, CPU), ids, CPU)
    got = prompt_logits(embedded_model(dtype, CUDA), ids, CUDA)
    assert (got - reference).abs().max().item() < LOGIT_TOL[dtype]
    picked = reference.gather(1, got.argmax(1, keepdim=True))[:, 0]
    assert (reference.max(1).values - picked).max().item() < LOGIT_TOL[dtype]  # near-ties only


# Each KV dtype under float16 compute on the embedded model's shape; then Llama-3-8B's head
# shape (32 / 8 heads of 128) in float16 and float32.  Each new shape or dtype is a Triton
# compile (seconds), so the grid is smaller than the CPU one (tests/unit/test_flex_attention.py).
FLEX_CASES = [(d, torch.float16, *SHAPES[0]) for d in KV_DTYPES] + [
    ("float16", torch.float16, 32, 8, 128, 16),
    ("float32", torch.float32, 32, 8, 128, 16),
]


@pytest.mark.parametrize(
    ("kv_dtype", "compute", "heads", "kv_heads", "dim", "block_size"), FLEX_CASES
)
def test_compiled_flex_equals_the_reference_on_cuda(
    kv_dtype, compute, heads, kv_heads, dim, block_size
):
    gen = torch.Generator().manual_seed(dim + block_size)
    md, num_blocks, num_tokens = mixed_step(block_size, gen, CUDA)
    q, k, v = (torch.randn(num_tokens, h, dim, generator=gen).to(CUDA, compute)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    outputs = []
    for backend in (TorchRefBackend(), FlexAttentionBackend(compiled=COMPILED)):
        cache = filled_cache(kv_dtype, num_blocks, block_size, kv_heads, dim,
                             gen.manual_seed(5), CUDA)  # fmt: skip
        outputs.append(backend.forward(q, k, v, cache, md, dim**-0.5))
        if isinstance(backend, FlexAttentionBackend):
            assert backend.compiled == COMPILED  # no silent fall-back to eager on CUDA
    tol = 2e-5 if compute == torch.float32 else 2e-3
    torch.testing.assert_close(outputs[1], outputs[0], atol=tol, rtol=tol * 5)


def test_the_article_configuration_runs_on_cuda_with_flex():
    """`kvserve serve MODEL --dtype float16 --kv-cache-dtype fp8 --enable-prefix-caching
    --gpu-memory-utilization 0.90` (max_model_len within the embedded model's 8,192 trained
    tokens).  The dry run takes 64 MiB of KV and flex eager instead of 90% of the host."""
    memory = dict(gpu_memory_utilization=0.9, max_model_len=8192)
    if not COMPILED:
        memory = dict(kv_cache_memory=64 * 2**20, max_model_len=512, attention_backend="flex")
    llm = LLM(device=str(CUDA), dtype="float16", kv_cache_dtype="fp8", enable_prefix_caching=True,
              **memory)  # fmt: skip
    engine = llm.engine
    assert engine.executor.dtype == torch.float16 and engine.sizing.spec.dtype == "fp8_e4m3"
    expected = "flex (compiled)" if COMPILED else "flex (eager)"
    assert describe(engine.executor.driver_worker.backend) == expected
    outputs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    backend = engine.executor.driver_worker.backend
    assert describe(backend) == expected  # it compiled: no fall-back to eager
    if COMPILED:
        assert describe(select_backend("auto", CUDA)) == "flex (compiled)"
