"""The pure parts of the CUDA graph runner (runner/cuda_graphs.py): which batch sizes and
block-table widths are captured, and which graph a decode batch is padded to."""

from __future__ import annotations

import torch

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.runner.cuda_graphs import (
    backend_is_graph_safe,
    capture_batch_sizes,
    capture_block_widths,
    describe,
    graphs_enabled,
    plan_graphs,
)


def test_batch_sizes_follow_vllms_pattern_up_to_max_num_seqs_included():
    assert capture_batch_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # the cap itself is captured
    assert capture_batch_sizes(3) == (1, 2, 3)
    assert capture_batch_sizes(1) == (1,)
    assert capture_batch_sizes(1024)[-1] == 256  # larger batches run eagerly


def test_widths_are_powers_of_two_blocks_up_to_the_longest_covered_sequence():
    assert capture_block_widths(4096, 16) == (16, 32, 64, 128, 256)
    assert capture_block_widths(1000, 16) == (16, 32, 63)  # 1,000 tokens: 63 blocks
    assert capture_block_widths(100, 16) == (7,)
    assert capture_block_widths(131072, 16)[-1] == 512  # capped at 8,192 tokens


def test_plan_caps_the_gathered_tokens_and_pads_to_the_next_captured_graph():
    plan = plan_graphs(max_num_seqs=64, max_model_len=4096, block_size=16, max_gather_tokens=2**15)
    assert (64, 32) in plan.keys and (64, 64) not in plan.keys  # 64 x 32 x 16 = 32,768
    assert (8, 256) in plan.keys and (16, 256) not in plan.keys
    assert plan.padded(3, 5) == (4, 16)  # 3 sequences -> 4, 5 blocks -> 16
    assert plan.padded(8, 16) == (8, 16)  # exact sizes need no padding
    assert plan.padded(33, 17) == (40, 32)
    assert plan.padded(40, 33) is None  # (40, 64) gathers too much: eager
    assert plan.padded(65, 1) is None  # past the largest batch size
    assert plan.padded(1, 257) is None  # past the widest table
    assert plan.max_batch_size == 64 and plan.max_block_width == 256


def test_a_single_sequence_always_gets_a_graph():
    plan = plan_graphs(max_num_seqs=4, max_model_len=8192, block_size=16, max_gather_tokens=1)
    assert plan.keys == frozenset({(1, 16)})


def test_only_a_backend_class_that_declares_a_graph_safe_decode_gets_graphs():
    class OwnDecode(TorchRefBackend):  # like the C kernel's backend: its own decode
        pass

    assert backend_is_graph_safe(TorchRefBackend())
    assert not backend_is_graph_safe(OwnDecode())


def test_the_plan_is_described_in_one_line():
    plan = plan_graphs(max_num_seqs=256, max_model_len=8192, block_size=16)
    assert describe(plan) == "batch sizes 1-256 (35), block-table widths 16-512 (6)"


def test_graphs_only_on_cuda_and_never_with_enforce_eager():
    assert graphs_enabled(torch.device("cuda"), enforce_eager=False)
    assert not graphs_enabled(torch.device("cuda"), enforce_eager=True)
    assert not graphs_enabled(torch.device("cpu"), enforce_eager=False)
