"""The public Python API, called as another program would: through
`inventory_pipeline.api` alone, on real PostgreSQL, each function's transaction
contract included."""

from __future__ import annotations

import uuid
from datetime import date, timedelta
from decimal import Decimal

import pytest

from inventory_pipeline import api
from inventory_pipeline.db import execute, fetch_all
from tests import factories as f
from tests import stats_factories as sf

TODAY = date(2026, 3, 10)


class CallerRollsBack(Exception):
    """The caller's own transaction fails after the API call."""


def test_the_api_names_what_it_exports() -> None:
    for name in api.__all__:
        assert getattr(api, name) is not None
    for function in (api.request_learning_refresh, api.process_user, api.read_pr_overview):
        assert function.__module__ == "inventory_pipeline.api"
        assert "Transaction:" in (function.__doc__ or "")
        assert "Example::" in (function.__doc__ or "")


def learning_requests(conn: api.Connection, library_id: int) -> list[dict[str, object]]:
    return fetch_all(
        conn,
        "SELECT kind, status, learning_id, classification_id, candidate_id"
        " FROM profile_refresh_requests WHERE library_id = %s ORDER BY id",
        (library_id,),
    )


def test_request_learning_refresh(conn: api.Connection) -> None:
    lib = f.library(conn)
    # Inside the caller's transaction it commits or rolls back with the caller's writes.
    with pytest.raises(CallerRollsBack), api.transaction(conn):
        assert api.request_learning_refresh(conn, lib, 7, 3) is not None
        raise CallerRollsBack
    assert learning_requests(conn, lib) == []
    # On its own it commits at once; a second request finds the active one.
    request_id = api.request_learning_refresh(conn, lib, 7, 3, candidate_id=11)
    assert isinstance(request_id, int)
    assert api.request_learning_refresh(conn, lib, 8, 3) is None
    assert learning_requests(conn, lib) == [
        {
            "kind": "learning",
            "status": "pending",
            "learning_id": 7,
            "classification_id": 3,
            "candidate_id": 11,
        }
    ]
    with pytest.raises(api.DatabaseError) as refused:
        api.request_learning_refresh(conn, lib + 1000, 7, 3)
    assert refused.value.sqlstate == "23503"


@pytest.fixture
def user(conn: api.Connection) -> uuid.UUID:
    execute(conn, "SELECT set_config('inventory.stats_today', %s, false)", (TODAY.isoformat(),))
    sf.exercise(conn, "squat")
    return uuid.uuid4()


def test_process_user_then_read_pr_overview(conn: api.Connection, user: uuid.UUID) -> None:
    assert api.process_user(conn, user, "app").outcome == "idle"
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    # Inside the caller's transaction the publication counts only if the caller commits.
    with pytest.raises(CallerRollsBack), api.transaction(conn):
        assert api.process_user(conn, user, "app").outcome == "published"
        raise CallerRollsBack
    assert sf.versions(conn, user) == (1, 0)
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]

    result = api.process_user(conn, user, "app")
    assert isinstance(result, api.AccountResult)
    assert (result.outcome, result.generation, result.has_more) == ("published", 1, False)
    assert sf.versions(conn, user) == (1, 1)
    rows = api.read_pr_overview(conn, user, TODAY)
    assert rows == [
        {
            "exercise_id": "squat",
            "best_e1rm_all_time": Decimal("116.67"),  # 100 x (30 + 5) / 30
            "best_e1rm_30d": Decimal("116.67"),
            "best_e1rm_30d_prior_year": None,
            "heaviest_kg": Decimal("100.00"),
            "stale": False,
        }
    ]
    assert set(rows[0]) == set(api.PrOverviewRow.__annotations__)
    # Newer work queued: the served generation says it is stale until published.
    sf.save(conn, user, TODAY, sf.sets(("squat", 110, 5)))
    assert [r["stale"] for r in api.read_pr_overview(conn, user, TODAY)] == [True]


def test_read_pr_overview_fails_closed_and_serves_the_application_role(
    conn: api.Connection, user: uuid.UUID
) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    assert api.process_user(conn, user, "app").outcome == "published"
    # The window is the database date and the day either side (yesterday's overview
    # holds nothing of today's session, but it exists).
    assert api.read_pr_overview(conn, user, TODAY - timedelta(days=1)) == []
    assert len(api.read_pr_overview(conn, user, TODAY + timedelta(days=1))) == 1
    for day in (TODAY + timedelta(days=2), TODAY - timedelta(days=2)):
        with pytest.raises(api.DatabaseError) as closed:
            api.read_pr_overview(conn, user, day)
        assert closed.value.sqlstate == "55000"
    with pytest.raises(api.DatabaseError) as unknown:
        api.read_pr_overview(conn, uuid.uuid4(), TODAY)
    assert unknown.value.sqlstate == "55000"

    def as_application(acting_for: uuid.UUID | None) -> list[api.PrOverviewRow]:
        with api.transaction(conn):
            execute(conn, "SET LOCAL ROLE inventory_app")
            if acting_for is not None:
                execute(
                    conn,
                    "SELECT set_config('inventory.current_user_id', %s, true)",
                    (str(acting_for),),
                )
            return api.read_pr_overview(conn, user, TODAY)

    assert [r["exercise_id"] for r in as_application(user)] == ["squat"]
    for acting_for in (uuid.uuid4(), None):
        with pytest.raises(api.DatabaseError) as refused:
            as_application(acting_for)
        assert refused.value.sqlstate == "42501"
