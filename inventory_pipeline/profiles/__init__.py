"""Inventory-driven library profile refresh (seed 000)."""

from __future__ import annotations
