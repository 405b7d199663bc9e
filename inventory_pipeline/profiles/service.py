"""Every state transition of the profile refresh (docs/profiles.md): plan, claim, generate,
complete-and-acknowledge, fail, backfill, compact.

Functions take a connection in autocommit mode; each statement commits on its own
unless a transaction is shown. No transaction is held while a profile is generated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal
from uuid import uuid4

from inventory_pipeline.db import (
    Connection,
    DatabaseError,
    DatabaseUnavailable,
    snapshot,
    transaction,
)
from inventory_pipeline.profiles import repository
from inventory_pipeline.profiles.generator import generate_profile
from inventory_pipeline.profiles.models import (
    PLANNER_BATCH,
    BackfillRequest,
    Claim,
    ClaimBatch,
    Completion,
    DirtyPosition,
    LibraryLabel,
    LibrarySetFingerprint,
    LibrarySnapshot,
    MaterializationDue,
    Plan,
    PlannedRequest,
    ProfileStatus,
    QueueOverview,
    RefreshPolicy,
    RefreshRun,
    StalledLibrary,
    StoredProfile,
)

# Generates a profile from a projection's column names and rows (tests inject others).
Generator = Callable[[Sequence[str], Sequence[tuple[Any, ...]]], dict[str, Any]]


def plan(conn: Connection, policy: RefreshPolicy) -> Plan:
    """One scheduler tick: recover expired leases, then queue dirty and native work.

    Each planner pass is its own transaction bounded to 25 libraries
    (docs/profiles.md#planning); a tick runs passes until one finds fewer than 25
    candidates, at most `policy.planner_passes`. Each pass continues the walk of the
    dirty index where the previous one stopped, so a tick walks a backlog of libraries
    that already have active work once, not once per pass. A library passed over that becomes a
    candidate during the tick is planned by the next tick.
    """
    repository.fold_changes(conn)
    expired = repository.expire_leases(conn, policy)
    inventory: list[PlannedRequest] = []
    after: DirtyPosition | None = None
    for _ in range(policy.planner_passes):
        batch = repository.plan_inventory_requests(conn, policy, PLANNER_BATCH, after)
        inventory.extend(batch.requests)
        if batch.candidates < PLANNER_BATCH or batch.last is None:
            break
        after = batch.last
    native = repository.plan_native_requests(conn, policy, PLANNER_BATCH)
    return Plan(expired=expired, inventory=tuple(inventory), native=tuple(native))


def claim(
    conn: Connection,
    policy: RefreshPolicy,
    limit: int = 1,
    request_ids: Sequence[int] | None = None,
) -> ClaimBatch:
    """Claim up to `limit` claimable requests under one fresh lease token."""
    token = uuid4()
    claims = repository.claim_requests(conn, token, policy.lease_seconds, limit, request_ids)
    return ClaimBatch(lease_token=token, claims=tuple(claims))


def claimable(conn: Connection, limit: int) -> int:
    """Requests a run could claim now, counted up to `limit`."""
    return repository.count_claimable(conn, limit)


def dirty(conn: Connection, limit: int) -> int:
    """Libraries whose profile is behind their inventory, counted up to `limit`."""
    repository.fold_changes(conn)
    return repository.count_dirty(conn, limit)


def read_snapshot(conn: Connection, library_id: int) -> LibrarySnapshot:
    """The library's projection and its revision, read in one snapshot.

    The claim committed before this read, so the snapshot includes at least the
    claimed revision (docs/profiles.md#acknowledged-revision); later writes show up as a
    larger revision.
    """
    with snapshot(conn):
        revision = repository.read_revision(conn, library_id)
        columns, rows = repository.read_snapshot(conn, library_id)
    return LibrarySnapshot(library_id, revision or 0, columns, tuple(rows))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:240]


def _fail(
    conn: Connection,
    claim: Claim,
    policy: RefreshPolicy,
    error: str | BaseException,
    snapshot_revision: int = 0,
    terminal: bool = False,
    spends_attempt: bool = True,
) -> Completion:
    """Record a failed attempt; a claim that is gone (lease lost, library deleted) is lost.
    An exception is recorded by class and first line, with its SQLSTATE when the
    database raised it, so a reader tells an expected refusal from a defect."""
    sqlstate = error.sqlstate if isinstance(error, DatabaseError) else None
    message = error if isinstance(error, str) else _describe(error)
    row = repository.fail_claim(conn, claim, policy, message, sqlstate, terminal, spends_attempt)
    return Completion(
        request_id=claim.request_id,
        library_id=claim.library_id,
        kind=claim.kind,
        outcome="lost" if row is None else "failed",
        claimed_revision=claim.inventory_revision,
        snapshot_revision=snapshot_revision,
        acknowledged_revision=None,
        revision=None,
        item_count=0,
        profile=None,
        error=message,
    )


def process(
    conn: Connection,
    claim: Claim,
    policy: RefreshPolicy,
    generate: Generator = generate_profile,
    spends_attempt: bool = True,
    materialization_due: bool = False,
) -> Completion:
    """Generate the claimed library's profile and complete the claim.

    Generation runs even when the stored profile is young: an inventory change is
    refreshed whatever the profile's age (docs/profiles.md#acknowledged-revision). An
    empty library completes with the guarded profile deletion and is acknowledged. A failure records
    a retry (or the terminal failure on the last attempt) for this claim alone; a lost
    claim changes nothing. A request for a revision the library never reached (written
    by hand) cannot be acknowledged: it fails at once. An analyst's backfill processes
    with `spends_attempt=False`: its failure gives the attempt back. A Dagster refresh
    run completes with `materialization_due` and clears it once it has recorded the
    materialization (`materialized`).
    """
    try:
        library = read_snapshot(conn, claim.library_id)
    except DatabaseUnavailable:
        raise  # nothing can be recorded; the lease expires and the request is retried
    except DatabaseError as exc:
        return _fail(conn, claim, policy, exc, spends_attempt=spends_attempt)
    if (claim.inventory_revision or 0) > library.revision:
        return _fail(
            conn,
            claim,
            policy,
            f"request revision {claim.inventory_revision} is ahead of the library's "
            f"revision {library.revision}",
            library.revision,
            terminal=True,
        )
    try:
        profile = generate(library.columns, library.rows) if library.rows else None
    except Exception as exc:
        return _fail(conn, claim, policy, exc, library.revision, spends_attempt=spends_attempt)
    item_count = len(library.rows)
    try:
        row = repository.complete_claim(
            conn, claim, library.revision, item_count, profile, materialization_due
        )
    except DatabaseUnavailable:
        raise
    except DatabaseError as exc:
        return _fail(conn, claim, policy, exc, library.revision, spends_attempt=spends_attempt)
    if row is None:
        outcome: Literal["published", "removed", "lost"] = "lost"
    else:
        outcome = "published" if item_count else "removed"
    return Completion(
        request_id=claim.request_id,
        library_id=claim.library_id,
        kind=claim.kind,
        outcome=outcome,
        claimed_revision=claim.inventory_revision,
        snapshot_revision=library.revision,
        acknowledged_revision=None if row is None else row["acknowledged_revision"],
        revision=None if row is None else row["revision"],
        item_count=item_count,
        profile=profile,
    )


def refresh(
    conn: Connection,
    policy: RefreshPolicy,
    max_claims: int | None = None,
    generate: Generator = generate_profile,
    *,
    replan: bool = True,
    on_claim: Callable[[Claim], None] | None = None,
    on_completion: Callable[[Completion], None] | None = None,
    materialization_due: bool = False,
) -> RefreshRun:
    """What a refresh run does: claim one request, process it, repeat, until
    `max_claims` (default `policy.run_claims`) were taken or no work is left.

    Claiming when the work begins, one request at a time, means a lease only covers
    work that has started: a run waiting in Dagster's queue holds nothing, and no
    request waits out its lease behind the earlier libraries of the same run.

    When nothing is claimable the run plans (the same planner a tick runs) and goes on
    while that queues work, so a backlog larger than one tick's plan is drained by the
    runs already running. It stops when a plan queues nothing or leaves it nothing to
    claim: planning again would only race the other runs for what they are taking.
    `replan=False` stops at the first empty claim instead, for a caller whose planner
    ticks on its own clock. `on_claim` runs once a claim has committed and before its
    work starts; `on_completion` after each claim is processed. `materialization_due`:
    see `process`.
    """
    budget = policy.run_claims if max_claims is None else max_claims
    plans: list[Plan] = []
    completions: list[Completion] = []
    planned_last = False
    while len(completions) < budget:
        batch = claim(conn, policy)
        if not batch.claims:
            if not replan or planned_last:
                break
            plans.append(plan(conn, policy))
            if plans[-1].planned == 0:
                break
            planned_last = True
            continue
        planned_last = False
        [claimed] = batch.claims
        if on_claim is not None:
            on_claim(claimed)
        completion = process(
            conn, claimed, policy, generate, materialization_due=materialization_due
        )
        if on_completion is not None:
            on_completion(completion)
        completions.append(completion)
    return RefreshRun(plans=tuple(plans), completions=tuple(completions))


@dataclass(frozen=True)
class BackfillResult:
    """Where one library of an analyst's backfill ended up."""

    library_id: int
    status: Literal["refreshed", "refreshed_elsewhere", "never_stocked", "inactive", "failed"]
    completion: Completion | None = None
    error: str | None = None


def backfill(
    conn: Connection,
    library_ids: Sequence[int],
    policy: RefreshPolicy,
    wait_seconds: float | None = None,
    generate: Generator = generate_profile,
) -> list[BackfillResult]:
    """An analyst's refresh of chosen libraries, through the outbox and lease path
    (docs/profiles.md#backfill).

    Enqueue an inventory_change at the current revision or join the library's active
    request, then claim and process them one at a time (a lease covers only work that
    has begun, however many libraries were chosen). A request held by another worker is
    waited for until it finishes or its lease expires and it can be taken; the wait
    gives up after `wait_seconds` without progress. A library is refreshed once the
    revision the backfill found is acknowledged: a joined request of an older revision
    or of another kind is followed by one of the backfill's own. A failure is the
    analyst's to see and spends none of the automatic path's attempts.
    """
    ids = sorted(set(library_ids))
    results: dict[int, BackfillResult] = {}
    found: dict[int, int] = {}  # the revision each library had when the backfill began
    waiting: dict[int, BackfillRequest] = {}

    def enqueue(chosen: Sequence[int]) -> None:
        with transaction(conn):
            # Held, the libraries' changes are folded by this transaction's own fold (a
            # fold skips a state row another transaction holds); then their revisions.
            repository.lock_states(conn, chosen)
            repository.fold_changes(conn)
            states = {row["library_id"]: row for row in repository.lock_states(conn, chosen)}
            requests = repository.request_backfill(conn, chosen)
        for library_id in chosen:
            state = states.get(library_id)
            if state is None:
                error = "no such library" if library_id not in found else "library deleted"
                results[library_id] = BackfillResult(library_id, "failed", error=error)
            elif not state["active"]:
                results[library_id] = BackfillResult(
                    library_id, "inactive", error="library inactive"
                )
            elif state["revision"] == 0:
                results[library_id] = BackfillResult(library_id, "never_stocked")
            else:
                found.setdefault(library_id, state["revision"])
        waiting.update({r.request_id: r for r in requests if r.library_id not in results})

    def finished(library_id: int, acknowledged: int | None, result: BackfillResult) -> None:
        """The backfill's result, or its own request when the library is still behind."""
        if acknowledged is None:
            acknowledged = repository.acknowledged_revisions(conn, [library_id]).get(
                library_id, (0, False)
            )[0]
        if acknowledged >= found[library_id]:
            results[library_id] = result
        else:
            enqueue([library_id])

    enqueue(ids)
    patience = wait_seconds if wait_seconds is not None else policy.lease_seconds + 30
    deadline = time.monotonic() + patience
    while waiting:
        batch = claim(conn, policy, request_ids=list(waiting))
        if batch.claims:
            [c] = batch.claims
            del waiting[c.request_id]
            completion = process(conn, c, policy, generate, spends_attempt=False)
            if completion.outcome in ("published", "removed"):
                result = BackfillResult(c.library_id, "refreshed", completion)
                finished(c.library_id, completion.acknowledged_revision, result)
            else:
                # One attempt per backfill, given back when it fails: the automatic path
                # keeps its attempts and backoff (a tight loop here would trip the
                # circuit).
                results[c.library_id] = BackfillResult(
                    c.library_id, "failed", completion, error=completion.error or "claim lost"
                )
            deadline = time.monotonic() + patience
            continue
        outcomes = repository.request_outcomes(conn, list(waiting))
        for gone in set(waiting) - {row["id"] for row in outcomes}:
            # The request went with its library (a library or server deletion).
            results[waiting[gone].library_id] = BackfillResult(
                waiting[gone].library_id, "failed", error="library deleted"
            )
            del waiting[gone]
        for row in outcomes:
            if row["status"] == "succeeded":
                del waiting[row["id"]]
                library_id = row["library_id"]
                finished(library_id, None, BackfillResult(library_id, "refreshed_elsewhere"))
            elif row["status"] == "failed":
                results[row["library_id"]] = BackfillResult(
                    row["library_id"], "failed", error=row["last_error"]
                )
                del waiting[row["id"]]
        if not waiting:
            break
        if time.monotonic() > deadline:
            for r in waiting.values():
                results[r.library_id] = BackfillResult(
                    r.library_id, "failed", error="timed out waiting for the active request"
                )
            break
        repository.expire_leases(conn, policy)
        time.sleep(0.5)
    return [results[i] for i in ids if i in results]


def materializations_due(
    conn: Connection, grace_seconds: float, limit: int
) -> list[MaterializationDue]:
    """Completions a Dagster refresh run made and did not record (it ended first),
    finished more than `grace_seconds` ago, oldest first."""
    return [
        MaterializationDue(row["id"], row["library_id"])
        for row in repository.materializations_due(conn, grace_seconds, limit)
    ]


def materialized(conn: Connection, request_ids: Sequence[int]) -> None:
    """Record that these completions are materialized in Dagster."""
    if request_ids:
        repository.materialized(conn, request_ids)


def request_learning_refresh(
    conn: Connection,
    library_id: int,
    learning_id: int,
    classification_id: int,
    candidate_id: int | None = None,
) -> int | None:
    """Queue a learning refresh; None when the library already has active work."""
    return repository.request_learning_refresh(
        conn, library_id, learning_id, classification_id, candidate_id
    )


def compact(conn: Connection, policy: RefreshPolicy, max_batches: int = 100) -> int:
    """Delete old terminal requests in bounded batches; returns how many went."""
    total = 0
    for _ in range(max_batches):
        deleted = repository.compact_requests(conn, policy.retention_days, policy.compaction_batch)
        total += deleted
        if deleted < policy.compaction_batch:
            break
    return total


def library_ids_after(conn: Connection, after_id: int) -> list[int]:
    """Libraries with an id above `after_id`, in id order."""
    return repository.library_ids_after(conn, after_id)


def library_ranges(conn: Connection, width: int) -> list[int]:
    """The lowest id of every id range of `width` that holds a library, ascending."""
    return repository.library_ranges(conn, width)


def library_ids_in_ranges(conn: Connection, lows: Sequence[int], width: int) -> list[int]:
    """The libraries whose id lies in one of the ranges [low, low + width), in id order."""
    return repository.library_ids_in_ranges(conn, lows, width)


def library_fingerprint(conn: Connection) -> LibrarySetFingerprint:
    """What the set of library ids looks like, without reading it: the partition sync
    compares this with the last synced one and only diffs both key sets on a change."""
    return repository.library_fingerprint(conn)


def profile_status(conn: Connection, library_ids: Sequence[int]) -> list[ProfileStatus]:
    """Each library's status; its change rows not yet folded count (no fold needed)."""
    return repository.profile_status(conn, library_ids)


def library_labels(conn: Connection, library_ids: Sequence[int]) -> dict[int, LibraryLabel]:
    """Name and media server of each existing library, by id."""
    return {label.library_id: label for label in repository.library_labels(conn, library_ids)}


def stored_profile(conn: Connection, library_id: int) -> StoredProfile | None:
    """The library's published profile, if it has one."""
    return repository.stored_profile(conn, library_id)


def stalled_libraries(
    conn: Connection,
    policy: RefreshPolicy,
    limit: int,
    after: tuple[datetime, int] | None = None,
) -> list[StalledLibrary]:
    """Active libraries dirty for longer than `policy.stall_seconds`, oldest first, at
    most `limit`, after the position (dirty since, library id) of the last one a previous
    page held. An inactive library waits by design: paused, not stalled. It folds the
    captured changes first, and claims and leases nothing."""
    repository.fold_changes(conn)
    return repository.stalled_libraries(conn, policy.stall_seconds, limit, after)


def acknowledged_revisions(
    conn: Connection, library_ids: Sequence[int]
) -> dict[int, tuple[int, bool]]:
    """Each library's acknowledged revision and whether it is paused (its library or
    server inactive); deleted libraries are absent. A fold changes neither."""
    return repository.acknowledged_revisions(conn, library_ids)


def queue_overview(conn: Connection) -> QueueOverview:
    repository.fold_changes(conn)
    return repository.queue_overview(conn)


def mark_all_dirty(conn: Connection, batch: int = 1000) -> int:
    """Advance every library's revision once, so the planner refreshes them all.

    For writes that skipped capture: a restore or replication apply that ran with
    `session_replication_role = replica` fires no trigger. Libraries go in library-id
    order (the lock order of capture) in batches of `batch`, each its own statement and
    transaction, so no transaction ever locks more than one batch. Returns how many
    libraries were marked.
    """
    marked = 0
    after = -(2**63)  # below every bigint id
    while True:
        ids = repository.mark_libraries_dirty(conn, after, batch)
        marked += len(ids)
        if len(ids) < batch:
            return marked
        after = max(ids)
