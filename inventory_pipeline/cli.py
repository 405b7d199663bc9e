"""`inventory-pipeline` commands.

The parser is the dispatch table: every command and `stats` action names its handler
with `set_defaults(func=...)`, a function of `(args, settings)` returning the exit
code, and carries a description and an example for its `--help`.

Errors a user can cause (bad URL, unreachable server, missing Dagster home, unknown
option) print one line and exit non-zero; they never show a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeAlias

from inventory_pipeline.credentials import service as credentials
from inventory_pipeline.credentials.models import short
from inventory_pipeline.db import DatabaseError, connect
from inventory_pipeline.db.embedded import psql_command
from inventory_pipeline.demo import apply_merges, load_demo
from inventory_pipeline.deployment import (
    DAEMON_COMMAND,
    INSTANCE_MIGRATE_COMMAND,
    WEBSERVER_COMMAND,
    Deployment,
    prepare_dagster_home,
    provision,
    reach,
)
from inventory_pipeline.leases import service as leases
from inventory_pipeline.leases.models import LeaseOverview
from inventory_pipeline.profiles import service
from inventory_pipeline.provider.standin import StandIn
from inventory_pipeline.recovery import service as recovery
from inventory_pipeline.recovery.models import ProviderSettings
from inventory_pipeline.revalidation import service as revalidation
from inventory_pipeline.revalidation.models import Proposal, ProposalRefused
from inventory_pipeline.settings import (
    DAGSTER_STORAGE_URL,
    DATABASE_URL,
    TMDB_BASE_URL,
    Settings,
    SettingsError,
    TmdbSettings,
)
from inventory_pipeline.stats import maintenance as stats_maintenance
from inventory_pipeline.stats import runbook as stats_runbook
from inventory_pipeline.stats import service as stats
from inventory_pipeline.stats.models import DrainSummary, WorkerSettings
from inventory_pipeline.stats.service import MAX_ROUNDS as STATS_DRAIN_ROUNDS
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
    ("--claim-seconds", "claim_budget_ms", _seconds_ms, "claim statement budget (>= 0.1)"),
    ("--compute-seconds", "compute_budget_ms", _seconds_ms, "compute statement budget (>= 0.1)"),
    ("--publish-seconds", "publish_budget_ms", _seconds_ms, "publish statement budget (0.1-8)"),
    ("--lease-seconds", "lease_seconds", _count, "lease (covers compute + publish)"),
    ("--active-leases", "active_lease_cap", _count, "cap of active leases"),
    ("--max-attempts", "max_attempts", _count, "attempts before a job fails"),
    ("--backoff-seconds", "retry_backoff_seconds", _whole, "retry backoff per attempt"),
)

Handler: TypeAlias = Callable[[argparse.Namespace, Settings], int]
Subparsers: TypeAlias = "argparse._SubParsersAction[_Parser]"


def _examples(examples: Sequence[str]) -> str:
    heading = "Example:" if len(examples) == 1 else "Examples:"
    return "\n".join([heading, *(f"  {PROG} {example}" for example in examples)])


def _command(
    sub: Subparsers,
    name: str,
    summary: str,
    description: str,
    examples: Sequence[str],
    handler: Handler | None,
) -> _Parser:
    """One entry of the dispatch table: `summary` in the command list, `description` and
    `examples` in the command's own --help, `handler` what `main` calls for it."""
    parser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=_examples(examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if handler is not None:
        parser.set_defaults(func=handler)
    return parser


def _stats_parser(sub: Subparsers) -> None:
    stats = _command(
        sub,
        "stats",
        "operate the training stats worker (the runbook)",
        "Operate the training stats worker: show or change its budgets, stop and restart\n"
        "its claims, retry a job that exhausted its attempts, or process queued work once\n"
        "without Dagster. Each action has its own --help.",
        ["stats settings", "stats pause"],
        None,
    )
    actions = stats.add_subparsers(
        dest="stats_command", required=True, parser_class=_Parser, metavar="ACTION"
    )
    settings = _command(
        actions,
        "settings",
        "show or change the worker's budgets",
        "Print the stats worker's settings row: statement budgets, lease, cap of active\n"
        "leases, attempts, retry backoff and the pause switch. With any flag, change those\n"
        "settings first; the table's checks refuse an inconsistent set (each budget at\n"
        "least 0.1 s, publish below 8 s, the lease covering compute + publish) in one line,\n"
        "changing nothing.",
        ["stats settings", "stats settings --compute-seconds 2.5 --lease-seconds 60"],
        _stats_settings,
    )
    for flag, dest, kind, text in STATS_SETTING_FLAGS:
        metavar = "SECONDS" if kind is _seconds_ms else "N"
        settings.add_argument(flag, dest=dest, type=kind, metavar=metavar, help=text)
    _command(
        actions,
        "pause",
        "stop claiming (work in flight finishes; nothing is lost)",
        "Stop the stats worker from claiming: no claim starts (the drain sensor skips, a\n"
        "running drain ends at its next claim) while work in flight finishes. Pending jobs\n"
        "and owed ranges stay queued; `stats resume` picks them up.",
        ["stats pause"],
        _stats_pause,
    )
    _command(
        actions,
        "resume",
        "claim again after a pause",
        "Let the stats worker claim again after `stats pause`.",
        ["stats resume"],
        _stats_resume,
    )
    retry = _command(
        actions,
        "retry",
        "retry a job that exhausted its attempts",
        "Send the range of a job that exhausted its attempts through the queue again as a\n"
        "new job, and print its id. Refused in one line for an unknown job, a job that did\n"
        "not fail, or one already retried.",
        ["stats retry 42"],
        _stats_retry,
    )
    retry.add_argument("job_id", type=_count, help="the failed job's id")
    drain = _command(
        actions,
        "drain",
        "claim, compute and publish once, without Dagster",
        "Claim, compute and publish queued stats work in this process, without Dagster,\n"
        "until no work is claimable or --rounds claims are spent. With --idle it stays:\n"
        "it waits for the database to announce new work and drains again, until nothing\n"
        "was claimed for that many seconds or --lifetime passed, printing a line for\n"
        "what it did at most every 30 s. Exits 1 when a job failed.",
        ["stats drain", "stats drain --rounds 10", "stats drain --idle 600"],
        _stats_drain,
    )
    drain.add_argument(
        "--rounds", type=_count, default=STATS_DRAIN_ROUNDS, help="claims a pass makes at most"
    )
    drain.add_argument(
        "--idle", type=_count, metavar="SECONDS", help="stay while work came within SECONDS"
    )
    drain.add_argument(
        "--lifetime",
        type=_count,
        metavar="SECONDS",
        help="with --idle, end after SECONDS in any case (default 3600)",
    )


def _proposals_parser(sub: Subparsers) -> None:
    proposals = _command(
        sub,
        "proposals",
        "review replacement proposals for unresolved TMDb 404s",
        "Review the replacement identities proposed for unresolved TMDb 404s on\n"
        "corroborated external-id evidence, and approve or reject them. Nothing is\n"
        "applied without approval; an approved item is observed under its new id and the\n"
        "replacement is published for the syncing program (docs/identity-revalidation.md).",
        ["proposals list", "proposals approve 7 9", "proposals reject 8"],
        None,
    )
    actions = proposals.add_subparsers(
        dest="proposals_command", required=True, parser_class=_Parser, metavar="ACTION"
    )
    listing = _command(
        actions,
        "list",
        "list proposals and why other cases got none",
        "List proposals as they stand (by default those awaiting a decision or approved),\n"
        "newest first, with their title and year evidence, then count the checks that\n"
        "proposed nothing by reason.",
        ["proposals list", "proposals list --state all", "proposals list --state rejected"],
        _proposals_list,
    )
    listing.add_argument(
        "--state",
        default="proposed,approved",
        help="comma-separated states (proposed, approved, rejected, superseded) or all",
    )
    listing.add_argument("--limit", type=_count, default=100, help="proposals to list")
    for action, verb in (("approve", "approved"), ("reject", "rejected")):
        decide = _command(
            actions,
            action,
            f"{action} proposals by id",
            f"{action.title()} the proposals named, all or nothing: each must still stand as\n"
            "proposed, else nothing is decided and the first that does not is named.\n"
            + (
                "An approved item is observed under its candidate id at the next observation\n"
                "run; the items table is never written."
                if action == "approve"
                else "A rejected case keeps its id and its ordinary backoff."
            ),
            [f"proposals {action} 7", f"proposals {action} 7 9 --by alice"],
            _proposals_decide,
        )
        decide.set_defaults(decision=verb)
        decide.add_argument("ids", type=_count, nargs="+", metavar="ID", help="proposal ids")
        decide.add_argument("--by", help="who decides (default: the login name)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Keep library profiles, provider observations and training stats fresh\n"
        "from PostgreSQL. Each command has its own --help.",
        epilog=_examples(["dev --demo", "refresh --limit 100", "stats --help"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )
    dev = _command(
        sub,
        "dev",
        "run Dagster (webserver + daemon) on the database",
        "Run the Dagster webserver and daemon on the application database. Without\n"
        "INVENTORY_DATABASE_URL an embedded PostgreSQL is started in the data folder. The\n"
        "databases are created and migrated first. Ctrl-C (or SIGTERM, SIGHUP) stops\n"
        "everything it started. One `dev` runs per data folder and Dagster home.",
        ["dev --demo", "dev --port 3001"],
        _dev,
    )
    dev.add_argument("--demo", action="store_true", help="load the demo inventory first")
    dev.add_argument("--host", default="127.0.0.1", help="webserver address (default loopback)")
    dev.add_argument("--port", type=_port, default=3000, help="webserver port (default 3000)")
    dev.add_argument(
        "--verbose",
        action="store_true",
        help="the daemon's full log (every sensor evaluation); default: warnings and errors",
    )
    _command(
        sub,
        "migrate",
        "apply pending migrations",
        "Create the application and Dagster databases when missing and apply pending\n"
        "migrations. Only `dev` and `migrate` migrate: every other command refuses a\n"
        "database whose schema is behind.",
        ["migrate"],
        _migrate,
    )
    _command(
        sub,
        "status",
        "show the queues, recovery cases and stats freshness",
        "Print what the database holds now: dirty libraries and refresh requests, the TMDb\n"
        "key, items due for observation, admission pauses, open recovery cases, the key\n"
        "generation and its released cases, the stats queue, freshness and PR overview\n"
        "rollover.",
        ["status"],
        _status,
    )
    _command(
        sub,
        "demo",
        "load the demo inventory into an empty database",
        "Load the demo inventory into a migrated database that holds no media server yet;\n"
        "a database that already holds an inventory is left as it is.",
        ["demo"],
        _demo,
    )
    refresh = _command(
        sub,
        "refresh",
        "plan and process refresh work once, without Dagster",
        "Plan refresh requests for dirty libraries, then claim and process up to --limit\n"
        "of them in this process, without Dagster, and print the outcomes. Exits 1 when a\n"
        "request failed.",
        ["refresh", "refresh --limit 100"],
        _refresh,
    )
    refresh.add_argument("--limit", type=_count, default=100, help="claims to process")
    observe = _command(
        sub,
        "observe",
        "observe due items against TMDb once",
        "Observe up to --limit items due for observation against TMDb, without Dagster.\n"
        "Every failure opens or updates the item's recovery case; a warning for each new\n"
        "case goes to standard error as it commits.",
        ["observe", "observe --limit 500"],
        _observe,
    )
    observe.add_argument("--limit", type=_count, default=500, help="items to observe")
    _command(
        sub,
        "mark-dirty",
        "mark every library dirty (after writes that fired no trigger)",
        "Advance every library's revision once so that the planner refreshes them all.\n"
        "Run it after writes that fired no trigger: a restore with triggers disabled or a\n"
        "logical-replication apply (session_replication_role = replica).",
        ["mark-dirty"],
        _mark_dirty,
    )
    key = _command(
        sub,
        "tmdb-key",
        "save the TMDb API key, read from standard input",
        "Save the TMDb API key, read from standard input (a prompt on a terminal), never\n"
        "from the command line, which other users can read. Dagster's credential wakeup\n"
        "verifies a new key once before it releases the cases waiting for it.",
        [
            "tmdb-key --language en-US",
            "tmdb-key --inactive < key.txt",
        ],
        _tmdb_key,
    )
    key.add_argument(
        "--language", type=_language, help="TMDb language, e.g. en-US (default: the saved one)"
    )
    key.add_argument("--inactive", action="store_true", help="save it but keep it inactive")
    _stats_parser(sub)
    _proposals_parser(sub)
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
    children.run("dagster instance migrate", [*INSTANCE_MIGRATE_COMMAND], env, timeout=300)
    # The daemon logs every sensor evaluation at INFO (a line every few seconds per
    # sensor); a person reads `dev`'s terminal, so warnings and errors only unless asked.
    quiet = [] if args.verbose else ["--log-level", "warning"]
    children.start("daemon", [*DAEMON_COMMAND, "run", *quiet, *location], env)
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
    if settings.database_url is None:
        # How to reach the embedded server (a local socket, user postgres, no password).
        _say(f"embedded PostgreSQL: {psql_command(deployment.app_url)}")
    if args.demo:
        # The demo observes a local TMDb stand-in: no internet, faults switchable.
        standin = stack.enter_context(StandIn(api_key=DEMO_KEY, missing_every=17))
        apply_merges(standin)  # a few demo items TMDb merged away: proposals to review
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


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    with provision(settings):
        print(f"{PROG}: database is up to date")
    return 0


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        created = load_demo(conn)
    print(
        f"{PROG}: {created} demo libraries loaded"
        if created
        else f"{PROG}: the database already holds an inventory; nothing loaded"
    )
    return 0


STATUS_CASES = 5  # oldest open recovery cases `status` lists


def _status(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        overview = service.queue_overview(conn)
        due = recovery.due_items(conn)
        paused = recovery.admission_paused_seconds(conn)
        cases = recovery.case_overview(conn)
        oldest_cases = recovery.oldest_open_cases(conn, STATUS_CASES)
        proposal_states = revalidation.overview(conn, limit=1).states
        key = recovery.provider_settings(conn)
        wakeup = credentials.status(conn)
        stats_status = stats.worker_status(conn)
        rollover = stats_maintenance.rollover_overview(conn)
        lapses = leases.overview(conn)
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
    for case in oldest_cases:
        label = recovery.item_label(case.title, case.provider_kind, case.provider_id)
        next_at = case.next_attempt_at
        print(
            f"  item {case.item_id} {label} in {recovery.bounded(case.library, 40)}: "
            f"{case.category}, {case.attempts} attempts, next "
            f"{next_at.isoformat(timespec='seconds') if next_at else '-'}"
        )
    if proposal_states:
        print(f"replacement proposals {proposal_states}")
    if wakeup is not None:
        state: str = "verified" if wakeup.verified else (wakeup.last_outcome or "unverified")
        if state == "unverified" and wakeup.auth_cases == 0:
            state = "unverified: probed only when authentication cases wait for it"
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
    for line in lease_lines(lapses):
        print(line)
    return 0


def drain_owner() -> str:
    """The lock owner a command-line drain claims as: which host and process, so that
    `status` can say whose lease lapsed."""
    return f"cli:{socket.gethostname()}:{os.getpid()}"


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()) if n) or "none"


def lease_lines(lapses: LeaseOverview) -> list[str]:
    """Which leases ran out before their holder finished and who took the work back
    (the last hour's, latest first), and which have run out and wait to be taken."""
    hours = lapses.window_seconds // 3600
    lines = [
        f"lapsed leases        {sum(lapses.lapsed.values())} taken back in the last "
        f"{'hour' if hours == 1 else f'{hours} hours'}: {_counted(lapses.lapsed)}; "
        f"run out, not yet taken back: {_counted(lapses.expired)}"
    ]
    for lease in lapses.latest:
        taken = {
            "taken": f"taken by {lease.taken_by}",
            "requeued": "back in the queue",
            "restarted": "its job restarted under a new run",
            "failed": "failed for good (it was the last attempt)",
        }[lease.outcome]
        lines.append(
            f"  {lease.taken_at:%H:%M:%S} {lease.kind} {lease.work}: lease of "
            f"{lease.holder or '-'} ran out {lease.lapsed_at:%H:%M:%S}, {taken}"
        )
    return lines


def _print_notice(level: str, message: str) -> None:
    print(f"{PROG}: {level}: {message}", file=sys.stderr if level == "warning" else sys.stdout)


def _observe(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment:
        tmdb = TmdbSettings(
            settings.tmdb_base_url, settings.tmdb_rate, settings.observation_workers, args.limit
        )
        summary = recovery.observe_due(deployment.app_url, tmdb, _print_notice)
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


def _mark_dirty(args: argparse.Namespace, settings: Settings) -> int:
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


def _stats_settings(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        changes = {dest: getattr(args, dest) for _, dest, _, _ in STATS_SETTING_FLAGS}
        if any(value is not None for value in changes.values()):
            stats_runbook.change_settings(conn, changes)
        _print_settings(stats_runbook.settings(conn))
    return 0


def _stats_pause(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        stats_runbook.pause(conn)
    print(f"{PROG}: stats worker paused: no claim starts; work in flight finishes")
    return 0


def _stats_resume(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        stats_runbook.resume(conn)
    print(f"{PROG}: stats worker resumed")
    return 0


def _stats_retry(args: argparse.Namespace, settings: Settings) -> int:
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        retried = stats_runbook.retry(conn, args.job_id)
    print(f"{PROG}: job {retried.job_id} retried as job {retried.successor_id}")
    return 0


def _drain_line(summary: DrainSummary) -> str:
    return (
        f"published {len(summary.published)} generations, "
        f"{summary.deferred} deferred, {summary.rejected} rejected, "
        f"{summary.failed} failed, {summary.lost} lost, {summary.interrupted} interrupted"
    ) + (f"; claiming failed: {summary.claim_error}" if summary.claim_error else "")


def _stats_drain(args: argparse.Namespace, settings: Settings) -> int:
    if args.lifetime is not None and args.idle is None:
        raise CliError("--lifetime needs --idle: a drain without it ends when idle")
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        if args.idle is None:
            summary = stats.drain(conn, drain_owner(), max_rounds=args.rounds)
        else:
            reports: list[DrainSummary] = []

            def report(done: DrainSummary) -> None:
                reports.append(done)
                print(_drain_line(done), flush=True)

            end = stats.keep_draining(
                conn,
                drain_owner(),
                idle_seconds=args.idle,
                lifetime_seconds=args.lifetime or 3600,
                report=report,
                max_rounds=args.rounds,
            )
            summary = sum(reports, DrainSummary(()))
            ended = {"lifetime": "lifetime over", "paused": "paused", "idle": "idle"}[end]
            print(f"ended: {ended}; in all:", end=" ")
        paused = stats.work_waiting(conn).paused
    print(_drain_line(summary) + ("; the worker is paused" if paused else ""))
    return 0 if summary.failed == 0 and summary.claim_error is None else 1


def _proposal_line(p: Proposal) -> str:
    state = p.state + ("/replaced" if p.replaced_at else "")
    titles = f'"{p.source_title}" = "{p.candidate_title}"'
    if p.candidate_original_title and p.candidate_original_title != p.candidate_title:
        titles += f' (original "{p.candidate_original_title}")'
    return (
        f"{p.id:<6} {state:<17} {p.item_id:<8} {(p.library or '-')[:20]:<20} "
        f"{p.provider_kind:<5} {p.old_tmdb_id:<10} {p.candidate_tmdb_id:<10} "
        f"{p.source_year}~{p.candidate_year:<6} {p.age_seconds // 3600:>4} h  {titles}"
    )


def _proposals_list(args: argparse.Namespace, settings: Settings) -> int:
    states = revalidation.parse_states(args.state)
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        listed = revalidation.proposals(conn, states, args.limit)
        view = revalidation.overview(conn, limit=1)
    if listed:
        print(
            f"{'ID':<6} {'STATE':<17} {'ITEM':<8} {'LIBRARY':<20} {'KIND':<5} {'OLD':<10} "
            f"{'CANDIDATE':<10} {'YEAR':<11} {'AGE':>6}  TITLE"
        )
        for p in listed:
            print(_proposal_line(p))
    else:
        print(f"no proposals {', '.join(states)}")
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(view.reasons.items()))
    print(
        f"{sum(view.reasons.values())} cases with no proposal ({reasons or '-'}); "
        f"{view.due} due for revalidation"
    )
    return 0


def _operator(args: argparse.Namespace) -> str:
    if args.by is not None:
        return str(args.by)
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        raise CliError("no login name to record the decision with: pass --by NAME") from None


def _proposals_decide(args: argparse.Namespace, settings: Settings) -> int:
    approve = list(args.ids) if args.decision == "approved" else []
    reject = list(args.ids) if args.decision == "rejected" else []
    with reach(settings) as deployment, connect(deployment.app_url) as conn:
        decided = revalidation.decide(conn, approve, reject, _operator(args))
    for d in decided:
        then = (
            f"TMDb {d.old_tmdb_id} -> {d.candidate_tmdb_id}; observed under the new id at the "
            "next observation run"
            if d.state == "approved"
            else f"keeps TMDb {d.old_tmdb_id} and its ordinary backoff"
        )
        print(f"{PROG}: proposal {d.proposal_id} {d.state} (item {d.item_id}: {then})")
    return 0


# Refusals a user can cause: one line on standard error, exit 1.
USER_ERRORS = (
    SettingsError,
    DatabaseError,
    CliError,
    SupervisorError,
    stats_runbook.RunbookError,
    ProposalRefused,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, read the settings, then call the handler the chosen (sub)command set."""
    args = _parser().parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args, Settings.from_env())
    except USER_ERRORS as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
