"""dev's supervision pieces without Dagster: stop signals, instance locks, port check."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from inventory_pipeline.supervisor import (
    Stopping,
    StopSignals,
    SupervisorError,
    check_port_free,
    exclusive,
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_stop_signal_raises_once(signum: int) -> None:
    with StopSignals().installed() as signals:
        with pytest.raises(Stopping) as caught:
            os.kill(os.getpid(), signum)
        assert caught.value.signum == signum and signals.stopping
        os.kill(os.getpid(), signal.SIGTERM)  # while stopping: ignored, clean-up goes on
    assert signal.getsignal(signum) != signals._on_signal  # the previous handler is back


def test_a_signal_inside_deferred_waits_for_the_block() -> None:
    finished = False
    with StopSignals().installed() as signals:
        with pytest.raises(Stopping):
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGHUP)
                finished = True
    assert finished


def test_second_holder_is_refused_with_the_first_pid(tmp_path: Path) -> None:
    with exclusive(tmp_path, "data folder"):
        with pytest.raises(SupervisorError) as caught:
            with exclusive(tmp_path, "data folder"):
                pass
        assert f"(pid {os.getpid()}) is running on the data folder {tmp_path}" in str(caught.value)
    with exclusive(tmp_path, "data folder"):  # released with its holder
        pass


def test_busy_port_is_refused() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SupervisorError, match=f"port {port} on 127.0.0.1 is in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)
