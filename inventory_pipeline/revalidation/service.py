"""Every state transition of revalidation and replacement proposals
(docs/identity-revalidation.md).

claim (hourly budget, compare-and-set, fresh UUID, lease) -> the external-id lookup and
the candidate's details through the shared admission limiter, no transaction open ->
the corroboration rules -> one guarded completion statement (the check, and a proposal
when every rule held) -> messages after commit. An operator's decision is one
transaction that locks the items before the proposals. Nothing here writes an item.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from inventory_pipeline.db import (
    TRANSIENT,
    Connection,
    DatabaseError,
    LockNotAvailable,
    connect,
    transaction,
)
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.models import Failure, FindAnswer
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import Deferred, ProviderSettings
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.revalidation import corroboration, repository
from inventory_pipeline.revalidation.models import (
    PROPOSAL_STATES,
    Checks,
    Decision,
    Proposal,
    ProposalOverview,
    ProposalRefused,
    ProposalState,
    RevalidationClaim,
    RevalidationResult,
    RevalidationSummary,
)
from inventory_pipeline.settings import TmdbSettings

LEASE_SECONDS = recovery.LEASE_SECONDS  # the observation lease's five minutes
CLAIM_BATCH = 4  # cases per claim: a case takes at most two requests
REVALIDATOR = "inventory_pipeline.revalidator"  # application_name of a run's session
SWEEP_LIMIT = 1000
RETENTION_DAYS = 30  # superseded (and moot rejected) proposals are kept this long
MAX_DECISIONS = 1000  # proposals one decision may name
MAX_DECIDED_BY = 64
DECISION_LOCK_SECONDS = 5.0  # how long a decision retries items another program writes
DECISION_LOCK_RETRY_SECONDS = 0.05
LIVE: tuple[ProposalState, ...] = ("proposed", "approved")


def due_revalidations(conn: Connection) -> int:
    return repository.due_revalidations(conn)


def budget_left(conn: Connection, per_hour: int) -> int:
    """Revalidations the rolling hour still allows under `per_hour`."""
    return repository.budget_left(conn, per_hour)


def claim(
    conn: Connection, limit: int, per_hour: int, lease_seconds: int = LEASE_SECONDS
) -> tuple[list[RevalidationClaim], int]:
    """Up to `limit` due cases, never more than the rolling hour leaves under `per_hour`
    (docs/identity-revalidation.md#budget), and how many records the walk settled (0:
    nothing left to walk, or the budget is spent). One transaction: the budget row is
    locked to its commit, so concurrent claimers take turns."""
    with transaction(conn):
        allowed = repository.take_budget(conn, per_hour)
        if allowed <= 0:
            return [], 0
        claims, walked = repository.claim_revalidations(conn, min(limit, allowed), lease_seconds)
        if claims:
            repository.spend_budget(conn, len(claims))
    return claims, walked


def lookup(
    conn: Connection,
    claim: RevalidationClaim,
    client: TmdbClient,
    settings: ProviderSettings,
) -> Checks | Failure | Deferred:
    """The provider I/O of one check, no transaction or lock held: the external-id
    lookup, then, for a single candidate, its details; each through the shared admission
    limiter. A missing candidate is evidence (its round trip is broken); every other
    failure is a fault the check waits out."""
    key = settings.usable_key
    if key is None:
        return Failure("configuration", cause="no active key")
    source, external_id = claim.external
    found = recovery.admitted(
        conn, lambda: client.find(source, external_id, key, settings.language)
    )
    if not isinstance(found, FindAnswer):
        return found
    candidates = corroboration.candidates_of(
        claim.provider_kind, claim.old_tmdb_id, found.candidates
    )
    if len(candidates) != 1:
        return corroboration.corroborate(claim, candidates, None)
    details = recovery.admitted(
        conn,
        lambda: client.fetch(claim.provider_kind, candidates[0].tmdb_id, key, settings.language),
    )
    if isinstance(details, Deferred):
        return details
    if isinstance(details, Failure):
        if details.category != "not_found":
            return details
        return corroboration.corroborate(claim, candidates, None)
    return corroboration.corroborate(claim, candidates, details)


def complete(
    conn: Connection,
    claim: RevalidationClaim,
    result: Checks | Failure | Deferred,
    policy: RetryPolicy,
    rng: random.Random | None = None,
) -> RevalidationResult:
    """Record the check in one guarded statement (a stale claim changes nothing and is
    `lost`); a fault waits out the retry policy's delay for its category; a claim never
    sent goes back without a fault."""
    base = RevalidationResult(
        claim.case_id, claim.item_id, "lost", claim.old_tmdb_id, external=claim.external
    )
    if isinstance(result, Deferred):
        released = repository.release_revalidation(conn, claim)
        return replace(base, outcome="deferred" if released else "lost")
    if isinstance(result, Failure):
        delay = policy.delay(result.category, claim.faults + 1, result.retry_after_seconds, rng)
        due = repository.fault_revalidation(conn, claim, result.category, delay)
        if due is None:
            return replace(base, category=result.category)
        return replace(
            base, outcome="fault", category=result.category, cause=result.cause, next_attempt_at=due
        )
    recorded, proposal_id = repository.complete_revalidation(conn, claim, result)
    if not recorded:
        return replace(base, checks=result)
    if proposal_id is None:
        return replace(base, outcome="no_proposal", checks=result)
    return replace(base, outcome="proposed", checks=result, proposal_id=proposal_id)


def revalidate_claim(
    conn: Connection,
    claim: RevalidationClaim,
    client: TmdbClient,
    settings: ProviderSettings,
    policy: RetryPolicy,
) -> RevalidationResult:
    """One check, start to finish. A database error is never a provider outcome: a
    transient one (deadlock, serialization, lock or statement timeout) gives the claim
    back unrecorded (`error`, no fault counted), due again no sooner than
    `policy.interrupted_seconds` later (no immediate retry), a lost session
    leaves the claim to its lease, and any other one is raised. Any other exception is a
    defect in handling this case's answers: it is recorded as an invalid_response fault
    (its class name kept), so one case never fails a run nor comes back at once."""
    try:
        return complete(conn, claim, lookup(conn, claim, client, settings), policy)
    except TRANSIENT as exc:
        try:
            repository.give_back_interrupted(conn, claim, policy.interrupted_seconds)
        except TRANSIENT:
            pass  # its lease ends it
        return RevalidationResult(
            claim.case_id, claim.item_id, "error", claim.old_tmdb_id, error=type(exc).__name__
        )
    except DatabaseError:
        raise
    except Exception as exc:
        recorded = complete(conn, claim, Failure("invalid_response", cause="unhandled"), policy)
        return replace(recorded, error=type(exc).__name__)


def sweep(conn: Connection) -> tuple[int, int, int]:
    """Bookkeeping before a run claims: proposals superseded by a source change take
    that state as stored, records of ended cases are forgotten, old superseded and moot
    rejected proposals are pruned. Returns the three counts."""
    return (
        repository.supersede_proposals(conn, SWEEP_LIMIT),
        repository.forget_revalidations(conn, SWEEP_LIMIT),
        repository.prune_proposals(conn, RETENTION_DAYS, SWEEP_LIMIT),
    )


def revalidate(
    conn: Connection,
    client: TmdbClient,
    policy: RetryPolicy,
    per_hour: int,
    max_cases: int | None = None,
    on_result: Callable[[RevalidationResult], None] | None = None,
) -> RevalidationSummary:
    """Claim and check due cases, a few at a time, until none is due, the hourly budget
    is spent, `max_cases` are checked or admission is paused. `on_result` runs as soon
    as each check's completion has committed."""
    results: list[RevalidationResult] = []
    limit = per_hour if max_cases is None else max_cases
    while len(results) < limit:
        if admission.paused_seconds(conn) > 0:
            break  # the provider throttled: take nothing until the pause ends
        settings = recovery.provider_settings(conn)
        batch, walked = claim(conn, min(CLAIM_BATCH, limit - len(results)), per_hour)
        if walked == 0:
            break
        for c in batch:
            result = revalidate_claim(conn, c, client, settings, policy)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return RevalidationSummary(tuple(results))


def revalidate_due(
    database_url: str,
    tmdb: TmdbSettings,
    on_notice: Callable[[recovery.Level, str], None],
    policy: RetryPolicy | None = None,
) -> RevalidationSummary:
    """One revalidation run, as the Dagster job starts it: set the admission rate, sweep,
    then `revalidate` within `tmdb.revalidations_per_hour` on a session of its own.
    `on_notice` gets each check's message (`notice`) once its completion committed."""

    def report(result: RevalidationResult) -> None:
        message = notice(result)
        if message is not None:
            on_notice(*message)

    with connect(database_url, application_name=REVALIDATOR) as conn:
        admission.set_rate(conn, tmdb.rate)
        sweep(conn)
        with TmdbClient(tmdb.base_url) as client:
            return revalidate(
                conn,
                client,
                RetryPolicy() if policy is None else policy,
                tmdb.revalidations_per_hour,
                on_result=report,
            )


def notice(result: RevalidationResult) -> tuple[recovery.Level, str] | None:
    """The message a check deserves. Allowlisted fields only: item id, ids, the external
    id looked up, rule and fault labels, proposal id, next attempt, an exception's class
    name; never a body, header, URL or key."""
    item = f"item {result.item_id}"
    looked = f"{result.external[0]} {result.external[1]}" if result.external else "-"
    checks = result.checks
    if result.outcome == "proposed" and checks is not None:
        return (
            "info",
            f"{item}: replacement proposed (proposal {result.proposal_id}): TMDb "
            f"{result.old_tmdb_id} -> {checks.candidate_tmdb_id}; {looked} names it alone, "
            "its details point back, title and year agree; waiting for an operator",
        )
    if result.outcome == "no_proposal" and checks is not None:
        return (
            "info",
            f"{item}: no replacement proposed for TMDb {result.old_tmdb_id} ({checks.reason}; "
            f"{looked}, {checks.candidates} candidates); the case keeps its backoff",
        )
    if result.outcome == "fault":
        at = result.next_attempt_at
        due = at.isoformat(timespec="seconds") if at else "-"
        cause = f"{result.category}: {result.cause}" if result.cause else str(result.category)
        if result.error:
            cause = f"{cause}, after {result.error}"
        return ("info", f"{item}: revalidation could not conclude ({cause}); next try {due}")
    if result.outcome == "error":
        return (
            "warning",
            f"{item}: revalidation not recorded ({result.error}); the case goes back as it was",
        )
    return None


def _stored(states: Sequence[ProposalState]) -> tuple[str, ...]:
    """The stored states that can stand as one of `states`: a stored proposed or
    approved proposal may stand superseded."""
    stored = set(states)
    if "superseded" in stored:
        stored |= set(LIVE)
    return tuple(sorted(stored))


def proposals(
    conn: Connection, states: Sequence[ProposalState] = LIVE, limit: int = 100
) -> list[Proposal]:
    """Proposals standing in `states` (default: awaiting a decision or approved), newest
    first."""
    chosen = tuple(states)
    return repository.proposals(conn, chosen, _stored(chosen), limit)


def overview(conn: Connection, limit: int = 50) -> ProposalOverview:
    """The standing view an operator reviews, read from the database."""
    return ProposalOverview(
        states={s: n for s, n in repository.proposal_states(conn).items() if n},
        live=tuple(proposals(conn, LIVE, limit)),
        reasons=repository.unproposed_reasons(conn),
        unproposed=tuple(repository.unproposed(conn, limit)),
        faulted=repository.faulted(conn),
        due=repository.due_revalidations(conn),
    )


def checked_decided_by(decided_by: str) -> str:
    """Who decides: 1 to 64 printable characters, kept as given (trimmed)."""
    name = decided_by.strip()
    if not name or len(name) > MAX_DECIDED_BY or not name.isprintable():
        raise ProposalRefused(
            f"the operator's name must be 1 to {MAX_DECIDED_BY} printable characters"
        )
    return name


def decide(
    conn: Connection,
    approve: Sequence[int] = (),
    reject: Sequence[int] = (),
    decided_by: str = "",
    lock_seconds: float = DECISION_LOCK_SECONDS,
) -> list[Decision]:
    """Approve and reject proposals in one transaction, all or nothing: every id must
    name a proposal that still stands as proposed, else ProposalRefused names the first
    that does not and nothing is decided. The items are locked (share) before the
    proposals, all at once or not at all, so a source change in flight is waited for
    (up to `lock_seconds`, then refused in one line) and seen: it supersedes a proposal
    before the decision, or after it; and a decision never holds one item while waiting
    for another, so it never deadlocks another program's write
    (docs/identity-revalidation.md#decisions). An approval writes the proposal only:
    never the item."""
    name = checked_decided_by(decided_by)
    chosen = [*approve, *reject]
    if not chosen:
        raise ProposalRefused("name at least one proposal to approve or reject")
    if len(chosen) > MAX_DECISIONS:
        raise ProposalRefused(f"at most {MAX_DECISIONS} proposals per decision")
    for proposal_id in chosen:
        if isinstance(proposal_id, bool) or not 1 <= proposal_id < 2**63:
            raise ProposalRefused(f"proposal ids are positive whole numbers, got {proposal_id!r}")
    if len(set(chosen)) != len(chosen):
        twice = next(p for p in chosen if chosen.count(p) > 1)
        raise ProposalRefused(f"proposal {twice} is named twice")
    deadline = time.monotonic() + lock_seconds
    while True:
        try:
            return _decide(conn, approve, reject, name)
        except LockNotAvailable:
            if time.monotonic() >= deadline:
                raise ProposalRefused(
                    "another transaction is writing the items of these proposals; "
                    "nothing decided, try again"
                ) from None
            time.sleep(DECISION_LOCK_RETRY_SECONDS)


def _decide(
    conn: Connection, approve: Sequence[int], reject: Sequence[int], name: str
) -> list[Decision]:
    """One attempt of `decide`: LockNotAvailable when an item is locked by a writer."""
    chosen = [*approve, *reject]
    with transaction(conn):
        repository.lock_proposal_items(conn, chosen)
        states = repository.chosen_proposals(conn, chosen)
        for proposal_id in chosen:
            state = states.get(proposal_id)
            if state is None:
                raise ProposalRefused(f"proposal {proposal_id} does not exist")
            if state == "superseded":
                raise ProposalRefused(
                    f"proposal {proposal_id} is superseded: the item's source or case changed"
                )
            if state != "proposed":
                raise ProposalRefused(f"proposal {proposal_id} is already {state}")
        decided = repository.decide_proposals(conn, list(approve), list(reject), name)
        if len(decided) != len(chosen):  # the locks above make this unreachable
            raise ProposalRefused("the proposals changed during the decision; nothing decided")
    return decided


def parse_states(text: str) -> tuple[ProposalState, ...]:
    """`all`, or a comma-separated list of proposal states."""
    if text == "all":
        return PROPOSAL_STATES
    states = tuple(s.strip() for s in text.split(",") if s.strip())
    for state in states:
        if state not in PROPOSAL_STATES:
            raise ProposalRefused(
                f"unknown proposal state {state[:40]!r} (one of {', '.join(PROPOSAL_STATES)})"
            )
    return states  # type: ignore[return-value]


def replacements(conn: Connection) -> list[dict[str, object]]:
    """The published replacements the syncing program may adopt."""
    return [dict(r) for r in repository.replacements(conn)]
