"""Owner-only files by default: the modes kvstrata creates stores, lock files, archives and
temporary files with (``store_mode``), and the check that warns when a store is readable by
other users. Pure Python, beside ``config``.

A KV cache holds every prompt it served in a form prompts can be recovered from, so nothing
kvstrata creates is readable by other local users unless the operator asks for it: directories
0700 and files 0600 by default; ``store_mode`` (a directory mode such as ``0o750``) shares a
store within a group (files get the same bits without the execute ones: 0640). An existing
directory or file keeps its modes (an operator may have set them on purpose).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

DEFAULT_DIR_MODE = 0o700
MODE_BITS = 0o777


def file_mode(dir_mode: int) -> int:
    """The mode of files in a directory of ``dir_mode``: its read/write bits, no execute bit."""
    return dir_mode & 0o666


def check_dir_mode(mode: int) -> int:
    """``mode`` if it is a sensible store directory mode; ValueError naming the problem."""
    if not 0 <= mode <= MODE_BITS:
        raise ValueError(f"expected permission bits between 0000 and 0777, got {oct(mode)}")
    if mode & 0o700 != 0o700:
        raise ValueError(f"the owner needs rwx on the store directory (0700 in it), got {mode:04o}")
    if mode & 0o002:
        raise ValueError(f"a store must not be writable by every user, got {mode:04o}")
    return mode


def make_dirs(path: Path, mode: int = DEFAULT_DIR_MODE) -> None:
    """Create ``path`` and missing parents with ``mode`` exactly (the umask may only remove
    bits, so the mode is set after each mkdir). Existing directories keep their modes."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:  # made by another process meanwhile: its modes stay
            continue
        os.chmod(d, mode)


def exposed(path: Path) -> list[str]:
    """What other users may read in the store directory ``path``: a line per directory or file
    readable (or, for the directory, searchable) by others; empty when the store is private to
    its owner and group. Files that cannot be examined are skipped."""
    out: list[str] = []
    try:
        entries = [path, *sorted(p for p in path.iterdir() if p.is_file())]
    except OSError:
        return out
    for p in entries:
        try:
            mode = stat.S_IMODE(p.stat().st_mode)
        except OSError:
            continue
        if mode & 0o004 or (p == path and mode & 0o001):
            out.append(f"{p} is mode {mode:04o}: readable by every user")
    return out


def warn_if_readable(path: Path, logger: logging.Logger) -> list[str]:
    """Log (and return) a warning per part of the store ``path`` other users can read (the
    connector's start-up)."""
    lines = exposed(path)
    for line in lines:
        logger.warning("kvstrata: the store holds every cached prompt's KV, but %s; chmod it "
                       "(new stores are made with store_mode, default 0700)", line)
    return lines
