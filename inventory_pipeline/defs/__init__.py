"""The only package that imports dagster: thin wrappers over the services."""

from __future__ import annotations
