"""Trial: today's byte-plane + zstd codec (kvstrata.tiers.codec) against python-blosc2.

Question: would blosc2 (SIMD shuffle/bitshuffle + zstd clevel 1, its own threads, GIL released)
encode/decode KV records faster than the byte-plane codec at a compression ratio within 1% of it?

Run with an interpreter that has blosc2 next to numpy/zstandard/xxhash (see README.md), e.g.::

    /tmp/blosc-venv/bin/python benchmarks/codec_trial/blosc2_vs_planes.py --repeat 9

Every candidate works like the store does: encode returns one framed ``bytes``; decode writes into
a preallocated, already-touched destination (a slice of one big buffer, like the host slab) and
verifies the xxh3-64 checksum of what it wrote. The blosc2 candidates are framed the way we would
have to frame them (our 28-byte header with raw_len and xxh3-64 of the raw bytes, then the blosc2
chunk), so their timings include the same checksum work as today's codec.

Measurement: per repetition, every case and, inside a case, every candidate in a rotated order
(the candidates alternate, so a noisy neighbour on this shared 2-core machine hits all of them).
Each measurement runs over all records of the case (~16 MiB, beyond L2). "1c" = one caller
thread; "2c" = two caller threads in parallel (records split between them), like the disk tier's
two read/store threads. MB/s are of uncompressed KV (1 MB = 1e6 bytes). Figures are medians over
repetitions with min/max.

Prints one JSON object (also written to --out when given).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import inspect
import json
import os
import platform
import statistics
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import blosc2  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from kvstrata.bench.disk import bf16_bits, kv_channel_stats, synthetic_kv  # noqa: E402
from kvstrata.tiers import codec  # noqa: E402

MB = 1e6
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# Data


def _synthetic(nbytes: int, chunk_bytes: int, seed: int, fp32: bool,
               layers: int = 8, channels: int = 1024) -> np.ndarray:
    """bench_disk.synthetic_kv's model (lognormal channel scales, channel means, 2% outlier
    channels x10 on keys, K and V of successive layers alternating per chunk); bf16 bit patterns,
    or full-precision float32 when ``fp32``."""
    item = 4 if fp32 else 2
    rng = np.random.default_rng(seed)
    rows = max(1, chunk_bytes // (item * channels))
    n_chunks = max(1, nbytes // (rows * channels * item))
    stats = kv_channel_stats(rng, layers, channels)
    out = np.empty((n_chunks, rows, channels), dtype=np.float32 if fp32 else np.uint16)
    for i in range(n_chunks):
        scale, mean = stats[(i // 2) % layers][i % 2]
        x = rng.standard_normal((rows, channels), dtype=np.float32) * scale + mean
        out[i] = x if fp32 else bf16_bits(x)
    return out.reshape(-1)


def synthetic_bf16(nbytes: int, chunk_bytes: int, seed: int) -> tuple[np.ndarray, str]:
    return synthetic_kv(nbytes, chunk_bytes, seed), "kvstrata.bench.disk.synthetic_kv"


def engine_kv(pattern: str, dtype: str, limit: int) -> np.ndarray | None:
    """KV pages that vLLM wrote into kvstrata stores (e.g. the e2e tests' stores), decoded and
    de-duplicated by checksum, concatenated in key order. None when there are none."""
    try:
        import lmdb
    except ImportError:
        return None
    parts, seen, total = [], set(), 0
    for path in sorted(glob.glob(pattern)):
        try:
            env = lmdb.open(os.path.dirname(path), readonly=True, lock=False, max_dbs=8,
                            subdir=True)
        except lmdb.Error:
            continue
        try:
            db = env.open_db(b"payload", create=False)
            with env.begin() as txn:
                for _key, frame in txn.cursor(db):
                    try:
                        info = codec.frame_info(frame)
                        if info.dtype != dtype or info.checksum in seen:
                            continue
                        seen.add(info.checksum)
                        try:
                            raw = codec.decode(frame, key=bytes(_key)) if _HAS_KEY else None
                        except codec.CorruptRecord:
                            raw = None
                        if raw is None:
                            raw = codec.decode(frame)
                        parts.append(np.frombuffer(raw, dtype=np.uint8))
                        total += info.raw_len
                    except Exception:  # noqa: BLE001  (v2 frames need their key: skip)
                        continue
                    if total >= limit:
                        break
        except lmdb.Error:
            pass
        finally:
            env.close()
        if total >= limit:
            break
    if not parts:
        return None
    return np.concatenate(parts)[:limit]


# ---------------------------------------------------------------------------------------------
# Candidates

_HAS_KEY = "key" in inspect.signature(codec.encode).parameters


class Planes:
    """Today's codec, called as the store calls it."""

    name = "planes_zstd1 (today)"

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def encode(self, rec: memoryview, key: bytes) -> bytes:
        if _HAS_KEY:
            return codec.encode(rec, self.dtype, key=key)
        return codec.encode(rec, self.dtype)

    def decode_into(self, frame: bytes, out: memoryview, key: bytes) -> int:
        if _HAS_KEY:
            return codec.decode_into(frame, out, key=key)
        return codec.decode_into(frame, out)


# What a blosc2 frame would look like for us: our own magic/version/codec byte, raw_len and the
# xxh3-64 of the raw bytes (blosc2 chunks carry no content checksum), then the blosc2 chunk.
_B2_HEADER = struct.Struct("<4sBBBBQQ")
_B2_CODEC = 2  # hypothetical codec id "blosc2 chunk"


class Blosc2:
    def __init__(self, dtype: str, codec_: Any, clevel: int, filt: Any, nthreads: int,
                 blocksize: int = 0, splitmode: Any = None, label: str = "",
                 releasegil: bool = True) -> None:
        self.dtype = dtype
        # python-blosc2 holds the GIL in compress2/decompress2 unless set_releasegil(True)
        # (a process-wide switch, default False): measure() sets it around each candidate.
        self.releasegil = releasegil
        self.code, self.size = codec.DTYPES[dtype]
        kw = dict(codec=codec_, clevel=clevel, typesize=self.size, filters=[filt],
                  nthreads=nthreads, blocksize=blocksize)
        if splitmode is not None:
            kw["splitmode"] = splitmode
        self.cparams = blosc2.CParams(**kw)
        self.dparams = blosc2.DParams(nthreads=nthreads)
        self.name = label or (
            f"blosc2_{codec_.name.lower()}{clevel}_{filt.name.lower()}_nt{nthreads}"
            + (f"_bs{blocksize >> 10}k" if blocksize else "")
            + ("" if releasegil else "_GILheld"))

    def encode(self, rec: memoryview, key: bytes) -> bytes:
        checksum = xxhash.xxh3_64_intdigest(rec, seed=codec.key_seed(key) if _HAS_KEY else 0)
        chunk = blosc2.compress2(rec, cparams=self.cparams)
        header = _B2_HEADER.pack(b"KVSF", 3, _B2_CODEC, self.code, 1, len(rec), checksum)
        return b"".join((header, chunk))

    def decode_into(self, frame: bytes, out: memoryview, key: bytes) -> int:
        magic, version, cod, code, _np, raw_len, checksum = _B2_HEADER.unpack_from(frame, 0)
        if magic != b"KVSF" or version != 3 or cod != _B2_CODEC or code != self.code:
            raise codec.CorruptRecord("bad header")
        chunk = memoryview(frame)[_B2_HEADER.size:]
        nbytes, cbytes, _bs = blosc2.get_cbuffer_sizes(chunk)
        if nbytes != raw_len or cbytes != len(chunk) or len(out) < raw_len:
            raise codec.CorruptRecord("blosc2 chunk sizes disagree with the header")
        dst = out[:raw_len]
        blosc2.decompress2(chunk, dst=dst, dparams=self.dparams)
        seed = codec.key_seed(key) if _HAS_KEY else 0
        if xxhash.xxh3_64_intdigest(dst, seed=seed) != checksum:
            raise codec.CorruptRecord("checksum mismatch")
        return raw_len


def candidates(dtype: str, record: int) -> list[Any]:
    Z, L4, BL = blosc2.Codec.ZSTD, blosc2.Codec.LZ4, blosc2.Codec.BLOSCLZ
    SH, BS = blosc2.Filter.SHUFFLE, blosc2.Filter.BITSHUFFLE
    out: list[Any] = [Planes(dtype)]
    for nt in (1, 2):
        out.append(Blosc2(dtype, Z, 1, SH, nt))
        out.append(Blosc2(dtype, Z, 1, BS, nt))
    # python-blosc2's default: the GIL held during the call (2 caller threads serialise)
    out.append(Blosc2(dtype, Z, 1, SH, 1, releasegil=False))
    # best-ratio blosc2 zstd1 setting found while preparing: one block per record, always split
    out.append(Blosc2(dtype, Z, 1, SH, 1, blocksize=record, splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
                      label="blosc2_zstd1_shuffle_nt1_1block_split"))
    # references (blosc2's default clevel 5: at clevel 1 blosclz barely compresses)
    out.append(Blosc2(dtype, L4, 5, SH, 1))
    out.append(Blosc2(dtype, BL, 5, SH, 1))
    return out


# ---------------------------------------------------------------------------------------------
# Measurement


def _stat(xs: list[float]) -> dict[str, float]:
    nd = 2 if max(xs) < 10 else 0
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd),
            "max": round(max(xs), nd)}


class Case:
    def __init__(self, name: str, data: np.ndarray, dtype: str, record: int, source: str) -> None:
        flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        n = (flat.size // record) * record
        self.name, self.dtype, self.record, self.source = name, dtype, record, source
        self.src = flat[:n]
        self.recs = [memoryview(self.src[i : i + record]) for i in range(0, n, record)]
        self.keys = [b"\x00" * 16 + i.to_bytes(32, "big") + b"\x00" * 4
                     for i in range(len(self.recs))]
        self.sink = np.ones(n, dtype=np.uint8)  # touched destination, like the host slab
        self.outs = [memoryview(self.sink[i : i + record]) for i in range(0, n, record)]
        self.total = n


def _run_split(pool: ThreadPoolExecutor | None, fn: Callable[[int], Any], count: int
               ) -> tuple[float, float, list[Any]]:
    """Run fn(0..count-1) on 1 caller (pool None) or 2 callers; returns (wall, cpu, results)."""
    results: list[Any] = [None] * count
    c0, t0 = time.process_time(), time.perf_counter()
    if pool is None:
        for i in range(count):
            results[i] = fn(i)
    else:
        def part(k: int) -> None:
            for i in range(k, count, 2):
                results[i] = fn(i)
        futs = [pool.submit(part, k) for k in (0, 1)]
        for f in futs:
            f.result()
    return time.perf_counter() - t0, time.process_time() - c0, results


def measure(case: Case, cand: Any, pool: ThreadPoolExecutor, acc: dict[str, list[float]]
            ) -> bool:
    gil = getattr(cand, "releasegil", None)
    old = blosc2.set_releasegil(gil) if gil is not None else None
    try:
        return _measure(case, cand, pool, acc)
    finally:
        if old is not None:
            blosc2.set_releasegil(old)


def _measure(case: Case, cand: Any, pool: ThreadPoolExecutor, acc: dict[str, list[float]]
             ) -> bool:
    ok = True
    for mode, p in (("1c", None), ("2c", pool)):
        wall, cpu, frames = _run_split(p, lambda i: cand.encode(case.recs[i], case.keys[i]),
                                       len(case.recs))
        acc[f"encode_{mode}_MBps"].append(case.total / wall / MB)
        acc[f"encode_{mode}_cpus"].append(cpu / wall)
        acc[f"encode_{mode}_MB_per_cpu_s"].append(case.total / max(cpu, 1e-6) / MB)
        case.sink.fill(0)
        wall, cpu, got = _run_split(
            p, lambda i, fr=frames: cand.decode_into(fr[i], case.outs[i], case.keys[i]),
            len(case.recs))
        acc[f"decode_{mode}_MBps"].append(case.total / wall / MB)
        acc[f"decode_{mode}_cpus"].append(cpu / wall)
        acc[f"decode_{mode}_MB_per_cpu_s"].append(case.total / max(cpu, 1e-6) / MB)
        ok = ok and all(g == case.record for g in got) and bool(np.array_equal(case.sink, case.src))
    acc["_stored"].append(float(sum(len(f) for f in frames)))
    return ok


def ratio_sweep(case: Case) -> dict[str, float]:
    """Compression ratio only (framed, one pass) for blosc2 zstd clevels 1, 2, 3, 5."""
    out = {}
    for filt in (blosc2.Filter.SHUFFLE, blosc2.Filter.BITSHUFFLE):
        for cl in (1, 2, 3, 5):
            c = Blosc2(case.dtype, blosc2.Codec.ZSTD, cl, filt, 1)
            out[c.name.replace("_nt1", "")] = round(
                case.total / sum(len(c.encode(r, k)) for r, k in zip(case.recs, case.keys, strict=True)), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--mib", type=int, default=16, help="MiB of KV per case (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-glob", default="/tmp/eq/*/*/data.mdb",
                    help="kvstrata stores whose vLLM-written KV to add as extra cases ('' = none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    nbytes = args.mib * MiB
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]

    cases: list[Case] = []
    for rec in (256 << 10, 1 << 20, 2 << 20):
        data, src = synthetic_bf16(nbytes, rec, args.seed)
        cases.append(Case(f"bf16_{rec >> 10}KiB", data, "bfloat16", rec, "synthetic: " + src))
    cases.append(Case("fp32_1024KiB", _synthetic(nbytes, MiB, args.seed, True), "float32", MiB,
                      "synthetic: bench_disk.synthetic_kv model, full-precision float32"))
    engine_note = "none found"
    if args.engine_glob:
        for dtype, tag in (("bfloat16", "bf16"), ("float32", "fp32")):
            data = engine_kv(args.engine_glob, dtype, nbytes)
            if data is not None and data.size >= 4 * MiB:
                cases.append(Case(f"engine_{tag}_1024KiB", data, dtype, MiB,
                                  f"vLLM-written KV from stores {args.engine_glob} (tiny "
                                  "random-weight test models; NOT trained-model KV)"))
                engine_note = "see cases engine_*"

    cands = {c.name: candidates(c.dtype, c.record) for c in cases}
    accs = {c.name: {k.name: {} for k in cands[c.name]} for c in cases}
    oks = {c.name: {k.name: True for k in cands[c.name]} for c in cases}
    keys = [f"{op}_{m}_{u}" for op in ("encode", "decode") for m in ("1c", "2c")
            for u in ("MBps", "cpus", "MB_per_cpu_s")] + ["_stored"]
    for c in cases:
        for k in cands[c.name]:
            accs[c.name][k.name] = {key: [] for key in keys}

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="caller") as pool:
        # warm-up: thread-local contexts, scratch buffers, blosc2 init
        for c in cases:
            for k in cands[c.name]:
                measure(c, k, pool, {key: [] for key in keys})
        for rep in range(args.repeat):
            for c in cases:
                lst = cands[c.name]
                shift = rep % len(lst)
                order = lst[shift:] + lst[:shift]
                if rep % 2:
                    order.reverse()
                for k in order:
                    oks[c.name][k.name] &= measure(c, k, pool, accs[c.name][k.name])

    result: dict[str, Any] = {
        "question": "blosc2 (shuffle/bitshuffle + zstd clevel 1) vs byte planes + detuned zstd 1",
        "units": "MB/s of uncompressed KV (1e6 B/s); median/min/max over repetitions; "
                 "1c = one caller thread, 2c = two caller threads in parallel; cpus = process "
                 "CPU seconds per wall second during the measurement; MB_per_cpu_s = MB per "
                 "process CPU second (less sensitive to a busy neighbour than MB/s); blosc2 "
                 "candidates run with blosc2.set_releasegil(True) unless named _GILheld",
        "cases": {},
        "summary_medians": {},
    }
    for c in cases:
        base = None
        rows: dict[str, Any] = {}
        summ: dict[str, Any] = {}
        for k in cands[c.name]:
            a = accs[c.name][k.name]
            ratio = c.total / statistics.median(a["_stored"])
            if base is None:
                base = ratio
            row: dict[str, Any] = {key: _stat(a[key]) for key in keys if not key.startswith("_")}
            row.update(ratio=round(ratio, 4), ratio_vs_today=round(ratio / base, 4),
                       roundtrip_exact=oks[c.name][k.name])
            rows[k.name] = row
            summ[k.name] = {
                "enc_1c": row["encode_1c_MBps"]["median"], "dec_1c": row["decode_1c_MBps"]["median"],
                "enc_2c": row["encode_2c_MBps"]["median"], "dec_2c": row["decode_2c_MBps"]["median"],
                "enc_MB_per_cpu_s": row["encode_1c_MB_per_cpu_s"]["median"],
                "dec_MB_per_cpu_s": row["decode_1c_MB_per_cpu_s"]["median"],
                "ratio": row["ratio"], "ratio_vs_today": row["ratio_vs_today"],
                "exact": row["roundtrip_exact"]}
        result["cases"][c.name] = {"source": c.source, "dtype": c.dtype, "record_bytes": c.record,
                                   "records": len(c.recs), "candidates": rows,
                                   "ratio_sweep_blosc2": ratio_sweep(c)}
        result["summary_medians"][c.name] = summ

    codec_file = Path(codec.__file__)
    result["meta"] = {
        "repeat": args.repeat, "mib_per_case": args.mib, "engine_kv": engine_note,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "numpy": np.__version__, "blosc2": blosc2.__version__,
        "c_blosc2": blosc2.VERSION_STRING, "zstandard": __import__("zstandard").__version__,
        "xxhash": xxhash.VERSION,
        "codec_py_sha256": hashlib.sha256(codec_file.read_bytes()).hexdigest()[:16],
        "codec_keyed_checksum": _HAS_KEY,
        "loadavg_1m": {"before": round(load0, 2), "after": round(os.getloadavg()[0], 2)},
        "runtime_s": round(time.perf_counter() - t_start, 1),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
