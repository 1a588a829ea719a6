"""Admission to the lower tiers gated on reuse (--kv-offloading-store-threshold, issue 46): a
pure-Python simulation over the cache manager (kvserve/bench/kv_sim.py: no model, no
scheduler), comparing thresholds on two traces.

* scan: a trickle of requests sharing a system prompt, each followed by a burst of one-off
  prompts larger than device + host together.  Reported: the shared prompt's hit rate
  (tokens found in any tier / its tokens, rounds 2+) and the blocks copied down.
* chat: conversations sharing a system prompt, each turn resending its whole history (the
  earlier turns' prompts and answers), turns of all conversations interleaved round-robin.
  Reported: the mean cached fraction of turns 2+ prompts and the blocks copied down.

    PYTHONPATH=src python benchmarks/admission_sim.py            # the issue's sizes
    PYTHONPATH=src python benchmarks/admission_sim.py --thresholds 1,2,3 --evictions lru
"""

from __future__ import annotations

import argparse

from kvserve.bench.kv_sim import Result, Tiers, chat, scan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--thresholds", default="1,2")
    parser.add_argument("--evictions", default="arc,lru")
    parser.add_argument("--device", type=int, default=128, help="device blocks")
    parser.add_argument("--host", type=int, default=256, help="host blocks")
    parser.add_argument("--disk", type=int, default=0, help="disk blocks (0: none)")
    parser.add_argument(
        "--chat-hosts",
        default="256,1024,4096",
        help="host blocks of the chat runs (its histories: ~3,500 blocks)",
    )
    args = parser.parse_args()
    thresholds = [int(t) for t in args.thresholds.split(",")]
    for eviction in args.evictions.split(","):
        tiers = Tiers(args.device, args.host, args.disk, eviction=eviction)
        for threshold in thresholds:
            report(f"scan {eviction} {tiers.device}+{tiers.host}+{tiers.disk}", threshold,
                   scan(tiers, threshold))  # fmt: skip
        for host in (int(h) for h in args.chat_hosts.split(",")):
            chat_tiers = Tiers(args.device, host, args.disk, eviction=eviction)
            for threshold in thresholds:
                report(f"chat {eviction} {args.device}+{host}+{args.disk}", threshold,
                       chat(chat_tiers, threshold))  # fmt: skip


def report(name: str, threshold: int, result: Result) -> None:
    print(f"{name:<28} threshold {threshold}: hit rate {result.hit_rate:.3f}, "
          f"offloaded {result.num_offloaded}, written {result.num_written}, "
          f"evicted misses by tier {result.miss_tiers}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
