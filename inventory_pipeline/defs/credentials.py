"""Dagster surface of verified credential wakeups (docs/credentials.md).

Only authentication cases are woken; other failure categories keep their cooldowns
(a 404 needs identity evidence, throttling needs time).
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import json
from typing import Any

import dagster as dg

from inventory_pipeline.credentials import service
from inventory_pipeline.credentials.models import ProbeNotSent, WakeupStatus, short
from inventory_pipeline.db import DatabaseError
from inventory_pipeline.defs.resources import (
    QUEUE_TAG,
    InventoryDatabase,
    TmdbResource,
    latest_materialization,
    run_in_flight,
)
from inventory_pipeline.defs.sources import CREDENTIALS_GROUP
from inventory_pipeline.defs.ticks import cursor_state, logged
from inventory_pipeline.recovery import service as recovery

WAKEUP_QUEUE = "credential_wakeup"
CREDENTIAL = dg.AssetKey("tmdb_credential")
KEY_CHECK = "tmdb_key_verified"
PROBE_FAILURES = ("auth", "throttled", "transient", "invalid_response")


def key_check(
    status: WakeupStatus | None,
) -> tuple[bool, dg.AssetCheckSeverity, str, dict[str, Any]]:
    """Passed, severity, description and metadata of `tmdb_key_verified`, from the
    database alone: red when no key is usable or TMDb rejected the current generation, a
    warning while its verification could not complete or authentication cases wait on
    it unverified."""
    error, warn = dg.AssetCheckSeverity.ERROR, dg.AssetCheckSeverity.WARN
    if status is None or not status.usable:
        return False, error, "no active TMDb key is saved (inventory-pipeline tmdb-key)", {}
    generation = short(status.generation)
    outcome = status.last_outcome
    metadata: dict[str, dg.RawMetadataValue] = {
        "generation": generation,
        "verified": status.verified,
        "auth_cases": status.auth_cases,
        "last_outcome": outcome or "-",
    }
    if status.verified:
        return True, error, f"TMDb accepted key generation {generation}", metadata
    if outcome == "auth":
        return (
            False,
            error,
            f"TMDb rejected key generation {generation} (authentication failed)",
            metadata,
        )
    if outcome in PROBE_FAILURES:
        when = status.next_probe_at.isoformat(timespec="seconds") if status.next_probe_at else "-"
        return (
            False,
            warn,
            f"verification of key generation {generation} could not complete "
            f"({outcome}); next probe {when}",
            metadata,
        )
    if status.auth_cases:
        return (
            False,
            warn,
            f"key generation {generation} is not verified; {status.auth_cases} "
            "authentication cases wait for it",
            metadata,
        )
    return (
        True,
        error,
        f"key generation {generation} is unverified, which is expected: a key is probed "
        "only when authentication cases wait for it, and none does",
        metadata,
    )


@dg.asset(
    key=CREDENTIAL,
    group_name=CREDENTIALS_GROUP,
    kinds={"postgres"},
    op_tags={QUEUE_TAG: WAKEUP_QUEUE},
    description="The TMDb key saved in the database (`inventory-pipeline tmdb-key`); the "
    "key itself is never shown. A key is verified only when authentication cases wait "
    "for it: each wakeup run probes the current generation if needed, releases one "
    "bounded batch of the cases, and records what it did as a materialization; the "
    "tmdb_key_verified check follows it.",
)
def tmdb_credential(
    context: dg.AssetExecutionContext, inventory_db: InventoryDatabase, tmdb: TmdbResource
) -> dg.MaterializeResult[None]:
    """Verify the current generation if needed, then release one bounded batch."""
    metadata: dict[str, dg.RawMetadataValue] = {"verification": "not needed", "released": 0}
    with inventory_db.connection() as conn:
        try:
            status = service.status(conn)
            if status is not None and status.wants_probe:
                with service.probe_client(tmdb.settings().base_url) as client:
                    probed = service.verify(conn, client)
                if isinstance(probed, ProbeNotSent):
                    metadata["verification"] = "not sent"
                    context.log.info(f"key probe not sent ({probed.reason}); tried again later")
                elif probed is not None:
                    metadata["verification"] = probed.outcome if probed.accepted else "superseded"
                    if probed.retry_after_seconds is not None:
                        metadata["retry_after_seconds"] = probed.retry_after_seconds
                status = service.status(conn)
            if status is not None and status.wants_release:
                batch = service.release(conn)
                if batch is not None:
                    metadata["released"] = batch.released
                    metadata["cursor"] = batch.cursor
            if status is not None:
                metadata["generation"] = short(status.generation)
        except DatabaseError as exc:
            # This path is an accelerator: ordinary observation keeps working without it.
            context.log.warning(f"credential wakeup skipped: {type(exc).__name__}")
            metadata["error"] = type(exc).__name__
    return dg.MaterializeResult(metadata=metadata)


credential_wakeup = dg.define_asset_job(
    "credential_wakeup",
    selection=dg.AssetSelection.assets(CREDENTIAL),
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: WAKEUP_QUEUE},
    description="Verify a saved TMDb key once and release waiting authentication cases, "
    "then evaluate the key check.",
)


@dg.sensor(
    job=credential_wakeup,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="When authentication cases exist and the current key generation is "
    "unverified (and may be probed: admission is not paused by throttling) or verified "
    "with cases left to release, and no wakeup run is already queued or running.",
)
@logged
def credential_wakeup_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.RunRequest | dg.SkipReason | dg.SensorResult:
    """A tick that launches nothing records the key check when its answer changed (a key
    saved or removed, a new generation), so `tmdb_key_verified` always says where the key
    stands, including why a key nobody needed to probe is unverified."""
    with inventory_db.connection() as conn:
        status = service.status(conn)
        wants_probe_only = status is not None and status.wants_probe and not status.wants_release
        paused = recovery.admission_paused_seconds(conn) if wants_probe_only else 0.0
    state = cursor_state(context.cursor, "launches")
    if status is None or status.auth_cases == 0:
        skip = "no authentication cases"
    elif not (status.wants_probe or status.wants_release):
        skip = f"generation {short(status.generation)}: " + (
            "verified, nothing to release now" if status.verified else "probe not due"
        )
    elif paused > 0:
        # No probe is sent while the provider's throttling pauses admission.
        skip = (
            f"generation {short(status.generation)}: probe due; admission paused for"
            f" {paused:.0f} s after TMDb throttled"
        )
    elif run_in_flight(context.instance, credential_wakeup.name):
        # A stuck or queued run would only have launches stack up behind it.
        skip = "a credential wakeup run is already queued or running"
    else:
        launch = int(state["launches"]) + 1
        context.update_cursor(json.dumps({**state, "launches": launch}, sort_keys=True))
        return dg.RunRequest(
            run_key=f"wakeup-{short(status.generation)}-{launch}",
            tags={"inventory_pipeline/generation": short(status.generation)},
        )
    passed, severity, description, metadata = key_check(status)
    if state.get("check") == description:
        return dg.SkipReason(skip)
    evaluation = dg.AssetCheckEvaluation(
        asset_key=CREDENTIAL,
        check_name=KEY_CHECK,
        passed=passed,
        severity=severity,
        description=description,
        metadata=metadata,
        target_materialization_data=latest_materialization(context.instance, CREDENTIAL),
    )
    context.update_cursor(json.dumps({**state, "check": description}, sort_keys=True))
    return dg.SensorResult(asset_events=[evaluation], skip_reason=skip)


@dg.asset_check(
    asset=CREDENTIAL,
    name=KEY_CHECK,
    description="An active TMDb key is saved and TMDb has not rejected it; a warning "
    "while authentication cases wait on an unverified key. Evaluated after every wakeup "
    "run, and recorded by the wakeup sensor when its answer changes without one.",
)
def tmdb_key_verified(
    context: dg.AssetCheckExecutionContext, inventory_db: InventoryDatabase
) -> dg.AssetCheckResult:
    with inventory_db.connection() as conn:
        status = service.status(conn)
    passed, severity, description, metadata = key_check(status)
    if not passed:
        context.log.warning(description)  # the run's log says it, not only the check
    return dg.AssetCheckResult(
        passed=passed, severity=severity, description=description, metadata=metadata
    )
