"""A circuit breaker for the shared tier: after a failure (refused, reset, timed out) the serving
path stops asking the server at once — every call answers "unavailable" without a round trip —
and a background probe asks it again every ``probe_interval_s`` until it answers. A hung server
(SIGSTOP) therefore costs one timeout, not one per request. Each state change is logged once.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class Breaker:
    def __init__(self, name: str, probe_interval_s: float) -> None:
        self.name = name
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._up = True
        self._down_since: float | None = None
        self.state_changes = 0
        self.last_error: str | None = None

    @property
    def up(self) -> bool:
        return self._up

    def failed(self, exc: BaseException) -> bool:
        """A call failed with ``exc``: open the breaker. True when this call opened it (the
        caller then starts the probe)."""
        with self._lock:
            if not self._up:
                # Already open: the error that opened it says why. Calls caught in flight fail
                # after it with errors of their own making (the probe drops the pool's
                # connections under them: "Connection closed by server" from a hung server);
                # the probe records what the server answers since (``note``).
                return False
            self.last_error = describe(exc)
            self._up = False
            self._down_since = time.monotonic()
            self.state_changes += 1
        logger.warning("kvstrata: %s unavailable (%s); serving from the local tiers, probing every %.1fs",
                       self.name, self.last_error, self.probe_interval_s)
        return True

    def note(self, exc: BaseException) -> None:
        """A probe failed with ``exc``: the latest reason the server is unavailable."""
        self.last_error = describe(exc)

    def recovered(self) -> bool:
        """A probe succeeded: close the breaker. True when this call closed it."""
        with self._lock:
            if self._up:
                return False
            self._up = True
            down_for = time.monotonic() - (self._down_since or time.monotonic())
            self._down_since = None
            self.state_changes += 1
        logger.warning("kvstrata: %s available again after %.1fs", self.name, down_for)
        return True


def describe(exc: BaseException) -> str:
    """``Type: message``, or the type alone (asyncio's TimeoutError has no message)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if "CERTIFICATE_VERIFY_FAILED" in text:
        text += (" -- the server's TLS certificate is not signed by a CA this replica trusts "
                 "(option remote_tls_ca_file), or not issued for this host name")
    return text
