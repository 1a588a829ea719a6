"""Attention backends behind one contract (base.py); `select_backend` picks one per device."""

from __future__ import annotations

import logging
import subprocess

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.errors import ParameterError
from kvserve.native import ops
from kvserve.native.build import KernelBuildError

logger = logging.getLogger(__name__)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """--attention-backend, logged: `auto` takes the C paged kernel on a CPU when it builds here
    (else the reference) and FlexAttention on CUDA; `cpu-paged` insists on the kernel and says
    why it cannot be had."""
    backend = _select(name, device)
    logger.info("attention backend: %s (--attention-backend %s)", describe(backend), name)
    return backend


def describe(backend: AttentionBackend) -> str:
    """The name a log line or a benchmark's JSON gives the backend."""
    compiled = getattr(backend, "compiled", None)
    kind = {"TorchRefBackend": "torch", "CpuPagedBackend": "cpu-paged"}.get(
        type(backend).__name__, "flex"
    )
    return kind if compiled is None else f"{kind} ({'compiled' if compiled else 'eager'})"


def _select(name: str, device: torch.device) -> AttentionBackend:
    if name == "torch":
        return TorchRefBackend()
    if name == "flex" or (name == "auto" and device.type == "cuda"):
        from kvserve.attention.flex import FlexAttentionBackend

        # Compiled on CUDA (Triton); eager on a CPU, where torch 2.13 cannot compile it with
        # dynamic shapes (attention/flex.py).
        return FlexAttentionBackend(compiled=device.type == "cuda")
    if name == "cpu-paged" and device.type != "cpu":
        raise ParameterError(
            "--attention-backend", "cpu-paged runs on a CPU only; use auto or torch"
        )
    if name == "cpu-paged":
        try:
            ops.kernels()
        except (KernelBuildError, OSError, subprocess.SubprocessError) as exc:
            raise ParameterError(
                "--attention-backend",
                f"cpu-paged: the C kernel could not be built ({exc}); "
                "install gcc or use --attention-backend torch",
            ) from exc
    elif device.type != "cpu" or not ops.available():
        return TorchRefBackend()  # auto, where the kernel cannot run
    from kvserve.attention.cpu_paged import CpuPagedBackend

    return CpuPagedBackend()
