"""The deployment command this project exists for, as the article writes it for vLLM:

    kvserve serve MODEL --gpu-memory-utilization 0.90 --max-model-len 32768 \
        --dtype float16 --enable-prefix-caching --kv-cache-dtype fp8

Every flag parses into the config it names, and on CUDA that config takes float16 compute,
an fp8 (e4m3) KV cache and the FlexAttention backend.  (On a CPU with the embedded model it
exits 2, naming --max-model-len: 32,768 is past the model's 8,192 trained tokens;
tests/model/test_start_up_checks.py covers that refusal.)  The command itself runs on a GPU in
tests/gpu/test_cuda_parity.py."""

from __future__ import annotations

import torch

from kvserve.attention import describe, select_backend
from kvserve.cli import build_parser
from kvserve.flags import engine_config_from_args
from kvserve.kv.spec import kv_cache_spec
from kvserve.native import platform

ARTICLE = (
    "serve MODEL --gpu-memory-utilization 0.90 --max-model-len 32768 --dtype float16 "
    "--enable-prefix-caching --kv-cache-dtype fp8"
).split()


def test_the_article_flags_parse_into_the_expected_config():
    args = build_parser().parse_args(ARTICLE)
    config = engine_config_from_args(args)
    assert config.load.model == "MODEL"
    assert config.cache.gpu_memory_utilization == 0.90
    assert config.scheduler.max_model_len == 32768
    assert config.load.dtype == "float16"
    assert config.cache.enable_prefix_caching is True
    assert config.cache.kv_cache_dtype == "fp8"
    assert config.load.attention_backend == "auto" and config.cache.block_size == 16


def test_on_cuda_the_article_takes_float16_fp8_and_flex():
    cuda = torch.device("cuda")
    assert platform.resolve_dtype("float16", cuda, "bfloat16") == torch.float16
    # Llama-3-8B's shape: 32 layers x 8 KV heads x 128: 1 byte per value plus one float32
    # scale per (token, head), for K and V: 2 x 32 x 8 x (128 + 4) = 67,584 bytes per token,
    # 51.6% of float16's 131,072.
    spec = kv_cache_spec(32, 8, 128, "fp8", "float16", 16)
    assert spec.dtype == "fp8_e4m3" and spec.bytes_per_token == 67_584
    assert kv_cache_spec(32, 8, 128, "auto", "float16", 16).bytes_per_token == 131_072
    # Construction compiles nothing, so the CUDA choice is checked on any machine.
    assert describe(select_backend("auto", cuda)) == "flex (compiled)"
