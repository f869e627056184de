"""kvstrata on a real vLLM engine (CPU) for each KV cache layout it must serve.

For every model: reload after ``reset_prefix_cache()`` (host tier), a restart (disk tier), a
corrupted record, and a store written by another model. Each model's stages run once, in order,
in their own engine processes (see ``e2e_harness.Scenario``); the tests assert on their results.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from e2e_harness import (
    CASES,
    PROMPTS,
    Scenario,
    dump,
    kvstrata_hits,
    metric,
    namespaces_of,
    read_record,
    store_keys,
    token_ids,
)

from kvstrata.connector.keys import NAMESPACE_BYTES


@pytest.fixture(scope="module", params=sorted(CASES))
def scenario(request: pytest.FixtureRequest, scenarios: Callable[[str], Scenario]) -> Scenario:
    return scenarios(request.param)  # shared with the equivalence tests: run once per session


@pytest.mark.slow
def test_reset_prefix_cache_then_served_from_host_tier(scenario: Scenario) -> None:
    cold, host = scenario.first["cold"], scenario.first["host"]
    assert kvstrata_hits(cold) == 0, dump(cold["metrics"])
    assert token_ids(host) == token_ids(cold)
    # vLLM's device cache was emptied: the prefix must come from kvstrata, and vLLM must agree.
    assert metric(host, "kvstrata_hit_tokens_host") > 0, dump(host["metrics"])
    assert metric(host, "external_prefix_cache_hits") > 0, dump(host["metrics"])
    # At least the unrelated second prompt's full blocks (it shares nothing with the others).
    assert kvstrata_hits(host) >= len(PROMPTS[1]) // 2, dump(host["metrics"])
    if scenario.case.eagle:  # the drafter really ran, in the cold run and over served KV
        assert metric(cold, "spec_decode_num_drafts") > 0, dump(cold["metrics"])
        assert metric(host, "spec_decode_num_drafts") > 0, dump(host["metrics"])
    unit = scenario.case.prefix_match_unit
    if unit is not None:
        # Partial tails: every prompt is served up to its last hash boundary before its last
        # token, inside a Mamba block (not a multiple of the 384-token block).
        assert kvstrata_hits(host) == sum((len(p) - 1) // unit * unit for p in PROMPTS), dump(host["metrics"])


@pytest.mark.slow
def test_restart_serves_first_request_from_disk(scenario: Scenario) -> None:
    cold = scenario.first["cold"]
    disk = scenario.restart["disk"]
    assert token_ids(disk) == token_ids(cold)
    assert metric(disk, "kvstrata_hit_tokens_disk") > 0, dump(disk["metrics"])
    assert metric(disk, "prompt_tokens_cached_by_source{source=disk}") > 0, dump(disk["metrics"])
    assert kvstrata_hits(disk) >= len(PROMPTS[1]) // 2, dump(disk["metrics"])
    if scenario.case.eagle:
        assert metric(disk, "spec_decode_num_drafts") > 0, dump(disk["metrics"])
    if scenario.case.prefix_match_unit is not None:
        assert kvstrata_hits(disk) == kvstrata_hits(scenario.first["host"]), dump(disk["metrics"])
    if scenario.case.serves_prompt_tails:
        # None of the prompts ends on a block boundary: the two unrelated ones are served to the
        # end of their tails, the whole prompt or one token short with a window (docs/SEMANTICS.md R21). (The third
        # shares the first's 1000 tokens: with 2-block chunks vLLM's own cache then holds half a
        # chunk of it, and a chunk is loaded only with at least a chunk beyond the local hit.)
        end = 1 if scenario.case.window else 0
        assert [o["num_cached_tokens"] for o in disk["outputs"][:2]] == [len(p) - end for p in PROMPTS[:2]]


@pytest.mark.slow
def test_corrupt_record_is_detected_missed_and_recomputed(scenario: Scenario) -> None:
    cold = scenario.first["cold"]
    clean = scenario.restart["disk"]
    key, steps = scenario.corrupted
    after = steps["after_corruption"]
    assert token_ids(after) == token_ids(cold)
    # Detected: the store reports that very record as corrupt (checksum) and treats it as a miss.
    assert f"corrupt record {key.hex()}" in scenario.log_text("corrupted-then-foreign")
    # The chunks from the corrupted one on could not be served: fewer hits than a clean store,
    # but the chunks before it (and the other prompts) still were.
    assert 0 < kvstrata_hits(after) < kvstrata_hits(clean), dump(after["metrics"])
    # Streamed loads (kv_load_failure_policy "recompute") found it corrupt after the hit was
    # answered: the load failed and vLLM recomputed. Verified first ("fail"), no load failed.
    failures = metric(after, "kvstrata_load_failures")
    if scenario.case.engine.get("kv_load_failure_policy") == "fail":
        assert failures == 0, dump(after["metrics"])
    else:
        assert failures >= 1, dump(after["metrics"])
    # The bad record is gone or was rewritten from the recomputed KV; either way it decodes.
    present, decoded, corrupt = read_record(scenario.store, key)
    assert not present or (decoded is not None and corrupt == 0)


@pytest.mark.slow
def test_store_written_by_another_model_gives_zero_hits(scenario: Scenario) -> None:
    foreign = scenario.foreign["foreign"]
    assert kvstrata_hits(foreign) == 0, dump(foreign["metrics"])
    assert metric(foreign, "external_prefix_cache_hits") == 0, dump(foreign["metrics"])
    # The check means something only if both models stored the very same chunk keys, so that
    # the fingerprint alone kept them apart.
    ours = namespaces_of(scenario.store, scenario.case.model_path(scenario.model_dir))
    theirs = namespaces_of(scenario.store, scenario.case.model_path(scenario.root / "other-model"))
    assert ours and theirs and not ours & theirs
    ours_keys = {k[NAMESPACE_BYTES:] for k in store_keys(scenario.store, ours)}
    theirs_keys = {k[NAMESPACE_BYTES:] for k in store_keys(scenario.store, theirs)}
    assert ours_keys & theirs_keys
