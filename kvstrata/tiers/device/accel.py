"""The accelerator primitives ``StreamStager`` drives, and the real ones for CUDA and XPU.

``StreamStager`` only needs streams, events and one batched copy op. They sit behind
``CopyDevice`` so the CI test double (``tests/unit/accel_double.py``) drives the same stager code
with streams and events whose completion the test controls. The real device follows vLLM 0.32's
own offloading worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``): copies go to the copy engines
through ``swap_blocks_batch`` (cuMemcpyBatchAsync where the CUDA runtime has it, a loop of
cudaMemcpyAsync otherwise; the XPU DMA engine on XPU) from pinned host descriptor buffers, so no
device memory and no SM time is spent on staging.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class CopyDevice(Protocol):
    """Streams, events and the batched raw-pointer copy of one device.

    Streams have ``wait_event(event)`` and ``wait_stream(stream)``; events ``record(stream)``,
    ``query()`` and ``synchronize()`` (the ``torch.cuda``/``torch.xpu`` API).
    """

    kind: str

    def new_stream(self) -> Any: ...

    def new_event(self, blocking: bool = False) -> Any:
        """An event; ``blocking``: its ``synchronize`` sleeps instead of spinning."""
        ...

    def current_stream(self) -> Any: ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def descriptor_buffer(self, n: int) -> torch.Tensor:
        """``n`` pointer-sized slots of pinned host memory (the copy op's descriptor dtype)."""
        ...

    def copy_batch(
        self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, *, src_order_any: bool
    ) -> None:
        """Queue ``sizes[i]`` bytes ``src[i] -> dst[i]`` on the current stream; never waits for
        the device when the host side is pinned."""
        ...


class TorchCopyDevice:
    """CUDA or XPU through ``torch.<kind>`` and vLLM's ``swap_blocks_batch`` op.

    Raises ValueError at construction, naming what is missing, when this torch/vLLM build lacks a
    primitive the stager needs (the engine refuses to start rather than copy wrongly later).
    """

    def __init__(self, device: torch.device) -> None:
        self.kind = device.type
        self.device = device
        self._mod: Any = getattr(torch, self.kind, None)  # torch.cuda / torch.xpu, checked below
        missing = [
            f"torch.{self.kind}.{name}"
            for name in ("Stream", "Event", "current_stream", "stream")
            if not hasattr(self._mod, name)
        ]
        try:
            from vllm import _custom_ops as ops

            self._swap = ops.swap_blocks_batch
            # The op is registered by vLLM's compiled extension for this device; a build without
            # it (or an old vLLM) fails here, not at the first transfer.
            torch.ops._C_cache_ops.swap_blocks_batch  # noqa: B018
        except (ImportError, AttributeError, RuntimeError) as exc:
            missing.append(f"vLLM's torch.ops._C_cache_ops.swap_blocks_batch ({exc})")
        if missing:
            raise ValueError(
                f"kvstrata cannot stage KV on {self.kind}: missing {', '.join(missing)}"
            )
        # vLLM's cache_kernels.cu takes int64 pointers; its XPU DMA engine takes uint64.
        self._ptr_dtype = torch.uint64 if self.kind == "xpu" else torch.int64

    def new_stream(self) -> Any:
        return self._mod.Stream(device=self.device)

    def new_event(self, blocking: bool = False) -> Any:
        # torch.xpu.Event has no blocking flag.
        return self._mod.Event(blocking=True) if blocking and self.kind == "cuda" else self._mod.Event()

    def current_stream(self) -> Any:
        return self._mod.current_stream(self.device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self._mod.stream(stream)

    def descriptor_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self._ptr_dtype, pin_memory=True)

    def copy_batch(
        self, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, *, src_order_any: bool
    ) -> None:
        self._swap(src, dst, sizes, is_src_access_order_any=src_order_any)
