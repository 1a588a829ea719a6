"""tcmalloc for the processes that run an engine, where the machine has it.

A step allocates and frees a few hundred tensors (each projection's output, the attention
buffers, the batch's index tensors).  With glibc's malloc, `benchmarks/w2_steps.py` measured
a 36-sequence decode step at 62-66 ms; with tcmalloc preloaded, 55-57 ms, and the steps that
carry a 256-token prompt 126-136 -> 118-120 ms (docs/decisions/tcmalloc.md).  Tuning
glibc instead (no mmap below 32 MiB, no trimming) cut page faults by a quarter and gained
nothing.  vLLM's CPU backend asks its users to preload tcmalloc the same way.

No wheel on PyPI ships tcmalloc, so it comes from the system (Debian/Ubuntu:
`libtcmalloc-minimal4`).  An allocator has to be in place before the first allocation, so
the process re-executes itself once with LD_PRELOAD set.  KVSERVE_MALLOC chooses: `auto`
(the default: tcmalloc where found, else glibc's malloc with a one-line hint), `system`
(never re-execute), or the path of an allocator library to preload (jemalloc, say).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from kvserve.errors import UserInputError

logger = logging.getLogger("kvserve")

CHOICE_VARIABLE = "KVSERVE_MALLOC"
# Set in the re-executed process: if the preload did not take (ld.so only warns), the process
# must not re-execute again, and again.
REEXECUTED_VARIABLE = "KVSERVE_MALLOC_PRELOADED"
LIBRARY_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def find_tcmalloc(directories: tuple[str, ...] = LIBRARY_DIRS) -> Path | None:
    """The first tcmalloc library in the usual system directories, or None."""
    for directory in directories:
        for name in LIBRARY_NAMES:
            path = Path(directory) / name
            if path.is_file():
                return path
    return None


def allocator_library(environ: Mapping[str, str], found: Path | None) -> Path | None:
    """The library KVSERVE_MALLOC asks to preload (None: keep the system malloc)."""
    choice = environ.get(CHOICE_VARIABLE, "auto").strip() or "auto"
    if choice == "system":
        return None
    if choice == "auto":
        if found is None:
            logger.info(
                "tcmalloc not found: CPU steps run ~10%% faster with it "
                "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4); %s=system hides this",
                CHOICE_VARIABLE,
            )
        return found
    path = Path(choice)
    if not path.is_file():
        raise UserInputError(
            f"{CHOICE_VARIABLE}={choice!r}: no such library; use auto, system, or the path "
            "of an allocator's shared library (libtcmalloc_minimal.so.4, libjemalloc.so.2)"
        )
    return path


def preload_environment(environ: Mapping[str, str], library: Path) -> dict[str, str] | None:
    """The environment to re-execute with so that `library` is preloaded, or None when there
    is nothing to do (already preloaded, or this process is the re-executed one)."""
    preloaded = environ.get("LD_PRELOAD", "")
    if environ.get(REEXECUTED_VARIABLE) or str(library) in preloaded.split(":"):
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{library}:{preloaded}" if preloaded else str(library)
    env[REEXECUTED_VARIABLE] = str(library)
    return env


def reexec_with_allocator() -> None:
    """Re-execute this process (same interpreter, same arguments) with the allocator that
    KVSERVE_MALLOC selects preloaded; returns when there is nothing to do.  Call it first
    thing in a command that runs an engine, before threads or files are opened."""
    library = allocator_library(os.environ, find_tcmalloc())
    if library is None or sys.platform != "linux":
        return
    env = preload_environment(os.environ, library)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
