"""Validate TMDb v3 movie/TV bodies into frozen observations.

Unknown fields are ignored; a missing required field, a wrong type or non-JSON is an
`invalid_response` (raised as InvalidResponse, caught by the client).
"""

from __future__ import annotations

import json
from datetime import date
from typing import Any

from inventory_pipeline.provider.models import Observation, ProviderKind

INT4_MAX = 2**31 - 1  # the columns a record's numbers are stored in
INT8_MAX = 2**63 - 1


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
    return _storable(value, key)


def _storable(text: str, key: str) -> str:
    """PostgreSQL text holds neither NUL nor lone surrogates (which JSON escapes can
    carry); such a record is invalid rather than a failed write on every retry."""
    if "\x00" in text:
        raise InvalidResponse(f"{key} contains NUL")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidResponse(f"{key} is not valid Unicode") from None
    return text


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidResponse(f"{key} is not a number")
    return float(value)


def _int(
    body: dict[str, Any], key: str, required: bool = False, maximum: int = INT8_MAX
) -> int | None:
    value = body.get(key)
    if value is None:
        if required:
            raise InvalidResponse(f"missing {key}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidResponse(f"{key} is not an integer")
    if not 0 <= value <= maximum:
        raise InvalidResponse(f"{key} is out of range")
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
        names.append(_storable(entry["name"], key))
    return tuple(names)


def _date(body: dict[str, Any], key: str) -> date | None:
    text = _str(body, key)
    if not text:
        return None  # TMDb sends "" for unknown dates
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise InvalidResponse(f"{key} is not a date") from None


def _load(raw: bytes) -> Any:
    """The decoded JSON body; InvalidResponse for anything else, including nesting deep
    enough to exhaust the parser's recursion (a crash would retry forever)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidResponse("body is not JSON") from None


def parse_body(raw: bytes, kind: ProviderKind, expected_id: int) -> Observation:
    body = _load(raw)
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
        vote_count=_int(body, "vote_count", maximum=INT4_MAX),
        original_language=language or None,
        companies=_names(body, "production_companies"),
        release_date=_date(body, "release_date" if kind == "movie" else "first_air_date"),
        status=_str(body, "status"),
    )


def tmdb_status_code(raw: bytes) -> int | None:
    """TMDb's own `status_code` from an error body, if the body is one."""
    try:
        body = _load(raw)
    except InvalidResponse:
        return None
    code = body.get("status_code") if isinstance(body, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def is_configuration(raw: bytes) -> bool:
    """A TMDb `/3/configuration` body with the fields a working key returns: HTTP
    success alone is not proof (docs/credentials.md#probe)."""
    try:
        body = _load(raw)
    except InvalidResponse:
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
