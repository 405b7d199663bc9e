"""A local TMDb v3 stand-in over real HTTP, for the demo and the tests.

It serves the documented endpoints (`/3/movie/{id}`, `/3/tv/{id}` with its appended
`external_ids`, `/3/find/{external_id}`, `/3/configuration`) with TMDb-shaped bodies and
error bodies, checks the API key, and has switchable faults so observation and recovery
are visible without internet:

    POST   /__standin/faults   {"fault": "status", "status": 503, "ids": [12]}
    DELETE /__standin/faults
    POST   /__standin/catalog  {"kind": "movie", "id": 12, "available": true}
    POST   /__standin/merge    {"kind": "movie", "from": 12, "into": 34, "title": "Heat",
                                "year": 1995, "round_trip": true, "also": [56]}
    DELETE /__standin/merge
    GET    /__standin/stats    arrivals per second

Every record has deterministic external ids: movie X the IMDb id tt000000X (seven
digits at least), show X the IMDb id tt(5000000000 + X) and the TVDB id 900000000 + X.
A merge simulates TMDb folding a duplicate into another record: `from` answers 404
(status code 34) for good, its external ids find `into`, and `into` carries the merged
record's external ids, the given title (default: the merged record's) and year (one
merged record per survivor: a second one is refused, 409). The
variations a revalidation must refuse: `round_trip: false` (the survivor's details name
its own external ids), `also` (more results of the find: ids of the same kind, or
[kind, id] pairs), a title or year of its own.

Faults: status (any HTTP status, TMDb error body, Retry-After when `retry_after` is
given), throttle (429 + Retry-After), slow (delay seconds), drip (body a byte at a
time), drip_headers (status line and headers a byte at a time, then a valid
configuration body), truncate (promise more than is sent, then hang up mid-body), close
(hang up without answering), oversize (a body over 64 KiB), gzip_bomb (a small gzip body
that decodes to megabytes), encoded (a 200 whose body, the given text or `size` spaces,
is coded by each of `encoding` in turn and sent with that Content-Encoding: gzip and
deflate code it, any other name only labels it; `gzip, gzip` over a few hundred MiB of
spaces is a nested bomb of a few KiB; `cut` bytes fewer sent), answer (the given status,
`headers` and `raw` body bytes, as they are, framed by a Content-Length), echo_key (a
record with the request's key in a header), garbage (not JSON), cut_json (a complete
response whose JSON is cut short), missing (a 200 without required fields), body (a 200
with the given text, verbatim), compress (every answer as it would be, gzip-coded when the
request accepts gzip).
A gate (`StandIn.gate`, in process only) holds the answers for one id until it opens, so
that a test can act between a request's arrival and its answer; they are then answered
as they are, whatever the fault.
It binds to loopback only and never logs request lines (they carry the key).
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

GENRES = ("Drama", "Comedy", "Action", "Thriller", "Science Fiction", "Animation", "Crime")
LANGUAGES = ("en", "en", "en", "fr", "ja", "ko", "de", "es")
COMPANIES = ("A24", "Pixar", "Studio Ghibli", "Warner Bros.", "Toho", "Canal+")
NOT_FOUND = {
    "status_code": 34,
    "status_message": "The resource you requested could not be found.",
    "success": False,
}
INVALID_KEY = {
    "status_code": 7,
    "status_message": "Invalid API key: You must be granted a valid key.",
    "success": False,
}
THROTTLED = {
    "status_code": 25,
    "status_message": "Your request count (#) is over the allowed limit of (40).",
    "success": False,
}


TV_IMDB_BASE = 5_000_000_000
TVDB_BASE = 900_000_000


def external_ids(kind: str, tmdb_id: int) -> dict[str, Any]:
    """A record's deterministic external ids (a movie has no TVDB id)."""
    if kind == "movie":
        return {"imdb_id": f"tt{tmdb_id:07d}", "tvdb_id": None}
    tvdb = TVDB_BASE + tmdb_id if tmdb_id < 10**9 else None
    return {"imdb_id": f"tt{TV_IMDB_BASE + tmdb_id}", "tvdb_id": tvdb}


def owner_of(source: str, external_id: str) -> tuple[str, int] | None:
    """The record whose own external id this is, when it is one of ours."""
    if source == "imdb_id" and external_id.startswith("tt") and external_id[2:].isdigit():
        number = int(external_id[2:])
        if number >= TV_IMDB_BASE:
            return ("tv", number - TV_IMDB_BASE)
        return ("movie", number) if number > 0 else None
    if source == "tvdb_id" and external_id.isascii() and external_id.isdigit():
        number = int(external_id) - TVDB_BASE
        return ("tv", number) if number > 0 else None
    return None


def record(kind: str, tmdb_id: int) -> dict[str, Any]:
    """A deterministic TMDb-shaped record for any id."""
    rng = random.Random(f"{kind}:{tmdb_id}")
    title_key, date_key = (
        ("title", "release_date") if kind == "movie" else ("name", "first_air_date")
    )
    return {
        "id": tmdb_id,
        title_key: f"{kind.title()} {tmdb_id}",
        f"original_{title_key}": f"{kind.title()} {tmdb_id}",
        "genres": [{"id": i, "name": g} for i, g in enumerate(rng.sample(GENRES, 2))],
        "vote_average": round(rng.uniform(3, 9), 1),
        "vote_count": rng.randint(10, 20000),
        "original_language": rng.choice(LANGUAGES),
        "production_companies": [{"id": 1, "name": rng.choice(COMPANIES), "logo_path": None}],
        date_key: f"{rng.randint(1960, 2025)}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}",
        "status": "Released" if kind == "movie" else "Ended",
        "popularity": rng.uniform(0, 100),
        "adult": False,
        **({"imdb_id": external_ids(kind, tmdb_id)["imdb_id"]} if kind == "movie" else {}),
    }


def _titles(kind: str) -> tuple[str, str, str]:
    """The keys of a record's title, original title and date."""
    if kind == "movie":
        return "title", "original_title", "release_date"
    return "name", "original_name", "first_air_date"


def summary(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """A record as `/3/find` lists it."""
    keys = ("id", *_titles(kind), "original_language", "vote_average", "popularity")
    return {**{k: body[k] for k in keys if k in body}, "media_type": kind}


CONFIGURATION = {
    "images": {
        "base_url": "http://image.tmdb.org/t/p/",
        "secure_base_url": "https://image.tmdb.org/t/p/",
        "poster_sizes": ["w92", "w154", "original"],
    },
    "change_keys": ["adult", "genres", "original_language", "title"],
}


@dataclass
class Fault:
    fault: str
    status: int = 500
    retry_after: str | None = None
    delay: float = 0.0
    ids: frozenset[int] | None = None
    body: str | None = None  # the "body" fault's verbatim 200 response
    encoding: tuple[str, ...] = ()  # the "encoded" fault's codings, first applied first
    size: int = 0  # the "encoded" fault's body of spaces, when no body is given
    cut: int = 0  # the "encoded" fault's payload sent without its last `cut` bytes
    headers: tuple[tuple[str, str], ...] = ()  # the "answer" fault's headers
    raw: bytes = b""  # the "answer" fault's body, sent as it is

    def applies(self, tmdb_id: int | None) -> bool:
        return self.ids is None or (tmdb_id is not None and tmdb_id in self.ids)


@dataclass(frozen=True)
class Gate:
    """The answers for one id wait until `opened` (at most GATE_SECONDS); `arrived` is
    set by the first request that waits."""

    arrived: threading.Event = field(default_factory=threading.Event)
    opened: threading.Event = field(default_factory=threading.Event)


GATE_SECONDS = 30.0


@dataclass(frozen=True)
class Merge:
    """`(kind, from)` folded into `into` (see the module docstring)."""

    into: int
    title: str | None = None
    original_title: str | None = None
    year: int | None = None
    round_trip: bool = True
    also: tuple[tuple[str, int], ...] = ()


@dataclass
class StandInState:
    api_key: str
    missing: set[tuple[str, int]] = field(default_factory=set)
    available: set[tuple[str, int]] = field(default_factory=set)
    merges: dict[tuple[str, int], Merge] = field(default_factory=dict)
    survivors: dict[tuple[str, int], tuple[int, Merge]] = field(default_factory=dict)
    # Lookups answered with these records whatever the catalog says: (source, id) ->
    # [(kind, id), ...].
    finds: dict[tuple[str, str], tuple[tuple[str, int], ...]] = field(default_factory=dict)
    missing_every: int | None = None  # demo: ids divisible by this are unknown
    fault: Fault | None = None
    gates: dict[int, Gate] = field(default_factory=dict)
    arrivals: list[float] = field(default_factory=list)
    compressed: int = 0  # answers the compress fault gzip-coded
    encoded: int = 0  # answers the encoded fault sent
    paths: list[str] = field(default_factory=list)  # of each request, never its query
    dripped: int = 0  # bytes of a header drip written before the client hung up
    lock: threading.Lock = field(default_factory=threading.Lock)

    def is_missing(self, kind: str, tmdb_id: int) -> bool:
        with self.lock:
            if (kind, tmdb_id) in self.missing or (kind, tmdb_id) in self.merges:
                return True
            if (kind, tmdb_id) in self.available:
                return False
            return bool(self.missing_every) and tmdb_id % (self.missing_every or 1) == 0

    def per_second(self) -> Counter[int]:
        with self.lock:
            return Counter(int(t) for t in self.arrivals)

    def merge(self, kind: str, merged: int, merge: Merge) -> None:
        """A survivor carries one merged record's title and external ids: folding a
        second record into it would silently change what the first one's lookup finds,
        so it is refused (ValueError)."""
        with self.lock:
            taken = self.survivors.get((kind, merge.into))
            if taken is not None and taken[0] != merged:
                raise ValueError(
                    f"{kind} {merge.into} already carries merged record {taken[0]}:"
                    " merge each record into a survivor of its own"
                )
            earlier = self.merges.get((kind, merged))
            if earlier is not None:  # merged again, elsewhere: the old survivor is free
                self.survivors.pop((kind, earlier.into), None)
            self.merges[(kind, merged)] = merge
            self.survivors[(kind, merge.into)] = (merged, merge)

    def clear_merges(self) -> None:
        with self.lock:
            self.merges.clear()
            self.survivors.clear()

    def body(self, kind: str, tmdb_id: int, appended: bool) -> dict[str, Any]:
        """The record served for an id: a merge's survivor carries the merged record's
        title, date and (unless the round trip is broken) external ids."""
        body = record(kind, tmdb_id)
        ids = external_ids(kind, tmdb_id)
        with self.lock:
            survivor = self.survivors.get((kind, tmdb_id))
        if survivor is not None:
            merged, merge = survivor
            title_key, original_key, date_key = _titles(kind)
            old = record(kind, merged)
            body[title_key] = merge.title if merge.title is not None else old[title_key]
            body[original_key] = (
                merge.original_title if merge.original_title is not None else body[title_key]
            )
            released = old[date_key]
            body[date_key] = f"{merge.year}{released[4:]}" if merge.year else released
            if merge.round_trip:
                ids = external_ids(kind, merged)
        if kind == "movie":
            body["imdb_id"] = ids["imdb_id"]
        elif appended:
            body["external_ids"] = {**ids, "facebook_id": None, "instagram_id": None}
        return body

    def find(self, source: str, external_id: str) -> dict[str, Any]:
        """`/3/find`: the record owning the external id, or its merge's survivor (and the
        merge's extra results), or nothing when the record is gone without a merge."""
        results: dict[str, list[dict[str, Any]]] = {"movie_results": [], "tv_results": []}
        owner = owner_of(source, external_id)
        with self.lock:
            merge = self.merges.get(owner) if owner is not None else None
            given = self.finds.get((source, external_id))
        found: list[tuple[str, int]] = []
        if given is not None:
            found = list(given)
        elif owner is not None and merge is not None:
            found = [(owner[0], merge.into), *merge.also]
        elif owner is not None and not self.is_missing(*owner):
            found = [owner]
        for k, i in found:
            results[f"{k}_results"].append(summary(self.body(k, i, False), k))
        return {**results, "person_results": [], "tv_episode_results": [], "tv_season_results": []}


CODERS = {"gzip": 31, "x-gzip": 31, "deflate": 15}  # zlib's wbits for each coding
MIB = 1 << 20


@functools.lru_cache(maxsize=8)
def encoded(encoding: tuple[str, ...], size: int, body: str | None) -> bytes:
    """The "encoded" fault's payload: `body` (or `size` spaces, coded a MiB at a time so
    that a bomb never exists decoded) coded by each of `encoding` in turn."""
    chunks: Iterable[bytes] = (
        [body.encode()]
        if body is not None
        else (b" " * min(MIB, size - start) for start in range(0, size, MIB))
    )
    for name in encoding:
        wbits = CODERS.get(name)
        if wbits is not None:
            coder = zlib.compressobj(9, zlib.DEFLATED, wbits)
            chunks = [*(coder.compress(chunk) for chunk in chunks), coder.flush()]
    return b"".join(chunks)


def _set_available(state: StandInState, key: tuple[str, int], available: bool) -> None:
    with state.lock:
        if available:
            state.missing.discard(key)
            state.available.add(key)
        else:
            state.available.discard(key)
            state.missing.add(key)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm a kept-alive
    # connection would wait out the client's delayed ACK (tens of ms) on every answer.
    disable_nagle_algorithm = True
    compress = False  # this request's answer goes gzip-coded (the compress fault)

    def log_message(self, format: str, *args: Any) -> None:
        return  # request lines carry the API key

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        if self.compress:
            body, headers = gzip.compress(body), {**(headers or {}), "Content-Encoding": "gzip"}
            with self.server.state.lock:
                self.server.state.compressed += 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json;charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(value).encode(), headers)

    def _admin_body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        return body if isinstance(body, dict) else {}

    def do_POST(self) -> None:
        state = self.server.state
        path = urlsplit(self.path).path
        body = self._admin_body()
        if path == "/__standin/faults":
            ids = body.get("ids")
            with state.lock:
                state.fault = Fault(
                    fault=str(body.get("fault", "status")),
                    status=int(body.get("status", 500)),
                    retry_after=body.get("retry_after"),
                    delay=float(body.get("delay", 0)),
                    ids=frozenset(int(i) for i in ids) if ids is not None else None,
                    body=body.get("body"),
                    encoding=tuple(str(e) for e in body.get("encoding") or ()),
                    size=int(body.get("size", 0)),
                    cut=int(body.get("cut", 0)),
                )
            self._json(200, {"ok": True})
        elif path == "/__standin/catalog":
            key = (str(body["kind"]), int(body["id"]))
            _set_available(state, key, bool(body.get("available", True)))
            self._json(200, {"ok": True})
        elif path == "/__standin/merge":
            kind = str(body["kind"])
            also = [
                (str(a[0]), int(a[1])) if isinstance(a, list) else (kind, int(a))
                for a in body.get("also") or []
            ]
            year = body.get("year")
            merged = int(body["from"])
            merge = Merge(
                into=int(body["into"]),
                title=body.get("title"),
                original_title=body.get("original_title"),
                year=int(year) if year is not None else None,
                round_trip=bool(body.get("round_trip", True)),
                also=tuple(also),
            )
            try:
                state.merge(kind, merged, merge)
            except ValueError as exc:
                self._json(409, {"error": str(exc)})
                return
            self._json(200, {"ok": True})
        else:
            self._json(404, NOT_FOUND)

    def do_DELETE(self) -> None:
        path = urlsplit(self.path).path
        if path == "/__standin/faults":
            with self.server.state.lock:
                self.server.state.fault = None
            self._json(200, {"ok": True})
        elif path == "/__standin/merge":
            self.server.state.clear_merges()
            self._json(200, {"ok": True})
        else:
            self._json(404, NOT_FOUND)

    def do_GET(self) -> None:
        state = self.server.state
        url = urlsplit(self.path)
        self.compress = False
        if url.path == "/__standin/stats":
            counts = state.per_second()
            self._json(
                200,
                {
                    "requests": sum(counts.values()),
                    "max_per_second": max(counts.values(), default=0),
                },
            )
            return
        with state.lock:
            state.arrivals.append(time.time())
            state.paths.append(url.path)
            fault = state.fault
        query = parse_qs(url.query)
        parts = url.path.strip("/").split("/")
        kind = parts[1] if len(parts) == 3 and parts[0] == "3" else None
        tmdb_id = int(parts[2]) if kind and parts[2].isascii() and parts[2].isdigit() else None
        source = query.get("external_source", [""])[0]
        if kind == "find":  # faults aimed at ids hit the lookups of their external ids
            owner = owner_of(source, parts[2])
            tmdb_id = owner[1] if owner is not None else None
        with state.lock:
            gate = state.gates.get(tmdb_id) if tmdb_id is not None else None
        if gate is not None:
            gate.arrived.set()
            gate.opened.wait(GATE_SECONDS)
        elif fault is not None and fault.applies(tmdb_id) and self._fault(fault):
            return
        key = query.get("api_key", [None])[0]
        if key != state.api_key:
            self._json(401, INVALID_KEY)
            return
        if url.path == "/3/configuration":
            self._json(200, CONFIGURATION)
            return
        if kind == "find" and source in ("imdb_id", "tvdb_id"):
            self._json(200, state.find(source, parts[2]))
            return
        if kind not in ("movie", "tv") or tmdb_id is None or state.is_missing(kind, tmdb_id):
            self._json(404, NOT_FOUND)
            return
        appended = "external_ids" in query.get("append_to_response", [""])[0].split(",")
        self._json(200, state.body(kind, tmdb_id, appended))

    def _fault(self, fault: Fault) -> bool:
        """Answer with the fault; False when the request should be served normally."""
        if fault.fault == "slow":
            time.sleep(fault.delay)
            return False
        if fault.fault == "compress":
            self.compress = "gzip" in (self.headers.get("Accept-Encoding") or "")
            return False
        if fault.fault == "status":
            body = (
                NOT_FOUND
                if fault.status == 404
                else {"status_code": 11, "success": False, "status_message": "Internal error."}
            )
            headers = {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}
            self._json(fault.status, body, headers)
        elif fault.fault == "throttle":
            headers = {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}
            self._json(429, THROTTLED, headers)
        elif fault.fault == "garbage":
            self._send(200, b"<html>not json</html>")
        elif fault.fault == "missing":
            self._json(200, {"id": 1, "adult": False})
        elif fault.fault == "oversize":
            self._json(200, {"id": 1, "padding": "x" * (1024 * 1024)})
        elif fault.fault == "drip":
            payload = json.dumps(CONFIGURATION).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            for byte in payload:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(fault.delay or 0.5)
        elif fault.fault == "drip_headers":
            self._drip_headers(json.dumps(CONFIGURATION).encode(), fault.delay or 1.0)
        elif fault.fault == "body":
            self._send(200, (fault.body or "").encode("utf-8", "surrogatepass"))
        elif fault.fault == "cut_json":
            self._send(200, json.dumps(record("movie", 1)).encode()[:40])
        elif fault.fault == "gzip_bomb":
            payload = gzip.compress(b" " * (4 * 1024 * 1024))  # 4 MiB of spaces, ~4 KiB sent
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        elif fault.fault == "encoded":
            payload = encoded(fault.encoding, fault.size, fault.body)
            with self.server.state.lock:
                self.server.state.encoded += 1
            self._send(
                200,
                payload[: len(payload) - fault.cut],
                {"Content-Encoding": ", ".join(fault.encoding)},
            )
        elif fault.fault == "answer":
            self.send_response(fault.status)
            for name, value in fault.headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(fault.raw)))
            self.end_headers()
            self.wfile.write(fault.raw)
        elif fault.fault == "echo_key":
            key = parse_qs(urlsplit(self.path).query).get("api_key", [""])[0]
            self._json(200, record("movie", 1), {"X-Echo": f"your key is {key}"})
        elif fault.fault == "truncate":
            self.send_response(200)
            self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b'{"id": 1, "title": "cut')
            self.close_connection = True
        elif fault.fault == "close":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            return False
        return True

    def _drip_headers(self, payload: bytes, delay: float) -> None:
        """Every read of the client gets a byte, so only a deadline over the whole
        request (not a per-read timeout) ends the wait."""
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: application/json;charset=utf-8\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        self.close_connection = True
        for byte in head:
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return  # the client hung up
            with self.server.state.lock:
                self.server.state.dripped += 1
            time.sleep(delay)
        self.wfile.write(payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: StandInState

    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # clients that hang up early (deadlines, limits) are expected here


class StandIn:
    """Run the stand-in on 127.0.0.1 in a background thread."""

    def __init__(
        self, api_key: str = "standin-key", port: int = 0, missing_every: int | None = None
    ) -> None:
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.state = StandInState(api_key=api_key, missing_every=missing_every)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._more: list[tuple[_Server, threading.Thread]] = []

    @property
    def state(self) -> StandInState:
        return self._server.state

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> StandIn:
        self._thread.start()
        return self

    def also_listen(self) -> str:
        """Serve the same state on one more port of 127.0.0.1, bound in the calling
        thread's network namespace (a harness that runs hosts in namespaces gives each
        host the stand-in on its own loopback); the new listener's URL."""
        server = _Server(("127.0.0.1", 0), _Handler)
        server.state = self._server.state
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self._more.append((server, thread))
        host, port = server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        for server, thread in [(self._server, self._thread), *self._more]:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    def __enter__(self) -> StandIn:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def set_fault(self, fault: str, **options: Any) -> None:
        ids = options.pop("ids", None)
        with self.state.lock:
            self.state.fault = Fault(
                fault=fault, ids=frozenset(ids) if ids is not None else None, **options
            )

    def clear_fault(self) -> None:
        with self.state.lock:
            self.state.fault = None

    def gate(self, tmdb_id: int) -> Gate:
        """Hold the answers for `tmdb_id` until the gate opens (`ungate` opens it)."""
        gate = Gate()
        with self.state.lock:
            self.state.gates[tmdb_id] = gate
        return gate

    def ungate(self, tmdb_id: int) -> None:
        with self.state.lock:
            gate = self.state.gates.pop(tmdb_id, None)
        if gate is not None:
            gate.opened.set()

    def set_available(self, kind: str, tmdb_id: int, available: bool) -> None:
        _set_available(self.state, (kind, tmdb_id), available)

    def merge(
        self,
        kind: str,
        merged: int,
        into: int,
        *,
        title: str | None = None,
        original_title: str | None = None,
        year: int | None = None,
        round_trip: bool = True,
        also: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """TMDb folds `(kind, merged)` into `into` (see the module docstring)."""
        self.state.merge(kind, merged, Merge(into, title, original_title, year, round_trip, also))

    def clear_merges(self) -> None:
        """Every merged record answers again, under its own id."""
        self.state.clear_merges()

    def set_find(self, source: str, external_id: str, results: tuple[tuple[str, int], ...]) -> None:
        """Answer the lookup of this external id with these (kind, id) records."""
        with self.state.lock:
            self.state.finds[(source, external_id)] = results
