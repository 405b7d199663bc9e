"""Frozen values of the profile refresh capability (docs/profiles.md)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, get_args
from uuid import UUID

RequestKind = Literal["learning", "native", "inventory_change"]

# Fixed server-owned source/reason identifiers, never caller input (the migration's CHECK
# admits exactly these for inventory work).
INVENTORY_SOURCE = "inventory_revision"
INVENTORY_REASON = "inventory_changed"
BACKFILL_REASON = "analyst_backfill"
NATIVE_SOURCE = "native_policy"
NATIVE_REASON = "profile_age"
LEARNING_SOURCE = "learning"
LEARNING_REASON = "learning_update"

# A planner pass takes the oldest 25 dirty candidates (docs/profiles.md#planning).
PLANNER_BATCH = 25


@dataclass(frozen=True)
class RefreshPolicy:
    """Timing and bounds of planning, leases, retries and compaction."""

    lease_seconds: int = 300
    retry_seconds: int = 30
    circuit_probe_seconds: int = 7200
    native_max_age_seconds: int = 86400
    planner_passes: int = 20
    # A refresh run claims one request at a time (a lease only ever covers work that has
    # begun) and stops after this many. A run worker's start costs about 3 s of CPU, so
    # fewer, longer runs drain a burst faster: 5,000 claims are about a minute of work.
    run_claims: int = 5000
    retention_days: int = 30
    compaction_batch: int = 1000
    # A library dirty for longer than this is stalled: its profile check turns red
    # even when no run touches it.
    stall_seconds: int = 900


@dataclass(frozen=True)
class PlannedRequest:
    request_id: int
    library_id: int
    kind: RequestKind
    inventory_revision: int | None


@dataclass(frozen=True)
class DirtyPosition:
    """A place in the dirty index's order (oldest change first, then library id)."""

    dirty_since: datetime
    library_id: int


@dataclass(frozen=True)
class PlannerPass:
    """One planner pass: the requests it queued, how many candidates its walk found
    (a full batch means more may follow) and where the walk stopped."""

    requests: tuple[PlannedRequest, ...]
    candidates: int
    last: DirtyPosition | None


@dataclass(frozen=True)
class LibrarySetFingerprint:
    """Count, largest id and a sum of 64-bit id hashes of every library: equal
    fingerprints mean (but for a hash collision) the same set of library ids."""

    libraries: int
    max_id: int
    digest: str

    @property
    def token(self) -> str:
        return f"{self.libraries}:{self.max_id}:{self.digest}"


@dataclass(frozen=True)
class Plan:
    """What one planning tick did."""

    expired: int
    inventory: tuple[PlannedRequest, ...]
    native: tuple[PlannedRequest, ...]

    @property
    def planned(self) -> int:
        return len(self.inventory) + len(self.native)


@dataclass(frozen=True)
class Claim:
    """One request held under a lease token."""

    request_id: int
    library_id: int
    kind: RequestKind
    inventory_revision: int | None
    attempt: int
    lease_token: UUID
    lease_expires_at: datetime


@dataclass(frozen=True)
class ClaimBatch:
    lease_token: UUID
    claims: tuple[Claim, ...]


@dataclass(frozen=True)
class LibrarySnapshot:
    """The projection of one library's items and the library's revision, read in one
    snapshot: what a profile is generated from."""

    library_id: int
    revision: int
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]


Outcome = Literal["published", "removed", "lost", "failed"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


@dataclass(frozen=True)
class Completion:
    """The result of processing one claim."""

    request_id: int
    library_id: int
    kind: RequestKind
    outcome: Outcome
    claimed_revision: int | None
    snapshot_revision: int
    acknowledged_revision: int | None
    revision: int | None
    item_count: int
    profile: dict[str, Any] | None
    error: str | None = None


@dataclass(frozen=True)
class RefreshRun:
    """What one refresh run did: the plans it made when it ran out of claimable work,
    and every claim it processed, in order."""

    plans: tuple[Plan, ...]
    completions: tuple[Completion, ...]

    @property
    def planned(self) -> int:
        return sum(p.planned for p in self.plans)

    @property
    def outcomes(self) -> dict[str, int]:
        """How many completions ended in each outcome, every outcome named (zero too)."""
        counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        for completion in self.completions:
            counts[completion.outcome] += 1
        return counts


@dataclass(frozen=True)
class MaterializationDue:
    """A completion of a Dagster refresh run that is not yet a materialization."""

    request_id: int
    library_id: int


@dataclass(frozen=True)
class BackfillRequest:
    request_id: int
    library_id: int
    enqueued: bool


@dataclass(frozen=True)
class ProfileStatus:
    """A library's profile as stored against its inventory: what a range's check
    judges and what its summary shows."""

    library_id: int
    label: LibraryLabel
    revision: int
    acknowledged_revision: int
    profile_revision: int | None
    item_count: int | None
    items: int
    dirty_seconds: float | None  # since the first unacknowledged change; None: clean
    published_at: datetime | None
    published_traits: tuple[str, ...]
    paused: bool = False  # its library or server is inactive: it waits by design

    @property
    def current(self) -> bool:
        """Acknowledged up to the revision, and the stored profile matches the inventory."""
        if self.acknowledged_revision < self.revision:
            return False
        if self.items == 0:
            return self.profile_revision is None
        return self.profile_revision is not None and self.item_count == self.items

    def catching_up(self, stall_seconds: int) -> bool:
        """Behind only by changes younger than the stall threshold: the refresh has not
        reached them yet, which is not an error."""
        return (
            self.acknowledged_revision < self.revision
            and self.dirty_seconds is not None
            and self.dirty_seconds < stall_seconds
        )

    @property
    def reason(self) -> str | None:
        """Why the profile is not current, in one line; None when it is."""
        if self.acknowledged_revision < self.revision:
            return (
                f"inventory revision {self.revision} not yet acknowledged "
                f"(acknowledged {self.acknowledged_revision})"
            )
        if self.items == 0:
            return None if self.profile_revision is None else "empty library still has a profile"
        if self.profile_revision is None:
            return f"no stored profile for {self.items} items"
        if self.item_count != self.items:
            return f"stored profile covers {self.item_count} items, the library has {self.items}"
        return None


@dataclass(frozen=True)
class LibraryLabel:
    """How a reader recognises a library: its name and its media server."""

    library_id: int
    name: str
    media_kind: str
    server_name: str
    server_kind: str


@dataclass(frozen=True)
class StoredProfile:
    """The published profile of a library as stored."""

    library_id: int
    inventory_revision: int
    item_count: int
    profile: dict[str, Any]


@dataclass(frozen=True)
class StalledLibrary:
    """A library whose inventory revision has waited longer than the stall threshold."""

    library_id: int
    revision: int
    acknowledged_revision: int
    dirty_since: datetime
    stalled_seconds: int


@dataclass(frozen=True)
class QueueOverview:
    dirty: int
    pending: int
    claimable: int
    running: int
    failed: int
    oldest_dirty_since: datetime | None
