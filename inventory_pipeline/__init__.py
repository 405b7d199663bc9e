"""inventory_pipeline: derived data kept fresh from a PostgreSQL system of record."""

from __future__ import annotations

__version__ = "0.1.0"
