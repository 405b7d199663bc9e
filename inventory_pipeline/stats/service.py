"""The stats worker's three committed stages, each its own transaction and module:
claim (attempt + lease), compute (private output, batched for large accounts), publish
(atomic replacement of the public projections and applied_version). Each stage arms its
statement budget from the settings row and declares its lease token for the fence."""

from __future__ import annotations

from inventory_pipeline.stats.claim import claim
from inventory_pipeline.stats.compute import compute
from inventory_pipeline.stats.publish import publish

__all__ = ["claim", "compute", "publish"]
