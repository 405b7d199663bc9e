"""`inventory-pipeline proposals list | approve ID… | reject ID…` in a subprocess: what
an operator reads, what a decision prints, and bad input refused in one line with a
non-zero exit, nothing decided."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inventory_pipeline.db import Connection, connect
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from tests import factories as f
from tests import revalidation_cases as rc
from tests.acceptance.test_cli import run
from tests.conftest import TMDB_TEST_KEY


@pytest.fixture
def env(db_url: str, tmp_path: Path) -> dict[str, str]:
    return {"INVENTORY_DATABASE_URL": db_url, "INVENTORY_DATA_DIR": str(tmp_path)}


@pytest.fixture
def proposed(conn: Connection, client: TmdbClient, standin: StandIn) -> Iterator[dict[str, int]]:
    """Two proposals (items 'Heat' 603 -> 9603, 'Ronin' 604 -> 9604) and a case that got
    none (a broken round trip)."""
    f.provider_key(conn, TMDB_TEST_KEY)
    library = f.library(conn, name="Films")
    heat = rc.merged(conn, client, standin, library, 603, 9603, title="Heat", year=1995)
    ronin = rc.merged(conn, client, standin, library, 604, 9604, title="Ronin", year=1998)
    rc.merged(conn, client, standin, library, 605, 9605, survivor={"round_trip": False})
    rc.revalidate(conn, client)
    ids = {p["item_id"]: p["id"] for p in rc.proposals(conn)}
    yield {"heat": ids[heat], "ronin": ids[ronin], "heat_item": heat, "ronin_item": ronin}


def test_list_approve_and_reject(
    env: dict[str, str], db_url: str, proposed: dict[str, int]
) -> None:
    listed = run(["proposals", "list"], env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:8] == [
        "ID",
        "STATE",
        "ITEM",
        "LIBRARY",
        "KIND",
        "OLD",
        "CANDIDATE",
        "YEAR",
    ]
    heat = next(line for line in lines if line.startswith(f"{proposed['heat']} "))
    assert "proposed" in heat and "Films" in heat and " 603 " in heat and " 9603 " in heat
    assert '"Heat" = "Heat"' in heat and "1995~1995" in heat
    assert lines[-1].startswith("1 cases with no proposal (round_trip 1)")

    approved = run(["proposals", "approve", str(proposed["heat"]), "--by", "alice"], env)
    assert approved.returncode == 0, approved.stderr
    assert approved.stdout.strip() == (
        f"inventory-pipeline: proposal {proposed['heat']} approved (item {proposed['heat_item']}:"
        " TMDb 603 -> 9603; observed under the new id at the next observation run)"
    )
    rejected = run(["proposals", "reject", str(proposed["ronin"])], env)
    assert rejected.returncode == 0, rejected.stderr
    assert "keeps TMDb 604 and its ordinary backoff" in rejected.stdout
    with connect(db_url) as conn:
        states = {p["id"]: (p["state"], p["decided_by"]) for p in rc.proposals(conn)}
    assert states[proposed["heat"]] == ("approved", "alice")
    assert states[proposed["ronin"]][0] == "rejected" and states[proposed["ronin"]][1]

    everything = run(["proposals", "list", "--state", "all"], env)
    assert "approved" in everything.stdout and "rejected" in everything.stdout
    only = run(["proposals", "list", "--state", "rejected"], env)
    rows = [line.split()[0] for line in only.stdout.splitlines()[1:-1]]
    assert rows == [str(proposed["ronin"])]
    status = run(["status"], env)
    assert "replacement proposals" in status.stdout and "'approved': 1" in status.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["proposals", "approve"], "the following arguments are required: ID"),
        (["proposals", "approve", "x7"], "must be a positive whole number, got 'x7'"),
        (["proposals", "reject", "0"], "must be a positive whole number, got '0'"),
        (["proposals", "approve", "1; DROP TABLE libraries"], "must be a positive whole"),
        (["proposals", "frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str) -> None:
    result = run(args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_refused_decisions_are_one_line_and_decide_nothing(
    env: dict[str, str], db_url: str, proposed: dict[str, int]
) -> None:
    heat = proposed["heat"]
    refusals = [
        (["proposals", "list", "--state", "maybe"], "unknown proposal state 'maybe'"),
        (["proposals", "approve", "424242"], "proposal 424242 does not exist"),
        (["proposals", "approve", str(heat), str(heat)], f"proposal {heat} is named twice"),
        (["proposals", "approve", str(heat), "--by", ""], "the operator's name must be 1 to 64"),
    ]
    with connect(db_url) as conn:
        before = rc.proposals(conn)
    for args, message in refusals:
        result = run(args, env)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr
    with connect(db_url) as conn:
        assert rc.proposals(conn) == before


def test_a_decided_proposal_is_refused_by_name(
    env: dict[str, str], proposed: dict[str, int]
) -> None:
    assert run(["proposals", "reject", str(proposed["heat"])], env).returncode == 0
    again = run(["proposals", "approve", str(proposed["ronin"]), str(proposed["heat"])], env)
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"inventory-pipeline: error: proposal {proposed['heat']} is already rejected"
    )
    # All or nothing: the other one named was not approved either.
    assert "proposed" in run(["proposals", "list"], env).stdout
