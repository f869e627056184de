"""Loads from the disk tier under vLLM 0.32.0's real Scheduler, on CPU: waiting on promotions,
streamed loads, and records found corrupt or missing (recomputed, never served)."""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    assert_host_tier_released,
    slow_disk_reads,
    token_prompt,
)
from strata_harness import G, Runner

pytestmark = pytest.mark.integration


def test_waiting_on_promotions_neither_spins_nor_rescans(runners, tmp_path: Path, monkeypatch) -> None:
    """A restarted engine whose first request waits on disk -> host promotions: its empty steps
    wait for them (bounded by IDLE_WAIT_S) instead of spinning, and its lookup is not re-run
    while every chunk it waits on is still in flight."""
    import time

    from kvstrata.connector import scheduler as sched_mod
    from kvstrata.tiers.disk import DiskStore

    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(token_prompt(96), 1)  # chunk-aligned: no prompt tail
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
    req = second.add(token_prompt(96), 1)
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


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "verified-first"])
def test_disk_hit_is_loaded_while_its_chunks_land(runners, tmp_path: Path, monkeypatch, stream) -> None:
    """Under kv_load_failure_policy="recompute" (this harness) loads stream: the restarted
    engine's first request gets its load job in its first step, while the promotions still run,
    and the worker copies each chunk as it lands. With ``stream_loads`` off the hit is answered
    only once every chunk landed. Either way every loaded page is byte-checked."""
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(token_prompt(96), 1)
    first.close()
    second = runners([G("full", 16)], store=store, extra={"stream_loads": stream})
    slow_disk_reads(monkeypatch, 0.03)
    hierarchy = second.connector.scheduler.hierarchy
    req = second.add(token_prompt(96), 1)
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
    prompt = token_prompt(96)
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
    slow_disk_reads(monkeypatch, 0.02)
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


def test_a_failed_load_retried_with_no_hit_stores_what_it_recomputes(runners, tmp_path: Path) -> None:
    """The first chunk's record is corrupt: the streamed load fails, the retry finds nothing and
    recomputes the prompt. What it recomputed is stored again (the scan was not left past the
    failed load's chunks), so the next request is served the whole prompt from the host tier."""
    store = tmp_path / "persist"
    prompt = token_prompt(96)
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
    prompt = token_prompt(96)
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


@pytest.mark.parametrize("wait", ["no-wait", "until-room", "until-deadline", "not-streamed"])
def test_a_disk_hit_waits_for_host_room_to_be_promoted_whole(runners, tmp_path: Path, wait: str) -> None:
    """Every host slot but two is held (stores in flight) when a restarted engine's request
    finds its 6 chunks on disk. With ``host_room_wait_s`` 0 its load is brought in pieces
    through the two free slots (promoted, copied, unpinned, the next two promoted): served whole,
    every page byte-checked. With a wait, its lookup defers while the host tier has no room; once
    the stores let go of their slots it is served whole in one load; and if they never do, it
    is loaded in pieces once it waited ``host_room_wait_s``. With loads not streamed (vLLM's
    default kv_load_failure_policy "fail") it loads the 2 chunks that fit and computes the rest.
    Watched failing with the lookup not asked to wait (32 tokens loaded, not 96), and before
    loads came in pieces (32 tokens)."""
    import os
    import time

    store = tmp_path / "persist"
    prompt = token_prompt(96)  # chunk-aligned: no prompt tail
    first = runners([G("full", 16)], store=store)
    first.serve(prompt, 1)
    first.close()
    wait_s = {"no-wait": 0.0, "until-room": 60.0, "until-deadline": 0.5, "not-streamed": 0.0}[wait]
    second = runners([G("full", 16)], store=store,
                     extra={"host_room_wait_s": wait_s, "stream_loads": wait != "not-streamed"})
    hierarchy = second.connector.scheduler.hierarchy
    pinned = [os.urandom(28) + bytes(4) for _ in range(second.connector.scheduler.plan.num_slots - 2)]
    assert hierarchy.prepare_store(pinned) is not None
    started = time.monotonic()
    req = second.add(prompt, 1)
    if wait == "until-room":
        for _ in range(5):
            second.step()
        assert req.request_id not in second.loaded_tokens and req.num_computed_tokens == 0
        assert hierarchy.stats()["promote_room_waits"] >= 4
        hierarchy.complete_store(pinned, success=False)  # the stores let go of their slots
    steps = 0
    while not req.is_finished():
        second.step()
        steps += 1
        assert steps < 100_000, "the request was never served"  # a hang guard
    second.run_until_idle()
    assert second.load_errors == []
    stats = hierarchy.stats()
    if wait == "until-room":
        assert second.loaded_tokens[req.request_id] == 96
        assert stats["promote_no_room"] == 0 and stats["promotions_started"] == 6, stats
        assert second.stats.data["pieced_loads"] == 0
    elif wait == "not-streamed":
        assert second.loaded_tokens[req.request_id] == 32  # the two chunks that fit
        assert stats["promote_no_room"] >= 1 and stats["promote_queued"] == 0, stats
    else:
        assert second.loaded_tokens[req.request_id] == 96  # in three pieces of two chunks
        assert stats["promote_no_room"] == 0 and stats["promote_queued"] >= 4, stats
        assert stats["promotions_completed"] == 6, stats
        assert second.stats.data["pieced_loads"] == 1 and second.stats.data["load_pieces"] == 2
        assert second.stats.data["hit_tokens_disk"] == 96 and second.stats.data["load_failures"] == 0
        assert (stats["promote_room_waits"] > 0) == (wait == "until-deadline"), stats
        if wait == "until-deadline":
            assert time.monotonic() - started >= wait_s
        assert stats["host"]["referenced"] == len(pinned)  # the load's pins all let go
    hierarchy.complete_store(pinned, success=False)


def _restarted_over_a_stored_prompt(runners, tmp_path: Path, prompt: list[int], num_blocks: int = 400,
                                    **extra) -> Runner:
    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(prompt, 1)
    first.close()
    return runners([G("full", 16)], store=store, num_blocks=num_blocks, extra=extra)


def _promotions_landed(r: Runner) -> None:
    import time

    deadline = time.monotonic() + 30
    while r.connector.scheduler.hierarchy.stats()["promotions_inflight"]:
        assert time.monotonic() < deadline, "promotions never landed"
        time.sleep(0.01)


def test_a_waiting_request_s_landed_chunks_are_kept_until_it_loads_them(runners, tmp_path: Path) -> None:
    """Loads not streamed (vLLM's default kv_load_failure_policy "fail"): a restarted engine's
    request waits while its 6 chunks promote, and is looked up again only when vLLM's scheduler
    reaches it. Meanwhile other requests' stores want 12 of the host tier's 16 free slots: the
    landed chunks are held for the request (the stores are refused), which is then served all
    96 tokens from the 6 promotions, each promoted once. Watched failing without the holds
    (the stores evicted 4 landed chunks; the request promoted them again, or computed them)."""
    import os

    prompt = token_prompt(96)  # chunk-aligned: no prompt tail
    second = _restarted_over_a_stored_prompt(runners, tmp_path, prompt, stream_loads=False)
    hierarchy = second.connector.scheduler.hierarchy
    # Stores in flight hold every host slot but 16 throughout.
    pinned = [os.urandom(28) + bytes(4) for _ in range(second.connector.scheduler.plan.num_slots - 16)]
    assert hierarchy.prepare_store(pinned) is not None
    req = second.add(prompt, 1)
    second.step()  # the lookup defers; its promotions read once the step is scheduled
    assert req.request_id not in second.loaded_tokens
    _promotions_landed(second)
    others = [os.urandom(28) + bytes(4) for _ in range(12)]
    taken = hierarchy.prepare_store(others)
    second.run_until_idle()
    assert second.loaded_tokens[req.request_id] == 96
    assert second.load_errors == []
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 6 and stats["waiting_holds"] >= 6, stats
    assert taken is None and stats["store_no_room"] == 1
    assert stats["chunks_held"] == 0 and stats["host"]["referenced"] == len(pinned)
    hierarchy.complete_store(pinned, success=False)
    assert second.stats.data["hit_tokens_disk"] == 96


def test_a_hit_vllm_finds_no_blocks_for_keeps_its_chunks_until_it_loads_them(runners, tmp_path: Path) -> None:
    """Streamed loads (the default under "recompute"): a restarted engine's request is answered
    a hit of its 6 chunks on disk, promoted for it, but vLLM finds no blocks for it while a long
    request decodes, so it waits and is looked up again at every step. Meanwhile other stores
    take every host slot they may: the request's landed chunks are held for it, not evicted, and
    it is served all 96 tokens from the 6 promotions, each promoted once. Watched failing
    without the holds on a hit (the stores evicted the landed chunks: 12 promotions)."""
    import os

    prompt = token_prompt(96)  # chunk-aligned: no prompt tail
    second = _restarted_over_a_stored_prompt(runners, tmp_path, prompt, num_blocks=23)
    hierarchy = second.connector.scheduler.hierarchy
    # A long request holds 19-20 of the 22 blocks while it decodes (its stores done first).
    long = second.add(token_prompt(288, seed=6), 20)
    second.step()
    _stores_landed(second)
    req = second.add(prompt, 1)
    second.step()  # answered a hit; vLLM cannot allocate its blocks
    assert req.request_id not in second.loaded_tokens
    _promotions_landed(second)
    assert hierarchy.stats()["chunks_held"] == 6
    # Stores take every slot a store may have.
    others = [os.urandom(28) + bytes(4) for _ in range(hierarchy.store_room())]
    assert hierarchy.prepare_store(others) is not None
    hierarchy.complete_store(others, success=False)
    second.run_until_idle()
    assert long.request_id in second.outputs and second.loaded_tokens[req.request_id] == 96
    assert second.load_errors == []
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 6, stats
    assert stats["chunks_held"] == 0
    assert_host_tier_released(second)


def _stores_landed(r: Runner) -> None:
    import time

    deadline = time.monotonic() + 30
    while r.connector.scheduler.hierarchy.stats()["stores_inflight"]:
        assert time.monotonic() < deadline, "stores never landed"
        r.step()
        time.sleep(0.01)


@pytest.mark.parametrize("end", ["abort", "reset"])
def test_a_waiting_request_s_holds_go_with_it_or_with_the_cache(runners, tmp_path: Path, end: str) -> None:
    """A client disconnects while its request waits on promotions it holds, or the prefix cache
    is reset (``reset_prefix_cache(reset_connector=True)``): the holds go, nothing stays pinned
    (the reset empties the host tier), and a request with the prefix is served whole."""
    from vllm.v1.request import RequestStatus

    prompt = token_prompt(96)
    second = _restarted_over_a_stored_prompt(runners, tmp_path, prompt, stream_loads=False)
    hierarchy = second.connector.scheduler.hierarchy
    req = second.add(prompt, 1)
    second.step()
    assert hierarchy.stats()["chunks_held"] == 6
    _promotions_landed(second)
    if end == "abort":
        second.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    else:
        second.connector.reset_cache()
        st = hierarchy.stats()
        assert st["chunks_held"] == 0 and st["host"]["used"] == 0, st
    second.run_until_idle()
    assert_host_tier_released(second)
    if end == "reset":  # the request goes on: promoted again and served
        assert second.loaded_tokens[req.request_id] == 96
        second.drop_gpu_prefix_cache()
    assert second.serve(prompt, 1) == 96
    assert second.load_errors == []


def test_a_request_vllm_looks_up_at_every_step_offers_its_chunks_once(runners) -> None:
    """Disk admission (``admission: 3``: written once offered three times) counts requests: a
    request vLLM cannot allocate blocks for is looked up again at every step, and those lookups
    are one offer, not one per step."""
    r = runners([G("full", 16)], num_blocks=23, extra={"admission": 3})
    prompt = token_prompt(64, seed=5)
    assert r.serve(prompt, 1) == 0  # stored: the first offer of its 4 chunks
    r.drop_gpu_prefix_cache()
    scheduler = r.connector.scheduler
    lookups: dict[str, int] = {}
    real_lookup = scheduler.get_num_new_matched_tokens

    def counted(request, *args):  # type: ignore[no-untyped-def]
        lookups[request.request_id] = lookups.get(request.request_id, 0) + 1
        return real_lookup(request, *args)

    scheduler.get_num_new_matched_tokens = counted  # type: ignore[method-assign]
    # A long request holds 19-20 of the 22 blocks while it decodes: the prompt's second request
    # (4 blocks) waits for it, looked up at every step.
    r.add(token_prompt(288, seed=6), 20)
    r.step()
    again = r.add(prompt, 1)
    r.run_until_idle()
    assert lookups[again.request_id] >= 3, lookups
    assert r.loaded_tokens[again.request_id] > 0  # served once it could run
    assert r.load_errors == []
    # Two requests offered the chunks (the one that stored them, the one served): not admitted.
    assert scheduler.hierarchy.stats()["writes_started"] == 0


def test_a_lookup_s_promotions_read_once_the_step_is_scheduled(runners, tmp_path: Path, monkeypatch) -> None:
    """The disk reads a lookup starts run once vLLM has scheduled the step (from
    ``build_connector_meta``), not while its scheduler still runs: their Python work would take
    the GIL from it (docs/BENCHMARKS.md, "Promotions launched after the step's scheduling")."""
    import time

    from kvstrata.tiers.disk import DiskStore

    store = tmp_path / "persist"
    first = runners([G("full", 16)], store=store)
    first.serve(token_prompt(96), 1)
    first.close()
    second = runners([G("full", 16)], store=store)
    reads: list[float] = []
    real_get_into = DiskStore.get_into

    def recorded_get_into(self, key, out):
        reads.append(time.monotonic())
        return real_get_into(self, key, out)

    monkeypatch.setattr(DiskStore, "get_into", recorded_get_into)
    hierarchy = second.connector.scheduler.hierarchy
    reads_by_lookup_end: list[int] = []
    real_lookup = hierarchy.lookup_many

    def lookup_then_wait(keys, promoting=None, **kw):
        answers = real_lookup(keys, promoting, **kw)
        time.sleep(0.1)  # a read launched now would have begun meanwhile
        reads_by_lookup_end.append(len(reads))
        return answers

    monkeypatch.setattr(hierarchy, "lookup_many", lookup_then_wait)
    launched: list[int] = []
    real_launch = hierarchy.launch_deferred_promotions
    monkeypatch.setattr(hierarchy, "launch_deferred_promotions",
                        lambda: launched.append(len(reads)) or real_launch())
    req = second.add(token_prompt(96), 1)
    second.step()
    assert hierarchy.stats()["promotions_started"] == 6
    assert reads_by_lookup_end and set(reads_by_lookup_end) == {0}, reads_by_lookup_end
    assert launched and launched[0] == 0
    second.run_until_idle()
    assert second.loaded_tokens[req.request_id] == 96 and second.load_errors == []
    assert len(reads) >= 6 and second.stats.data["hit_tokens_disk"] == 96


@pytest.mark.parametrize("tp", [1, 2])
def test_writes_framed_by_the_write_processes_are_served_after_a_restart(runners, tmp_path: Path, tp: int) -> None:
    """``write_processes``: the engine's writes to its disk are framed by processes of its disk
    tier from the host slab (every shard of a chunk from its place) and put by its put process;
    the restarted engine loads every chunk from them, each loaded page byte-checked."""
    store = tmp_path / "persist"
    prompt = token_prompt(96)
    first = runners([G("full", 16)], store=store, tp=tp, extra={"write_processes": 2})
    hierarchy = first.connector.scheduler.hierarchy
    assert [link.slab_writes for link in hierarchy._s.links] == [True]  # noqa: SLF001
    first.serve(prompt, 1)
    disk = hierarchy.tiers[0]
    first.close()  # every write behind done
    framed = disk.stats()
    assert framed["process_framed"] == framed["process_puts"] == 6 * tp  # 6 chunks, one record per rank
    second = runners([G("full", 16)], store=store, tp=tp)
    assert second.serve(prompt, 1) == 96 and second.load_errors == []
    assert second.stats.data["hit_tokens_disk"] == 96 and second.stats.data["load_failures"] == 0
    second.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_disk_hits_are_read_by_the_read_processes(runners, tmp_path: Path, tp: int) -> None:
    """``read_processes``: the restarted engine's promotions are read by processes of its disk
    tier straight into the host slab (every shard of a chunk at its place), streamed to the
    worker as they land, and every loaded page is byte-checked; a record found damaged there is
    a failed load and its request recomputed from the chunks before it, as in-process."""
    store = tmp_path / "persist"
    prompt = token_prompt(96)
    first = runners([G("full", 16)], store=store, tp=tp)
    first.serve(prompt, 1)
    keys = _chunk_store_keys(first, prompt, rank=tp - 1)
    first.close()
    second = runners([G("full", 16)], store=store, tp=tp, extra={"read_processes": 2})
    hierarchy = second.connector.scheduler.hierarchy
    assert [link.slab_reads for link in hierarchy._s.links] == [True]  # noqa: SLF001
    assert second.serve(prompt, 1) == 96 and second.load_errors == []
    assert second.stats.data["hit_tokens_disk"] == 96 and second.stats.data["load_failures"] == 0
    assert hierarchy.tiers[0].stats()["hits"] == 6 * tp  # 6 chunks, one record per rank
    second.close()

    _flip_payload_byte(store, keys[3])
    third = runners([G("full", 16)], store=store, tp=tp, extra={"read_processes": 2})
    assert third.serve(prompt, 1) == 48 and third.load_errors == []  # chunks 0-2, never chunk 3
    assert third.stats.data["load_failures"] == 1 and third.stats.data["hit_tokens_disk"] == 48
    assert third.connector.scheduler.hierarchy.tiers[0].stats()["corrupt"] == 1


def test_a_request_looked_up_behind_another_promotes_no_more_than_it_can_hold(runners, tmp_path: Path) -> None:
    """Loads not streamed: a restarted engine gets two requests at once, each with 6 chunks on
    disk, and room to hold 8 chunks for waiting requests. The first looked up in the step promotes its 6 and
    holds them; the second, behind it, promotes only the 2 it can hold (the rest would be idle
    slots others' promotions and stores take before it loads them) and the rest once it comes
    first. Both are served all 96 tokens, each chunk promoted once. Watched failing without the
    budget (12 promotions in the first step)."""
    import os

    first_prompt, second_prompt = token_prompt(96, seed=11), token_prompt(96, seed=12)
    store = tmp_path / "persist"
    writer = runners([G("full", 16)], store=store)
    writer.serve(first_prompt, 1)
    writer.serve(second_prompt, 1)
    writer.close()
    r = runners([G("full", 16)], store=store, extra={"stream_loads": False, "host_bytes": 1 << 20})
    hierarchy = r.connector.scheduler.hierarchy
    # Other waiting requests hold all but 8 of the chunks that may be held.
    others = [os.urandom(28) + bytes(4) for _ in range(hierarchy.hold_room() - 8)]
    assert hierarchy.prepare_store(others) is not None
    hierarchy.complete_store(others)
    held = hierarchy.hold(others)
    assert hierarchy.hold_room() == 8
    a, b = r.add(first_prompt, 1), r.add(second_prompt, 1)
    r.step()
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 8 and stats["promote_held_back"] == 4, stats
    assert stats["chunks_held"] == len(others) + 8, stats
    r.run_until_idle()
    assert r.loaded_tokens[a.request_id] == 96 and r.loaded_tokens[b.request_id] == 96
    assert r.load_errors == []
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 12 and stats["promotions_unused"] == 0, stats
    hierarchy.release_held(held)
    assert_host_tier_released(r)


def test_the_request_vllm_schedules_next_holds_past_what_others_left(runners, tmp_path: Path) -> None:
    """Loads not streamed: requests behind in vLLM's queue hold all of the half of the host
    tier that they may. A restarted engine's request, first in its step's lookups (the one
    vLLM schedules next), still holds its 6 promoting chunks (the head may hold up to three
    quarters), and is served all 96 tokens, each chunk promoted once. Watched failing with the
    head's allowance ignored (0 of its chunks held)."""
    import os

    prompt = token_prompt(96)
    store = tmp_path / "persist"
    writer = runners([G("full", 16)], store=store)
    writer.serve(prompt, 1)
    writer.close()
    r = runners([G("full", 16)], store=store, extra={"stream_loads": False, "host_bytes": 1 << 20})
    hierarchy = r.connector.scheduler.hierarchy
    others = [os.urandom(28) + bytes(4) for _ in range(hierarchy.hold_room())]
    assert hierarchy.prepare_store(others) is not None
    hierarchy.complete_store(others)
    held = hierarchy.hold(others)
    assert hierarchy.hold_room() == 0 and hierarchy.hold_room(head=True) >= 6
    req = r.add(prompt, 1)
    r.step()
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 6 and stats["chunks_held"] == len(others) + 6, stats
    r.run_until_idle()
    assert r.loaded_tokens[req.request_id] == 96 and r.load_errors == []
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 6 and stats["promotions_unused"] == 0, stats
    hierarchy.release_held(held)
    assert_host_tier_released(r)


def test_a_hit_vllm_allocates_at_once_is_pinned_by_its_load_alone(runners, tmp_path: Path) -> None:
    """Streamed loads: a restarted engine's request is answered a hit of its 6 chunks on disk
    and vLLM allocates its blocks in the same step. Its load pins them; nothing is held for it
    (the scheduler's critical path pins and lets go of nothing twice), and it is served all 96
    tokens. Watched failing with the hit held at the lookup (6 holds)."""
    prompt = token_prompt(96)
    r = _restarted_over_a_stored_prompt(runners, tmp_path, prompt)
    hierarchy = r.connector.scheduler.hierarchy
    req = r.add(prompt, 1)
    r.step()
    stats = hierarchy.stats()
    assert stats["promotions_started"] == 6 and stats["waiting_holds"] == 0, stats
    r.run_until_idle()
    assert r.loaded_tokens[req.request_id] == 96 and r.load_errors == []
    assert_host_tier_released(r)
