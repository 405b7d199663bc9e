"""Validate TMDb v3 movie/TV bodies into frozen observations.

Unknown fields are ignored; a missing required field, a wrong type or non-JSON is an
`invalid_response` (raised as InvalidResponse, caught by the client).
"""

from __future__ import annotations

import json
import re
from datetime import date
from typing import Any

from inventory_pipeline.provider.models import (
    Candidate,
    ExternalSource,
    FindAnswer,
    Observation,
    ProviderKind,
)

INT4_MAX = 2**31 - 1  # the columns a record's numbers are stored in
INT8_MAX = 2**63 - 1
# An IMDb title id: "tt" and 7 to 10 ASCII digits (the column's CHECK says the same).
_IMDB_ID = re.compile(r"tt[0-9]{7,10}")
_TVDB_ID = re.compile(r"[1-9][0-9]{0,9}")


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


def imdb_id_of(value: object) -> str | None:
    """An IMDb title id, or None for anything else (TMDb sends null or "" when unknown)."""
    return value if isinstance(value, str) and _IMDB_ID.fullmatch(value) else None


def tvdb_id_of(value: object) -> int | None:
    """A TVDB id (a positive int32), or None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= INT4_MAX else None


def external_id_valid(source: ExternalSource, value: str) -> bool:
    """Is this a well-formed external id of its source? Only such ids are ever put into
    a request path."""
    pattern = _IMDB_ID if source == "imdb_id" else _TVDB_ID
    return bool(pattern.fullmatch(value)) and (source == "imdb_id" or int(value) <= INT4_MAX)


def _external_ids(body: dict[str, Any], kind: ProviderKind) -> tuple[str | None, int | None]:
    """A movie's IMDb id (a field of the record); a show's IMDb and TVDB ids (its
    appended `external_ids`). Malformed ids are no evidence, never a failed observation."""
    if kind == "movie":
        return imdb_id_of(body.get("imdb_id")), None
    ids = body.get("external_ids")
    if not isinstance(ids, dict):
        return None, None
    return imdb_id_of(ids.get("imdb_id")), tvdb_id_of(ids.get("tvdb_id"))


def _title(body: dict[str, Any], key: str) -> str | None:
    """An optional title, None unless it is storable text."""
    value = body.get(key)
    if not isinstance(value, str):
        return None
    try:
        return _storable(value, key)
    except InvalidResponse:
        return None


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
    imdb_id, tvdb_id = _external_ids(body, kind)
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
        original_title=_title(body, "original_title" if kind == "movie" else "original_name"),
        imdb_id=imdb_id,
        tvdb_id=tvdb_id,
    )


def _candidate(entry: object, kind: ProviderKind) -> Candidate:
    if not isinstance(entry, dict):
        raise InvalidResponse("find results must be objects")
    tmdb_id = _int(entry, "id", required=True, maximum=INT4_MAX)
    assert tmdb_id is not None
    if tmdb_id == 0:
        raise InvalidResponse("find result id is out of range")
    movie = kind == "movie"
    try:
        released = _date(entry, "release_date" if movie else "first_air_date")
    except InvalidResponse:
        released = None  # a result's date is evidence only: a bad one is no date
    return Candidate(
        tmdb_id=tmdb_id,
        kind=kind,
        title=_title(entry, "title" if movie else "name"),
        original_title=_title(entry, "original_title" if movie else "original_name"),
        release_date=released,
    )


def parse_find_body(raw: bytes) -> FindAnswer:
    """The movie and TV results of `/3/find/{external_id}`: both lists must be there
    (possibly empty) and every result needs an id; other result kinds are ignored."""
    body = _load(raw)
    if not isinstance(body, dict):
        raise InvalidResponse("body is not an object")
    candidates: list[Candidate] = []
    kinds: tuple[tuple[str, ProviderKind], ...] = (("movie_results", "movie"), ("tv_results", "tv"))
    for key, kind in kinds:
        results = body.get(key)
        if not isinstance(results, list):
            raise InvalidResponse(f"{key} is not a list")
        candidates += [_candidate(entry, kind) for entry in results]
    return FindAnswer(tuple(candidates))


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
