"""Drive vLLM 0.32.0's real Scheduler with kvstrata's connector on CPU (docs/SEMANTICS.md §5.1).

The scheduler is vLLM's own (real block pool, prefix cache, hybrid KV cache manager); the worker is
kvstrata's real worker connector over real CPU KV tensors allocated exactly as vLLM allocates them.
Only the model forward is emulated: after each step, every page a request just computed is filled
with a value derived from that block's prefix hash, its group and its layer. A load is then checked
byte-for-byte: a loaded page must hold the value of the block it claims to be.

``tp=N`` runs N worker connectors (tensor-parallel ranks 0..N-1), each over its own KV tensors
whose values also depend on the rank, their outputs merged by vLLM's own ``KVOutputAggregator``
as its executors do: a load counts as finished only once every rank finished it.

``kv_events=True`` turns vLLM's KV cache events on; every batch the scheduler publishes (its own
GPU events and the connector's) lands in ``Runner.published``.

``async_scheduling=True`` runs vLLM's ``AsyncScheduler`` the way its engine core does on GPUs,
where it is on by default (``step_with_batch_queue``, two steps in flight): step N is scheduled and
executed before the scheduler sees step N-1's output, so the connector's scheduler side plans each
step one output behind.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvstrata.connector.connector import StrataConnector
from kvstrata.connector.request_state import SERVED_PARAM

EOS = 50256
HEADS, HEAD = 2, 16


def write_model_dir(path: Path) -> Path:
    """A local config.json so ModelConfig needs no hub (no weights: the scheduler never runs them)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 60000, "max_position_embeddings": 16384,
        "torch_dtype": "float32", "rms_norm_eps": 1e-5, "eos_token_id": EOS, "bos_token_id": 1,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@dataclass(frozen=True)
class G:
    """One KV cache group of a test configuration."""

    kind: str  # "full" | "sw" | "mamba"
    block_size: int
    window: int = 0
    eagle: bool = False
    layers: int = 2
    # Mamba: a kernel that saves the prompt's checkpoint state inside the forward (vLLM's Mamba2
    # layers), at this token granularity: the scheduler then does not split the prefill there.
    checkpoint_alignment: int | None = None


def kv_cache_config(groups: list[G], num_blocks: int) -> KVCacheConfig:
    specs = []
    for i, g in enumerate(groups):
        names = [f"g{i}.l{j}" for j in range(g.layers)]
        if g.kind == "full":
            spec: Any = FullAttentionSpec(block_size=g.block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
        elif g.kind == "sw":
            spec = SlidingWindowSpec(block_size=g.block_size, num_kv_heads=HEADS, head_size=HEAD,
                                     dtype=torch.float16, sliding_window=g.window)
        else:
            attn_page = 2 * HEADS * g.block_size * 2 * HEAD  # fp16 K+V, same as the attention pages
            spec = MambaSpec(block_size=g.block_size, shapes=((4, 8),), dtypes=(torch.float32,),
                             page_size_padded=attn_page, mamba_cache_mode="align",
                             num_prefill_checkpoint_blocks=int(g.checkpoint_alignment is not None),
                             prefill_checkpoint_alignment=g.checkpoint_alignment)
        specs.append(KVCacheGroupSpec(names, spec, is_eagle_group=g.eagle))
    # As vLLM's hybrid allocator lays it out (layer-outer): one tensor per group, the group's layers
    # back to back, and every group aliasing the same bytes from offset 0.
    size = max(s.kv_cache_spec.page_size_bytes * len(s.layer_names) for s in specs) * num_blocks
    tensors = [
        KVCacheTensor(size=size, layers=list(s.layer_names),
                      layer_stride=s.kv_cache_spec.page_size_bytes * num_blocks,
                      block_stride=s.kv_cache_spec.page_size_bytes, offset=0)
        for s in specs
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=specs)


def vllm_config(model_dir: Path, store: Path, *, block_size: int, extra: dict[str, Any] | None = None,
                spec_decode: bool = False, retention: int | None = None,
                max_num_batched_tokens: int = 4096, hash_algo: str = "sha256",
                mamba: bool = False, prefix_match_unit: int | None = None,
                kv_events: bool = False) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), dtype="float16", seed=0, skip_tokenizer_init=True,
                        max_model_len=8192)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=8192, enable_chunked_prefill=True, is_encoder_decoder=False,
                            disable_hybrid_kv_cache_manager=False)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                        prefix_caching_hash_algo=hash_algo)
    cache.kv_cache_layout = "LBHNC"
    cache.prefix_cache_retention_interval = retention
    if mamba:
        cache.mamba_cache_mode = "align"  # states kept at block boundaries and handed off
    # Hybrid models only: hash (and match prefixes) at a finer grain than the blocks.
    cache.prefix_match_unit = prefix_match_unit
    kvt = KVTransferConfig(
        kv_connector="StrataConnector", kv_connector_module_path="kvstrata.connector",
        kv_role="kv_both",
        # One block per chunk unless a test says otherwise: the scenarios count in blocks ("auto"
        # would make the 16-token blocks of most of them 64-token chunks; tested on its own).
        kv_connector_extra_config={"store_path": str(store), "host_bytes": 64 << 20, "blocks_per_chunk": 1,
                                   **(extra or {})},
        kv_load_failure_policy="recompute",
    )
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                     kv_transfer_config=kvt, device_config=DeviceConfig("cpu"))
    if kv_events:
        cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if spec_decode:
        spec = MagicMock()
        spec.use_eagle_block_drop.return_value = True
        spec.use_eagle.return_value = True
        spec.num_speculative_tokens = 1
        spec.num_speculative_tokens_per_batch_size = None
        spec.max_num_new_slots_for_drafting = 1
        cfg.speculative_config = spec
    return cfg


def page_value(block_hash: bytes, group: int, layer: int, rank: int = 0) -> int:
    key = (block_hash, group, layer) if rank == 0 else (block_hash, group, layer, rank)
    return (int.from_bytes(sha256(key)[:4], "big") % 120) + 1  # 1..120: exact in int8 and fp16


@dataclass
class Runner:
    """One engine: the real Scheduler, kvstrata's scheduler and worker connectors, real KV tensors."""

    groups: list[G]
    model_dir: Path
    store: Path
    num_blocks: int = 400
    extra: dict[str, Any] = field(default_factory=dict)
    spec_decode: bool = False
    retention: int | None = None
    max_num_batched_tokens: int = 4096
    prefix_match_unit: int | None = None
    async_scheduling: bool = False
    tp: int = 1
    kv_events: bool = False
    # Workers stage through StreamStager on the accelerator double (tests/unit/accel_double.py):
    # deferred stores, event-completed loads; the double runs its queued copies just before each
    # step's get_finished, after that step's (host-synchronous) emulated forward. Loads are
    # asynchronous there unless ``extra`` says ``sync_loads`` (what "auto" does on accelerators;
    # the engine's device type is the CPU here).
    accel: bool = False
    # Every rank holds the same KV (MLA's latent under tensor parallelism): vLLM's signals for it
    # (``use_mla``, ``kv_tp_replicas``) are set, and the emulated forward writes the same values
    # on every rank.
    replicated: bool = False
    # The engine's device type as the connector reads it (``device_config.device_type``): what
    # "auto" options resolve by. The copies still run on the CPU (or the accelerator double).
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if not self.replicated:
            self._build()
            return
        from unittest import mock

        from vllm.config import ModelConfig

        with mock.patch.object(ModelConfig, "use_mla", new_callable=mock.PropertyMock,
                               return_value=True):
            self._build()

    def _build(self) -> None:
        block_size = max(g.block_size for g in self.groups)
        if self.accel:
            self.extra = {"sync_loads": False, **self.extra}
        self.config = vllm_config(self.model_dir, self.store, block_size=block_size, extra=self.extra,
                                  spec_decode=self.spec_decode, retention=self.retention,
                                  max_num_batched_tokens=self.max_num_batched_tokens,
                                  mamba=any(g.kind == "mamba" for g in self.groups),
                                  prefix_match_unit=self.prefix_match_unit,
                                  kv_events=self.kv_events)
        self.config.device_config.device_type = self.device_type
        self.kv_config = kv_cache_config(self.groups, self.num_blocks)
        if self.replicated:
            self.kv_config.kv_tp_replicas = self.tp
        self.config.cache_config.num_gpu_blocks = self.num_blocks
        sched_block, hash_block = resolve_kv_cache_block_sizes(self.kv_config, self.config)
        self.hash_block = hash_block
        # vLLM's CPU platform turns async scheduling off while the config is built; GPUs keep it.
        self.config.scheduler_config.async_scheduling = self.async_scheduling
        parallel = self.config.parallel_config
        parallel.tensor_parallel_size = parallel.world_size = self.tp
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        with set_current_vllm_config(self.config):
            self.scheduler = scheduler_cls(
                vllm_config=self.config, kv_cache_config=self.kv_config,
                structured_output_manager=StructuredOutputManager(self.config),
                block_size=sched_block, hash_block_size=hash_block, log_stats=True,
            )
            # One worker connector per rank, built as that rank's process builds it.
            self.workers: list[StrataConnector] = []
            self.devices: list[Any] = []
            self.kvs: list[dict[str, torch.Tensor]] = []
            for rank in range(self.tp):
                parallel.rank = rank
                worker = StrataConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
                kv = allocate_kv_cache(self.kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)
                if self.accel:
                    self.devices.append(_register_on_accel_double(worker, kv))
                else:
                    worker.register_kv_caches(kv)
                self.workers.append(worker)
                self.kvs.append(kv)
            parallel.rank = 0
        self._aggregator = KVOutputAggregator(expected_finished_count=self.tp)
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, StrataConnector)
        # Every KV cache event batch the scheduler publishes (vLLM's own and the connector's).
        self.published: list[Any] = []
        self.scheduler.kv_event_publisher.publish = self.published.append
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(hash_block, sha256)
        self._next_id = 0
        self.loaded_tokens: dict[str, int] = {}
        # What kvstrata says it served each finished request, by tier (its kv_transfer_params).
        self.served: dict[str, dict[str, int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.load_errors: list[str] = []
        self._position_hashes: dict[str, list[bytes]] = {}  # by request (see _position_hash)
        self.stats: Any = None  # connector stats as vLLM's stats logger sees them
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        # Async scheduling: the step whose output the scheduler has not seen yet, and the forward
        # writes that wait for tokens sampled by an earlier step (see _emulate_forward).
        self._unseen: tuple[Any, ModelRunnerOutput] | None = None
        self._deferred_writes: list[tuple[Request, list[list[int]], int, int]] = []

    # ----------------------------------------------------------------- requests
    def add(self, prompt: list[int], max_tokens: int = 1) -> Request:
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        params.update_from_generation_config({}, EOS)
        req = Request(request_id=f"r{self._next_id}", prompt_token_ids=list(prompt),
                      sampling_params=params, pooling_params=None, block_hasher=self._hasher)
        self.scheduler.add_request(req)
        self.outputs[req.request_id] = []
        return req

    def run_until_idle(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if (not self.scheduler.has_requests() and not self.connector.has_pending_push_work()
                    and self._unseen is None):
                return
            self.step()
        raise AssertionError("engine did not go idle")

    def serve(self, prompt: list[int], max_tokens: int = 1) -> int:
        """Run one request to completion; return the tokens kvstrata loaded for it."""
        req = self.add(prompt, max_tokens)
        self.run_until_idle()
        return self.loaded_tokens.get(req.request_id, 0)

    def drop_gpu_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache()

    # -------------------------------------------------------------------- steps
    def step(self, before_output: Callable[[], None] | None = None) -> None:
        """One engine step; ``before_output`` runs after the workers, before the scheduler
        sees their results (where a cache reset can catch transfers in flight).

        With async scheduling the scheduler sees this step's output only after it scheduled
        the next one (vLLM's batch queue); the previous step's output is handed over here.
        """
        if self.async_scheduling and self._unseen is not None and not self.scheduler.has_requests():
            # Nothing to schedule: the engine core only drains its batch queue.
            unseen, self._unseen = self._unseen, None
            self._update(*unseen)
            self._write_deferred()
            return
        so = self.scheduler.schedule()
        out = self._execute(so, before_output)
        if not self.async_scheduling:
            self._update(so, out)
            return
        unseen, self._unseen = self._unseen, (so, out)
        if unseen is not None:
            self._update(*unseen)
        self._write_deferred()

    def _execute(self, so: Any, before_output: Callable[[], None] | None) -> ModelRunnerOutput:
        """The workers' part of a step: transfers around the emulated forward, on every rank;
        their outputs merged as vLLM's executor merges them."""
        meta = so.kv_connector_metadata
        for req_id, n in self._new_loads(so).items():
            self.loaded_tokens[req_id] = n
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(self._ctx)
        self._emulate_forward(so)
        reqs = [self.scheduler.requests[r] for r in so.num_scheduled_tokens]
        outputs: list[ModelRunnerOutput | None] = []
        for i, w in enumerate(self.workers):
            w.wait_for_save()
            if self.devices:
                self.devices[i].run()
            results = w.get_transfer_results(so.finished_req_ids)
            wmeta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(
                req_ids=[r.request_id for r in reqs],
                req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
                # A request still prefilling (a partial chunk) samples nothing, as in vLLM's runner.
                sampled_token_ids=[
                    [self._next_token(r)] if r.num_computed_tokens >= r.num_tokens else [] for r in reqs
                ],
                logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                    failed_recving=results.failed_recving, kv_connector_worker_meta=wmeta,
                    invalid_block_ids=w.get_block_ids_with_load_errors(),
                ),
            ))
        out = self._aggregator.aggregate(outputs)
        assert out is not None and out.kv_connector_output is not None
        kv_out = out.kv_connector_output
        for req_id in kv_out.finished_recving or ():
            if req_id in self.scheduler.requests and req_id not in kv_out.failed_recving:
                self._check_loaded_pages(self.scheduler.requests[req_id])
        if before_output is not None:
            before_output()
        return out

    def _update(self, so: Any, out: ModelRunnerOutput) -> None:
        for eco in self.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finished:
                    self.served[o.request_id] = dict((o.kv_transfer_params or {}).get(SERVED_PARAM) or {})
            sched_stats = eco.scheduler_stats
            if sched_stats is not None and sched_stats.kv_connector_stats:
                # What vLLM's logger receives: rebuilt from the dict, aggregated over steps.
                step_stats = StrataConnector.build_kv_connector_stats(sched_stats.kv_connector_stats)
                self.stats = step_stats if self.stats is None else self.stats.aggregate(step_stats)

    def _new_loads(self, so: Any) -> dict[str, int]:
        loads = {}
        for job in so.kv_connector_metadata.loads:
            req = self.scheduler.requests[job.req_id]
            # A synchronous load's request is scheduled in the same step: schedule() advanced
            # num_computed_tokens past the tokens this step computes.
            computed = req.num_computed_tokens - so.num_scheduled_tokens.get(job.req_id, 0)
            loads[job.req_id] = computed - self._local_hit(req)
        return loads

    def _local_hit(self, req: Request) -> int:
        st = self.connector.scheduler._reqs.get(req.request_id)
        return st.num_local if st is not None else 0

    @staticmethod
    def _next_token(req: Request) -> int:
        # Deterministic "model": the next token is a function of the sequence length.
        return 1000 + (req.num_tokens * 7919) % 50000

    def _block_hash_at(self, req: Request, end_token: int) -> bytes | None:
        idx = end_token // self.hash_block - 1
        if idx < 0 or idx >= len(req.block_hashes):
            return None
        return bytes(req.block_hashes[idx])

    def _group_pages(self, g: int, block_id: int) -> Iterable[tuple[int, int, torch.Tensor]]:
        """(rank, layer, page) of a block, on every rank."""
        for rank, kv in enumerate(self.kvs):
            for layer, name in enumerate(self.kv_config.kv_cache_groups[g].layer_names):
                yield 0 if self.replicated else rank, layer, kv[name][block_id]

    def _is_state(self, g: int) -> bool:
        return self.groups[g].kind == "mamba"

    def _apply_block_copies(self, so: Any) -> None:
        """The scheduler's copy-on-write copies (Mamba align states): run before the forward."""
        for copy in getattr(so, "kv_cache_block_copies", None) or ():
            for kvs in self.kvs:
                for kv in kvs.values():
                    kv[copy.dst_block_id].copy_(kv[copy.src_block_id])

    def _emulate_forward(self, so: Any) -> None:
        """Write what this step computes, each value a function of the prefix it depends on.

        Attention groups: each position this step computes gets a value of the tokens up to it
        (``_position_hash``), and no other position is written: as in a real forward, a
        position's bytes never change once computed (a store issued late still copies them).
        Mamba groups: each block completed by this step holds the state at its end; the running
        state block holds the state at the step's end, recognisable only at a hash boundary (0
        elsewhere, never a valid value).
        """
        self._apply_block_copies(so)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            # schedule() already advanced num_computed_tokens past this step's tokens.
            start, end = req.num_computed_tokens - n, req.num_computed_tokens
            ids = [list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(req_id)]
            self._write(req, ids, start, end)
            if req.num_tokens >= end:
                self._check_attended(req, ids, start, end)
            if req.num_tokens < end:
                # Async scheduling: a token this step computes was sampled by a step whose output
                # the scheduler has not seen, so the values (functions of the token ids) are not
                # known yet. The real forward wrote them now; no store can read them before the
                # scheduler has seen that token (their keys do not exist until then), so they
                # are written right after that output is handed over.
                self._deferred_writes.append((req, ids, start, end))

    def _write(self, req: Request, ids: list[list[int]], start: int, end: int) -> None:
        for g, spec in enumerate(self.kv_config.kv_cache_groups):
            bs = spec.kv_cache_spec.block_size
            if self._is_state(g):
                self._write_states(req, ids[g], g, bs, start, end)
            else:
                self._write_tokens(req, ids[g], g, bs, start, end)

    def _write_deferred(self) -> None:
        pending, self._deferred_writes = self._deferred_writes, []
        for req, ids, start, end in pending:
            if req.num_tokens >= end:
                self._write(req, ids, start, end)
            elif not req.is_finished():
                self._deferred_writes.append((req, ids, start, end))
            # A request that finished before that token was sampled never stores it.

    def _write_tokens(self, req: Request, ids: list[int], g: int, bs: int, start: int, end: int) -> None:
        # Positions whose token is not known yet are written later (``_write_deferred``).
        for p in range(start, min(end, req.num_tokens)):
            b = p // bs
            if b < len(ids) and ids[b] != 0:
                h = self._position_hash(req, p)
                for rank, layer, page in self._group_pages(g, ids[b]):
                    page[:, p % bs].fill_(page_value(h, g, layer, rank))

    def _position_hash(self, req: Request, p: int) -> bytes:
        """A hash of tokens ``0..p`` (what the KV at position ``p`` depends on), chained so a
        request's positions cost one hash each."""
        chain = self._position_hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        while len(chain) <= p:
            chain.append(sha256((chain[-1] if chain else None, tokens[len(chain)])))
        return chain[p]

    def _write_states(self, req: Request, ids: list[int], g: int, bs: int, start: int, end: int) -> None:
        ends = [(b + 1) * bs for b in range(start // bs, end // bs)]
        if end % bs:
            ends.append(end)  # the running state, in the block the step ends in
        blocks = {e: -(-e // bs) - 1 for e in ends}
        # A checkpoint the kernel saves inside the forward, in the block the manager reserved.
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[g]
        checkpoint = getattr(manager, "_checkpoints", {}).get(req.request_id)
        if checkpoint is not None and start < checkpoint[0] <= end:
            blocks[checkpoint[0]] = checkpoint[1]
        for state_end, b in blocks.items():
            if b >= len(ids) or ids[b] == 0:
                continue
            h = self._block_hash_at(req, state_end) if state_end % self.hash_block == 0 else None
            for rank, layer, page in self._group_pages(g, ids[b]):
                page.fill_(0 if h is None else page_value(h, g, layer, rank))

    def _check_attended(self, req: Request, ids: list[list[int]], start: int, end: int) -> None:
        """What the forward of positions ``start..end-1`` reads must be there: in every attention
        group, each position a computed token attends (all before it; a sliding window's last W)
        lies in an allocated block and holds the value written for it (a function of the tokens
        up to it). A null block or a wrong value means the first token would be computed from
        the wrong KV, which byte counts alone cannot see."""
        tph = self.hash_block
        for g, spec in enumerate(self.kv_config.kv_cache_groups):
            if self._is_state(g):
                continue
            bs = spec.kv_cache_spec.block_size
            window = self.groups[g].window if self.groups[g].kind == "sw" else 0
            lo = max(0, start - window + 1) if window else 0
            complete_end = end - end % tph
            # One position per complete hash block (a block's positions are copied together),
            # every position past the last complete one.
            positions = sorted({max(lo, q - q % tph) for q in range(lo, complete_end)}
                               | set(range(max(lo, complete_end), end)))
            for q in positions:
                b = q // bs
                if b >= len(ids[g]) or ids[g][b] == 0:
                    self.load_errors.append(
                        f"{req.request_id} g{g}: tokens {start}..{end - 1} attend position {q}, "
                        f"in {'a null block' if b < len(ids[g]) else 'no block'} (block {b})")
                    break
                h = self._position_hash(req, q)
                for rank, layer, page in self._group_pages(g, ids[g][b]):
                    want = page_value(h, g, layer, rank)
                    got = int(page[:, q % bs].flatten()[0].item())
                    if got != want:
                        self.load_errors.append(
                            f"{req.request_id} rank {rank} g{g} layer {layer}: tokens {start}.."
                            f"{end - 1} attend position {q} (block {b}): {got} != {want}")
                        return

    def _check_loaded_pages(self, req: Request) -> None:
        """Every loaded position must hold what the forward wrote for it: the first position of
        each hash block below the loaded boundary and every position of the one it ends in
        (attention), the state at the boundary (Mamba)."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
        cached = req.num_computed_tokens
        local = self._local_hit(req)
        tph = self.hash_block
        for g, spec in enumerate(self.kv_config.kv_cache_groups):
            bs = spec.kv_cache_spec.block_size
            for b in range(local // bs, -(-cached // bs)):
                if b >= len(ids[g]) or ids[g][b] == 0:
                    continue
                # (what, expected hash, position in the block or None for the whole page)
                checks: list[tuple[str, bytes | None, int | None]]
                if self._is_state(g):
                    # A state block holds the state at its end, or at the boundary inside it.
                    end = min((b + 1) * bs, cached)
                    checks = [(f"@{end}", self._block_hash_at(req, end), None)]
                else:
                    top = min((b + 1) * bs, cached)
                    positions = (set(range(b * bs, top, tph))  # one per hash block's length
                                 | set(range(max(b * bs, cached - cached % tph), top)))
                    checks = [(f"pos {p}", self._position_hash(req, p), p - b * bs)
                              for p in sorted(positions)]
                for what, h, pos in checks:
                    for rank, layer, page in self._group_pages(g, ids[g][b]):
                        want = page_value(h, g, layer, rank)
                        got = int((page.flatten() if pos is None else page[:, pos].flatten())[0].item())
                        if got != want:
                            self.load_errors.append(
                                f"{req.request_id} rank {rank} g{g} block {b} {what}: {got} != {want}")

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()


def _register_on_accel_double(worker: StrataConnector, kv: dict[str, torch.Tensor]) -> Any:
    """``register_kv_caches`` with the worker's stager built on the accelerator double."""
    import sys
    from unittest import mock

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from accel_double import FakeDevice

    from kvstrata.connector import worker as worker_mod
    from kvstrata.tiers.device import StreamStager

    made: list[Any] = []

    def make_stager(kv_caches, group_layers, host, **kw):
        kw.pop("copy_threads", None)
        dev = FakeDevice([next(iter(kv_caches.values()))], [host.tensor])
        made.append(dev)
        return StreamStager(kv_caches, group_layers, host, backend=dev, host_pinned=True, **kw)

    with mock.patch.object(worker_mod, "make_stager", make_stager):
        worker.register_kv_caches(kv)
    return made[0]
