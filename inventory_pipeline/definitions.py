"""The code location: builds Definitions from defs/* (nothing else here).

Resources are bound here, once: settings read from the environment when a run or tick
starts (see `defs/resources.py`); settings shared at runtime live in the database.
"""

from __future__ import annotations

import warnings

import dagster as dg

# Filtered before defs/* is imported, where these definitions are built; each filter
# names one category and message exactly, so any other Beta/Preview warning still shows.
# A partitioned check is the one way to keep a status per partition (a range of library ids).
warnings.filterwarnings(
    "ignore",
    message=r"Specifying a partitions_def on an AssetCheckSpec is currently in preview",
    category=dg.PreviewWarning,
)
# Dagster's own SensorDefinition.with_attributes passes `owners=[]` (not None) when it
# binds a sensor to its resolved job, so every sensor trips this; no sensor sets owners.
warnings.filterwarnings(
    "ignore",
    message=r"Parameter `owners` of initializer `SensorDefinition.__init__` is currently in beta",
    category=dg.BetaWarning,
)

from inventory_pipeline.defs import (  # noqa: E402  (after the filters above)
    credentials,
    observation,
    profile_checks,
    profile_sensor,
    profiles,
    revalidation,
    sources,
    stats,
    stats_maintenance,
)
from inventory_pipeline.defs.resources import bound_resources  # noqa: E402

defs = dg.Definitions(
    assets=[
        sources.media_inventory,
        sources.training_log,
        profiles.library_profile,
        observation.provider_observations,
        revalidation.replacement_proposals,
        credentials.tmdb_credential,
        stats.drain_stats,
    ],
    asset_checks=[
        profile_checks.library_profile_current,
        observation.recovery_cases_on_time,
        credentials.tmdb_key_verified,
    ],
    jobs=[
        profiles.library_profile_refresh,
        profiles.profile_request_compaction,
        observation.provider_observation,
        revalidation.identity_revalidation,
        revalidation.replacement_decision,
        credentials.credential_wakeup,
        stats.stats_drain,
        stats.stats_worker_control,
        *stats_maintenance.maintenance_jobs,
    ],
    sensors=[
        profile_sensor.library_profile_sensor,
        observation.provider_observation_sensor,
        revalidation.identity_revalidation_sensor,
        credentials.credential_wakeup_sensor,
        stats.stats_refresh_sensor,
        profile_checks.library_profile_staleness_sensor,
        *stats_maintenance.maintenance_sensors,
    ],
    schedules=[profiles.compaction_schedule, *stats_maintenance.maintenance_schedules],
    resources=bound_resources(),
    # Every job is one op or one asset step: a subprocess per step only adds its start-up
    # (about 1.2 s per run in process against 2.5 s with the multiprocess executor).
    executor=dg.in_process_executor,
)
