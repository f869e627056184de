"""Shared pieces of the end-to-end tests: tiny models, prompts, engine phases, store surgery.

Every engine runs in its own Python process (``kvstrata.tools.jobs.run_job_subprocess``), so a
"restart" is a real one and a crash in vLLM or kvstrata fails one test instead of the session.
The suite forks those processes from a server that imported vLLM once
(``kvstrata/tools/job_forkserver.py``): new processes still, none of which saw an earlier
engine or store.
"""

from __future__ import annotations

import json
import mmap
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from equivalence import (
    EQ_MAX_TOKENS,
    TOP_K,
    Boundaries,
    Verdict,
    compare_step,
    follow_ups,
    prompt_rounds,
    reference_step,
    references_of,
    seeds,
)

from kvstrata.connector.keys import NAMESPACE_BYTES
from kvstrata.tools import models
from kvstrata.tools.engine import EngineOptions
from kvstrata.tools.jobs import run_job_subprocess, run_jobs_subprocess

# Restarts read the store from the device: the page cache is dropped, or the stage fails.
DROP_PAGE_CACHE = {"op": "drop_page_cache", "required": True}
MAX_TOKENS = 12
KV_BYTES = 64 << 20
HOST_BYTES = 256 << 20  # room for every chunk of a round (a full host tier misses)
JOB_TIMEOUT_S = 300.0


def make_prompts(seed: int = 1234) -> list[list[int]]:
    """Three prompts: two unrelated, one sharing the first 1000 tokens of the first.

    Long enough for several 128-token blocks and three 384-token (Qwen3-Next) blocks; random
    token ids well inside the tiny vocabulary.
    """
    rng = random.Random(seed)
    a = [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(1300)]
    b = [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(900)]
    c = a[:1000] + [rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(200)]
    return [a, b, c]


PROMPTS = make_prompts()


def independent_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Independent prompts (no two share a first token's block), so every cached token of a
    fresh engine comes from kvstrata, none from vLLM's own prefix cache."""
    rng = random.Random(seed)
    return [[rng.randrange(3, models.TINY_VOCAB - 8) for _ in range(n)] for n in lengths]


@dataclass(frozen=True)
class Restart:
    """One more restarted engine on a scenario's store, serving the equivalence prompts again:
    ``name`` is its round, ``extra`` its kvstrata options, ``steps`` what runs before the round."""

    name: str
    extra: dict[str, Any] = field(default_factory=dict)
    host_bytes: int = HOST_BYTES
    steps: tuple[dict[str, Any], ...] = ()
    # A store of the round's own (``Scenario.store_of``) rather than the scenario's: written by an
    # engine of the first stage with this round's options (the long prompts, then the first
    # equivalence prompts, each step compared with the recomputation too); the restarted engine
    # serves the long prompts from it before the round.
    own_store: bool = False


@dataclass(frozen=True)
class ModelCase:
    """One architecture under test and the engine settings it needs on CPU."""

    name: str
    build: Callable[[Path, int], Path]  # (directory, seed) -> model directory
    engine: dict[str, Any] = field(default_factory=dict)
    eagle: bool = False
    # vLLM's ``prefix_match_unit``: hash every N tokens, finer than the blocks. With a Mamba-align
    # hybrid that makes hits end inside a block, at the prompt's last N-token boundary (partial
    # tails, docs/SEMANTICS.md R7/R30).
    prefix_match_unit: int | None = None
    # Attention-only layouts (full, sliding window) without a drafter: the prompt's partial last
    # block is stored and served too (semantics.prompt_tail), so a hit covers the whole prompt.
    serves_prompt_tails: bool = False
    # Where this layout's behaviour changes (the equivalence prompts' lengths).
    block: int = 128  # vLLM's CPU default
    # What kvstrata's blocks_per_chunk "auto" makes of this layout (connector/plan.py), where
    # ``extra`` does not set it: one block, except plain full attention on blocks under 64 tokens.
    auto_blocks_per_chunk: int = 1
    window: int | None = None
    mamba: bool = False  # an align-mode Mamba group whose chunk is the block
    # kvstrata options of every kvstrata engine of this case.
    extra: dict[str, Any] = field(default_factory=dict)
    # Restarted engines after the main restart, each serving the equivalence prompts again.
    restarts: tuple[Restart, ...] = ()
    vocab: int = models.TINY_VOCAB

    @property
    def chunk(self) -> int:
        return self.block * int(self.extra.get("blocks_per_chunk", self.auto_blocks_per_chunk))

    @property
    def boundaries(self) -> Boundaries:
        return Boundaries(self.block, self.chunk, self.window,
                          self.block if self.mamba else None, self.prefix_match_unit)

    def options(self, model_dir: Path, store: Path | None, **overrides: Any) -> EngineOptions:
        """Engine options for this case; ``store`` None runs vLLM without kvstrata."""
        engine = dict(self.engine)
        if self.prefix_match_unit is not None:
            engine["llm_kwargs"] = {"prefix_match_unit": self.prefix_match_unit}
        if self.eagle:
            engine["speculative_config"] = {
                "method": "eagle", "model": str(model_dir / "draft"), "num_speculative_tokens": 2}
            model_dir = model_dir / "target"
        extra = {**self.extra, **overrides.pop("extra_config", {})}
        settings: dict[str, Any] = {
            "host_bytes": HOST_BYTES, "kv_cache_memory_bytes": KV_BYTES, "max_model_len": 2048,
            "skip_tokenizer_init": True, **engine, **overrides}
        return EngineOptions(model=str(model_dir), store=None if store is None else str(store),
                             extra_config=extra, **settings)

    def model_path(self, model_dir: Path) -> str:
        return str(model_dir / "target") if self.eagle else str(model_dir)


def _llama_with_eagle(out: Path, seed: int) -> Path:
    models.make_tiny_llama(out / "target", seed=seed)
    models.make_tiny_eagle_draft(out / "target", out / "draft", seed=seed + 1)
    return out


# A host tier too small for a round's prompts: chunks are evicted between requests and come
# from disk again, requests waiting for room to promote them (the smallest host tier kvstrata
# accepts; host_room_wait_s).
TIGHT_HOST = Restart("tight_host", host_bytes=1 << 20)
# Stores into a host tier too small for them: a long prompt's prefill offers more chunks in a
# step than the 1 MiB host tier's 4 slots, so the offer is cut to the room
# (semantics.plan_store_within) and the rest is offered as the request decodes. The round's own
# store holds only what those cut stores wrote; a restarted engine (same tight host tier) serves
# it.
CUT_STORES = Restart("cut_stores", host_bytes=1 << 20, own_store=True)
# Warm start after a restart: the chunks used last are promoted in the background while the
# engine is idle; the round starts once they landed (waited for, not slept through), so it is
# served from the host tier.
WARM_START = Restart("warm_start", {"warm_start_bytes": HOST_BYTES},
                     steps=({"op": "wait_warm_start", "timeout_s": JOB_TIMEOUT_S},))
# Disk reads in processes of the disk tier's own (read_processes: "auto" starts them only on
# accelerators): a restarted engine, its host tier empty, so the round's chunks come from disk
# through them.
READ_PROCESSES = Restart("read_processes", {"read_processes": 2})
# Asynchronous loads on a one-group model (CPU engines load synchronously by default,
# accelerators asynchronously): the request waits for its load to be reported, then runs.
ASYNC_LOADS = Restart("async_loads", {"sync_loads": False})

# vLLM's dtype "auto" runs a float32 checkpoint in bf16 (KV cache included), where the KV a
# forward writes depends on the batch around it (kernel tiles): float32 keeps the comparison with
# a recomputation at the 1e-6 level (equivalence.TOLERANCE is 1e-4).
FP32 = {"dtype": "float32"}
# Qwen3-Next: one sequence per step, prefill chunks of one 384-token block (CASES below).
QWEN3_NEXT_ENGINE = {"max_num_batched_tokens": 384, "max_num_seqs": 1, "block_size": 384}

CASES: dict[str, ModelCase] = {
    "llama": ModelCase("llama", lambda d, s: models.make_tiny_llama(d, seed=s), engine=FP32,
                       serves_prompt_tails=True,
                       restarts=(TIGHT_HOST, CUT_STORES, WARM_START, ASYNC_LOADS, READ_PROCESSES)),
    # Under vLLM's default kv_load_failure_policy ("fail") kvstrata does not stream: every chunk
    # is read and verified before a hit is answered, so the corrupt record is a plain miss.
    # Chunks of two blocks, and decoded tokens stored too (multi-turn follow-ups reuse them).
    "llama_verify_first": ModelCase("llama_verify_first", lambda d, s: models.make_tiny_llama(d, seed=s),
                                    engine={**FP32, "kv_load_failure_policy": "fail"},
                                    serves_prompt_tails=True,
                                    extra={"blocks_per_chunk": 2, "offload_prompt_only": False}),
    # A GPU's chunking on CPU: 32-token blocks, so blocks_per_chunk "auto" (the default) stores
    # 64-token chunks of two blocks; every boundary of the equivalence prompts moves with it.
    # And a GPU's writes: framed in processes of the disk tier's own (write_processes "auto"
    # starts them only on accelerators), so its disk rounds serve what they framed.
    "llama_auto_chunks": ModelCase("llama_auto_chunks", lambda d, s: models.make_tiny_llama(d, seed=s),
                                   engine={**FP32, "block_size": 32}, serves_prompt_tails=True,
                                   block=32, auto_blocks_per_chunk=2, extra={"write_processes": 2}),
    "gemma3": ModelCase("gemma3", lambda d, s: models.make_tiny_gemma3(d, seed=s), engine=FP32,
                        serves_prompt_tails=True, window=64, restarts=(TIGHT_HOST, CUT_STORES)),
    # GDN blocks are storable only when prefill chunks end on the 384-token block. One sequence
    # per step: CPU GDN runs only in bf16, where a request's numerics depend on what else is in
    # its batch; a reloaded request batched differently from its cold run then flips greedy
    # near-ties (top-2 logprobs one bf16 step apart were seen). Alone, both runs compute the same
    # chunks and are bit-identical, so any difference is kvstrata's. The block is set: vLLM
    # sizes a hybrid model's block to its Mamba state's page, which depends on the CPU (384
    # tokens on the AVX-512 bf16 VMs; an AVX2-only one served multiples of 256), and every
    # boundary here is the block's.
    "qwen3_next": ModelCase("qwen3_next", lambda d, s: models.make_tiny_qwen3_next(d, seed=s),
                            engine=QWEN3_NEXT_ENGINE, block=384, mamba=True),
    # The same with 128-token hashes: the state at each prompt's last 128-token boundary is stored
    # from the scheduler's copy-on-write hand-off and served, up to 383 tokens more per prompt.
    "qwen3_next_tails": ModelCase("qwen3_next_tails", lambda d, s: models.make_tiny_qwen3_next(d, seed=s),
                                  engine=QWEN3_NEXT_ENGINE, prefix_match_unit=128, block=384, mamba=True),
    "llama_eagle": ModelCase("llama_eagle", _llama_with_eagle, engine=FP32, eagle=True),
}


# ------------------------------------------------------------------------------------------
# Engine phases
# ------------------------------------------------------------------------------------------


def generate_step(name: str, prompts: list[list[int]] = PROMPTS,
                  max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": prompts, "max_tokens": max_tokens,
            "logprobs": TOP_K}


def run_phase(opts: EngineOptions, steps: list[dict[str, Any]], log: Path) -> dict[str, dict[str, Any]]:
    """Run ``steps`` in a new engine process; the steps by name."""
    result = run_job_subprocess({"engine": asdict(opts), "steps": steps},
                                timeout_s=JOB_TIMEOUT_S, log_path=log)
    return steps_by_name(result)


def steps_by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in result["steps"]}


def _merged(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The steps of several jobs (one process) by name."""
    return {name: step for r in results for name, step in steps_by_name(r).items()}


def token_ids(step: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in step["outputs"]]


def metric(step: dict[str, Any], name: str) -> float:
    """A metric delta of a step; kvstrata's connector stats are ``kvstrata_<counter>``."""
    return float(step["metrics"].get(f"vllm:{name}", 0.0))


def kvstrata_hits(step: dict[str, Any]) -> float:
    return metric(step, "kvstrata_hit_tokens")


def _stage(fn: Callable[[Scenario], Any]) -> property:
    """A stage that runs once: its result, or its failure, is remembered for later tests."""

    def get(self: Scenario) -> Any:
        name = fn.__name__
        if name not in self._done:
            try:
                self._done[name] = fn(self)
            except Exception as exc:  # later tests re-raise it rather than re-run the engines
                self._done[name] = exc
        result = self._done[name]
        if isinstance(result, Exception):
            raise RuntimeError(f"stage {name} failed earlier: {result}") from result
        return result

    return property(get)


class Scenario:
    """One model through the whole story, each stage run once, in order, when first needed.

    1. ``first``: cold, ``reset_prefix_cache()``, the same prompts again (host tier); then the
       equivalence prompts likewise (``equivalence.prompt_rounds``); and, for a restart with a
       store of its own, an engine writing that store;
    2. ``restart``: a new process on the same store (disk tier), the equivalence prompts and
       their follow-ups again; then each of the case's ``restarts`` (one more engine each);
    3. ``corrupted``: one record's payload bytes flipped in ``data.mdb``, then a new process;
    4. ``foreign``: then, in that process, another model (same architecture, other weights: other
       fingerprint, the same chunk keys) on that store.

    The processes of stages 1 and 2 first run the same engine without kvstrata on every prompt,
    each on its own: ``verdicts(round)`` compares what kvstrata served with that recomputation.
    """

    def __init__(self, case: ModelCase, root: Path) -> None:
        self.case = case
        self.root = root
        self.store = root / "store"
        self.model_dir = case.build(root / "model", 0)
        self.opts = case.options(self.model_dir, self.store)
        self.reference_opts = case.options(self.model_dir, None)
        self.eq = prompt_rounds(case.boundaries, case.vocab, seeds())
        self._done: dict[str, Any] = {}
        # Per restart with a store of its own: where each chunk ends (its last block's index) of
        # each long prompt (PROMPTS) in its most complete group that the first stage's engine
        # wrote there.
        self.written: dict[str, list[list[int]]] = {}

    @property
    def rounds(self) -> list[str]:
        """The served rounds (steps compared with the recomputation), in the order they ran."""
        return ["cold", "host", "disk", *(r.name for r in self.case.restarts), "after_corruption"]

    def _log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def log_text(self, name: str) -> str:
        """The engine output (vLLM's and kvstrata's logging) of one stage's process."""
        return self._log(name).read_text(errors="replace")

    def _eq_step(self, name: str, prompts: list[list[int]]) -> dict[str, Any]:
        return generate_step(f"eq_{name}", prompts, EQ_MAX_TOKENS)

    def store_of(self, restart: Restart) -> Path:
        return self.root / f"store-{restart.name}" if restart.own_store else self.store

    def _restart_options(self, restart: Restart) -> EngineOptions:
        return self.case.options(self.model_dir, self.store_of(restart), extra_config=restart.extra,
                                 host_bytes=restart.host_bytes)

    def _own_store(self, name: str) -> bool:
        return any(r.own_store and r.name == name for r in self.case.restarts)

    @_stage
    def first(self) -> dict[str, dict[str, Any]]:
        eq = self.eq
        reference = {"engine": asdict(self.reference_opts), "steps": [
            reference_step("ref", PROMPTS, MAX_TOKENS),
            reference_step("ref_eq", eq.first + eq.second, EQ_MAX_TOKENS)]}
        served = {"engine": asdict(self.opts), "steps": [
            generate_step("cold"), {"op": "reset_prefix_cache"}, generate_step("host"),
            self._eq_step("cold", eq.first), {"op": "reset_prefix_cache"},
            self._eq_step("host", eq.second)]}
        own = [r for r in self.case.restarts if r.own_store]
        stores = [{"engine": asdict(self._restart_options(r)), "steps": [
            generate_step(f"{r.name}_writing"), self._eq_step(f"{r.name}_writing", eq.first)]}
            for r in own]
        steps = _merged(run_jobs_subprocess([reference, served, *stores], timeout_s=JOB_TIMEOUT_S,
                                            log_path=self._log("first")))
        model = self.case.model_path(self.model_dir)
        for r in own:  # before a restarted engine computes (and stores) what they did not
            self.written[r.name] = [stored_blocks_of_prompt(self.store_of(r), model, p) for p in PROMPTS]
        return steps

    @property
    def follow_ups(self) -> list[tuple[list[int], int]]:
        """Multi-turn follow-ups of the first round, with the length of their first turn."""
        return follow_ups(self.eq.first, token_ids(self.first["eq_cold"]), self.case.vocab)

    def round_prompts(self, name: str) -> list[list[int]]:
        """The prompts of equivalence step ``eq_<name>`` (``<round>_follow_ups``: the follow-ups,
        after the round's own step and a prefix-cache reset, so that vLLM's device cache holds
        none of their first turns)."""
        if name == "cold" or name.endswith("_writing"):
            return self.eq.first
        if name.endswith("_follow_ups"):
            return [p for p, _ in self.follow_ups]
        return self.eq.second

    def _restart_steps(self, name: str) -> list[dict[str, Any]]:
        return [self._eq_step(name, self.eq.second), {"op": "reset_prefix_cache"},
                self._eq_step(f"{name}_follow_ups", self.round_prompts(f"{name}_follow_ups"))]

    @_stage
    def restart(self) -> dict[str, dict[str, Any]]:
        _ = self.first  # stages run in order
        reference = {"engine": asdict(self.reference_opts), "steps": [
            reference_step("ref_follow_ups", [p for p, _ in self.follow_ups], EQ_MAX_TOKENS)]}
        served = {"engine": asdict(self.opts), "steps": [
            DROP_PAGE_CACHE, generate_step("disk"), *self._restart_steps("disk")]}
        more = [{"engine": asdict(self._restart_options(r)),
                 "steps": [DROP_PAGE_CACHE, *r.steps, *([generate_step(r.name)] if r.own_store else []),
                           *self._restart_steps(r.name)]}
                for r in self.case.restarts]
        return _merged(run_jobs_subprocess([reference, served, *more], timeout_s=JOB_TIMEOUT_S,
                                           log_path=self._log("restart")))

    @property
    def references(self) -> dict[tuple[int, ...], dict[str, Any]]:
        first, restart = self.first, self.restart
        return references_of([
            (PROMPTS, first["ref"]), (self.eq.first + self.eq.second, first["ref_eq"]),
            ([p for p, _ in self.follow_ups], restart["ref_follow_ups"])])

    def step(self, name: str) -> dict[str, Any]:
        """A served step of any stage by name (``cold``, ``eq_disk``, ``after_corruption``...)."""
        if name == "after_corruption":
            return self.corrupted[1][name]
        return self.first[name] if name in self.first else self.restart[name]

    def verdicts(self, name: str) -> list[Verdict]:
        """Round ``name`` against the recomputation: the long prompts' step of that name (where
        there is one) and its equivalence step."""
        refs = self.references
        out: list[Verdict] = []
        if name in ("cold", "host", "disk", "after_corruption") or self._own_store(name):
            out += compare_step(refs, self.step(name), PROMPTS)
        if self._own_store(name):  # the steps that wrote its store
            out += compare_step(refs, self.step(f"{name}_writing"), PROMPTS)
            out += compare_step(refs, self.step(f"eq_{name}_writing"), self.round_prompts(f"{name}_writing"))
        if name != "after_corruption":
            out += compare_step(refs, self.step(f"eq_{name}"), self.round_prompts(name))
        if name not in ("cold", "host", "after_corruption"):
            follow = f"{name}_follow_ups"
            out += compare_step(refs, self.step(f"eq_{follow}"), self.round_prompts(follow))
        return out

    @_stage
    def _last_process(self) -> tuple[bytes, dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        # Stages 3 and 4 share one process (one engine after the other; the first one's shutdown
        # closes the store): each still opens the store fresh, and the suite saves an import.
        _ = self.restart  # stages run in order
        key = corrupt_one_record(self.store, self.case.model_path(self.model_dir), PROMPTS[0])
        other = self.case.options(self.case.build(self.root / "other-model", 1), self.store)
        corrupted, foreign = run_jobs_subprocess(
            [{"engine": asdict(self.opts), "steps": [generate_step("after_corruption")]},
             {"engine": asdict(other), "steps": [generate_step("foreign")]}],
            timeout_s=JOB_TIMEOUT_S, log_path=self._log("corrupted-then-foreign"))
        return key, steps_by_name(corrupted), steps_by_name(foreign)

    @property
    def corrupted(self) -> tuple[bytes, dict[str, dict[str, Any]]]:
        key, steps, _ = self._last_process
        return key, steps

    @property
    def foreign(self) -> dict[str, dict[str, Any]]:
        return self._last_process[2]


# ------------------------------------------------------------------------------------------
# Store inspection and surgery
# ------------------------------------------------------------------------------------------


def namespaces_of(store: Path, model: str) -> set[bytes]:
    from kvstrata.tiers.disk import DiskStore

    with DiskStore(store, budget_bytes=1 << 40, readonly=True, create=False) as disk:
        return {ns for ns, info in disk.namespaces().items() if info.get("model") == model}


def store_keys(store: Path, namespaces: set[bytes]) -> set[bytes]:
    """Store keys (namespace + chunk key) stored under ``namespaces``."""
    from kvstrata.tiers.disk import DiskStore

    with DiskStore(store, budget_bytes=1 << 40, readonly=True, create=False) as disk:
        return {k for k, _ in disk.iter_index() if k[:NAMESPACE_BYTES] in namespaces}


def chain_hashes(tokens: list[int], block: int) -> list[bytes]:
    """vLLM's sha256 prefix-cache block hashes of ``tokens`` at ``block`` tokens per hash."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    saved = os.environ.pop("PYTHONHASHSEED", None)  # the engines run without it (child_env)
    try:
        kv_cache_utils.init_none_hash(sha256)
    finally:
        if saved is not None:
            os.environ["PYTHONHASHSEED"] = saved
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // block):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i * block:(i + 1) * block])
        out.append(bytes(parent))
    return out


def records_of_prompt(store: Path, model: str, prompt: list[int]) -> list[bytes]:
    """Store keys of ``prompt``'s chunks in its most complete group, in prefix order."""
    return [key for _, key in _stored_chunks(store, model, prompt)]


def stored_blocks_of_prompt(store: Path, model: str, prompt: list[int]) -> list[int]:
    """Where each of those chunks ends: the index of its last block in ``prompt``, in order."""
    return [block for block, _ in _stored_chunks(store, model, prompt)]


def _stored_chunks(store: Path, model: str, prompt: list[int]) -> list[tuple[int, bytes]]:
    """(last block index, store key) of ``prompt``'s chunks in its most complete group.

    The hash granularity is found by trying the block sizes vLLM can use; a chunk key is the
    block hash ending the chunk followed by the 4-byte group index.
    """
    spaces = namespaces_of(store, model)
    assert spaces, f"no namespace registered for {model}"
    stored = store_keys(store, spaces)
    best: list[tuple[int, bytes]] = []
    for block in (16, 32, 64, 128, 256, 384, 512):
        order = {h: i for i, h in enumerate(chain_hashes(prompt, block))}
        by_group: dict[bytes, list[tuple[int, bytes]]] = {}
        for key in stored:
            suffix = key[NAMESPACE_BYTES:]
            if suffix[:-4] in order:
                by_group.setdefault(suffix[-4:], []).append((order[suffix[:-4]], key))
        for chunks in by_group.values():
            if len(chunks) > len(best):
                best = sorted(chunks)
    return best


def corrupt_one_record(store: Path, model: str, prompt: list[int]) -> bytes:
    """Flip payload bytes of one stored chunk of ``prompt`` directly in ``data.mdb``.

    The record in the middle of the prompt's prefix is chosen, so a lookup must load the chunks
    before it and stop at it. The bytes are found by content and flipped in the file, leaving
    LMDB's own structures intact: exactly what bit rot on the device would look like.
    """
    import lmdb

    from kvstrata.tiers.records import DB_PAYLOAD

    keys = records_of_prompt(store, model, prompt)
    assert len(keys) >= 2, f"expected several stored chunks of the prompt, found {len(keys)}"
    key = keys[len(keys) // 2]
    env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin() as txn:
            db = env.open_db(DB_PAYLOAD, txn=txn, create=False)
            value = bytes(txn.get(key, db=db))
    finally:
        env.close()
    middle = len(value) // 2
    needle = value[middle:middle + 64]
    path = store / "data.mdb"
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        offset = mm.find(needle)
        assert offset >= 0, "the record's payload bytes are not in data.mdb"
        # A freed page may still hold an older copy of them (LMDB copies pages on write): flip
        # every copy, so the live one is hit whichever it is.
        while offset >= 0:
            mm[offset:offset + 16] = bytes(b ^ 0xFF for b in mm[offset:offset + 16])
            offset = mm.find(needle, offset + 1)
        mm.flush()
    return key


def read_record(store: Path, key: bytes) -> tuple[bool, int | None, int]:
    """(key present, bytes decoded or None, corrupt records seen) through ``DiskStore``."""
    from kvstrata.tiers.disk import DiskStore

    with DiskStore(store, budget_bytes=1 << 40, readonly=True, create=False) as disk:
        records = dict(disk.iter_index())
        rec = records.get(key)
        if rec is None:
            return False, None, 0
        got = disk.get_into(key, bytearray(rec.raw_len))
        return True, got, int(disk.stats().get("corrupt", 0))


def dump(obj: Any) -> str:
    """Compact JSON of a step's metrics for assertion messages."""
    return json.dumps({k: v for k, v in obj.items() if v}, sort_keys=True)
