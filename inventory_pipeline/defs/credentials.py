"""Dagster surface of verified credential wakeups (seed 004).

Only authentication cases are woken; other failure categories keep their cooldowns
(a 404 needs identity evidence, throttling needs time).
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

import dagster as dg

from inventory_pipeline.credentials import service
from inventory_pipeline.credentials.models import short
from inventory_pipeline.db import DatabaseError
from inventory_pipeline.defs.resources import InventoryDatabase, run_in_flight
from inventory_pipeline.settings import Settings

QUEUE_TAG = "inventory_pipeline/queue"
WAKEUP_QUEUE = "credential_wakeup"


@dg.op(tags={QUEUE_TAG: WAKEUP_QUEUE})
def wake_authentication_cases(
    context: dg.OpExecutionContext, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Verify the current generation if needed, then release one bounded batch."""
    metadata: dict[str, dg.RawMetadataValue] = {"verification": "not needed", "released": 0}
    with inventory_db.connection() as conn:
        try:
            status = service.status(conn)
            if status is not None and status.wants_probe:
                with service.probe_client(Settings.from_env().tmdb_base_url) as client:
                    probe = service.verify(conn, client)
                if probe is not None:
                    metadata["verification"] = probe.outcome if probe.accepted else "superseded"
                    if probe.retry_after_seconds is not None:
                        metadata["retry_after_seconds"] = probe.retry_after_seconds
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
    released = metadata["released"]
    return dg.Output(released if isinstance(released, int) else 0, metadata=metadata)


@dg.job(
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: WAKEUP_QUEUE},
    description="Verify a saved TMDb key once and release waiting authentication cases.",
)
def credential_wakeup() -> None:
    wake_authentication_cases()


@dg.sensor(
    job=credential_wakeup,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="When authentication cases exist and the current key generation is "
    "unverified (and may be probed) or verified with cases left to release, and no "
    "wakeup run is already queued or running.",
)
def credential_wakeup_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase
) -> dg.RunRequest | dg.SkipReason:
    with inventory_db.connection() as conn:
        status = service.status(conn)
    if status is None or status.auth_cases == 0:
        return dg.SkipReason("no authentication cases")
    if not (status.wants_probe or status.wants_release):
        return dg.SkipReason(
            f"generation {short(status.generation)}: "
            + ("verified, nothing to release now" if status.verified else "probe not due")
        )
    if run_in_flight(context.instance, credential_wakeup.name):
        # A stuck or queued run would only have launches stack up behind it.
        return dg.SkipReason("a credential wakeup run is already queued or running")
    launch = int(context.cursor or "0") + 1
    context.update_cursor(str(launch))
    return dg.RunRequest(
        run_key=f"wakeup-{short(status.generation)}-{launch}",
        tags={"inventory_pipeline/generation": short(status.generation)},
    )
