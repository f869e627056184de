"""A served token equals a recomputed one: every layout, every tier, every feature that serves.

For each model (``e2e_harness.CASES``) and each round its scenario serves — ``host`` after
``reset_prefix_cache()``, ``disk`` after a real restart with the page cache dropped, a host tier
too small for the round (``tight_host``), a store written through a host tier too small for its
stores (``cut_stores``), a warm start, and after a corrupted record — every
completion is compared with the same engine recomputing its prompt alone (``equivalence``). The
feature tests then check that each serving feature really was exercised in those rounds: a
feature that silently stopped serving would otherwise pass the comparison vacuously. "Served"
counts what kvstrata served each request (its own attribution, ``Completion.served``, by tier),
never vLLM's ``num_cached_tokens``, which adds vLLM's own prefix-cache hits: half the prompts
share one trunk, so vLLM's cache alone serves many of them in the same engine.

Last, each model's story on its three long prompts: reloaded from the host tier, served from
disk after a restart, a corrupted record detected and recomputed, and no hit on a store another
model wrote (same chunk keys, another fingerprint).

Float32 except Qwen3-Next: vLLM's CPU Gated DeltaNet runs only in bf16. There the served and
the recomputed requests run alone (``max_num_seqs`` 1) and compute the same prefill chunks (the
scheduler splits both at the same Mamba and replay boundaries), so the same tolerance holds.
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
from equivalence import COUNTS, boundary_lengths, divergences, served_tokens, summary

from kvstrata.connector.keys import NAMESPACE_BYTES
from kvstrata.tiers.disk import DiskStore

ROUNDS = [(name, r) for name in sorted(CASES)
          for r in ["cold", "host", "disk", *(x.name for x in CASES[name].restarts), "after_corruption"]]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "round_name"), ROUNDS, ids=[f"{c}-{r}" for c, r in ROUNDS])
def test_served_equals_recomputed(scenarios: Callable[[str], Scenario], case: str, round_name: str) -> None:
    verdicts = scenarios(case).verdicts(round_name)
    COUNTS.append(f"{case} {round_name}: {summary(verdicts)}")
    assert not divergences(verdicts), "\n".join(divergences(verdicts))
    if round_name != "cold":
        assert any(v.served for v in verdicts), summary(verdicts)
        # The tier each round serves from: after a restart nothing is in the host tier until
        # kvstrata brings it up from disk, so those rounds' hits were promoted from disk.
        tiers = {t for v in verdicts for t in v.served_by_tier}
        if round_name in ("disk", "tight_host", "cut_stores", "read_processes"):
            assert "disk" in tiers, summary(verdicts)
        if round_name == "host":
            assert tiers == {"host"}, summary(verdicts)


def _eq_outputs(sc: Scenario, name: str) -> list[tuple[list[int], dict]]:
    return list(zip(sc.round_prompts(name), sc.step(f"eq_{name}")["outputs"], strict=True))


def _tail_end(case: str, n: int) -> int | None:
    """Where a prompt-tail hit of an ``n``-token prompt ends, or None when it has no tail."""
    c = CASES[case]
    if n % c.chunk < 2:
        return None
    return n - 1 if c.window else n


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "llama_verify_first", "gemma3", "llama_eagle"])
def test_prompt_tails_are_served(scenarios: Callable[[str], Scenario], case: str) -> None:
    """Every independent prompt repeated after ``reset_prefix_cache()`` is served to the end of
    its tail: the whole prompt (full attention) or one token short (a sliding window, docs/SEMANTICS.md R21). The
    gemma3 lengths include those where N - W + 1 falls on a block (issue 22, defect 1)."""
    sc = scenarios(case)
    checked = 0
    block = CASES[case].block
    for prompt, out in _eq_outputs(sc, "host"):
        end = _tail_end(case, len(prompt))
        if tuple(prompt) in sc.eq.independent and end is not None:
            # The hit ends at the tail, and kvstrata served it: vLLM's own cache holds whole
            # blocks only, so the partial block past them came from kvstrata.
            served, cached = served_tokens(out), out["num_cached_tokens"]
            assert cached == end and served >= end % block and served > 0, (len(prompt), cached, served)
            checked += 1
    assert checked >= 5


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "llama_verify_first", "llama_auto_chunks", "gemma3"])
def test_longer_prompts_are_served_the_tails_they_start_with(scenarios: Callable[[str], Scenario], case: str) -> None:
    """A second-round prompt that extends an independent first-round prompt (by a few tokens, or
    by a block and a token) is served to that prompt's end from its stored tail, inside the block
    it ended in: with a sliding window too, the hit being short of the request's last token
    (docs/SEMANTICS.md R21a). Compared with recomputation in test_served_equals_recomputed; after
    a restart, the multi-turn follow-ups reach at least their first turn's end."""
    sc = scenarios(case)
    chunk, block = CASES[case].chunk, CASES[case].block
    firsts = [p for p in sc.eq.first if tuple(p) in sc.eq.independent and len(p) % chunk >= 2]
    checked = 0
    for prompt, out in _eq_outputs(sc, "host"):
        bases = [len(p) for p in firsts if len(p) < len(prompt) and prompt[: len(p)] == p]
        if not bases:
            continue
        cached, served = out["num_cached_tokens"], served_tokens(out)
        assert cached == max(bases), (len(prompt), max(bases), cached, served)
        # A base ending on a block boundary inside a 2-block chunk may be all vLLM's own.
        if max(bases) % block:
            assert served > 0, (len(prompt), max(bases), cached, served)
            checked += 1
    assert checked >= 3, checked
    follow_ups = [(n, out["num_cached_tokens"]) for (_, n), (_, out)
                  in zip(sc.follow_ups, _eq_outputs(sc, "disk_follow_ups"), strict=True) if n % chunk >= 2]
    assert follow_ups and all(cached >= n for n, cached in follow_ups), follow_ups


@pytest.mark.slow
def test_partial_tails_are_served(scenarios: Callable[[str], Scenario]) -> None:
    """Qwen3-Next hashed every 128 tokens: prompts are served to a hash boundary inside a Mamba
    block, from the host tier and after a restart."""
    sc = scenarios("qwen3_next_tails")
    for name in ("host", "disk"):
        # A hit's external part comes after vLLM's own: served by kvstrata, it ends the hit.
        inside = [out["num_cached_tokens"] for _, out in _eq_outputs(sc, name)
                  if served_tokens(out) and out["num_cached_tokens"] % 384]
        assert len(inside) >= 5, (name, inside)


@pytest.mark.slow
def test_mamba_states_are_served_at_their_chunks(scenarios: Callable[[str], Scenario]) -> None:
    sc = scenarios("qwen3_next")
    served = [out["num_cached_tokens"] for _, out in _eq_outputs(sc, "host") if served_tokens(out)]
    assert len(served) >= 5 and all(n % 384 == 0 for n in served), served


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "llama_auto_chunks", "gemma3"])
def test_the_store_records_the_chunks_auto_chose(scenarios: Callable[[str], Scenario], case: str) -> None:
    """``blocks_per_chunk`` "auto" (the default): 128-token blocks and a sliding window keep one
    block per chunk; 32-token blocks of plain full attention are stored two to a chunk."""
    sc = scenarios(case)
    sc.step("eq_disk")  # the store has been written and read back
    [space] = namespaces_of(sc.store, sc.case.model_path(sc.model_dir))
    with DiskStore(sc.store, budget_bytes=1 << 40, readonly=True, create=False) as disk:
        info = disk.namespaces()[space]
    assert int(info["block_size"]) == CASES[case].block
    assert int(info["block_size"]) * int(info["blocks_per_chunk"]) == CASES[case].chunk, info


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_disk_tier_serves_after_a_restart(scenarios: Callable[[str], Scenario], case: str) -> None:
    step = scenarios(case).step("eq_disk")
    assert metric(step, "kvstrata_hit_tokens_disk") > 0, dump(step["metrics"])


@pytest.mark.slow
@pytest.mark.parametrize(("case", "streamed"), [("llama", True), ("llama_verify_first", False)],
                         ids=["streamed", "verified-first"])
def test_disk_loads_stream_only_under_the_recompute_policy(
        scenarios: Callable[[str], Scenario], case: str, streamed: bool) -> None:
    step = scenarios(case).step("eq_disk")
    assert (metric(step, "kvstrata_streamed_loads") > 0) is streamed, dump(step["metrics"])
    if not streamed:  # lookups waited on promotions, holding what they found meanwhile
        assert metric(step, "kvstrata_waiting_holds") > 0, dump(step["metrics"])


@pytest.mark.slow
@pytest.mark.parametrize(("case", "round_name", "sync"),
                         [("llama", "disk", True), ("llama_verify_first", "disk", True),
                          ("llama", "async_loads", False), ("gemma3", "disk", False)],
                         ids=["streamed", "verified-first", "async-option", "two-groups"])
def test_cpu_engines_load_in_the_step_that_computes(
        scenarios: Callable[[str], Scenario], case: str, round_name: str, sync: bool) -> None:
    """sync_loads "auto": one-group engines on CPU load a hit before the forward of the step
    that computes it (streamed disk hits too; a hit of a whole prompt stays asynchronous, vLLM
    recomputes its last token); the option off, or several KV cache groups, keep asynchronous
    loads. Both kinds are compared with recomputation in test_served_equals_recomputed."""
    step = scenarios(case).step(f"eq_{round_name}")
    loads, synced = metric(step, "kvstrata_load_jobs"), metric(step, "kvstrata_sync_loads")
    assert loads > 0, dump(step["metrics"])
    assert (0 < synced <= loads) if sync else synced == 0, dump(step["metrics"])


@pytest.mark.slow
@pytest.mark.parametrize(("case", "in_pieces"), [("llama", None), ("gemma3", True)])
def test_a_tight_host_tier_serves_from_disk(scenarios: Callable[[str], Scenario], case: str,
                                            in_pieces: bool | None) -> None:
    step = scenarios(case).step("eq_tight_host")
    assert metric(step, "kvstrata_hit_tokens_disk") > 0, dump(step["metrics"])
    # The round's requests arrive together: their lookups wait for host-tier room to promote
    # what the disk holds (host_room_wait_s), and what they are then served equals the
    # recomputation (the round's verdict, test_served_equals_recomputed). The 1 MiB host tier
    # holds 4 chunks here: Gemma 3's longest hits (a window group's chunks beside the full
    # one's) need more at once, so they are loaded through it in pieces; Llama's fit unless
    # stores hold the room when they come (stores are cut to the room since stop 63, so they
    # take it more often: either happens, with the timing).
    assert metric(step, "kvstrata_promotion_room_waits") > 0, dump(step["metrics"])
    if in_pieces is not None:
        assert (metric(step, "kvstrata_pieced_loads") > 0) is in_pieces, dump(step["metrics"])
        assert (metric(step, "kvstrata_load_pieces") > 0) is in_pieces, dump(step["metrics"])
    # Loads fail here only where a piece waited host_room_wait_s for room with none moving
    # (given up and computed; the round's verdict covers what was served).
    assert (metric(step, "kvstrata_load_failures")
            == metric(step, "kvstrata_pieced_loads_given_up")), dump(step["metrics"])
    assert metric(step, "kvstrata_host_bytes") <= 1 << 20, dump(step["metrics"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_stores_cut_to_the_host_tiers_room_are_served_after_a_restart(
        scenarios: Callable[[str], Scenario], case: str) -> None:
    """The round ``cut_stores`` (e2e_harness.CUT_STORES): its store was written through a 1 MiB
    host tier (4 slots), the long prompts' offers cut to its room, and a restarted engine is
    served from what those cut stores wrote. What was served, and what was computed while the
    stores were cut, equals the recomputation (test_served_equals_recomputed)."""
    sc = scenarios(case)
    writing = [sc.step("cut_stores_writing"), sc.step("eq_cut_stores_writing")]
    assert sum(metric(s, "kvstrata_stores_cut") for s in writing) > 0, dump(writing[0]["metrics"])
    assert sum(metric(s, "kvstrata_store_failures") for s in writing) == 0, dump(writing[0]["metrics"])
    # The first prompt's first cut filled the 4 slots; later offers, as the requests decoded,
    # stored more once the write-behind gave slots back (how much more depends on how fast it
    # did). Each cut stores the start of what is left, and a store never evicts a chunk the
    # disk has not got yet, so each long prompt's chunks on disk are a prefix, without a hole
    # (before that fix, the first prompt's were chunks 0-6 and 9 of 10):
    written = sc.written["cut_stores"]
    assert len(written[0]) >= 4 and sum(map(len, written)) > 4, written
    assert all(blocks == list(range(len(blocks))) for blocks in written), written
    # Served from that store after the restart: the long prompts (Gemma 3's only where a window
    # chunk was stored where their stored full-attention run ends, which depends on how the
    # cuts fell; a CI run had none) or the equivalence prompts.
    served = [sc.step("cut_stores"), sc.step("eq_cut_stores")]
    assert sum(metric(s, "kvstrata_hit_tokens_disk") for s in served) > 0, (
        written, dump(served[0]["metrics"]), dump(served[1]["metrics"]))


@pytest.mark.slow
def test_a_warm_start_serves_from_the_host_tier(scenarios: Callable[[str], Scenario]) -> None:
    step = scenarios("llama").step("eq_warm_start")
    assert metric(step, "kvstrata_warm_promotions") > 0, dump(step["metrics"])
    assert metric(step, "kvstrata_hit_tokens_host") > 0, dump(step["metrics"])
    assert metric(step, "kvstrata_hit_tokens_disk") == 0, dump(step["metrics"])


@pytest.mark.slow
def test_follow_ups_are_served_the_decoded_tokens(scenarios: Callable[[str], Scenario]) -> None:
    """With ``offload_prompt_only`` false the answer's KV is stored too: its complete chunks,
    and at finish the chunk holding the end of what it wrote as a tail. After a restart each
    follow-up turn (prompt, answer, new turn) is served to the end of the KV its first turn
    wrote (the answer's last token never had KV written), from the disk tier."""
    sc = scenarios("llama_verify_first")
    chunk = CASES["llama_verify_first"].chunk
    written = {tuple(p + a[:-1]): len(p) + len(a) - 1
               for p, a in zip(sc.eq.first, token_ids(sc.first["eq_cold"]), strict=True)}
    checked = 0
    for prompt, out in _eq_outputs(sc, "disk_follow_ups"):
        end = max(n for turn, n in written.items() if tuple(prompt[: len(turn)]) == turn)
        if end % chunk < 2:
            continue  # no tail: ends on (or one token past) a chunk boundary
        assert out["num_cached_tokens"] == end and served_tokens(out) > 0, (len(prompt), end, out["num_cached_tokens"])
        checked += 1
    assert checked >= 3, checked


@pytest.mark.slow
def test_the_drafter_runs_over_served_kv(scenarios: Callable[[str], Scenario]) -> None:
    sc = scenarios("llama_eagle")
    for name in ("eq_host", "eq_disk"):
        assert metric(sc.step(name), "spec_decode_num_drafts") > 0, dump(sc.step(name)["metrics"])


def test_boundary_lengths_cover_every_boundary() -> None:
    """The prompt lengths include each boundary the issue names (no engine needed)."""
    gemma = CASES["gemma3"].boundaries
    lengths = set(boundary_lengths(gemma))
    assert {1, 2, 126, 127, 128, 129, 130, 191, 319} <= lengths
    qwen = set(boundary_lengths(CASES["qwen3_next_tails"].boundaries))
    assert {383, 384, 385, 767, 768, 769, 512, 513, 896} <= qwen
    chunk2 = set(boundary_lengths(CASES["llama_verify_first"].boundaries))
    assert {254, 255, 256, 257, 258, 510, 514} <= chunk2
    # Where a windowed prompt-tail hit would have attended a null block (N - W + 1 on a block).
    assert all((n - 64 + 1) % 128 == 0 for n in (191, 319))


# ------------------------------------------------------------------------------------------
# Each model's story on its own prompts: reloaded after ``reset_prefix_cache()`` (host tier),
# after a restart (disk tier), with a corrupted record, and on a store another model wrote.
# (In this module with the comparisons: the scenarios are run once per session, and
# pytest-xdist keeps a module on one worker, scripts/test.sh.)
# ------------------------------------------------------------------------------------------


@pytest.fixture(params=sorted(CASES))
def scenario(request: pytest.FixtureRequest, scenarios: Callable[[str], Scenario]) -> Scenario:
    return scenarios(request.param)


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
