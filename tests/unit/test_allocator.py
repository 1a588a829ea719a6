"""tcmalloc for engine processes (kvserve/allocator.py): which library, which environment,
and a real re-execution where the machine has tcmalloc."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.allocator import (
    CHOICE_VARIABLE,
    REEXECUTED_VARIABLE,
    allocator_library,
    find_tcmalloc,
    preload_environment,
)
from kvserve.errors import UserInputError


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_find_takes_the_first_directory_and_the_minimal_library_first(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    _touch(first / "libtcmalloc.so.4")
    minimal = _touch(second / "libtcmalloc_minimal.so.4")
    assert find_tcmalloc((str(first), str(second))) == first / "libtcmalloc.so.4"
    _touch(first / "libtcmalloc_minimal.so.4")
    assert find_tcmalloc((str(first), str(second))) == first / "libtcmalloc_minimal.so.4"
    assert find_tcmalloc((str(second),)) == minimal
    assert find_tcmalloc((str(tmp_path / "none"),)) is None


def test_the_choice_variable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    found = _touch(tmp_path / "libtcmalloc_minimal.so.4")
    assert allocator_library({}, found) == found
    assert allocator_library({CHOICE_VARIABLE: "auto"}, found) == found
    assert allocator_library({CHOICE_VARIABLE: "system"}, found) is None
    other = _touch(tmp_path / "libjemalloc.so.2")
    assert allocator_library({CHOICE_VARIABLE: str(other)}, found) == other
    with caplog.at_level(logging.INFO, logger="kvserve"):
        assert allocator_library({}, None) is None
    assert "libtcmalloc-minimal4" in caplog.text
    with pytest.raises(UserInputError, match=f"{CHOICE_VARIABLE}='/no/such.so'.*auto, system"):
        allocator_library({CHOICE_VARIABLE: "/no/such.so"}, found)


def test_the_preload_keeps_other_preloads_and_happens_once(tmp_path: Path) -> None:
    library = tmp_path / "libtcmalloc_minimal.so.4"
    env = preload_environment({"PATH": "/bin"}, library)
    assert env == {"PATH": "/bin", "LD_PRELOAD": str(library), REEXECUTED_VARIABLE: str(library)}
    env = preload_environment({"LD_PRELOAD": "/x/libother.so"}, library)
    assert env is not None and env["LD_PRELOAD"] == f"{library}:/x/libother.so"
    assert preload_environment({"LD_PRELOAD": f"/y.so:{library}"}, library) is None
    # The re-executed process does not re-execute again, even if the preload did not take.
    assert preload_environment({REEXECUTED_VARIABLE: str(library)}, library) is None


_PROBE = (
    "from kvserve.allocator import reexec_with_allocator; reexec_with_allocator(); "
    "print('tcmalloc' in open('/proc/self/maps').read())"
)


@pytest.mark.skipif(
    find_tcmalloc() is None or not sys.platform.startswith("linux"), reason="no tcmalloc here"
)
@pytest.mark.parametrize("choice, loaded", [("auto", "True"), ("system", "False")])
def test_a_process_re_executes_itself_with_tcmalloc(choice: str, loaded: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", REEXECUTED_VARIABLE)}
    env[CHOICE_VARIABLE] = choice
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == loaded
