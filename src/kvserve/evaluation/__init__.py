"""Accuracy of the KV cache dtypes: perplexity and greedy agreement through the paged cache.

`kvserve eval-kv` (cli.py) loads one model and compares each KV dtype on a user's text;
sample_text.py makes an offline English text from Python's bundled language reference.
"""
