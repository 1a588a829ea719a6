"""Bad input at the command line: one line naming the problem, exit code 2, no traceback.

One test runs the module as a process (`python -m kvserve.cli`: the exit code through
sys.exit); the others call cli.main in this process, as that entry point does (a process
each cost 7-10 s of imports on the 2-core CI machine, ~1 minute of the suite, before the
engine's flags and the model path were checked ahead of those imports)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, tmp_path=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """cli.main(args) in this process, as a CompletedProcess (argparse's own errors exit)."""
    from kvserve import cli

    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, proc.stderr
    for needle in needles:
        assert needle in error_lines[0]


def test_missing_model_path(tmp_path):
    proc = run_cli("generate", str(tmp_path / "nope.gguf"))
    assert_one_line_error(proc, "model path does not exist", "nope.gguf")


@pytest.mark.parametrize(
    "args",
    [("serve", "nope.gguf"), ("generate", "--block-size", "12"), ("eval-kv", "--text", "t", ".")],
)
def test_engine_commands_answer_a_bad_flag_or_path_before_importing_torch(tmp_path, args):
    """The engine's flags and the model path are checked before the re-execution with
    tcmalloc and before anything imports torch or the tokenizer: the error comes back in a
    fraction of a second (it took ~8 s, the imports twice)."""
    script = (
        "import sys\n"
        "from kvserve import cli\n"
        f"code = cli.main({list(args)!r})\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_non_model_file(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert_one_line_error(run_main(capsys, "generate", str(text)), "is not a model", ".gguf")


def test_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"], "hidden_size": 8}')
    proc = run_main(capsys, "generate", str(tmp_path))
    assert_one_line_error(proc, "unsupported architecture 'BertModel'", "LlamaForCausalLM")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--block-size", "12"], "--block-size must be a positive power of two"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be positive"),
        (["--scheduling-max-wait-s", "0"], "--scheduling-max-wait-s must be positive"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "needs prefix caching"),
    ],
)
def test_bad_flags_name_the_flag(flags, needle, capsys):
    assert_one_line_error(run_main(capsys, "generate", *flags), needle)


def test_a_bug_is_not_reported_as_bad_input(monkeypatch, capsys, caplog):
    """Only UserInputError (ParameterError, ModelLoadError, CapacityError...) is exit 2; any
    other exception, a ValueError from a bug included, is exit 1 with its traceback."""
    from kvserve import cli
    from kvserve.errors import ParameterError

    def buggy(args):  # noqa: ANN001, ANN202
        raise ValueError("an internal invariant broke")

    def bad_flag(args):  # noqa: ANN001, ANN202
        raise ParameterError("--block-size", "must be a positive power of two, got 3")

    for func, code in ((buggy, 1), (bad_flag, 2)):
        monkeypatch.setattr(cli, "_cmd_generate", func)
        assert cli.main(["generate"]) == code
    err = capsys.readouterr().err
    assert "kvserve generate: error: --block-size must be a positive power of two" in err
    assert "internal error (a bug" in caplog.text and "an internal invariant broke" in caplog.text
