"""Device staging: copy whole KV block pages between vLLM's KV tensors and host slab slots.

Runs in the worker process. One stager per backend, all behind ``DeviceStager``'s API:

* ``StreamStager`` (``stream.py``): CUDA/XPU, DMA copies (vLLM's ``swap_blocks_batch``) between KV
  pages and pinned slab slots on dedicated streams, events polled, no device memory; its
  primitives sit behind ``CopyDevice`` (``accel.py``) so tests drive it with a controlled double;
* ``CpuStager`` (``cpu.py``): CPU engines, memmove of page runs on the calling thread (a job's
  chunks spread over a few threads), jobs complete synchronously.

``make_stager`` picks one by the KV tensors' device. Shared geometry, validation and group
discovery live in ``base.py``; page layout helpers in ``layout.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Unpack

import torch

from kvstrata.tiers.device.accel import CopyDevice, TorchCopyDevice
from kvstrata.tiers.device.base import DeviceStager, StagerGeometry
from kvstrata.tiers.device.cpu import CpuStager, allow_amx_tiles
from kvstrata.tiers.device.layout import NULL_BLOCK, Transfer, kv_device
from kvstrata.tiers.device.stream import StreamStager
from kvstrata.tiers.host import HostSlab

__all__ = [
    "NULL_BLOCK",
    "CopyDevice",
    "CpuStager",
    "DeviceStager",
    "StagerGeometry",
    "StreamStager",
    "TorchCopyDevice",
    "Transfer",
    "allow_amx_tiles",
    "make_stager",
]

# Device types StreamStager serves (TorchCopyDevice refuses a build lacking a primitive).
STREAM_DEVICES = ("cuda", "xpu")


def make_stager(
    kv_caches: Mapping[str, torch.Tensor],
    group_layers: Sequence[Sequence[str]],
    host: HostSlab | torch.Tensor,
    *,
    max_stage_bytes: int | None = None,
    pin: bool = True,
    copy_threads: int | None = None,
    **geometry: Unpack[StagerGeometry],
) -> DeviceStager:
    """The stager for ``kv_caches``' device (arguments: ``DeviceStager``, ``StreamStager``,
    ``CpuStager``). Options of the other backend are accepted and ignored, so one call site
    serves every device: ``pin`` applies to CUDA/XPU, ``copy_threads`` to CPU;
    ``max_stage_bytes`` is accepted and unused (there is no device staging buffer any more)."""
    kind = kv_device(kv_caches).type
    if kind in STREAM_DEVICES:
        return StreamStager(
            kv_caches,
            group_layers,
            host,
            max_stage_bytes=max_stage_bytes,
            pin=pin,
            **geometry,
        )
    if kind == "cpu":
        return CpuStager(kv_caches, group_layers, host, copy_threads=copy_threads, **geometry)
    raise ValueError(f"no device stager for {kind!r} KV tensors (supported: cpu, cuda, xpu)")
