"""Hosts in network namespaces (chaos/netns.py): PostgreSQL on a host of its own, clients
on others, faults made in the router between them. Skipped where namespaces cannot be
made (not root, no `ip`/`nft`/`iptables`) or no PostgreSQL binaries are installed;
with INVENTORY_NETWORK_REQUIRED=1 (CI) that is a failure instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos import netns


@dataclass
class Site:
    network: netns.Network
    server: netns.ClusterHost


def postgres_on_a_host(major: int | None = None) -> Path:
    """The PostgreSQL binaries to run on a host of its own (`major`, else the newest the
    system has); skips (or fails, where required) when hosts cannot be made here."""
    why = netns.available()
    bindir = netns.postgres_bindirs().get(major) if major else netns.postgres_bindir()
    if why is None and bindir is None:
        why = f"no PostgreSQL {major or ''} to run on a host".replace("  ", " ")
    if why is not None or bindir is None:
        if os.environ.get("INVENTORY_NETWORK_REQUIRED") == "1":
            pytest.fail(f"separate hosts required here: {why}")
        pytest.skip(why)
    return bindir


@pytest.fixture(params=[15, 18], ids=lambda major: f"pg{major}")
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    """PostgreSQL 15 (the system's) and 18 (the embedded wheel's) each on a host."""
    bindir = postgres_on_a_host(request.param)
    network = netns.Network()
    try:
        server = netns.ClusterHost(network, network.add_host("pg"), bindir)
        try:
            yield Site(network, server)
        finally:
            server.stop()
    finally:
        network.close()
