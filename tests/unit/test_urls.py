"""Database URLs: every part percent-encoded, read back alike by libpq and SQLAlchemy
(Dagster's storage), and no password in a message."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from inventory_pipeline.db import InvalidDatabaseUrl
from inventory_pipeline.db.connection import redact_url, url_with_database, validate_url
from inventory_pipeline.deployment import dagster_storage_url

# Each reserved character a user or password can hold, percent-encoded as users write it.
USER = "ops@team:/?#%& x"
PASSWORD = "p@ss/w:rd%?#&=+ ;'\"é"
USER_Q = "ops%40team%3A%2F%3F%23%25%26%20x"
PASSWORD_Q = "p%40ss%2Fw%3Ard%25%3F%23%26%3D%2B%20%3B%27%22%C3%A9"


def libpq(url: str) -> dict[str, str]:
    from psycopg import conninfo

    return {k: str(v) for k, v in conninfo.conninfo_to_dict(url).items() if v is not None}


def sqlalchemy(url: str) -> dict[str, object]:
    parsed = make_url(dagster_storage_url(url))
    return {**parsed.translate_connect_args(), **dict(parsed.query)}


def test_the_reported_password_keeps_its_host() -> None:
    url = url_with_database("postgresql://app:p%40ss%2Fw%3Ard@db.internal:5433/inv", "inv_dagster")
    assert libpq(url)["password"] == "p@ss/w:rd"
    parsed = make_url(dagster_storage_url(url))
    assert (parsed.host, parsed.port, parsed.password) == ("db.internal", 5433, "p@ss/w:rd")
    assert parsed.database == "inv_dagster" and parsed.username == "app"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            f"postgresql://{USER_Q}:{PASSWORD_Q}@db.example.org:6432/inv",
            {"user": USER, "password": PASSWORD, "host": "db.example.org", "port": "6432"},
        ),
        (  # a socket folder with a space, in the query
            f"postgresql://{USER_Q}@/inv?host=%2Fvar%2Frun%2Fpg%20sockets",
            {"user": USER, "host": "/var/run/pg sockets"},
        ),
        ("postgresql://[::1]:5432/inv", {"host": "::1", "port": "5432"}),
        (
            "postgresql://h1:5432,h2:5433/inv?target_session_attrs=read-write",
            {"host": "h1,h2", "port": "5432,5433", "target_session_attrs": "read-write"},
        ),
        (
            "postgresql://u@h/inv?application_name=a%26b%3Dc%20d&sslmode=disable"
            f"&password={PASSWORD_Q}",
            {"application_name": "a&b=c d", "sslmode": "disable", "password": PASSWORD},
        ),
    ],
)
def test_another_database_keeps_every_parameter(url: str, expected: dict[str, str]) -> None:
    rebuilt = url_with_database(url, "inv dagster/ü")
    assert libpq(rebuilt) == {**libpq(url), "dbname": "inv dagster/ü"}
    assert {k: v for k, v in libpq(rebuilt).items() if k in expected} == expected
    # SQLAlchemy sees the same user, password, host, port and options.
    alchemy = sqlalchemy(rebuilt)
    assert alchemy["database"] == "inv dagster/ü"
    for key, value in expected.items():
        name = {"user": "username"}.get(key, key)
        assert str(alchemy[name]) == value, (key, alchemy)


def test_build_url_round_trips() -> None:
    from inventory_pipeline.db.connection import build_url

    params = {"user": USER, "password": PASSWORD, "host": "/tmp/s d", "dbname": "d?b"}
    assert libpq(build_url(params)) == params


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://u:{PASSWORD_Q}@h/d",
        "postgresql://u:p@ss/w:rd@h/d",  # written without encoding
        "postgresql://u:pa?ss@h/d?sslmode=disable",
        "postgresql://u@h/d?sslmode=disable&password=p%40ss",
        "postgresql://u@h/d?password=p@ss&sslmode=disable",
        "postgresql://u@h/d?sslmode=verify-full&sslpassword=p@ss",
    ],
)
def test_redact_hides_every_form_of_password(url: str) -> None:
    shown = redact_url(url)
    assert "***" in shown
    for secret in ("p%40ss", "p@ss", "pa?ss", PASSWORD_Q, "w:rd"):
        assert secret not in shown, shown


def test_malformed_url_message_holds_no_password() -> None:
    # libpq names the bad token, which is the password here.
    url = "postgresql://u:s3cr%zzet@h/d"
    with pytest.raises(InvalidDatabaseUrl) as caught:
        validate_url(url)
    assert "s3cr" not in str(caught.value) and "malformed database URL" in str(caught.value)
    from inventory_pipeline.db.connection import scrub

    assert scrub("bad token s3cr%zzet", url) == "bad token ***"


def test_dagster_storage_carries_the_same_network_bounds() -> None:
    """Dagster's storage connections (psycopg2) get the keepalives and TCP user timeout
    the URL lacks, and the server's side added to its `options` (a setting those name is
    left to them)."""
    query = sqlalchemy("postgresql://u@db.internal/inv?keepalives_idle=30")
    assert query["keepalives"] == "1" and query["keepalives_idle"] == "30"
    assert query["tcp_user_timeout"] == "25000"
    assert query["options"] == (
        "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=5"
        " -c tcp_keepalives_count=3 -c tcp_user_timeout=25000"
    )
    own = sqlalchemy(
        "postgresql://u@db.internal/inv?options=-c%20search_path%3Dops%20-c%20tcp_user_timeout%3D9"
    )
    assert own["options"] == (
        "-c search_path=ops -c tcp_user_timeout=9 -c tcp_keepalives_idle=10"
        " -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"
    )
