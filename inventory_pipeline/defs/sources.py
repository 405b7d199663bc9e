"""What the derived assets are computed from: the system of record's tables, written by
other programs (a media-server sync, the training app), never materialized here. As
external assets they give the asset graph its lineage: profiles and observations follow
the inventory, the training stats follow the training log."""

from __future__ import annotations

import dagster as dg

# Asset groups, one per capability (and one for the tables the capabilities read).
SOURCES_GROUP = "system_of_record"
PROFILES_GROUP = "library_profiles"
PROVIDER_GROUP = "provider_recovery"
CREDENTIALS_GROUP = "credentials"
STATS_GROUP = "training_stats"

media_inventory = dg.AssetSpec(
    "media_inventory",
    group_name=SOURCES_GROUP,
    description="Media servers, libraries and their items (`media_servers`, `libraries`, "
    "`media_server_items`), written by the media-server sync. Every write advances its "
    "library's inventory revision, which the profile refresh acknowledges; items' "
    "TMDb identities are what observation checks.",
    kinds={"postgres"},
)

training_log = dg.AssetSpec(
    "training_log",
    group_name=SOURCES_GROUP,
    description="Saved training sessions and their sets (`save_training_session`), written "
    "by the training app: each save queues its user's stats to be recomputed and "
    "published.",
    kinds={"postgres"},
)
