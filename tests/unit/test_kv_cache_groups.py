"""KV cache groups (kv/groups.py, kv/spec.py): the layout, a window group's freed blocks, and
the prefix search across groups, with exact block counts."""

from __future__ import annotations

from kv_requests import make_request

from kvserve.kv.cache_manager import KVCacheManager
from kvserve.kv.groups import NULL_BLOCK, first_kept_block, hit_length
from kvserve.kv.spec import KVCacheGroup, kv_cache_groups, kv_cache_spec

BS = 16
WINDOW = 32


def test_layout_one_group_per_kind_or_groups_of_the_rarest_kinds_size():
    assert kv_cache_groups([0, 0, 0]) == (KVCacheGroup(0, (0, 1, 2)),)
    assert kv_cache_groups([32, 32]) == (KVCacheGroup(32, (0, 1)),)
    gemma = [512] * 5 + [0]
    assert kv_cache_groups(gemma) == (
        KVCacheGroup(0, (5,)),
        *(KVCacheGroup(512, (i,)) for i in range(5)),
    )
    twelve = ([512] * 5 + [0]) * 2
    assert kv_cache_groups(twelve) == (
        KVCacheGroup(0, (5, 11)),
        KVCacheGroup(512, (0, 1)),
        KVCacheGroup(512, (2, 3)),
        KVCacheGroup(512, (4, 6)),
        KVCacheGroup(512, (7, 8)),
        KVCacheGroup(512, (9, 10)),
    )


def test_spec_counts_a_window_groups_blocks_up_to_its_window():
    spec = kv_cache_spec(6, 2, 8, "float32", "float32", BS, layer_windows=[64] * 5 + [0])
    assert spec.layers_per_block == 1
    assert spec.bytes_per_block == BS * 2 * 2 * 8 * 4
    # 1,000 tokens: 63 blocks in the full group, ceil(63 / 16) + 1 = 5 in each window group.
    assert spec.num_blocks_for_tokens(1000) == 63 + 5 * 5
    full = kv_cache_spec(6, 2, 8, "float32", "float32", BS, layer_windows=[0] * 6)
    assert full.num_blocks_for_tokens(1000) * full.bytes_per_block == 63 * 6 * BS * 2 * 2 * 8 * 4
    assert spec.slot_of_layers() == [0] * 6


def hybrid_manager(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=kv_cache_groups([WINDOW, 0]))


def run_prompt(cm: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Admit, compute and cache the whole prompt (one chunk), as the scheduler does."""
    request = make_request(cm, request_id, tokens)
    cached = cm.find_cached_prefix(request)
    assert cm.allocate_slots(request_id, cached.num_tokens, len(tokens) - cached.num_tokens,
                             cached) is not None  # fmt: skip
    cm.cache_full_blocks(request, len(tokens))


def test_window_group_frees_blocks_that_left_the_window():
    cm = hybrid_manager()
    tokens = list(range(200))
    run_prompt(cm, "a", tokens)
    assert cm.num_blocks_of("a") == 13 + 13  # the chunk wrote every block of both groups
    assert cm.allocate_slots("a", 200, 1) is not None  # the first decode
    full, [window] = cm.block_table("a"), cm.group_block_tables("a")
    first = first_kept_block(WINDOW, 200, BS)  # (200 - 31) // 16 = 10
    assert first == 10 and len(full) == 13 and NULL_BLOCK not in full
    assert window[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in window[first:]
    assert cm.num_blocks_of("a") == 13 + 3 == 13 + cm.blocks_needed(201) - 13
    cm.check_invariants()
    cm.free("a")
    assert cm.num_free_blocks == 64
    cm.check_invariants()


def test_hybrid_prefix_hit_needs_the_full_prefix_and_the_window_before_it():
    cm = hybrid_manager()
    shared = list(range(160))
    run_prompt(cm, "a", shared + [1000 + i for i in range(40)])
    cm.allocate_slots("a", 200, 1)  # frees window blocks 0..9: cached, free, still hits
    cm.free("a")
    b = make_request(cm, "b", shared + [2000 + i for i in range(40)])
    cached = cm.find_cached_prefix(b)
    assert cached.num_tokens == 160
    [window] = cached.other_groups
    kept = first_kept_block(WINDOW, 160, BS)  # (160 - 31) // 16 = 8
    assert window[:kept] == [NULL_BLOCK] * kept and len(window) == 10
    assert len(cached.block_ids) == 10
    assert cm.allocate_slots("b", 160, 40, cached) is not None
    assert cm.num_blocks_of("b") == 13 + (13 - kept)
    cm.check_invariants()


def test_hit_length_searches_windows_from_the_right_until_groups_agree():
    present = {0: set(range(10)), 1: {0, 1, 2, 3, 4, 5}, 2: {0, 1, 2, 3, 5, 6, 7, 8, 9}}

    def lookup(group: int, index: int) -> int | None:
        return index if index in present[group] else None

    # Full group: 10 blocks.  Window 32 (2 blocks before n): group 1 holds 4, 5 -> n = 6;
    # group 2 lacks 4, so at n = 6 it needs 4 and 5: the search goes on down to n = 4 where
    # group 2 needs 2, 3 and group 1 too (both hold them).
    assert hit_length((0, WINDOW, WINDOW), 10, BS, lookup) == 4
    assert hit_length((0, WINDOW), 10, BS, lookup) == 6
    assert hit_length((WINDOW,), 10, BS, lambda g, i: i if i in {7, 8, 9} else None) == 10
    assert hit_length((0,), 10, BS, lambda g, i: i if i < 3 else None) == 3


def test_one_window_group_admission_counts_only_the_window():
    cm = KVCacheManager(8, BS, groups=kv_cache_groups([WINDOW, WINDOW]))
    assert cm.blocks_needed(10_000) == 3
    tokens = list(range(100))  # 7 blocks in one chunk: fits in 8
    run_prompt(cm, "a", tokens)
    for position in range(100, 300):  # decodes far past the pool's 8 blocks of tokens
        assert cm.allocate_slots("a", position, 1) is not None
    assert cm.num_blocks_of("a") <= 3
    cm.check_invariants()


def test_fork_shares_every_group_and_copies_on_write():
    cm = hybrid_manager()
    run_prompt(cm, "a", list(range(40)))  # 2.5 blocks: the last one partial
    cm.fork("a", "b", 40)
    assert cm.group_block_tables("b") == cm.group_block_tables("a")
    assert cm.allocate_slots("b", 40, 1) is not None
    assert len(cm.take_block_copies()) == 2  # the partial block of each group
    assert cm.block_table("b")[2] != cm.block_table("a")[2]
    cm.check_invariants()
    cm.free("a")
    cm.free("b")
    assert cm.num_free_blocks == 64


GEMMA3_SHAPED = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}


def test_engine_accounting_of_a_gemma3_shaped_model_equals_the_planners():
    """The engine's spec (kv_cache_groups over the layers' windows) and `kvserve plan`'s
    layout give the same bytes per sequence; the windows let 4.5x the sequences fit."""
    from kvserve.planner.layers import kv_layout
    from kvserve.planner.model import LayerKind
    from kvserve.planner.readers import shape_from_hf_config

    shape = shape_from_hf_config(GEMMA3_SHAPED, "gemma3-shaped", "test")
    layout = kv_layout(shape, "auto", BS)
    windows = [512 if kind is LayerKind.SLIDING else 0 for kind in shape.kinds]
    assert windows == ([512] * 5 + [0]) * 2
    spec = kv_cache_spec(12, 1, 256, "auto", "bfloat16", BS, layer_windows=windows)
    assert len(spec.groups) == 6 and spec.layers_per_block == 2
    assert spec.bytes_per_sequence(8192) == layout.block_bytes_per_sequence(8192)
    all_full = kv_cache_spec(12, 1, 256, "auto", "bfloat16", BS, layer_windows=[0] * 12)
    budget = 2 * 2**30
    ratio = spec.num_blocks_in(budget) / spec.num_blocks_for_tokens(8192)
    ratio /= all_full.num_blocks_in(budget) / all_full.num_blocks_for_tokens(8192)
    assert ratio >= 3


def test_hybrid_prefix_found_in_the_host_tier_is_loaded_into_each_group():
    cm = KVCacheManager(32, BS, groups=kv_cache_groups([WINDOW, 0]), num_host_blocks=32)
    shared = list(range(160))
    run_prompt(cm, "a", shared + [1000 + i for i in range(40)])
    cm.free("a")
    cm.take_host_transfers()
    # Another request takes every device block: a's cached blocks are evicted to the host.
    run_prompt(cm, "x", [5000 + i for i in range(32 * BS // 2)])
    offloads = cm.take_host_transfers().offloads
    assert len(offloads) == 24  # the 12 full (cached) blocks of each group
    cm.free("x")
    b = make_request(cm, "b", shared + [2000 + i for i in range(40)])
    cached = cm.find_cached_prefix(b)
    kept = first_kept_block(WINDOW, 160, BS)
    assert cached.num_tokens == 160 and len(cached.host_entries) == 10 + (10 - kept)
    assert cached.num_host_tokens == 160
    assert cm.allocate_slots("b", 160, 40, cached) is not None
    loads = cm.take_host_transfers().loads
    assert len(loads) == 10 + (10 - kept)
    [window] = cm.group_block_tables("b")
    assert window[:kept] == [NULL_BLOCK] * kept and min(window[kept:]) >= 0
    assert len(window) == len(cm.block_table("b")) == 13  # 200 tokens
    assert min(cm.block_table("b")) >= 0
    cm.check_invariants()


def test_a_chunk_is_cut_to_what_the_pool_holds_under_a_window():
    """A 20-block pool holds a whole sequence of a window-32 model (3 blocks), but not a
    512-token chunk of it (32 blocks until the next step frees them): the chunk is cut."""
    cm = KVCacheManager(20, BS, groups=kv_cache_groups([WINDOW]))
    assert cm.chunk_limit(0, 512) == 256  # 16 blocks
    assert cm.chunk_limit(256, 256) == 256  # blocks 14..31: 18
    assert cm.chunk_limit(100, 1) == 1
    full = KVCacheManager(20, BS)
    assert full.chunk_limit(0, 320) == 320  # a full group: a sequence that fits, fits
