"""Executors: how the engine's step reaches the model, in this process (tensor-parallel size 1:
the ModelRunner itself) or on tensor-parallel ranks (worker processes or Ray actors)."""
