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
from pathlib import Path
from typing import Any

from kvstrata.config import DEFAULT_DISK_BYTES, DEFAULT_HOST_BYTES
from kvstrata.tools import support as ts
from kvstrata.tools.cli import CLIError
from kvstrata.tools.warmup_child import store_totals
from kvstrata.tools.warmup_corpus import validate_corpus

_LOG_TAIL_LINES = 30
_CHILD = "import sys; from kvstrata.tools.warmup_child import child_main; sys.exit(child_main(sys.argv[1:]))"


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
