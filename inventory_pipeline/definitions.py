"""The code location: builds Definitions from defs/* (nothing else here)."""

from __future__ import annotations

import dagster as dg

from inventory_pipeline.defs import credentials, observation, profiles, stats, stats_maintenance
from inventory_pipeline.defs.resources import inventory_database

defs = dg.Definitions(
    assets=[
        profiles.library_profile,
        observation.provider_observations,
        stats.exercise_stats,
        stats.period_stats,
    ],
    asset_checks=[profiles.library_profile_current, observation.recovery_cases_on_time],
    jobs=[
        profiles.library_profile_refresh,
        profiles.profile_request_compaction,
        observation.provider_observation,
        credentials.credential_wakeup,
        stats.stats_drain,
        stats.stats_worker_control,
        *stats_maintenance.maintenance_jobs,
    ],
    sensors=[
        profiles.library_profile_sensor,
        observation.provider_observation_sensor,
        credentials.credential_wakeup_sensor,
        stats.stats_refresh_sensor,
    ],
    schedules=[profiles.compaction_schedule, *stats_maintenance.maintenance_schedules],
    resources={"inventory_db": inventory_database()},
)
