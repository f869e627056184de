"""Namespaces: equal for interchangeable KV, different for anything that changes the bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstrata.connector import keys


def _identity(**changes: object) -> keys.ModelIdentity:
    base = keys.ModelIdentity(
        model="/m", revision=None, architectures=("LlamaForCausalLM",), weights_digest="abc",
        dtype="bfloat16", kv_cache_dtype="auto", kv_cache_layout="LBHNC", block_size=16,
        tokens_per_hash=16, blocks_per_chunk=1, hash_algo="sha256",
        groups=(keys.GroupIdentity(0, "FullAttentionSpec(block_size=16)", ("l0", "l1"), 4096),),
        tp_size=1, pp_size=1, pp_rank=0,
    )
    return dataclasses.replace(base, **changes)


def test_namespace_is_stable_and_16_bytes() -> None:
    a, b = keys.rank_namespace(_identity(), 0), keys.rank_namespace(_identity(), 0)
    assert a == b and len(a) == keys.NAMESPACE_BYTES


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/other"}, {"revision": "v2"}, {"weights_digest": "def"}, {"dtype": "float16"},
        {"kv_cache_dtype": "fp8"}, {"kv_cache_layout": "LBNHC"}, {"block_size": 32},
        {"blocks_per_chunk": 2}, {"hash_algo": "sha256_cbor"}, {"tp_size": 2},
        {"groups": (keys.GroupIdentity(0, "SlidingWindowSpec(block_size=16)", ("l0", "l1"), 4096),)},
    ],
)
def test_anything_that_changes_bytes_changes_the_namespace(change: dict) -> None:
    assert keys.rank_namespace(_identity(**change), 0) != keys.rank_namespace(_identity(), 0)


def test_each_rank_has_its_own_namespace() -> None:
    ident = _identity(tp_size=2)
    assert keys.rank_namespace(ident, 0) != keys.rank_namespace(ident, 1)


def test_weights_digest_tracks_checkpoint_files(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text("{}")
    first = keys.weights_digest(str(tmp_path))
    assert first == keys.weights_digest(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)
    assert keys.weights_digest(str(tmp_path)) != first
    assert keys.weights_digest("org/hub-model-name") is None


def test_hash_seed_reproducibility(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert keys.hash_seed_is_reproducible("sha256")
    assert keys.hash_seed_is_reproducible("sha256_cbor")
    assert not keys.hash_seed_is_reproducible("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert keys.hash_seed_is_reproducible("xxhash")
    assert keys.hash_seed_is_reproducible("sha256")  # a pinned seed keeps sha256 reproducible too
