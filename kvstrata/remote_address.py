"""Where the shared tier lives (``remote_url``), parsed into what redis-py needs. Pure Python,
beside ``config``, which refuses a bad URL at start-up with it.

Accepted forms (``valkey`` may replace ``redis`` in every scheme):

* ``redis://[user:password@]host[:port][/db]`` — one server (TLS: ``rediss://``);
* ``redis+cluster://[user:password@]h1:p1,h2:p2[,...]`` — a Redis/Valkey cluster, any of its
  nodes as seeds (TLS: ``rediss+cluster://``; a cluster has only database 0).

Nothing here connects: a bad URL is refused at start-up with a message naming what is wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from urllib.parse import unquote

DEFAULT_PORT = 6379

_SCHEMES = {
    "redis": (False, False), "rediss": (True, False),
    "valkey": (False, False), "valkeys": (True, False),
    "redis+cluster": (False, True), "rediss+cluster": (True, True),
    "valkey+cluster": (False, True), "valkeys+cluster": (True, True),
}
_HOST_RE = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?")


class RemoteURLError(ValueError):
    """``remote_url`` is not a Redis/Valkey URL kvstrata understands; the message says why."""


@dataclass(frozen=True)
class RemoteAddress:
    """A parsed ``remote_url``."""

    nodes: tuple[tuple[str, int], ...]  # one for a single server; the seeds of a cluster
    cluster: bool = False
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a repr or a log
    # The URL's user part had no colon (``redis://word@host``): redis-py reads the word as a
    # password, but with the password given elsewhere (``with_password``) it is the user name.
    password_only: bool = field(default=False, repr=False, compare=False)

    def with_password(self, password: str) -> RemoteAddress:
        """This address with ``password`` from a file or the environment (kvstrata.auth):
        ``redis://USER@host`` then names the ACL user. RemoteURLError when the URL holds a
        password too."""
        if self.password_only:
            return replace(self, username=self.password, password=password, password_only=False)
        if self.password is not None:
            raise RemoteURLError("the URL holds a password and one is given from a file or the "
                                 "environment too; keep it out of the URL (vLLM logs it)")
        return replace(self, password=password)

    def redacted(self) -> str:
        """The URL without its password, for logs and statistics."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = f"{self.username or ''}:***@" if self.password is not None else (
            f"{self.username}@" if self.username else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{auth}{hosts}" + (f"/{self.db}" if self.db else "")


def parse_remote_url(url: str) -> RemoteAddress:
    """Parse ``url``; raises RemoteURLError naming the problem."""
    if not isinstance(url, str) or not url.strip():
        shown = _shown(url) if isinstance(url, str) else repr(url)
        raise RemoteURLError(f"expected a redis://, rediss://, valkey:// or redis+cluster:// URL, got {shown}")
    shown = _shown(url)  # in messages: never the password (they end up in logs)
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise RemoteURLError(
            f"unknown scheme in {shown}: expected one of {sorted(_SCHEMES)} followed by '://'")
    tls, cluster = _SCHEMES[scheme.lower()]
    if "?" in rest or "#" in rest:
        raise RemoteURLError(
            f"{shown}: query parameters and fragments are not supported; "
            "use kvstrata's remote_* options for timeouts and pool sizes")
    auth, at, hostpart = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon:  # redis://secret@host is a password-only URL in redis-py's reading
            username, password = None, unquote(user)
    hostpart, slash, db_text = hostpart.partition("/")
    db = 0
    if slash and db_text:
        if not db_text.isascii() or not db_text.isdigit() or int(db_text) > 65535:
            raise RemoteURLError(f"{shown}: the database must be a number, got {db_text!r}")
        db = int(db_text)
    if cluster and db:
        raise RemoteURLError(f"{shown}: a cluster has only database 0")
    if not hostpart:
        raise RemoteURLError(f"{shown}: no host")
    nodes = []
    for item in hostpart.split(","):
        m = _HOST_RE.fullmatch(item)
        if m is None:
            raise RemoteURLError(f"{shown}: {item!r} is not host[:port]")
        port = int(m.group("port")) if m.group("port") else DEFAULT_PORT
        if not 0 < port < 65536:
            raise RemoteURLError(f"{shown}: port {port} out of range")
        nodes.append((m.group("v6") or m.group("name"), port))
    if len(nodes) > 1 and not cluster:
        raise RemoteURLError(
            f"{shown}: several hosts need a cluster URL ({scheme}+cluster://...); "
            "a single server takes one host")
    return RemoteAddress(tuple(nodes), cluster=cluster, tls=tls, db=db, username=username,
                         password=password, password_only=bool(at) and ":" not in auth)


def _shown(url: str) -> str:
    """``repr(url)`` with its password (and any query, which may carry one) masked, for
    messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    auth, at, hostpart = rest.rpartition("@")  # as parse_remote_url splits it
    hostpart, q, _ = hostpart.partition("?")
    if at:
        user, colon, _ = auth.partition(":")
        hostpart = f"{user}:***@{hostpart}" if colon else f"***@{hostpart}"
    return repr(f"{scheme}{sep}{hostpart}" + ("?..." if q else ""))
