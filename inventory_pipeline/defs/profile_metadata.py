"""What a reader of library_profile's materializations sees: each range lists every
library it holds, as the database has it, with what the run did to it; a single
library's event carries its whole profile."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from inventory_pipeline.db import Connection
from inventory_pipeline.defs.profile_ranges import (
    low_of,
    range_ids,
    range_key,
)
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.generator import held_back_reason
from inventory_pipeline.profiles.models import (
    OUTCOMES,
    Completion,
    LibraryLabel,
    ProfileStatus,
)

# Rows per distribution table: a huge library's metadata stays bounded.
TABLE_ROWS = 20
DISTRIBUTIONS = ("genres", "primary_studio", "original_language", "identity")


def _share_table(shares: dict[str, float], rest_share: float = 0.0) -> dg.TableMetadataValue:
    """A distribution as value/share rows, the largest first (ties by name: a stored
    profile comes back from jsonb with its keys shortest first), at most TABLE_ROWS, then
    what the values not listed hold together."""
    rows = sorted(shares.items(), key=lambda kv: (-float(kv[1]), kv[0]))
    records = [dg.TableRecord({"value": k, "share": float(v)}) for k, v in rows[:TABLE_ROWS]]
    folded = len(rows) - TABLE_ROWS
    rest = sum(float(v) for _, v in rows[TABLE_ROWS:]) + float(rest_share)
    if rest:
        parts = [f"{folded} more"] if folded > 0 else []
        if rest_share:
            parts.append("the rest")
        records.append(
            dg.TableRecord({"value": f"({' and '.join(parts)})", "share": round(rest, 4)})
        )
    return dg.MetadataValue.table(
        records=records,
        schema=dg.TableSchema(
            columns=[dg.TableColumn("value", "string"), dg.TableColumn("share", "float")]
        ),
    )


def profile_metadata(profile: dict[str, Any]) -> dict[str, Any]:
    """Each trait's status and contributors, every published distribution as a table,
    why a trait is held back, and the whole profile as JSON."""
    metadata: dict[str, Any] = {}
    traits = []
    for trait, body in profile.items():
        reason = held_back_reason(body)
        metadata[f"trait/{trait}"] = reason or (
            f"published: {body['contributors']} contributing items, coverage {body['coverage']:g}"
        )
        traits.append(
            dg.TableRecord(
                {
                    "trait": trait,
                    "status": str(body["status"]),
                    "contributors": int(body["contributors"]),
                    "coverage": float(body["coverage"]),
                    "held_back": reason or "",
                }
            )
        )
    metadata["traits"] = dg.MetadataValue.table(
        records=traits,
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("trait", "string"),
                dg.TableColumn("status", "string"),
                dg.TableColumn("contributors", "int"),
                dg.TableColumn("coverage", "float"),
                dg.TableColumn("held_back", "string"),
            ]
        ),
    )
    rating = profile.get("rating", {})
    if rating.get("status") == "published":
        metadata["distribution/rating"] = dg.MetadataValue.table(
            records=[
                dg.TableRecord({"statistic": name, "value": float(rating[name])})
                for name in ("mean", "median", "p10", "p90")
            ],
            schema=dg.TableSchema(
                columns=[dg.TableColumn("statistic", "string"), dg.TableColumn("value", "float")]
            ),
        )
    for trait in DISTRIBUTIONS:
        body = profile.get(trait, {})
        if body.get("status") == "published":
            metadata[f"distribution/{trait}"] = _share_table(
                body["share"], body.get("rest_share", 0.0)
            )
    metadata["profile"] = dg.MetadataValue.json(profile)
    return metadata


def label_metadata(label: LibraryLabel | None) -> dict[str, Any]:
    if label is None:
        return {"library": "deleted"}
    return {
        "library": f"{label.name} ({label.media_kind})",
        "media_server": f"{label.server_name} ({label.server_kind})",
    }


def completion_metadata(completion: Completion, label: LibraryLabel | None) -> dict[str, Any]:
    """What a reader of one library's materialization wants to see."""
    metadata: dict[str, Any] = {
        "library_id": completion.library_id,
        **label_metadata(label),
        "item_count": completion.item_count,
        "acknowledged_revision": completion.acknowledged_revision or 0,
        "snapshot_revision": completion.snapshot_revision,
        "request_kind": completion.kind,
    }
    if completion.profile is not None:
        metadata.update(profile_metadata(completion.profile))
    else:
        metadata["profile"] = "removed: the library is empty"
    return metadata


# What a range's summary says a run did to each library: a completion's outcome, or
# UNCHANGED for a library the run did not refresh (another worker did, or none was due).
UNCHANGED = "unchanged"
# Longest library name quoted in an event's description.
NAME_CHARS = 40


def quoted(name: str) -> str:
    """A library name in a one-line description: bounded, quotes and control characters
    escaped."""
    short = name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "…"
    return json.dumps(short, ensure_ascii=False)


def describe_library(library_id: int, label: LibraryLabel | None, outcome: str) -> str:
    """One library's event description: which library, and what the run did to it."""
    if label is None:
        return f"library {library_id} (deleted): {outcome}"
    return f"library {library_id} {quoted(label.name)} on {quoted(label.server_name)}: {outcome}"


def range_summary(
    low: int, statuses: Sequence[ProfileStatus], outcomes: Mapping[int, str]
) -> tuple[dict[str, Any], str]:
    """A range's materialization: every library it holds, once, as the database has it
    now, with what this run did to it; and a description naming them by outcome
    (`published 6 "Kids", 7 "Anime"; 5 unchanged`)."""
    records = [
        dg.TableRecord(
            {
                "library_id": s.library_id,
                **label_metadata(s.label),
                "outcome": outcomes.get(s.library_id, UNCHANGED),
                "item_count": s.items,
                "revision": s.revision,
                "acknowledged": s.acknowledged_revision,
                "profile_revision": s.profile_revision,
                "published": ", ".join(s.published_traits),
                "published_at": (
                    s.published_at.isoformat(timespec="seconds") if s.published_at else None
                ),
            }
        )
        for s in statuses
    ]
    named: dict[str, list[str]] = {}
    for s in statuses:
        outcome = outcomes.get(s.library_id, UNCHANGED)
        named.setdefault(outcome, []).append(f"{s.library_id} {quoted(s.label.name)}")
    parts = [
        f"{outcome} {', '.join(names)}" for outcome in OUTCOMES if (names := named.get(outcome))
    ]
    if UNCHANGED in named:
        parts.append(f"{len(named[UNCHANGED])} {UNCHANGED}")
    metadata = {
        "libraries": dg.MetadataValue.table(
            records=records,
            schema=dg.TableSchema(
                columns=[
                    dg.TableColumn("library_id", "int"),
                    dg.TableColumn("library", "string"),
                    dg.TableColumn("media_server", "string"),
                    dg.TableColumn("outcome", "string"),
                    dg.TableColumn("item_count", "int"),
                    dg.TableColumn("revision", "int"),
                    dg.TableColumn("acknowledged", "int"),
                    dg.TableColumn("profile_revision", "int"),
                    dg.TableColumn("published", "string"),
                    dg.TableColumn("published_at", "string"),
                ]
            ),
        ),
        "library_ids": ", ".join(str(s.library_id) for s in statuses),
        "id_range": range_key(low),
    }
    return metadata, "; ".join(parts) or "no library in this range"


def range_statuses(conn: Connection, lows: Sequence[int]) -> dict[int, list[ProfileStatus]]:
    """Every library of each range as the database has it now, in one query."""
    by_range: dict[int, list[ProfileStatus]] = {low: [] for low in lows}
    for status in service.profile_status(conn, range_ids(lows)):
        by_range[low_of(status.library_id)].append(status)
    return by_range
