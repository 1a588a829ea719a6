"""`kvserve plan`: numbers against hand computations, readers, and the CLI's bad-input path."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.spec import kv_cache_spec
from kvserve.planner.cli import add_plan_parser, run_plan
from kvserve.planner.gpus import find_gpu
from kvserve.planner.layers import kv_layout
from kvserve.planner.model import LayerKind, ModelShape, PlanError, infer_layer_kinds
from kvserve.planner.plan import PlanInputs, engine_kv_capacity, kv_capacity, make_plan
from kvserve.planner.readers import load_model_shape, shape_from_hf_config
from kvserve.planner.report import format_plan, seq_counts_to_draw
from kvserve.planner.weights import estimate_num_params

GiB = 1024**3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_plan_parser(parser.add_subparsers())
    return parser


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    args = _parser().parse_args(["plan", *argv])
    assert args.func is run_plan
    code = run_plan(args)
    out, err = capsys.readouterr()
    return code, out, err


# --- the seed article's two numbers ----------------------------------------------------------


def test_llama2_70b_gqa_per_sequence_matches_article() -> None:
    shape = load_model_shape("llama-2-70b")
    layout = kv_layout(shape, "auto", block_size=16)
    # 2 (K,V) x 32768 tokens x 80 layers x 8 KV heads x 128 head_dim x 2 bytes (FP16)
    assert layout.bytes_per_sequence(32768) == 2 * 32768 * 80 * 8 * 128 * 2 == 10_737_418_240
    assert layout.dtype == "float16"


def test_llama2_70b_as_mha_is_eight_times_larger() -> None:
    mha = dataclasses.replace(load_model_shape("llama-2-70b"), num_kv_heads=64)
    assert mha.attention_name == "MHA"
    assert kv_layout(mha, "auto", 16).bytes_per_sequence(32768) == 85_899_345_920


def test_plan_reports_the_article_number() -> None:
    plan = make_plan(
        load_model_shape("llama-2-70b"), PlanInputs("H100-80GB", 80 * GiB, context_len=32768)
    )
    assert plan.selected.bytes_per_sequence == 10_737_418_240
    assert plan.attention == "GQA"
    assert "10,737,418,240 bytes" in format_plan(plan)


# --- standard layers are the engine's own accounting -----------------------------------------


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("tp", [1, 2, 4, 16])
def test_standard_layers_agree_with_kv_cache_spec(kv_dtype: str, tp: int) -> None:
    layout = kv_layout(load_model_shape("llama-2-70b"), kv_dtype, 16, tp)
    spec = kv_cache_spec(80, 8, 128, kv_dtype, "float16", 16, tp)
    assert layout.bytes_per_block == spec.bytes_per_block
    assert layout.bytes_per_token == spec.bytes_per_token


def test_8bit_dtypes_count_scales_like_the_engine() -> None:
    layout = kv_layout(load_model_shape("llama-3.1-8b"), "int8", 16)
    # 2 (K,V) x 32 layers x 8 heads x (128 values x 1 byte + 4-byte float32 scale)
    assert layout.bytes_per_token == 2 * 32 * 8 * (128 + 4) == 67_584
    assert kv_layout(load_model_shape("llama-3.1-8b"), "fp8_e5m2", 16).bytes_per_token == 65_536


# --- MLA (DeepSeek-V3) -----------------------------------------------------------------------


def test_mla_counts_one_latent_per_token_and_layer() -> None:
    shape = load_model_shape("deepseek-v3")
    assert shape.attention_name == "MLA"
    layout = kv_layout(shape, "auto", 16)
    # 61 layers x (512 kv_lora_rank + 64 qk_rope_head_dim) x 2 bytes: no x2, no x128 heads
    assert layout.bytes_per_token == 61 * 576 * 2 == 70_272
    assert layout.bytes_per_sequence(32768) == 70_272 * 32768 == 2_302_672_896
    assert "kv_lora_rank" in layout.formula[0]


def test_mla_is_not_split_by_tensor_parallelism() -> None:
    shape = load_model_shape("deepseek-v3")
    assert kv_layout(shape, "auto", 16, 8).bytes_per_token == 70_272


def test_mla_8bit_dtypes() -> None:
    shape = load_model_shape("deepseek-v3")
    assert kv_layout(shape, "fp8_e5m2", 16).bytes_per_token == 61 * 576 == 35_136
    # one float32 scale per token and layer for the scaled 8-bit formats
    assert kv_layout(shape, "int8", 16).bytes_per_token == 61 * (576 + 4) == 35_380


def test_deepseek_v3_plan_on_eight_h200() -> None:
    plan = make_plan(
        load_model_shape("deepseek-v3"),
        PlanInputs("H200", 141 * GiB, context_len=32768, tensor_parallel_size=8),
    )
    assert plan.weight_dtype == "fp8"  # from quantization_config.quant_method
    assert plan.weight_bytes == plan.num_params  # one byte per fp8 weight
    assert plan.weight_bytes_per_gpu == math.ceil(plan.num_params / 8)
    budget = 141 * GiB * 9 // 10 - plan.weight_bytes_per_gpu
    assert plan.kv_budget == budget
    assert plan.selected.max_num_seqs == budget // (70_272 * 32768)


# --- sliding windows (Gemma 2 27B) -----------------------------------------------------------


def test_gemma2_alternates_sliding_and_global_layers() -> None:
    shape = load_model_shape("gemma-2-27b")
    kinds = shape.kinds
    assert kinds[0] is LayerKind.SLIDING and kinds[1] is LayerKind.FULL
    assert kinds.count(LayerKind.SLIDING) == kinds.count(LayerKind.FULL) == 23
    assert shape.sliding_window == 4096


def test_gemma2_per_sequence_caps_sliding_layers_at_the_window() -> None:
    layout = kv_layout(load_model_shape("gemma-2-27b"), "auto", 16)
    per_layer = 2 * 16 * 128 * 2  # (K,V) x 16 KV heads x head_dim 128 x bf16 = 8,192 B
    assert layout.bytes_per_token == 46 * per_layer == 376_832
    # below the window every layer holds every token
    assert layout.bytes_per_sequence(4096) == 46 * per_layer * 4096 == 1_543_503_872
    # at 8,192: 23 global layers x 8,192 tokens + 23 sliding layers x 4,096 tokens
    assert layout.bytes_per_sequence(8192) == 23 * per_layer * (8192 + 4096) == 2_315_255_808


def test_gemma2_blocks_of_a_sliding_window() -> None:
    layout = kv_layout(load_model_shape("gemma-2-27b"), "auto", 16)
    block = 16 * 23 * 8192  # one block of 16 tokens in 23 layers
    # global: 8192 / 16 = 512 blocks; sliding: a 4096-token window straddles 256 + 1 blocks
    assert layout.block_bytes_per_sequence(8192) == block * (512 + 257) == 2_318_270_464
    assert layout.max_num_seqs(20 * GiB, 8192) == 9  # 21,474,836,480 // 2,318,270,464


def test_every_layer_sliding_has_no_length_limit() -> None:
    layout = kv_layout(load_model_shape("mistral-7b"), "auto", 16)
    assert layout.max_model_len(1 * GiB) is None
    assert layout.max_model_len(1024) == 0


def test_layers_without_kv_and_mixed_kinds() -> None:
    shape = ModelShape(
        name="hybrid", architecture="test", num_layers=4, hidden_size=16,
        intermediate_size=32, vocab_size=10, num_heads=4, num_kv_heads=2, head_dim=4,
        torch_dtype="float32", sliding_window=8,
        layer_kinds=(LayerKind.FULL, LayerKind.NONE, LayerKind.SLIDING, LayerKind.NONE),
    )  # fmt: skip
    layout = kv_layout(shape, "auto", block_size=4)
    per_layer = 2 * 2 * 4 * 4  # (K,V) x 2 heads x 4 dims x 4 bytes = 64 B per token
    assert layout.num_layers_without_kv == 2
    assert layout.bytes_per_token == 2 * per_layer
    assert layout.bytes_per_sequence(20) == per_layer * (20 + 8)
    # full: 5 blocks; sliding: an 8-token window straddles ceil(7 / 4) + 1 = 3 blocks
    assert layout.block_bytes_per_sequence(20) == per_layer * 4 * (5 + 3)
    assert any("no attention" in line for line in layout.formula)


def test_max_model_len_is_whole_blocks_of_the_budget() -> None:
    layout = kv_layout(load_model_shape("llama-3.1-8b"), "auto", 16)
    budget = 10 * GiB + 12345
    assert layout.max_model_len(budget) == budget // layout.bytes_per_block * 16


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 96),
    num_kv_heads=st.integers(1, 64),
    head_dim=st.sampled_from([32, 64, 80, 128, 256]),
    kv_dtype=st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2", "int8"]),
    block_size=st.sampled_from([1, 8, 16, 32]),
    tp=st.integers(1, 8),
    budget=st.integers(0, 200 * GiB),
    context=st.integers(1, 300_000),
)
def test_uniform_models_count_like_the_engine(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, block_size: int,
    tp: int, budget: int, context: int,
) -> None:  # fmt: skip
    shape = ModelShape(
        name="random", architecture="test", num_layers=num_layers, hidden_size=head_dim,
        intermediate_size=1, vocab_size=1, num_heads=num_kv_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, torch_dtype="bfloat16",
    )  # fmt: skip
    layout = kv_layout(shape, kv_dtype, block_size, tp)
    spec = kv_cache_spec(num_layers, num_kv_heads, head_dim, kv_dtype, "bfloat16", block_size, tp)
    num_blocks = spec.num_blocks_in(budget)
    assert layout.max_num_seqs(budget, context) == num_blocks // spec.num_blocks_for_tokens(context)
    assert layout.max_model_len(budget) == num_blocks * block_size
    cap = engine_kv_capacity(num_layers, num_kv_heads, head_dim, "bfloat16", block_size=block_size,
                             kv_cache_dtype=kv_dtype, kv_cache_memory=budget,
                             max_model_len=context, tensor_parallel_size=tp)  # fmt: skip
    assert kv_capacity(layout, budget, context) == cap


@settings(max_examples=40, deadline=None)
@given(budget=st.integers(0, 80 * GiB), block_size=st.sampled_from([8, 16, 32]))
def test_max_model_len_is_the_longest_that_fits_with_windows(budget: int, block_size: int) -> None:
    layout = kv_layout(load_model_shape("gemma-2-27b"), "auto", block_size)
    longest = layout.max_model_len(budget)
    assert longest is not None and longest % block_size == 0
    assert layout.block_bytes_per_sequence(longest) <= budget
    assert layout.block_bytes_per_sequence(longest + block_size) > budget


# --- tensor parallelism ----------------------------------------------------------------------


def test_tp_split_of_llama2_70b_on_h100() -> None:
    plan = make_plan(
        load_model_shape("llama-2-70b"),
        PlanInputs("H100-80GB", 80 * GiB, context_len=32768, tensor_parallel_size=4),
    )
    weights = 68_976_648_192 * 2  # params x fp16
    assert plan.weight_bytes == weights
    assert plan.weight_bytes_per_gpu == weights // 4 == 34_488_324_096
    assert plan.usable_memory == 77_309_411_328  # 0.9 x 80 GiB
    assert plan.kv_budget == 77_309_411_328 - 34_488_324_096 == 42_821_087_232
    row = plan.selected
    assert row.bytes_per_token == 2 * 80 * 2 * 128 * 2 == 81_920  # 8 KV heads / 4 ranks
    assert row.num_blocks == 42_821_087_232 // (81_920 * 16) == 32_669
    assert row.max_num_seqs == 32_669 // 2048 == 15
    assert row.max_concurrency == 32_669 / 2048


def test_tp_replicates_kv_heads_when_fewer_than_ranks() -> None:
    layout = kv_layout(load_model_shape("llama-2-70b"), "auto", 16, 16)
    assert layout.bytes_per_token == 2 * 80 * 1 * 128 * 2  # one head per rank
    assert "replicated" in " ".join(layout.formula)


# --- engine check ----------------------------------------------------------------------------


def test_engine_kv_capacity_for_the_embedded_model() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bfloat16
    cap = engine_kv_capacity(
        30,
        3,
        64,
        "bfloat16",
        block_size=16,
        kv_cache_dtype="auto",
        kv_cache_memory=1 * GiB,
        max_model_len=8192,
    )
    assert cap.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert cap.bytes_per_block == 368_640
    assert cap.num_blocks == GiB // 368_640 == 2912
    assert cap.blocks_per_seq == 512
    assert cap.max_concurrency == 2912 / 512
    layout = kv_layout(load_model_shape("smollm2-135m"), "auto", 16)
    assert kv_capacity(layout, 1 * GiB, 8192) == cap


# --- weights ---------------------------------------------------------------------------------


def test_param_estimates() -> None:
    assert estimate_num_params(load_model_shape("llama-2-7b")) == 6_738_415_616
    assert estimate_num_params(load_model_shape("llama-2-70b")) == 68_976_648_192
    published = {
        "deepseek-v3": 671e9,
        "mixtral-8x7b": 46.7e9,
        "gemma-2-27b": 27.2e9,
        "qwen2.5-7b": 7.61e9,
        "llama-3.1-8b": 8.03e9,
        "llama-3.1-405b": 405.9e9,
    }
    for name, count in published.items():
        assert estimate_num_params(load_model_shape(name)) == pytest.approx(count, rel=0.01)


# --- readers ---------------------------------------------------------------------------------


def test_hf_directory_reads_like_the_preset(tmp_path: Path) -> None:
    from kvserve.planner.presets import find_preset

    preset = find_preset("gemma-2-27b")
    assert preset is not None
    (tmp_path / "config.json").write_text(json.dumps(dict(preset.config)))
    shape = load_model_shape(str(tmp_path))
    assert shape.kinds == load_model_shape("gemma-2-27b").kinds
    assert kv_layout(shape, "auto", 16).bytes_per_sequence(8192) == 2_315_255_808


def test_preset_found_by_hugging_face_id() -> None:
    assert load_model_shape("meta-llama/Llama-2-70b-hf").num_kv_heads == 8


def test_layer_kind_rules() -> None:
    assert infer_layer_kinds("qwen2", 4, 4096, use_sliding_window=False) == ()
    gemma3 = infer_layer_kinds("gemma3", 6, 1024, sliding_window_pattern=6)
    assert gemma3 == (LayerKind.SLIDING,) * 5 + (LayerKind.FULL,)
    types = ["linear_attention", "full_attention", "sliding_attention"]
    assert infer_layer_kinds("x", 3, 8, layer_types=types) == (
        LayerKind.NONE,
        LayerKind.FULL,
        LayerKind.SLIDING,
    )


def test_gguf_metadata_and_exact_weights(tmp_path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_context_length(256)
    writer.add_vocab_size(100)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float16))
    writer.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = load_model_shape(str(path))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 16)
    assert shape.num_params == 6400 + 64
    assert shape.weight_bytes == 6400 * 2 + 64 * 4
    assert kv_layout(shape, "auto", 16).bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_gguf_missing_key_is_named(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "bad.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PlanError, match="llama.embedding_length"):
        load_model_shape(str(path))


# --- CLI and bad input -----------------------------------------------------------------------


def test_cli_table_names_formula_and_all_dtypes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        [
            "llama-2-70b",
            "--context",
            "32768",
            "--gpu",
            "a100-80gb",
            "--tensor-parallel-size",
            "2",
            "--batch",
            "4",
        ],
        capsys,
    )
    assert code == 0 and err == ""
    assert "GQA: 2 (K,V) x 80 layers x 4 KV heads x 128 head_dim" in out
    for name in ("auto (float16)", "fp8_e4m3", "fp8_e5m2", "int8"):
        assert name in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        [
            "deepseek-v3",
            "--context",
            "4096",
            "--memory",
            "141GiB",
            "--tensor-parallel-size",
            "8",
            "--kv-cache-dtype",
            "fp8",
            "--json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert code == 0 and data["selected"] == "fp8_e4m3"
    assert {d["kv_cache_dtype"] for d in data["dtypes"]} == {
        "auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "k8v4",
    }  # fmt: skip
    assert data["dtypes"][0]["bytes_per_sequence"] == 70_272 * 4096


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    code, _, _ = _run(
        ["llama-3.1-8b", "--context", "8192", "--gpu", "L4", "--batch", "12", "--plot", str(png)],
        capsys,
    )
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seq_counts_to_draw() -> None:
    assert seq_counts_to_draw(3) == [1, 2, 3]
    counts = seq_counts_to_draw(64)
    assert counts[0] == 1 and counts[-1] == 64 and len(counts) <= 8


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["llama-9"], "unknown preset 'llama-9'"),
        (["llama-9"], "llama-2-70b"),  # the known presets are listed
        (["llama-2-7b", "--memory", "0"], "--memory must be positive"),
        (["llama-2-7b", "--memory", "lots"], "--memory"),
        (["llama-2-7b", "--gpu", "Z80"], "unknown GPU 'Z80'"),
        (["llama-2-7b", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["llama-2-7b", "--block-size", "12"], "--block-size"),
        (["llama-2-7b", "--context", "0"], "--context"),
        (["llama-2-7b", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["missing.gguf"], "no such file: missing.gguf"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("kvserve plan: error: ") and err.count("\n") == 1
    assert expected in err
    assert "Traceback" not in err


def test_config_without_a_needed_field_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    code, _, err = _run([str(config)], capsys)
    assert code == 2
    assert "'num_hidden_layers'" in err and err.count("\n") == 1


def test_mla_config_without_rope_dim_names_it() -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 10,
        "kv_lora_rank": 16,
    }
    with pytest.raises(PlanError, match="qk_rope_head_dim"):
        shape_from_hf_config(config, "tiny-mla", "config.json")


def test_gpu_presets() -> None:
    assert find_gpu("h200").memory_bytes == 141 * GiB
    assert find_gpu("RTX 4090").memory_bytes == 24 * GiB
    assert find_gpu("a100_40gb").memory_bytes == 40 * GiB
