"""`inventory-pipeline` commands.

Errors a user can cause (bad URL, unreachable server, missing Dagster home, unknown
option) print one line and exit non-zero; they never show a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.credentials.models import short
from inventory_pipeline.db import DatabaseError, connect
from inventory_pipeline.demo import load_demo
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    WEBSERVER_COMMAND,
    Deployment,
    prepare_dagster_home,
    provision,
    reach,
)
from inventory_pipeline.profiles import service
from inventory_pipeline.provider import admission
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.provider.tmdb import TmdbClient
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import ObservationResult, ProviderSettings
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.settings import (
    DAGSTER_STORAGE_URL,
    DATABASE_URL,
    TMDB_BASE_URL,
    Settings,
    SettingsError,
)
from inventory_pipeline.stats import maintenance as stats_maintenance
from inventory_pipeline.stats import processors as stats
from inventory_pipeline.stats import runbook as stats_runbook
from inventory_pipeline.stats.models import WorkerSettings
from inventory_pipeline.supervisor import (
    Children,
    Stopping,
    StopSignals,
    SupervisorError,
    check_port_free,
    exclusive,
    wait_for_webserver,
)

PROG = "inventory-pipeline"
CODE_LOCATION = "inventory_pipeline.definitions"
DEMO_KEY = "demo-key"  # the stand-in's key; not a real TMDb credential


class CliError(Exception):
    """The command cannot go on."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")


def _count(text: str) -> int:
    """A positive whole number (claim and item limits)."""
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text[:40]!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {text[:40]!r}")
    return int(text)


LANGUAGE = re.compile(r"^[a-z]{2,3}(-[A-Z]{2})?$")


def _language(text: str) -> str:
    """A TMDb language: ISO 639-1, optionally with an ISO 3166-1 region (en, en-US)."""
    if not LANGUAGE.match(text):
        raise argparse.ArgumentTypeError(f"must look like en or en-US, got {text[:40]!r}")
    return text


def _seconds_ms(text: str) -> int:
    """A positive duration in seconds (decimals allowed), as whole milliseconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not text.isascii() or not 0 < value <= 86400 or round(value * 1000) < 1:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most 86400, got {text[:40]!r}"
        )
    return round(value * 1000)


def _whole(text: str) -> int:
    """A whole number from 0 (the retry backoff may be zero)."""
    if not text.isascii() or not text.isdigit() or int(text) > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text[:40]!r}")
    return int(text)


STATS_SETTING_FLAGS = (
    ("--claim-seconds", "claim_budget_ms", _seconds_ms, "claim statement budget"),
    ("--compute-seconds", "compute_budget_ms", _seconds_ms, "compute statement budget"),
    ("--publish-seconds", "publish_budget_ms", _seconds_ms, "publish statement budget (< 8)"),
    ("--lease-seconds", "lease_seconds", _count, "lease (covers compute + publish)"),
    ("--active-leases", "active_lease_cap", _count, "cap of active leases"),
    ("--max-attempts", "max_attempts", _count, "attempts before a job fails"),
    ("--backoff-seconds", "retry_backoff_seconds", _whole, "retry backoff per attempt"),
)


def _stats_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    stats = sub.add_parser("stats", help="operate the training stats worker (the runbook)")
    actions = stats.add_subparsers(dest="stats_command", required=True, parser_class=_Parser)
    settings = actions.add_parser("settings", help="show or change the worker's budgets")
    for flag, dest, kind, text in STATS_SETTING_FLAGS:
        settings.add_argument(flag, dest=dest, type=kind, help=text)
    actions.add_parser("pause", help="stop claiming (work in flight finishes; nothing is lost)")
    actions.add_parser("resume", help="claim again after a pause")
    retry = actions.add_parser("retry", help="retry a job that exhausted its attempts")
    retry.add_argument("job_id", type=_count, help="the failed job's id")
    drain = actions.add_parser("drain", help="claim, compute and publish once, without Dagster")
    drain.add_argument("--rounds", type=_count, default=50, help="claims to process")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Keep library profiles fresh from PostgreSQL.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    dev = sub.add_parser("dev", help="run Dagster (webserver + daemon) on the database")
    dev.add_argument("--demo", action="store_true", help="load the demo inventory first")
    dev.add_argument("--host", default="127.0.0.1", help="webserver address (default loopback)")
    dev.add_argument("--port", type=_port, default=3000, help="webserver port (default 3000)")
    sub.add_parser("migrate", help="apply pending migrations")
    sub.add_parser("status", help="show the refresh queues")
    sub.add_parser("demo", help="load the demo inventory into an empty database")
    refresh = sub.add_parser("refresh", help="plan and process refresh work once, without Dagster")
    refresh.add_argument("--limit", type=_count, default=100, help="claims to process")
    observe = sub.add_parser("observe", help="observe due items against TMDb once")
    observe.add_argument("--limit", type=_count, default=500, help="items to observe")
    sub.add_parser(
        "mark-dirty",
        help="mark every library dirty (after a restore or replication apply that ran"
        " without triggers)",
    )
    key = sub.add_parser("tmdb-key", help="save the TMDb API key, read from standard input")
    key.add_argument("--language", type=_language, help="TMDb language, e.g. en-US")
    key.add_argument("--inactive", action="store_true", help="save it but keep it inactive")
    _stats_parser(sub)
    return parser


def _say(message: str) -> None:
    """Print a status line; a closed terminal (SIGHUP) must not stop the clean-up."""
    with contextlib.suppress(OSError):
        print(f"{PROG}: {message}", flush=True)


def _run_dagster(
    args: argparse.Namespace, home: Path, deployment: Deployment, children: Children
) -> int:
    env = dict(os.environ)
    env.update(
        {
            "DAGSTER_HOME": str(home),
            DATABASE_URL: deployment.app_url,
            DAGSTER_STORAGE_URL: deployment.dagster_url,
        }
    )
    location = ["-m", CODE_LOCATION]
    children.start("daemon", [*DAEMON_COMMAND, "run", *location], env)
    children.start(
        "webserver", [*WEBSERVER_COMMAND, "-h", args.host, "-p", str(args.port), *location], env
    )
    url = f"http://{args.host}:{args.port}"
    wait_for_webserver(url, args.port, children.procs["webserver"])
    _say(f"Dagster UI at {url} (Ctrl-C stops everything)")
    while True:
        exited = children.exited()
        if exited is not None:
            raise CliError(f"the Dagster {exited[0]} exited with code {exited[1]}")
        time.sleep(0.5)


def _serve(
    args: argparse.Namespace,
    settings: Settings,
    home: Path,
    signals: StopSignals,
    stack: contextlib.ExitStack,
) -> int:
    """Take the locks, recover a killed `dev`, check the port, provision, then run
    Dagster; everything started is pushed on `stack` to be stopped in reverse order."""
    if settings.database_url is None:
        stack.enter_context(exclusive(settings.data_dir, "data folder"))
    stack.enter_context(exclusive(home, "Dagster instance"))
    children = Children(home, signals)
    if children.recover():
        _say("stopped the Dagster processes a killed `dev` left running")
    check_port_free(args.host, args.port)
    deployment = stack.enter_context(provision(settings))
    if args.demo:
        # The demo observes a local TMDb stand-in: no internet, faults switchable.
        standin = stack.enter_context(StandIn(api_key=DEMO_KEY, missing_every=17))
        os.environ[TMDB_BASE_URL] = standin.url
        with connect(deployment.app_url) as conn:
            created = load_demo(conn)
            recovery.save_provider_settings(conn, ProviderSettings(DEMO_KEY, True, None))
        _say(f"demo inventory: {created} libraries loaded")
        _say(
            f"TMDb stand-in at {standin.url} (faults: POST "
            f"{standin.url}/__standin/faults, see README)"
        )
    stack.callback(children.stop)  # first out: Dagster stops before its database
    return _run_dagster(args, home, deployment, children)


def _dev(args: argparse.Namespace, settings: Settings) -> int:
    """One `dev` per data folder and Dagster home; the port is checked before anything
    starts; SIGINT, SIGTERM and SIGHUP stop Dagster, the stand-in and the embedded
    PostgreSQL (see supervisor)."""
    home = prepare_dagster_home(settings)  # fail fast on a missing DAGSTER_HOME
    try:
        with StopSignals().installed() as signals, contextlib.ExitStack() as stack:
            try:
                return _serve(args, settings, home, signals, stack)
            finally:
                # Whatever ends `dev`, a later signal must not cut the clean-up short.
                signals.unwinding()
    except Stopping as stop:
        _say(f"{stop} received: stopped")
        return 0


def _migrate(settings: Settings) -> int:
    with provision(settings):
        print(f"{PROG}: database is up to date")
    return 0


def _demo(settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        created = load_demo(conn)
    print(
        f"{PROG}: {created} demo libraries loaded"
        if created
        else f"{PROG}: the database already holds an inventory; nothing loaded"
    )
    return 0


def _status(settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        overview = service.queue_overview(conn)
        due = recovery.due_items(conn)
        paused = recovery.admission_paused_seconds(conn)
        cases = recovery.case_overview(conn)
        key = recovery.provider_settings(conn)
        wakeup = credentials.status(conn)
        stats_status = stats.worker_status(conn)
        rollover = stats_maintenance.rollover_overview(conn)
    print(f"dirty libraries      {overview.dirty}")
    print(f"pending requests     {overview.pending} ({overview.claimable} claimable now)")
    print(f"running requests     {overview.running}")
    print(f"failed requests      {overview.failed}")
    oldest = overview.oldest_dirty_since
    print(f"oldest dirty since   {oldest.isoformat() if oldest else '-'}")
    print(f"TMDb key             {'active' if key.usable_key else 'missing or inactive'}")
    print(f"items due to observe {due}")
    if paused > 0:
        print(f"TMDb admission       paused {paused:.0f} s more (TMDb throttled)")
    print(f"open recovery cases  {sum(cases.values())} {cases or ''}".rstrip())
    if wakeup is not None:
        state = "verified" if wakeup.verified else (wakeup.last_outcome or "unverified")
        print(
            f"key generation       {short(wakeup.generation)} ({state}); "
            f"{wakeup.released_total} authentication cases released"
        )
    wait = stats_status.get("oldest_wait_seconds")
    owed_wait = stats_status.get("oldest_owed_seconds")
    print(
        f"stats queue          {stats_status.get('pending_jobs', 0)} pending jobs for "
        f"{stats_status.get('pending_users', 0)} users; oldest wait "
        f"{f'{float(wait):.0f} s' if wait is not None else '-'}; "
        f"{stats_status.get('active_leases', 0)} active, "
        f"{stats_status.get('expired_leases', 0)} expired leases; "
        f"{stats_status.get('completed_last_hour', 0)} completed in the last hour"
    )
    print(
        f"stats freshness      {stats_status.get('stale_users', 0)} users stale; "
        f"{stats_status.get('owed_users', 0)} with an owed range (oldest "
        f"{f'{float(owed_wait):.0f} s' if owed_wait is not None else '-'}); "
        f"{stats_status.get('attempt_exhausted_failures', 0)} exhausted jobs to retry; "
        f"{stats_status.get('backing_off', 0)} runs backing off"
        + ("; worker PAUSED" if (stats_status.get("settings") or {}).get("paused") else "")
    )
    print(
        f"PR overview rollover {rollover.get('due_backlog') or 0} due; "
        f"{rollover.get('failing_users') or 0} failing (max {rollover.get('max_attempts') or 0} "
        f"attempts); oldest success {rollover.get('oldest_success') or '-'}; "
        f"last error {rollover.get('last_error') or '-'}"
    )
    return 0


def _print_notice(result: ObservationResult) -> None:
    notice = recovery.notice(result)
    if notice is not None:
        level, message = notice
        print(f"{PROG}: {level}: {message}", file=sys.stderr if level == "warning" else sys.stdout)


def _observe(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment:
        with connect(deployment.app_url) as conn:
            admission.set_rate(conn, settings.tmdb_rate)
        with TmdbClient(settings.tmdb_base_url) as client:
            summary = recovery.observe(
                lambda: connect(deployment.app_url),
                client,
                RetryPolicy(),
                max_items=args.limit,
                workers=settings.observation_workers,
                on_result=_print_notice,  # as each completion commits
            )
    print(f"observed {summary.observed} of {len(summary.results)}: {summary.by_category or '-'}")
    return 0


def _tmdb_key(args: argparse.Namespace, settings: Settings) -> int:
    """The key comes from standard input (never argv, which other users can read)."""
    if sys.stdin.isatty():
        key = getpass.getpass("TMDb API key: ").strip()
    else:
        key = sys.stdin.readline().strip()
    if not key or any(c.isspace() for c in key) or len(key) > 512:
        raise CliError("the TMDb key must be one non-empty line without spaces")
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        recovery.save_provider_settings(
            conn, ProviderSettings(key, not args.inactive, args.language)
        )
    print(f"{PROG}: TMDb key saved ({'inactive' if args.inactive else 'active'})")
    return 0


def _mark_dirty(settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        marked = service.mark_all_dirty(conn)
    print(f"{PROG}: {marked} libraries marked dirty; the planner queues their refresh")
    return 0


def _refresh(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        run = service.refresh(conn, settings.policy, max_claims=args.limit)
    outcomes = {outcome: n for outcome, n in run.outcomes.items() if n}
    print(f"planned {run.planned}, processed {len(run.completions)}: {outcomes or 'nothing to do'}")
    return 0 if "failed" not in outcomes else 1


def _print_settings(current: WorkerSettings) -> None:
    print(
        f"claim {current.claim_budget_ms} ms, compute {current.compute_budget_ms} ms, "
        f"publish {current.publish_budget_ms} ms; lease {current.lease_seconds} s; "
        f"{current.active_lease_cap} active leases; {current.max_attempts} attempts; "
        f"backoff {current.retry_backoff_seconds} s per attempt; "
        f"{'PAUSED' if current.paused else 'running'}"
    )


def _stats(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        try:
            if args.stats_command == "settings":
                changes = {dest: getattr(args, dest) for _, dest, _, _ in STATS_SETTING_FLAGS}
                if any(value is not None for value in changes.values()):
                    stats_runbook.change_settings(conn, changes)
                _print_settings(stats_runbook.settings(conn))
            elif args.stats_command == "pause":
                stats_runbook.pause(conn)
                print(f"{PROG}: stats worker paused: no claim starts; work in flight finishes")
            elif args.stats_command == "resume":
                stats_runbook.resume(conn)
                print(f"{PROG}: stats worker resumed")
            elif args.stats_command == "retry":
                retried = stats_runbook.retry(conn, args.job_id)
                print(f"{PROG}: job {retried.job_id} retried as job {retried.successor_id}")
            else:
                summary = stats.drain(conn, "cli", max_rounds=args.rounds)
                print(
                    f"published {len(summary.published)} generations, "
                    f"{summary.deferred} deferred, {summary.rejected} rejected, "
                    f"{summary.failed} failed"
                    + ("; the worker is paused" if stats.work_waiting(conn).paused else "")
                )
                return 0 if summary.failed == 0 else 1
        except stats_runbook.RunbookError as exc:
            raise CliError(str(exc)) from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        if args.command == "dev":
            return _dev(args, settings)
        if args.command == "migrate":
            return _migrate(settings)
        if args.command == "demo":
            return _demo(settings)
        if args.command == "status":
            return _status(settings)
        if args.command == "observe":
            return _observe(args, settings)
        if args.command == "tmdb-key":
            return _tmdb_key(args, settings)
        if args.command == "mark-dirty":
            return _mark_dirty(settings)
        if args.command == "stats":
            return _stats(args, settings)
        return _refresh(args, settings)
    except (SettingsError, DatabaseError, CliError, SupervisorError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
