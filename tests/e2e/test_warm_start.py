"""``warm_start_bytes`` on a real engine: after a restart, the chunks used last are promoted into
the host tier in the background, so the first requests are served from host memory."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import (
    CASES,
    HOST_BYTES,
    PROMPTS,
    dump,
    generate_step,
    metric,
    run_phase,
    token_ids,
)

# The warm start of this store (22 small chunks) takes milliseconds; the engine is idle meanwhile.
WARM_WAIT_S = 5.0


@pytest.mark.slow
def test_restart_with_warm_start_serves_the_first_request_from_the_host_tier(tmp_path: Path) -> None:
    case = CASES["llama"]
    model_dir = case.build(tmp_path / "model", 0)
    store = tmp_path / "store"
    cold = run_phase(case.options(model_dir, store), [generate_step("cold")],
                     tmp_path / "first.log")["cold"]
    warm_opts = case.options(model_dir, store, extra_config={"warm_start_bytes": HOST_BYTES})
    warm = run_phase(warm_opts, [{"op": "drop_page_cache"}, {"op": "sleep", "seconds": WARM_WAIT_S},
                                 generate_step("after_restart")], tmp_path / "restart.log")["after_restart"]
    assert token_ids(warm) == token_ids(cold)
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [len(p) for p in PROMPTS]
    # Every prompt token not in vLLM's own prefix cache came from kvstrata's host tier.
    assert metric(warm, "kvstrata_hit_tokens_disk") == 0, dump(warm["metrics"])
    assert (metric(warm, "kvstrata_hit_tokens_host") + metric(warm, "prefix_cache_hits")
            == sum(map(len, PROMPTS))), dump(warm["metrics"])
    assert metric(warm, "kvstrata_warm_promotions") > 0, dump(warm["metrics"])
