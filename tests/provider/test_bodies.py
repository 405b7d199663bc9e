"""Coded answers over loopback: a body is decoded within its limit and a few MiB of
memory whatever its Content-Encoding stack says, and every answer ends in a category."""

from __future__ import annotations

import gzip
import json
import os
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from inventory_pipeline.provider.body import BodyTooLarge, Undecodable, read_limited
from inventory_pipeline.provider.models import Failure, Observation
from inventory_pipeline.provider.standin import StandIn, encoded, record
from inventory_pipeline.provider.tmdb import TmdbClient
from tests.conftest import TMDB_TEST_KEY

KEY = TMDB_TEST_KEY
MIB = 1 << 20
# A few MiB for the whole request: the client, the stand-in's thread, the pieces.
PEAK_BYTES = 4 * MIB


def _peak(standin: StandIn, client: TmdbClient) -> tuple[Observation | Failure, int]:
    """The answer to one fetch, and the most memory Python held during it."""
    tracemalloc.start()
    try:
        result = client.fetch("movie", 11, KEY)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def bombs() -> Iterator[None]:
    """The bombs coded before any measurement (each a few hundred bytes once coded)."""
    for encoding, size in (
        (("gzip", "gzip"), 256 * MIB),
        (("gzip",), 64 * MIB),
        (("deflate", "gzip"), 256 * MIB),
    ):
        encoded(encoding, size, None)
    yield


@pytest.mark.parametrize(
    ("encoding", "size"),
    [
        pytest.param(("gzip", "gzip"), 256 * MIB, id="gzip, gzip: 256 MiB"),
        pytest.param(("gzip",), 64 * MIB, id="gzip: 64 MiB"),
        pytest.param(("deflate", "gzip"), 256 * MIB, id="deflate, gzip: 256 MiB"),
    ],
)
def test_a_bomb_is_refused_within_a_few_mib(
    standin: StandIn, client: TmdbClient, bombs: None, encoding: tuple[str, ...], size: int
) -> None:
    standin.set_fault("encoded", encoding=encoding, size=size)
    result, peak = _peak(standin, client)
    assert result == Failure("invalid_response", cause="body too large")
    assert peak < PEAK_BYTES, (
        f"{peak / MIB:.1f} MiB held decoding {len(encoded(encoding, size, None))} bytes"
    )


@pytest.mark.parametrize(
    "encoding",
    [
        (),
        ("identity",),
        ("gzip",),
        ("x-gzip",),
        ("deflate",),
        ("gzip", "gzip"),
        ("deflate", "gzip", "gzip"),
    ],
)
def test_a_coded_record_is_read(
    standin: StandIn, client: TmdbClient, encoding: tuple[str, ...]
) -> None:
    standin.set_fault("encoded", encoding=encoding, body=json.dumps(record("movie", 11)))
    result = client.fetch("movie", 11, KEY)
    assert isinstance(result, Observation) and result.tmdb_id == 11


@pytest.mark.parametrize(
    ("encoding", "cause"),
    [
        (("br",), "content encoding not asked for"),
        (("gzip", "zstd"), "content encoding not asked for"),
        (("gzip",) * 4, "too many content encodings"),
    ],
)
def test_a_coding_not_asked_for_is_refused_unread(
    standin: StandIn, client: TmdbClient, encoding: tuple[str, ...], cause: str
) -> None:
    standin.set_fault("encoded", encoding=encoding, body=json.dumps(record("movie", 11)))
    assert client.fetch("movie", 11, KEY) == Failure("invalid_response", cause=cause)


def test_a_coded_body_cut_short_is_invalid(standin: StandIn, client: TmdbClient) -> None:
    standin.set_fault("encoded", encoding=("gzip",), body=json.dumps(record("movie", 11)), cut=12)
    assert client.fetch("movie", 11, KEY) == Failure("invalid_response", cause="body cut short")


@pytest.mark.parametrize("encoding", [["gzip"], ["deflate"], ["gzip", "deflate"]])
def test_a_garbled_coded_body_is_undecodable(encoding: list[str]) -> None:
    with pytest.raises(Undecodable, match=r"^undecodable body$"):
        read_limited([b"not coded at all"], encoding, MIB, time.monotonic() + 5)


def test_an_incompressible_body_at_the_limit_is_read_through_two_layers() -> None:
    """An inner layer is a little larger than the body it codes (headers, stored
    blocks): a body of exactly the limit still reads; one byte more does not."""
    body = os.urandom(MIB // 16)
    twice = gzip.compress(gzip.compress(body))
    assert read_limited([twice], ["gzip", "gzip"], len(body), time.monotonic() + 5) == body
    with pytest.raises(BodyTooLarge):
        read_limited([twice], ["gzip", "gzip"], len(body) - 1, time.monotonic() + 5)


def test_every_answer_of_the_compressing_provider_ends_as_uncompressed(
    standin: StandIn, client: TmdbClient
) -> None:
    """The stand-in's compress fault: a record, a 404 and a 401 each come gzip-coded (the
    client asks for gzip) and each reads as it would uncoded."""
    standin.set_fault("compress")
    assert isinstance(observed := client.fetch("movie", 11, KEY), Observation)
    assert observed.tmdb_id == 11
    standin.set_available("movie", 12, False)
    missing = client.fetch("movie", 12, KEY)
    assert isinstance(missing, Failure) and missing.category == "not_found"
    wrong = client.fetch("movie", 11, "not-the-key")
    assert isinstance(wrong, Failure) and wrong.category == "auth"
    assert len(standin.state.paths) == 3
