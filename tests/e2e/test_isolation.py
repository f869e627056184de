"""Isolation end to end on real engines and a real Redis server (docs/SECURITY.md):

* requests with different ``cache_salt`` never share a hit in any tier: the host tier (one
  engine), the disk and a warm start (a restarted engine), the shared tier (another engine),
  prompt tails included (the llama case serves them; the prompts end mid-block), also to longer
  prompts that start with them;
* a value forged by a writer without the secret — another checkpoint made to look like the same
  model (same path, file names, sizes and mtimes, so the same namespace) writing its KV to the
  server — is never served: each request still equals its recomputation by vLLM alone (the
  equivalence oracle: first-token logprobs).

One engine process (a Python/vLLM import is the dearest part of an engine on a small machine),
five engines one after another: F (no secret) on the other checkpoint, swapped in under the model's
path, computing other prompts, which reach the server unsigned; then, with the real checkpoint
back, the reference (vLLM alone); engine A (secret A) serving the prompts under two salts; A
restarted on its store with a warm start (its disk records carry MACs too: ``auth_key_file``);
engine C (secret A, empty local store) reading the shared tier. No engine with a second secret
is started: a value sealed under another secret fails the same check as an unsigned one
(``ValueAuth.open``), and tests/remote/test_remote_auth.py covers both on a real server.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

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

from kvstrata.tools.jobs import run_jobs_subprocess

CASE = CASES["llama"]  # float32, 128-token blocks, prompt tails served



P = independent_prompts(31, [2, 129, 200, 258])  # tails: all of a 2-token prompt, 1, 72 and 2 tokens
Q = independent_prompts(32, [130, 256, 301])  # what the forger computes with the other checkpoint
# P's prompts with a turn after each: a tail serves a longer prompt only under its own salt (R21a).
LONGER = [p + q for p, q in zip(P, independent_prompts(33, [5] * len(P)), strict=True)]
LONGER_C = [p + q for p, q in zip(P, independent_prompts(34, [5] * len(P)), strict=True)]  # new to engine C


def _gen(name: str, prompts: list[list[int]], salt: str | None) -> dict[str, Any]:
    return {**generate_step(name, prompts, EQ_MAX_TOKENS), "cache_salt": salt}


def _cached(step: dict[str, Any]) -> int:
    return sum(o["num_cached_tokens"] for o in step["outputs"])


def _secret(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _swap_in(src: Path, dst: Path, like: Path) -> None:
    """Put checkpoint ``src`` at ``dst`` with the mtimes of ``like``'s files of the same names."""
    shutil.move(str(src), str(dst))
    for f in dst.rglob("*"):
        twin = like / f.relative_to(dst)
        if f.is_file() and twin.is_file():
            st = twin.stat()
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.slow
def test_salts_secrets_and_a_disguised_checkpoint_never_share_or_forge_a_hit(
        tmp_path: Path, redis_server: RedisServer) -> None:
    t0 = time.monotonic()
    model_dir = CASE.build(tmp_path / "model", 0)
    fake_dir = CASE.build(tmp_path / "fake", 1)  # other weights, same names and sizes
    real_aside = tmp_path / "real-aside"
    key_a = _secret(tmp_path / "a.key", "replica-secret-A-0123456789abcdef")
    # Timeouts above the connector's: a loaded CI machine's starved loop thread is not an outage.
    remote = {"remote_url": redis_server.url, "remote_connect_timeout_s": 1.0, "remote_timeout_s": 1.0}
    with_a = {**remote, "remote_auth_key_file": key_a, "auth_key_file": key_a}  # disk records too

    def engine(store: str | None, extra: dict[str, Any]) -> dict[str, Any]:
        return asdict(CASE.options(model_dir, None if store is None else tmp_path / store, extra_config=extra))

    # The forger runs first, on the other checkpoint disguised as the real one; the real one is
    # back under the model's path (while F's process waits) before any other engine starts.
    shutil.move(str(model_dir), str(real_aside))
    _swap_in(fake_dir, model_dir, real_aside)
    f_done, real_back = tmp_path / "f_done", tmp_path / "real_back"
    jobs = [
        {"engine": engine("store_f", remote), "steps": [
            _gen("f_q", Q, None),
            {"op": "signal", "path": str(f_done)},
            {"op": "wait_for", "path": str(real_back), "timeout_s": 120}]},
        {"engine": engine(None, {}), "steps": [reference_step("ref", P + Q + LONGER + LONGER_C, EQ_MAX_TOKENS)]},
        {"engine": engine("store_a", with_a), "steps": [
            _gen("a_x", P, "tenant-x"),
            _gen("a_y", P, "tenant-y"),  # tenant x's chunks and tails are in the host tier
            {"op": "reset_prefix_cache"},
            _gen("a_x_again", P, "tenant-x"),  # the control: x's own chunks are served
            _gen("a_v_longer", LONGER, "tenant-v"),
            _gen("a_x_longer", LONGER, "tenant-x")]},  # x's tails serve x's longer prompts
        # A restarted on its store (an engine shut down and a new one started: the host tier
        # is gone, the disk and its access log stay).
        {"engine": engine("store_a", {**with_a, "warm_start_bytes": 64 << 20}), "steps": [
            {"op": "sleep", "seconds": 2.0},  # the warm start promotes x's and y's chunks
            _gen("a2_z", P, "tenant-z"),
            _gen("a2_y", P, "tenant-y")]},
        {"engine": engine("store_c", with_a), "steps": [
            _gen("c_q", Q, None),  # forged values on the server
            # Tier gauges are snapshots refreshed at most once a second: the next step publishes
            # what c_q left (it reads nothing forged itself: no value has tenant w's keys).
            {"op": "sleep", "seconds": 1.2},
            _gen("c_w", P, "tenant-w"),  # the server holds x's, y's and z's, signed
            _gen("c_x_longer", LONGER_C, "tenant-x"),  # x's chunks and tails, from the server
            _gen("c_x", P, "tenant-x")]},
    ]

    def on_progress(msg: str) -> None:
        if "waiting for" in msg and str(real_back) in msg and not real_back.exists():
            assert f_done.exists()
            shutil.rmtree(model_dir)
            shutil.move(str(real_aside), str(model_dir))
            real_back.touch()

    try:
        f, ref, a, a2, c = (steps_by_name(r) for r in run_jobs_subprocess(
            jobs, timeout_s=2 * JOB_TIMEOUT_S, progress=on_progress, log_path=tmp_path / "engines.log"))
    finally:
        if real_aside.exists():  # the real checkpoint back, as it was
            shutil.rmtree(model_dir, ignore_errors=True)
            shutil.move(str(real_aside), str(model_dir))
    refs = references_of([(P + Q + LONGER + LONGER_C, ref["ref"])])

    def check(step: dict[str, Any], prompts: list[list[int]]) -> None:
        verdicts = compare_step(refs, step, prompts)
        assert not divergences(verdicts), "\n".join(divergences(verdicts))
        print(f"{step['name']}: {summary(verdicts)}; kvstrata hit tokens "
              + str({k or "all": metric(step, f"kvstrata_hit_tokens{k}") for k in ("", "_host", "_disk", "_remote")}))

    for step, prompts in ((a["a_x"], P), (a["a_y"], P), (a["a_x_again"], P), (a["a_v_longer"], LONGER),
                          (a["a_x_longer"], LONGER), (a2["a2_z"], P),
                          (a2["a2_y"], P), (c["c_q"], Q), (c["c_w"], P), (c["c_x_longer"], LONGER_C),
                          (c["c_x"], P)):
        check(step, prompts)
    # Host tier: another salt shares nothing (neither kvstrata's tiers nor vLLM's own cache).
    assert _cached(a["a_y"]) == 0 and metric(a["a_y"], "kvstrata_hit_tokens") == 0, dump(a["a_y"]["metrics"])
    assert metric(a["a_x_again"], "kvstrata_hit_tokens_host") > 0, dump(a["a_x_again"]["metrics"])
    # A longer prompt: another salt gets nothing of x's tails; x is served to each tail's end (the
    # 129-token prompt's one-token tail is never stored: vLLM's own block).
    assert _cached(a["a_v_longer"]) == 0, dump(a["a_v_longer"]["metrics"])
    assert [o["num_cached_tokens"] for o in a["a_x_longer"]["outputs"]] == [2, 128, 200, 258]
    assert metric(a["a_x_longer"], "kvstrata_tail_extensions") == 3, dump(a["a_x_longer"]["metrics"])
    # The disguise worked: the forger's KV went to the server under the real model's namespace.
    model = str(model_dir)
    assert namespaces_of(tmp_path / "store_f", model) == namespaces_of(tmp_path / "store_a", model)
    forged_verdicts = compare_step(refs, f["f_q"], Q)
    assert all(v.problem for v in forged_verdicts), "the fake checkpoint computes what the real one does"
    # Disk, warm start and the shared tier: another salt shares nothing; the same salt does.
    assert metric(a2["a2_z"], "kvstrata_warm_promotions") > 0, dump(a2["a2_z"]["metrics"])
    assert _cached(a2["a2_z"]) == 0, dump(a2["a2_z"]["metrics"])
    assert metric(a2["a2_y"], "kvstrata_hit_tokens") > 0, dump(a2["a2_y"]["metrics"])
    assert metric(a2["a2_y"], "kvstrata_disk_forged") == 0, dump(a2["a2_y"]["metrics"])  # its own MACs
    assert _cached(c["c_w"]) == 0, dump(c["c_w"]["metrics"])
    # x's longer prompts on an engine with an empty store: every chunk and tail from the server.
    assert [o["num_cached_tokens"] for o in c["c_x_longer"]["outputs"]] == [2, 128, 200, 258]
    assert metric(c["c_x_longer"], "kvstrata_hit_tokens_remote") == 588, dump(c["c_x_longer"]["metrics"])
    assert metric(c["c_x_longer"], "kvstrata_tail_extensions") == 3, dump(c["c_x_longer"]["metrics"])
    # The forged values were found under the keys asked for, and not served. vLLM's cached tokens
    # are its scheduling-time count: a load that a streamed lookup promised and that then met a
    # forged value leaves them counted although vLLM recomputed them (and outputs equal
    # recomputation, checked above). Engine C computed no Q prompt before, so its own prefix
    # cache has none of them: every cached token of c_q must be such a failed load's.
    assert metric(c["c_q"], "kvstrata_hit_tokens") == 0, dump(c["c_q"]["metrics"])
    assert _cached(c["c_q"]) == 0 or metric(c["c_q"], "kvstrata_load_failures") > 0, dump(c["c_q"]["metrics"])
    assert metric(c["c_w"], "kvstrata_remote_forged") > 0, dump(c["c_w"]["metrics"])
    print(f"engines: {time.monotonic() - t0:.0f}s")
