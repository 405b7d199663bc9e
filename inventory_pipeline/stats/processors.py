"""Entry points around the worker: the drivers (from `drain`), the status and rebuild
requests and the PR overview reader."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from inventory_pipeline.db import Connection
from inventory_pipeline.stats import rebuild
from inventory_pipeline.stats import repository as repo
from inventory_pipeline.stats.drain import (
    drain,
    process_claim,
    process_one_account,
    process_user,
    work_waiting,
)
from inventory_pipeline.stats.rebuild import RebuildProgress
from inventory_pipeline.stats.runbook import status as worker_status

__all__ = [
    "drain",
    "process_claim",
    "process_one_account",
    "process_user",
    "read_pr_overview",
    "request_rebuild",
    "work_waiting",
    "worker_status",
]


def request_rebuild(conn: Connection, user_ids: list[UUID] | None) -> RebuildProgress:
    """Enqueue full-history ranges through the queue (never around it), one user per
    transaction (see `rebuild.py`)."""
    return rebuild.request_rebuild(conn, user_ids)


def read_pr_overview(conn: Connection, user_id: UUID, as_of: Any) -> list[dict[str, Any]]:
    """The fail-closed reader: raises ObjectNotInPrerequisiteState (SQLSTATE 55000)
    unless the applied generation has a snapshot for exactly this date; each row says
    whether the generation is stale."""
    return repo.read_pr_overview(conn, user_id, as_of)
