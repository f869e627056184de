"""Secrets that never sit in the JSON config (vLLM logs its whole ``kv_transfer_config``): the
value-authentication key and the shared tier's password, each read from a file named in the
config or from an environment variable; and the MAC that authenticates stored values.

``ValueAuth`` is keyed BLAKE3 (a 256-bit tag) over the store key and the codec frame: a writer
without the secret cannot make a value a reader with it accepts, and a value written under one
key is refused under another. BLAKE3 rather than hashlib's BLAKE2b: both are keyed PRFs of the
same strength, and BLAKE3 hashes about 5 GB/s on one core where BLAKE2b manages about 0.6, which
kept the authenticated load within the issue's 0.9x (``kvstrata bench remote``).

Nothing here puts a secret in a message, a repr or a log line. Pure Python, beside ``config``.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from kvstrata.config_values import ConfigError
from kvstrata.remote_address import RemoteURLError, parse_remote_url

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvstrata.config import StrataConfig

REMOTE_AUTH_KEY_ENV = "KVSTRATA_REMOTE_AUTH_KEY"
DISK_AUTH_KEY_ENV = "KVSTRATA_AUTH_KEY"
REMOTE_PASSWORD_ENV = "KVSTRATA_REMOTE_PASSWORD"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
TAG_BYTES = 32
_CONTEXT = "kvstrata 2026-12 stored value MAC v1"


class SecretError(ValueError):
    """A secret could not be read or is unusable; the message names its source, never its value."""


def read_secret(path: Path | None, env_var: str, what: str, *, minimum: int = MIN_SECRET_BYTES) -> bytes | None:
    """The secret in the file ``path`` (one trailing newline dropped), else in ``$env_var``, else
    None. A file readable by other users is refused: it would defeat the secret."""
    if path is not None:
        try:
            st = os.stat(path)
            if stat.S_IMODE(st.st_mode) & 0o004:
                raise SecretError(f"{what} file {path} is readable by every user (mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}); chmod o-r it")
            data = Path(path).read_bytes()
        except OSError as exc:
            raise SecretError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
        source = f"{what} file {path}"
    else:
        env = os.environ.get(env_var)
        if env is None:
            return None
        data, source = env.encode(), f"${env_var}"
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if len(data) < minimum:
        raise SecretError(f"{source}: the {what} must be at least {minimum} bytes, got {len(data)}")
    if len(data) > MAX_SECRET_BYTES:
        raise SecretError(f"{source}: the {what} must be at most {MAX_SECRET_BYTES} bytes, got {len(data)}")
    return data


def read_password(path: Path | None) -> str | None:
    """The shared tier's password: the file ``path`` (one trailing newline dropped), else
    ``$KVSTRATA_REMOTE_PASSWORD``, else None."""
    data = read_secret(path, REMOTE_PASSWORD_ENV, "remote password", minimum=1)
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise SecretError("the remote password is not UTF-8 text") from None


class ValueAuth:
    """The MAC of stored values under one secret. ``seal``/``open`` frame a value as
    ``MAGIC + tag + frame`` (the shared tier); ``tag``/``verify`` give the bare tag (the disk
    keeps it in the index record)."""

    MAGIC = b"KVSA"
    HEADER = len(MAGIC) + TAG_BYTES

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"an authentication key must be at least {MIN_SECRET_BYTES} bytes")
        self._key = blake3.blake3(secret, derive_key_context=_CONTEXT).digest()

    def __repr__(self) -> str:
        return "ValueAuth(<secret>)"

    def tag(self, store_key: bytes, frame: Buffer) -> bytes:
        h = blake3.blake3(key=self._key)
        h.update(len(store_key).to_bytes(4, "big"))
        h.update(store_key)
        h.update(frame)
        return h.digest(TAG_BYTES)

    def verify(self, store_key: bytes, frame: Buffer, tag: bytes) -> bool:
        return len(tag) == TAG_BYTES and hmac.compare_digest(self.tag(store_key, frame), tag)

    def seal(self, store_key: bytes, frame: bytes) -> bytes:
        return self.MAGIC + self.tag(store_key, frame) + frame

    def open(self, store_key: bytes, value: bytes) -> memoryview | None:
        """The frame inside an authentic ``value`` of ``store_key`` (zero-copy), or None: no
        tag, or a tag this secret did not make for this key and these bytes."""
        view = memoryview(value)
        if len(view) < self.HEADER or view[:4] != self.MAGIC:
            return None
        frame = view[self.HEADER:]
        return frame if self.verify(store_key, frame, bytes(view[4:self.HEADER])) else None


def is_sealed(value: bytes) -> bool:
    """Whether ``value`` carries a MAC header (written by a replica with a key)."""
    return value[:4] == ValueAuth.MAGIC


def read_secrets(cfg: StrataConfig) -> tuple[ValueAuth | None, ValueAuth | None, str | None]:
    """The disk tier's and the shared tier's value MACs and the shared tier's password, from
    the files the options name or the environment (never from the config itself);
    ConfigError naming the source (never the secret) when one cannot be used."""
    try:
        disk_key = read_secret(cfg.auth_key_file, DISK_AUTH_KEY_ENV, "auth key") if cfg.disk else None
        remote_key = password = None
        if cfg.remote_url is not None:
            remote_key = read_secret(cfg.remote_auth_key_file, REMOTE_AUTH_KEY_ENV, "remote auth key")
            password = read_password(cfg.remote_password_file)
            if password is not None:
                try:
                    parse_remote_url(cfg.remote_url).with_password(password)
                except RemoteURLError as exc:
                    raise SecretError(f"'remote_url': {exc}") from None
    except SecretError as exc:
        raise ConfigError(f"kvstrata: {exc}") from None
    return (None if disk_key is None else ValueAuth(disk_key),
            None if remote_key is None else ValueAuth(remote_key), password)
