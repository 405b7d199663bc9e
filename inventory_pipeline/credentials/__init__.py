"""Verified credential wakeups for TMDb authentication recovery (docs/credentials.md)."""

from __future__ import annotations
