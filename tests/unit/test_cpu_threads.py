"""--cpu-threads-bind: where a CPU engine's compute threads run, and that they really are
pinned (checked in a child process, whose affinity the test may change freely)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.config import LoadConfig
from kvserve.errors import ParameterError
from kvserve.native.platform import CpuThreadPlan, plan_cpu_threads


def two_threads_per_core(cpu: int) -> tuple[str, str]:
    """16 CPUs, 8 cores: CPUs i and i + 8 are hyper-threads of core i (Linux's usual order)."""
    return "0", str(cpu % 8)


def test_auto_takes_one_pinned_thread_per_core_and_leaves_the_first_core_to_the_server():
    plan = plan_cpu_threads("auto", list(range(16)), two_threads_per_core)
    assert plan == CpuThreadPlan(compute_cpus=(1, 2, 3, 4, 5, 6, 7), pin=True, server_cpus=(0, 8))


def test_auto_on_two_cores_computes_on_both_unpinned():
    plan = plan_cpu_threads("auto", [0, 1], lambda cpu: ("0", str(cpu)))
    assert plan == CpuThreadPlan(compute_cpus=(0, 1), pin=False)


def test_all_and_an_explicit_list():
    assert plan_cpu_threads("all", list(range(16)), two_threads_per_core) == CpuThreadPlan(
        tuple(range(16)), pin=False
    )
    plan = plan_cpu_threads("2-4,9", list(range(16)), two_threads_per_core)
    assert plan.compute_cpus == (2, 3, 4, 9) and plan.pin
    assert plan.server_cpus == (0, 1, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15)


@pytest.mark.parametrize("spec", ["0-", "a", "1,,2", "3-x"])
def test_a_malformed_list_names_the_flag(spec):
    with pytest.raises(ParameterError) as err:
        LoadConfig(cpu_threads_bind=spec)
    assert err.value.param == "--cpu-threads-bind"


def test_cpus_outside_the_affinity_are_refused():
    with pytest.raises(ParameterError, match=r"CPUs \[5\] are not available"):
        plan_cpu_threads("0,5", [0, 1], two_threads_per_core)


PINNED = """
import os, torch
from kvserve.native import platform
plan = platform.set_cpu_threads({spec!r})
x = torch.randn(512, 512)
for _ in range(20):
    x = (x @ x).tanh()  # a parallel region: the OpenMP team exists
masks = set()
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{{tid}}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list"):
                masks.add(line.split()[1])
print(repr((torch.get_num_threads(), sorted(os.sched_getaffinity(0)), sorted(masks))))
"""


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_an_explicit_list_pins_each_compute_thread_to_its_cpu():
    from kvserve.native import ops

    if not ops.available():
        pytest.skip("pinning uses the C kernel library")
    cpus = sorted(__import__("os").sched_getaffinity(0))[:2]
    spec = f"{cpus[0]},{cpus[1]}"
    out = subprocess.run(
        [sys.executable, "-c", PINNED.format(spec=spec)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    threads, main_affinity, masks = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307
    assert threads == 2
    assert main_affinity == [cpus[0]]  # the calling thread is OpenMP thread 0
    assert str(cpus[1]) in masks  # a worker thread pinned to the second CPU
