"""The only package that imports httpx: the TMDb v3 client, its response models,
Retry-After parsing, the shared admission limiter and a local TMDb stand-in."""

from __future__ import annotations
