"""The partitions of library_profile: ranges of PARTITION_WIDTH library ids ("000120-000129"),
not one library each. The webserver reads every key of a dynamic partition set several
times per page load, so one key per library made the asset's page slow at 100k
libraries; the outbox, the leases and the planning stay per library."""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

# Dynamic partition set names are global to the instance: keep this one distinctive.
PARTITIONS_NAME = "inventory_pipeline__library_profile"
library_partitions = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
PROFILE_ASSET = dg.AssetKey("library_profile")
# Library ids per partition: 10k partition keys at 100k libraries.
PARTITION_WIDTH = 10
# The largest library id (bigint): the last range holds ids up to it, not past it.
BIGINT_MAX = 2**63 - 1


def low_of(library_id: int) -> int:
    """The lowest id of the range that holds a library."""
    return library_id - library_id % PARTITION_WIDTH


def range_key(low: int) -> str:
    """The partition key of the id range starting at `low`: both ends, zero-padded."""
    return f"{low:06d}-{low + PARTITION_WIDTH - 1:06d}"


def partition_of(library_id: int) -> str:
    """The key of the partition that holds a library."""
    return range_key(low_of(library_id))


def range_low(key: str) -> int | None:
    """The lowest library id of a partition key; None for any key this module would not
    have written."""
    low, sep, high = key.partition("-")
    if not (sep and _is_number(low) and _is_number(high)):
        return None
    start = int(low)
    valid = start <= BIGINT_MAX and start % PARTITION_WIDTH == 0 and range_key(start) == key
    return start if valid else None


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= len(str(BIGINT_MAX))


def is_partition_key(key: str) -> bool:
    return range_low(key) is not None


def range_lows_of(partition_keys: Sequence[str]) -> list[int]:
    """Partition keys are library id ranges; anything else is refused before any work."""
    lows = [range_low(key) for key in partition_keys]
    bad = [key for key, low in zip(partition_keys, lows, strict=True) if low is None]
    if bad:
        raise dg.Failure(
            f"partition keys must be library id ranges like {range_key(0)!r}, got {bad[0][:40]!r}"
        )
    return [low for low in lows if low is not None]


def range_ids(lows: Sequence[int]) -> list[int]:
    """Every id the ranges can hold, whether or not a library has it."""
    ids = (low + n for low in sorted(set(lows)) for n in range(PARTITION_WIDTH))
    return [i for i in ids if i <= BIGINT_MAX]
