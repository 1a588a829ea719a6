"""`kvserve bench serve`: a serving benchmark for OpenAI-compatible servers.

Python API: `kvserve.bench.runner.bench_serve(BenchConfig(...)) -> BenchResult`, then
`kvserve.bench.report` (table, JSON) and `kvserve.bench.plot` (memory timeline PNG).
Nothing is imported here, so `kvserve --help` does not pay for aiohttp or matplotlib.
"""
