"""Inventory-driven library profile refresh (docs/profiles.md)."""

from __future__ import annotations
