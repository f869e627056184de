"""The shared tier between two real engines: what engine A computed is served to engine B (its
own host tier and local disk, both empty) from one real Redis server, equal to a recomputation;
a Redis server that hangs (SIGSTOP) while B serves costs B nothing but misses.

Two engine processes: (1) the reference (vLLM alone, float32, each prompt computed on its own)
then engine A, one after the other in one process; (2) engine B. A clean engine shutdown drains
write-behind into every tier, the shared one included, so A's chunks are on the server when its
process has exited (checked, not waited for).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pytest
from e2e_harness import (
    CASES,
    JOB_TIMEOUT_S,
    dump,
    generate_step,
    independent_prompts,
    metric,
    namespaces_of,
    steps_by_name,
    store_keys,
)
from equivalence import (
    EQ_MAX_TOKENS,
    compare_step,
    divergences,
    reference_step,
    references_of,
    summary,
)
from redis_server import RedisServer

from kvstrata.tiers.remote import KEY_PREFIX
from kvstrata.tools.jobs import run_jobs_subprocess

CASE = CASES["llama"]  # float32, 128-token blocks, prompt tails served



# Block boundaries +-1/2, two blocks, 1- and 2-token prompts (equivalence.boundary_lengths).
SHARED = independent_prompts(11, [1, 2, 126, 127, 128, 129, 130, 256, 258, 301])
# Never seen by A: computed by B while the server hangs.
HUNG = independent_prompts(12, [1, 2, 128, 129, 257])
HUNG_LATER = independent_prompts(13, [2, 130, 200])


def _remote_store_keys(server: RedisServer) -> set[bytes]:
    """Store keys (namespace + chunk key) of every ``kvstrata:<ns hex>:<chunk hex>`` value."""
    out = set()
    for rkey in server.client().scan_iter(match=KEY_PREFIX + b"*", count=1000):
        ns, chunk = rkey[len(KEY_PREFIX):].split(b":")
        out.add(bytes.fromhex(ns.decode()) + bytes.fromhex(chunk.decode()))
    return out


def _check(refs: dict, step: dict, prompts: list[list[int]]) -> None:
    verdicts = compare_step(refs, step, prompts)
    assert not divergences(verdicts), "\n".join(divergences(verdicts))
    print(f"{step['name']}: {summary(verdicts)}")


@pytest.mark.slow
def test_a_chunk_of_one_engine_is_served_to_another_through_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    t0 = time.monotonic()
    model_dir = CASE.build(tmp_path / "model", 0)
    # Connect and reply timeouts above the connector's 0.2 + 0.25 s: on a loaded 2-core CI
    # machine the engine's remote loop thread can wait that long for a core, and an opened
    # breaker here would turn the hits this test checks into misses (failures are tests/remote's
    # subject; the hang below opens it all the same).
    remote = {"remote_url": redis_server.url, "remote_connect_timeout_s": 1.0, "remote_timeout_s": 1.0}
    reference = {"engine": asdict(CASE.options(model_dir, None)), "steps": [
        reference_step("ref", SHARED + HUNG + HUNG_LATER, EQ_MAX_TOKENS)]}
    engine_a = {"engine": asdict(CASE.options(model_dir, tmp_path / "store_a", extra_config=remote)),
                "steps": [generate_step("a_cold", SHARED, EQ_MAX_TOKENS)]}
    ref, a = (steps_by_name(r) for r in run_jobs_subprocess(
        [reference, engine_a], timeout_s=JOB_TIMEOUT_S, log_path=tmp_path / "ref_then_a.log"))
    refs = references_of([(SHARED + HUNG + HUNG_LATER, ref["ref"])])
    _check(refs, a["a_cold"], SHARED)
    t1 = time.monotonic()

    # A has exited: its shutdown drained write-behind, so the server holds every chunk A's own
    # disk holds (admission 1 on both tiers), and nothing else.
    model = str(model_dir)
    spaces = namespaces_of(tmp_path / "store_a", model)
    on_a_disk = store_keys(tmp_path / "store_a", spaces)
    on_server = _remote_store_keys(redis_server)
    assert on_a_disk and on_server == on_a_disk, (len(on_server), len(on_a_disk))
    a_metrics = a["a_cold"]["metrics"]
    assert metric(a["a_cold"], "kvstrata_hit_tokens") == 0, dump(a_metrics)

    # B: its own store, a fresh host tier, the same server. First pass: every hit is remote.
    # Then the server hangs (SIGSTOP) and B serves prompts nobody stored, then more.
    b_served, hung = tmp_path / "b_served", tmp_path / "server_hung"
    engine_b = {"engine": asdict(CASE.options(model_dir, tmp_path / "store_b", extra_config=remote)),
                "steps": [
                    generate_step("b_remote", SHARED, EQ_MAX_TOKENS),
                    {"op": "signal", "path": str(b_served)},
                    {"op": "wait_for", "path": str(hung), "timeout_s": 60},
                    {"op": "reset_prefix_cache"},
                    generate_step("b_hung", HUNG + SHARED, EQ_MAX_TOKENS),
                    # Tier gauges are snapshots refreshed at most once a second: the next step
                    # publishes the state the hung server left.
                    {"op": "sleep", "seconds": 1.2},
                    generate_step("b_hung_later", HUNG_LATER, EQ_MAX_TOKENS)]}

    def on_progress(msg: str) -> None:
        if "waiting for" in msg and str(hung) in msg and not hung.exists():
            assert b_served.exists()
            redis_server.pause()
            hung.touch()

    (b,) = (steps_by_name(r) for r in run_jobs_subprocess(
        [engine_b], timeout_s=JOB_TIMEOUT_S, progress=on_progress, log_path=tmp_path / "b.log"))
    t2 = time.monotonic()

    first = b["b_remote"]
    _check(refs, first, SHARED)
    served = sum(o["served"].get("remote", 0) for o in first["outputs"])  # kvstrata's, from the server
    m = first["metrics"]
    print("b_remote per tier:", {k: metric(first, f"kvstrata_hit_tokens{k}")
                                 for k in ("", "_host", "_disk", "_remote")}, "cached", served)
    assert served > 0
    assert metric(first, "kvstrata_hit_tokens_remote") == served, dump(m)
    assert metric(first, "kvstrata_hit_tokens") == served, dump(m)
    assert metric(first, "kvstrata_hit_tokens_disk") == 0, dump(m)
    assert metric(first, "kvstrata_hit_tokens_host") == 0, dump(m)
    assert metric(first, "kvstrata_remote_hits") > 0 and metric(first, "kvstrata_remote_read_bytes") > 0, dump(m)

    # The hung server: every request still completes and equals its recomputation; the prompts
    # B got remotely are served from its host tier.
    hung_step, later = b["b_hung"], b["b_hung_later"]
    _check(refs, hung_step, HUNG + SHARED)
    _check(refs, later, HUNG_LATER)
    assert metric(hung_step, "kvstrata_hit_tokens_host") == served, dump(hung_step["metrics"])
    assert metric(hung_step, "kvstrata_hit_tokens_remote") == 0, dump(hung_step["metrics"])
    ml = later["metrics"]
    print("b_hung_later remote gauges:", {k: v for k, v in ml.items() if "remote" in k})
    assert metric(later, "kvstrata_remote_available") == 0, dump(ml)
    assert metric(later, "kvstrata_remote_errors") > 0, dump(ml)
    assert metric(later, "kvstrata_remote_unavailable_skips") > 0, dump(ml)

    # B wrote what it got remotely to its own disk (and what it computed while the server hung).
    on_b_disk = store_keys(tmp_path / "store_b", namespaces_of(tmp_path / "store_b", model))
    assert on_server <= on_b_disk, (len(on_server - on_b_disk), len(on_server))
    print(f"chunks on the server {len(on_server)}, on B's disk {len(on_b_disk)}; "
          f"ref+A {t1 - t0:.0f}s, B {t2 - t1:.0f}s")
