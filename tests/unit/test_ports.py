"""Ports the tests and the chaos harness pick for their servers."""

from __future__ import annotations

import socket

from chaos.servers import FIRST_PICKED_PORT, _first_ephemeral_port, free_port


def test_a_picked_port_is_free_and_below_the_ephemeral_range() -> None:
    """The kernel hands ports of its ephemeral range to any process that binds port 0 or
    connects out (a Dagster code server picks its gRPC port so), which could take a
    picked port before the server meant for it binds it: picks stay below that range."""
    below = _first_ephemeral_port()
    for _ in range(50):
        port = free_port()
        assert FIRST_PICKED_PORT <= port < below
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
