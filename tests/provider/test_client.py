"""The TMDb client over real loopback HTTP against the stand-in: every category, every
fault, and the key never in any text the client produces."""

from __future__ import annotations

import logging
import socket

import pytest

from inventory_pipeline.provider.models import Failure, Observation
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import (
    ProviderConfigError,
    TmdbClient,
    classify,
    redact,
)
from tests.conftest import TMDB_TEST_KEY

KEY = TMDB_TEST_KEY


def test_movie_and_tv_are_validated(client: TmdbClient) -> None:
    movie = client.fetch("movie", 603, KEY)
    assert isinstance(movie, Observation)
    assert movie.tmdb_id == 603 and movie.kind == "movie" and movie.title == "Movie 603"
    assert movie.genres and movie.companies and movie.release_date is not None
    tv = client.fetch("tv", 1399, KEY, language="en-US")
    assert isinstance(tv, Observation) and tv.title == "Tv 1399"


@pytest.mark.parametrize(
    ("fault", "options", "category"),
    [
        ("status", {"status": 404}, "not_found"),
        ("status", {"status": 500}, "transient"),
        ("status", {"status": 503}, "transient"),
        ("status", {"status": 400}, "invalid_response"),
        ("throttle", {"retry_after": "7"}, "throttled"),
        ("garbage", {}, "invalid_response"),
        ("missing", {}, "invalid_response"),
        ("oversize", {}, "invalid_response"),
        ("truncate", {}, "transient"),
        ("close", {}, "transient"),
        ("slow", {"delay": 2.0}, "transient"),
        ("drip", {"delay": 0.3}, "transient"),
    ],
)
def test_faults_become_categories(
    standin: StandIn, client: TmdbClient, fault: str, options: dict[str, object], category: str
) -> None:
    standin.set_fault(fault, **options)
    result = client.fetch("movie", 11, KEY)
    assert isinstance(result, Failure)
    assert result.category == category


def test_retry_after_is_kept_bounded(standin: StandIn, client: TmdbClient) -> None:
    standin.set_fault("throttle", retry_after="120")
    assert client.fetch("movie", 11, KEY) == Failure("throttled", 120)
    standin.set_fault("throttle", retry_after="garbage")
    assert client.fetch("movie", 11, KEY) == Failure("throttled", None)


def test_missing_identity_wrong_key_and_no_key(standin: StandIn, client: TmdbClient) -> None:
    standin.set_available("movie", 12, False)
    assert client.fetch("movie", 12, KEY) == Failure("not_found")
    assert client.fetch("movie", 13, "wrong-key") == Failure("auth")
    before = len(standin.state.arrivals)
    assert client.fetch("movie", 13, None) == Failure("configuration")
    assert len(standin.state.arrivals) == before  # no request without a key


def test_connection_refused_is_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with TmdbClient(f"http://127.0.0.1:{port}", timeout_seconds=1.0) as c:
        assert c.fetch("movie", 1, KEY) == Failure("transient")


def test_tmdb_codes_decide_over_status() -> None:
    assert classify(200, b'{"status_code": 34}', None).category == "not_found"
    assert classify(403, b'{"status_code": 10}', None).category == "auth"
    assert classify(400, b'{"status_code": 25}', None).category == "throttled"
    assert classify(418, b"teapot", 30) == Failure("invalid_response", 30)


@pytest.mark.parametrize("url", ["ftp://x", "localhost:80", "http://", "http://h/?api_key=k"])
def test_bad_base_url(url: str) -> None:
    with pytest.raises(ProviderConfigError) as info:
        TmdbClient(url)
    assert "api_key=k" not in str(info.value)


def test_key_never_in_logs(
    standin: StandIn, client: TmdbClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for fault in ("status", "close", "garbage", "slow"):
        standin.set_fault(fault, delay=2.0)
        client.fetch("movie", 11, KEY)
    standin.clear_fault()
    client.fetch("movie", 11, KEY)
    assert KEY not in caplog.text
    assert redact(f"GET /3/movie/1?api_key={KEY}&language=en") == (
        "GET /3/movie/1?api_key=***&language=en"
    )


def test_key_never_in_httpx_or_httpcore_debug_logs(
    standin: StandIn, client: TmdbClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator who turns httpx's and httpcore's own loggers up to DEBUG sees every
    trace line (their child loggers' included, where headers are written) without the
    key, though the server echoes it in a header."""
    for name in ("httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)
    standin.set_fault("echo_key")
    client.fetch("movie", 11, KEY)
    standin.clear_fault()
    client.fetch("movie", 11, KEY)
    assert "receive_response_headers" in caplog.text  # the trace lines were written
    assert "X-Echo" in caplog.text and KEY not in caplog.text
