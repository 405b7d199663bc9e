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
    taken_by: str | None  # None: returned to the queue, or restarted under a new run
    taken_at: datetime


@dataclass(frozen=True)
class LeaseOverview:
    window_seconds: int
    lapsed: dict[str, int]  # kind -> leases taken back within the window
    latest: tuple[LapsedLease, ...]  # the latest taken back, newest first
    expired: dict[str, int]  # kind -> leases run out now, not yet taken back
