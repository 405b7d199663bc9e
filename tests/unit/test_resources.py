"""Settings as resources: bound to their environment variables, resolved when a run
initializes them, and a bad value fails the run in one line that names the variable."""

from __future__ import annotations

import dagster as dg
import pytest
import yaml

from inventory_pipeline.defs.resources import (
    InventoryDatabase,
    TmdbResource,
    bound_resources,
    inventory_database,
    tmdb_resource,
)
from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.settings import DEFAULT_TMDB_BASE_URL


def test_unset_variables_keep_the_defaults() -> None:
    env = {"INVENTORY_DATABASE_URL": "postgresql://u@127.0.0.1:1/x"}
    tmdb = tmdb_resource({})
    assert (tmdb.base_url, tmdb.rate, tmdb.workers, tmdb.max_items) == (
        DEFAULT_TMDB_BASE_URL,
        40,
        8,
        2000,
    )
    assert inventory_database(env).run_claims == 5000


def test_every_policy_field_is_a_field_of_the_database_resource() -> None:
    """A policy field the resource lacks would fail every tick that reads the policy."""
    resource = InventoryDatabase(url="postgresql://localhost/x")
    assert resource.policy() == RefreshPolicy()


@dg.op
def read(tmdb: TmdbResource, inventory_db: InventoryDatabase) -> tuple[int, int]:
    return tmdb.settings().rate, inventory_db.policy().run_claims


@dg.job
def settings_job() -> None:
    read()


def test_values_are_read_when_a_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The code location's resources read the environment when a run initializes them:
    the values at run time count, never those seen when the definitions were loaded."""
    defs = dg.Definitions(jobs=[settings_job], resources=bound_resources())
    monkeypatch.setenv("INVENTORY_TMDB_RATE", "9")
    monkeypatch.setenv("INVENTORY_RUN_CLAIMS", "4")
    monkeypatch.setenv("INVENTORY_DATABASE_URL", "postgresql://u@127.0.0.1:1/x")
    result = defs.resolve_job_def("settings_job").execute_in_process()
    assert result.output_for_node("read") == (9, 4)


def test_the_launchpad_shows_op_config_and_no_resource_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the Launchpad pre-fills (the run config schema's defaults, as the webserver
    computes them): the op's config; settings are the deployment's environment, not
    launch choices (before, 14 lines of `inventory_db` values pre-filled every job)."""
    from dagster._core.snap import JobSnap
    from dagster_graphql.schema.run_config import default_values_yaml_from_type_snap

    from inventory_pipeline.definitions import defs

    monkeypatch.setenv("INVENTORY_STALL_SECONDS", "600")
    for name, expected in [
        (
            "stats_drain",
            {
                "ops": {
                    "drain_stats": {
                        # A launchpad drain ends when nothing is claimable, as before.
                        "config": {
                            "idle_seconds": 0.0,
                            "lifetime_seconds": 3600.0,
                            "max_rounds": 2000,
                        }
                    }
                }
            },
        ),
        ("stats_worker_control", {"ops": {"control_stats_worker": {"config": {"action": "show"}}}}),
        ("library_profile_refresh", {}),
        ("provider_observation", {}),
    ]:
        snap = JobSnap.from_job_def(defs.resolve_job_def(name))
        schema = snap.config_schema_snapshot
        root = schema.get_config_snap(snap.mode_def_snaps[0].root_config_key)
        assert yaml.safe_load(default_values_yaml_from_type_snap(schema, root)) == expected, name


@pytest.mark.parametrize(
    ("resource", "message"),
    [
        (TmdbResource(rate=0), "INVENTORY_TMDB_RATE must be positive, got 0"),
        (TmdbResource(workers=-1), "INVENTORY_OBSERVATION_WORKERS must be positive"),
        (
            TmdbResource(base_url="ftp://user:hunter2@tmdb.example/"),
            "INVENTORY_TMDB_BASE_URL: TMDb base URL must be http(s)",
        ),
    ],
)
def test_bad_tmdb_values_fail_in_one_line(resource: TmdbResource, message: str) -> None:
    with pytest.raises(dg.Failure) as failure:
        resource.settings()
    text = str(failure.value.description)
    assert message in text and "\n" not in text and "hunter2" not in text


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lease_seconds": 5}, "INVENTORY_LEASE_SECONDS must be at least 10 seconds"),
        ({"run_claims": 0}, "INVENTORY_RUN_CLAIMS must be positive, got 0"),
        ({"runs_per_tick": 0}, "INVENTORY_MAX_RUNS_PER_TICK must be positive, got 0"),
    ],
)
def test_bad_policy_values_fail_in_one_line(changes: dict[str, int], message: str) -> None:
    db = InventoryDatabase(url="postgresql://u@127.0.0.1:1/x", **changes)
    with pytest.raises(dg.Failure, match=message):
        db.policy()
        db.max_runs_per_tick()


def test_a_value_that_is_not_a_number_fails_the_run_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read when the run starts: the run fails before any op, in one line naming the
    variable and not echoing its value."""
    monkeypatch.setenv("INVENTORY_DATABASE_URL", "postgresql://u@127.0.0.1:1/x")
    monkeypatch.setenv("INVENTORY_TMDB_RATE", "fast-9c1d")
    defs = dg.Definitions(jobs=[settings_job], resources=bound_resources())
    result = defs.resolve_job_def("settings_job").execute_in_process(raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "RESOURCE_INIT_FAILURE"]
    text = str(failure.event_specific_data)
    assert "INVENTORY_TMDB_RATE must be a whole number" in text
    assert "fast-9c1d" not in text


def test_a_bad_tmdb_value_fails_only_what_asks_tmdb(monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in a TMDb setting fails the observation path, never the profile refresh or
    the stats worker (which read only the database resource)."""
    env = {"INVENTORY_DATABASE_URL": "postgresql://u@127.0.0.1:1/x", "INVENTORY_TMDB_RATE": "-5"}
    assert inventory_database(env).run_claims == 5000
    with pytest.raises(dg.Failure, match="INVENTORY_TMDB_RATE must be positive"):
        tmdb_resource(env)
    # And the other way: a bad policy value leaves TMDb's resource readable.
    assert tmdb_resource({"INVENTORY_RUN_CLAIMS": "0"}).rate == 40
