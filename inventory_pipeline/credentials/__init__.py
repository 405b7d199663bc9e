"""Verified credential wakeups for TMDb authentication recovery (seed 004)."""

from __future__ import annotations
