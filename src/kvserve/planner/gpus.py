"""GPU presets: device memory by name, so `--gpu H100-80GB` replaces looking numbers up.

Capacities are the nominal sizes the cards are sold with, read as GiB (an "80 GB" H100
reports 79.6 GiB to the driver, an H200 140.4 GiB).  Give `--memory` for an exact figure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.planner.model import PlanError

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    """One device's name and the memory one tensor-parallel rank gets."""

    name: str
    memory_bytes: int
    aliases: tuple[str, ...] = ()


GPUS: tuple[GPU, ...] = (
    GPU("A100-40GB", 40 * GiB),
    GPU("A100-80GB", 80 * GiB),
    GPU("H100-80GB", 80 * GiB, ("H100", "H100-SXM", "H100-PCIE")),
    GPU("H100-NVL", 94 * GiB),
    GPU("H200", 141 * GiB, ("H200-141GB",)),
    GPU("B200", 180 * GiB),
    GPU("L4", 24 * GiB),
    GPU("L40S", 48 * GiB),
    GPU("A10G", 24 * GiB, ("A10",)),
    GPU("T4", 16 * GiB),
    GPU("V100-32GB", 32 * GiB),
    GPU("RTX-3090", 24 * GiB, ("3090",)),
    GPU("RTX-4090", 24 * GiB, ("4090",)),
    GPU("RTX-5090", 32 * GiB, ("5090",)),
    GPU("MI300X", 192 * GiB),
)

DEFAULT_GPU = "H100-80GB"


def _normalize(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().upper())


def gpu_names() -> list[str]:
    return [gpu.name for gpu in GPUS]


def find_gpu(name: str) -> GPU:
    """The GPU called ``name`` (case and separators ignored); PlanError listing the known ones."""
    wanted = _normalize(name)
    for gpu in GPUS:
        if wanted == gpu.name or wanted in gpu.aliases:
            return gpu
    raise PlanError(
        f"unknown GPU {name!r}; known: {', '.join(gpu_names())} (or give --memory SIZE)"
    )
