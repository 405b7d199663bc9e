"""Every connection bounds a silent network on both ends (db.connection.KEEPALIVES):
libpq's keepalives and TCP user timeout on the client, the same values as the session's
settings on the server, and the server's client-connection check. A URL's own values
win. tests/network cuts a real link under them."""

from __future__ import annotations

import pytest

from inventory_pipeline.db import DatabaseError, connect, fetch_one

SERVER_SIDE = (
    "SELECT inet_client_addr() IS NOT NULL AS tcp,"
    " current_setting('tcp_keepalives_idle') AS idle,"
    " current_setting('tcp_keepalives_interval') AS interval,"
    " current_setting('tcp_keepalives_count') AS count,"
    " current_setting('tcp_user_timeout') AS user_timeout,"
    " current_setting('client_connection_check_interval') AS check_interval"
)


def test_a_connection_bounds_a_silent_network_on_both_ends(db_url: str) -> None:
    with connect(db_url) as conn:
        client = conn.info.get_parameters()
        server = fetch_one(conn, SERVER_SIDE)
    assert {k: client.get(k) for k in ("keepalives", "keepalives_idle", "tcp_user_timeout")} == {
        "keepalives": "1",
        "keepalives_idle": "10",
        "tcp_user_timeout": "25000",
    }
    assert server is not None and server["check_interval"] == "5s"
    if server["tcp"]:  # over a Unix socket the server ignores its TCP settings (reads 0)
        assert (server["idle"], server["interval"], server["count"], server["user_timeout"]) == (
            "10",
            "5",
            "3",
            "25000",
        )


def test_a_urls_own_values_win_on_both_ends(db_url: str) -> None:
    separator = "&" if "?" in db_url else "?"
    url = db_url + separator + "keepalives_idle=7&keepalives_count=2&tcp_user_timeout=9000"
    with connect(url) as conn:
        client = conn.info.get_parameters()
        server = fetch_one(conn, SERVER_SIDE)
    assert (client["keepalives_idle"], client["tcp_user_timeout"]) == ("7", "9000")
    assert server is not None
    if server["tcp"]:
        assert (server["idle"], server["interval"], server["count"], server["user_timeout"]) == (
            "7",
            "5",
            "2",
            "9000",
        )


def test_a_session_setting_the_server_refuses_opens_nothing(db_url: str) -> None:
    """The connection is closed before the error reaches the caller (a worker retrying
    would otherwise leave a session behind on every try)."""
    with pytest.raises(DatabaseError):
        connect(db_url, application_name="refused-setting", idle_in_transaction_ms=-1)
    with connect(db_url) as conn:
        row = fetch_one(
            conn,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = 'refused-setting'",
        )
    assert row == {"n": 0}
