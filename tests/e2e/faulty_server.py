"""`kvserve serve` whose model runner raises in any step that computes the token id in
$KVSERVE_TEST_POISON_TOKEN: the server of the fault-isolation test (a real process, a real
failure inside a step, no hook in the product)."""

from __future__ import annotations

import os
import sys

from kvserve.cli import main
from kvserve.runner.model_runner import ModelRunner
from kvserve.step import SchedulerOutput

POISON = int(os.environ["KVSERVE_TEST_POISON_TOKEN"])
_execute = ModelRunner.execute


def _poisoned_execute(self: ModelRunner, output: SchedulerOutput):  # noqa: ANN202
    if any(POISON in item.token_ids for item in output.scheduled):
        raise RuntimeError("injected failure: a poisoned token reached the model")
    return _execute(self, output)


ModelRunner.execute = _poisoned_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
