"""Provider observation and durable, item-scoped recovery against TMDb (seed 003)."""

from __future__ import annotations
