"""What `status` shows of lapsed leases."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class LapsedLease:
    kind: str  # profile request, stats run, observation, credential probe
    work: str  # which one, read after the kind: "12 for library 3", "of item 7", ...
    holder: str | None  # a stats run's lock owner, else "token " and the start of the token
    lapsed_at: datetime
    taken_by: str | None  # set exactly when the outcome is "taken"
    taken_at: datetime
    # taken (by `taken_by`), requeued (back to pending), restarted (a stats run retired
    # so that its job starts again under a new run), failed (no attempt was left: the
    # request or the stats job failed for good)
    outcome: str


@dataclass(frozen=True)
class LeaseOverview:
    window_seconds: int
    lapsed: dict[str, int]  # kind -> leases taken back within the window
    latest: tuple[LapsedLease, ...]  # the latest taken back, newest first
    expired: dict[str, int]  # kind -> leases run out now, not yet taken back
