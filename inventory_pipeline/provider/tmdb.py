"""TMDb API v3 client: `GET /3/movie/{id}`, `/3/tv/{id}` (with its external ids) and
`/3/find/{external_id}` with the API-key flow.

Every outcome becomes an Observation or an allowlisted Failure. The key travels in the
query string, so nothing here ever formats a request URL, an httpx exception or a
response body into text; httpx's own request logging is silenced and redacted.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import httpx

from inventory_pipeline.provider.body import (
    ACCEPT_ENCODING,
    BodyTooLarge,
    DeadlineExceeded,
    Undecodable,
    read_limited,
)
from inventory_pipeline.provider.models import (
    ExternalSource,
    Failure,
    FetchResult,
    FindAnswer,
    ProviderKind,
)
from inventory_pipeline.provider.parsing import (
    InvalidResponse,
    external_id_valid,
    parse_body,
    parse_find_body,
    tmdb_status_code,
)
from inventory_pipeline.provider.retry_after import MAX_RETRY_AFTER_SECONDS, parse_retry_after
from inventory_pipeline.provider.transport import DeadlineTransport
from inventory_pipeline.provider.transport import deadline as request_deadline

DEFAULT_BASE_URL = "https://api.themoviedb.org"
MAX_BODY_BYTES = 512 * 1024

NOT_FOUND_CODES = frozenset({6, 34})
AUTH_CODES = frozenset({3, 7, 10})
THROTTLED_CODES = frozenset({25})

_KEY = re.compile(r"(api_key=)[^&\s\"']+", re.IGNORECASE)
# Every key this process has sent: hidden wherever it appears in a log line, a header a
# server echoed included. Keys are few (one per rotation), and short strings.
_SENT_KEYS: set[str] = set()


def redact(text: str) -> str:
    """Hide an API key carried in a URL query string, and every key this process sent."""
    text = _KEY.sub(r"\1***", text)
    for key in _SENT_KEYS.copy():
        text = text.replace(key, "***")
    return text


class _RedactKeys(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = None
        return True


# httpx's and httpcore's loggers and their children (httpcore writes its trace, headers
# included, to `httpcore.http11`, `httpcore.connection`, ...): a logger's filter does not
# see the records of its children, so each gets the filter, and stays at WARNING unless
# an operator turns it up.
_REDACT = _RedactKeys()
for _name in (
    "httpx",
    "httpcore",
    *(f"httpcore.{child}" for child in ("connection", "connection_pool", "http11", "http2")),
    *(f"httpcore.{child}" for child in ("proxy", "socks")),
    *(n for n in list(logging.root.manager.loggerDict) if n.startswith(("httpx.", "httpcore."))),
):
    _logger = logging.getLogger(_name)
    if _name in ("httpx", "httpcore"):
        _logger.setLevel(logging.WARNING)
    if _REDACT not in _logger.filters:
        _logger.addFilter(_REDACT)


class ProviderConfigError(ValueError):
    """The provider base URL is invalid."""


def validate_base_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        # Shown without user, password, query or fragment: any of them may be a secret.
        if parts.netloc:
            shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
        else:
            shown = redact(base_url.rpartition("@")[2].split("?")[0])
        raise ProviderConfigError(
            f"TMDb base URL must be http(s)://host[:port][/path], got {shown!r}"
        )
    return base_url.rstrip("/")


def status_cause(status: int) -> str:
    """The HTTP status as a label: exact for the statuses TMDb gives meaning to (503:
    the whole service unavailable), else its class ("HTTP 5xx")."""
    if status in (401, 403, 404, 429, 503):
        return f"HTTP {status}"
    if 100 <= status <= 599:
        return f"HTTP {status // 100}xx"
    return "HTTP status out of range"


def classify(status: int, raw: bytes, retry_after: int | None) -> Failure:
    """The allowlisted categories (docs/provider-recovery.md#categories) from the HTTP
    status and TMDb's own error code."""
    code = tmdb_status_code(raw)
    cause = status_cause(status)
    if status == 404 or code in NOT_FOUND_CODES:
        return Failure("not_found", retry_after, cause)
    if status == 401 or code in AUTH_CODES:
        return Failure("auth", retry_after, cause)
    if status == 429 or code in THROTTLED_CODES:
        return Failure("throttled", retry_after, cause)
    if status >= 500:
        return Failure("transient", retry_after, cause)
    return Failure("invalid_response", retry_after, cause)


Parsed = TypeVar("Parsed")


def answered(
    answer: tuple[int, bytes, int | None] | Failure, parse: Callable[[bytes], Parsed]
) -> Parsed | Failure:
    """A GET's outcome: its transport failure, the category of a status other than 200,
    or the parsed body (an invalid one is an `invalid_response`)."""
    if isinstance(answer, Failure):
        return answer
    status, raw, retry_after = answer
    if status != 200:
        return classify(status, raw, retry_after)
    try:
        return parse(raw)
    except InvalidResponse:
        return Failure("invalid_response", cause="HTTP 200, invalid body")


class TmdbClient:
    """One pooled HTTP client; safe to share between threads. `timeout_seconds` is the
    whole request's wall-clock deadline: connect, TLS, the status line, headers and
    body together (see `transport`), not a timeout per read."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout_seconds: float = 10.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = validate_base_url(base_url)
        self.max_body_bytes = max_body_bytes
        self.timeout_seconds = timeout_seconds
        self._client = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_seconds),
            transport=transport or DeadlineTransport(),
            follow_redirects=False,
            headers={"Accept": "application/json", "Accept-Encoding": ACCEPT_ENCODING},
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TmdbClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get(
        self,
        path: str,
        api_key: str | None,
        language: str | None = None,
        limit: int | None = None,
        retry_after_cap_seconds: int = MAX_RETRY_AFTER_SECONDS,
        query: dict[str, str] | None = None,
    ) -> tuple[int, bytes, int | None] | Failure:
        """GET a path (with `query` besides the key and language): (status, decoded body,
        bounded Retry-After) or a transport Failure."""
        if not api_key:
            return Failure("configuration", cause="no key")
        _SENT_KEYS.add(api_key)
        params = {**(query or {}), "api_key": api_key}
        if language:
            params["language"] = language
        deadline = time.monotonic() + self.timeout_seconds
        try:
            with (
                request_deadline(self.timeout_seconds),
                self._client.stream("GET", path, params=params) as response,
            ):
                raw = read_limited(
                    response.iter_raw(),
                    response.headers.get_list("content-encoding", split_commas=True),
                    limit or self.max_body_bytes,
                    deadline,
                )
                retry_after = parse_retry_after(
                    response.headers.get("retry-after"), cap_seconds=retry_after_cap_seconds
                )
                return response.status_code, raw, retry_after
        except BodyTooLarge:
            return Failure("invalid_response", cause="body too large")
        except Undecodable as exc:
            return Failure("invalid_response", cause=str(exc))
        except (httpx.TimeoutException, DeadlineExceeded):
            return Failure("transient", cause="timeout")
        except httpx.HTTPError:
            # Refused or reset connections, bodies cut short: transient like a timeout.
            return Failure("transient", cause="connection error")

    def fetch(
        self, kind: ProviderKind, tmdb_id: int, api_key: str | None, language: str | None = None
    ) -> FetchResult:
        """A movie or show; a show's external ids come appended to the same request."""
        query = {"append_to_response": "external_ids"} if kind == "tv" else None
        answer = self.get(f"/3/{kind}/{tmdb_id}", api_key, language, query=query)
        return answered(answer, lambda raw: parse_body(raw, kind, tmdb_id))

    def find(
        self,
        source: ExternalSource,
        external_id: str,
        api_key: str | None,
        language: str | None = None,
    ) -> FindAnswer | Failure:
        """The TMDb records an external id maps to (`/3/find`). Only a well-formed id of
        its source is ever sent."""
        if not external_id_valid(source, external_id):
            return Failure("invalid_response", cause="malformed external id")
        answer = self.get(
            f"/3/find/{external_id}", api_key, language, query={"external_source": source}
        )
        return answered(answer, parse_find_body)
