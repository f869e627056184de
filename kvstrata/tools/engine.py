"""Run a real vLLM engine with kvstrata in this process: its options, the ``kv_transfer_config``
that loads kvstrata, generation, metrics, a clean shutdown, and a summary of a store.

Shared by ``kvstrata demo``, ``kvstrata warmup``, the benchmarks and the end-to-end tests;
``jobs`` runs these as jobs, in this process or in a fresh one (a real restart).

vLLM is imported lazily (inside the functions), so the parent of a subprocess job never pays for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

# Engine counters a caller may want per step (deltas): vLLM's own prefix-cache accounting
# (per tier), its speculative-decoding counts, and every kvstrata counter/gauge
# (``vllm:kvstrata_*``).
_VLLM_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
_KVSTRATA_PREFIX = "vllm:kvstrata_"

ProgressFn = Callable[[str], None]


@dataclass
class EngineOptions:
    """Everything needed to build one ``vllm.LLM``; JSON-serialisable (``asdict``)."""

    model: str
    # kvstrata store directory; None runs vLLM without kvstrata (a baseline, or another connector
    # passed as ``llm_kwargs["kv_transfer_config"]``).
    store: str | None = None
    host_bytes: int = 256 << 20
    # Further ``kv_connector_extra_config`` keys (kvstrata.config.StrataConfig).
    extra_config: dict[str, Any] = field(default_factory=dict)
    # vLLM's kv_load_failure_policy for kvstrata: "recompute" streams disk hits, "fail" (vLLM's
    # default) makes kvstrata verify every chunk before it answers a hit.
    kv_load_failure_policy: str = "recompute"
    kv_cache_memory_bytes: int = 256 << 20
    max_model_len: int = 8192
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    enforce_eager: bool = True
    skip_tokenizer_init: bool = False
    speculative_config: dict[str, Any] | None = None
    distributed_executor_backend: str | None = None
    # False runs the engine core in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which
    # starts several times faster. True is vLLM's default: the engine core in its own process.
    multiprocess: bool = False
    seed: int = 0
    # vLLM's KVEventsConfig fields (e.g. {"enable_kv_cache_events": true, "publisher": "zmq",
    # "endpoint": ...}); ``LLM`` takes only the config object for it.
    kv_events_config: dict[str, Any] | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineOptions:
        return cls(**data)


def strata_transfer_config(store: str | os.PathLike[str] | None, *, host_bytes: int,
                           kv_load_failure_policy: str = "recompute",
                           **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` that loads kvstrata (the same dict a user passes).

    ``kv_load_failure_policy="recompute"`` (the default here): a cache load that fails (a record
    found corrupt once its load began) recomputes the request instead of failing it, and lets
    kvstrata stream disk hits (``stream_loads``).
    """
    options: dict[str, Any] = {"host_bytes": host_bytes, **extra}
    if store is not None:
        options["store_path"] = str(store)
    return {
        "kv_connector": "StrataConnector",
        "kv_connector_module_path": "kvstrata.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": kv_load_failure_policy,
        "kv_connector_extra_config": options,
    }


def build_llm(opts: EngineOptions) -> LLM:
    """A ``vllm.LLM`` for ``opts``. Sets the multiprocessing switch before vLLM reads it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if opts.multiprocess else "0"
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": opts.model,
        "enforce_eager": opts.enforce_eager,
        "kv_cache_memory_bytes": opts.kv_cache_memory_bytes,
        "max_model_len": opts.max_model_len,
        "skip_tokenizer_init": opts.skip_tokenizer_init,
        "seed": opts.seed,
        # Per-request first-token latency and the prefix-cache/connector counters need stats.
        "disable_log_stats": False,
        # Stored KV is found again only if block hashes are identical in every process.
        "prefix_caching_hash_algo": "sha256",
        "enable_prefix_caching": True,
    }
    if opts.store is not None:
        kwargs["kv_transfer_config"] = strata_transfer_config(
            opts.store, host_bytes=opts.host_bytes,
            kv_load_failure_policy=opts.kv_load_failure_policy, **opts.extra_config)
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "dtype",
                 "speculative_config", "distributed_executor_backend"):
        value = getattr(opts, name)
        if value is not None:
            kwargs[name] = value
    if opts.kv_events_config is not None:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**opts.kv_events_config)
    kwargs.update(opts.llm_kwargs)
    return LLM(**kwargs)


@dataclass
class Completion:
    """One request's result."""

    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    # Arrival to first token, measured by the engine (includes kvstrata lookups and loads).
    ttft_s: float | None
    num_cached_tokens: int
    # The first generated token's top log-probabilities, ``[[token_id, logprob], ...]`` best
    # first, when asked for (``logprobs``).
    first_logprobs: list[list[float]] | None = None
    # Prompt tokens kvstrata served this request, by tier (``{"host": n, "disk": m}``; empty when
    # it served none). ``num_cached_tokens`` adds vLLM's own prefix-cache hits to these.
    served: dict[str, int] = field(default_factory=dict)


def generate(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int, *,
             cache_salt: str | Sequence[str | None] | None = None, ignore_eos: bool = True,
             kv_transfer_params: dict[str, Any] | None = None,
             logprobs: int | None = None) -> list[Completion]:
    """Greedy generation of ``max_tokens`` tokens for each token-id prompt (one batch).

    ``cache_salt`` enters the first block's hash, so salted prompts share no KV with unsalted or
    differently salted ones: it makes a "cold" request cold on a store that saw the prompt before.
    One salt for all prompts, or one per prompt (each prompt then computed on its own).
    ``kv_transfer_params`` go to the connector per request (e.g. ``{"max_load_tokens": 0,
    "max_offload_tokens": 0}`` keeps a request away from kvstrata entirely). ``logprobs``: report
    the first token's top ``logprobs`` log-probabilities (``Completion.first_logprobs``).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstrata.connector.request_state import SERVED_PARAM

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            detokenize=not llm.llm_engine.model_config.skip_tokenizer_init,
                            logprobs=logprobs,
                            extra_args={"kv_transfer_params": kv_transfer_params}
                            if kv_transfer_params else None)
    salts = ([cache_salt] * len(prompts) if cache_salt is None or isinstance(cache_salt, str)
             else list(cache_salt))
    if len(salts) != len(prompts):
        raise ValueError(f"{len(salts)} cache salts for {len(prompts)} prompts")
    requests = []
    for p, salt in zip(prompts, salts, strict=True):
        request = TokensPrompt(prompt_token_ids=list(p))
        if salt:
            request["cache_salt"] = salt
        requests.append(request)
    outs = llm.generate(requests, params, use_tqdm=False)
    result = []
    for out in outs:
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        completion = out.outputs[0]
        first = completion.logprobs[0] if logprobs and completion.logprobs else None
        result.append(Completion(
            token_ids=list(completion.token_ids),
            text=completion.text if completion.text else None,
            prompt_tokens=len(out.prompt_token_ids or ()),
            ttft_s=float(ttft) if ttft else None,
            num_cached_tokens=int(out.num_cached_tokens or 0),
            first_logprobs=None if first is None else sorted(
                ([int(t), float(lp.logprob)] for t, lp in first.items()), key=lambda e: -e[1]),
            served={str(t): int(n) for t, n in ((out.kv_transfer_params or {}).get(SERVED_PARAM) or {}).items()},
        ))
    return result


@dataclass
class MetricsSnapshot:
    """Cache metric values (``name`` or ``name{source=...}``) and which of them are gauges."""

    values: dict[str, float]
    gauges: set[str]


def metrics_snapshot(llm: LLM) -> MetricsSnapshot:
    """Current values of the cache metrics, vLLM's and kvstrata's.

    Read from vLLM's Prometheus registry in the frontend process, so it works the same whether
    the scheduler lives in this process or another one.
    """
    from vllm.v1.metrics.reader import Counter, Gauge

    snap = MetricsSnapshot({}, set())
    for metric in llm.get_metrics():
        if not isinstance(metric, (Counter, Gauge)):
            continue
        name = metric.name
        if not (name in _VLLM_METRICS or name.startswith(_KVSTRATA_PREFIX)):
            continue
        if "source" in metric.labels:
            name = f"{name}{{source={metric.labels['source']}}}"
        snap.values[name] = snap.values.get(name, 0.0) + float(metric.value)
        if isinstance(metric, Gauge):
            snap.gauges.add(name)
    return snap


def metrics_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, float]:
    """Counters as increments over a step; gauges (tier figures) as their latest value."""
    return {name: value if name in after.gauges else value - before.values.get(name, 0.0)
            for name, value in after.values.items()}


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by this process's threads, by Python thread name (pool threads'
    ``_N`` suffix dropped; threads Python did not start, e.g. OpenMP's, are ``native``), and the
    process's ``io`` counters: where a step's time went (``generate`` steps report deltas)."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("_-") or t.name
             for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(task.name), "native")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("read_bytes", "write_bytes"):
                out[f"io:{key}"] = float(value)
    return out


def drop_page_cache() -> bool:
    """Flush and drop the OS page cache so the next read comes from the device, if permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def shutdown_llm(llm: LLM) -> None:
    """Shut the engine down now (not at interpreter exit): the connector drains its disk writes.

    The scheduler's ``shutdown`` calls the connector's, which flushes write-behind to LMDB; a
    process that exits without it may lose the last stores.
    """
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def store_summary(store: str | os.PathLike[str], model: str | None = None) -> dict[str, Any]:
    """What a kvstrata store holds, read from the store itself (no engine needed).

    Whole-store totals from ``DiskStore.stats()``, plus the entries, tokens and bytes of the
    namespaces (fingerprints) registered for ``model`` when given. Store keys are the 16-byte
    namespace followed by the chunk key (docs/DESIGN.md). Returns ``{"exists": False}`` for a
    directory that holds no store yet.
    """
    from kvstrata.connector.keys import NAMESPACE_BYTES
    from kvstrata.tiers.disk import DiskStore

    if not (Path(store) / "data.mdb").exists():
        return {"exists": False, "path": str(store)}
    with DiskStore(store, budget_bytes=1 << 40, readonly=True, create=False) as disk:
        stats = disk.stats()
        namespaces = disk.namespaces()
        out: dict[str, Any] = {
            "exists": True,
            "path": str(store),
            "entries": stats["entries"],
            "raw_bytes": stats["raw_bytes"],
            "stored_bytes": stats["stored_bytes"],
            "compression_ratio": stats["compression_ratio"],
            "file_bytes": stats["file_bytes"],
            "namespaces": len(namespaces),
        }
        if model is None:
            return out
        mine = {ns: info for ns, info in namespaces.items() if info.get("model") == str(model)}
        entries = raw = stored = 0
        per_group: dict[tuple[bytes, int], int] = {}
        for key, rec in disk.iter_index():
            ns = key[:NAMESPACE_BYTES]
            if ns in mine:
                entries += 1
                raw += rec.raw_len
                stored += rec.stored_len
                per_group[ns, rec.group] = per_group.get((ns, rec.group), 0) + 1
    # A model may have several fingerprints (other settings, other weights at the same path) and
    # one namespace per TP rank of each; count rank 0's. Within a namespace the most complete
    # group (full attention keeps every chunk; windowed and Mamba groups fewer) gives the tokens.
    tokens = 0
    for ns, info in mine.items():
        if int(info.get("tp_rank") or 0) != 0:
            continue
        chunks = max((n for (space, _), n in per_group.items() if space == ns), default=0)
        tokens += chunks * int(info.get("block_size") or 0) * int(info.get("blocks_per_chunk") or 1)
    out["model"] = {"namespaces": len(mine), "entries": entries, "tokens": tokens,
                    "raw_bytes": raw, "stored_bytes": stored,
                    "compression_ratio": raw / stored if stored else 1.0}
    return out
