"""The CPU KV cache asks for transparent huge pages (kv_cache.py, _huge_page_table): where the
kernel allows them, the cache's mapping is backed by them; the tables are filled as before."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvserve.attention.kv_cache import allocate_kv_caches
from kvserve.kv.spec import kv_cache_spec

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kib_of_mapping(address: int) -> int:
    """AnonHugePages (kB) of the /proc/self/smaps mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_the_cpu_cache_lives_on_huge_pages():
    spec = kv_cache_spec(2, 3, 64, "int8", "bfloat16", 16)
    caches = allocate_kv_caches(spec, 2000, torch.device("cpu"))  # 6 MB per K/V table
    key = caches[0].key
    assert huge_kib_of_mapping(key.data_ptr()) >= 2048  # at least one whole 2 MiB page
    assert not key.any() and bool((caches[1].value_scale == 1).all())
