"""The operator's runbook: change a budget, pause and resume the worker, retry an
exhausted job — as service calls and as `inventory-pipeline stats ...` commands."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import date

import pytest

from inventory_pipeline import cli
from inventory_pipeline.db import Connection, fetch_all, fetch_one
from inventory_pipeline.stats import runbook, service
from tests import stats_factories as sf

D = date(2026, 3, 10)
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def user(conn: Connection) -> uuid.UUID:
    sf.exercise(conn, "squat")
    return uuid.uuid4()


@pytest.fixture
def command(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Run:
    for name in ("INVENTORY_DAGSTER_STORAGE_URL", "DAGSTER_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("INVENTORY_DATABASE_URL", db_url)

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = cli.main(["stats", *args])
        except SystemExit as exc:  # argparse refusals
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def failed_job(conn: Connection, user: uuid.UUID) -> int:
    """A job that exhausted its attempts (dead workers past the cap)."""
    job_id = int(sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["job_id"])
    for _ in range(3):
        dead = service.claim(conn, "dead")
        assert dead is not None
        sf.expire_run(conn, dead.run_id, dead.lease_token)
    assert service.claim(conn, "test") is None
    assert sf.jobs(conn, user)[0]["status"] == "failed"
    return job_id


def test_pause_stops_claims_and_loses_nothing(conn: Connection, user: uuid.UUID) -> None:
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    assert runbook.pause(conn).paused
    assert service.claim(conn, "w") is None
    assert service.drain(conn, "w").rounds == 0
    waiting = service.work_waiting(conn)
    assert (waiting.paused, waiting.waiting, waiting.claimable) == (True, 1, 0)
    assert [j["status"] for j in sf.jobs(conn, user)] == ["pending"]
    assert not runbook.resume(conn).paused
    assert len(service.drain(conn, "w").published) == 1


def test_pause_lets_work_in_flight_finish(conn: Connection, user: uuid.UUID) -> None:
    sf.history(conn, user, sessions=60, exercises=120)
    claimed = service.claim(conn, "w")
    assert claimed is not None
    assert service.compute(conn, claimed).status == "batch_pending"
    runbook.pause(conn)
    assert service.process(conn, claimed).outcome == "published"
    requested, applied = sf.versions(conn, user)
    assert requested == applied


def test_retry_an_exhausted_job(conn: Connection, user: uuid.UUID) -> None:
    job_id = failed_job(conn, user)
    assert service.worker_status(conn)["attempt_exhausted_failures"] == 1
    retried = runbook.retry(conn, job_id)
    assert service.worker_status(conn)["attempt_exhausted_failures"] == 0
    service.drain(conn, "w")
    jobs = {j["id"]: j for j in sf.jobs(conn, user)}
    assert jobs[retried.successor_id]["status"] == "completed"
    assert jobs[job_id]["metadata"]["retried_by"] == retried.successor_id
    assert sf.versions(conn, user) == (2, 2) and set(sf.exercise_stats(conn, user)) == {"squat"}
    with pytest.raises(runbook.RunbookError, match="already retried"):
        runbook.retry(conn, job_id)


def test_settings_respect_the_table_checks(conn: Connection) -> None:
    changed = runbook.change_settings(conn, {"compute_budget_ms": 30000, "active_lease_cap": 4})
    assert (changed.compute_budget_ms, changed.active_lease_cap) == (30000, 4)
    with pytest.raises(runbook.RunbookError) as refused:
        runbook.change_settings(conn, {"publish_budget_ms": 9000})
    assert str(refused.value) == (
        "settings refused: the publish budget must be at least 0.1 s (100 ms) and under 8 s,"
        " the save's deadline"
    )
    with pytest.raises(runbook.RunbookError) as refused:
        runbook.change_settings(conn, {"lease_seconds": 10})
    assert str(refused.value) == (
        "settings refused: the lease must cover the compute and publish budgets together"
    )
    assert runbook.settings(conn) == changed


@pytest.mark.parametrize("stage", ["claim", "compute", "publish"])
def test_a_budget_no_stage_can_finish_in_is_refused(conn: Connection, stage: str) -> None:
    """A one-millisecond budget was accepted, and every call of its stage ran out of it
    (a claim budget of 1 ms made a drain publish nothing): every stage budget has a
    floor, stated in the refusal."""
    with pytest.raises(runbook.RunbookError) as refused:
        runbook.change_settings(conn, {f"{stage}_budget_ms": 1})
    assert f"the {stage} budget must be at least 0.1 s (100 ms)" in str(refused.value)
    assert runbook.change_settings(conn, {f"{stage}_budget_ms": 100}).paused is False


def test_cli_runbook(command: Run, conn: Connection, user: uuid.UUID) -> None:
    run = command
    code, out, _ = run("settings", "--compute-seconds", "45", "--backoff-seconds", "10")
    assert code == 0 and "compute 45000 ms" in out and "backoff 10 s" in out
    code, out, _ = run("pause")
    assert code == 0 and "paused" in out
    sf.save(conn, user, D, sf.sets(("squat", 100, 5)))
    code, out, _ = run("drain")
    assert code == 0 and out.startswith("published 0 generations") and "paused" in out
    code, out, _ = run("resume")
    assert code == 0
    code, out, _ = run("drain")
    assert code == 0 and out.startswith("published 1 generations")
    assert sf.versions(conn, user) == (1, 1)
    sf.save(conn, user, D, sf.sets(("squat", 110, 5)))
    code, out, _ = run("drain", "--idle", "1")
    assert code == 0
    assert out.splitlines() == [
        "published 1 generations, 0 deferred, 0 rejected, 0 failed, 0 lost, 0 interrupted",
        "ended: idle; in all: published 1 generations, 0 deferred, 0 rejected, 0 failed,"
        " 0 lost, 0 interrupted",
    ]
    assert sf.versions(conn, user) == (2, 2)


def test_cli_retry(command: Run, conn: Connection, user: uuid.UUID) -> None:
    run = command
    job_id = failed_job(conn, user)
    code, out, _ = run("retry", str(job_id))
    assert code == 0 and f"job {job_id} retried as job" in out


@pytest.mark.parametrize(
    ("args", "message", "exit_code"),
    [
        (["retry", "999999"], "no stats job 999999", 1),
        (["retry", "abc"], "must be a positive whole number", 2),
        (["settings", "--publish-seconds", "100"], "publish budget must be at least 0.1 s", 1),
        (["settings", "--lease-seconds", "5"], "the lease must cover the compute and publish", 1),
        (["settings", "--compute-seconds", "-1"], "must be a number of seconds", 2),
        (["settings", "--compute-seconds", "nan"], "must be a number of seconds", 2),
        (["settings", "--active-leases", "0"], "must be a positive whole number", 2),
        (["settings", "--backoff-seconds", "99999999999"], "must be a whole number", 2),
        (["drain", "--idle", "0"], "must be a positive whole number", 2),
        (["drain", "--idle", "5", "--lifetime", "x"], "must be a positive whole number", 2),
        (["drain", "--lifetime", "60"], "--lifetime needs --idle", 1),
    ],
)
def test_cli_runbook_errors_are_one_line(
    command: Run, args: list[str], message: str, exit_code: int
) -> None:
    run = command
    code, _, err = run(*args)
    assert code == exit_code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_cli_retry_refuses_a_job_that_did_not_fail(
    command: Run, conn: Connection, user: uuid.UUID
) -> None:
    run = command
    job_id = sf.save(conn, user, D, sf.sets(("squat", 100, 5)))["job_id"]
    code, _, err = run("retry", str(job_id))
    assert code == 1 and err.strip() == (
        f"inventory-pipeline: error: job {job_id} is pending, not an exhausted failure"
    )
    row = fetch_one(conn, "SELECT count(*) AS n FROM user_exercise_stats_refresh_jobs")
    assert row == {"n": 1}


def test_status_command_reports_freshness(
    command: Run, conn: Connection, user: uuid.UUID, capsys: pytest.CaptureFixture[str]
) -> None:
    failed_job(conn, user)
    command("pause")
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("stats freshness")]
    assert "1 users stale; 1 with an owed range" in line
    assert "1 exhausted jobs to retry" in line and line.endswith("worker PAUSED")


def test_every_settings_check_has_a_rule_an_operator_reads(conn: Connection) -> None:
    """A refusal states the rule, never a constraint's name: each CHECK of the settings
    table has its sentence."""
    names = {
        r["conname"]
        for r in fetch_all(
            conn,
            "SELECT conname FROM pg_constraint"
            " WHERE conrelid = 'stats_projection_worker_settings'::regclass AND contype = 'c'"
            " AND conname <> 'stats_projection_worker_settings_id_check'",
        )
    }
    assert names == set(runbook.SETTING_RULES)
