"""The public Python API, called as another program would: through
`inventory_pipeline.api` alone, on real PostgreSQL, each function's transaction
contract included."""

from __future__ import annotations

import uuid
from datetime import date, timedelta
from decimal import Decimal

import pytest

from inventory_pipeline import api
from inventory_pipeline.db import execute, fetch_all, fetch_one
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
    assert api.read_pr_overview(conn, user, TODAY) == api.PrOverview(
        as_of=TODAY,
        generation=1,
        stale=False,
        exercises=(
            api.PrExercise(
                exercise_id="squat",
                best_e1rm_all_time=Decimal("116.67"),  # 100 x (30 + 5) / 30
                best_e1rm_30d=Decimal("116.67"),
                best_e1rm_30d_prior_year=None,
                heaviest_kg=Decimal("100.00"),
            ),
        ),
    )
    # Newer work queued: the served generation says it is stale until published.
    sf.save(conn, user, TODAY, sf.sets(("squat", 110, 5)))
    assert api.read_pr_overview(conn, user, TODAY).stale


def test_an_overview_with_no_exercise_still_says_whether_it_is_stale(
    conn: api.Connection, user: uuid.UUID
) -> None:
    """A user whose published window holds no exercise (only warm-ups logged) saves a
    140 kg squat. Until that save is published the overview has no row to carry the
    word, and still says it is stale, through the Python reader and SQL alike."""
    sf.save(conn, user, TODAY, sf.sets(("squat", 60, 10, True)))
    assert api.process_user(conn, user, "app").outcome == "published"
    current = api.read_pr_overview(conn, user, TODAY)
    assert (current.exercises, current.stale, current.generation) == ((), False, 1)
    sf.save(conn, user, TODAY, sf.sets(("squat", 140, 1)))
    behind = api.read_pr_overview(conn, user, TODAY)
    assert (behind.exercises, behind.stale, behind.generation) == ((), True, 1)
    status = fetch_one(
        conn, "SELECT * FROM get_pr_overview_status(%s, %s)", (user, TODAY.isoformat())
    )
    assert status == {"generation": 1, "as_of_date": TODAY, "stale": True, "exercise_count": 0}
    assert api.process_user(conn, user, "app").outcome == "published"
    published = api.read_pr_overview(conn, user, TODAY)
    assert (published.stale, published.generation) == (False, 2)
    assert [e.best_e1rm_all_time for e in published.exercises] == [Decimal("140.00")]


def test_read_pr_overview_fails_closed_and_serves_the_application_role(
    conn: api.Connection, user: uuid.UUID
) -> None:
    sf.save(conn, user, TODAY, sf.sets(("squat", 100, 5)))
    assert api.process_user(conn, user, "app").outcome == "published"
    # The window is the database date and the day either side (yesterday's overview
    # holds nothing of today's session, but it exists).
    assert api.read_pr_overview(conn, user, TODAY - timedelta(days=1)).exercises == ()
    assert len(api.read_pr_overview(conn, user, TODAY + timedelta(days=1)).exercises) == 1
    for day in (TODAY + timedelta(days=2), TODAY - timedelta(days=2)):
        with pytest.raises(api.DatabaseError) as closed:
            api.read_pr_overview(conn, user, day)
        assert closed.value.sqlstate == "55000"
    with pytest.raises(api.DatabaseError) as unknown:
        api.read_pr_overview(conn, uuid.uuid4(), TODAY)
    assert unknown.value.sqlstate == "55000"

    def as_application(acting_for: uuid.UUID | None) -> api.PrOverview:
        with api.transaction(conn):
            execute(conn, "SET LOCAL ROLE inventory_app")
            if acting_for is not None:
                execute(
                    conn,
                    "SELECT set_config('inventory.current_user_id', %s, true)",
                    (str(acting_for),),
                )
            return api.read_pr_overview(conn, user, TODAY)

    assert [e.exercise_id for e in as_application(user).exercises] == ["squat"]
    for acting_for in (uuid.uuid4(), None):
        with pytest.raises(api.DatabaseError) as refused:
            as_application(acting_for)
        assert refused.value.sqlstate == "42501"
