"""The convergence harness on separate hosts (chaos/partition.py), its short form: the
workload, workers on two worker hosts and the Dagster deployment of deploy/ on a third,
PostgreSQL on its own; one worker host cut off, mid-compute, for longer than a lease and
than the server's bound, then healed. Everything converges with 0 divergences, the
server ends the cut host's sessions within its bound, another host takes over what it
held, the healed host works again, and `status` lists the leases taken back.

`python -m chaos --network long` is the long form (more cuts, loss and latency, a host
lost for good). INVENTORY_CHAOS_SEED picks another seed."""

from __future__ import annotations

import os

from chaos.partition import (
    CUT_SECONDS,
    PLAN_SECONDS,
    SERVER_BOUND_SECONDS,
    Fault,
    FaultRecord,
    Site,
    fault_divergences,
)
from chaos.run import run
from tests.network.conftest import postgres_on_a_host

CI_SEED = 20261206


def test_one_worker_host_cut_off_and_healed_converges() -> None:
    bindir = postgres_on_a_host()
    seed = int(os.environ.get("INVENTORY_CHAOS_SEED", CI_SEED))
    site = Site.create("short", bindir)
    try:
        assert site.server is not None
        report = run(
            site.server, seed, PLAN_SECONDS["short"], log=lambda _: None, daemon=True, site=site
        )
    finally:
        site.close()
    print("\n".join(report.lines()))
    assert report.divergences == []
    [record] = site.records
    assert record.moment.startswith("computing,"), record.line()  # caught mid-compute
    assert record.held > 0 and record.takeover is not None, record.line()
    assert record.detection is not None and record.detection <= SERVER_BOUND_SECONDS
    assert record.rejoin is not None
    assert report.dagster_share.get("profile acknowledgements", 0) > 0
    # The operator's view: status lists leases taken back during the run.
    assert report.operator_view[0].startswith("lapsed leases"), report.operator_view
    assert not report.operator_view[0].startswith("lapsed leases        0 ")


def record(kind: str, seconds: float, **measured: object) -> FaultRecord:
    out = FaultRecord(Fault(kind, "wa", 0.1, seconds), started=1.0, ended=2.0)
    for name, value in measured.items():
        setattr(out, name, value)
    return out


def test_the_fault_checks_see_a_host_the_server_kept() -> None:
    fine = record("cut", CUT_SECONDS, detection=26.0, takeover=20.0, rejoin=1.0, held=1)
    assert fault_divergences([fine], 1) == []
    kept = record("cut", CUT_SECONDS, detection=None, takeover=20.0, rejoin=1.0, held=1)
    assert "the server still held its sessions" in fault_divergences([kept], 1)[0]
    stuck = record("lose", 0.0, detection=26.0, takeover=None, held=2, left_held=1)
    assert [line.split(": ")[1][:20] for line in fault_divergences([stuck], 1)] == [
        "what it held was not",
        "1 stats leases of it",
    ]
    gone = record("cut", CUT_SECONDS, detection=26.0, takeover=20.0, rejoin=None, held=1)
    assert "never worked again" in fault_divergences([gone], 1)[0]
    assert fault_divergences([], 1) == ["1 network faults planned, 0 struck"]
    # A cut shorter than the bound heals first: the server keeps the sessions, by design.
    short = record("cut", 10.0, detection=None, takeover=None, rejoin=1.0, held=1)
    assert fault_divergences([short], 1) == []
