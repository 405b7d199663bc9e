"""Hosts in network namespaces (chaos/netns.py): PostgreSQL on a host of its own, clients
on others, faults made in the router between them. Skipped where namespaces cannot be
made (not root, no `ip`/`nft`/`iptables`) or no PostgreSQL binaries are installed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from chaos import netns


@dataclass
class Site:
    network: netns.Network
    server: netns.ClusterHost


@pytest.fixture
def site() -> Iterator[Site]:
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    bindir = netns.postgres_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql")
    network = netns.Network()
    try:
        server = netns.ClusterHost(network, network.add_host("pg"), bindir)
        try:
            yield Site(network, server)
        finally:
            server.stop()
    finally:
        network.close()
