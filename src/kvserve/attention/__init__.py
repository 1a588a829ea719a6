"""Attention backends behind one contract (base.py); `select_backend` picks one per device."""

from __future__ import annotations

import subprocess

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.errors import ParameterError


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """--attention-backend: `auto` takes the C paged kernel on a CPU when it builds here and the
    reference elsewhere; `cpu-paged` insists on the kernel and says why it cannot be had."""
    from kvserve.attention import cpu_kernels

    if name == "torch":
        return TorchRefBackend()
    if name == "cpu-paged" and device.type != "cpu":
        raise ParameterError(
            "--attention-backend", "cpu-paged runs on a CPU only; use auto or torch"
        )
    if name == "cpu-paged":
        try:
            cpu_kernels.load_paged_decode()
        except (cpu_kernels.KernelBuildError, OSError, subprocess.SubprocessError) as exc:
            raise ParameterError(
                "--attention-backend",
                f"cpu-paged: the C kernel could not be built ({exc}); "
                "install gcc or use --attention-backend torch",
            ) from exc
    elif device.type != "cpu" or not cpu_kernels.paged_decode_available():
        return TorchRefBackend()  # auto, where the kernel cannot run
    from kvserve.attention.cpu_paged import CpuPagedBackend

    return CpuPagedBackend()
