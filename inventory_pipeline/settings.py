"""One frozen settings object, read from the environment once and validated.

Every value a user can get wrong fails here with one clear line, before anything
touches the database.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from inventory_pipeline.profiles.models import RefreshPolicy

DATABASE_URL = "INVENTORY_DATABASE_URL"
DAGSTER_STORAGE_URL = "INVENTORY_DAGSTER_STORAGE_URL"
DATA_DIR = "INVENTORY_DATA_DIR"
MAX_RUNS_PER_TICK = "INVENTORY_MAX_RUNS_PER_TICK"
TMDB_BASE_URL = "INVENTORY_TMDB_BASE_URL"
TMDB_RATE = "INVENTORY_TMDB_RATE"
OBSERVATION_WORKERS = "INVENTORY_OBSERVATION_WORKERS"
OBSERVATION_MAX_ITEMS = "INVENTORY_OBSERVATION_MAX_ITEMS"
REVALIDATIONS_PER_HOUR = "INVENTORY_REVALIDATIONS_PER_HOUR"
DEFAULT_TMDB_BASE_URL = "https://api.themoviedb.org"
# Unresolved 404 cases revalidated per rolling hour, by every process together (each
# check is an external-id lookup and at most one details request): a merge is rare, and
# a library's backlog of them is worked off over hours, never in a burst
# (docs/identity-revalidation.md#budget). The budget keeps one timestamp per claim of
# the last hour in one row, hence the ceiling.
DEFAULT_REVALIDATIONS_PER_HOUR = 60
MAX_REVALIDATIONS_PER_HOUR = 3600
# Profile refresh runs a sensor tick launches, and at most this many waiting to start.
DEFAULT_MAX_RUNS_PER_TICK = 4

# RefreshPolicy field -> environment variable, e.g. lease_seconds -> INVENTORY_LEASE_SECONDS
POLICY_ENV = {f.name: "INVENTORY_" + f.name.upper() for f in fields(RefreshPolicy)}


class SettingsError(ValueError):
    """The configuration is invalid."""


def checked_positive(name: str, value: int) -> int:
    """A count or duration must be positive; `name` is the variable a user sets."""
    if value <= 0:
        raise SettingsError(f"{name} must be positive, got {value}")
    return value


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number") from None
    return checked_positive(name, value)


def checked_revalidations(value: int) -> int:
    """The hourly revalidation budget: 1 to MAX_REVALIDATIONS_PER_HOUR."""
    if not 1 <= value <= MAX_REVALIDATIONS_PER_HOUR:
        raise SettingsError(
            f"{REVALIDATIONS_PER_HOUR} must be from 1 to {MAX_REVALIDATIONS_PER_HOUR}, got {value}"
        )
    return value


def checked_policy(values: Mapping[str, int]) -> RefreshPolicy:
    """A refresh policy from its field values: each positive, the lease at least 10 s."""
    policy = RefreshPolicy(
        **{name: checked_positive(POLICY_ENV[name], values[name]) for name in POLICY_ENV}
    )
    if policy.lease_seconds < 10:
        raise SettingsError(f"{POLICY_ENV['lease_seconds']} must be at least 10 seconds")
    return policy


def _base_url(value: str) -> str:
    from inventory_pipeline.provider.tmdb import ProviderConfigError, validate_base_url

    try:
        return validate_base_url(value)
    except ProviderConfigError as exc:
        raise SettingsError(f"{TMDB_BASE_URL}: {exc}") from None


@dataclass(frozen=True)
class TmdbSettings:
    """Where and how fast TMDb is asked (the key and language live in the database)."""

    base_url: str = DEFAULT_TMDB_BASE_URL
    rate: int = 40
    workers: int = 8
    max_items: int = 2000
    revalidations_per_hour: int = DEFAULT_REVALIDATIONS_PER_HOUR


def checked_tmdb(
    base_url: str,
    rate: int,
    workers: int,
    max_items: int,
    revalidations_per_hour: int = DEFAULT_REVALIDATIONS_PER_HOUR,
) -> TmdbSettings:
    return TmdbSettings(
        base_url=_base_url(base_url),
        rate=checked_positive(TMDB_RATE, rate),
        workers=checked_positive(OBSERVATION_WORKERS, workers),
        max_items=checked_positive(OBSERVATION_MAX_ITEMS, max_items),
        revalidations_per_hour=checked_revalidations(revalidations_per_hour),
    )


@dataclass(frozen=True)
class Settings:
    database_url: str | None
    dagster_storage_url: str | None
    data_dir: Path
    policy: RefreshPolicy = field(default_factory=RefreshPolicy)
    max_runs_per_tick: int = DEFAULT_MAX_RUNS_PER_TICK
    tmdb_base_url: str = TmdbSettings.base_url
    tmdb_rate: int = TmdbSettings.rate
    observation_workers: int = TmdbSettings.workers
    observation_max_items: int = TmdbSettings.max_items
    revalidations_per_hour: int = TmdbSettings.revalidations_per_hour

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        tmdb = tmdb_from_env(env)
        return cls(
            database_url=database_url_from_env(env),
            dagster_storage_url=env.get(DAGSTER_STORAGE_URL) or None,
            data_dir=Path(env.get(DATA_DIR) or ".inventory_pipeline").resolve(),
            policy=policy_from_env(env),
            max_runs_per_tick=max_runs_from_env(env),
            tmdb_base_url=tmdb.base_url,
            tmdb_rate=tmdb.rate,
            observation_workers=tmdb.workers,
            observation_max_items=tmdb.max_items,
            revalidations_per_hour=tmdb.revalidations_per_hour,
        )


# Each reader checks only its own variables: a bad TMDb setting fails what asks TMDb,
# never the profile refresh or the stats worker.


def database_url_from_env(env: Mapping[str, str]) -> str | None:
    """The application database's URL, checked to be a PostgreSQL URL; None when unset."""
    url = env.get(DATABASE_URL) or None
    if url is not None:
        from inventory_pipeline.db.connection import validate_url

        validate_url(url)
    return url


def policy_from_env(env: Mapping[str, str]) -> RefreshPolicy:
    """The refresh policy: each field from its variable (POLICY_ENV), else its default."""
    defaults = RefreshPolicy()
    return checked_policy(
        {name: _positive_int(env, var, getattr(defaults, name)) for name, var in POLICY_ENV.items()}
    )


def max_runs_from_env(env: Mapping[str, str]) -> int:
    return _positive_int(env, MAX_RUNS_PER_TICK, DEFAULT_MAX_RUNS_PER_TICK)


def tmdb_from_env(env: Mapping[str, str]) -> TmdbSettings:
    """Where and how fast TMDb is asked: each field from its variable, else its default."""
    return TmdbSettings(
        base_url=_base_url(env.get(TMDB_BASE_URL) or TmdbSettings.base_url),
        rate=_positive_int(env, TMDB_RATE, TmdbSettings.rate),
        workers=_positive_int(env, OBSERVATION_WORKERS, TmdbSettings.workers),
        max_items=_positive_int(env, OBSERVATION_MAX_ITEMS, TmdbSettings.max_items),
        revalidations_per_hour=checked_revalidations(
            _positive_int(env, REVALIDATIONS_PER_HOUR, TmdbSettings.revalidations_per_hour)
        ),
    )
