"""The memory timeline of a run as a PNG: KV usage against its cap, the queues and
preemptions, and the request throughput, on one time axis, so a reader sees memory rise to
the cap, stay there while requests wait, and the server keep completing requests.

Works from the JSON document (report.to_json), so saved runs can be redrawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_timeline(doc: dict[str, Any], path: Path | str, title: str | None = None) -> Path:
    """Draw `doc` (a result JSON) into `path` with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    _draw_usage(axes[0], doc["timeline"])
    _draw_queues(axes[1], doc["timeline"])
    _draw_throughput(axes[2], _throughput(doc), doc["timeline"])
    axes[2].set_xlabel("seconds since the first request")
    fig.suptitle(title or _default_title(doc))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _throughput(doc: dict[str, Any]) -> list[tuple[float, float]]:
    """Completed requests per second, binned from the per-request end times."""
    from kvserve.bench.metrics import completions_per_second, throughput_bin_s

    ends = [r["end_time"] for r in doc.get("requests", []) if r["success"]]
    duration = doc.get("duration") or max(ends, default=1.0)
    return completions_per_second(ends, duration, throughput_bin_s(duration))


def _default_title(doc: dict[str, Any]) -> str:
    label = doc.get("label") or doc.get("backend", "")
    return (
        f"{label}: {doc.get('completed', 0)} requests, "
        f"{doc.get('request_throughput', 0):.2f} req/s ({doc.get('model', '')})"
    )


def _draw_usage(ax: Any, timeline: list[dict[str, Any]]) -> None:
    if not timeline:
        ax.text(0.5, 0.5, "no /metrics on this server", ha="center", transform=ax.transAxes)
    t = [s["t"] for s in timeline]
    ax.plot(
        t, [100 * s["kv_cache_usage"] for s in timeline], color="tab:blue", label="KV cache usage %"
    )
    ax.axhline(100, color="grey", linestyle="--", linewidth=1, label="cap")
    ax.set_ylim(0, 110)
    ax.set_ylabel("KV usage %")
    ax.legend(loc="lower right", fontsize=8)


def _draw_queues(ax: Any, timeline: list[dict[str, Any]]) -> None:
    t = [s["t"] for s in timeline]
    ax.plot(t, [s["num_running"] for s in timeline], color="tab:green", label="running")
    ax.plot(
        t, [s["num_waiting"] for s in timeline], color="tab:red", linestyle=":", label="waiting"
    )
    ax.set_ylabel("requests")
    ax.legend(loc="upper left", fontsize=8)
    right = ax.twinx()
    first = timeline[0]["num_preemptions"] if timeline else 0
    right.plot(
        t,
        [s["num_preemptions"] - first for s in timeline],
        color="black",
        linestyle="-.",
        label="preemptions (cumulative)",
    )
    right.set_ylim(
        bottom=0, top=max([1.0] + [s["num_preemptions"] - first for s in timeline]) * 1.1
    )
    right.set_ylabel("preemptions")
    right.legend(loc="upper right", fontsize=8)


def _draw_throughput(
    ax: Any, rate: list[tuple[float, float]], timeline: list[dict[str, Any]]
) -> None:
    if rate:
        starts = [r[0] for r in rate]
        width = starts[1] - starts[0] if len(starts) > 1 else 1.0
        ax.bar(
            starts,
            [r[1] for r in rate],
            width=width,
            align="edge",
            color="tab:orange",
            alpha=0.6,
            label="completed requests/s",
        )
    ax.set_ylabel("req/s")
    ax.legend(loc="upper left", fontsize=8)
    hits = [
        (s["t"], 100 * s["prefix_hit_rate"])
        for s in timeline
        if s.get("prefix_hit_rate") is not None
    ]
    if hits:
        right = ax.twinx()
        right.plot(
            [h[0] for h in hits],
            [h[1] for h in hits],
            color="tab:purple",
            label="prefix hit rate % (this run)",
        )
        right.set_ylim(0, 105)
        right.set_ylabel("prefix hits %")
        right.legend(loc="upper right", fontsize=8)
