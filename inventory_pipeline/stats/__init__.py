"""Training stats refresh: write path, dirty-range queue, lease-fenced
claim -> compute -> publish worker, per-exercise and per-period projections."""

from __future__ import annotations
