"""Validate TMDb v3 movie/TV bodies into frozen observations.

Unknown fields are ignored; a missing required field, a wrong type or non-JSON is an
`invalid_response` (raised as InvalidResponse, caught by the client).
"""

from __future__ import annotations

import json
from datetime import date
from typing import Any

from inventory_pipeline.provider.models import Observation, ProviderKind


class InvalidResponse(ValueError):
    """The provider's response is not a valid record."""


def _str(body: dict[str, Any], key: str, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise InvalidResponse(f"missing {key}")
        return None
    if not isinstance(value, str):
        raise InvalidResponse(f"{key} is not a string")
    return value


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidResponse(f"{key} is not a number")
    return float(value)


def _int(body: dict[str, Any], key: str, required: bool = False) -> int | None:
    value = body.get(key)
    if value is None:
        if required:
            raise InvalidResponse(f"missing {key}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidResponse(f"{key} is not an integer")
    return value


def _names(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidResponse(f"{key} is not a list")
    names = []
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidResponse(f"{key} entries need a name")
        names.append(entry["name"])
    return tuple(names)


def _date(body: dict[str, Any], key: str) -> date | None:
    text = _str(body, key)
    if not text:
        return None  # TMDb sends "" for unknown dates
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise InvalidResponse(f"{key} is not a date") from None


def parse_body(raw: bytes, kind: ProviderKind, expected_id: int) -> Observation:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidResponse("body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidResponse("body is not an object")
    tmdb_id = _int(body, "id", required=True)
    if tmdb_id != expected_id:
        raise InvalidResponse("id does not match the request")
    vote_average = _number(body, "vote_average")
    if vote_average is not None and not 0 <= vote_average <= 10:
        raise InvalidResponse("vote_average out of range")
    language = _str(body, "original_language")
    return Observation(
        tmdb_id=tmdb_id,
        kind=kind,
        title=_str(body, "title" if kind == "movie" else "name", required=True) or "",
        genres=_names(body, "genres"),
        vote_average=vote_average,
        vote_count=_int(body, "vote_count"),
        original_language=language or None,
        companies=_names(body, "production_companies"),
        release_date=_date(body, "release_date" if kind == "movie" else "first_air_date"),
        status=_str(body, "status"),
    )


def tmdb_status_code(raw: bytes) -> int | None:
    """TMDb's own `status_code` from an error body, if the body is one."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    code = body.get("status_code") if isinstance(body, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def is_configuration(raw: bytes) -> bool:
    """A TMDb `/3/configuration` body with the fields a working key returns: HTTP
    success alone is not proof (seed 004)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(body, dict):
        return False
    images = body.get("images")
    return (
        isinstance(images, dict)
        and isinstance(images.get("base_url"), str)
        and isinstance(images.get("secure_base_url"), str)
        and isinstance(body.get("change_keys"), list)
    )
