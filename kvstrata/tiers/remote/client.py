"""The redis-py asyncio client kvstrata's shared tier talks through, and the batched commands it
sends. Every command batch is one pipelined round trip (per node of a cluster); nothing here
retries: the serving path answers a miss instead (see ``breaker``).

The client lives on the event loop that runs it (``RemoteLoop``): redis-py's asyncio connections
belong to one loop, and the tier's callers are threads (the hierarchy's read and write pools,
the scheduler's lookups).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstrata.remote_address import RemoteAddress
from kvstrata.tiers.priority import name_this_thread

T = TypeVar("T")


def make_client(address: RemoteAddress, *, connect_timeout_s: float, timeout_s: float,
                max_connections: int, tls_ca_file: str | None = None) -> Redis | RedisCluster:
    """A client for ``address`` (call on the loop that will use it). Nothing connects yet.
    TLS verifies the server's certificate (against ``tls_ca_file``, else the system's CAs) and
    its host name."""
    common: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0), username=address.username, password=address.password,
        client_name="kvstrata",
    )
    if address.tls:
        common.update(ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=tls_ca_file)
    if address.cluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in address.nodes], ssl=address.tls,
            max_connections=max_connections, require_full_coverage=False, **common)
    host, port = address.nodes[0]
    # Blocking: a burst of callers waits (bounded by timeout_s) for a free connection instead
    # of opening connections without limit.
    pool = BlockingConnectionPool(
        max_connections=max_connections, timeout=timeout_s,
        connection_class=SSLConnection if address.tls else Connection,
        host=host, port=port, db=address.db, **common)
    return Redis(connection_pool=pool)


async def exists_many(client: Any, keys: Sequence[bytes]) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return [bool(n) for n in await pipe.execute()]


async def get_many(client: Any, keys: Sequence[bytes]) -> list[bytes | None]:
    if len(keys) == 1:
        return [await client.get(keys[0])]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return list(await pipe.execute())


async def set_many(client: Any, items: Sequence[tuple[bytes, bytes]], ttl_ms: int | None) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for key, value in items:
        pipe.set(key, value, px=ttl_ms)
    return [bool(ok) for ok in await pipe.execute()]


async def delete_many(client: Any, keys: Sequence[bytes]) -> int:
    # One DEL per key: a cluster refuses a multi-key DEL across slots.
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.delete(key)
    return sum(await pipe.execute())


async def touch_many(client: Any, keys: Sequence[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.touch(key)
    return sum(await pipe.execute())


async def ping(client: Any) -> None:
    """PING the server, or every primary of a cluster: redis-py sends a cluster's PING to one
    node only, which answers while another master is down or hung (the breaker would then close
    for the next batch to fail on that master, once per probe interval)."""
    if isinstance(client, RedisCluster):
        await client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        await client.ping()


class RemoteLoop:
    """An asyncio loop on a daemon thread of its own, for the client and the breaker's probe."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_this_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()
