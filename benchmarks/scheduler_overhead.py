"""What kvstrata's connector costs vLLM's engine loop per step at GPU scale, without a GPU.

On a GPU the forward is short (tens of ms for a decode batch) and vLLM's engine core plans step
N+1 while step N runs (async scheduling, the GPU default): whatever the scheduler side and the
workers' connector hooks add to a step is hidden only while it stays under the forward, and
beyond it the GPU waits. The CPU engine of ``kvstrata bench serve`` cannot show that (its steps
take hundreds of ms). This runs vLLM 0.32.0's real ``AsyncScheduler`` with a GPU's block size
(16 tokens) and batch limits over a multi-round long-context workload, the model's forward
replaced by a sleep (sampled tokens are made up; KV pages hold whatever they held), once without
a connector, once with kvstrata's and once with vLLM's OffloadingConnector (CPU + fs tiers, the
peer of ``kvstrata bench serve``), each with its real worker side over KV tensors in host memory,
and times per step:

* ``schedule_us`` / ``update_us``: ``Scheduler.schedule()`` and ``update_from_output()``, the
  engine core's part of a step (the connector's scheduler hooks run inside them);
* ``connector_us``: of those, the time inside the connector's scheduler hooks
  (``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``request_finished``, ``take_events``), summed per step;
* ``gpu_wait``: what the GPU would have waited for the engine core: with two steps in flight the
  engine core processes step k-1's output and schedules step k+1 while forward k runs, and the
  GPU idles by what those take beyond it (steps that waited, total ms, share of forward time);
* ``worker_us``: the worker-side hooks a model runner calls around its forward
  (``bind_connector_metadata`` .. ``clear_connector_metadata``). Here they include the copies
  themselves (host memory on both sides, synchronous); on a GPU they issue DMA on streams.

and per configuration the prompt tokens the engine computed (``computed_tokens``: what a GPU
would have prefilled) and the tokens the connector served. What kvstrata writes to disk runs on
its own threads in this process, as in the engine core. Prints one JSON object; ratios in it
compare configurations of the same run only.

    .venv/bin/python -m benchmarks.scheduler_overhead --users 64 --prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# "vllm_tiered_fs": vLLM's OffloadingConnector, CPU tier + fs tier (the peer of ``bench serve``).
CONFIGS = ("none", "kvstrata", "vllm_tiered_fs")
# The connector's scheduler-side hooks vLLM's Scheduler calls (KVConnectorBase_V1).
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "take_events")
EOS = 2
HEADS, HEAD, LAYERS = 2, 64, 2  # small pages: the scheduler's cost depends on blocks, not bytes


@dataclass
class Workload:
    users: int
    rounds: int
    system_tokens: int
    prompt_tokens: int
    question_tokens: int
    answer_tokens: int
    arrival_steps: int  # a new user every this many steps
    seed: int

    def first_prompt(self, rng: random.Random, system: list[int]) -> list[int]:
        return system + [rng.randrange(100, 30000) for _ in range(self.prompt_tokens - self.system_tokens)]

    def max_model_len(self) -> int:
        return self.prompt_tokens + self.rounds * (self.question_tokens + self.answer_tokens) + 16


@dataclass
class Timings:
    schedule: list[float] = field(default_factory=list)
    update: list[float] = field(default_factory=list)
    worker: list[float] = field(default_factory=list)
    connector: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    idle_steps: int = 0
    hooks: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def summary(self) -> dict[str, Any]:
        step = [s + u for s, u in zip(self.schedule, self.update, strict=True)]
        out: dict[str, Any] = {"steps": len(step), "idle_steps": self.idle_steps}
        for name, xs in (("schedule_us", self.schedule), ("update_us", self.update),
                         ("engine_core_us", step), ("connector_us", self.connector),
                         ("worker_us", self.worker)):
            out[name] = _stats(xs) if xs else None
        out["connector_hook_s"] = {k: round(v, 4) for k, v in sorted(self.hooks.items())}
        out["gpu_wait"] = self.gpu_wait()
        return out

    def gpu_wait(self) -> dict[str, float]:
        """How long the emulated GPU would have waited for the engine core. With two steps in
        flight (``step_with_batch_queue``), while forward k runs the engine core processes step
        k-1's output and schedules step k+1; the GPU idles by whatever those take beyond forward
        k. ``update[k]`` is step k-1's output (processed after forward k here)."""
        late = [max(0.0, self.update[k] + self.schedule[k + 1] - self.forward[k])
                for k in range(len(self.forward) - 1)]
        busy = sum(self.forward)
        return {"steps": sum(1 for x in late if x > 0), "ms": round(sum(late) * 1e3, 2),
                "share_of_forward": round(sum(late) / busy, 5) if busy else 0.0}


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"mean": round(statistics.fmean(s) * 1e6, 1), "p50": round(s[len(s) // 2] * 1e6, 1),
            "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1), "max": round(s[-1] * 1e6, 1)}


def _transfer_config(config: str, args: argparse.Namespace, work: Path) -> Any:
    """The connector of configuration ``config`` (None: no connector), its host tier of
    ``--host-bytes`` and its disk under ``work``."""
    from vllm.config import KVTransferConfig

    from kvstrata.config_values import parse_size

    host = parse_size("--host-bytes", args.host_bytes)
    if config == "kvstrata":
        extra = {"store_path": str(work / "store"), "host_bytes": host, **json.loads(args.kvstrata_config)}
        return KVTransferConfig(kv_connector="StrataConnector", kv_connector_module_path="kvstrata.connector",
                                kv_role="kv_both", kv_connector_extra_config=extra,
                                kv_load_failure_policy="recompute")
    if config == "vllm_tiered_fs":
        from benchmarks.vllm_fs_baseline import fs_transfer_config

        return KVTransferConfig(**fs_transfer_config(str(work / "fs"), cpu_bytes=host,
                                                     **json.loads(args.vllm_offload_config)))
    return None


def _model_dir(path: Path, max_len: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD * 2,
           "intermediate_size": 256, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
           "head_dim": HEAD, "num_hidden_layers": LAYERS, "vocab_size": 32000,
           "max_position_embeddings": max_len, "torch_dtype": "float16", "rms_norm_eps": 1e-5,
           "eos_token_id": EOS, "bos_token_id": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


class Engine:
    """vLLM's real AsyncScheduler (and the configuration's worker-side connector), driven the
    way the engine core drives them with two steps in flight (``step_with_batch_queue``)."""

    def __init__(self, config: str, args: argparse.Namespace, work: Path, timings: Timings) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.forward_context import ForwardContext
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.t = timings
        self.forward_ms = args.forward_ms
        self.forward_us_per_token = args.forward_us_per_token
        max_len = args.workload.max_model_len()
        model = ModelConfig(model=str(_model_dir(work / "model", max_len)), dtype="float16", seed=0,
                            skip_tokenizer_init=True, max_model_len=max_len)
        sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=max_len, enable_chunked_prefill=True, is_encoder_decoder=False)
        cache = CacheConfig(block_size=args.block_size, enable_prefix_caching=True)
        cache.kv_cache_layout = "LBHNC"
        kvt = _transfer_config(config, args, work)
        self.config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                                 kv_transfer_config=kvt, device_config=DeviceConfig("cpu"))
        # vLLM's CPU platform turns async scheduling off while the config is built; GPUs keep it.
        self.config.scheduler_config.async_scheduling = True
        if config == "kvstrata":
            # What kvstrata's "auto" options resolve for (sync_loads, background_priority,
            # write_threads): read by its scheduler side only, from vLLM's device_config. The
            # worker side copies between host-memory tensors whatever this says.
            self.config.device_config.device_type = args.kvstrata_device
        spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=HEADS, head_size=HEAD,
                                 dtype=torch.float16)
        names = [f"l{i}" for i in range(LAYERS)]
        page = spec.page_size_bytes
        self.kv_config = KVCacheConfig(
            num_blocks=args.num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page * LAYERS * args.num_blocks, layers=names,
                                            layer_stride=page * args.num_blocks, block_stride=page, offset=0)],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        self.config.cache_config.num_gpu_blocks = args.num_blocks
        with set_current_vllm_config(self.config):
            self.scheduler = AsyncScheduler(
                vllm_config=self.config, kv_cache_config=self.kv_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=args.block_size, hash_block_size=args.block_size, log_stats=True)
            self.worker: Any = None
            if kvt is not None:  # the worker side, built as a model runner builds it
                from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

                self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                                  self.kv_config)
                self.worker.register_kv_caches(
                    allocate_kv_cache(self.kv_config, torch.device("cpu"), KVCacheLayout.LBHNC))
        self.connector = self.scheduler.connector
        if self.connector is not None:
            self._time_hooks(self.connector)
        self.scheduler.kv_event_publisher.publish = lambda batch: None  # type: ignore[method-assign,assignment]
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(args.block_size, sha256)
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._unseen: tuple[Any, Any] | None = None
        self._step_connector = self._step_update = self._step_worker = self._forward_s = 0.0
        self.computed_tokens = 0
        self.finished: list[tuple[str, Any]] = []  # (request id, kv_transfer_params)
        self._next_id = 0

    def _time_hooks(self, connector: Any) -> None:
        for name in SCHEDULER_HOOKS:
            fn = getattr(connector, name, None)
            if fn is not None:
                setattr(connector, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self._step_connector += dt
                self.t.hooks[name] += dt
        return run

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        params.update_from_generation_config({}, EOS)
        req = Request(request_id=f"r{self._next_id}", prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, block_hasher=self._hasher)
        self.scheduler.add_request(req)
        return req.request_id

    def busy(self) -> bool:
        return self.scheduler.has_requests() or self._unseen is not None or (
            self.connector is not None and self.connector.has_pending_push_work())

    def step(self) -> None:
        """One engine-core step. Its times are recorded when it scheduled tokens (a step that
        only waits for transfers, or drains the last output, has no forward to stall)."""
        self._step_connector = 0.0
        self._step_update = self._step_worker = 0.0
        if self._unseen is not None and not self.scheduler.has_requests():
            last, self._unseen = self._unseen, None
            self._update(*last)
            self.t.idle_steps += 1
            return
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        schedule_s = time.perf_counter() - t0
        for req_id, n in so.num_scheduled_tokens.items():  # prompt tokens only, not decodes
            req = self.scheduler.requests[req_id]
            self.computed_tokens += max(0, min(n, req.num_prompt_tokens - (req.num_computed_tokens - n)))
        out = self._execute(so)
        unseen, self._unseen = self._unseen, (so, out)
        if unseen is not None:
            self._update(*unseen)
        if so.total_num_scheduled_tokens == 0:
            self.t.idle_steps += 1
            return
        self.t.schedule.append(schedule_s)
        self.t.forward.append(self._forward_s)
        self.t.update.append(self._step_update)
        self.t.connector.append(self._step_connector)
        if self.worker is not None:
            self.t.worker.append(self._step_worker)

    def _execute(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        reqs = [self.scheduler.requests[r] for r in so.num_scheduled_tokens]
        kv_out = None
        forward_s = (self.forward_ms * 1e-3 + self.forward_us_per_token * 1e-6 * so.total_num_scheduled_tokens
                     if so.total_num_scheduled_tokens else 0.0)
        self._forward_s = forward_s
        if self.worker is None:
            time.sleep(forward_s)
        else:
            w = self.worker
            t0 = time.perf_counter()
            meta = so.kv_connector_metadata
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(self._ctx)  # before the forward for sync loads, after otherwise: same here
            hooks = time.perf_counter() - t0
            time.sleep(forward_s)  # the forward: the GIL is free, as while a GPU computes
            t0 = time.perf_counter()
            w.wait_for_save()
            results = w.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                failed_recving=results.failed_recving, invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(), kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            self._step_worker = hooks + time.perf_counter() - t0
        return ModelRunnerOutput(
            req_ids=[r.request_id for r in reqs],
            req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
            sampled_token_ids=[[1000 + r.num_tokens % 20000] if r.num_computed_tokens >= r.num_tokens else []
                               for r in reqs],
            logprobs=None, prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_out)

    def _update(self, so: Any, out: Any) -> None:
        t0 = time.perf_counter()
        outputs = self.scheduler.update_from_output(so, out)
        self._step_update = time.perf_counter() - t0
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finished:
                    self.finished.append((o.request_id, o.kv_transfer_params))

    def close(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self.worker is not None:
            self.worker.shutdown()


def run_config(config: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One configuration over the whole workload; its figures."""
    from kvstrata.connector.request_state import SERVED_PARAM

    wl: Workload = args.workload
    rng = random.Random(wl.seed)
    system = [rng.randrange(100, 30000) for _ in range(wl.system_tokens)]
    prompts = [wl.first_prompt(rng, system) for _ in range(wl.users)]
    questions = [[[rng.randrange(100, 30000) for _ in range(wl.question_tokens)] for _ in range(wl.rounds)]
                 for _ in range(wl.users)]
    timings = Timings()
    engine = Engine(config, args, work, timings)
    resolved = None
    if config == "kvstrata":  # what its automatic options came to for --kvstrata-device
        mine = engine.connector.scheduler
        resolved = {"sync_loads": mine.sync_loads, "write_threads": mine.hierarchy.write_threads,
                    "read_processes": mine.hierarchy.read_processes,
                    "write_processes": mine.hierarchy.write_processes}
    # As vLLM's engine core at the end of its start-up: what start-up allocated is never scanned
    # by the collector again, so a step pays only for what serving allocates.
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    owner: dict[str, tuple[int, int]] = {}  # request id -> (user, round)
    started = 0
    step = 0
    served = 0
    t0 = time.perf_counter()
    try:
        while started < wl.users or engine.busy():
            if started < wl.users and step % wl.arrival_steps == 0:
                owner[engine.add(prompts[started], wl.answer_tokens)] = (started, 0)
                started += 1
            engine.step()
            step += 1
            for req_id, params in engine.finished:
                user, rnd = owner.pop(req_id)
                served += sum(((params or {}).get(SERVED_PARAM) or {}).values())
                # The next round: the prompt, an answer (made-up tokens, the same for every
                # configuration) and a new question.
                prompts[user] = prompts[user] + [1000 + i for i in range(wl.answer_tokens)]
                if rnd + 1 < wl.rounds:
                    prompts[user] = prompts[user] + questions[user][rnd + 1]
                    owner[engine.add(prompts[user], wl.answer_tokens)] = (user, rnd + 1)
            engine.finished.clear()
            if step > args.max_steps:
                raise RuntimeError(f"{config}: not done after {args.max_steps} steps")
    finally:
        engine.close()
    out = timings.summary()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    out["computed_tokens"] = engine.computed_tokens
    out["served_tokens"] = served
    if config == "none":
        out["connector_us"] = out["worker_us"] = None
    if config != "kvstrata":
        out["served_tokens"] = None  # what another connector served is not reported per request
    else:
        out["resolved"] = resolved
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scheduler_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=8192, help="each user's first prompt")
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--arrival-steps", type=int, default=4, help="a new user every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="device KV blocks (default: a third of what the users' contexts take)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--host-bytes", default="256MiB", help="kvstrata's host tier")
    p.add_argument("--kvstrata-config", default="{}", help="options added to kvstrata's (JSON)")
    p.add_argument("--kvstrata-device", choices=("cuda", "cpu"), default="cuda",
                   help="the engine device kvstrata's automatic options resolve for: cuda (as on a GPU: "
                        "asynchronous loads, normal-priority writes on one thread per core, at most 4) "
                        "or cpu (synchronous loads, idle-priority writes on one thread)")
    p.add_argument("--vllm-offload-config", default="{}",
                   help="options added to vLLM's OffloadingConnector's (JSON), e.g. '{\"block_size\": 64}'")
    p.add_argument("--forward-ms", type=float, default=10.0,
                   help="the emulated forward of a step: this long, plus --forward-us-per-token per "
                        "scheduled token (defaults: about an 8B model on one H100)")
    p.add_argument("--forward-us-per-token", type=float, default=20.0)
    p.add_argument("--max-steps", type=int, default=200_000)
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    args = p.parse_args(argv)
    args.workload = Workload(users=args.users, rounds=args.rounds, system_tokens=args.system_tokens,
                             prompt_tokens=args.prompt_tokens, question_tokens=args.question_tokens,
                             answer_tokens=args.answer_tokens, arrival_steps=args.arrival_steps, seed=args.seed)
    for name in ("users", "rounds", "prompt_tokens", "answer_tokens", "arrival_steps", "block_size",
                 "max_num_seqs", "max_num_batched_tokens", "max_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("system_tokens", "question_tokens", "forward_ms", "forward_us_per_token"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    if args.system_tokens > args.prompt_tokens:
        p.error("--system-tokens must not exceed --prompt-tokens")
    for flag in ("--kvstrata-config", "--vllm-offload-config"):
        try:
            extra = json.loads(getattr(args, flag[2:].replace("-", "_")))
        except ValueError as exc:
            p.error(f"{flag} is not JSON: {exc}")
        if not isinstance(extra, dict):
            p.error(f"{flag} must be a JSON object")
    if args.num_blocks is not None and args.num_blocks < 1:
        p.error("--num-blocks must be positive")
    if args.num_blocks is None:
        total = args.users * args.workload.max_model_len() // args.block_size
        args.num_blocks = max(total // 3, 2 * args.workload.max_model_len() // args.block_size + 64)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configuration(s) {', '.join(bad)}; known: {', '.join(CONFIGS)}")
    return args


@contextmanager
def _work_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvstrata-sched-") as d:
        yield Path(d)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "workload": {k: v for k, v in vars(args.workload).items()},
        "block_size": args.block_size, "num_blocks": args.num_blocks, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "kvstrata_device": args.kvstrata_device,
        "configs": {},
    }
    for config in args.configs:
        print(f"scheduler_overhead: {config} ...", file=sys.stderr, flush=True)
        with _work_dir() as work:
            result["configs"][config] = run_config(config, args, work)
    figs = result["configs"]
    if "none" in figs:  # what each connector adds to the engine core's step, same run
        base = figs["none"]["engine_core_us"]
        for name, fig in figs.items():
            if name != "none":
                fig["engine_core_us_added"] = {k: round(fig["engine_core_us"][k] - base[k], 1)
                                               for k in ("mean", "p50", "p99")}
                fig["computed_tokens_vs_none"] = round(fig["computed_tokens"] / max(1, figs["none"]["computed_tokens"]), 3)
    if "kvstrata" in figs and "vllm_tiered_fs" in figs:
        mine, peer = figs["kvstrata"], figs["vllm_tiered_fs"]
        result["connector_us_mean_vs_vllm_tiered_fs"] = round(
            mine["connector_us"]["mean"] / max(1e-9, peer["connector_us"]["mean"]), 3)
        result["engine_core_us_mean_vs_vllm_tiered_fs"] = round(
            mine["engine_core_us"]["mean"] / max(1e-9, peer["engine_core_us"]["mean"]), 3)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
