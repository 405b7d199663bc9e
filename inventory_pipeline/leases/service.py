"""Which leases ran out and who took the work back, for the operator."""

from __future__ import annotations

from inventory_pipeline.db import Connection
from inventory_pipeline.leases import repository
from inventory_pipeline.leases.models import LeaseOverview


def overview(conn: Connection, window_seconds: int = 3600, latest: int = 5) -> LeaseOverview:
    """Leases taken back within the window (by kind, and the latest few), and those run
    out now and not yet taken back."""
    return LeaseOverview(
        window_seconds=window_seconds,
        lapsed=repository.lapsed_by_kind(conn, window_seconds),
        latest=repository.latest_lapsed(conn, window_seconds, latest),
        expired=repository.expired_now(conn),
    )
