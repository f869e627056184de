"""Does a call release the GIL? Each call runs on a big buffer in a thread while the main thread
spins a Python loop; the longest gap between loop iterations is the stall. A call that holds the
GIL stalls the loop for about its whole duration.

    /tmp/blosc-venv/bin/python benchmarks/codec_trial/gil_probe.py
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import blosc2
import numpy as np
import xxhash
import zstandard as zstd

N = 256 << 20


def _cparams(nthreads: int) -> blosc2.CParams:
    return blosc2.CParams(typesize=2, clevel=1, codec=blosc2.Codec.ZSTD,
                          filters=[blosc2.Filter.SHUFFLE], nthreads=nthreads)


def _released(fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        old = blosc2.set_releasegil(True)
        try:
            return fn()
        finally:
            blosc2.set_releasegil(old)
    return call


def probe(fn: Callable[[], object], tries: int = 3) -> tuple[float, float]:
    """(median call duration, median longest main-thread stall), seconds."""
    res = []
    for _ in range(tries):
        done = threading.Event()
        dur = [0.0]

        def work(done: threading.Event = done, dur: list[float] = dur) -> None:
            t = time.perf_counter()
            fn()
            dur[0] = time.perf_counter() - t
            done.set()

        th = threading.Thread(target=work)
        last = time.perf_counter()
        gap = 0.0
        th.start()
        while not done.is_set():
            now = time.perf_counter()
            gap = max(gap, now - last)
            last = now
        th.join()
        res.append((dur[0], gap))
    return sorted(r[0] for r in res)[tries // 2], sorted(r[1] for r in res)[tries // 2]


def main() -> None:
    rng = np.random.default_rng(0)
    words = (rng.standard_normal(N // 2, dtype=np.float32) * 2).view(np.uint32)
    bf = (words >> 16).astype(np.uint16).view(np.uint8)  # bf16 bit patterns
    lo, hi = np.ascontiguousarray(bf[0::2]), np.ascontiguousarray(bf[1::2])
    packed = zstd.ZstdCompressor(level=1).compress(hi)
    dz = zstd.ZstdDecompressor()
    chunk = blosc2.compress2(bf, cparams=_cparams(1))
    dst = np.empty(bf.size, np.uint8)
    out = dst.view(np.uint16)

    def join() -> None:
        np.left_shift(hi, 8, out=out, dtype=np.uint16)
        np.bitwise_or(out, lo, out=out, dtype=np.uint16)

    def b2_dec(nt: int) -> Callable[[], object]:
        return lambda: blosc2.decompress2(chunk, dst=dst, dparams=blosc2.DParams(nthreads=nt))

    def b2_enc() -> object:
        return blosc2.compress2(bf, cparams=_cparams(1))

    tests: dict[str, Callable[[], object]] = {
        "xxh3_64(256MiB)": lambda: xxhash.xxh3_64_intdigest(bf),
        "zstd.decompress(128MiB plane)": lambda: dz.decompress(packed),
        "zstd.compress(128MiB plane)": lambda: zstd.ZstdCompressor(level=1).compress(hi),
        "numpy plane join (left_shift+or)": join,
        "blosc2.decompress2 nt1 (256MiB)": b2_dec(1),
        "blosc2.compress2 nt1 (256MiB)": b2_enc,
        "blosc2.decompress2 nt1, set_releasegil(True)": _released(b2_dec(1)),
        "blosc2.compress2 nt1, set_releasegil(True)": _released(b2_enc),
        "blosc2.decompress2 nt2 (default GIL)": b2_dec(2),
    }
    sys.setswitchinterval(0.001)
    for name, fn in tests.items():
        d, g = probe(fn)
        verdict = "HOLDS GIL" if g > 0.5 * d else "releases GIL"
        print(f"{name:46s} call {d * 1e3:7.1f} ms  longest main-thread stall "
              f"{g * 1e3:7.1f} ms  -> {verdict}")


if __name__ == "__main__":
    main()
