"""A response body read within bounds: its decoded size, its wall-clock deadline, and
the memory its decoding takes.

The client asks for `ACCEPT_ENCODING` and decodes the raw bytes itself, one layer at a
time and each in pieces of at most `PIECE` bytes, so an answer that inflates (a gzip
bomb, gzip inside gzip) is refused once its decoded bytes pass the limit, having
held at most a few pieces of it. An encoding it did not ask for, or more layers than
`MAX_LAYERS`, is refused unread.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator

ACCEPT_ENCODING = "gzip, deflate"
MAX_LAYERS = 3
PIECE = 16 * 1024
_GZIP = ("gzip", "x-gzip")


class BodyTooLarge(Exception):
    """The decoded response body is over the limit."""


class DeadlineExceeded(Exception):
    """The whole request took longer than its deadline."""


class Undecodable(Exception):
    """The body's content encoding is not one asked for, or its bytes do not decode.
    The message is the reason: a fixed label, never the provider's text."""


def read_limited(raw: Iterable[bytes], encodings: list[str], limit: int, deadline: float) -> bytes:
    """The body decoded from the raw network bytes `raw` sent with the content codings
    `encodings` (as the header lists them, the first applied first), refused over
    `limit` decoded bytes (every layer counts) or still arriving at `deadline` (a slow
    drip defeats per-read timeouts)."""
    layers = _layers(encodings)
    # A layer's output is the next layer's coded input: a legitimate one is the body's
    # size and a little more (headers, stored blocks of incompressible bytes). The
    # body itself is held to `limit` exactly below.
    layer_limit = limit + limit // 64 + 1024
    body = bytearray()

    def through(index: int, data: bytes) -> Iterator[bytes]:
        if index == len(layers):
            yield data
            return
        for piece in layers[index].feed(data, layer_limit):
            yield from through(index + 1, piece)

    for chunk in raw:
        for piece in through(0, chunk):
            body += piece
            if len(body) > limit:
                raise BodyTooLarge
        if time.monotonic() > deadline:
            raise DeadlineExceeded
    for layer in layers:
        layer.finish()
    return bytes(body)


def _layers(encodings: list[str]) -> list[_Layer]:
    names = [e.strip().lower() for e in encodings if e.strip().lower() not in ("", "identity")]
    if any(name not in (*_GZIP, "deflate") for name in names):
        raise Undecodable("content encoding not asked for")
    if len(names) > MAX_LAYERS:
        raise Undecodable("too many content encodings")
    return [_Layer(name in _GZIP) for name in reversed(names)]


class _Layer:
    """One content coding undone: gzip, or deflate (zlib-wrapped, or raw as some servers
    send it). Bytes after the end of the coded stream are ignored, as httpx does."""

    def __init__(self, gzip: bool) -> None:
        self.gzip = gzip
        self.begun = False  # some input decoded: the coding is settled
        self.total = 0
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 16 if gzip else zlib.MAX_WBITS)

    def feed(self, data: bytes, limit: int) -> Iterator[bytes]:
        """Every piece `data` decodes to, at most PIECE bytes each; past `limit` bytes of
        this layer's output the body is refused."""
        while not self._inflate.eof:
            piece = self._decompress(data)
            data = self._inflate.unconsumed_tail
            self.total += len(piece)
            if self.total > limit:
                raise BodyTooLarge
            if piece:
                yield piece
            if not data and len(piece) < PIECE:
                return

    def _decompress(self, data: bytes) -> bytes:
        try:
            piece = self._inflate.decompress(data, PIECE)
        except zlib.error as exc:
            if self.gzip or self.begun:
                raise Undecodable("undecodable body") from exc
            self._inflate = zlib.decompressobj(-zlib.MAX_WBITS)  # deflate without zlib's wrapper
            self.begun = True
            return self._decompress(data)
        self.begun = self.begun or bool(data)
        return piece

    def finish(self) -> None:
        """A coded stream begun and not ended was cut short."""
        if self.begun and not self._inflate.eof:
            raise Undecodable("body cut short")
