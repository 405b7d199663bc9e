"""The code location: builds Definitions from defs/* (nothing else here)."""

from __future__ import annotations

import dagster as dg

from inventory_pipeline.defs import profiles
from inventory_pipeline.defs.resources import inventory_database

defs = dg.Definitions(
    assets=[profiles.library_profile],
    asset_checks=[profiles.library_profile_current],
    jobs=[profiles.library_profile_refresh, profiles.profile_request_compaction],
    sensors=[profiles.library_profile_sensor],
    schedules=[profiles.compaction_schedule],
    resources={"inventory_db": inventory_database()},
)
