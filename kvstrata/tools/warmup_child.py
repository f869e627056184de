"""The engine side of ``kvstrata warmup`` (a child process, so the parent never imports vLLM and
a vLLM crash is reported with its log): the engine, the exact resume check (is a prompt's whole
servable prefix on disk already?), the batches, and the store's totals.

Run as ``child_main([spec.json, result.json, progress.jsonl])``; progress is JSON lines.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.tools import support as ts
from kvstrata.tools.warmup_corpus import Prompt, read_corpus


@dataclass(frozen=True)
class _PromptKeys:
    hashes: list[bytes]  # vLLM's block hashes of the prompt
    chunks: dict[int, list[bytes]]  # group -> chunk keys
    tail: dict[int, bytes] | None  # group -> the prompt's tail key (semantics.prompt_tail)


class _StoredCheck:
    """Is a prompt's whole servable prefix on disk? Computed the way the connector does it."""

    def __init__(self, llm: Any) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        connector = core.scheduler.connector
        self.plan = connector.plan
        disk = next((t for t in connector.scheduler.hierarchy.tiers if t.tier_name == "disk"), None)
        if disk is None:
            raise RuntimeError("the connector runs without its disk tier")
        self.disk = disk
        algo = llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
        self._hash = get_hash_fn_by_name(algo)
        self._hash_block = kv_cache_utils.hash_block_tokens

    def keys(self, ids: Sequence[int]) -> _PromptKeys:
        from vllm.v1.core.kv_cache_utils import BlockHash

        from kvstrata import semantics

        tph = self.plan.tokens_per_hash
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(ids) - tph + 1, tph):
            parent = self._hash_block(self._hash, parent, ids[start : start + tph], None)
            hashes.append(bytes(parent))
        layout = self.plan.layout
        chunks = {g.index: semantics.chunk_keys(hashes, g) for g in layout.groups}
        # Plain token prompts: no LoRA, multimodal or salt extra keys.
        tail = semantics.prompt_tail_keys(
            layout, hashes, len(ids),
            lambda parent, start: self._hash_block(
                self._hash, None if parent is None else BlockHash(parent), ids[start:], None),
        )
        return _PromptKeys(hashes, chunks, tail)

    def _hit(self, ids: Sequence[int], keys: _PromptKeys, store: Any | None) -> int:
        from kvstrata import semantics
        from kvstrata.presence import Presence

        namespaces = self.plan.namespaces

        def probe(batch: Any) -> list[Presence]:
            batch = list(batch)
            if store is None:  # what a complete store would serve
                return [Presence.HIT] * len(batch)
            # Servable only when every rank's shard is on disk.
            found = store.contains_many([ns + k for k in batch for ns in namespaces])
            n = len(namespaces)
            return [
                Presence.HIT if all(found[i * n : (i + 1) * n]) else Presence.MISS
                for i in range(len(batch))
            ]

        layout = self.plan.layout
        hit = semantics.lookup_hit(
            layout, num_tokens=len(ids), local_computed=0, keys=keys.chunks, probe=probe
        )
        hit, _ = semantics.partial_tail_hit(
            layout, complete_hit=hit, num_prompt_tokens=len(ids), local_computed=0,
            block_hashes=keys.hashes, probe=probe, keys=keys.chunks,
        )
        hit = semantics.prompt_tail_hit(
            layout, complete_hit=hit, num_tokens=len(ids), num_prompt_tokens=len(ids), local_computed=0,
            tail_keys=keys.tail, probe=probe,
        )
        return hit or 0

    def fully_stored(self, ids: Sequence[int], keys: _PromptKeys, store: Any) -> bool:
        best = self._hit(ids, keys, None)
        return best > 0 and self._hit(ids, keys, store) >= best


def _tokenize(llm: Any, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids exactly as vLLM makes them from a text prompt (its renderer's own path)."""
    texts = [p for p in prompts if p.text is not None]
    by_line: dict[int, list[int]] = {}
    if texts:
        try:
            renderer = llm.llm_engine.renderer
            dict_prompts = renderer.render_prompts([{"prompt": p.text} for p in texts])
            tok = renderer.tokenize_prompts(dict_prompts, renderer.default_cmpl_tok_params)
            ids = [list(t["prompt_token_ids"]) for t in tok]
        except (AttributeError, TypeError, KeyError):  # renderer API moved: the tokenizer's default
            tokenizer = llm.get_tokenizer()
            ids = [list(tokenizer.encode(p.text)) for p in texts]
        by_line = {p.line: i for p, i in zip(texts, ids, strict=True)}
    return [p.token_ids if p.token_ids is not None else by_line[p.line] for p in prompts]


def _batches(path: Path, size: int) -> Iterator[list[Prompt]]:
    batch: list[Prompt] = []
    for prompt in read_corpus(path):
        batch.append(prompt)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _totals(stats: dict[str, Any]) -> dict[str, int]:
    return {k: int(stats[k]) for k in ("entries", "raw_bytes", "stored_bytes")}


def child_main(argv: list[str]) -> int:
    """The engine side: ``spec.json result.json progress.jsonl``."""
    spec_file, result_file, progress_file = (Path(a) for a in argv)
    spec = json.loads(spec_file.read_text())

    def say(event: str, **fields: Any) -> None:
        with open(progress_file, "a") as f:
            f.write(json.dumps({"event": event, **fields}) + "\n")

    t0 = time.perf_counter()
    say("status", text="starting vLLM")
    from kvstrata.tools.engine import EngineOptions, build_llm, generate, shutdown_llm

    opts = EngineOptions.from_dict(spec["engine"])
    llm = build_llm(opts)
    t_engine = time.perf_counter() - t0
    say("status", text="warming up")
    try:
        check: _StoredCheck | None = _StoredCheck(llm)
        resume = "exact"
    except Exception as exc:  # vLLM internals moved: run everything rather than guess
        check, resume = None, f"unavailable ({type(exc).__name__}: {exc}); every prompt was run"
    tokens = tokens_run = skipped = run = 0
    pending: list[tuple[list[int], _PromptKeys | None]] = []
    try:
        for batch in _batches(Path(spec["prompts_file"]), int(spec["batch_size"])):
            ids = _tokenize(llm, batch)
            todo: list[list[int]] = []
            for prompt_ids in ids:
                tokens += len(prompt_ids)
                keys = check.keys(prompt_ids) if check else None
                if check and keys and check.fully_stored(prompt_ids, keys, check.disk):
                    skipped += 1
                    continue
                todo.append(prompt_ids)
                pending.append((prompt_ids, keys))
            if todo:
                generate(llm, todo, max_tokens=1)
                run += len(todo)
                tokens_run += sum(map(len, todo))
            say("batch", prompts=len(batch))
    finally:
        say("status", text="flushing to disk")
        shutdown_llm(llm)  # drains the connector's write-behind
        if check is not None:
            check.disk.close()  # idempotent: the store is marked cleanly closed
    fully = None
    if check is not None:
        from kvstrata.tiers.disk import DiskStore

        # The connector's environment is closed now: opening the store again here is safe.
        assert opts.store is not None  # the check found the connector's disk tier
        with DiskStore(opts.store, budget_bytes=ts.UNLIMITED, readonly=True) as store:
            fully = skipped + sum(k is not None and check.fully_stored(i, k, store) for i, k in pending)
    result = {
        "store": opts.store,
        "prompts": skipped + run,
        "skipped": skipped,
        "run": run,
        "fully_stored": fully,
        "tokens": tokens,
        "tokens_run": tokens_run,
        "resume_check": resume,
        "engine_start_s": t_engine,
        "seconds": time.perf_counter() - t0,
    }
    tmp = result_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_file)
    return 0


def store_totals(path: Path) -> dict[str, int]:
    """Chunks and bytes of the store at ``path`` (zeros when there is none yet)."""
    if not (path / "data.mdb").is_file():
        return {"entries": 0, "raw_bytes": 0, "stored_bytes": 0}
    store = ts.open_store(path, readonly=True)
    try:
        return _totals(store.stats())
    finally:
        store.close()
