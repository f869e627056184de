"""One option's value, parsed and checked: byte sizes, seconds, paths, file modes, choices.

Every check takes the option's key and its raw value (from vLLM's JSON config) and returns the
value kvstrata uses, or raises ``ConfigError`` naming the key; ``config.StrataConfig`` maps each
key to its check.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvstrata import fsmode
from kvstrata.remote_address import RemoteURLError, parse_remote_url

MAX_SIZE_BYTES = 1 << 60  # 1 EiB: beyond any disk or memory, still a 64-bit count

# Numbers in strings are ASCII only: no Unicode digits ("²", "٤"), "nan", "inf" or underscores.
_INT_RE = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_SHARE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*", re.ASCII)
_MAX_RESERVE_SHARE = 50  # per cent of the file system
_SIZE_RE = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))\s*([a-z]*)\s*", re.ASCII | re.IGNORECASE)
_SECONDS_RE = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?\s*", re.ASCII | re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}


class ConfigError(ValueError):
    """A kvstrata option is unknown or has a bad value; the message names the key."""


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"4GiB"`` / ``"512 MB"``, at most 1 EiB."""
    number: Decimal | None = None
    unit = ""
    if isinstance(value, bool):
        pass
    elif isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        number = Decimal(value)
    elif isinstance(value, str) and (m := _SIZE_RE.fullmatch(value)):
        number, unit = Decimal(m.group(1)), m.group(2).lower()
        if unit not in _UNITS:
            raise ConfigError(f"kvstrata option {key!r}: unknown size unit in {shown(value)}")
    if number is None:
        raise ConfigError(
            f"kvstrata option {key!r}: expected a byte size (int or e.g. '4GiB'), got {shown(value)}"
        )
    if number < 0:
        raise ConfigError(f"kvstrata option {key!r}: must not be negative, got {shown(value)}")
    if number > Fraction(MAX_SIZE_BYTES, _UNITS[unit]):  # exact, before any arithmetic on it
        raise ConfigError(
            f"kvstrata option {key!r}: must be at most {MAX_SIZE_BYTES} bytes (1 EiB), got {shown(value)}"
        )
    size = Fraction(number) * _UNITS[unit]  # exact: no float rounds "1.5GiB" or 2**53 + 1
    if size.denominator != 1:
        raise ConfigError(f"kvstrata option {key!r}: not a whole number of bytes: {shown(value)}")
    return int(size)


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut short: a 5000-digit value is not echoed whole."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (sys.get_int_max_str_digits)
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} chars)"


def expand_path(value: Any) -> Path:
    """``value`` as a path with ``~`` expanded; ValueError (the reason) when it cannot be one."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a directory path, got {shown(value)}")
    if "\0" in text:
        raise ValueError(f"path contains a NUL byte: {shown(text)}")
    try:
        return Path(text).expanduser()
    except RuntimeError:  # "~user" with no such user, or no home directory
        raise ValueError(f"cannot expand '~' in {shown(text)}") from None


def as_path(key: str, value: Any) -> Path:
    try:
        return expand_path(value)
    except ValueError as exc:
        raise ConfigError(f"kvstrata option {key!r}: {exc}") from None


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"kvstrata option {key!r}: expected true or false, got {shown(value)}")


def int_range(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(key: str, value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = Decimal(value)
        elif isinstance(value, str) and _INT_RE.fullmatch(value):
            number = Decimal(value)  # exact, and no limit on digits as int() has
        else:
            raise ConfigError(f"kvstrata option {key!r}: expected an integer, got {shown(value)}")
        if not lo <= number <= hi:
            raise ConfigError(f"kvstrata option {key!r}: must be in [{lo}, {hi}], got {shown(value)}")
        return int(number)

    return check


def choice(*choices: str) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(
                f"kvstrata option {key!r}: expected one of {list(choices)}, got {shown(value)}"
            )
        return value

    return check


def admission(key: str, value: Any) -> int:
    # "all" admits every chunk to disk; N admits a chunk once it was offered N times (SSD wear).
    if value == "all":
        return 1
    return _admission_count(key, value)


_admission_count = int_range(1, 2**31 - 1)


def optional_seconds(key: str, value: Any) -> float | None:
    if value is None:
        return None
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            seconds = math.inf
    elif isinstance(value, str) and _SECONDS_RE.fullmatch(value):
        seconds = float(value)  # "1e400" -> inf, "1e-400" -> 0.0: both refused below
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"kvstrata option {key!r}: expected a positive finite number of seconds or null, "
            f"got {shown(value)}"
        )
    return seconds


def optional_path(key: str, value: Any) -> Path | None:
    return None if value is None else as_path(key, value)


def auto_or(validate: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value == "auto":
            return "auto"
        try:
            return validate(key, value)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (or \"auto\")") from None

    return check


def optional_file(key: str, value: Any) -> Path | None:
    """A path to a file holding a secret (or a CA bundle), or null; a secret itself is refused
    in so far as it cannot be a path. The file is read at start-up (kvstrata.auth)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip() or "\0" in os.fspath(value):
        raise ConfigError(f"kvstrata option {key!r}: expected the path of a file, got a {type(value).__name__}")
    return Path(os.fspath(value)).expanduser()


def dir_mode(key: str, value: Any) -> int:
    """A directory mode: an octal string ("0750", "750", "0o750") or an int (0o750)."""
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"(?:0o?)?[0-7]{3}", value.strip(), re.ASCII):
        mode = int(value.strip().removeprefix("0o"), 8)
    if mode is None:
        raise ConfigError(f"kvstrata option {key!r}: expected an octal mode such as \"0750\", got {shown(value)}")
    try:
        return fsmode.check_dir_mode(mode)
    except ValueError as exc:
        raise ConfigError(f"kvstrata option {key!r}: {exc}") from None


def non_negative_seconds(key: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    return _seconds(key, value, "a finite number of seconds, 0 or more")


def positive_seconds(key: str, value: Any) -> float:
    return _seconds(key, value, "a positive finite number of seconds")


def _seconds(key: str, value: Any, expected: str) -> float:
    try:
        seconds = None if value is None else optional_seconds(key, value)
    except ConfigError:
        seconds = None
    if seconds is None:
        raise ConfigError(f"kvstrata option {key!r}: expected {expected}, got {shown(value)}")
    return seconds


def remote_url(key: str, value: Any) -> str | None:
    """A ``redis://``, ``rediss://``, ``valkey://`` or ``redis+cluster://`` URL, or null (off).
    Parsed here only to refuse a bad one at start-up (remote_address.py)."""
    if value is None:
        return None
    try:
        parse_remote_url(value)
    except RemoteURLError as exc:
        raise ConfigError(f"kvstrata option {key!r}: {exc}") from None
    return str(value).strip()


def reserve_share(text: str) -> Fraction:
    """The per cent of a ``disk_reserve`` share ("5%" -> 5), as ``disk_reserve`` accepted it."""
    m = _SHARE_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"not a share of the file system: {shown(text)}")
    return Fraction(m.group(1))


def disk_reserve(key: str, value: Any) -> int | str:
    """A byte size, or a share of the file system such as "5%" (at most 50 %)."""
    if isinstance(value, str) and "%" in value:
        m = _SHARE_RE.fullmatch(value)
        if m is None or Fraction(m.group(1)) > _MAX_RESERVE_SHARE:
            raise ConfigError(f"kvstrata option {key!r}: expected a byte size or a share from 0% to "
                              f"{_MAX_RESERVE_SHARE}% of the file system, got {shown(value)}")
        return value.strip()
    return parse_size(key, value)


def min_size(key: str, value: Any, minimum: int) -> int:
    size = parse_size(key, value)
    if size < minimum:
        raise ConfigError(f"kvstrata option {key!r}: must be at least {minimum} bytes, got {value!r}")
    return size
