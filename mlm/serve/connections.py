"""Connection limits: uvicorn's h11 protocol, guarded so that slow or abusive clients cannot take
the server away from others (docs/serve.md, "Connection limits").

- At most `max_connections` connections are open. One more closes the connection that has waited
  longest for (the rest of) its request with a 503; when every connection has a request running,
  the new one gets the 503 instead.
- A request's line, headers and body must arrive within `read_timeout_s` of the connection opening
  or of the previous response on it; otherwise 408.
- The request line and headers hold at most `max_header_bytes`; otherwise 431.

The cap is kept below the process's open-file limit (raised to its hard limit first), so accept()
never fails for want of a descriptor and `/health` keeps answering."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlm.errors import MlmError
from mlm.serve.errors import ApiError

log = logging.getLogger("mlm.serve")

ACCEPT_BATCH = 16
"""Connections asyncio accepts in one go: it accepts up to the backlog it was given before any of
them is set up, and closes an evicted one's socket a loop turn or two later."""
IN_FLIGHT = 4 * ACCEPT_BATCH
"""How far past the cap the open sockets can go: a few batches accepted while those before them
are set up or closed."""
LISTEN_BACKLOG = 2048
"""The kernel's queue of connections not yet accepted (uvicorn's default)."""
FILE_RESERVE = 64
"""Descriptors kept for everything but connections: checkpoint files, logs, pipes."""
READING = (h11.IDLE, h11.SEND_BODY)
"""The client's h11 states while its request has not fully arrived."""


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1000
    """Open connections (`--max-connections`); lowered to fit the open-file limit."""
    read_timeout_s: float = 10.0
    """Seconds for a whole request to arrive (`--read-timeout`); 408 beyond."""
    max_header_bytes: int = 16384
    """Request line and headers (`--max-header-bytes`); 431 beyond."""

    def __post_init__(self):
        for flag, value in (
            ("--max-connections", self.max_connections),
            ("--read-timeout", self.read_timeout_s),
            ("--max-header-bytes", self.max_header_bytes),
        ):
            if not value > 0:
                raise MlmError(f"{flag} {value} must be positive")

    def cap(self) -> int:
        """`max_connections`, lowered (with a warning) to what the open-file limit allows."""
        room = open_file_room()
        if room is None:
            return self.max_connections
        fits = room - FILE_RESERVE - IN_FLIGHT
        if fits < 1:
            raise MlmError(
                f"the open-file limit leaves room for {room} more files, too few to serve "
                f"(at least {FILE_RESERVE + IN_FLIGHT + 1}): raise it with `ulimit -n`"
            )
        if fits < self.max_connections:
            log.warning(
                "mlm serve: --max-connections lowered from %d to %d to fit the open-file limit "
                "(ulimit -n: raise it to allow more)",
                self.max_connections,
                fits,
            )
        return min(self.max_connections, fits)


def open_file_room() -> int | None:
    """How many more files this process may open, after raising its soft limit to the hard one;
    None where the platform does not say."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = FILE_RESERVE
    return soft - used


class Guard:
    """What the connections share: the cap, the connections still waiting for their request
    (oldest first), and the counts of those closed at the limits, logged at most every
    `LOG_EVERY_S` seconds."""

    LOG_EVERY_S = 10.0

    def __init__(self, limits: ConnectionLimits, cap: int):
        self.limits, self.cap = limits, cap
        self.waiting: dict[GuardedProtocol, None] = {}
        self._unlogged: collections.Counter[int] = collections.Counter()
        self._logged_at = 0.0

    def protocol(self):
        """The protocol class uvicorn builds each connection with."""
        return functools.partial(GuardedProtocol, guard=self)

    def closing(self, status: int) -> None:
        self._unlogged[status] += 1
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY_S:
            counts = ", ".join(f"{n} × {s}" for s, n in sorted(self._unlogged.items()))
            log.warning("mlm serve: connections closed at the connection limits: %s", counts)
            self._unlogged.clear()
            self._logged_at = now


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of `Guard`."""

    def __init__(self, *args, guard: Guard, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.read_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()
        if len(self.connections) > self.guard.cap:
            oldest = next((p for p in self.guard.waiting if p is not self), None)
            if oldest is None:
                self.refuse(503, "the server is at its connection limit: retry later")
            else:
                oldest.refuse(
                    503,
                    "the server is at its connection limit and closed the connection "
                    "that had waited longest for its request",
                )

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_size(data) > self.guard.limits.max_header_bytes:
            limit = self.guard.limits.max_header_bytes
            self.refuse(431, f"the request line and headers exceed {limit} bytes (--max-header-bytes)")
            return
        super().data_received(data)
        self._watch()

    def _head_size(self, data: bytes) -> int:
        """The size of the request head arriving, so far or up to its blank line (h11 checks its
        size only while it is incomplete)."""
        head = self.conn.trailing_data[0] + data
        end = head.find(b"\r\n\r\n")
        return len(head) if end < 0 else end + 4

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc) -> None:
        self._unwatch()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request."""
        self.refuse(400, "the request is not valid HTTP/1.1")

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` (unless this request's answer has begun, or none was asked on a kept-alive
        connection) and close."""
        self._unwatch()
        if self.transport.is_closing():
            return
        self.guard.closing(status)
        if self.conn.their_state is h11.SEND_BODY:
            answer = not self.cycle.response_started
        else:
            answer = self.cycle is None or bool(self.conn.trailing_data[0])
        if answer:
            self.transport.write(response_bytes(status, message))
        self.transport.close()

    def _watch(self) -> None:
        """Keep the read deadline and `guard.waiting` in step with the client's state."""
        if self.transport.is_closing() or self.conn.their_state not in READING:
            self._unwatch()
        elif self.read_timer is None:
            self.read_timer = self.loop.call_later(self.guard.limits.read_timeout_s, self._timed_out)
            self.guard.waiting[self] = None

    def _unwatch(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        self.guard.waiting.pop(self, None)

    def _timed_out(self) -> None:
        self.read_timer = None
        if self.conn.their_state in READING:
            t = self.guard.limits.read_timeout_s
            self.refuse(408, f"the request did not arrive within {t:g} s (--read-timeout)")


def response_bytes(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection: OpenAI's error shape, as JSON."""
    body = json.dumps(ApiError(status, message).body()).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if status == 503:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
