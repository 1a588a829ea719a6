"""The start-up check of an 8-bit KV cache on the embedded model: the line it logs, a refusal
in a case built to fail (an absurdly strict minimum agreement) naming a dtype that passes, and
the fallback to that dtype.  One canary, shared: each dtype's comparison is computed once."""

from __future__ import annotations

import logging

import pytest

from kvserve.config import CacheConfig, EngineConfig, LoadConfig
from kvserve.errors import ParameterError
from kvserve.evaluation.kv_eval import load_model
from kvserve.executor.kv_dtype_check import Canary, canary_token_ids, check_kv_cache_dtype


@pytest.fixture(scope="module")
def canary() -> Canary:
    loaded = load_model(EngineConfig(load=LoadConfig(dtype="float32")))
    token_ids = canary_token_ids(loaded.tokenizer)
    return Canary(loaded.model, loaded.config, token_ids, loaded.dtype, 16, loaded.device)


def test_the_default_minimum_passes_every_8_bit_dtype_and_logs_one_line(canary, caplog):
    for kv_dtype in ("fp8", "fp8_e5m2", "int8"):
        with caplog.at_level(logging.INFO, logger="kvserve"):
            assert check_kv_cache_dtype(CacheConfig(kv_cache_dtype=kv_dtype), lambda: canary) == (
                kv_dtype
            )
    lines = [r.getMessage() for r in caplog.records if "KV cache dtype check:" in r.message]
    assert len(lines) == 3 and all(line.endswith(": pass") for line in lines)
    assert lines[0].startswith("KV cache dtype check: fp8_e4m3 vs float32 over 267 positions")
    assert "largest logit difference" in lines[0] and "top-1 agreement" in lines[0]


def test_a_failing_dtype_is_refused_naming_one_that_passes(canary):
    strict = CacheConfig(kv_cache_dtype="fp8_e5m2", kv_cache_dtype_check_min_agreement=1.0)
    with pytest.raises(ParameterError) as refused:
        check_kv_cache_dtype(strict, lambda: canary)
    message = str(refused.value)
    assert refused.value.param == "--kv-cache-dtype"
    assert "fp8_e5m2 fails the start-up check" in message and "below 100.0%" in message
    passing = {r.kv_dtype for r in canary._results.values() if r.agreement >= 1.0} | {"auto"}
    named = message.split(": use --kv-cache-dtype ")[1].split(",")[0]
    assert named in passing


def test_fallback_uses_the_dtype_that_passes(canary, caplog):
    strict = CacheConfig(
        kv_cache_dtype="fp8_e5m2", kv_cache_dtype_check="fallback",
        kv_cache_dtype_check_min_agreement=1.0,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        chosen = check_kv_cache_dtype(strict, lambda: canary)
    assert chosen != "fp8_e5m2"
    assert f"using --kv-cache-dtype {chosen} instead" in caplog.text
    off = CacheConfig(kv_cache_dtype="fp8_e5m2", kv_cache_dtype_check="off")
    assert check_kv_cache_dtype(off, lambda: pytest.fail("no canary when off")) == "fp8_e5m2"
