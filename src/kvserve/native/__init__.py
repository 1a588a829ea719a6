"""The native library: kvserve's C code for the CPU and what Python needs to use it.

    build.py     compiles csrc/ with the system compiler into a private, content-keyed cache
                 and loads it only when it is a file of ours (trust checks)
    ops.py       every entry point declared once (ctypes types, argument structures) behind a
                 typed wrapper that checks dtype, shape and contiguity
    platform.py  device and dtype resolution, memory figures, the CPU thread plan and pinning
    csrc/        common/ (storage kinds, exp, AMX tiles), attention/ (paged decode, one part
                 per instruction set; bf16 prefill; KV stores), linear/ (packed bf16
                 projections), layer/ (the one-call decode layer, SiLU), sampling/, runtime/
                 (thread pinning, the structures' sizes)

The package imports leaf modules only (config, errors): attention, models and runner call it
with tensors, and it knows nothing of them.
"""
