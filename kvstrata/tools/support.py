"""What every store tool (``kvstrata verify``, ``inspect``, ``compact``, ...) shares: opening a store with one-line errors, progress bars, arguments.

Errors are raised as :class:`kvstrata.tools.cli.CLIError` (printed as one line, exit status 2).
A tool must never create a store where the user pointed at something else, so opening is strict:
the directory must exist and hold a ``data.mdb`` unless the tool creates stores (``import``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lmdb

from kvstrata.config_values import ConfigError, parse_size
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore, StoreFormatError, StoreUnavailableError
from kvstrata.tools.cli import CLIError

# Tools that only delete never trigger the store's own budget eviction (it runs on puts), so
# they open with a budget no store reaches.
UNLIMITED = 1 << 62

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def check_store_dir(path: Path) -> None:
    """CLIError unless ``path`` holds a kvstrata store.

    Checked read-only before anything opens the store, without creating LMDB's lock file (a
    writable open of some other program's directory would leave lock files in it). Where the
    lock file exists, the store may be open and written right now, so the peek reads under it:
    an unlocked read can meet pages a live writer is reusing (next to two writers here, 2 of
    713,203 unlocked peeks called a live store "not a kvstrata store").
    """
    if not path.exists():
        raise CLIError(f"no store at {path}: the directory does not exist")
    if not path.is_dir():
        raise CLIError(f"{path} is not a directory (a store is a directory)")
    if not (path / rec.DATA_FILE).is_file():
        raise CLIError(f"{path} is not a kvstrata store (it has no {rec.DATA_FILE})")
    if (path / rec.DATA_FILE).stat().st_size == 0:
        raise CLIError(f"{path} is not a kvstrata store: its {rec.DATA_FILE} is empty (a failed copy?)")
    try:
        env = lmdb.open(str(path), readonly=True, lock=(path / rec.LMDB_LOCK_FILE).exists(),
                        max_dbs=4, subdir=True)
    except (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError) as exc:
        raise CLIError(f"{path} is not a kvstrata store ({rec.DATA_FILE} is not LMDB: {exc})") from None
    except lmdb.Error as exc:
        raise CLIError(f"cannot open {path}: {exc}") from None
    try:
        with env.begin() as txn:
            names = [txn.get(name) is not None for name in rec.DB_NAMES]
    finally:
        env.close()
    if not all(names):
        raise CLIError(f"{path} is not a kvstrata store (an LMDB environment without kvstrata's databases)")


def open_store(path: Path, *, readonly: bool, budget_bytes: int = UNLIMITED) -> DiskStore:
    """An existing store, read-only or writable; CLIError with the reason when it is not one."""
    check_store_dir(path)
    try:
        return DiskStore(path, budget_bytes=budget_bytes, readonly=readonly, create=False)
    except (StoreFormatError, StoreUnavailableError) as exc:
        raise CLIError(str(exc)) from None


def create_or_open_store(path: Path, *, budget_bytes: int) -> tuple[DiskStore, bool]:
    """A writable store at ``path``, created when the directory is missing or empty.

    Returns ``(store, created)``. A non-empty directory without a kvstrata store is refused: it
    belongs to something else.
    """
    if path.exists() and not path.is_dir():
        raise CLIError(f"{path} is not a directory (a store is a directory)")
    created = not path.exists() or not any(path.iterdir())
    if not created:
        check_store_dir(path)
    try:
        return DiskStore(path, budget_bytes=budget_bytes, create=True), created
    except (StoreFormatError, StoreUnavailableError) as exc:
        raise CLIError(str(exc)) from None


def size_arg(text: str) -> int:
    """argparse type for byte sizes: ``4GiB``, ``512MB``, ``1000000``."""
    try:
        return parse_size("size", text)
    except ConfigError:
        raise ValueError(text) from None


def duration_arg(text: str) -> float:
    """argparse type for durations: ``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w``."""
    m = _DURATION_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(text)
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


size_arg.__name__ = "size"  # argparse names the type in "invalid size value: 'x'"
duration_arg.__name__ = "duration"


def resolve_fingerprint(spec: str, candidates: Iterable[bytes]) -> bytes:
    """The one namespace whose hex starts with ``spec``; CLIError if none or several do."""
    want = spec.strip().lower()
    if not want or any(c not in "0123456789abcdef" for c in want):
        raise CLIError(f"fingerprint {spec!r} is not hexadecimal")
    known = sorted(set(candidates))
    matches = [ns for ns in known if ns.hex().startswith(want)]
    if not matches:
        listed = ", ".join(ns.hex() for ns in known) or "none"
        raise CLIError(f"no namespace starts with {want}; the store holds: {listed}")
    if len(matches) > 1:
        listed = ", ".join(ns.hex() for ns in matches)
        raise CLIError(f"fingerprint {want} is ambiguous ({listed}); give more digits")
    return matches[0]


def store_namespaces(store: DiskStore) -> list[bytes]:
    """Registered namespaces and namespaces found in keys (a record may outlive its entry)."""
    return sorted(set(store.namespaces()) | set(store.key_namespaces()))


def progress(total: int | None, desc: str, *, unit: str = "chunk", unit_bytes: bool = False) -> Any:
    """A tqdm bar on stderr when it is a terminal, a silent stand-in otherwise."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B" if unit_bytes else unit,
        unit_scale=unit_bytes,
        unit_divisor=1024 if unit_bytes else 1000,
        disable=not sys.stderr.isatty(),
        leave=False,
        file=sys.stderr,
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def warn(command: str, message: str) -> None:
    print(f"kvstrata {command}: warning: {message}", file=sys.stderr)
