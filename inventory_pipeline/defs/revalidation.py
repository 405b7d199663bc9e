"""Dagster surface of revalidation and replacement proposals
(docs/identity-revalidation.md#dagster).

The sensor only counts due cases and the hourly budget; the revalidation job claims
cases itself under leases, so a duplicated, killed or hand-launched run is harmless.
The decision job is the operator's gate: typed run config names the proposals to
approve or reject, and nothing is approved any other way.
"""

# No `from __future__ import annotations`: Dagster reads these signatures at definition
# time and compares the context annotation to real classes.

from typing import Any

import dagster as dg
from pydantic import Field

from inventory_pipeline.defs.observation import OBSERVATIONS
from inventory_pipeline.defs.resources import (
    QUEUE_TAG,
    InventoryDatabase,
    TmdbResource,
    run_in_flight,
)
from inventory_pipeline.defs.sources import PROVIDER_GROUP
from inventory_pipeline.defs.ticks import logged
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.revalidation import service
from inventory_pipeline.revalidation.models import ProposalOverview, ProposalRefused

PROPOSALS = dg.AssetKey("replacement_proposals")
REVALIDATION_QUEUE = "identity_revalidation"
TABLE_ROWS = 50  # rows of each metadata table; the counts cover all


def _text(title: str, original: str | None = None) -> str:
    shown = f'"{title}"'
    return f'{shown} (original "{original}")' if original and original != title else shown


def proposal_metadata(view: ProposalOverview) -> dict[str, Any]:
    """The standing view as asset metadata: the live proposals (awaiting a decision, or
    approved) with their title and year evidence, the checks that proposed nothing and
    why, and the counts by state, reason and fault."""
    live = dg.MetadataValue.table(
        records=[
            dg.TableRecord(
                {
                    "proposal": p.id,
                    "state": p.state + (" (replaced)" if p.replaced_at else ""),
                    "item": p.item_id,
                    "library": p.library or "-",
                    "kind": p.provider_kind,
                    "old_id": p.old_tmdb_id,
                    "candidate": p.candidate_tmdb_id,
                    "evidence": f"{p.external_source} {p.external_id}",
                    "title": f"{_text(p.source_title)} = "
                    f"{_text(p.candidate_title, p.candidate_original_title)}",
                    "year": f"{p.source_year} ~ {p.candidate_year}",
                    "age_hours": p.age_seconds // 3600,
                }
            )
            for p in view.live
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("proposal", "int"),
                dg.TableColumn("state", "string"),
                dg.TableColumn("item", "int"),
                dg.TableColumn("library", "string"),
                dg.TableColumn("kind", "string"),
                dg.TableColumn("old_id", "int"),
                dg.TableColumn("candidate", "int"),
                dg.TableColumn("evidence", "string"),
                dg.TableColumn("title", "string"),
                dg.TableColumn("year", "string"),
                dg.TableColumn("age_hours", "int"),
            ]
        ),
    )
    unproposed = dg.MetadataValue.table(
        records=[
            dg.TableRecord(
                {
                    "item": n.item_id,
                    "library": n.library,
                    "kind": n.provider_kind,
                    "old_id": n.old_tmdb_id,
                    "evidence": f"{n.external_source} {n.external_id}",
                    "reason": n.reason,
                    "candidates": n.candidates,
                    "passed": ", ".join(n.passed) or "-",
                    "checked": n.checked_at.isoformat(timespec="seconds"),
                }
            )
            for n in view.unproposed
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("item", "int"),
                dg.TableColumn("library", "string"),
                dg.TableColumn("kind", "string"),
                dg.TableColumn("old_id", "int"),
                dg.TableColumn("evidence", "string"),
                dg.TableColumn("reason", "string"),
                dg.TableColumn("candidates", "int"),
                dg.TableColumn("passed", "string"),
                dg.TableColumn("checked", "string"),
            ]
        ),
    )
    return {
        "proposals": live,
        "awaiting_decision": view.states.get("proposed", 0),
        "approved": view.states.get("approved", 0),
        "replaced": sum(1 for p in view.live if p.replaced_at is not None),
        "by_state": dg.MetadataValue.json(view.states),
        "no_proposal": unproposed,
        "no_proposal_by_reason": dg.MetadataValue.json(view.reasons),
        "faulted": dg.MetadataValue.json(view.faulted),
        "due": view.due,
    }


def standing_view(inventory_db: InventoryDatabase) -> dict[str, Any]:
    """The proposals as the database holds them now: what every materialization shows."""
    with inventory_db.connection() as conn:
        return proposal_metadata(service.overview(conn, TABLE_ROWS))


def log_proposals(
    context: dg.OpExecutionContext,
    inventory_db: InventoryDatabase,
    extra: dict[str, Any],
) -> None:
    """Materialize the standing view after an operator's decision."""
    metadata = {**standing_view(inventory_db), **extra}
    context.log_event(dg.AssetMaterialization(asset_key=PROPOSALS, metadata=metadata))


@dg.asset(
    key=PROPOSALS,
    group_name=PROVIDER_GROUP,
    deps=[OBSERVATIONS],
    kinds={"postgres"},
    op_tags={QUEUE_TAG: REVALIDATION_QUEUE},
    description="Replacement identities proposed for unresolved TMDb 404s on corroborated "
    "external-id evidence, waiting for an operator's approval (nothing is applied without "
    "it), and the checks that proposed nothing, with why. A materialization checks the "
    "due cases within the hourly budget; an operator's decision records it again.",
)
def replacement_proposals(
    context: dg.AssetExecutionContext, inventory_db: InventoryDatabase, tmdb: TmdbResource
) -> dg.MaterializeResult[None]:
    """Check due cases against TMDb's external-id lookup within the hourly budget, log
    each proposal and each check that proposed nothing, and materialize the view."""

    def report(level: str, message: str) -> None:
        (context.log.warning if level == "warning" else context.log.info)(message)

    summary = service.revalidate_due(inventory_db.url, tmdb.settings(), report)
    return dg.MaterializeResult(
        metadata={
            **standing_view(inventory_db),
            "checked": len(summary.results) - summary.count("error"),
            "proposed": summary.count("proposed"),
            "unproposed": summary.count("no_proposal"),
            "faults": summary.count("fault"),
            # Given back unrecorded after a transient database error, due as they were.
            "not_recorded": summary.count("error"),
            "reasons_this_run": dg.MetadataValue.json(summary.reasons),
        }
    )


identity_revalidation = dg.define_asset_job(
    "identity_revalidation",
    selection=dg.AssetSelection.assets(PROPOSALS),
    executor_def=dg.in_process_executor,
    tags={QUEUE_TAG: REVALIDATION_QUEUE},
    description="Revalidate unresolved TMDb 404 cases by their external ids and propose "
    "corroborated replacements for an operator to approve.",
)


class ReplacementDecisions(dg.Config):
    """The operator's decision: proposals to approve and to reject (by proposal id, as
    the replacement_proposals asset lists them), and who decides."""

    approve: list[int] = Field(
        default_factory=list,
        description="Proposal ids to approve: each item is observed under its candidate id.",
    )
    reject: list[int] = Field(
        default_factory=list,
        description="Proposal ids to reject: the case keeps its id and ordinary backoff.",
    )
    operator: str = Field(description="Who decides (recorded with the decision), 1-64 characters.")


@dg.op
def decide_replacement_proposals(
    context: dg.OpExecutionContext, config: ReplacementDecisions, inventory_db: InventoryDatabase
) -> dg.Output[int]:
    """Approve and reject the chosen proposals, all or nothing; a refusal (an unknown id,
    a proposal already decided or superseded) fails the run in one line."""
    try:
        with inventory_db.connection() as conn:
            decided = service.decide(conn, config.approve, config.reject, config.operator)
    except ProposalRefused as exc:
        raise dg.Failure(str(exc)) from None
    for d in decided:
        then = (
            f"observed under TMDb {d.candidate_tmdb_id} at the next observation run"
            if d.state == "approved"
            else f"keeps TMDb {d.old_tmdb_id} and its ordinary backoff"
        )
        context.log.info(f"proposal {d.proposal_id} {d.state}: item {d.item_id} {then}")
    extra: dict[str, Any] = {
        "approved_now": sum(d.state == "approved" for d in decided),
        "rejected_now": sum(d.state == "rejected" for d in decided),
    }
    log_proposals(context, inventory_db, extra)
    return dg.Output(len(decided))


@dg.job(
    executor_def=dg.in_process_executor,
    description="An operator approves or rejects replacement proposals (run config: "
    "approve, reject, operator).",
)
def replacement_decision() -> None:
    decide_replacement_proposals()


@dg.sensor(
    job=identity_revalidation,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches a revalidation run when cases are due, the hourly budget has "
    "room, admission is not paused by throttling, and none is already queued or running.",
)
@logged
def identity_revalidation_sensor(
    context: dg.SensorEvaluationContext, inventory_db: InventoryDatabase, tmdb: TmdbResource
) -> dg.RunRequest | dg.SkipReason:
    per_hour = tmdb.settings().revalidations_per_hour
    with inventory_db.connection() as conn:
        due = service.due_revalidations(conn)
        left = service.budget_left(conn, per_hour) if due else 0
        paused = recovery.admission_paused_seconds(conn) if due else 0.0
    if due == 0:
        return dg.SkipReason("no cases due for revalidation")
    if left == 0:
        return dg.SkipReason(f"{due} cases due; the hourly budget of {per_hour} is spent")
    if paused > 0:
        return dg.SkipReason(
            f"{due} cases due; admission paused for {paused:.0f} s after TMDb throttled"
        )
    if run_in_flight(context.instance, identity_revalidation.name):
        return dg.SkipReason(f"{due} cases due; a revalidation run is already active")
    launch = int(context.cursor or "0") + 1
    context.update_cursor(str(launch))
    return dg.RunRequest(run_key=f"revalidate-{launch}", tags={"inventory_pipeline/due": str(due)})
