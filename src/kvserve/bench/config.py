"""Configuration of `kvserve bench serve`: one field, one flag, one help text.

The flags are generated from these dataclasses (see bench/cli.py), and scripts build the
same dataclasses directly, so the command line and the Python API cannot drift apart.  Names
follow vLLM's serving benchmark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import ParameterError, UserInputError

DATASET_NAMES = ("random", "sharegpt", "prefix", "multi-turn")
# --backend -> the path it posts to (unless --endpoint)
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
BACKEND_NAMES = tuple(BACKENDS)
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "e2el")


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts, how many and how long."""

    dataset_name: str = _f(
        "random",
        "Prompts: random token ids, a ShareGPT file, a shared prefix plus unique suffixes, or "
        "chat conversations resending their history (multi-turn: --num-prompts conversations).",
        choices=DATASET_NAMES,
    )
    dataset_path: str | None = _f(None, "ShareGPT-format JSON file (--dataset-name sharegpt).")
    num_prompts: int = _f(1000, "Number of requests to send.")
    seed: int = _f(0, "Seed of the prompts and of the arrival times.")
    random_input_len: int = _f(1024, "Prompt tokens per request (random).")
    random_output_len: int = _f(128, "max_tokens per request (random).")
    random_range_ratio: float = _f(0.0, "Lengths uniform in [len x (1 - r), len x (1 + r)].")
    prefix_len: int = _f(1024, "Tokens of the shared prefix (prefix).")
    suffix_len: int = _f(32, "Unique tokens after the prefix (prefix).")
    num_prefixes: int = _f(1, "Distinct shared prefixes, used in turn (prefix).")
    output_len: int | None = _f(
        None, "max_tokens of the prefix dataset (default 128); overrides ShareGPT's reply lengths."
    )

    num_turns: int = _f(6, "Turns of each conversation (multi-turn).")
    system_prompt_len: int = _f(512, "Tokens of the system prompt all conversations share "
                                "(multi-turn).")  # fmt: skip
    turn_input_len: int = _f(96, "New user tokens each turn (multi-turn).")
    turn_output_len: int = _f(48, "max_tokens of each turn's answer (multi-turn).")

    def __post_init__(self) -> None:
        if self.dataset_name not in DATASET_NAMES:
            raise ParameterError("--dataset-name", f"must be one of {', '.join(DATASET_NAMES)}")
        if self.num_prompts <= 0:
            raise ParameterError("--num-prompts", "must be positive")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ParameterError("--random-range-ratio", "must be in [0, 1)")
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ParameterError("--dataset-name", "sharegpt needs --dataset-path FILE.json")
        lengths = (
            self.random_input_len,
            self.random_output_len,
            self.prefix_len,
            self.num_prefixes,
            self.output_len or 1,
            self.num_turns,
            self.system_prompt_len,
            self.turn_input_len,
            self.turn_output_len,
        )
        if min(lengths) <= 0 or self.suffix_len < 0:
            raise UserInputError(
                "lengths (--random-*-len, --prefix-len, --output-len, --num-prefixes, "
                "--num-turns, --system-prompt-len, --turn-*-len) must be positive"
            )


@dataclass(frozen=True)
class BenchConfig:
    """Where to send, how fast, what to report."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    backend: str = _f(
        "openai",
        "API: /v1/completions (token-id prompts) or /v1/chat/completions (text).",
        choices=BACKEND_NAMES,
    )
    base_url: str = _f("http://127.0.0.1:8000", "Server address; /metrics is scraped there.")
    endpoint: str | None = _f(None, "API path (default: the backend's).")
    model: str | None = _f(None, "Model name to request (default: the server's first).")
    tokenizer: str | None = _f(
        None,
        "Tokenizer: a HF directory or GGUF file (default: the "
        "embedded model's, or MODEL's when it is a path).",
    )
    request_rate: float = _f(math.inf, "Requests per second (Poisson arrivals); inf = all at once.")
    burstiness: float = _f(
        1.0, "Gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular."
    )
    max_concurrency: int | None = _f(None, "Most requests in flight at once.")
    ignore_eos: bool = _f(False, "Ask the server to ignore EOS (exact output lengths).")
    temperature: float = _f(0.0, "Sampling temperature of every request (0 = greedy).")
    top_p: float | None = _f(None, "Top-p of every request (default: the server's, 1).")
    top_k: int | None = _f(None, "Top-k of every request (default: the server's, off).")
    min_p: float | None = _f(None, "Min-p of every request (default: the server's, 0).")
    percentile_metrics: str = _f(
        "ttft,tpot,itl", "Metrics whose percentiles are reported, from ttft,tpot,itl,e2el."
    )
    metric_percentiles: str = _f("99", "Percentiles to report, e.g. 50,90,99.")
    goodput: tuple[str, ...] = _f((), "SLOs in ms, e.g. ttft:500 tpot:50 e2el:2000.", nargs="+")
    save_result: bool = _f(False, "Write the JSON result (summary, timeline, requests).")
    result_dir: str | None = _f(None, "Directory of the JSON result (default: current).")
    scrape_interval: float = _f(0.5, "Seconds between /metrics scrapes.")
    result_filename: str | None = _f(None, "JSON file name (default: derived from the run).")
    plot: str | None = _f(
        None,
        "Draw KV usage, queues, preemptions, prefix hits and request "
        "throughput over time into this PNG.",
    )
    label: str | None = _f(None, "A name for the run in the JSON and the plot title.")
    disable_tqdm: bool = _f(False, "No progress bar.")

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ParameterError("--backend", f"must be one of {', '.join(BACKEND_NAMES)}")
        if self.dataset.dataset_name == "multi-turn" and self.backend != "openai-chat":
            raise ParameterError("--backend", "multi-turn sends chat messages: use openai-chat")
        if not self.request_rate > 0:
            raise ParameterError("--request-rate", "must be positive (inf = all at once)")
        if not self.burstiness > 0:
            raise ParameterError("--burstiness", "must be positive (1.0 = Poisson)")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ParameterError("--max-concurrency", "must be positive")
        if not self.scrape_interval > 0:
            raise ParameterError("--scrape-interval", "must be positive")
        if not self.temperature >= 0:
            raise ParameterError("--temperature", "must be >= 0 (0 = greedy)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ParameterError("--top-p", "must be in (0, 1]")
        if self.top_k is not None and (self.top_k == 0 or self.top_k < -1):
            raise ParameterError("--top-k", "must be positive, or -1 for off")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ParameterError("--min-p", "must be in [0, 1]")
        self.selected_metrics()
        self.percentiles()
        self.slos_ms()

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields every request carries: temperature always, the others when set."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p}  # fmt: skip
        return {name: value for name, value in fields.items() if value is not None}

    def selected_metrics(self) -> list[str]:
        names = [m.strip() for m in self.percentile_metrics.split(",") if m.strip()]
        bad = [m for m in names if m not in METRIC_NAMES]
        if bad:
            raise ParameterError(
                "--percentile-metrics", f"unknown {bad}; choose from {','.join(METRIC_NAMES)}"
            )
        return names

    def percentiles(self) -> list[float]:
        try:
            values = [float(p) for p in self.metric_percentiles.split(",") if p.strip()]
        except ValueError:
            raise ParameterError("--metric-percentiles", "numbers like 50,90,99") from None
        if any(not 0 <= p <= 100 for p in values):
            raise ParameterError("--metric-percentiles", "must be in [0, 100]")
        return values

    def slos_ms(self) -> dict[str, float]:
        """`--goodput ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0}."""
        slos = {}
        for item in self.goodput:
            name, _, value = item.partition(":")
            if name not in SLO_NAMES:
                raise ParameterError(
                    "--goodput",
                    f"{name!r} is not one of {', '.join(SLO_NAMES)} (write e.g. ttft:500)",
                )
            try:
                slos[name] = float(value)
            except ValueError:
                raise ParameterError(
                    "--goodput", f"{item!r} needs a number of ms, e.g. ttft:500"
                ) from None
            if slos[name] <= 0:
                raise ParameterError("--goodput", f"{item!r} must be positive")
        return slos

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + (self.endpoint or BACKENDS[self.backend])
