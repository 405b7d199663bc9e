"""An HTTP transport whose deadline is wall-clock over the whole exchange.

httpx's timeouts bound each network operation, and restart at every read: a server that
trickles its status line and headers a byte at a time never trips one. Here every
connect, TLS handshake, write and read of a request is bounded by what is left of the
request's deadline (set with `deadline()` around the request, body reading included),
so the exchange ends at the deadline however the bytes arrive. Name resolution counts
against the deadline too.

Built on httpcore's public network-backend interface. Requests go straight to the
provider: proxies from the environment are not consulted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_DEADLINE: ContextVar[float | None] = ContextVar("provider_request_deadline", default=None)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Bound every network operation of the requests made inside to `seconds` in all."""
    token = _DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, expired: type[Exception]) -> float | None:
    """The operation's own timeout, cut to what is left of the deadline."""
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise expired("the request's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return _Stream(
            self._inner.start_tls(
                ssl_context, server_hostname, _bounded(timeout, httpcore.ConnectTimeout)
            )
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def _resolve(host: str, port: int, timeout: float | None) -> list[str]:
    """The host's addresses, the lookup bounded like any other network operation: the
    system resolver cannot be interrupted, so it runs in a thread of its own that the
    request stops waiting for at the deadline (the thread ends with the lookup)."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    answer: list[list[str] | OSError] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            answer.append([str(info[4][0]) for info in infos])
        except OSError as exc:
            answer.append(exc)
        done.set()

    threading.Thread(target=lookup, name="provider-resolve", daemon=True).start()
    if not done.wait(timeout):
        raise httpcore.ConnectTimeout("name resolution outlasted the request's deadline")
    [result] = answer
    if isinstance(result, OSError):
        raise httpcore.ConnectError(type(result).__name__)
    return result


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        """Resolve within the deadline, then try each address in turn with what is left
        of it (TLS still names the host: httpcore passes it to `start_tls`)."""
        addresses = _resolve(host, port, _bounded(timeout, httpcore.ConnectTimeout))
        failure: Exception | None = None
        for address in addresses:
            bounded = _bounded(timeout, httpcore.ConnectTimeout)
            try:
                stream = self._inner.connect_tcp(
                    address, port, bounded, local_address, socket_options
                )
            except httpcore.ConnectError as exc:
                failure = exc
                continue
            return _Stream(stream)
        raise failure or httpcore.ConnectError("no address")

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        bounded = _bounded(timeout, httpcore.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, bounded, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


# httpcore's exceptions as httpx's, as httpx's own transport maps them.
_EXCEPTIONS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.ProxyError, httpx.ProxyError),
)


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core, mapped in _EXCEPTIONS:
            if isinstance(exc, core):
                raise mapped(type(exc).__name__) from exc
        raise


class _Body(httpx.SyncByteStream):
    def __init__(self, inner: Iterable[bytes]) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self._inner

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            with _as_httpx():
                close()


class DeadlineTransport(httpx.BaseTransport):
    """HTTP/1.1 with a connection pool; every network operation is bounded by what is
    left of the deadline set around the request."""

    def __init__(self) -> None:
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=_Backend(),
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx():
            response = self._pool.handle_request(core)
        assert isinstance(response.stream, Iterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._pool.close()
