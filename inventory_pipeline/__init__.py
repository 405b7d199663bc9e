"""inventory_pipeline: derived data kept fresh from a PostgreSQL system of record.

`__version__` is the package's only version: pyproject.toml reads it from here.
"""

from __future__ import annotations

__version__ = "0.1.0"
