"""One definition of a valid typed TMDb identity, in SQL and Python alike, and an item
whose identity is malformed: a recovery case with its ordinary backoff, never a request,
never a failed run; warnings of committed cases survive a run that dies later."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from inventory_pipeline.db import (
    Connection,
    DatabaseUnavailable,
    connect,
    execute,
    fetch_all,
)
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service
from inventory_pipeline.recovery.models import ObservationResult
from inventory_pipeline.recovery.policy import RetryPolicy
from tests import factories as f
from tests.conftest import TMDB_TEST_KEY

POLICY = RetryPolicy()
INT4_MAX = 2**31 - 1

IDENTITIES: list[tuple[str, int | None]] = [
    ("603", 603),
    ("1", 1),
    ("2147483647", INT4_MAX),  # TMDb ids are int32
    ("2147483648", None),
    ("9999999999", None),
    ("99999999999999999999", None),
    ("0", None),  # TMDb ids start at 1
    ("0603", None),  # one spelling per id: no leading zeros
    ("00", None),
    ("", None),
    (" 603", None),
    ("603 ", None),
    ("603\n", None),  # a regex `$` would accept this one
    ("\t603", None),
    ("+603", None),
    ("-603", None),
    ("6_03", None),  # int() would accept this one
    ("6.03", None),
    ("1e3", None),
    ("0x25b", None),
    ("tt0111161", None),
    ("²", None),  # superscript two: str.isdigit() is True, int() raises
    ("٦٠٣", None),  # Arabic-Indic 603: int() reads it as 603
    ("\uff16\uff10\uff13", None),  # fullwidth 603
    ("\U0001d7d4\U0001d7ce\U0001d7d1", None),  # mathematical bold 603
    ("60\uff13", None),
    ("603²", None),
]


def sql_tmdb_ids(conn: Connection, texts: list[str]) -> list[int | None]:
    rows = fetch_all(
        conn,
        "SELECT tmdb_id_of(x.t) AS id FROM unnest(%s::text[]) WITH ORDINALITY AS x(t, n)"
        " ORDER BY x.n",
        (texts,),
    )
    return [r["id"] for r in rows]


@pytest.mark.parametrize(("text", "expected"), IDENTITIES)
def test_python_definition(text: str, expected: int | None) -> None:
    from inventory_pipeline.recovery.models import tmdb_id_of

    assert tmdb_id_of(text) == expected


def test_sql_and_python_share_one_definition(conn: Connection) -> None:
    from inventory_pipeline.recovery.models import tmdb_id_of

    rng = random.Random(7)
    alphabet = "0123456789" * 4 + "²٦٠٣\uff16\U0001d7d4 +-\n\t._xe"
    fuzz = ["".join(rng.choices(alphabet, k=rng.randint(0, 12))) for _ in range(3000)]
    fuzz += [str(rng.randint(1, 2**33)) for _ in range(500)]
    texts = [t for t, _ in IDENTITIES] + fuzz
    assert sql_tmdb_ids(conn, texts) == [tmdb_id_of(t) for t in texts]
    assert sql_tmdb_ids(conn, [t for t, _ in IDENTITIES]) == [e for _, e in IDENTITIES]


MALFORMED = ("²", "٦٠٣", "0603", "2147483648", " 7", "6_03")


def malformed_items(conn: Connection, library_id: int) -> dict[int, str]:
    items = {}
    for text in MALFORMED:
        item = f.tmdb_item(conn, library_id, 1)
        execute(conn, "UPDATE media_server_items SET provider_id = %s WHERE id = %s", (text, item))
        items[item] = text
    return items


def test_malformed_identity_gets_a_case_and_never_stops_the_run(
    conn: Connection, db_url: str, standin: StandIn
) -> None:
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    good = [f.tmdb_item(conn, lib, tmdb_id) for tmdb_id in (11, 12, 13, 14, 15, 16)]
    bad = malformed_items(conn, lib)
    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        summary = service.observe(lambda: connect(db_url), client, POLICY, workers=3)
    assert summary.observed == len(good)
    assert len(standin.state.arrivals) == len(good)  # a malformed identity is never sent
    rows = fetch_all(conn, "SELECT item_id, tmdb_id FROM provider_observations")
    observed = {r["item_id"]: r["tmdb_id"] for r in rows}
    assert set(observed) == set(good)
    assert 603 not in observed.values()  # '٦٠٣' is not TMDb 603
    for item in bad:
        row = f.item(conn, item)
        assert row["recovery_category"] == "not_found" and row["recovery_attempts"] == 1
        assert row["observation_lease_token"] is None
        # Its ordinary backoff: a missing identity waits at least a day.
        assert row["observation_due_at"] >= datetime.now(UTC) + timedelta(hours=23)
    assert {r.item_id for r in summary.results if r.transition == "opened"} == set(bad)
    # Not claimed again: nothing is due.
    assert service.due_items(conn) == 0 and service.claim(conn, 100) == []


def test_warnings_of_committed_cases_survive_a_run_that_dies(
    conn: Connection, db_url: str, server_url: str, standin: StandIn
) -> None:
    """Each warning is delivered right after its own commit: the main connection dies
    after the first batch, the run fails, and every case committed so far was told."""
    f.provider_key(conn, TMDB_TEST_KEY)
    lib = f.library(conn)
    for tmdb_id in range(900, 912):
        f.tmdb_item(conn, lib, tmdb_id)
        standin.set_available("movie", tmdb_id, False)
    opened = connections(db_url)
    told: list[ObservationResult] = []

    def on_result(result: ObservationResult) -> None:
        told.append(result)
        if len(told) == 4:  # the first batch is done: the run's own session dies
            with connect(db_url) as admin:
                execute(
                    admin,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'observer-main'",
                )

    with TmdbClient(standin.url, timeout_seconds=2.0) as client:
        with pytest.raises(DatabaseUnavailable):
            service.observe(opened, client, POLICY, workers=1, on_result=on_result)
    cases = fetch_all(conn, "SELECT id FROM media_server_items WHERE recovery_case_id IS NOT NULL")
    assert len(cases) >= 4
    warned = {r.item_id for r in told if (n := service.notice(r)) and n[0] == "warning"}
    assert warned == {r["id"] for r in cases}


def connections(db_url: str) -> Callable[[], Connection]:
    """The first connection a run opens is its main session, named so a test can end it."""
    count = 0

    def open_next() -> Connection:
        nonlocal count
        count += 1
        name = "observer-main" if count == 1 else "observer-worker"
        return connect(db_url, application_name=name)

    return open_next
