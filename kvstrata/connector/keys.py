"""Namespaces that make stored KV interchangeable only with the KV it was made for.

A chunk key (vLLM block hash ending the chunk + group index) says nothing about the model, dtype,
layout or rank (docs/SEMANTICS.md R10, R14). Every store key is therefore prefixed with a 16-byte namespace:
a digest of everything that makes two servers' KV bytes interchangeable. Two servers that agree on
all of it share chunks across restarts and hosts; any difference gives zero hits, never wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMESPACE_BYTES = 16
# Hash algorithms whose NONE_HASH seed is fixed across processes unless PYTHONHASHSEED is set
# differently (docs/SEMANTICS.md R11). xxhash* seeds are random per process without PYTHONHASHSEED.
REPRODUCIBLE_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
# Weight files whose size and mtime identify a local checkpoint's contents cheaply.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class GroupIdentity:
    """What one KV cache group's stored bytes depend on."""

    index: int
    spec: str  # spec class name and its fields, canonical repr
    layer_names: tuple[str, ...]
    page_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "spec": self.spec,
            "layers": list(self.layer_names),
            "page_bytes": self.page_bytes,
        }


@dataclass(frozen=True)
class ModelIdentity:
    """What every rank shares: the model, its dtypes, block geometry and hashing."""

    model: str
    revision: str | None
    architectures: tuple[str, ...]
    weights_digest: str | None
    dtype: str
    kv_cache_dtype: str
    kv_cache_layout: str | None
    block_size: int
    tokens_per_hash: int
    blocks_per_chunk: int
    hash_algo: str
    groups: tuple[GroupIdentity, ...]
    tp_size: int
    pp_size: int
    pp_rank: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "revision": self.revision,
            "architectures": list(self.architectures),
            "weights_digest": self.weights_digest,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_cache_layout": self.kv_cache_layout,
            "block_size": self.block_size,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_chunk": self.blocks_per_chunk,
            "hash_algo": self.hash_algo,
            "groups": [g.as_dict() for g in self.groups],
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
        }


def rank_namespace(identity: ModelIdentity, tp_rank: int) -> bytes:
    """The 16-byte namespace of one tensor-parallel rank's shard."""
    payload = json.dumps({**identity.as_dict(), "tp_rank": tp_rank}, sort_keys=True)
    return hashlib.blake2b(payload.encode(), digest_size=NAMESPACE_BYTES).digest()


def namespace_info(identity: ModelIdentity, tp_rank: int) -> dict[str, Any]:
    """Human-readable description stored next to the namespace (``kvstrata inspect``)."""
    return {**identity.as_dict(), "tp_rank": tp_rank}


def weights_digest(model: str) -> str | None:
    """Digest of a local checkpoint's weight files (names, sizes, mtimes), None for hub names.

    Two different checkpoints saved under the same path (a retrained model, a re-made random test
    model) must not share KV; size+mtime is a cheap proxy for content that never false-matches in
    practice and costs one stat per file.
    """
    path = Path(model)
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        if f.suffix not in _WEIGHT_SUFFIXES:
            continue
        st = f.stat()
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def hash_seed_is_reproducible(hash_algo: str) -> bool:
    """True when vLLM's block hashes are identical in every process (docs/SEMANTICS.md R11).

    sha256/sha256_cbor hash a fixed seed unless PYTHONHASHSEED is set; xxhash* use a random seed per
    process unless PYTHONHASHSEED pins it. A set PYTHONHASHSEED is reproducible as long as every
    server uses the same value, which is the operator's contract (it is part of the environment).
    """
    return hash_algo in REPRODUCIBLE_HASH_ALGOS or os.environ.get("PYTHONHASHSEED") is not None


def spec_repr(spec: Any) -> str:
    """Canonical text of a vLLM KV cache spec (a frozen dataclass): class name + fields."""
    fields = getattr(spec, "__dataclass_fields__", None)
    if fields is None:
        return repr(spec)
    parts = []
    for name in sorted(fields):
        value = getattr(spec, name)
        parts.append(f"{name}={_canonical(value)}")
    return f"{type(spec).__name__}({', '.join(parts)})"


def _canonical(value: Any) -> str:
    if hasattr(value, "__dataclass_fields__"):
        return spec_repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_canonical(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_canonical(v) for v in value) + "]"
    return str(value)
