"""Prefill alignment of the TTFT experiment: each cold run ends with the chunk a cached run of
the same cache computes, so outputs can be compared bit for bit (kvstrata.tools.ttft)."""

from __future__ import annotations

import pytest

from kvstrata.tools.ttft import BLOCK_SIZE, aligned_prefill_chunk, common_prefix, engine_options


@pytest.mark.parametrize(
    ("prompt", "whole_blocks_cache", "partial_block_cache"),
    [
        (4096, 4095, 4095),  # whole blocks: every cache computes the last token only
        (8176, 8064, 8175),  # vLLM recomputes the 112-token partial block, kvstrata one token
        (300, 256, 299),
        (129, 128, 128),
    ],
)
def test_the_cold_run_ends_with_what_the_cached_run_computes(prompt, whole_blocks_cache, partial_block_cache) -> None:
    assert aligned_prefill_chunk(prompt, BLOCK_SIZE, serves_partial_blocks=False) == whole_blocks_cache
    assert aligned_prefill_chunk(prompt, BLOCK_SIZE, serves_partial_blocks=True) == partial_block_cache


def test_engine_options_align_for_the_cache_under_test() -> None:
    def chunk(serves: bool) -> int | None:
        return engine_options("m", None, 8176, host_bytes=1, kv_cache_bytes=1,
                              serves_partial_blocks=serves).max_num_batched_tokens

    assert (chunk(True), chunk(False)) == (8175, 8064)
    # Under two blocks vLLM's default chunking stays.
    assert engine_options("m", None, 200, host_bytes=1, kv_cache_bytes=1).max_num_batched_tokens is None


def test_common_prefix_counts_leading_equal_tokens() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
