"""Constrained decoding with llguidance: a request's StructuredOutput compiled into a grammar
(grammar.py), one matcher per constrained sequence and the step's packed token bitmask
(manager.py).  numpy and llguidance, no torch: the engine imports it, the runner applies the
bitmask to the logits (runner/sampling.py `apply_token_bitmask`)."""
