"""Inputs of `kvserve bench serve`: datasets (exact lengths), flags, /metrics parsing."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from kvserve.bench.cli import add_bench_parser, config_from_args
from kvserve.bench.client import RequestSpec, request_body
from kvserve.bench.config import BenchConfig, DatasetConfig
from kvserve.bench.datasets import SampleRequest, as_text, sample_requests
from kvserve.bench.metrics import RequestRecord
from kvserve.bench.multi_turn import (
    Conversation,
    conversations,
    run_conversations,
    turn_messages,
    turn_summary,
)
from kvserve.bench.scrape import metrics_url, parse_metrics, to_sample, with_hit_rates


class CharTokenizer:
    """One token per character, ids 0-1 special: enough to check lengths and seeds."""

    all_special_ids = [0, 1]

    def __len__(self) -> int:
        return 60

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) for i in ids)


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.models.loader import embedded_model_path
    from kvserve.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_path())


def test_random_prompts_have_exact_lengths_and_no_special_tokens() -> None:
    config = DatasetConfig(num_prompts=50, random_input_len=40, random_output_len=8, seed=3)
    requests = sample_requests(config, CharTokenizer())
    assert [len(r.prompt) for r in requests] == [40] * 50
    assert {r.prompt_len for r in requests} == {40} and {r.output_len for r in requests} == {8}
    assert all(2 <= i < 60 for r in requests for i in r.prompt)
    assert requests == sample_requests(config, CharTokenizer())  # seeded
    other = sample_requests(DatasetConfig(**{**config.__dict__, "seed": 4}), CharTokenizer())
    assert other != requests


def test_random_range_ratio() -> None:
    config = DatasetConfig(
        num_prompts=200, random_input_len=100, random_output_len=10, random_range_ratio=0.5
    )
    requests = sample_requests(config, CharTokenizer())
    lengths = [r.prompt_len for r in requests]
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert 50 <= min(lengths) < 60 and 140 < max(lengths) <= 150
    assert all(5 <= r.output_len <= 15 for r in requests)


def test_prefix_prompts_share_exactly_the_prefix() -> None:
    config = DatasetConfig(
        dataset_name="prefix",
        num_prompts=6,
        prefix_len=30,
        suffix_len=5,
        num_prefixes=2,
        output_len=4,
    )
    requests = sample_requests(config, CharTokenizer())
    assert [r.prompt_len for r in requests] == [35] * 6 and {r.output_len for r in requests} == {4}
    prefixes = [tuple(r.prompt[:30]) for r in requests]
    assert prefixes[0] == prefixes[2] == prefixes[4] != prefixes[1] == prefixes[3]
    assert len({tuple(r.prompt[30:]) for r in requests}) == 6


def test_sharegpt_file(tmp_path) -> None:
    data = [
        {
            "conversations": [
                {"from": "human", "value": "hello there"},
                {"from": "gpt", "value": "general kenobi"},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo!"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {
            "conversations": [
                {"from": "human", "value": "what is two and two"},
                {"from": "gpt", "value": "four"},
            ]
        },
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    config = DatasetConfig(dataset_name="sharegpt", dataset_path=str(path), num_prompts=2)
    requests = sample_requests(config, CharTokenizer())
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in requests) == [
        ("hello there", 11, 14),
        ("what is two and two", 19, 4),
    ]
    fixed = sample_requests(DatasetConfig(**{**config.__dict__, "output_len": 9}), CharTokenizer())
    assert {r.output_len for r in fixed} == {9}
    with pytest.raises(ValueError, match="fewer than --num-prompts 3"):
        sample_requests(DatasetConfig(**{**config.__dict__, "num_prompts": 3}), CharTokenizer())


def test_as_text_reencodes_to_the_exact_length(tokenizer) -> None:
    config = DatasetConfig(num_prompts=8, random_input_len=64, seed=5)
    for request in sample_requests(config, tokenizer):
        text = as_text(request, tokenizer)
        assert isinstance(text.prompt, str)
        assert len(tokenizer.encode(text.prompt, add_special_tokens=False)) == text.prompt_len
        assert text.prompt_len == 64
    same = SampleRequest("already text", 2, 3)
    assert as_text(same, tokenizer) is same


def parse(*argv: str) -> BenchConfig:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["bench", "serve", *argv]))


def test_flags_build_the_config() -> None:
    config = parse(
        "--backend",
        "openai-chat",
        "--num-prompts",
        "7",
        "--request-rate",
        "2.5",
        "--burstiness",
        "0.5",
        "--max-concurrency",
        "3",
        "--ignore-eos",
        "--goodput",
        "ttft:500",
        "tpot:50",
        "--metric-percentiles",
        "50,90,99.9",
        "--random-input-len",
        "256",
        "--base-url",
        "http://h:1/",
    )
    assert config.dataset.num_prompts == 7 and config.dataset.random_input_len == 256
    assert (config.request_rate, config.burstiness, config.max_concurrency) == (2.5, 0.5, 3)
    assert config.ignore_eos and config.slos_ms() == {"ttft": 500.0, "tpot": 50.0}
    assert config.percentiles() == [50.0, 90.0, 99.9]
    assert config.api_url == "http://h:1/v1/chat/completions"
    assert parse().request_rate == float("inf") and parse().api_url.endswith("/v1/completions")
    assert parse("--endpoint", "/x").api_url == "http://127.0.0.1:8000/x"


def test_sampling_flags_reach_every_request_body() -> None:
    """Greedy unless told; each flag given is sent, the others are left to the server."""
    sample = SampleRequest(prompt=[1, 2, 3], prompt_len=3, output_len=5)

    def body(*argv: str) -> dict:
        config = parse(*argv)
        spec = RequestSpec(
            "http://h/v1/completions", "m", sampling=tuple(config.sampling().items())
        )
        return request_body(spec, sample)

    greedy = body()
    assert greedy["temperature"] == 0.0 and not {"top_p", "top_k", "min_p"} & greedy.keys()
    sampled = body("--temperature", "0.8", "--top-p", "0.95", "--top-k", "50", "--min-p", "0.05")
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["min_p"]) == (
        0.8, 0.95, 50, 0.05,
    )  # fmt: skip
    assert sampled["max_tokens"] == 5 and sampled["prompt"] == [1, 2, 3] and sampled["stream"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--goodput", "ttft=5"], "--goodput"),
        (["--goodput", "itl:5"], "--goodput"),
        (["--percentile-metrics", "ttft,foo"], "--percentile-metrics"),
        (["--metric-percentiles", "101"], "--metric-percentiles"),
        (["--request-rate", "0"], "--request-rate"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--dataset-name", "sharegpt"], "--dataset-path"),
        (["--random-range-ratio", "1"], "--random-range-ratio"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-k", "0"], "--top-k"),
        (["--min-p", "1.5"], "--min-p"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        parse(*argv)


PAGE = """# HELP kvserve:kv_cache_usage_perc KV cache usage.
# TYPE kvserve:kv_cache_usage_perc gauge
kvserve:kv_cache_usage_perc{model_name="m"} 0.75
kvserve:num_requests_running{model_name="m"} 12.0
kvserve:num_requests_waiting{model_name="m"} 3.0
kvserve:num_preemptions_total{model_name="m"} 5.0
kvserve:num_preemptions_created{model_name="m"} 1.7e+09
kvserve:prefix_cache_queries_total{model_name="m"} 2000.0
kvserve:prefix_cache_hits_total{model_name="m"} 500.0
kvserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 9.0
process_cpu_seconds_total 3.5
"""


def test_parse_metrics_page() -> None:
    values = parse_metrics(PAGE)
    assert values["kv_cache_usage_perc"] == 0.75 and values["num_preemptions_total"] == 5.0
    assert values["process_cpu_seconds_total"] == 3.5
    sample = to_sample(values, t=1.5)
    assert sample is not None
    assert (sample.t, sample.kv_cache_usage, sample.num_running, sample.num_waiting) == (
        1.5,
        0.75,
        12.0,
        3.0,
    )
    assert (sample.num_preemptions, sample.prefix_cache_queries, sample.prefix_cache_hits) == (
        5.0,
        2000.0,
        500.0,
    )
    assert to_sample(parse_metrics("process_cpu_seconds_total 1\n"), 0.0) is None
    vllm = to_sample(parse_metrics('vllm:gpu_cache_usage_perc{m="x"} 0.5\n'), 0.0)
    assert vllm is not None and vllm.kv_cache_usage == 0.5


def test_hit_rate_counts_only_this_run() -> None:
    pages = [
        PAGE,
        PAGE.replace("2000.0", "2400.0").replace("500.0", "800.0"),
        PAGE.replace("2000.0", "2400.0").replace("500.0", "800.0"),
    ]
    samples = with_hit_rates([to_sample(parse_metrics(p), float(i)) for i, p in enumerate(pages)])
    assert [s.prefix_hit_rate for s in samples] == [None, 0.75, 0.75]


def test_metrics_url() -> None:
    assert metrics_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert metrics_url("https://h:9/v1/") == "https://h:9/metrics"


def multi_turn_config() -> DatasetConfig:
    return DatasetConfig(dataset_name="multi-turn", num_prompts=3, num_turns=3,
                         system_prompt_len=20, turn_input_len=5, turn_output_len=4)  # fmt: skip


def test_multi_turn_conversations_share_one_system_prompt_of_exact_length() -> None:
    chats = conversations(multi_turn_config(), CharTokenizer())
    assert len(chats) == 3 and len({c.system for c in chats}) == 1 and len(chats[0].system) == 20
    assert all(len(c.user_turns) == 3 and {len(u) for u in c.user_turns} == {5} for c in chats)
    assert len({u for c in chats for u in c.user_turns}) == 9  # every user turn new
    assert conversations(multi_turn_config(), CharTokenizer()) == chats  # the seed decides


def test_each_turn_resends_the_whole_history_and_conversations_interleave(monkeypatch) -> None:
    chat = Conversation("SYS", ("u0", "u1", "u2"))
    assert turn_messages(chat, ["a0", "a1"]) == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]  # fmt: skip
    sent: list[tuple[str, list[dict[str, str]]]] = []

    async def fake_send(session, spec, sample, t0, count_tokens):  # noqa: ANN001, ANN202
        conversation = sample.messages[0]["content"]
        sent.append((conversation, sample.messages))
        assert request_body(spec, sample)["messages"] is sample.messages
        await asyncio.sleep(0)  # let the other conversations run
        answer = f"{conversation}-a{(len(sample.messages) - 2) // 2}"  # a<turn>
        return RequestRecord(5, 4, success=True, generated_text=answer, input_len=10)

    monkeypatch.setattr("kvserve.bench.multi_turn.send_request", fake_send)
    chats = [Conversation(name, ("u0", "u1", "u2")) for name in ("A", "B", "C")]
    spec = RequestSpec("http://x/v1/chat/completions", "m", "openai-chat")
    records = asyncio.run(run_conversations(None, spec, multi_turn_config(), chats, 2, 0.0))
    assert [r.turn for r in records] == [0, 1, 2] * 3
    assert [c for c, _ in sent] == ["A", "B", "A", "B", "A", "B", "C", "C", "C"]  # 2 at a time
    last_of_a = [m for c, m in sent if c == "A"][-1]
    assert [m["content"] for m in last_of_a] == ["A", "u0", "A-a0", "u1", "A-a1", "u2"]


def test_turn_summary_splits_turn_one_from_the_rest() -> None:
    def record(turn: int, ttft_ms: float, cached: int) -> RequestRecord:
        return RequestRecord(10, 4, success=True, input_len=100, ttft=ttft_ms / 1000,
                             cached_tokens=cached, turn=turn)  # fmt: skip

    rows = turn_summary([record(0, 100, 0), record(0, 300, 50), record(1, 10, 80),
                         record(2, 20, 90), record(1, 30, 70)])  # fmt: skip
    assert rows["turn 1"] == pytest.approx({"count": 2, "ttft_p50_ms": 200, "ttft_p90_ms": 280,
                                            "mean_cached_fraction": 0.25})  # fmt: skip
    assert rows["turns 2+"] == pytest.approx({"count": 3, "ttft_p50_ms": 20, "ttft_p90_ms": 28,
                                              "mean_cached_fraction": 0.8})  # fmt: skip


def test_multi_turn_needs_the_chat_backend() -> None:
    with pytest.raises(ValueError, match="--backend"):
        BenchConfig(dataset=multi_turn_config())
