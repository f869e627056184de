"""``RemoteStore``: the shared tier on a Redis or Valkey server (or cluster) every engine of a
deployment talks to (docs/DESIGN.md, "tiers/remote/").

One value per chunk and shard, under ``kvstrata:<namespace hex>:<chunk key hex>``: the same
self-describing frame the disk tier stores (``codec``), checksummed and bound to its store key,
so a value is served only under the key it was written for and never as metadata and data that
an eviction could separate. The server owns eviction (``maxmemory`` + ``allkeys-lru``): a value
gone by the time it is read is a miss, and a value that fails its check is a miss and is deleted.

Every method is called from a thread and answers within about ``connect_timeout_s +
timeout_s`` (writes: ``connect_timeout_s + write_timeout_s``); a failure (server down, hung,
restarted) opens the breaker (``breaker``), after which calls answer "miss / not stored" at once
until a background probe finds the server again. Nothing here raises into the hierarchy.

Writes run in the background (write-behind) and carry whole chunks (a 70B model's KV is 320 KiB
per token: a 128-token chunk is 40 MiB, and redis-py bounds a pipeline's whole send by the socket
timeout), so they have a deadline and a connection pool of their own: a write that takes longer
than a lookup may (a large value over a 1 GbE link, a server stalled by its own fork for a
snapshot) neither fails nor opens the breaker for the serving path, and a backlog of writes
never keeps a lookup waiting for a connection.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, TypeVar

import redis.exceptions as rex

from kvstrata.auth import ValueAuth, is_sealed
from kvstrata.remote_address import RemoteAddress, parse_remote_url
from kvstrata.tiers import codec
from kvstrata.tiers.codec import parse_mode as parse_codec_mode
from kvstrata.tiers.remote import client as rc
from kvstrata.tiers.remote.breaker import Breaker

if TYPE_CHECKING:
    from typing_extensions import Buffer

logger = logging.getLogger(__name__)
T = TypeVar("T")

KEY_PREFIX = b"kvstrata:"
NAMESPACE_BYTES = 16  # connector.keys: every store key starts with its shard's namespace

# Failures that say the server cannot be reached now: the breaker opens on them. Any other
# error (a server refusing one command) is counted and logged once per kind.
_UNAVAILABLE = (rex.ConnectionError, rex.TimeoutError, rex.BusyLoadingError, rex.ClusterDownError,
                rex.MasterDownError, rex.TryAgainError, OSError, TimeoutError, asyncio.TimeoutError)

COUNTERS = (
    "lookups", "lookup_keys", "lookup_found", "gets", "get_hits", "get_gone", "get_bytes",
    "get_raw_bytes", "puts", "put_bytes", "put_raw_bytes", "put_failed", "corrupt", "deleted",
    "touches", "errors", "unavailable", "skipped_unavailable", "forged", "sealed_skipped",
)


def remote_key(store_key: bytes, prefix: bytes = KEY_PREFIX) -> bytes:
    """The server key of a store key: ``kvstrata:<namespace hex>:<chunk key hex>``."""
    ns, chunk = store_key[:NAMESPACE_BYTES], store_key[NAMESPACE_BYTES:]
    return b"%s%s:%s" % (prefix, ns.hex().encode(), chunk.hex().encode())


class RemoteStore:
    """The shared tier (implements ``kvstrata.tiers.lower.LowerTier``).

    Args:
        url: ``remote_url`` (see ``address``), or an already parsed address.
        connect_timeout_s, timeout_s: TCP connect and per-reply socket timeouts; a call takes
            at most about their sum.
        write_timeout_s: the per-reply timeout of writes (one chunk each, in the background; at
            least ``timeout_s``): a write takes at most about ``connect_timeout_s +
            write_timeout_s``.
        max_connections: connection pool size (per node of a cluster), for reads and again
            for writes.
        probe_interval_s: how often a server found unavailable is asked again.
        ttl_s: expire values after this long (None: only the server's eviction removes them).
        codec: "auto" (byte planes + zstd, as on disk) or "raw".
        level: zstd level.
        auth: with it, every value written is ``MAGIC + MAC + frame`` (``kvstrata.auth``) and a
            value read is served only if its MAC is this secret's for its key and bytes; any
            other (no MAC, another secret's, forged) is a counted miss (``forged``) and is
            deleted. Without it, values carrying a MAC are misses left in place
            (``sealed_skipped``): this replica cannot check them.
        password: the password (from a file or the environment; ``RemoteAddress.with_password``).
        tls_ca_file: the CA bundle a TLS server's certificate must chain to (default: the
            system's); the host name is checked too.
    """

    tier_name = "remote"

    def __init__(
        self,
        url: str | RemoteAddress,
        *,
        connect_timeout_s: float = 0.2,
        timeout_s: float = 0.25,
        write_timeout_s: float = 2.0,
        max_connections: int = 16,
        probe_interval_s: float = 1.0,
        ttl_s: float | None = None,
        codec: str = "auto",
        level: int = 1,
        key_prefix: bytes = KEY_PREFIX,
        auth: ValueAuth | None = None,
        password: str | None = None,
        tls_ca_file: str | None = None,
    ) -> None:
        self.address = parse_remote_url(url) if isinstance(url, str) else url
        if password is not None:
            self.address = self.address.with_password(password)
        self._auth = auth
        self.url = self.address.redacted()
        self._mode = parse_codec_mode(codec)
        self._level = level
        self._prefix = key_prefix
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        write_timeout_s = max(write_timeout_s, timeout_s)
        self._deadline = connect_timeout_s + timeout_s
        self._write_deadline = connect_timeout_s + write_timeout_s
        self.on_removed: Callable[[list[bytes]], None] | None = None
        self.on_available: Callable[[], None] | None = None
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._counts_lock = threading.Lock()
        self._error_kinds: set[str] = set()
        self._breaker = Breaker(f"remote tier {self.url}", probe_interval_s)
        self._probing = False
        self._closed = False
        self._loop = rc.RemoteLoop("kvstrata-remote")
        # Writes sent at once: no more than the write pool's connections (``_send_puts``).
        self._write_slots = asyncio.Semaphore(max_connections)
        self._puts_inflight: set[Future[list[bool]]] = set()

        async def create(timeout: float) -> Any:
            return rc.make_client(self.address, connect_timeout_s=connect_timeout_s,
                                  timeout_s=timeout, max_connections=max_connections,
                                  tls_ca_file=tls_ca_file)

        self._client = self._loop.submit(create(timeout_s)).result(10)
        self._writer = self._loop.submit(create(write_timeout_s)).result(10)

    # ---- LowerTier ----------------------------------------------------------------------------

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        found = self._call(rc.exists_many(self._client, [self._rkey(k) for k in keys]), None)
        self._bump(lookups=1, lookup_keys=len(keys), lookup_found=sum(found) if found else 0)
        return found if found is not None else [False] * len(keys)

    def get_into(self, key: bytes, out: Buffer) -> int | None:
        return self.get_many_into([(key, out)])[0]

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[int | None]:
        """Fetch several records in one round trip and decode each into its buffer: bytes
        written per item, or None (miss, gone, damaged: a damaged value is deleted)."""
        if not items:
            return []
        values = self._call(rc.get_many(self._client, [self._rkey(k) for k, _ in items]), None)
        if values is None:
            return [None] * len(items)
        out: list[int | None] = []
        bad: list[bytes] = []
        forged: list[bytes] = []
        got = gone = got_bytes = raw = sealed = 0
        for (key, buf), value in zip(items, values, strict=True):
            if value is None:
                gone += 1
                out.append(None)
                continue
            frame: Any = value
            if self._auth is not None:
                frame = self._auth.open(key, value)
                if frame is None:  # checked before a byte of it is decoded or served
                    self._forged(key)
                    forged.append(key)
                    out.append(None)
                    continue
            elif is_sealed(value):
                sealed += 1
                out.append(None)
                continue
            try:
                n = codec.decode_into(frame, buf, key=key)
            except (codec.CorruptRecord, ValueError) as exc:
                logger.warning("kvstrata: %s: value of %s is damaged (%s); deleted",
                               self.url, self._rkey(key).decode(), exc)
                bad.append(key)
                out.append(None)
                continue
            got += 1
            got_bytes += len(value)
            raw += n
            out.append(n)
        self._bump(gets=len(items), get_hits=got, get_gone=gone, get_bytes=got_bytes,
                   get_raw_bytes=raw, corrupt=len(bad), forged=len(forged), sealed_skipped=sealed)
        if bad or forged:
            self._delete(bad + forged, wait=False)
        return out

    def put_many(self, entries: Sequence[tuple[bytes, Buffer, str]]) -> int:
        encoded = self._encode_puts(entries)
        if encoded is None:
            return 0
        frames, raw = encoded
        # Bounded twice over: a wait for a write connection and the write, each by the deadline.
        ok = self._call(self._send_puts(frames, self._write_deadline), None, 2 * self._write_deadline + 1.0)
        return self._count_puts(raw, frames, ok)

    def put_many_then(self, entries: Sequence[tuple[bytes, Buffer, str]], done: Callable[[int], None]) -> None:
        """``put_many`` without waiting for the server: encodes in the calling thread, hands
        the values to the loop and returns; ``done(stored)`` is called once, on the loop's
        thread when the server answers (or the write fails or the store closes), in this
        thread when nothing is sent. So an idle-priority caller, which a busy CPU may not run
        again for a second, neither holds up the report of a stored write nor waits out the
        round trip (docs/BENCHMARKS.md, "A write is reported when it commits")."""
        encoded = self._encode_puts(entries)
        if encoded is None:
            done(0)
            return
        frames, raw = encoded
        # No deadline on the wait for a connection: the write-behind bounds what is in flight.
        future = self._submit(self._send_puts(frames, None), None)
        if future is None:
            done(self._count_puts(raw, frames, None))
            return

        def answered(fut: Future[list[bool]]) -> None:
            with self._counts_lock:
                self._puts_inflight.discard(fut)
            done(self._count_puts(raw, frames, self._outcome(fut, None)))

        with self._counts_lock:  # close() fails what the loop did not finish
            self._puts_inflight.add(future)
        future.add_done_callback(answered)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        return self._delete(list(keys), wait=True)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        # Keeps the server's LRU in step with host hits; the caller (a lookup) never waits.
        if keys and self._breaker.up and not self._closed:
            self._bump(touches=len(keys))
            self._loop.submit(self._quiet(rc.touch_many(self._client, [self._rkey(k) for k in keys])))

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            out: dict[str, Any] = dict(self._counts)
        out.update(url=self.url, available=int(self._breaker.up),
                   state_changes=self._breaker.state_changes, last_error=self._breaker.last_error)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.submit(self._shutdown()).result(2 * self._deadline + 1.0)
        except Exception:  # closing a dead server's connections: nothing to do about it
            pass
        self._loop.stop()
        with self._counts_lock:
            unfinished = list(self._puts_inflight)
        for future in unfinished:  # the loop never got to them: their callers hear "not stored"
            future.cancel()

    async def _shutdown(self) -> None:
        """On the loop: end what runs behind the callers (touches, deletions of damaged values,
        the probe), then close the connections. A task left pending when the loop stops is
        destroyed later by the garbage collector, mid-command, with "Task was destroyed but it
        is pending" and an exception from redis-py that finds no running loop."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for client in (self._client, self._writer):
            await asyncio.wait_for(client.aclose(), self._deadline)

    # ---- server information (tools, tests, benchmarks) -------------------------------------

    @property
    def available(self) -> bool:
        return self._breaker.up

    def server_info(self) -> dict[str, Any] | None:
        """The server's INFO (memory, stats, keyspace), or None when it cannot be asked."""
        return self._call(self._client.info(), None)

    # ---- internals ---------------------------------------------------------------------------

    def _value(self, key: bytes, frame: bytes) -> bytes:
        return frame if self._auth is None else self._auth.seal(key, frame)

    def _forged(self, key: bytes) -> None:
        if "forged" not in self._error_kinds:  # once: a flood of forged values must not flood logs
            self._error_kinds.add("forged")
            logger.warning("kvstrata: %s: value of %s has no valid MAC for this replica's auth key "
                           "(written without it, by a replica with another key, or forged); not "
                           "served, deleted, counted as remote_forged (logged once)",
                           self.url, self._rkey(key).decode())

    def _rkey(self, key: bytes) -> bytes:
        return remote_key(key, self._prefix)

    def _bump(self, **counts: int) -> None:
        with self._counts_lock:
            for name, n in counts.items():
                self._counts[name] += n

    def _encode_puts(self, entries: Sequence[tuple[bytes, Buffer, str]]
                     ) -> tuple[list[tuple[bytes, bytes]], list[int]] | None:
        """The server keys and values of ``entries``, and their raw sizes; None (counted) when
        nothing is to be sent."""
        if not entries:
            return None
        if not self._breaker.up or self._closed:  # before the encoding: nothing will be sent
            self._bump(skipped_unavailable=1, put_failed=len(entries))
            return None
        frames = [(self._rkey(key), self._value(key, codec.encode(data, dtype, key=key, level=self._level,
                                                                  mode=self._mode)))
                  for key, data, dtype in entries]
        return frames, [memoryview(data).nbytes for _, data, _ in entries]

    async def _send_puts(self, frames: list[tuple[bytes, bytes]], slot_wait_s: float | None) -> list[bool]:
        """On the loop: SET the values once a write connection is free (waiting at most
        ``slot_wait_s``; None: as long as it takes), within the write deadline. Writes beyond the
        pool wait here rather than in redis-py's pool, whose wait would time out as an outage."""
        try:
            await asyncio.wait_for(self._write_slots.acquire(), slot_wait_s)
        except TimeoutError:  # every connection busy with other writes: not stored, no outage
            return [False] * len(frames)
        try:
            return await asyncio.wait_for(rc.set_many(self._writer, frames, self._ttl_ms), self._write_deadline)
        finally:
            self._write_slots.release()

    def _count_puts(self, raw: list[int], frames: list[tuple[bytes, bytes]], ok: list[bool] | None) -> int:
        """Count a write's outcome (``ok``: per value, None when the call failed): how many stored."""
        done = ok or [False] * len(frames)
        stored = sum(done)
        # Bytes of the values the server took (all, or none when the call failed).
        self._bump(puts=stored, put_failed=len(frames) - stored,
                   put_bytes=sum(len(f) for (_, f), taken in zip(frames, done, strict=True) if taken),
                   put_raw_bytes=sum(n for n, taken in zip(raw, done, strict=True) if taken))
        return stored

    def _submit(self, coro: Coroutine[Any, Any, T], deadline: float | None) -> Future[T] | None:
        """Start a command batch on the loop, cancelled after ``deadline`` (None: the coroutine
        bounds itself); None (counted) when the breaker is open or the store closed."""
        if not self._breaker.up or self._closed:
            coro.close()
            self._bump(skipped_unavailable=1)
            return None
        bounded = coro if deadline is None else asyncio.wait_for(coro, deadline)
        try:
            return self._loop.submit(bounded)
        except RuntimeError:  # closed meanwhile: its loop is gone
            bounded.close()
            coro.close()  # never started: closed, or Python warns it was never awaited
            self._bump(skipped_unavailable=1)
            return None

    def _outcome(self, future: Future[T], default: Any, wait_s: float | None = None) -> Any:
        """A submitted batch's result (waiting at most ``wait_s``), or ``default`` when it
        failed: counted, and the breaker opened if the server is unavailable."""
        try:
            return future.result(wait_s)
        except CancelledError:  # the store closed under it
            return default
        except _UNAVAILABLE as exc:
            self._unavailable(exc)
        except Exception as exc:
            self._error(exc)
        return default

    def _call(self, coro: Coroutine[Any, Any, T], default: Any, deadline: float | None = None) -> Any:
        """Run a command batch on the loop within ``deadline`` (the tier's, by default) and
        wait for it; ``default`` when the breaker is open or the call fails (counted, and the
        breaker opened if the server is unavailable)."""
        deadline = self._deadline if deadline is None else deadline
        future = self._submit(coro, deadline)
        return default if future is None else self._outcome(future, default, deadline + 1.0)

    async def _quiet(self, coro: Any) -> None:
        try:
            await asyncio.wait_for(coro, self._deadline)
        except _UNAVAILABLE as exc:
            self._unavailable(exc)
        except Exception as exc:
            self._error(exc)

    def _delete(self, keys: list[bytes], wait: bool) -> int:
        if not keys:
            return 0
        if wait:
            n = self._call(rc.delete_many(self._client, [self._rkey(k) for k in keys]), None)
            if n is None:  # not deleted (server unavailable): nothing to count or tell
                return 0
        else:
            n = 0
            self._loop.submit(self._quiet(rc.delete_many(self._client, [self._rkey(k) for k in keys])))
        self._bump(deleted=len(keys))
        if self.on_removed is not None:
            try:
                self.on_removed(keys)
            except Exception:
                logger.exception("kvstrata: %s: on_removed callback failed", self.url)
        return n

    def _unavailable(self, exc: BaseException) -> None:
        self._bump(unavailable=1)
        if self._breaker.failed(exc) and not self._closed:
            self._loop.submit(self._probe())

    def _error(self, exc: BaseException) -> None:
        self._bump(errors=1)
        kind = type(exc).__name__
        if kind not in self._error_kinds:  # once per kind: a refusing server must not flood logs
            self._error_kinds.add(kind)
            logger.warning("kvstrata: %s refused a command (%s: %s); counted as misses",
                           self.url, kind, exc)

    async def _probe(self) -> None:
        """Until the server answers again (on the loop): drop the pool's connections (a
        restarted server closed them all), wait, PING."""
        if self._probing:
            return
        self._probing = True
        try:
            while not self._closed and not self._breaker.up:
                await self._reset_connections()
                await asyncio.sleep(self._breaker.probe_interval_s)
                try:
                    await asyncio.wait_for(rc.ping(self._client), self._deadline)
                except Exception as exc:
                    self._breaker.note(exc)
                    continue
                if self._breaker.recovered():
                    self._tell_available()
        finally:
            self._probing = False

    def _tell_available(self) -> None:
        if self.on_available is not None and not self._closed:
            try:
                self.on_available()
            except Exception:
                logger.exception("kvstrata: %s: on_available callback failed", self.url)

    async def _reset_connections(self) -> None:
        for client in (self._client, self._writer):
            try:
                pool = getattr(client, "connection_pool", None)
                if pool is not None:
                    await pool.disconnect()
                else:  # a cluster client: rediscover the nodes on its next command
                    await client.aclose()
            except Exception:
                pass
