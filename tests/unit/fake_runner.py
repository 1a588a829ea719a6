"""A fake model runner for scheduler tests: no model, deterministic tokens.

It emulates a paged KV cache of token ids: each scheduled token is written into its slot
(block_table[pos // block_size], pos % block_size), and the sampled token is a function of the
whole history *read back through the block table*.  A scheduler or prefix-cache bug that feeds
wrong tokens, wrong positions or a wrong shared block therefore changes the outputs."""

from __future__ import annotations

from kvserve.step import SchedulerOutput


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        for src, dst in output.block_copies:  # copy on write, before anything is written
            for offset in range(bs):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        for item in output.scheduled:  # write every new token first, as attention does
            for i, token in enumerate(item.token_ids):
                pos = item.start_position + i
                self.slots[(item.block_table[pos // bs], pos % bs)] = token
        sampled = {}
        for item in output.scheduled:
            if item.sample:
                end = item.start_position + item.num_tokens
                history = [self.slots[(item.block_table[p // bs], p % bs)] for p in range(end)]
                sampled[item.request_id] = (sum(history) * 31 + len(history) + history[0]) % 997 + 3
        return sampled
