"""Dagster surface of the profile refresh.

The sensor plans and launches; runs claim as their work begins; the asset is what
analysts backfill. Correctness lives in the database: a run only ever completes claims
its lease token still holds, so a killed, duplicated or hand-launched run changes
nothing the lease would not allow.

A partition is a range of PARTITION_WIDTH library ids ("000120-000129"), not one
library: the webserver reads every key of a dynamic partition set several times per
page load, so one key per library made the asset's page slow at 100k libraries. The
outbox, the leases and the planning stay per library; a partition is materialized by
each refresh of one of its libraries, and its check is the worst of its libraries.

What the UI shows follows the database: check evaluations name the partition's latest
materialization (else Dagster drops them from the Partitions tab), a stalled library's
partition check is failed by a sensor without a run, and a partition key that is not a
library range is removed, never fatal.
"""

# No `from __future__ import annotations` here: Dagster reads op, asset and check
# signatures at definition time and compares the context annotation to real classes.

import json
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

# Not exported by dagster: the type of AssetCheckEvaluation.target_materialization_data.
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from pydantic import Field

from inventory_pipeline.db import Connection
from inventory_pipeline.defs.resources import QUEUE_TAG, InventoryDatabase, runs_waiting
from inventory_pipeline.defs.sources import PROFILES_GROUP, media_inventory
from inventory_pipeline.defs.ticks import logged
from inventory_pipeline.profiles import service
from inventory_pipeline.profiles.generator import held_back_reason
from inventory_pipeline.profiles.models import (
    OUTCOMES,
    Completion,
    LibraryLabel,
    ProfileStatus,
    StalledLibrary,
)

# Dynamic partition set names are global to the instance: keep this one distinctive.
PARTITIONS_NAME = "inventory_pipeline__library_profile"
library_partitions = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
PROFILE_ASSET = dg.AssetKey("library_profile")
REFRESH_QUEUE = "profile_refresh"
# Dirty libraries a skip reason counts before it says "1000+".
DIRTY_SHOWN = 1000
# A refresh run's tag saying what the tick that launched it found.
PLAN_TAG = "inventory_pipeline/plan"
CHECK_NAME = "library_profile_current"
CHECK_KEY = dg.AssetCheckKey(PROFILE_ASSET, CHECK_NAME)
# Library ids per partition: 10k partition keys at 100k libraries.
PARTITION_WIDTH = 10
# Libraries named in a range's check description; the metadata counts all of them.
NAMED_LIBRARIES = 3


# Rows per distribution table: a huge library's metadata stays bounded.
TABLE_ROWS = 20
DISTRIBUTIONS = ("genres", "primary_studio", "original_language", "identity")


def _share_table(shares: dict[str, float]) -> dg.TableMetadataValue:
    """A distribution as value/share rows, the largest first, at most TABLE_ROWS."""
    rows = list(shares.items())
    records = [dg.TableRecord({"value": k, "share": float(v)}) for k, v in rows[:TABLE_ROWS]]
    if len(rows) > TABLE_ROWS:
        rest = sum(float(v) for _, v in rows[TABLE_ROWS:])
        records.append(
            dg.TableRecord({"value": f"({len(rows) - TABLE_ROWS} more)", "share": round(rest, 4)})
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
            metadata[f"distribution/{trait}"] = _share_table(body["share"])
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


def low_of(library_id: int) -> int:
    """The lowest id of the range that holds a library."""
    return library_id - library_id % PARTITION_WIDTH


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
                "library": f"{s.label.name} ({s.label.media_kind})",
                "media_server": f"{s.label.server_name} ({s.label.server_kind})",
                "outcome": outcomes.get(s.library_id, UNCHANGED),
                "item_count": s.item_count or 0,
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


def range_key(low: int) -> str:
    """The partition key of the id range starting at `low`: both ends, zero-padded."""
    return f"{low:06d}-{low + PARTITION_WIDTH - 1:06d}"


def partition_of(library_id: int) -> str:
    """The key of the partition that holds a library."""
    return range_key(low_of(library_id))


def range_low(key: str) -> int | None:
    """The lowest library id of a partition key; None for any key this module would not
    have written."""
    low, sep, high = key.partition("-")
    if not (sep and _is_number(low) and _is_number(high)):
        return None
    start = int(low)
    return start if range_key(start) == key and start % PARTITION_WIDTH == 0 else None


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) < 19


def is_partition_key(key: str) -> bool:
    return range_low(key) is not None


def range_lows_of(partition_keys: Sequence[str]) -> list[int]:
    """Partition keys are library id ranges; anything else is refused before any work."""
    lows = [range_low(key) for key in partition_keys]
    bad = [key for key, low in zip(partition_keys, lows, strict=True) if low is None]
    if bad:
        raise dg.Failure(
            f"partition keys must be library id ranges like {range_key(0)!r}, got {bad[0][:40]!r}"
        )
    return [low for low in lows if low is not None]


def range_ids(lows: Sequence[int]) -> list[int]:
    """Every id the ranges can hold, whether or not a library has it."""
    return [low + n for low in sorted(set(lows)) for n in range(PARTITION_WIDTH)]


class RefreshConfig(dg.Config):
    """Op config of a refresh run."""

    max_claims: int | None = Field(
        default=None,
        description="Stop after this many claims (default INVENTORY_RUN_CLAIMS).",
    )


# Instances whose storage already holds its connections open (one call per run worker).
_POOLED: "weakref.WeakSet[dg.DagsterInstance]" = weakref.WeakSet()


def hold_storage_connections(instance: dg.DagsterInstance) -> None:
    """Let the instance's storage keep a connection open for the rest of the process.
    Dagster's postgres storage opens a new connection for every call unless told
    otherwise (as its webserver does): a refresh run makes about six calls per library,
    and each new connection costs the server a backend start, several times the CPU of
    the write itself."""
    if instance in _POOLED:
        return
    instance.optimize_for_webserver(statement_timeout=0, pool_recycle=3600, max_overflow=4)
    _POOLED.add(instance)


# Libraries a run records in Dagster together: their labels are read in one query, and
# the check evaluations that follow their materializations name them from one lookup.
EVENT_BATCH = 50


@dg.op(tags={QUEUE_TAG: REFRESH_QUEUE})
def refresh_claimed_profiles(
    context: dg.OpExecutionContext, config: RefreshConfig, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """One refresh run (`service.refresh`: claim as the work begins, plan when nothing
    is claimable) of at most `max_claims` (default the policy's run_claims), one
    materialization per library. Every EVENT_BATCH libraries, their materializations
    and then their check evaluations are logged."""
    policy = inventory_db.policy()
    if config.max_claims is not None and config.max_claims <= 0:
        raise dg.Failure(f"max_claims must be positive, got {config.max_claims}")
    budget = config.max_claims if config.max_claims is not None else policy.run_claims
    hold_storage_connections(context.instance)
    pending: list[Completion] = []
    with inventory_db.connection() as conn:

        def record(completion: Completion) -> None:
            if completion.outcome == "failed":
                context.log.warning(
                    f"library {completion.library_id}: attempt failed ({completion.error})"
                )
            elif completion.outcome == "lost":
                context.log.warning(f"library {completion.library_id}: claim lost, nothing done")
            pending.append(completion)
            if len(pending) >= EVENT_BATCH:
                log_completions(context, conn, pending, policy.stall_seconds)
                pending.clear()

        run = service.refresh(conn, policy, budget, on_completion=record)
        log_completions(context, conn, pending, policy.stall_seconds)
    counts = run.outcomes
    return dg.Output(counts["published"] + counts["removed"], metadata=counts)


def log_completions(
    context: dg.OpExecutionContext,
    conn: Connection,
    completions: Sequence[Completion],
    stall_seconds: int,
) -> None:
    """One materialization per range holding a published or removed library, listing
    every library of the range (one event per range, not per library: each Dagster
    event costs several writes, and per library they were a burst's wall); with a single
    library refreshed, that library's whole profile too. Then the check of every range
    the batch touched, from the same read."""
    if not completions:
        return
    by_range = range_statuses(conn, sorted({low_of(c.library_id) for c in completions}))
    outcomes = {c.library_id: c.outcome for c in completions}  # a library's last one
    done: dict[int, dict[int, Completion]] = {}
    for c in completions:
        if c.outcome in ("published", "removed"):
            done.setdefault(low_of(c.library_id), {})[c.library_id] = c
    for low, libraries in sorted(done.items()):
        metadata, description = range_summary(low, by_range[low], outcomes)
        if len(libraries) == 1:
            [completion] = libraries.values()
            labels = {s.library_id: s.label for s in by_range[low]}
            metadata.update(completion_metadata(completion, labels.get(completion.library_id)))
        context.log_event(
            dg.AssetMaterialization(
                asset_key=PROFILE_ASSET,
                partition=range_key(low),
                description=description,
                metadata=metadata,
            )
        )
    record_checks(context, by_range, stall_seconds)


@dg.job(
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: REFRESH_QUEUE},
    description="Claim and process profile refresh requests one at a time, planning more "
    "when none is claimable, until the run's claim budget is spent or no work is left.",
)
def library_profile_refresh() -> None:
    refresh_claimed_profiles()


def _backfill_metadata(
    conn: Connection, result: service.BackfillResult, label: LibraryLabel | None
) -> dict[str, Any]:
    """A refresh done by this run shows what it generated; one done by another worker
    meanwhile shows the profile stored now."""
    if result.completion is not None:
        return completion_metadata(result.completion, label)
    metadata: dict[str, Any] = {"library_id": result.library_id, **label_metadata(label)}
    stored = service.stored_profile(conn, result.library_id)
    if stored is None:
        metadata["profile"] = "none: the library has no items"
    else:
        metadata["item_count"] = stored.item_count
        metadata["profile_revision"] = stored.inventory_revision
        metadata.update(profile_metadata(stored.profile))
    return metadata


def backfill_outcome(result: service.BackfillResult) -> str:
    """A backfill's result in the vocabulary of every range summary."""
    if result.completion is not None:
        return result.completion.outcome
    return "failed" if result.status in ("failed", "inactive") else UNCHANGED


class LibraryProfileConfig(dg.Config):
    """Run config of a backfill: by default every library of the chosen partitions."""

    libraries: list[int] = Field(
        default_factory=list,
        description="Refresh only these library ids (each inside one of the run's partitions).",
    )


@dg.asset(
    key=PROFILE_ASSET,
    partitions_def=library_partitions,
    group_name=PROFILES_GROUP,
    deps=[media_inventory],
    kinds={"postgres"},
    output_required=False,
    description=(
        "Per-library profile: item count and, per trait, its distribution and coverage. "
        f"A partition is a range of {PARTITION_WIDTH} library ids. A backfill enqueues (or "
        "joins) an outbox request for each library of the partition and processes them "
        "under a lease, recording one materialization per library and one listing them; "
        "the check then evaluates the partition (the worst of its libraries). The run "
        "config `libraries` narrows it to chosen libraries. Kept fresh by "
        "library_profile_sensor: its library_profile_refresh runs record each range they "
        "refresh (one run serves whichever ranges have work, so Dagster does not list the "
        "sensor under this asset's Automation)."
    ),
)
def library_profile(
    context: dg.AssetExecutionContext,
    config: LibraryProfileConfig,
    inventory_db: InventoryDatabase,
) -> Iterator[dg.MaterializeResult[None]]:
    lows = range_lows_of(context.partition_keys)
    failed: list[str] = []
    outcomes: dict[int, str] = {}
    # One partition per run (the default backfill policy): the output is the partition's
    # materialization, and the check step, when the run includes it, evaluates against
    # it. Otherwise (a partition range, or the check left out) this op records the check.
    single = len(lows) == 1
    check_step = single and CHECK_KEY in context.job_def.asset_layer.asset_graph.asset_check_keys
    with inventory_db.connection() as conn:
        library_ids = service.library_ids_in_ranges(conn, lows, PARTITION_WIDTH)
        if config.libraries:
            outside = sorted(set(config.libraries) - set(library_ids))
            if outside:
                raise dg.Failure(
                    f"libraries not in the run's partitions: {', '.join(map(str, outside[:5]))}"
                )
            library_ids = sorted(set(config.libraries))
        if not library_ids:
            raise dg.Failure(f"no library in partitions {', '.join(context.partition_keys)[:200]}")
        labels = service.library_labels(conn, library_ids)
        for result in service.backfill(conn, library_ids, inventory_db.policy()):
            label = labels.get(result.library_id)
            outcome = outcomes[result.library_id] = backfill_outcome(result)
            if result.status in ("refreshed", "refreshed_elsewhere", "never_stocked"):
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=PROFILE_ASSET,
                        partition=partition_of(result.library_id),
                        description=describe_library(result.library_id, label, outcome),
                        metadata=_backfill_metadata(conn, result, label),
                    )
                )
            else:
                failed.append(f"{result.library_id} ({result.error or result.status})")
        by_range = range_statuses(conn, lows)
        touched = {low_of(library_id) for library_id in outcomes}
        summaries = {
            low: range_summary(low, by_range[low], outcomes) for low in lows if low in touched
        }
        if not single:
            for low, (summary, description) in summaries.items():
                context.log_event(
                    dg.AssetMaterialization(
                        asset_key=PROFILE_ASSET,
                        partition=range_key(low),
                        description=description,
                        metadata=summary,
                    )
                )
        elif not failed:
            summary, description = summaries[lows[0]]
            yield dg.MaterializeResult(metadata={**summary, "summary": description})
        if not check_step or failed:
            # A failed run skips the check step: the evaluation says what went wrong.
            record_checks(context, by_range, inventory_db.policy().stall_seconds)
    if failed:
        raise dg.Failure(f"profiles not refreshed for libraries: {', '.join(failed)}")


@dg.asset_check(
    asset=PROFILE_ASSET,
    partitions_def=library_partitions,
    description=(
        "Every library of the partition has a profile current with its inventory "
        "revision (the partition shows the worst of its libraries). Evaluated after each "
        "refresh, and failed by the staleness sensor for a library dirty longer than "
        "INVENTORY_STALL_SECONDS."
    ),
)
def library_profile_current(
    context: dg.AssetCheckExecutionContext, inventory_db: InventoryDatabase
) -> dg.AssetCheckResult:
    [low] = range_lows_of([context.partition_key])
    return range_current_result(inventory_db, low)


def range_current_result(inventory_db: InventoryDatabase, low: int) -> dg.AssetCheckResult:
    """The partition's check: passed only when every library of the range is current."""
    with inventory_db.connection() as conn:
        statuses = service.profile_status(conn, range_ids([low]))
    verdict = range_verdict(statuses, inventory_db.policy().stall_seconds)
    return dg.AssetCheckResult(
        passed=verdict.passed,
        severity=verdict.severity,
        description=verdict.description,
        metadata=verdict.metadata,
    )


@dataclass(frozen=True)
class RangeVerdict:
    passed: bool
    severity: dg.AssetCheckSeverity
    description: str
    metadata: dict[str, Any]


def range_verdict(statuses: Sequence[ProfileStatus], stall_seconds: int) -> RangeVerdict:
    """The worst of a range's libraries. A library behind only by changes younger than
    the stall threshold is catching up: a warning, not an error (red means something is
    wrong). The metadata are figures of the whole range, so its plots mean something."""
    error, warn = dg.AssetCheckSeverity.ERROR, dg.AssetCheckSeverity.WARN
    if not statuses:
        return RangeVerdict(
            False, error, "no library in this range", {"reason": "deleted", "libraries": 0}
        )
    # Libraries in error first, so the named few include one when there is one.
    behind = sorted(
        (s for s in statuses if not s.current), key=lambda s: s.catching_up(stall_seconds)
    )
    lags = [s.dirty_seconds for s in behind if s.dirty_seconds is not None]
    minutes, seconds = divmod(stall_seconds, 60)
    threshold = f"{minutes} min" if minutes and not seconds else f"{stall_seconds} s"
    metadata: dict[str, Any] = {
        "libraries": len(statuses),
        "current": len(statuses) - len(behind),
        "behind": len(behind),
        "oldest_lag_seconds": round(max(lags, default=0.0), 1),
    }
    if not behind:
        noun = "library" if len(statuses) == 1 else "libraries"
        return RangeVerdict(True, error, f"{len(statuses)} {noun} current", metadata)
    named = "; ".join(_behind(s, stall_seconds) for s in behind[:NAMED_LIBRARIES])
    more = f" and {len(behind) - NAMED_LIBRARIES} more" if len(behind) > NAMED_LIBRARIES else ""
    metadata["not_current"] = ", ".join(str(s.library_id) for s in behind)
    if all(s.catching_up(stall_seconds) for s in behind):
        return RangeVerdict(
            False,
            warn,
            f"{named}{more}; catching up, within the {threshold} stall threshold",
            metadata,
        )
    stalled = any(s.acknowledged_revision < s.revision for s in behind)
    past = f"; stall threshold {threshold}" if stalled else ""
    return RangeVerdict(False, error, f"{named}{more}{past}", metadata)


def _behind(status: ProfileStatus, stall_seconds: int) -> str:
    """Why one library is not current; for a stall, how long its change has waited."""
    waited = ""
    if status.dirty_seconds is not None and not status.catching_up(stall_seconds):
        waited = f", waiting {int(status.dirty_seconds) // 60} min"
    return f"library {status.library_id}: {status.reason}{waited}"


def target_materialization(
    instance: dg.DagsterInstance, partition: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The partition's latest materialization, which an evaluation must name: Dagster
    shows a partition's check status only while the evaluation targets the partition's
    latest materialization (the same lookup its own check steps do)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PROFILE_ASSET, asset_partitions=[partition]), limit=1
    ).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        run_id=records[0].run_id, storage_id=records[0].storage_id, timestamp=records[0].timestamp
    )


def target_materializations(
    instance: dg.DagsterInstance, partitions: Sequence[str]
) -> dict[str, AssetCheckEvaluationTargetMaterializationData]:
    """`target_materialization` for many partitions in one read: newest first, a
    partition's first record is its latest. A partition the read did not reach is
    looked up alone; one never materialized is absent."""
    wanted = set(partitions)
    found: dict[str, AssetCheckEvaluationTargetMaterializationData] = {}
    if not wanted:
        return found
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=PROFILE_ASSET, asset_partitions=sorted(wanted)),
        limit=(PARTITION_WIDTH + 1) * len(wanted),
    ).records
    for record in records:
        key = record.partition_key
        if key in wanted and key not in found:
            found[key] = AssetCheckEvaluationTargetMaterializationData(
                run_id=record.run_id, storage_id=record.storage_id, timestamp=record.timestamp
            )
    for key in sorted(wanted - found.keys()):
        target = target_materialization(instance, key)
        if target is not None:
            found[key] = target
    return found


def record_checks(
    context: dg.OpExecutionContext | dg.AssetExecutionContext,
    by_range: dict[int, list[ProfileStatus]],
    stall_seconds: int,
) -> None:
    """Record the check of every range a run touched, from its libraries as the database
    has them (`range_statuses`), against the range's latest materialization."""
    targets = target_materializations(context.instance, [range_key(low) for low in by_range])
    for low, statuses in sorted(by_range.items()):
        partition = range_key(low)
        verdict = range_verdict(statuses, stall_seconds)
        # AssetCheckEvaluation is accepted at run time; the annotation predates it.
        context.log_event(
            dg.AssetCheckEvaluation(  # type: ignore[arg-type]
                asset_key=PROFILE_ASSET,
                check_name=CHECK_NAME,
                passed=verdict.passed,
                severity=verdict.severity,
                partition=partition,
                description=verdict.description,
                metadata=verdict.metadata,
                target_materialization_data=targets.get(partition),
            )
        )


def plural(count: int, noun: str) -> str:
    """The noun for a count: one library, two libraries."""
    if count == 1:
        return noun
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def _partition_order(key: str) -> tuple[int, int, str]:
    low = range_low(key)
    return (0, low, "") if low is not None else (1, 0, key)


# A full partition diff at least this often even when nothing seems to have changed:
# it restores a range partition deleted by hand in the UI, which no cheap signal shows.
FULL_SYNC_SECONDS = 60


def _read_cursor(cursor: str | None) -> dict[str, Any]:
    """The profile sensor's cursor: runs launched so far and the last synced partition
    state. A bare integer is the older cursor (runs launched only)."""
    if not cursor:
        return {"runs": 0}
    if cursor.isdigit():
        return {"runs": int(cursor)}
    try:
        state = json.loads(cursor)
    except ValueError:
        return {"runs": 0}
    return state if isinstance(state, dict) and isinstance(state.get("runs"), int) else {"runs": 0}


def _newest_partition(instance: dg.DagsterInstance) -> str:
    """The newest key of the partition set (one indexed row): it changes whenever a key
    is added, by this sensor or by hand ("" for an empty set)."""
    page = instance.get_paginated_dynamic_partitions(PARTITIONS_NAME, limit=1, ascending=False)
    return page.results[0] if page.results else ""


def _partition_changes(
    context: dg.SensorEvaluationContext, wanted: set[str]
) -> tuple[list[str], list[dg.DeleteDynamicPartitionsRequest], str]:
    """The ranges that hold a library and have no partition (to add), the request
    deleting every key that is not such a range, and the warning for the foreign keys
    removed."""
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    gone = sorted(known - wanted, key=_partition_order)
    deletes = [library_partitions.build_delete_request(gone)] if gone else []
    foreign = [key for key in gone if not is_partition_key(key)]
    removed = ""
    if foreign:
        shown = ", ".join(repr(key[:40]) for key in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        removed = f"removed partition keys that are not library id ranges: {shown}{more}; "
        context.log.warning(removed.rstrip("; "))
    return sorted(wanted - known, key=_partition_order), deletes, removed


def _add_partitions(context: dg.SensorEvaluationContext, keys: Sequence[str]) -> None:
    """Add partition keys in one statement. Returned as a request instead, the daemon
    would ask the storage about each key on a connection of its own: 10,000 new ranges
    (a first tick at 100k libraries) took minutes, during which the tick held the sensor.
    Adding a key that exists changes nothing, so a previewed tick may add them too."""
    context.instance.add_dynamic_partitions(PARTITIONS_NAME, keys)
    shown = keys[0] if len(keys) == 1 else f"{keys[0]} … {keys[-1]}"
    context.log.info(f"added {len(keys)} partitions: {shown}")


@dg.sensor(
    job=library_profile_refresh,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Keeps partitions in step with libraries, plans dirty libraries and "
    "launches refresh runs for the backlog; the runs claim when they start.",
)
@logged
def library_profile_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SensorResult | dg.SkipReason:
    """A tick never claims: ticks fail, are previewed from the UI and are retried, and a
    run may wait in the queue for minutes. It launches enough runs for the backlog
    (`run_claims` each), never more than `max_runs_per_tick` waiting to start. Partition
    keys that are not library id ranges (added by hand in the UI) are reported and
    removed.

    The partition sync reads neither key set while the library set's fingerprint and
    the newest partition key are those of the last sync (the cursor keeps both). When
    only libraries were created since, it adds the keys of their ranges; any other
    change (a library deleted, a key added by hand) or FULL_SYNC_SECONDS since the last
    diff diffs the ranges that hold a library with the partition keys: a range loses
    its partition when its last library is deleted."""
    policy = inventory_db.policy()
    max_runs = inventory_db.max_runs_per_tick()
    state = _read_cursor(context.cursor)
    newest = _newest_partition(context.instance)
    partition_requests: list[dg.DeleteDynamicPartitionsRequest] = []
    added: list[str] = []
    removed = ""
    with inventory_db.connection() as conn:
        plan = service.plan(conn, policy)
        claimable = service.claimable(conn, max_runs * policy.run_claims)
        behind = service.dirty(conn, DIRTY_SHOWN) if claimable == 0 else 0
        fingerprint = service.library_fingerprint(conn)
        # A cursor of another width (one key per library before) was synced to other keys.
        recent = (
            state.get("newest") == newest
            and state.get("width") == PARTITION_WIDTH
            and time.time() - float(state.get("synced_at", 0)) < FULL_SYNC_SECONDS
        )
        if not (recent and state.get("libraries") == fingerprint.token):
            appended = (
                service.library_ids_after(conn, int(state.get("max_id", 0))) if recent else []
            )
            count = int(state.get("count", -1))
            if appended and fingerprint.libraries == count + len(appended):
                # Only libraries created since the last sync: add the keys of their
                # ranges, no diff. Only the range of the last synced id can exist.
                synced = partition_of(int(state["max_id"])) if state.get("max_id") else None
                added = sorted({partition_of(i) for i in appended} - {synced}, key=_partition_order)
            else:
                ranges = {range_key(low) for low in service.library_ranges(conn, PARTITION_WIDTH)}
                added, partition_requests, removed = _partition_changes(context, ranges)
            if added:
                _add_partitions(context, added)
            deletes = bool(partition_requests)
            # The newest key is now the last one added (keys are added in order); after
            # a deletion it is not known, and the next tick diffs again.
            if added:
                newest = added[-1]
            state = {
                **state,
                "libraries": fingerprint.token,
                "count": fingerprint.libraries,
                "max_id": fingerprint.max_id,
                "newest": None if deletes else newest,
                "synced_at": time.time(),
                "width": PARTITION_WIDTH,
            }
    wanted = min(max_runs, -(-claimable // policy.run_claims))
    waiting = runs_waiting(context.instance, library_profile_refresh.name)
    launches = max(0, wanted - waiting)
    first = int(state["runs"])
    # What the tick found and does, the same line in each request's tags and in the
    # skip reason: a preview from the UI shows one of the two.
    found = (
        f"{claimable} {plural(claimable, 'library')} to refresh "
        f"({plan.planned} planned by this tick, {plan.expired} expired leases)"
    )
    runs = [
        dg.RunRequest(
            # Unique per launch: Dagster never re-fires a run_key whose run failed.
            run_key=f"profile-refresh-{first + n + 1}",
            tags={
                QUEUE_TAG: REFRESH_QUEUE,
                "inventory_pipeline/claimable": str(claimable),
                PLAN_TAG: f"{found}; launching {launches} {plural(launches, 'run')} "
                f"of up to {policy.run_claims} claims each",
            },
        )
        for n in range(launches)
    ]
    state = {**state, "runs": first + len(runs)}
    cursor = json.dumps(state, sort_keys=True)
    if cursor != context.cursor:
        context.update_cursor(cursor)
    if claimable == 0 and behind == 0:
        reason = "nothing to refresh"
    elif claimable == 0:
        reason = (
            f"nothing to claim now: {behind}{'+' if behind == DIRTY_SHOWN else ''} "
            f"{plural(behind, 'library')} behind, each waiting for its running refresh "
            "or a retry"
        )
    else:
        reason = f"{found}; {waiting} {plural(waiting, 'run')} already waiting to start"
    skip = f"{removed}{reason}"
    if added:
        skip = f"added {len(added)} partitions; {skip}"
    if not runs and not partition_requests:
        return dg.SkipReason(skip)
    context.log.info(found)
    return dg.SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=partition_requests,
        skip_reason=None if runs else skip,
    )


# Stalled libraries reported per tick; the rest follow on later ticks, oldest first.
STALL_BATCH = 500


@dg.sensor(
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Fails library_profile_current for the partition of every library whose "
    "inventory change waits longer than INVENTORY_STALL_SECONDS, without a run and "
    "without claiming.",
)
@logged
def library_profile_staleness_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.SensorResult | dg.SkipReason:
    """A stall turns the check red even when no run touches the library: the tick reads
    the stalled libraries and records one failed evaluation for each partition holding a
    newly stalled revision (the cursor remembers, per library, which were reported), in
    one batch and without a run. The refresh that acknowledges the library records the
    partition's evaluation again."""
    policy = inventory_db.policy()
    reported: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(PARTITIONS_NAME))
    newly: dict[int, list[StalledLibrary]] = {}
    now_reported: dict[str, int] = {}
    with inventory_db.connection() as conn:
        for lib in service.stalled_libraries(conn, policy, STALL_BATCH):
            if partition_of(lib.library_id) not in known:
                continue  # the partition sync adds it; reported on a later tick
            now_reported[str(lib.library_id)] = lib.revision
            if reported.get(str(lib.library_id)) != lib.revision:
                newly.setdefault(low_of(lib.library_id), []).append(lib)
        # Each range's verdict from all of its libraries: the same figures as every
        # evaluation of this check, so its plots compare like with like.
        by_range = range_statuses(conn, sorted(newly))
    targets = target_materializations(context.instance, [range_key(low) for low in by_range])
    events = []
    for low, statuses in by_range.items():
        verdict = range_verdict(statuses, policy.stall_seconds)
        events.append(
            dg.AssetCheckEvaluation(
                asset_key=PROFILE_ASSET,
                check_name=CHECK_NAME,
                passed=verdict.passed,
                severity=verdict.severity,
                partition=range_key(low),
                description=verdict.description,
                metadata=verdict.metadata,
                target_materialization_data=targets.get(range_key(low)),
            )
        )
    cursor = json.dumps(now_reported, sort_keys=True)
    if not events:
        if cursor != (context.cursor or "{}"):
            context.update_cursor(cursor)
        return dg.SkipReason(f"no newly stalled library ({len(now_reported)} stalled)")
    context.log.warning(
        f"{sum(map(len, newly.values()))} libraries newly stalled in {len(events)} partitions "
        f"({len(now_reported)} stalled)"
    )
    return dg.SensorResult(asset_events=events, cursor=cursor)


@dg.op
def compact_refresh_requests(inventory_db: InventoryDatabase) -> dg.Output[int]:
    with inventory_db.connection() as conn:
        deleted = service.compact(conn, inventory_db.policy())
    return dg.Output(deleted, metadata={"deleted": deleted})


@dg.job(executor_def=dg.in_process_executor)
def profile_request_compaction() -> None:
    compact_refresh_requests()


compaction_schedule = dg.ScheduleDefinition(
    job=profile_request_compaction,
    cron_schedule="17 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Terminal refresh requests older than the retention, in bounded batches.",
)

# Registered in definitions.py next to the definitions above.
profile_sensors = [library_profile_staleness_sensor]
