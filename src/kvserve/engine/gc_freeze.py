"""Python's cyclic garbage collector kept off the objects that exist before an engine loop
starts, while the loop runs.

A loaded engine holds ~230,000 objects that the collector tracks (the tokenizer's, torch's
and transformers' modules, the model's); every step allocates requests' outputs, lists and
tensors, so every few steps a young collection runs, and now and then a full one walks all of
them: ~94 ms each on the AMD EPYC, in the middle of a step.  Frozen (gc.freeze), those
objects sit in a permanent generation that no collection walks, and a full collection costs
only the objects made since.  vLLM freezes its engine's heap after start-up for the same
reason.

The heap is frozen for as long as a loop runs (LLM.generate, the server's engine thread) and
unfrozen when the last one ends: whatever became garbage meanwhile is collectable again, so a
process that builds engine after engine (a test suite) leaks nothing.  No collection runs
before the freeze (a full one costs as much as the pauses it saves, for each short generate):
garbage already there waits for the unfreeze.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_loops = 0  # loops running: the heap is frozen while there is one


@contextmanager
def heap_frozen() -> Iterator[None]:
    """The current heap frozen while the block runs (nested and concurrent blocks share it)."""
    global _loops
    with _lock:
        if _loops == 0:
            gc.freeze()
        _loops += 1
    try:
        yield
    finally:
        with _lock:
            _loops -= 1
            if _loops == 0:
                gc.unfreeze()
