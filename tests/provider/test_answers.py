"""Every answer an HTTP server can give, generated over the real loopback transport:
statuses, header sets (Content-Encoding stacks, Retry-After forms, lengths) and body
shapes and sizes. Each ends in a documented category and a fixed cause label, within
the request's deadline and a few MiB of memory (docs/provider-recovery.md#categories)."""

from __future__ import annotations

import json
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory_pipeline.provider.models import Failure, Observation
from inventory_pipeline.provider.retry_after import MAX_RETRY_AFTER_SECONDS
from inventory_pipeline.provider.standin import StandIn, record
from inventory_pipeline.provider.tmdb import TmdbClient
from tests.conftest import TMDB_TEST_KEY

DEADLINE_SECONDS = 1.0
LIMIT = 64 * 1024
CATEGORIES = {"not_found", "auth", "throttled", "transient", "invalid_response"}
CAUSES = {
    "HTTP 200, invalid body",
    "body too large",
    "undecodable body",
    "body cut short",
    "content encoding not asked for",
    "too many content encodings",
    "timeout",
    "connection error",
    "HTTP status out of range",
    *(f"HTTP {status}" for status in (401, 403, 404, 429, 503)),
    *(f"HTTP {n}xx" for n in range(1, 6)),
}
CODERS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


def coded(body: bytes, stack: list[str]) -> bytes:
    """`body` coded by each of `stack` in turn (other names only label it)."""
    for name in stack:
        if name in CODERS:
            coder = zlib.compressobj(6, zlib.DEFLATED, CODERS[name])
            body = coder.compress(body) + coder.flush()
    return body


def retry_after_forms() -> st.SearchStrategy[str]:
    moment = st.integers(-(10**6), 10**8).map(
        lambda s: format_datetime(datetime.now(UTC) + timedelta(seconds=s), usegmt=True)
    )
    return st.one_of(
        st.integers(0, 10**30).map(str),
        st.integers(-(10**6), -1).map(str),
        moment,
        st.text(max_size=80),
        st.just("9" * 200),
    )


def bodies() -> st.SearchStrategy[bytes]:
    movie = json.dumps(record("movie", 11)).encode()
    return st.one_of(
        st.just(movie),
        st.binary(max_size=4096),
        st.integers(LIMIT - 64, LIMIT + 4096).map(lambda n: b" " * n),
        st.integers(1, 256 * 1024).map(lambda n: b'{"id": 11, "pad": "' + b"x" * n + b'"}'),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(
                    st.sampled_from(["id", "title", "genres", "x"]), inner, max_size=4
                )
            ),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
    )


@pytest.fixture(scope="module")
def server() -> Iterator[StandIn]:
    with StandIn(api_key=TMDB_TEST_KEY) as standin:
        yield standin


@pytest.fixture(scope="module")
def module_client(server: StandIn) -> Iterator[TmdbClient]:
    with TmdbClient(server.url, timeout_seconds=DEADLINE_SECONDS, max_body_bytes=LIMIT) as client:
        yield client


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    status=st.one_of(st.just(200), st.integers(100, 599)),
    stack=st.lists(
        st.sampled_from(["gzip", "deflate", "identity", "x-gzip", "br", "zstd"]), max_size=4
    ),
    retry_after=st.none() | retry_after_forms(),
    body=bodies(),
    bomb_mib=st.none() | st.sampled_from([2, 8, 32]),  # that many MiB of spaces instead
    extra=st.lists(
        st.tuples(
            st.sampled_from(["X-Junk", "Content-Type", "Vary"]),
            st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200),
        ),
        max_size=3,
    ),
)
def test_every_answer_ends_in_a_category_within_its_deadline_and_memory(
    server: StandIn,
    module_client: TmdbClient,
    status: int,
    stack: list[str],
    retry_after: str | None,
    body: bytes,
    bomb_mib: int | None,
    extra: list[tuple[str, str]],
) -> None:
    if bomb_mib is not None:  # a bomb once coded; made here, so a report shows its size
        body = b" " * (bomb_mib << 20)
    headers = [*extra]
    if stack:
        headers.append(("Content-Encoding", ", ".join(stack)))
    if retry_after is not None and retry_after.isprintable() and retry_after.isascii():
        headers.append(("Retry-After", retry_after.strip() or "x"))
    server.set_fault("answer", status=status, headers=tuple(headers), raw=coded(body, stack))
    tracemalloc.start()
    started = time.monotonic()
    try:
        result = module_client.fetch("movie", 11, TMDB_TEST_KEY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - started
    assert elapsed < DEADLINE_SECONDS + 0.5, elapsed
    assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.1f} MiB held for {len(body)} bytes"
    if isinstance(result, Observation):
        assert status == 200 and result.tmdb_id == 11
        return
    assert isinstance(result, Failure)
    assert result.category in CATEGORIES and result.cause in CAUSES, result
    wait = result.retry_after_seconds
    assert wait is None or 0 <= wait <= MAX_RETRY_AFTER_SECONDS
