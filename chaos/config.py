"""Every knob and every bound of the harness, in one place.

Clocks are shortened (leases of seconds, retries of seconds) so lost claims, expiries
and retries all happen inside a short run; everything else is the product's own code
and SQL. The bounds turn a livelock into a failure: each was chosen from measured runs
(docs/chaos.md) with a generous margin, and says why.
"""

from __future__ import annotations

from inventory_pipeline.profiles.models import RefreshPolicy
from inventory_pipeline.recovery.policy import RetryPolicy
from inventory_pipeline.settings import TmdbSettings

LEASE_SECONDS = 3

PROFILE_POLICY = RefreshPolicy(
    lease_seconds=LEASE_SECONDS,
    retry_seconds=1,
    circuit_probe_seconds=2,
    native_max_age_seconds=10**7,  # native refreshes would only add noise
    run_claims=10,
)

RETRY_POLICY = RetryPolicy(
    transient_base_seconds=1,
    slow_base_seconds=2,
    cap_seconds=6,
    floor_seconds=1,
    refresh_seconds=30 * 86400,  # a success is not re-observed during the run
    interrupted_seconds=3,
)

# The one settings row's budgets (docs/training-stats.md#settings), shortened; the lease
# still covers both budgets and
# attempts are plentiful so that kills alone never exhaust a job.
STATS_SETTINGS = {
    "claim_budget_ms": 2000,
    "compute_budget_ms": 1500,
    "publish_budget_ms": 1500,
    "lease_seconds": LEASE_SECONDS,
    "active_lease_cap": 3,
    "max_attempts": 1000,
    "retry_backoff_seconds": 1,
}

API_KEY = "chaos-key-0b1d2c3e4f"
WRONG_KEY = "chaos-wrong-key-9a8b7c"

# -- credential wakeups (docs/credentials.md) -------------------------------------------
# The batch limit stays the product's 100 (the check is that no batch exceeds it); the
# spacing (60 s) and the failed-probe backoff (15 min to 6 h) are shortened so several
# batches and re-probes happen within a run.
WAKEUP_RELEASE_LIMIT = 100
WAKEUP_SPACING_SECONDS = 2
WAKEUP_BACKOFF_SECONDS = (1, 4)
# One release cycle: a case the release must take is taken within two batch spacings
# (the cursor may have to wrap first) and a second of sampling.
LATE_AUTH_RELEASE_SECONDS = 2 * WAKEUP_SPACING_SECONDS + 1
# Authentication cases loaded at setup and again at this fraction of the run: more than
# one batch, so the spacing is tested.
AUTH_BACKLOG_CASES = 130
AUTH_BACKLOG_AT = 0.5
# The chaos begins once the setup's backlog went out in two batches (one spacing after
# the first verification), or after this long.
WAKEUP_WARMUP_SECONDS = 30
# The release jitter (1-60 s, fixed in SQL by `release_batch`) is the longest legitimate wait
# of a released case.
RELEASE_JITTER_SECONDS = 60

# The provider admission rate under the chaos: the product's default, in requests a
# second across every process (the Dagster runs set it too). The stand-in may count at
# most ADMISSION_MARGIN times as many arrivals in one wall-clock second: the limiter
# admits within a sliding second, and a loaded machine delays a request between its
# admission and its arrival.
ADMISSION_RATE = TmdbSettings.rate
ADMISSION_MARGIN = 1.25

# -- the workload and its faults --------------------------------------------------------
# Stats workers: two stepping through claim/compute/publish by hand, two drains kept
# alive (the drain op's own path) running at once. Three refreshers: each stalls past its lease
# on 15 % of its generations (3-4.5 s asleep), so two took at most ~3.5 claims a second,
# and a run that truncated nothing (every library kept its rows, the observers' captures
# dirtying them again) kept a library dirty past the bound below (194-244 s, 3 runs of 5).
WORKERS = {
    "planner": 2,
    "refresher": 3,
    "observer": 2,
    "prober": 1,
    "revalidator": 2,
    "stats": 2,
    "drainer": 2,
    "maintainer": 1,
}
# A drainer is a drain kept alive, as the sensor launches one, with short limits so that
# each one ends and starts again many times a run (a kill lands in every part of it).
DRAINER_IDLE_SECONDS = 3.0
DRAINER_LIFETIME_SECONDS = 20.0
DRAINER_RECHECK_SECONDS = 1.0
OPS_PER_SECOND = 8
KILL_CHANCE = 0.04  # per operation: SIGKILL a worker process (restarted at once)
PAUSE_CHANCE = 0.012  # SIGSTOP a worker past its lease
TERMINATE_CHANCE = 0.02  # pg_terminate_backend of one worker's session
# SIGKILL or terminate a stats worker that holds a live claim, inside a transaction when
# one is caught there (the harness looks a few times, a few milliseconds apart).
CLAIM_KILL_CHANCE = 0.025
CLAIM_KILL_LOOKS = 20
PAUSE_SECONDS = LEASE_SECONDS + 1.5  # outlives the lease
# Every enabled fault fires at least once a run, or the run fails "fault not exercised":
# a kill, pause or termination not drawn by this fraction of the run's operations fires
# then, and a claim-holder kill not drawn by then is tried on every operation after it
# until one finds a stats worker holding a live claim.
FAULTS_OWED_AT = 0.35
# Database restarts, at these fractions of the run's operations (when the server can be
# restarted: an embedded or private cluster, or a restart command given explicitly).
RESTART_AT = (0.6,)
# The backlog phase: this many libraries turn dirty in one go at this fraction of the
# run, more than one sensor tick's run capacity (4 runs x 100 claims, two at a time).
BACKLOG_AT = 0.25
BACKLOG_LIBRARIES = 450
BACKLOG_ITEMS = 3  # per library: enough for a profile, cheap to generate
# A throttle storm: the stand-in answers 429 to everything for this many operations,
# once at this fraction of the run (and now and then as a drawn operation).
STORM_AT = 0.45
STORM_OPERATIONS = 40  # 5 s at 8 operations/s
STORM_RETRY_AFTER = "2"
STORM_ITEMS = 30  # a sync brings this many items due for observation as the storm starts

# -- merges at TMDb and the operator's gate (docs/identity-revalidation.md) --------------
# The stand-in folds observed records into survivors: at these fractions of the run this
# many at once (deletes and truncates take many merged items before their cases are
# checked), owed until observed records exist (faults and wrong keys may keep the
# provider from observing any for most of a run; what is still owed is merged after the
# first quiescence), then now and then as a drawn operation. Most variants must be proposed; the
# others break one corroboration rule each (a survivor naming its own external ids, a
# lookup naming two records, a survivor of another title or year).
MERGE_AT = (0.2, 0.5, 0.8)
MERGES_AT_ONCE = 8
MERGE_VARIANTS = (
    ("corroborated", 6),
    ("round_trip", 1),
    ("ambiguous", 1),
    ("title", 1),
    ("year", 1),
)
# The hourly revalidation budget of the revalidator workers: the most the product allows
# (a refused check re-runs after every failure, seconds apart under the harness's clocks).
REVALIDATIONS_PER_HOUR = 3600

# -- the stats side ----------------------------------------------------------------------
# Users with more candidate exercises than one compute batch (100), so every full-history
# or import-sized range runs the batched path (preparation, batches, finalization in
# separate transactions); their sessions are edited while those batches run.
LARGE_USERS = 2
LARGE_EXERCISES = 120
LARGE_IMPORT_SESSIONS = 3  # at setup, each holding every one of the large exercises
SMALL_USERS = 6
# Exhausted attempts: for this many operations from this fraction of the run (and now
# and then as a drawn operation) the attempt cap drops to 2 or 3, with the compute
# budget at its floor, 100 ms (a large account's batches run out of it: always at the
# fixed point, half the time when drawn), or untouched (edits during a large account's
# batches invalidate its attempts); then both are restored.
SQUEEZE_AT = 0.55
SQUEEZE_OPERATIONS = 80  # 10 s at 8 operations/s
SQUEEZED_ATTEMPTS = (2, 3)
SQUEEZED_COMPUTE_BUDGET_MS = 100
# A publication that waits for its user's state row (an application's transaction around
# a save, an import, holds it): at these fractions of the run (and now and then as a
# drawn operation) a large account imports a session, and an application transaction
# then holds the user's row; the publication that waits for it is cancelled by an
# operator at the first fixed point and held past its budget at the second (drawn:
# either). Each ends the publication's call; the run must be given back, its slot free.
# A budget squeeze in progress ends first, and no drawn one starts in the
# LOCK_WAIT_CALM_OPERATIONS that follow (counted in operations, so that a seed replays
# the same operations whatever the threads' timing): no compute would reach its
# publication.
PUBLICATION_LOCK_WAIT_AT = (0.15, 0.4)
# A sync program holds an item being observed (an uncommitted write of it) past the
# observation's completion tries (3 x the 2 s lock timeout): at these fractions of the
# run, after the publication lock waits and the server restart (a hold across the restart
# is cut short; one beside a lock wait kept its publication from being found). The hold
# begins once an observer asks for the item, whose answer the stand-in keeps until the
# sync's write is made; no profile claim holds the library then. The completion is
# interrupted and the item given back, once the sync commits, due
# RETRY_POLICY.interrupted_seconds later; nobody may send it again sooner. The harness's
# 3 s lease is shorter than those tries, production's five minutes far longer: the held
# claims' leases are lengthened as production's would cover them. The sync commits after
# HOLD_PAST_TRIES_SECONDS; the give-back is waited for LIBRARY_HOLD_SECONDS.
LIBRARY_HOLD_AT = (0.7, 0.9)
LIBRARY_HOLD_SECONDS = 9.5
# Holds tried per fixed point, each of another library, until one interrupts; each
# waits this long for an observer to ask for its item (a throttle pause or a key's
# verification may come first).
HOLD_ATTEMPTS = 3
HOLD_ASK_SECONDS = 20
# How long the sync holds the item: past the completion's three 2 s lock timeouts.
HOLD_PAST_TRIES_SECONDS = 7.5
LIBRARY_HOLD_LEASE_SECONDS = 10
# The stand-in gzip-codes its answers from this fraction of the run, for at least
# KEPT_FAULT_OPERATIONS operations (and as a drawn fault); each must be read as if uncoded.
COMPRESS_AT = 0.1
KEPT_FAULT_OPERATIONS = 24
# How many operations more a kept fault stays while no answer has carried it.
KEPT_FAULT_MAX_EXTRA = 160
# The stand-in answers with a nested gzip bomb (a few KiB that decode to 256 MiB) from this
# fraction of the run, as the compression above (and as a drawn fault): each
# must end as an invalid_response without an observer's memory growing past
# OBSERVER_MEMORY_GROWTH_MIB.
BOMB_AT = 0.2
# What an observer's process may hold above its size when it started: its answers are at
# most 64 KiB decoded, so a nested-gzip bomb decoded without bound passes this at once.
OBSERVER_MEMORY_GROWTH_MIB = 64
# An operator cancels a stats worker's stage call in flight: at this fraction of the run
# and as a drawn operation. A stage of a small account lasts a few milliseconds, so the
# operator watches for one for up to CANCEL_LOOK_SECONDS, beside the operations; the
# held user's publication is looked for as long (a large account's batches come first).
CANCEL_AT = 0.2
CANCEL_LOOK_SECONDS = 10.0
LOCK_WAIT_LOOK_SECONDS = 10.0
LOCK_WAIT_CALM_OPERATIONS = 80
# An operator's rebuild of every user, issued beside the writes (its own connection);
# before the squeeze, so that it cannot cover the ranges the squeeze makes fail.
REBUILD_AT = 0.3
# One user's sessions are all deleted here and no session is saved for it afterwards:
# the comparisons must find nothing left of them.
EMPTY_USER_AT = 0.7

# -- the Dagster path ------------------------------------------------------------------
# The daemon's refresh runs use the product's settings from the environment: the
# shortest lease the product accepts and the harness's retry and circuit clocks.
DAEMON_ENV = {
    "INVENTORY_LEASE_SECONDS": "10",
    "INVENTORY_RETRY_SECONDS": "1",
    "INVENTORY_CIRCUIT_PROBE_SECONDS": "2",
    "INVENTORY_NATIVE_MAX_AGE_SECONDS": str(10**7),
}
# Before the chaos begins, the daemon alone processes the setup's inventory and stats
# until its runs have acknowledged a request and published stats (measured 13-25 s from
# a cold start; the drain publishes with the first refresh), so every run has
# Dagster-path work; past this it goes on without (the checks will say why).
DAEMON_FIRST_ACK_SECONDS = 90
# Sensors kept stopped: their clocks are constants no variable sets, and they break
# the harness's checks; the harness's own workers cover them.
# - provider_observation_sensor: the job observes with a five-minute item lease
#   (recovery/service.py LEASE_SECONDS) and the default RetryPolicy (recovery/policy.py:
#   6 h / 1 day backoffs, 300 s floor; defs/observation.py passes none), so every failure
#   it records (every 17th id is missing at the stand-in) leaves a case due in a day,
#   which `nothing_stuck` fails (61 s bound); its completions declare no token, which
#   `no_lost_claim_acknowledged` reports as "not its latest claim".
# - credential_wakeup_sensor: a 60 s tick (defs/credentials.py), a 60 s probe lease, a
#   15 min to 6 h failed-probe backoff and a 60 s release spacing
#   (credentials/service.py; the job passes none). The backoff is stored with the
#   generation, so one Dagster probe meeting the storm or a provider fault stops every
#   prober's verification for the rest of the run; `wakeups` reports a verification
#   that declared no token as "by a worker without the lease".
# - identity_revalidation_sensor: a 300 s claim lease and the same 6 h / 1 day fault
#   backoffs, so a revalidation run caught by the restart, or meeting the throttle storm
#   or a provider fault, would leave its merged case unproposed past quiescence. It ran
#   in six measured runs without harm, but never checked a case (the harness's two
#   revalidators take each within a poll): stopped rather than a rare flake.
DAEMON_STOPPED_SENSORS = (
    "provider_observation_sensor",
    "credential_wakeup_sensor",
    "identity_revalidation_sensor",
)
# The least a run's Dagster runs must do, by what `Daemon.share` counts. Measured
# (2026-12-06, private PG15, seeds 4242 at 45 s x4 and 20261130 at 40 s x2):
# - profile acknowledgements: 11-580 (of 168-1206 in all), 7 of them the setup's
#   libraries before the chaos. Most come from the backlog phase: a run whose backlog
#   went another way leaves Dagster a few (seed 4242 once: 11 of 168, its 455 dirty
#   libraries gone within 18 s, 2 servers deleted). Only the warm-up's share is sure,
#   hence 1: a warm-up that timed out, or a daemon that did nothing, fails.
# - stats publications: 8-9, all but one the setup's 8 users in the warm-up (0 in both
#   runs whose warm-up waited for an acknowledgement only): once the harness's 4 stats
#   workers run they claim each job within a poll, before a drain run has started, and
#   Dagster's drains find 0 users. Hence 1.
# - revalidation checks: 0 in every run: no case exists before the chaos and the
#   harness's 2 revalidators take each within a poll, while the sensor ticks every 30 s
#   ("no cases due for revalidation" on every tick). Counted, not required.
DAGSTER_MIN_SHARE = {
    "profile acknowledgements": 1,
    "stats publications": 1,
    "revalidation checks": 0,
}
# A Dagster run may fail only inside an injected fault's window (a server restart),
# widened by this on each side: a client notices a restart late. Measured: 0-2 refresh
# runs failed per run (5 of 6), each in the restart (its storage connection closed, or
# "marked as failed from outside the execution context"), ending 0.1-0.7 s after it.
DAGSTER_FAULT_MARGIN_SECONDS = 1.0

# -- errors ----------------------------------------------------------------------------
# What a worker may meet under chaos and recover from, by SQLSTATE: lock not available,
# statement timeout / query canceled, idle-in-transaction timeout, administrator
# shutdown, crash shutdown, cannot connect now (a restart); class 08 is connection
# exceptions. Anything else (40P01 deadlocks, 23xxx, 42xxx, ...) fails the run.
EXPECTED_SQLSTATES = frozenset({"55P03", "57014", "25P03", "57P01", "57P02", "57P03"})
EXPECTED_SQLSTATE_CLASSES = ("08",)
# Errors with no SQLSTATE that are expected: a connection the client itself found
# refused or dropped, and no admission slot in time.
EXPECTED_WITHOUT_SQLSTATE = frozenset({"DatabaseUnavailable", "AdmissionTimeout"})

# The database errors each product path may record in a row as an attempt's failure,
# by SQLSTATE. A profile attempt records none: every error the harness injects ends
# the session (raised, the lease recovers the claim). A stats run records a compute or
# publish statement budget spent (57014, the budget squeeze) and a rejection for a
# canonical row deleted under it (23503). A guard's own refusal (the stats lease
# fence's LEASE) is on no list: recorded or raised, it fails the run.
EXPECTED_RECORDED_SQLSTATES: dict[str, frozenset[str]] = {
    "profile refresh attempt": frozenset(),
    "stats run": frozenset({"57014", "23503"}),
}

# -- bounds on progress (a livelock fails the run) ----------------------------------------
# Quiescence after the chaos: measured 20-135 s (the longest after a truncate late in
# the run dirtied ~600 libraries at once); waiting longer is a failure, not patience.
MAX_QUIESCE_SECONDS = 240
# A library active and dirty for longer than this without an acknowledgement (one
# overtaken by a newer change counts: observations land on a library's items one by one
# after the backlog, each a new revision): measured 30-112 s (the backlog phase, a
# truncate, the restart). Counted from the library's last dirty episode alone, a run
# whose backlog stayed (no truncate after it) measured 131-188 s: a library acknowledged
# every pass was still dirty, overtaken by the next observation.
MAX_DIRTY_SECONDS = 180
# ... and longer on a machine that acknowledges slower: three times the time the largest
# dirty set the run saw takes to drain at the best rate the run acknowledged over any
# ACK_RATE_WINDOW_SECONDS (the bound follows the measured load; one library starved
# while others are acknowledged still fails it). Three passes of the queue: a refresh
# whose generation stalls past its lease (15 %) goes back behind every other dirty
# library (its retry is due later than their requests), so of ~450 libraries about ten
# stall twice in a row and wait a third pass. Under load the flat bound tripped at 213 s
# with unmutated code, and twice the drain time at 188 s against 184 s.
DIRTY_DRAIN_MARGIN = 3.0
ACK_RATE_WINDOW_SECONDS = 30
# Worker processes that exited on their own (the harness restarts them): a worker
# catches every error and reconnects, so an exit is a crash.
MAX_UNPLANNED_EXITS = 0
# Error lines (each one a worker loop restarted on a fresh connection) per minute of
# chaos: kills, pauses, terminations and the restart cause a few dozen in a minute.
MAX_WORKER_ERRORS_PER_MINUTE = 120
# Re-claims (claims beyond the first of each request) as a share of all claims: kills,
# pauses and stalls past the lease cost ~20 %.
MAX_RECLAIM_SHARE = 0.5
# Requests that ended terminally failed (and wait for the circuit to re-plan them):
# three lost attempts in a row are rare under the harness's fault rates.
MAX_TERMINAL_FAILURES = 12
# Requests to the stand-in while it answers 429 to everything, per storm: with a
# fleet-wide pause this is what was already in flight plus one retry per worker per
# Retry-After; without one it is the observers' whole batch.
MAX_STORM_REQUESTS = (WORKERS["observer"] + WORKERS["prober"]) * (
    STORM_OPERATIONS // OPS_PER_SECOND // int(STORM_RETRY_AFTER) + 3
)
