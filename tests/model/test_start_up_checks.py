"""Start-up refusals on a real engine (tiny llama, trained for 512 positions): --max-model-len
past the trained context, a KV budget that would leave the host short of memory, and flags
that do not exist (no --swap-space); each reaches the CLI as one line and exit code 2."""

from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.cli import build_parser, main
from kvserve.engine.sizing import ALLOW_LONG_ENV, CapacityError


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama3")[0])


def make(tiny_dir: str, **kw) -> LLM:
    return LLM(tiny_dir, dtype="float32", kv_cache_memory=2**20, **kw)


def test_max_model_len_past_the_trained_context_is_refused(tiny_dir, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    with pytest.raises(ValueError, match="--max-model-len 1024 exceeds the model's trained"):
        make(tiny_dir, max_model_len=1024)
    assert make(tiny_dir, max_model_len=512).engine.max_model_len == 512
    assert make(tiny_dir).engine.max_model_len == 512  # the default is the trained context


def test_the_override_by_keyword_or_environment(tiny_dir, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    llm = make(tiny_dir, max_model_len=1024, allow_long_max_model_len=True)
    assert llm.engine.max_model_len == llm.engine.scheduler.max_model_len == 1024
    monkeypatch.setenv(ALLOW_LONG_ENV, "1")
    assert make(tiny_dir, max_model_len=1024).engine.max_model_len == 1024


def test_cli_names_the_reason_and_the_override(tiny_dir, monkeypatch, capsys):
    monkeypatch.delenv(ALLOW_LONG_ENV, raising=False)
    argv = ["generate", tiny_dir, "--dtype", "float32", "--kv-cache-memory", "1MiB",
            "--max-tokens", "2", "--no-chat", "--prompt", "Hi"]  # fmt: skip
    assert main([*argv, "--max-model-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert "trained context of 512 tokens" in err and "--allow-long-max-model-len" in err
    assert main([*argv, "--max-model-len", "1024", "--allow-long-max-model-len"]) == 0


def test_a_kv_budget_that_starves_the_host_is_refused(tiny_dir, capsys):
    with pytest.raises(CapacityError, match="the largest safe values are --kv-cache-memory"):
        LLM(tiny_dir, dtype="float32", kv_cache_memory=2**50)
    assert main(["generate", tiny_dir, "--kv-cache-memory", "1024TiB"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("kvserve generate: error: --kv-cache-memory 1024.0 TiB would leave")
    assert "--gpu-memory-utilization 0." in err


def test_swap_space_is_not_a_flag():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--swap-space", "4"])
    args = parser.parse_args(["serve", "--allow-long-max-model-len"])
    assert args.allow_long_max_model_len is True and not hasattr(args, "swap_space")


@pytest.mark.parametrize("command", ["serve", "generate", "eval-kv"])
def test_help_renders(command, capsys):
    """argparse %-formats help texts: a bare '%' in a field's help breaks --help."""
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0 and "--max-model-len" in capsys.readouterr().out
