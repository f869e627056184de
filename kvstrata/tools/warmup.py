"""``kvstrata warmup --model PATH --prompts FILE --store DIR``: fill a store before traffic arrives.

Runs vLLM offline over a JSONL corpus (one ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``
per line), prefill only (one output token), with the kvstrata connector writing the KV to the
store. A server started afterwards on the same store and model serves those prefixes from its
first request.

* **Validation first**: the whole corpus is checked before any work; a bad line is an error that
  names its line number.
* **Resumable, exactly**: before each batch, every prompt's chunk keys are computed the way the
  connector computes them (vLLM's block hashes with the engine's hash function, the connector's
  chunk geometry and namespaces) and looked up in the store with the connector's own lookup rule;
  a prompt whose whole servable prefix is already on disk is skipped. Nothing is recorded besides
  the store itself, so chunks evicted since the last run are simply stored again.
* **Isolated engine**: vLLM runs in a child process (engine core in-process there) whose output
  goes to a log file, so ``--json`` output stays clean and a vLLM crash is reported with the log's
  tail. The parent never imports vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.config import DEFAULT_DISK_BYTES, DEFAULT_HOST_BYTES
from kvstrata.tools import support as ts
from kvstrata.tools.cli import CLIError

_LOG_TAIL_LINES = 30
_CHILD = "import sys; from kvstrata.tools.warmup import child_main; sys.exit(child_main(sys.argv[1:]))"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH", help="model directory (a Hugging Face checkpoint)")
    parser.add_argument("--prompts", required=True, type=Path, metavar="FILE", help="JSONL corpus, one prompt per line")
    parser.add_argument("--store", required=True, type=Path, metavar="DIR", help="store directory (created if missing)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N", help="vLLM max_model_len")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="prompts per engine batch (default 32)")
    parser.add_argument(
        "--disk-budget", type=ts.size_arg, default=DEFAULT_DISK_BYTES, metavar="BYTES",
        help=f"the store's disk budget (default {DEFAULT_DISK_BYTES >> 30} GiB)",
    )
    parser.add_argument(
        "--host-bytes", type=ts.size_arg, default=DEFAULT_HOST_BYTES, metavar="BYTES", help="kvstrata host tier size"
    )
    group = parser.add_argument_group("vLLM options")
    group.add_argument("--kv-cache-memory", type=ts.size_arg, default=None, metavar="BYTES",
                       help="KV cache size, e.g. 2GiB (recommended on CPU; default: vLLM's)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F")
    group.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N")
    group.add_argument("--dtype", default=None)
    group.add_argument("--block-size", type=int, default=None, metavar="N")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N")
    group.add_argument("--max-num-seqs", type=int, default=None, metavar="N")
    group.add_argument("--tokenizer", default=None)
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                       help="skip CUDA graph capture (default: on; prefill-only gains little)")
    group.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other vllm.LLM argument (VALUE parsed as JSON when it parses)")
    group.add_argument("--connector-option", action="append", default=[], metavar="KEY=VALUE",
                       help="a kv_connector_extra_config option (VALUE parsed as JSON when it parses)")
    parser.add_argument("--log", type=Path, default=None, metavar="FILE", help="vLLM's log file (default: a temp file)")


# ---- the corpus ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    line: int
    text: str | None
    token_ids: list[int] | None


class CorpusError(ValueError):
    """A corpus line is not a prompt; the message names the file and line."""


def _parse_line(path: Path, lineno: int, line: str) -> Prompt | None:
    if not line.strip():
        return None
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise CorpusError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise CorpusError(f'{where}: expected exactly one of "prompt" or "prompt_token_ids"')
    if has_text:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise CorpusError(f'{where}: "prompt" must be a non-empty string')
        return Prompt(lineno, text, None)
    ids = obj["prompt_token_ids"]
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        raise CorpusError(f'{where}: "prompt_token_ids" must be a non-empty list of token ids (ints >= 0)')
    return Prompt(lineno, None, ids)


def read_corpus(path: Path) -> Iterator[Prompt]:
    """The prompts of ``path`` in order (streamed); CorpusError on the first bad line."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                prompt = _parse_line(path, lineno, line)
                if prompt is not None:
                    yield prompt
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not UTF-8 text ({exc.reason})") from None


@dataclass(frozen=True)
class CorpusSummary:
    prompts: int
    text_prompts: int


def validate_corpus(path: Path) -> CorpusSummary:
    """Read the whole corpus once; CLIError naming the first bad line."""
    if not path.is_file():
        raise CLIError(f"no prompts file at {path}")
    count = text = 0
    try:
        for prompt in read_corpus(path):
            count += 1
            text += prompt.text is not None
    except CorpusError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not count:
        raise CLIError(f"{path} holds no prompts")
    return CorpusSummary(count, text)


# ---- the parent: validate, run the child, summarise -------------------------------------------


def _kv_option(text: str, flag: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise CLIError(f"{flag} expects KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def _engine_spec(args: argparse.Namespace, skip_tokenizer: bool) -> dict[str, Any]:
    extra = dict(_kv_option(o, "--connector-option") for o in args.connector_option)
    extra.setdefault("disk_bytes", args.disk_budget)
    llm_kwargs: dict[str, Any] = {
        # None lets vLLM choose (derived from the model / gpu_memory_utilization).
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "max_model_len": args.max_model_len,
    }
    for name, value in (
        ("gpu_memory_utilization", args.gpu_memory_utilization),
        ("tensor_parallel_size", args.tensor_parallel_size),
        ("tokenizer", args.tokenizer),
        ("trust_remote_code", args.trust_remote_code or None),
    ):
        if value is not None:
            llm_kwargs[name] = value
    llm_kwargs.update(_kv_option(o, "--vllm-arg") for o in args.vllm_arg)
    return {
        "model": str(args.model),
        "store": str(args.store),
        "host_bytes": args.host_bytes,
        "extra_config": extra,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "skip_tokenizer_init": skip_tokenizer,
        "multiprocess": False,  # the engine core in the child: the store check reaches the connector
        "llm_kwargs": llm_kwargs,
    }


def _check_store_target(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CLIError(f"{path} is not a directory (a store is a directory)")
    if path.is_dir() and any(path.iterdir()):
        ts.check_store_dir(path)  # an existing store, or refuse someone else's directory


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not Path(args.model).exists():
        raise CLIError(f"no model at {args.model}")
    if args.batch_size < 1:
        raise CLIError("--batch-size must be at least 1")
    corpus = validate_corpus(args.prompts)
    _check_store_target(args.store)
    spec = {
        "engine": _engine_spec(args, skip_tokenizer=corpus.text_prompts == 0),
        "prompts_file": str(args.prompts),
        "prompts": corpus.prompts,
        "batch_size": args.batch_size,
    }
    before = store_totals(args.store)
    with tempfile.TemporaryDirectory(prefix="kvstrata-warmup-") as tmp:
        work = Path(tmp)
        log = args.log or work / "vllm.log"
        result = _run_child(spec, work, log, corpus.prompts)
        if result is None:
            tail = _tail(log)
            if tail:
                print(tail, file=sys.stderr)
            where = f"; log: {args.log}" if args.log else ""
            raise CLIError(f"the vLLM engine failed (last lines of its log above){where}")
    return _summary(result, before, store_totals(args.store))


def _child_env() -> dict[str, str]:
    # The user's environment as it is: PYTHONHASHSEED, when set, seeds vLLM's block hashes, and
    # the servers that will read this store run with the user's value.
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run_child(spec: dict[str, Any], work: Path, log: Path, total: int) -> dict[str, Any] | None:
    spec_file, result_file, progress_file = work / "spec.json", work / "result.json", work / "progress.jsonl"
    spec_file.write_text(json.dumps(spec))
    progress_file.touch()
    with open(log, "ab") as log_f, ts.progress(total, "warming up", unit="prompt") as bar:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(spec_file), str(result_file), str(progress_file)],
            stdin=subprocess.DEVNULL, stdout=log_f, stderr=subprocess.STDOUT, env=_child_env(),
        )
        try:
            offset = 0
            while True:
                done = _wait(proc, 0.25)
                offset = _follow(progress_file, offset, bar)
                if done:
                    break
        except BaseException:  # Ctrl-C: let the engine shut down (drain its writes), then kill
            _stop(proc)
            raise
    if proc.returncode != 0 or not result_file.exists():
        return None
    return json.loads(result_file.read_text())


def _wait(proc: subprocess.Popen[bytes], seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    if not _wait(proc, 30):
        proc.kill()
        proc.wait()


def _follow(progress_file: Path, offset: int, bar: Any) -> int:
    with open(progress_file, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1  # whole lines only: the child may be writing one
    for line in chunk[:end].splitlines():
        with contextlib.suppress(ValueError, KeyError):
            msg = json.loads(line)
            if msg["event"] == "batch":
                bar.update(msg["prompts"])
            elif msg["event"] == "status":
                bar.set_description(msg["text"])
    return offset + end


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _summary(r: dict[str, Any], before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    raw, stored = after["raw_bytes"], after["stored_bytes"]
    out = {
        "store": r["store"],
        "prompts": r["prompts"],
        "prompts_skipped_already_stored": r["skipped"],
        "prompts_run": r["run"],
        "prompts_fully_stored": r["fully_stored"],
        "tokens": r["tokens"],
        "tokens_run": r["tokens_run"],
        "chunks": after["entries"],
        "chunks_added": after["entries"] - before["entries"],
        "raw_bytes": raw,
        "stored_bytes": stored,
        "stored_bytes_added": stored - before["stored_bytes"],
        "compression_ratio": round(raw / stored, 4) if stored else None,
        "resume_check": r["resume_check"],
        "engine_start_s": round(r["engine_start_s"], 2),
        "seconds": round(r["seconds"], 2),
    }
    if r["fully_stored"] is not None and r["fully_stored"] < r["prompts"]:
        out["note"] = (
            f"{r['prompts'] - r['fully_stored']} prompt(s) are not fully stored: too short for a "
            "chunk, longer than the budget allows, or evicted by later ones (raise --disk-budget)"
        )
    return out


# ---- the child: the engine, the resume check, the batches ------------------------------------


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
        self.disk = next((t for t in connector.scheduler.hierarchy.tiers if t.tier_name == "disk"), None)
        if self.disk is None:
            raise RuntimeError("the connector runs without its disk tier")
        algo = llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
        self._hash = get_hash_fn_by_name(algo)
        self._hash_block = kv_cache_utils.hash_block_tokens

    def keys(self, ids: Sequence[int]) -> _PromptKeys:
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
            lambda parent, start: self._hash_block(self._hash, parent, ids[start:], None),
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
