"""Executors: how the engine's start-up and steps reach the model, through one Worker per rank
(worker.py): in this process for one rank (uniproc.py), or on tensor-parallel ranks (worker
processes or Ray actors: tensor_parallel.py).  The engine's entry point is abstract.py."""
