"""Provider observation and durable, item-scoped recovery against TMDb
(docs/provider-recovery.md)."""

from __future__ import annotations
