"""`kvserve serve` whose model runner raises (or, with KVSERVE_TEST_POISON_HANG=1, hangs) in
any step that computes the token id in $KVSERVE_TEST_POISON_TOKEN: the server of the
fault-isolation and watchdog tests (a real process, a real failure inside a step, no hook in
the product)."""

from __future__ import annotations

import os
import sys
import time

from kvserve.cli import main
from kvserve.runner.model_runner import ModelRunner
from kvserve.step import SchedulerOutput

POISON = int(os.environ["KVSERVE_TEST_POISON_TOKEN"])
_execute = ModelRunner.execute


HANG = os.environ.get("KVSERVE_TEST_POISON_HANG") == "1"  # hang instead of raising


def _poisoned_execute(self: ModelRunner, output: SchedulerOutput):  # noqa: ANN202
    if any(POISON in item.token_ids for item in output.scheduled):
        if HANG:
            time.sleep(3600)  # a step that never returns (a collective whose peer hangs)
        raise RuntimeError("injected failure: a poisoned token reached the model")
    return _execute(self, output)


ModelRunner.execute = _poisoned_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
