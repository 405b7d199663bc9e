"""A request's deadline is wall-clock over the whole exchange: a server that trickles its
status line and headers a byte at a time (each read gets a byte, so no per-read timeout
ever fires) is cut at the deadline, for the probe and for observation requests alike."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.db import Connection
from inventory_pipeline.provider.models import Failure
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

# The dripped status line and headers are about 85 bytes: at one byte a second they
# would take well over a minute to arrive.
HEADER_BYTES = 80


def test_probe_is_cut_at_five_seconds_by_a_header_drip(conn: Connection, standin: StandIn) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    f.auth_cases(conn, f.library(conn), 1)
    standin.set_fault("drip_headers", delay=1.0)  # one byte a second
    with credentials.probe_client(standin.url) as client:
        result = credentials.verify(conn, client)
    assert result is not None and result.outcome == "transient"
    # Five seconds of a byte a second, give or take the hang-up being noticed.
    assert standin.state.dripped <= 8 < HEADER_BYTES


def test_observation_request_is_cut_at_its_deadline_by_a_header_drip(
    standin: StandIn,
) -> None:
    standin.set_fault("drip_headers", delay=0.1)
    with TmdbClient(standin.url, timeout_seconds=1.0) as client:
        assert client.fetch("movie", 11, TMDB_TEST_KEY) == Failure("transient")
    assert standin.state.dripped <= 15 < HEADER_BYTES


def test_deadline_does_not_cut_a_prompt_answer(standin: StandIn) -> None:
    with TmdbClient(standin.url, timeout_seconds=1.0) as client:
        for tmdb_id in range(1, 30):  # one pooled connection, reused
            assert not isinstance(client.fetch("movie", tmdb_id, TMDB_TEST_KEY), Failure)


def test_name_resolution_counts_against_the_deadline(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolver that does not answer (the system's, held here until the test lets it
    go) and a one-second deadline: the request ends as transient while the lookup is
    still hanging, instead of waiting for it."""
    resolve = socket.getaddrinfo
    held = threading.Event()

    def hanging(*args: Any, **kwargs: Any) -> Any:
        held.wait(60)
        return resolve(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    url = standin.url.replace("127.0.0.1", "localhost")
    assert "localhost" in url
    answers: list[object] = []
    with TmdbClient(url, timeout_seconds=1.0) as client:
        request = threading.Thread(
            target=lambda: answers.append(client.fetch("movie", 11, TMDB_TEST_KEY))
        )
        request.start()
        request.join(timeout=20)  # a hang detector, far past the deadline
        ended_while_held = not request.is_alive()
        held.set()
        request.join()
    assert ended_while_held
    assert answers == [Failure("transient")]


def test_a_name_is_resolved_and_each_address_tried(standin: StandIn) -> None:
    """localhost may answer ::1 first, where nothing listens: the next address serves."""
    url = standin.url.replace("127.0.0.1", "localhost")
    with TmdbClient(url, timeout_seconds=2.0) as client:
        assert not isinstance(client.fetch("movie", 11, TMDB_TEST_KEY), Failure)
