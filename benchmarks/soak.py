"""Soak: many short streaming requests against one `kvserve serve`, some clients hanging up
mid-stream, watching the server's memory (RSS) and checking that the KV cache drains to empty.

N requests (completions and chat, short prompts, 8-16 output tokens) run C at a time; a
fraction of the clients close the connection after the first chunk or after a random number
of chunks.  Every K finished requests the server's VmRSS (and threads, open files) is sampled
from /proc.  At the end it waits for idle and checks /metrics: nothing running or waiting, KV
usage 0 and every block free (num_free_blocks == num_blocks of cache_config_info).

    .venv/bin/python benchmarks/soak.py --num-requests 1000 --save-result results/soak.json

Growth is measured from the sample after warm-up (--warmup-fraction of N) to the end, and over
the last half.  Any 5xx, error event, stream without [DONE] or connection error that is not
one of our own drops counts as failed.  --server-env KEY=VALUE (repeatable) starts the server
with extra environment (MALLOC_ARENA_MAX=2, ONEDNN_PRIMITIVE_CACHE_CAPACITY=0: see
docs/decisions/packed-linear.md); --base-url with --pid soaks a server started elsewhere (e.g.
under a profiler).  The server runs in its default dtype (--dtype auto: bfloat16 on a CPU
with AMX/AVX512-BF16), unlike the other scripts' float32: a soak measures what users run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from server_process import KVServer

from kvserve.bench.scrape import parse_metrics

WORDS = "the a cat dog house river blue green runs sleeps quickly over under why how when".split()
REQUEST_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 120.0


@dataclass
class Sample:
    """One look at the server process after `done` requests had finished."""

    done: int
    seconds: float
    rss_mb: float
    threads: int
    open_files: int


@dataclass
class Tally:
    ok: int = 0
    dropped: int = 0
    failed: int = 0
    output_tokens: int = 0
    reasons: Counter = field(default_factory=Counter)  # failure reason -> count


# ---------------------------------------------------------------------- the server process
def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def sample(pid: int, done: int, started: float) -> Sample:
    status = proc_status(pid)
    return Sample(
        done=done,
        seconds=round(time.monotonic() - started, 2),
        rss_mb=round(int(status["VmRSS"].split()[0]) / 1024, 1),
        threads=int(status["Threads"]),
        open_files=len(os.listdir(f"/proc/{pid}/fd")),
    )


# ---------------------------------------------------------------------- one request
def request_for(rng: random.Random, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """A short prompt, 8-16 tokens out, streaming with usage; completions or chat."""
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
    common = {
        "max_tokens": rng.randint(args.min_tokens_out, args.max_tokens_out),
        "temperature": rng.choice([0.0, 0.8]),
        "ignore_eos": rng.random() < 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": prompt, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}


async def run_one(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], drop_after: int | None
) -> tuple[str, int]:
    """("ok" | "dropped" | a failure reason, output tokens).  With `drop_after`, the
    connection is closed after that many chunks (httpx cannot reuse a half-read stream)."""
    chunks, tokens = 0, 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}", 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return "ok", tokens
                event = json.loads(data)
                if "error" in event:
                    return f"error event {event['error'].get('code')}", tokens
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return "dropped", tokens
    except httpx.HTTPError as exc:
        return f"connection: {type(exc).__name__}", tokens
    return "stream ended without [DONE]", tokens


def drop_point(rng: random.Random, body: dict[str, Any], fraction: float) -> int | None:
    """None (read to the end) or the chunk after which to hang up: the first one half the
    time, else a random one before the last."""
    if rng.random() >= fraction:
        return None
    return 1 if rng.random() < 0.5 else rng.randint(1, max(1, body["max_tokens"] - 1))


# ---------------------------------------------------------------------- the load
async def drive(args: argparse.Namespace, base_url: str, pid: int) -> dict[str, Any]:
    """N requests, C workers; RSS samples every K finished requests."""
    tally, samples = Tally(), []
    next_index, done = 0, 0
    started = time.monotonic()
    samples.append(sample(pid, 0, started))
    limits = httpx.Limits(max_connections=args.concurrency * 2)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index, done
        while next_index < args.num_requests:
            rng = random.Random(args.seed * 1_000_003 + next_index)
            next_index += 1
            path, body = request_for(rng, args)
            outcome, tokens = await run_one(client, path, body, drop_point(rng, body, args.drop))
            record(tally, outcome, tokens)
            done += 1
            if done % args.sample_every == 0:
                samples.append(sample(pid, done, started))
            if done % max(1, args.num_requests // 10) == 0:
                now = sample(pid, done, started)
                print(f"{done}/{args.num_requests} {now.seconds} s: RSS {now.rss_mb} MB, "
                      f"{tally_line(tally)}", flush=True)  # fmt: skip

    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    seconds = time.monotonic() - started
    return {"tally": tally, "samples": samples, "seconds": seconds}


def record(tally: Tally, outcome: str, tokens: int) -> None:
    tally.output_tokens += tokens
    if outcome == "ok":
        tally.ok += 1
    elif outcome == "dropped":
        tally.dropped += 1
    else:
        tally.failed += 1
        tally.reasons[outcome] += 1


def tally_line(tally: Tally) -> str:
    return f"ok {tally.ok} dropped {tally.dropped} failed {tally.failed}"


# ---------------------------------------------------------------------- after the load
def wait_idle(base_url: str, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Poll /metrics until nothing runs or waits and no block is in use; the final values
    and whether each check held."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        values = parse_metrics(text)
        match = re.search(r'cache_config_info\{[^}]*num_blocks="(\d+)"', text)
        num_blocks = int(match.group(1)) if match else None
        checks = {
            "num_requests_running == 0": values.get("num_requests_running") == 0,
            "num_requests_waiting == 0": values.get("num_requests_waiting") == 0,
            "kv_cache_usage_perc == 0": values.get("kv_cache_usage_perc") == 0,
            "num_free_blocks == num_blocks": values.get("num_free_blocks") == num_blocks,
        }
        if all(checks.values()) or time.monotonic() > deadline:
            keys = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                    "num_free_blocks")  # fmt: skip
            final = {k: values.get(k) for k in keys}
            return {"metrics": {**final, "num_blocks": num_blocks}, "checks": checks}
        time.sleep(0.5)


def growth(samples: list[Sample], end: Sample, num_requests: int, fraction: float) -> dict:
    """RSS at the first sample after `fraction` of the requests, at half, at the end."""

    def at(share: float) -> Sample:
        return next((s for s in samples if s.done >= share * num_requests), samples[-1])

    warm, half = at(fraction), at(0.5)
    return {
        "rss_start_mb": samples[0].rss_mb,
        "rss_after_warmup_mb": warm.rss_mb,
        "warmup_after_requests": warm.done,
        "rss_half_mb": half.rss_mb,
        "rss_end_mb": end.rss_mb,
        "growth_after_warmup_pct": round(100 * (end.rss_mb / warm.rss_mb - 1), 2),
        "growth_last_half_pct": round(100 * (end.rss_mb / half.rss_mb - 1), 2),
        "rss_peak_mb": max(s.rss_mb for s in [*samples, end]),
    }


def report(args: argparse.Namespace, run: dict, end: Sample, idle: dict) -> dict[str, Any]:
    tally: Tally = run["tally"]
    seconds = run["seconds"]
    return {
        "argv": sys.argv,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "config": {k: v for k, v in vars(args).items() if k != "save_result"},
        "requests": {
            "ok": tally.ok,
            "dropped": tally.dropped,
            "failed": tally.failed,
            "failure_reasons": dict(tally.reasons),
        },  # fmt: skip
        "throughput": {
            "seconds": round(seconds, 1),
            "requests_per_s": round((tally.ok + tally.dropped + tally.failed) / seconds, 2),
            "output_tokens_per_s": round(tally.output_tokens / seconds, 1),
        },
        "memory": growth(run["samples"], end, args.num_requests, args.warmup_fraction),
        "threads_end": end.threads,
        "open_files_end": end.open_files,
        "idle": idle,
        "invariants_method": "/metrics after idle: running == waiting == 0, "
        "kv_cache_usage_perc == 0, num_free_blocks == cache_config_info num_blocks",
        "samples": [asdict(s) for s in [*run["samples"], end]],
    }


def print_summary(doc: dict[str, Any]) -> None:
    r, m, t = doc["requests"], doc["memory"], doc["throughput"]
    print(f"\nrequests: ok {r['ok']}, dropped {r['dropped']}, failed {r['failed']} "
          f"{r['failure_reasons'] or ''}")  # fmt: skip
    print(f"throughput: {t['requests_per_s']} req/s, {t['output_tokens_per_s']} output tok/s "
          f"over {t['seconds']} s")  # fmt: skip
    print(f"RSS: start {m['rss_start_mb']} MB, after warm-up ({m['warmup_after_requests']} req) "
          f"{m['rss_after_warmup_mb']} MB, half {m['rss_half_mb']} MB, end {m['rss_end_mb']} MB; "
          f"growth {m['growth_after_warmup_pct']}% after warm-up, "
          f"{m['growth_last_half_pct']}% over the last half")  # fmt: skip
    print(f"threads {doc['threads_end']}, open files {doc['open_files_end']}")
    print(f"idle: {doc['idle']['metrics']}; checks {doc['idle']['checks']}")


# ---------------------------------------------------------------------- entry point
def soak(args: argparse.Namespace, base_url: str, pid: int) -> dict[str, Any]:
    run = asyncio.run(drive(args, base_url, pid))
    idle = wait_idle(base_url)
    time.sleep(1.0)  # let the allocator settle after the last frees
    end = sample(pid, run["tally"].ok + run["tally"].dropped + run["tally"].failed, 0.0)
    end.seconds = round(run["seconds"], 2)
    return report(args, run, end, idle)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--drop", type=float, default=0.15, help="fraction of clients that hang up")
    p.add_argument("--min-tokens-out", type=int, default=8)
    p.add_argument("--max-tokens-out", type=int, default=16)
    p.add_argument("--sample-every", type=int, default=100, help="RSS sample every K requests")
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto", help="the server's default (bfloat16 with AMX)")
    p.add_argument("--server-arg", action="append", default=[], help="e.g. --server-arg=--seed=1")
    p.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server")
    p.add_argument("--cpus", default=None, help="pin the server with taskset, e.g. 0,1")
    p.add_argument("--base-url", default=None, help="soak a running server (with --pid)")
    p.add_argument("--pid", type=int, default=None, help="its process id, for RSS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="results/soak")
    p.add_argument("--save-result", default=None, help="JSON output path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        doc = soak(args, args.base_url, args.pid)
    else:
        for item in args.server_env:
            key, _, value = item.partition("=")
            os.environ[key] = value  # the server inherits this process's environment
        flags = ["--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory]
        flags += ["--max-model-len", str(args.max_model_len), *args.server_arg]
        with KVServer(flags, Path(args.log_dir), args.cpus) as server:
            assert server.server is not None
            doc = soak(args, server.base_url, server.server.process.pid)
    print_summary(doc)
    if args.save_result:
        Path(args.save_result).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_result).write_text(json.dumps(doc, indent=2))
        print(f"saved {args.save_result}")
    ok = doc["requests"]["failed"] == 0 and all(doc["idle"]["checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
