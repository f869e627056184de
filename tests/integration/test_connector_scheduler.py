"""kvstrata's connector under vLLM 0.32.0's real Scheduler (docs/SEMANTICS.md §5), on CPU.

Every scenario stores through a real request, finishes it, drops vLLM's GPU prefix cache, and checks
the next request is served the number of tokens the rules give (worked out in each test) — with the
loaded pages checked byte-for-byte by the harness. R<n> are the rules of docs/SEMANTICS.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_event_payloads import described_blocks
from strata_harness import G, Runner, write_model_dir

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


# Every scenario under vLLM's plain Scheduler and under its AsyncScheduler (the default on GPUs:
# each step is planned before the previous step's output is seen).
# "accel": the async scheduler with the workers on the accelerator double (StreamStager: stores
# deferred to the next step, loads completed by event).
@pytest.fixture(params=["sched", "async-sched", "accel"])
def runners(model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator:
    made: list[Runner] = []

    def make(groups: list[G], store: Path | None = None, **kw) -> Runner:
        kw.setdefault("async_scheduling", request.param != "sched")
        kw.setdefault("accel", make.accel)
        r = Runner(groups, model_dir, store or tmp_path / "store", **kw)
        made.append(r)
        return r

    make.accel = request.param == "accel"  # type: ignore[attr-defined]
    yield make
    for r in made:
        r.close()


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 10 for i in range(n)]


def _store_then_serve(r: Runner, prompt: list[int], max_tokens: int = 1, again: list[int] | None = None) -> int:
    assert r.serve(prompt, max_tokens) == 0  # nothing stored yet
    r.drop_gpu_prefix_cache()
    served = r.serve(again or prompt, 1)
    assert r.load_errors == [], r.load_errors
    return served


# (groups, spec_decode, prompt length, expected served tokens). Block sizes 16, one block per chunk.
#  - FA only, 100 tokens: 6 complete chunks and the prompt's tail (4 tokens) -> 100 (FA-only hits
#    may reach the whole prompt; vLLM recomputes its last token).
#  - FA + SW(32): 6 complete chunks (the SW window, 2 chunks, ends at 96) and the prompt's tail
#    in both groups, one token short as every windowed hit (R21) -> 99 (vLLM alone rounds the
#    99-token cap down to its last complete chunk: 96).
#  - FA + Mamba align: cap 99, rounded down to the Mamba chunk (16) -> 96; state@96 handed off.
#  - annotated eagle FA group: widening cannot pass the 6th key -> 6 hits, pop one -> 80.
#  - spec decode on, no group annotated: behaves as without speculation (52735 defect 1) — except
#    that under EAGLE block dropping vLLM's scheduler hands off the Mamba state one block earlier
#    (state@80, not @96), so a Mamba hybrid serves 80.
SCENARIOS = [
    ("fa", [G("full", 16)], False, 100, 100),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], False, 100, 99),
    ("fa-mamba", [G("full", 16), G("mamba", 16)], False, 100, 96),
    ("fa+eagle", [G("full", 16), G("full", 16, eagle=True)], True, 100, 80),
    ("fa-sw+eagle-sw", [G("full", 16), G("sw", 16, window=32, eagle=True)], True, 100, 80),
    ("fa-mamba+eagle", [G("full", 16, eagle=True), G("mamba", 16)], True, 100, 80),
    ("fa-spec-unannotated", [G("full", 16)], True, 100, 100),
    ("fa-sw-spec-unannotated", [G("full", 16), G("sw", 16, window=32)], True, 100, 99),
    ("fa-mamba-spec-unannotated", [G("full", 16), G("mamba", 16)], True, 100, 80),
]


@pytest.mark.parametrize(("name", "groups", "spec", "n", "expected"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_store_finish_drop_serve(runners, name, groups, spec, n, expected) -> None:
    r = runners(groups, spec_decode=spec)
    assert _store_then_serve(r, _prompt(n)) == expected


def test_prefix_of_a_longer_prompt_is_served(runners) -> None:
    """8 complete chunks and the 2-token tail the shorter prompt stored (R21a)."""
    r = runners([G("full", 16)])
    base = _prompt(200)
    assert _store_then_serve(r, base[:130], again=base) == 130


def test_served_chunks_come_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16), G("sw", 16, window=32)], store=store)
    first.serve(_prompt(100), 1)
    first.close()  # clean shutdown drains write-behind
    second = runners([G("full", 16), G("sw", 16, window=32)], store=store)
    assert second.serve(_prompt(100), 1) == 99  # the prompt tail too, in both groups (R21 cap)
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] > 0


def test_a_finished_request_says_what_kvstrata_served_it_and_from_which_tier(runners, tmp_path: Path) -> None:
    """Per request, the tokens kvstrata served and their tier (``kv_transfer_params``), apart
    from vLLM's own prefix-cache hits: what the end-to-end tests count as "served"."""
    store = tmp_path / "persist"
    prompt = _prompt(100)
    first = runners([G("full", 16)], store=store)
    cold = first.add(prompt, 1)
    first.run_until_idle()
    # vLLM's own prefix cache serves its 6 whole blocks (96 tokens), kvstrata only the tail.
    again = first.add(prompt, 1)
    first.run_until_idle()
    first.drop_gpu_prefix_cache()
    host = first.add(prompt, 1)
    first.run_until_idle()
    assert first.served[cold.request_id] == {} and first.served[again.request_id] == {"host": 4}
    assert first.served[host.request_id] == {"host": 100}
    first.close()
    second = runners([G("full", 16)], store=store)
    disk = second.add(prompt, 1)
    second.run_until_idle()
    assert second.served[disk.request_id] == {"disk": 100}


def test_waiting_on_promotions_neither_spins_nor_rescans(runners, tmp_path: Path, monkeypatch) -> None:
    """A restarted engine whose first request waits on disk -> host promotions: its empty steps
    wait for them (bounded by IDLE_WAIT_S) instead of spinning, and its lookup is not re-run
    while every chunk it waits on is still in flight."""
    import time

    from kvstrata.connector import scheduler as sched_mod
    from kvstrata.tiers.disk import DiskStore

    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(_prompt(96), 1)  # chunk-aligned: no prompt tail
    first.close()
    second = runners([G("full", 16)], store=store)
    slow_read = 0.05  # each record takes 50 ms to read: the promotions span ~2 reads per thread
    real_get_into = DiskStore.get_into

    def slow_get_into(self, key, out):
        time.sleep(slow_read)
        return real_get_into(self, key, out)

    monkeypatch.setattr(DiskStore, "get_into", slow_get_into)
    hierarchy = second.connector.scheduler.hierarchy
    lookups = []
    real_lookup = hierarchy.lookup_many
    monkeypatch.setattr(hierarchy, "lookup_many",
                        lambda keys, promoting=None, **kw: lookups.append(len(keys))
                        or real_lookup(keys, promoting, **kw))
    idle_waits = []  # (the bound each empty step waited with, whether its promotions landed)
    real_wait = hierarchy.wait_promotions

    def recorded_wait(keys, timeout):
        done = real_wait(keys, timeout)
        idle_waits.append((timeout, done))
        return done

    monkeypatch.setattr(hierarchy, "wait_promotions", recorded_wait)
    req = second.add(_prompt(96), 1)
    steps = 0
    while req.request_id not in second.loaded_tokens:
        second.step()
        steps += 1
        assert steps < 100_000, "the request was never served"  # a hang guard
    assert second.loaded_tokens[req.request_id] == 96
    second.run_until_idle()
    assert second.stats.data["hit_tokens_disk"] == 96 and second.stats.data["hit_tokens_host"] == 0
    assert second.load_errors == []
    # Every step before the load (but the few around the lookup and the load) waited for the
    # promotions, bounded by IDLE_WAIT_S, instead of returning at once: no spinning.
    assert steps <= len(idle_waits) + 6, (steps, len(idle_waits))
    assert idle_waits and all(bound <= sched_mod.IDLE_WAIT_S for bound, _ in idle_waits)
    assert any(done for _, done in idle_waits)  # the wait ended when the promotions landed
    # The lookup ran when the request arrived and once more after its chunks landed, not per step.
    assert len(lookups) <= 3, lookups


def _slow_disk_reads(monkeypatch, seconds: float) -> None:
    import time

    from kvstrata.tiers.disk import DiskStore

    real_get_into = DiskStore.get_into

    def slow_get_into(self, key, out):
        time.sleep(seconds)
        return real_get_into(self, key, out)

    monkeypatch.setattr(DiskStore, "get_into", slow_get_into)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "verified-first"])
def test_disk_hit_is_loaded_while_its_chunks_land(runners, tmp_path: Path, monkeypatch, stream) -> None:
    """Under kv_load_failure_policy="recompute" (this harness) loads stream: the restarted
    engine's first request gets its load job in its first step, while the promotions still run,
    and the worker copies each chunk as it lands. With ``stream_loads`` off the hit is answered
    only once every chunk landed. Either way every loaded page is byte-checked."""
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(_prompt(96), 1)
    first.close()
    second = runners([G("full", 16)], store=store, extra={"stream_loads": stream})
    _slow_disk_reads(monkeypatch, 0.03)
    hierarchy = second.connector.scheduler.hierarchy
    req = second.add(_prompt(96), 1)
    second.step()
    in_flight = hierarchy.stats()["promotions_inflight"]
    assert in_flight > 0
    assert (req.request_id in second.loaded_tokens) is stream
    second.run_until_idle()
    assert second.loaded_tokens[req.request_id] == 96
    assert second.load_errors == []
    st = hierarchy.stats()
    assert st["loads_streamed"] == (6 if stream else 0)
    assert st["host"]["referenced"] == 0 and st["host"]["not_ready"] == 0
    assert second.stats.data["hit_tokens_disk"] == 96 and second.stats.data["load_failures"] == 0


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2-rank1-corrupt"])
def test_streamed_load_of_a_corrupt_record_is_recomputed_from_a_shorter_hit(
        runners, tmp_path: Path, monkeypatch, tp: int) -> None:
    """A record found corrupt after its streamed load began: the load fails, vLLM (policy
    "recompute") resets the request, and its next lookup serves only the chunks before the bad
    one — byte-checked — and never the bad chunk. With two ranks only rank 1's record of the
    chunk is bad: the whole load fails all the same, on both ranks."""
    import lmdb
    from strata_harness import EOS
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvstrata import semantics

    store = tmp_path / "persist"
    prompt = _prompt(96)
    first = runners([G("full", 16)], store=store, tp=tp)
    first.serve(prompt, 1)
    sched = first.connector.scheduler
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    probe = Request(request_id="probe", prompt_token_ids=prompt, sampling_params=params,
                    pooling_params=None, block_hasher=first._hasher)
    keys = list(semantics.chunk_keys(probe.block_hashes, sched.layout.groups[0]))
    bad = sched.hierarchy.namespaces[tp - 1] + keys[3]
    first.close()
    with lmdb.open(str(store), max_dbs=4) as raw, raw.begin(write=True) as txn:
        payload = raw.open_db(b"payload", txn=txn)
        frame = bytearray(txn.get(bad, db=payload))
        frame[len(frame) // 2] ^= 0xFF
        txn.put(bad, bytes(frame), db=payload)

    second = runners([G("full", 16)], store=store, tp=tp)
    _slow_disk_reads(monkeypatch, 0.02)
    req = second.add(prompt, 1)
    second.step()
    assert req.request_id in second.loaded_tokens  # streamed: answered before the reads ended
    second.run_until_idle()
    assert second.load_errors == []
    assert second.stats.data["load_failures"] == 1
    assert second.loaded_tokens[req.request_id] == 48  # the retry: chunks 0-2, never chunk 3
    # Only what was served counts: the retry's 48 tokens, not the failed load's 96.
    assert second.stats.data["hit_tokens"] == 48 == second.stats.data["hit_tokens_disk"]
    assert second.connector.scheduler.hierarchy.stats()["promotions_failed"] == 1
    assert req.is_finished()


def test_stream_loads_true_under_the_fail_policy_is_refused_before_the_store_opens(
        model_dir: Path, tmp_path: Path) -> None:
    from strata_harness import kv_cache_config, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstrata.config import ConfigError
    from kvstrata.connector.connector import StrataConnector

    store = tmp_path / "never-opened"
    cfg = vllm_config(model_dir, store, block_size=16, extra={"stream_loads": True})
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    with set_current_vllm_config(cfg), pytest.raises(ConfigError, match="stream_loads"):
        StrataConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config([G("full", 16)], 64))
    assert not store.exists()


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "prefill_context_parallel_size",
                                  "decode_context_parallel_size"])
def test_unsupported_parallelism_is_refused_naming_it(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Pipeline stages and context-parallel ranks hold other layers or tokens than a TP shard:
    refused at start-up, in both roles, before the store is opened."""
    from strata_harness import kv_cache_config, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstrata.connector.connector import StrataConnector

    store = tmp_path / "never-opened"
    cfg = vllm_config(model_dir, store, block_size=16)
    setattr(cfg.parallel_config, name, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with set_current_vllm_config(cfg), pytest.raises(ValueError, match=f"{name}=2"):
            StrataConnector(cfg, role, kv_cache_config([G("full", 16)], 64))
    assert not store.exists()


def test_reset_with_transfers_in_flight_releases_their_slots(runners) -> None:
    """reset_prefix_cache() while stores are in flight: when they finish their slots are given
    back (not left pinned and "being stored" forever) and their KV is not served."""
    r = runners([G("full", 16)], extra={"disk": False})
    hierarchy = r.connector.scheduler.hierarchy
    r.add(_prompt(100), 4)
    seen = {}

    def reset_mid_step() -> None:
        seen.update(hierarchy.stats())
        r.connector.reset_cache()

    r.step(before_output=reset_mid_step)  # the prefill's stores are in flight at the reset
    assert seen["stores_inflight"] > 0
    r.run_until_idle()
    st = hierarchy.stats()
    assert st["stores_inflight"] == 0 and st["host"]["not_ready"] == 0 and st["host"]["referenced"] == 0
    assert st["stores_failed"] >= seen["stores_inflight"]  # dropped, as the reset asked
    assert r.load_errors == []


def test_other_model_layout_gets_zero_hits(runners, tmp_path: Path) -> None:
    store = tmp_path / "shared"
    a = runners([G("full", 16)], store=store)
    a.serve(_prompt(100), 1)
    a.close()
    # Same tokens, same block hashes, but the KV has another layout (more layers): never served.
    b = runners([G("full", 16, layers=3)], store=store)
    assert b.serve(_prompt(100), 1) == 0


# ---------------------------------------------------------------- vLLM issue 52735 regressions
def _decode_then_extend(r: Runner, prompt_len: int, decode: int, lookup_len: int) -> int:
    """Run a request that decodes (so the scheduler hands off Mamba states past the prompt), drop
    the GPU cache, then serve a request whose prompt is the first ``lookup_len`` tokens of it."""
    prompt = _prompt(prompt_len)
    req = r.add(prompt, max_tokens=decode)
    r.run_until_idle()
    seq = prompt + list(req.output_token_ids)
    r.drop_gpu_prefix_cache()
    served = r.serve(seq[:lookup_len], 1)
    assert r.load_errors == []
    return served


def test_52735_no_all_groups_fallback(runners) -> None:
    """Spec decode on, nothing annotated. Lookup prompt 160 tokens: cap 159 -> 128 (Mamba chunk 64).
    FA hits 8 chunks, the Mamba state @128 serves: 128. Treating every group as a drafter (vLLM's
    former fallback) pops the FA chunk and makes the Mamba group need two consecutive states and pop
    one: 64."""
    r = runners([G("full", 16), G("mamba", 64)], spec_decode=True, extra={"offload_prompt_only": False})
    assert _decode_then_extend(r, 150, 20, 160) == 128


def test_52735_full_attention_drafter_is_widened(runners) -> None:
    """FA16 drafter + Mamba64, lookup prompt 160: cap 128. Widened, the drafter queries 144 tokens
    (9 chunks), pops to 128 and the Mamba state @128 serves: 128. Without widening for
    full-attention drafters it pops to 112, below the Mamba boundary, and only the state @64 can
    serve: 64 (0 in vLLM issue 52735's configuration, where no earlier state existed)."""
    r = runners([G("full", 16, eagle=True), G("mamba", 64)], spec_decode=True, extra={"offload_prompt_only": False})
    assert _decode_then_extend(r, 150, 20, 160) == 128


def test_52735_drafter_tail_is_stored_at_finish(runners) -> None:
    """A decoding drafter group holds back its last chunk; at finish it must be stored.

    Prompt 40 + 30 decoded tokens: the sequence has 70 tokens, the KV of 69 exists at finish ->
    4 complete chunks in both groups, the drafter's 4th only thanks to finish-time promotion.
    The next request extends those 70 tokens to 90 (5 keys): FA hits 4 chunks; the drafter group,
    widened to 5, hits 4 and pops one -> 3 chunks = 48 tokens. Without the promotion the drafter
    holds 3 chunks, pops to 2 -> 32.
    """
    r = runners([G("full", 16), G("full", 16, eagle=True)], spec_decode=True, extra={"offload_prompt_only": False})
    prompt = _prompt(40)
    req = r.add(prompt, max_tokens=30)
    r.run_until_idle()
    seq = prompt + list(req.output_token_ids)
    assert len(seq) == 70
    r.drop_gpu_prefix_cache()
    assert r.serve(seq + _prompt(20, seed=9), 1) == 48
    assert r.load_errors == []


def test_unknown_option_is_an_error_naming_it(model_dir: Path, tmp_path: Path) -> None:
    from kvstrata.config import ConfigError

    with pytest.raises(ConfigError, match="hots_bytes"):
        Runner([G("full", 16)], model_dir, tmp_path / "s", extra={"hots_bytes": 1})


def test_random_hash_seed_keeps_a_session_only_store(model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import strata_harness

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    real = strata_harness.vllm_config
    monkeypatch.setattr(strata_harness, "vllm_config", lambda *a, **k: real(*a, **{**k, "hash_algo": "xxhash"}))
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        r = Runner([G("full", 16)], model_dir, tmp_path / "s")
    try:
        assert "session-only" in caplog.text
        assert not (tmp_path / "s").exists()  # the configured persistent store is left alone
        assert r.connector.plan.persistent is False
    finally:
        r.close()


def test_a_tier_snapshot_alone_is_reported() -> None:
    # A refresh landing on a step where no counter moved must still reach /metrics.
    from kvstrata.connector.stats import StrataStats

    stats = StrataStats()
    assert stats.is_empty()
    stats.tiers = {"remote_available": 0, "host_chunks": 0}
    assert not stats.is_empty() and stats.data["remote_available"] == 0


def test_connector_stats_report_tiers_and_hits(runners) -> None:
    from kvstrata.connector.connector import StrataConnector

    r = runners([G("full", 16)])
    assert _store_then_serve(r, _prompt(100)) == 100  # 6 chunks + the 4-token prompt tail
    assert r.stats is not None and not r.stats.is_empty()
    data = r.stats.data
    assert data["hit_tokens"] == 100 and data["hit_tokens_host"] == 100 and data["hit_tokens_disk"] == 0
    assert data["store_jobs"] >= 1 and data["load_jobs"] == 1
    assert data["bytes_loaded"] > 0 and data["bytes_stored"] >= data["bytes_loaded"]
    assert data["host_chunks"] == 7
    # vLLM rebuilds the stats object from the dict in its logger process.
    rebuilt = StrataConnector.build_kv_connector_stats(data)
    assert rebuilt.reduce()["hit_tokens"] == 100


# Partial tails (R7, R30, §3.8 C): FA16 + Mamba-align 16 hashed every 4 tokens. A 30-token prompt
# has one complete chunk (16); its replay boundary is 29 rounded down to a hash: 28. The scheduler
# splits the prefill there and hands off the Mamba state @28 when the next chunk copies it
# (copy-on-write); kvstrata then stores both groups at 28 under boundary keys.
PARTIAL_TAIL = [G("full", 16), G("mamba", 16)]


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_partial_tail_is_stored_and_served(runners, max_tokens: int) -> None:
    r = runners(PARTIAL_TAIL, prefix_match_unit=4)
    assert r.connector.scheduler.layout.supports_partial_tail
    assert _store_then_serve(r, _prompt(30), max_tokens=max_tokens) == 28


def test_partial_tail_served_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners(PARTIAL_TAIL, store=store, prefix_match_unit=4)
    first.serve(_prompt(30), 1)
    first.close()
    second = runners(PARTIAL_TAIL, store=store, prefix_match_unit=4)
    assert second.serve(_prompt(30), 1) == 28
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] > 0



def test_partial_tail_of_a_request_that_finishes_at_its_boundary(runners) -> None:
    """A request that ends right after the prefill chunk that stops at its replay boundary (28),
    before the next chunk's copy-on-write hands the Mamba state off, offers that state through
    ``register_finished_partial_tail``: kvstrata stores it, and the same prompt is served up to
    28 tokens. vLLM frees the request's blocks at once; with 8 blocks the next step hands them to
    new requests, and the fenced store is copied before that step's forward (a flush)."""
    from vllm.v1.request import RequestStatus

    r = runners(PARTIAL_TAIL, prefix_match_unit=4, num_blocks=8)
    offered: list[Any] = []
    hook = r.connector.register_finished_partial_tail
    r.connector.register_finished_partial_tail = lambda *a: offered.append(a[2]) or hook(*a)
    flushed: list[set[int]] = []
    worker = r.workers[0]
    handle = worker.handle_preemptions
    worker.handle_preemptions = lambda meta: flushed.append(set(meta.flush)) or handle(meta)
    req = r.add(_prompt(30), max_tokens=3)
    steps = 0
    while req.num_computed_tokens < 28 and steps < 4:  # align mode: prefill chunks end at 16, 28
        r.step()
        steps += 1
    assert req.num_computed_tokens == 28  # the prefill split at the replay boundary
    r.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    if r.async_scheduling:
        # The next chunk is already scheduled (tokens in flight): vLLM offers no tail then, and
        # only the complete chunk is served.
        assert offered == []
        expected = 16
    else:
        assert offered and offered[0][0][2] == 28  # (group, table block, boundary)
        expected = 28
    flushed.clear()
    for seed in (2, 3, 4, 5):  # more blocks than were never used: the freed ones go too
        r.add(_prompt(12, seed=seed), max_tokens=1)
    r.step()
    assert any(flushed) == (not r.async_scheduling)
    r.run_until_idle()
    r.drop_gpu_prefix_cache()
    assert r.serve(_prompt(30), 1) == expected
    assert r.load_errors == []


def test_partial_tail_from_a_kernel_checkpoint(runners, tmp_path: Path) -> None:
    """A kernel that saves the checkpoint inside the forward (vLLM's Mamba2 layers) does not
    split a one-chunk prefill: the only Mamba state handed off is the one at the tail (28), none
    at the block boundary (16). vLLM's lookup, which looks for tails only above a complete hit of
    every group, serves nothing; kvstrata serves the attention prefix and the tail, also from
    disk after a restart."""
    store = tmp_path / "persist"
    groups = [G("full", 16), G("mamba", 16, checkpoint_alignment=4)]
    r = runners(groups, store=store, prefix_match_unit=4)
    assert r.scheduler.mamba_has_prefill_checkpoint_blocks
    assert _store_then_serve(r, _prompt(30), max_tokens=1) == 28
    r.close()
    again = runners(groups, store=store, prefix_match_unit=4)
    assert again.serve(_prompt(30), 1) == 28
    assert again.load_errors == []


# ---- the prompt's partial last chunk (semantics.prompt_tail) -------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_prompt_tail_is_stored_and_served(runners, max_tokens: int) -> None:
    """100 tokens on 16-token blocks: 6 chunks and a 4-token tail; the tail's positions are
    checked one by one (decode steps after the prompt must not leak into the stored tail)."""
    r = runners([G("full", 16), G("full", 16)])
    assert _store_then_serve(r, _prompt(100), max_tokens=max_tokens) == 100


def test_prompt_tail_names_its_exact_tokens(runners) -> None:
    """Same chunks, another last token: the tail is not served (to that prompt, nor to one that
    extends it); a prompt that starts with the stored tokens is (R21a)."""
    r = runners([G("full", 16)])
    base = _prompt(100)
    other = [*base[:99], base[99] + 1]
    assert _store_then_serve(r, base, again=other) == 96
    r.drop_gpu_prefix_cache()
    assert r.serve([*other, *_prompt(20, seed=2)], 1) == 100  # other's own tail, stored just now
    r.drop_gpu_prefix_cache()
    assert r.serve([*base[:98], base[98] + 1, *_prompt(20, seed=3)], 1) == 96  # no stored tail fits
    r.drop_gpu_prefix_cache()
    assert r.serve(_prompt(120), 1) == 100
    assert r.load_errors == []


def test_prompt_tail_on_top_of_a_gpu_prefix_hit(runners) -> None:
    """vLLM's own prefix cache holds the 6 complete blocks: kvstrata loads just the tail."""
    r = runners([G("full", 16)])
    prompt = _prompt(100)
    assert r.serve(prompt, 1) == 0
    assert r.serve(prompt, 1) == 4
    assert r.load_errors == []


def test_prompt_tail_in_a_chunk_of_several_blocks(runners) -> None:
    """Chunks of 2 blocks: a 120-token prompt has 3 complete chunks and a tail chunk of a full
    block and a partial one."""
    r = runners([G("full", 16)], extra={"blocks_per_chunk": 2})
    assert _store_then_serve(r, _prompt(120)) == 120


def test_prompt_tail_served_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(_prompt(100), 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    assert second.serve(_prompt(100), 1) == 100
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] == 7  # 6 chunks + the tail


# ---- a stored tail serves a longer prompt that starts with it (semantics.tail_extension) ----------
# A multi-turn follow-up is its previous prompt, the answer and a new turn: the previous prompt's
# tail (stored with it) serves the block it ended in. The hit ends short of the request's last
# token, so no rewind follows, with or without a sliding window (R21a).
EXTENSION_SCENARIOS = [
    ("fa", [G("full", 16)], {}),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], {}),
    ("fa-tp2", [G("full", 16)], {"tp": 2}),
]


@pytest.mark.parametrize(("name", "groups", "kw"), EXTENSION_SCENARIOS, ids=[s[0] for s in EXTENSION_SCENARIOS])
def test_a_longer_prompt_is_served_the_tail_it_starts_with(runners, name, groups, kw) -> None:
    r = runners(groups, **kw)
    assert _store_then_serve(r, _prompt(100), max_tokens=3, again=_prompt(120)) == 100
    assert r.stats.data["tail_extensions"] == 1
    # Its own chunk at 96 (a full one now) and its tail are stored: served whole next time.
    r.drop_gpu_prefix_cache()
    assert r.serve(_prompt(120), 1) == (120 if name != "fa-sw" else 119)
    assert r.load_errors == []


def test_the_longest_stored_tail_that_fits_is_served(runners) -> None:
    r = runners([G("full", 16)])
    # Tails of 4 and 10 tokens after the same 6 chunks; the second prompt is served the first's
    # tail already, past vLLM's own 6 blocks.
    assert [r.serve(_prompt(n), 1) for n in (100, 106)] == [0, 4]
    r.drop_gpu_prefix_cache()
    assert r.serve([*_prompt(104), *_prompt(20, seed=2)], 1) == 100  # diverges inside the 10-token tail
    r.drop_gpu_prefix_cache()
    assert r.serve(_prompt(140), 1) == 106
    r.drop_gpu_prefix_cache()
    assert r.serve(_prompt(101), 1) == 100  # the 4-token tail; the 10-token one is past its last token
    assert r.load_errors == []


def test_a_stored_tail_serves_a_longer_prompt_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(_prompt(100), 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    req = second.add(_prompt(120), 1)
    second.run_until_idle()
    assert second.served[req.request_id] == {"disk": 100}
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] == 7  # 6 chunks + the tail


def test_a_stored_tail_past_a_gpu_prefix_hit_inside_its_chunk(runners) -> None:
    """Chunks of 2 blocks: the 120-token prompt stores 3 chunks and a 24-token tail. vLLM's own
    prefix cache keeps 7 blocks (112 tokens) of it, mid-chunk: kvstrata loads the tail's block
    past them."""
    r = runners([G("full", 16)], extra={"blocks_per_chunk": 2})
    assert r.serve(_prompt(120), 1) == 0
    assert r.serve(_prompt(150), 1) == 8
    assert r.load_errors == []


def test_tiers_that_held_no_candidate_tail_are_asked_again_only_after_a_while(runners, monkeypatch) -> None:
    """A waiting request is looked up every step: its candidate tails are hashed once, and tiers
    that held none of them (a round trip each with a shared tier) are asked at most every
    EXTENSION_RECHECK_S."""
    from kvstrata.connector import scheduler as sched_mod

    r = runners([G("full", 16)])
    sched = r.connector.scheduler
    asked: list[int] = []
    holds = sched.hierarchy.holds_many
    monkeypatch.setattr(sched.hierarchy, "holds_many", lambda keys: asked.append(len(keys)) or holds(keys))
    st = sched._reqs[r.add(_prompt(120), 1).request_id]
    lengths = range(15, 1, -1)
    monkeypatch.setattr(sched_mod, "EXTENSION_RECHECK_S", 3600.0)  # no wall-clock in the test
    assert sched._tail_extension_candidates(st, 96, lengths) == [] and asked == [14]
    assert sched._tail_extension_candidates(st, 96, lengths) == [] and asked == [14]
    monkeypatch.setattr(sched_mod, "EXTENSION_RECHECK_S", 0.0)
    assert sched._tail_extension_candidates(st, 96, lengths) == [] and asked == [14, 14]
    r.run_until_idle()  # _prompt(120) is stored, its tail at 112 included
    assert len(st.extension_tails) == 14  # hashed once


# With ``offload_prompt_only`` false the answer's KV is stored too: its complete chunks as they
# fill, and at finish the chunk holding the end of the KV it wrote (the final sampled token's slot
# is never written) as a tail. The next turn (prompt, answer, a new turn) is served to there.
ANSWER_SCENARIOS = [
    ("fa-in-the-prompt-chunk", [G("full", 16)], 8, {}),  # 100 + 7 written: a tail of 11 at 96
    ("fa-past-a-chunk", [G("full", 16)], 20, {}),  # 119 written: chunk 96..112 and a tail of 7
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], 20, {}),
    ("fa-2-block-chunks", [G("full", 16)], 20, {"blocks_per_chunk": 2}),
]


@pytest.mark.parametrize(("name", "groups", "answer", "extra"), ANSWER_SCENARIOS,
                         ids=[s[0] for s in ANSWER_SCENARIOS])
def test_the_next_turn_is_served_the_answer(runners, name, groups, answer, extra) -> None:
    r = runners(groups, extra={"offload_prompt_only": False, **extra})
    first = r.add(_prompt(100), answer)
    r.run_until_idle()
    written = len(first.all_token_ids) - 1
    assert written == 100 + answer - 1
    r.drop_gpu_prefix_cache()
    assert r.serve([*first.all_token_ids, *_prompt(10, seed=5)], 1) == written
    assert r.load_errors == []


def test_the_answer_tail_is_stored_only_with_the_answer(runners) -> None:
    """``offload_prompt_only`` (vLLM's default): the next turn gets the prompt, its tail included."""
    r = runners([G("full", 16)])
    first = r.add(_prompt(100), 8)
    r.run_until_idle()
    r.drop_gpu_prefix_cache()
    assert r.serve([*first.all_token_ids, *_prompt(10, seed=5)], 1) == 100
    assert r.load_errors == []


def test_the_answer_tail_comes_back_from_disk_after_restart(runners, tmp_path: Path) -> None:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store, extra={"offload_prompt_only": False})
    req = first.add(_prompt(100), 8)
    first.run_until_idle()
    turn = [*req.all_token_ids, *_prompt(10, seed=5)]
    first.close()
    second = runners([G("full", 16)], store=store, extra={"offload_prompt_only": False})
    follow_up = second.add(turn, 1)
    second.run_until_idle()
    assert second.served[follow_up.request_id] == {"disk": 107}
    assert second.load_errors == []


# ---- tensor parallelism: every slot and every stored chunk holds one shard per rank ---------------
TP_SCENARIOS = [
    ("fa", [G("full", 16)], 100),
    ("fa-sw", [G("full", 16), G("sw", 16, window=32)], 99),
    ("fa-mamba", [G("full", 16), G("mamba", 16)], 96),
]


@pytest.mark.parametrize(("name", "groups", "expected"), TP_SCENARIOS, ids=[s[0] for s in TP_SCENARIOS])
def test_tensor_parallel_ranks_load_their_own_shards(runners, name, groups, expected) -> None:
    """Two ranks, their KV different: each rank gets back its own pages (byte-checked per rank),
    and the load counts as finished only once both finished (vLLM's KVOutputAggregator)."""
    r = runners(groups, tp=2)
    assert _store_then_serve(r, _prompt(100)) == expected


def test_tensor_parallel_shards_come_back_from_disk_and_need_every_rank(runners, tmp_path: Path) -> None:
    """After a restart both ranks' shards come from disk. A chunk whose rank-1 record is gone is
    not served (the hit stops before it), and a TP=1 engine on the same store finds nothing."""
    import lmdb
    from strata_harness import EOS
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvstrata import semantics

    store = tmp_path / "persist"
    prompt = _prompt(100)
    first = runners([G("full", 16)], store=store, tp=2)
    first.serve(prompt, 1)
    sched = first.connector.scheduler
    namespaces = sched.hierarchy.namespaces
    assert len(namespaces) == 2 and namespaces[0] != namespaces[1]
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    probe = Request(request_id="probe", prompt_token_ids=prompt, sampling_params=params,
                    pooling_params=None, block_hasher=first._hasher)
    keys = list(semantics.chunk_keys(probe.block_hashes, sched.layout.groups[0]))
    first.close()

    second = runners([G("full", 16)], store=store, tp=2)
    assert second.serve(prompt, 1) == 100
    assert second.load_errors == []
    assert second.connector.scheduler.hierarchy.stats()["promotions_completed"] == 7  # 6 chunks + the tail
    second.close()

    with lmdb.open(str(store), max_dbs=4) as raw, raw.begin(write=True) as txn:
        for ns in namespaces:
            assert txn.get(ns + keys[3], db=raw.open_db(b"payload", txn=txn)) is not None
        assert txn.delete(namespaces[1] + keys[3], db=raw.open_db(b"payload", txn=txn))
    third = runners([G("full", 16)], store=store, tp=2)
    assert third.serve(prompt, 1) == 48  # chunks 0-2: chunk 3 lacks rank 1's shard
    assert third.load_errors == []
    third.close()

    assert runners([G("full", 16)], store=store, tp=1).serve(prompt, 1) == 0


# ---- aborts and preemption: nothing stays pinned, nothing is served wrong afterwards -------------
def _host_tier_is_released(r: Runner) -> None:
    import time

    hierarchy = r.connector.scheduler.hierarchy
    deadline = time.monotonic() + 30  # write-behind to disk pins its slots until written
    while hierarchy.stats()["write_inflight_bytes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    st = hierarchy.stats()
    assert st["host"]["referenced"] == 0 and st["host"]["not_ready"] == 0, st["host"]
    assert st["promotions_inflight"] == 0 and st["stores_inflight"] == 0
    assert r.connector.scheduler._reqs == {}


def test_abort_while_a_disk_load_streams(runners, tmp_path: Path, monkeypatch) -> None:
    """A client disconnects while its prefix still streams in from disk: vLLM keeps the blocks
    until the load reports finished (R39); kvstrata finishes the load, releases every slot, and
    the next request with that prefix is served whole."""
    from vllm.v1.request import RequestStatus

    store = tmp_path / "persist"
    prompt = _prompt(100)
    first = runners([G("full", 16)], store=store)
    first.serve(prompt, 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    _slow_disk_reads(monkeypatch, 0.03)
    req = second.add(prompt, 4)
    second.step()
    assert req.request_id in second.loaded_tokens  # the streamed load is under way
    assert second.connector.scheduler.hierarchy.stats()["promotions_inflight"] > 0
    second.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    second.run_until_idle()
    assert req.status == RequestStatus.FINISHED_ABORTED and req.num_output_tokens == 0
    _host_tier_is_released(second)
    assert second.serve(prompt, 1) == 100
    assert second.load_errors == []


def test_abort_mid_prefill_keeps_the_chunks_it_computed(runners) -> None:
    """Aborted after its first prefill chunk (64 of 100 tokens): the 4 chunks computed are stored
    and served; nothing of the rest is, and nothing stays pinned."""
    from vllm.v1.request import RequestStatus

    r = runners([G("full", 16)], max_num_batched_tokens=64)
    prompt = _prompt(100)
    req = r.add(prompt, 4)
    r.step()
    assert req.num_computed_tokens == 64
    r.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    r.run_until_idle()
    _host_tier_is_released(r)
    r.drop_gpu_prefix_cache()
    assert r.serve(prompt, 1) == 64
    assert r.load_errors == []


def test_preempted_requests_store_and_serve_correctly(runners) -> None:
    """Two decoding requests that do not both fit in 17 blocks (7 each for the prompts, 10 each
    once decoded): vLLM preempts one (its blocks are freed and later recomputed or reloaded). Both finish; both prompts are then served whole
    from kvstrata, byte-checked, and no slot stays pinned."""
    r = runners([G("full", 16)], num_blocks=18)
    a, b = _prompt(100, seed=1), _prompt(100, seed=2)
    ra, rb = r.add(a, 60), r.add(b, 60)
    r.run_until_idle()
    assert ra.num_output_tokens == rb.num_output_tokens == 60
    assert ra.num_preemptions + rb.num_preemptions > 0
    _host_tier_is_released(r)
    r.drop_gpu_prefix_cache()
    assert r.serve(a, 1) == 100
    r.drop_gpu_prefix_cache()
    assert r.serve(b, 1) == 100
    assert r.load_errors == []


def test_a_load_ends_only_when_the_slowest_rank_copied_it(runners, tmp_path: Path, monkeypatch) -> None:
    """Rank 1 copies the landed chunks only once rank 0 has reported the streamed load finished,
    so the ranks report it in different steps. The scheduler must count both: the load job ends
    (its slots unpinned) no earlier than the step rank 1 reports it, and the request runs after."""
    import threading

    from kvstrata.connector.scheduler import StrataScheduler

    if runners.accel:
        pytest.skip("slows the CPU landing copies; accelerators get whole jobs back instead")
    store = tmp_path / "persist"
    prompt = _prompt(100)
    first = runners([G("full", 16)], store=store, tp=2)
    first.serve(prompt, 1)
    first.close()
    second = runners([G("full", 16)], store=store, tp=2)
    _slow_disk_reads(monkeypatch, 0.01)
    landing = second.workers[1].worker.landing
    real_copy = landing._copy
    rank0_reported = threading.Event()

    def copy_after_rank0(transfer):
        assert rank0_reported.wait(60), "rank 0 never reported its load"  # a hang guard
        real_copy(transfer)

    landing._copy = copy_after_rank0
    step = 0
    reported: dict[int, int] = {}  # rank -> step its worker reported the load finished
    for rank, w in enumerate(second.workers):
        real_get_finished = w.worker.get_finished

        def get_finished(rank=rank, real=real_get_finished):
            sending, recving, failed = real()
            if recving:
                reported.setdefault(rank, step)
                if rank == 0:
                    rank0_reported.set()
            return sending, recving, failed

        monkeypatch.setattr(w.worker, "get_finished", get_finished)
    load_ended: list[int] = []
    real_finish = StrataScheduler._finish_job

    def finish_job(self, job_id, job, ok):
        if not job.is_store:
            load_ended.append(step)
        return real_finish(self, job_id, job, ok)

    monkeypatch.setattr(StrataScheduler, "_finish_job", finish_job)
    req = second.add(prompt, 1)
    while not req.is_finished():
        step += 1
        second.step()
        assert step < 1_000_000, f"not finished after {step} steps"  # a hang guard
    second.run_until_idle()
    assert reported[1] > reported[0]  # the ranks did report in different steps
    assert load_ended and load_ended[0] >= reported[1]
    assert second.loaded_tokens[req.request_id] == 100
    assert second.load_errors == []
    _host_tier_is_released(second)


# ---- KV cache events (--kv-events-config) ----------------------------------------------------------
def _events(r: Runner, kind: str, medium: str) -> list[Any]:
    return [e for batch in r.published for e in batch.events
            if type(e).__name__ == kind and e.medium == medium]


def _one_more_step(r: Runner) -> None:
    """A step whose output the scheduler sees (under async scheduling, one more to drain)."""
    r.step()
    r.run_until_idle()


def _hashes(events: list[Any]) -> set[Any]:
    return {h for e in events for h in e.block_hashes}


def test_kv_cache_events_name_the_blocks_vllm_names(runners, tmp_path: Path) -> None:
    """With KV cache events on, what enters kvstrata's host tier (medium CPU) and its disk
    (STORAGE) is published with the block hashes vLLM's own GPU events carry for the same
    blocks, so a router can tell which engine holds a prefix in which tier; evictions from the
    host tier are published too. A restarted engine announces what it promotes from disk."""
    store = tmp_path / "persist"
    prompt = _prompt(96)  # six whole blocks
    r = runners([G("full", 16)], store=store, kv_events=True)
    r.serve(prompt, 1)
    _host_tier_is_released(r)  # write-behind done
    _one_more_step(r)  # an (empty) step publishes what the disk tier reported meanwhile
    gpu = _hashes(_events(r, "BlockStored", "GPU"))
    assert len(gpu) == 6
    assert _hashes(_events(r, "BlockStored", "CPU")) == gpu
    assert _hashes(_events(r, "BlockStored", "STORAGE")) == gpu
    assert all(e.group_idx == 0 for e in _events(r, "BlockStored", "CPU"))
    r.connector.reset_cache()  # the host tier empties: every chunk removed from CPU
    _one_more_step(r)
    assert _hashes(_events(r, "BlockRemoved", "CPU")) == gpu
    r.close()

    again = runners([G("full", 16)], store=store, kv_events=True)
    assert again.serve(prompt, 1) == 96
    assert _hashes(_events(again, "BlockStored", "CPU")) == gpu  # promoted from disk


def _gpu_blocks(r: Runner, group: int | None = None) -> dict[Any, Any]:
    """vLLM's own GPU ``BlockStored`` payloads, by block hash: (parent, token ids, block size)."""
    return described_blocks(_events(r, "BlockStored", "GPU"), group)


def test_self_describing_kv_events_carry_each_chunks_blocks_and_tokens(runners, tmp_path: Path) -> None:
    """``self_describing_kv_events``: every chunk (two blocks here) entering the host tier (CPU)
    or the disk (STORAGE) is published with the hashes, parents, token ids and block size vLLM's
    own GPU events give its blocks; removals name every block hash of the chunk; and a restarted
    engine describes what it promotes from disk, learnt from the lookup that asked for it."""
    store = tmp_path / "persist"
    prompt = _prompt(96)  # six blocks, three chunks
    extra = {"self_describing_kv_events": True, "blocks_per_chunk": 2}
    r = runners([G("full", 16)], store=store, kv_events=True, extra=extra)
    r.serve(prompt, 1)
    _host_tier_is_released(r)
    _one_more_step(r)
    gpu = _gpu_blocks(r)
    assert len(gpu) == 6
    cpu_events = _events(r, "BlockStored", "CPU")
    assert len(cpu_events) == 3 and all(len(e.block_hashes) == 2 for e in cpu_events)
    assert described_blocks(cpu_events) == gpu
    assert described_blocks(_events(r, "BlockStored", "STORAGE")) == gpu
    assert {e.kv_cache_spec_kind for e in cpu_events} == {"full_attention"}
    r.connector.reset_cache()  # the host tier empties
    _one_more_step(r)
    assert _hashes(_events(r, "BlockRemoved", "CPU")) == set(gpu)
    r.close()

    again = runners([G("full", 16)], store=store, kv_events=True, extra=extra)
    assert again.serve(prompt, 1) == 96
    assert described_blocks(_events(again, "BlockStored", "CPU")) == gpu  # promoted, described
    again.connector.reset_cache()
    _one_more_step(again)
    assert _hashes(_events(again, "BlockRemoved", "CPU")) == set(gpu)
    # Still on disk, so still described: the disk's own removals (as its eviction makes them)
    # name every block hash of each chunk.
    disk = next(t for t in again.connector.scheduler.hierarchy.tiers if t.tier_name == "disk")
    assert disk.delete_many([key for key, _ in disk.iter_index()]) == 3
    _one_more_step(again)
    assert _hashes(_events(again, "BlockRemoved", "STORAGE")) == set(gpu)


def test_self_describing_kv_events_keep_the_placeholder_for_windowed_groups(runners) -> None:
    """A sliding-window group's chunks keep vLLM's placeholder payload (no token ids) while the
    full-attention group's chunks of the same prompt are described."""
    extra = {"self_describing_kv_events": True}
    r = runners([G("full", 16), G("sw", 16, window=32)], kv_events=True, extra=extra)
    r.serve(_prompt(96), 1)
    _host_tier_is_released(r)
    _one_more_step(r)
    cpu = _events(r, "BlockStored", "CPU")
    full = [e for e in cpu if e.group_idx == 0]
    windowed = [e for e in cpu if e.group_idx == 1]
    assert full and windowed
    assert all(e.token_ids and e.block_size == 16 for e in full)
    assert all(e.token_ids == [] and e.block_size == 0 for e in windowed)


def test_self_describing_kv_events_with_hashes_finer_than_blocks(runners) -> None:
    """A Mamba-align hybrid hashed every 4 tokens (``prefix_match_unit``): the full-attention
    chunks are described with vLLM's block-level hashes and tokens, exactly as its GPU events
    give them; the Mamba states and the partial tails at the replay boundary (28) keep the
    placeholder."""
    r = runners(PARTIAL_TAIL, prefix_match_unit=4, kv_events=True,
                extra={"self_describing_kv_events": True})
    r.serve(_prompt(30), 1)
    _host_tier_is_released(r)
    _one_more_step(r)
    cpu = _events(r, "BlockStored", "CPU")
    described = [e for e in cpu if e.token_ids]
    # vLLM's GPU events also name the cached 4-token pieces past the last whole block.
    gpu_full = {h: p for h, p in _gpu_blocks(r, group=0).items() if p[2] == 16}
    assert len(gpu_full) == 1  # one whole 16-token block of the 30-token prompt
    assert described_blocks(described) == gpu_full
    assert all(e.group_idx == 0 for e in described)
    placeholders = [e for e in cpu if not e.token_ids]
    assert {e.group_idx for e in placeholders} == {0, 1}  # partial tails of both, Mamba states


def test_no_kv_cache_events_unless_the_engine_asks(runners) -> None:
    r = runners([G("full", 16)])
    r.serve(_prompt(96), 1)
    assert r.connector.take_events() == []
    assert not any(e.medium in ("CPU", "STORAGE") for batch in r.published for e in batch.events)


# ---- prompt tails never change what the recomputed token attends (issue 22) -----------------------
# A hit of the whole prompt N makes vLLM allocate for N computed tokens, then rewind to N - 1: its
# sliding-window manager has by then nulled every block wholly below N - W + 1, so the recomputed
# token (which attends N - W .. N - 1) would read position N - W from the null block whenever
# N - W + 1 is a block boundary. The harness checks every attended position at every step.
WINDOW_TAIL_CASES = [
    # (block, window, prompt length)
    (16, 32, 111), (16, 32, 127), (16, 64, 127), (32, 48, 111),
    (16, 40, 103), (16, 40, 119), (16, 40, 135),
    (16, 32, 110), (16, 32, 112), (16, 32, 100),
]


@pytest.mark.parametrize(("block", "window", "n"), WINDOW_TAIL_CASES,
                         ids=[f"b{b}-w{w}-n{n}" for b, w, n in WINDOW_TAIL_CASES])
def test_window_prompt_tail_keeps_every_attended_block(runners, block: int, window: int, n: int) -> None:
    r = runners([G("full", block), G("sw", block, window=window)])
    served = _store_then_serve(r, _prompt(n))
    assert served == n - 1  # windowed layouts stop one token short of the prompt (R21)


@pytest.mark.parametrize("groups", [[G("full", 16)], [G("full", 16), G("sw", 16, window=32)]],
                         ids=["fa", "fa-sw"])
@pytest.mark.parametrize("n", [1, 2])
def test_one_and_two_token_prompts_repeated_run_and_serve_nothing_useless(runners, groups, n: int) -> None:
    """A stored 1-token prompt answered with a hit of 1 would rewind to 0 computed tokens and be
    looked up again forever. A tail that saves no computation is neither stored nor served; a
    2-token prompt's tail saves its first token (full attention: a hit of the whole prompt,
    rewound by vLLM; with a window: one token short)."""
    r = runners(groups)
    prompt = _prompt(n)
    assert r.serve(prompt, 2) == 0
    r.drop_gpu_prefix_cache()
    served = r.serve(prompt, 2)
    assert r.load_errors == [], r.load_errors
    expected = 0 if n == 1 else (n if len(groups) == 1 else n - 1)
    assert served == expected
    assert r.connector.scheduler.hierarchy.stats()["host"]["used"] == (0 if n == 1 else len(groups))


def _chunk_store_keys(r: Runner, prompt: list[int], rank: int = 0) -> list[bytes]:
    """Store keys (rank ``rank``'s namespace + chunk key) of ``prompt``'s full-attention chunks."""
    from strata_harness import EOS
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvstrata import semantics

    sched = r.connector.scheduler
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    probe = Request(request_id="probe", prompt_token_ids=prompt, sampling_params=params,
                    pooling_params=None, block_hasher=r._hasher)
    keys = semantics.chunk_keys(probe.block_hashes, sched.layout.groups[0])
    return [sched.hierarchy.namespaces[rank] + k for k in keys]


def _flip_payload_byte(store: Path, key: bytes) -> None:
    import lmdb

    with lmdb.open(str(store), max_dbs=4) as raw, raw.begin(write=True) as txn:
        payload = raw.open_db(b"payload", txn=txn)
        frame = bytearray(txn.get(key, db=payload))
        frame[len(frame) // 2] ^= 0xFF
        txn.put(key, bytes(frame), db=payload)


def test_a_store_failed_on_one_rank_is_not_committed_when_another_finishes_later(runners) -> None:
    """Rank 0 reports a store job failed in one step, rank 1 reports it done a step later: the
    chunk would hold a garbage shard for rank 0, so it must not be committed (nor served)."""
    r = runners([G("full", 16)], tp=2)
    rank0, rank1 = (w.worker.stager for w in r.workers)
    stores: set[int] = set()
    real_store, real_poll0, real_poll1 = rank0.store, rank0.poll, rank1.poll

    def store(job_id, copies, **kw):
        stores.add(job_id)
        return real_store(job_id, copies, **kw)

    def poll0():  # every store fails on rank 0
        return [(job, ok and job not in stores) for job, ok in real_poll0()]

    held: list[tuple[int, bool]] = []

    def poll1():  # rank 1 reports each store one poll late
        late, held[:] = list(held), []
        now = []
        for job, ok in real_poll1():
            (held if job in stores else now).append((job, ok))
        return now + late

    rank0.store, rank0.poll, rank1.poll = store, poll0, poll1
    assert r.serve(_prompt(96), 1) == 0
    assert stores and not held
    r.drop_gpu_prefix_cache()
    assert r.serve(_prompt(96), 1) == 0  # nothing was committed
    assert r.load_errors == []
    stats = r.connector.scheduler.hierarchy.stats()
    assert stats["stores_completed"] == 0 and stats["stores_failed"] == 12  # 6 chunks, twice


def test_after_a_prompt_tail_load_the_tail_chunk_is_stored_once_decoding_completes_it(runners) -> None:
    """The tail chunk was loaded under its tail key; with ``offload_prompt_only`` false its full
    key is stored when the decode fills it, and a prompt ending there is served whole."""
    r = runners([G("full", 16)], extra={"offload_prompt_only": False})
    prompt = _prompt(100)
    assert _store_then_serve(r, prompt) == 100  # 6 chunks + the tail; max_tokens 1 fills nothing
    r.drop_gpu_prefix_cache()
    req = r.add(prompt, 20)  # the tail hit again, then 20 decoded tokens fill chunk 6 (to 112)
    r.run_until_idle()
    assert r.loaded_tokens[req.request_id] == 100
    r.drop_gpu_prefix_cache()
    assert r.serve(list(req.all_token_ids[:112]), 1) == 112
    assert r.load_errors == []


def test_a_failed_load_retried_with_no_hit_stores_what_it_recomputes(runners, tmp_path: Path) -> None:
    """The first chunk's record is corrupt: the streamed load fails, the retry finds nothing and
    recomputes the prompt. What it recomputed is stored again (the scan was not left past the
    failed load's chunks), so the next request is served the whole prompt from the host tier."""
    store = tmp_path / "persist"
    prompt = _prompt(96)
    first = runners([G("full", 16)], store=store)
    first.serve(prompt, 1)
    chunk0 = _chunk_store_keys(first, prompt)[0]
    first.close()
    _flip_payload_byte(store, chunk0)
    second = runners([G("full", 16)], store=store)
    req = second.add(prompt, 1)
    second.run_until_idle()
    assert second.stats.data["load_failures"] == 1
    assert second.stats.data["hit_tokens"] == 0  # the retry: chunk 0 is bad, nothing served
    assert req.is_finished()
    second.drop_gpu_prefix_cache()
    assert second.serve(prompt, 1) == 96
    assert second.load_errors == []


def test_a_lookup_promotes_nothing_past_the_first_missing_chunk(runners, tmp_path: Path) -> None:
    """Chunk 2 of 6 is gone from the store: the restarted engine's lookup promotes chunks 0 and 1
    only (chunks 3-5 could not be served, and promoting them would take host slots and make the
    request wait for them)."""
    store = tmp_path / "persist"
    prompt = _prompt(96)
    first = runners([G("full", 16)], store=store)
    first.serve(prompt, 1)
    gone = _chunk_store_keys(first, prompt)[2]
    first.close()
    import lmdb

    with lmdb.open(str(store), max_dbs=4) as raw, raw.begin(write=True) as txn:
        assert txn.delete(gone, db=raw.open_db(b"index", txn=txn))
    second = runners([G("full", 16)], store=store)
    assert second.serve(prompt, 1) == 32
    assert second.connector.scheduler.hierarchy.stats()["promotions_started"] == 2
    assert second.load_errors == []


# ---- kept window tails (semantics.plan_store keep_served_tails) under vLLM's default retention 0 --
# vLLM keeps a sliding window's tail only where a replay's search starts (the replay boundary);
# a drafter's pop or a Mamba rounding ends the hit lower, where kvstrata keeps the tail too.
# The harness checks every position the first computed token attends.
KEPT_TAIL_CASES = [
    ("sw-eagle", [G("full", 16), G("sw", 16, window=32, eagle=True)], True, 100, 80),
    ("sw-mamba", [G("full", 16), G("sw", 16, window=32), G("mamba", 64)], False, 100, 64),
    ("sw-mamba-eagle", [G("full", 16, eagle=True), G("sw", 16, window=32), G("mamba", 32)], True, 140, 96),
]


@pytest.mark.parametrize(("name", "groups", "spec", "n", "expected"), KEPT_TAIL_CASES,
                         ids=[c[0] for c in KEPT_TAIL_CASES])
def test_kept_window_tails_serve_the_replay_with_every_attended_block(
        runners, name, groups, spec, n: int, expected: int) -> None:
    r = runners(groups, spec_decode=spec, retention=0)
    assert _store_then_serve(r, _prompt(n)) == expected


def test_replicated_kv_is_stored_once_and_served_to_every_rank(runners) -> None:
    """MLA under tensor parallelism: every rank holds the same latent. One shard per slot under
    one namespace (host and disk capacity not divided by the TP size), copied by rank 0 only;
    both ranks load it, each checked page by page."""
    r = runners([G("full", 16)], tp=2, replicated=True)
    plan = r.connector.plan
    assert plan.replicated and len(plan.namespaces) == 1 and plan.slot_bytes == plan.shard_bytes
    assert _store_then_serve(r, _prompt(100)) == 100
    rank0, rank1 = (w.worker.stager for w in r.workers)
    assert rank0.bytes_stored > 0 and rank1.bytes_stored == 0
    assert rank0.bytes_loaded == rank1.bytes_loaded > 0


@pytest.mark.parametrize("short_of_space", [False, True])
def test_the_disk_reserve_reaches_the_store(runners, tmp_path: Path, short_of_space: bool) -> None:
    """``disk_reserve`` is the disk tier's: a reserve the file system cannot give leaves an empty
    store nothing to evict, so nothing goes to disk (counted) while the host tier still serves;
    the default reserve (1 GiB) lets the same prompt reach the disk."""
    import shutil

    extra = {"disk_reserve": shutil.disk_usage(tmp_path).free + (1 << 40)} if short_of_space else {}
    r = runners([G("full", 16)], extra=extra)
    assert _store_then_serve(r, _prompt(100)) == 100  # from the host tier either way
    hierarchy = r.connector.scheduler.hierarchy
    hierarchy.close()  # every accepted write done
    disk = hierarchy.stats()["tiers"]["disk"]
    assert disk["reserve_bytes"] == extra.get("disk_reserve", 1 << 30), disk
    # The metrics' tier figures (refreshed once a second).
    import time

    deadline = time.monotonic() + 5
    while "disk_admission_drops" not in (gauges := r.connector.scheduler.take_stats().data):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.1)
    if short_of_space:
        assert disk["entries"] == 0 and disk["reserve_drops"] > 0 and disk["full_events"] == 0, disk
        # Chunks the disk refused, and the disk held to its size (empty) by the reserve.
        assert gauges["disk_admission_drops"] >= disk["reserve_drops"], gauges
        assert gauges["disk_reserve_capped"] == 1, gauges
    else:
        assert disk["entries"] > 0 and disk["reserve_drops"] == 0, disk
        assert gauges["disk_admission_drops"] == 0 and gauges["disk_reserve_capped"] == 0, gauges


def test_a_host_tier_its_shared_memory_cannot_hold_is_a_clear_error(runners, tmpfs) -> None:
    """A container's /dev/shm is 64 MiB unless it runs with --shm-size or --ipc=host: a host tier
    larger than the free space of its directory stops the engine with what to change, not with
    the file system's ENOSPC alone. Needs root for a small tmpfs (skipped otherwise)."""
    import os

    from kvstrata.config import ConfigError

    shm = tmpfs("8m")
    with pytest.raises(ConfigError, match=r"host tier needs 64 MiB in .*, which has [0-9]+ MiB "
                                          r"free.*--shm-size.*'host_shm_dir'.*'host_bytes'"):
        runners([G("full", 16)], extra={"host_shm_dir": str(shm), "host_bytes": "64MiB"})
    assert os.listdir(shm) == []  # nothing left behind
