"""The guards the product's correctness rests on, as data: where each is (a file and its
exact text), what it becomes when removed, what it protects, and the deterministic
tests that fail without it. `python -m chaos.mutations` removes them one at a time.

A guard whose removal no interleaving can observe, because another guard already
refuses the same write, names that other guard in `shadowed_by`: it is defence in depth
and is kept, but not scored. docs/chaos.md#guards lists them with the last score.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Guard:
    name: str
    path: str  # from the repository's root
    text: str  # occurs exactly once in the file
    removed: str  # what the text becomes without the guard
    protects: str
    tests: tuple[str, ...]
    shadowed_by: str | None = None
    # Further (path, text, removed) edits, for a guard written in several places that
    # only together protect (each place alone is the others' depth).
    more: tuple[tuple[str, str, str], ...] = ()

    @property
    def edits(self) -> tuple[tuple[str, str, str], ...]:
        """Every (path, text, removed) edit that removes the guard."""
        return ((self.path, self.text, self.removed), *self.more)


PROFILE_QUERIES = "inventory_pipeline/profiles/queries.sql"
RECOVERY_QUERIES = "inventory_pipeline/recovery/queries.sql"
CREDENTIAL_QUERIES = "inventory_pipeline/credentials/queries.sql"
REVALIDATION_QUERIES = "inventory_pipeline/revalidation/queries.sql"
ADMISSION_QUERIES = "inventory_pipeline/provider/admission.sql"
# The stats functions as the database runs them: the migration that last defined each
# (a scratch database is built from migrations/; tests/unit/test_guards.py checks that
# no later migration defines the guarded text again).
STATS_WORKER = "migrations/0026_stats_simple_worker.sql"  # stats_renew_lease
STATS_STAGES = "migrations/0030_recorded_error_sqlstate.sql"  # the claim and the fence
STATS_STEPS = "migrations/0033_stats_interrupted_stage_given_back.sql"  # compute, publish

# The three checks of a stats lease's end: the compute's, the renewal's (from the lease's
# slot row), the publication's.
COMPUTE_CHECK = "    ELSIF run.lease_until <= now() THEN"
RENEW_CHECK = "    WHERE run_id = p_run_id AND lease_until > now()\n    FOR UPDATE;"
PUBLISH_CHECK = (
    "      AND r.phase = 'computed' AND r.lease_until > now() AND r.retry_not_before IS NULL"
)

# Why a stats stage's token check has no effect of its own: the caller names the run.
RUN_IDENTITY = (
    "the run id (a run keeps one lease token for life, a resume included; a takeover"
    " retires the run and starts a new one, so a stale worker's run id names its own token)"
)

PROFILE_TESTS = ("tests/db/test_refresh.py", "tests/db/test_interleavings.py")
RECOVERY_TESTS = ("tests/db/test_observation.py", "tests/db/test_observation_locks.py")
CREDENTIAL_TESTS = ("tests/db/test_credentials.py",)
REVALIDATION_TESTS = (
    "tests/db/test_revalidation.py",
    "tests/db/test_revalidation_interleavings.py",
)
STATS_TESTS = (
    "tests/db/test_stats_leases.py",
    "tests/db/test_stats_worker.py",
    "tests/db/test_stats_generations.py",
)

GUARDS: tuple[Guard, ...] = (
    Guard(
        "profile_completion_token",
        PROFILE_QUERIES,
        "      AND r.lease_token = %(lease_token)s\n      AND r.lease_expires_at > held.at",
        "      AND r.lease_expires_at > held.at",
        "a completion acknowledges and publishes only under the live claim's token",
        ("tests/db/test_refresh.py::test_lost_claim_acknowledges_nothing",),
    ),
    Guard(
        "profile_completion_expiry",
        PROFILE_QUERIES,
        "      AND r.lease_token = %(lease_token)s\n      AND r.lease_expires_at > held.at",
        "      AND r.lease_token = %(lease_token)s",
        "a completion after its lease ended publishes nothing (the planner may requeue it)",
        ("tests/db/test_refresh.py::test_expired_but_unclaimed_lease_cannot_complete",),
    ),
    Guard(
        "profile_completion_clock",
        PROFILE_QUERIES,
        "      AND r.lease_expires_at > held.at",
        "      AND r.lease_expires_at > now()",
        "a completion that waited for its library past its lease publishes nothing",
        (
            "tests/db/test_refresh.py::"
            "test_a_completion_that_waited_for_its_library_past_its_lease_is_lost",
        ),
    ),
    Guard(
        "profile_failure_token",
        PROFILE_QUERIES,
        "WHERE r.id = %(request_id)s AND r.status = 'running' AND r.lease_token = %(lease_token)s",
        "WHERE r.id = %(request_id)s AND r.status = 'running'",
        "only the live claim records a failed attempt",
        ("tests/db/test_refresh.py::test_a_lost_claims_failure_leaves_the_live_claim_alone",),
    ),
    Guard(
        "profile_acknowledged_greatest",
        PROFILE_QUERIES,
        "    SET acknowledged_revision = GREATEST(s.acknowledged_revision,"
        " done.inventory_revision),",
        "    SET acknowledged_revision = done.inventory_revision,",
        "the acknowledged revision never goes back (an analyst's backfill planned earlier"
        " carries an older revision)",
        ("tests/db/test_refresh.py::test_acknowledgement_never_moves_backwards",),
    ),
    Guard(
        "profile_publish_newer",
        PROFILE_QUERIES,
        "    WHERE p.inventory_revision <= EXCLUDED.inventory_revision\n",
        "\n",
        "an older snapshot never overwrites a newer profile",
        PROFILE_TESTS,
        shadowed_by="profile_refresh_requests_one_active (each later completion read a"
        " snapshot at least as new)",
    ),
    Guard(
        "observation_completion_token",
        RECOVERY_QUERIES,
        "      AND observation_lease_token = %(lease_token)s\n"
        "      AND source_generation = %(source_generation)s\n"
        "      AND library_id = %(library_id)s",
        "      AND source_generation = %(source_generation)s\n"
        "      AND library_id = %(library_id)s",
        "only the live observation claim saves its result",
        (
            "tests/db/test_observation.py::test_killed_worker_lease_expires_and_old_token_is_rejected",
        ),
    ),
    Guard(
        "observation_completion_generation",
        RECOVERY_QUERIES,
        "      AND observation_lease_token = %(lease_token)s\n"
        "      AND source_generation = %(source_generation)s\n"
        "      AND library_id = %(library_id)s",
        "      AND observation_lease_token = %(lease_token)s\n"
        "      AND library_id = %(library_id)s",
        "an observation of an older source is never saved",
        RECOVERY_TESTS,
        shadowed_by="observation_completion_token (a source change clears the lease token"
        " in the same row, advance_source_generation)",
    ),
    Guard(
        "observation_failure_token",
        RECOVERY_QUERIES,
        "    WHERE id = %(item_id)s\n"
        "      AND observation_lease_token = %(lease_token)s\n"
        "      AND source_generation = %(source_generation)s\n"
        "    FOR UPDATE\n",
        "    WHERE id = %(item_id)s\n      AND source_generation = %(source_generation)s\n"
        "    FOR UPDATE\n",
        "only the live observation claim records a failed attempt or opens a case",
        (
            "tests/db/test_observation.py::test_killed_worker_lease_expires_and_old_token_is_rejected",
        ),
    ),
    Guard(
        "observation_release_token",
        RECOVERY_QUERIES,
        "WHERE id = %(item_id)s\n"
        "  AND observation_lease_token = %(lease_token)s\n"
        "  AND source_generation = %(source_generation)s\n"
        "RETURNING id;",
        "WHERE id = %(item_id)s\n  AND source_generation = %(source_generation)s\nRETURNING id;",
        "a claim given back unsent releases only its own lease",
        (
            "tests/db/test_observation.py::test_killed_worker_lease_expires_and_old_token_is_rejected",
        ),
    ),
    Guard(
        "credential_probe_generation",
        CREDENTIAL_QUERIES,
        "           config.credential_generation = %(generation)s\n"
        "             AND config.active\n",
        "           config.active\n",
        "a probe of an older key never verifies the current one",
        ("tests/db/test_credentials.py::test_settings_saved_during_probe_invalidate_it",),
    ),
    Guard(
        "credential_probe_expiry",
        CREDENTIAL_QUERIES,
        "             AND w.probe_lease_expires_at > now() AS current",
        " AS current",
        "a probe whose lease ended records no verification",
        ("tests/db/test_credentials.py::test_expired_lease_cannot_complete",),
    ),
    Guard(
        "credential_probe_token",
        CREDENTIAL_QUERIES,
        "    WHERE w.provider = 'tmdb' AND w.probe_lease_token = %(lease_token)s\n",
        "    WHERE w.provider = 'tmdb'\n",
        "only the live probe records its outcome",
        ("tests/db/test_credentials.py::test_expired_probe_lease_lets_another_worker_recover",),
    ),
    Guard(
        "revalidation_record_token",
        REVALIDATION_QUERIES,
        "      AND r.item_id = item.id\n      AND r.lease_token = %(lease_token)s\n",
        "      AND r.item_id = item.id\n",
        "only the live revalidation claim records a check or a proposal",
        (
            "tests/db/test_revalidation_interleavings.py::test_a_revalidator_past_its_lease_loses_to_the_one_that_took_over",
        ),
    ),
    Guard(
        "revalidation_fault_token",
        REVALIDATION_QUERIES,
        "WHERE r.case_id = %(case_id)s\n"
        "  AND r.lease_token = %(lease_token)s\n"
        "  AND r.source_generation = %(source_generation)s\n"
        "RETURNING r.due_at;",
        "WHERE r.case_id = %(case_id)s\n"
        "  AND r.source_generation = %(source_generation)s\n"
        "RETURNING r.due_at;",
        "only the live revalidation claim records a fault",
        (
            "tests/db/test_revalidation_interleavings.py::test_a_revalidator_past_its_lease_loses_to_the_one_that_took_over",
        ),
    ),
    Guard(
        "stats_compute_token",
        STATS_STEPS,
        "    WHERE r.id = p_run_id AND r.lease_token = p_lease_token\n    FOR UPDATE SKIP LOCKED;",
        "    WHERE r.id = p_run_id\n    FOR UPDATE SKIP LOCKED;",
        "only the lease holder computes a run",
        STATS_TESTS,
        shadowed_by=RUN_IDENTITY,
    ),
    Guard(
        "stats_publish_token",
        STATS_STEPS,
        "    WHERE r.id = p_run_id AND r.lease_token = p_lease_token\n"
        "      AND r.phase = 'computed' AND r.lease_until > now()",
        "    WHERE r.id = p_run_id\n      AND r.phase = 'computed' AND r.lease_until > now()",
        "only the lease holder publishes",
        STATS_TESTS,
        shadowed_by=RUN_IDENTITY,
    ),
    Guard(
        "stats_publish_expiry",
        STATS_STEPS,
        PUBLISH_CHECK,
        "      AND r.phase = 'computed' AND r.retry_not_before IS NULL",
        "a publication after its lease ended publishes nothing",
        STATS_TESTS,
        shadowed_by="stats_renew_lease (publication renews the lease first, from its slot"
        " row, which holds the lease's end: an ended lease cannot be renewed)",
    ),
    Guard(
        "stats_renew_slot",
        STATS_WORKER,
        RENEW_CHECK,
        "    WHERE run_id = p_run_id\n    FOR UPDATE;",
        "a stage renews a lease only while its slot still holds it",
        STATS_TESTS,
        shadowed_by="each stage's own check of the run's lease end (compute's 'lease lapsed',"
        " stats_publish_expiry): the slot mirrors the run's lease",
    ),
    Guard(
        "stats_compute_expiry",
        STATS_STEPS,
        COMPUTE_CHECK,
        "    ELSIF false THEN",
        "a compute step after its lease ended takes no step",
        STATS_TESTS,
        shadowed_by="stats_renew_slot (compute renews the lease from its slot row first)",
    ),
    Guard(
        "stats_lease_end",
        STATS_STEPS,
        COMPUTE_CHECK,
        "    ELSIF false THEN",
        "a stats worker past its lease takes no step, though nobody took over: the run's"
        " lease end and its slot's mirror, checked at each stage (either alone suffices)",
        (
            "tests/db/test_interleavings.py::test_a_stats_worker_past_its_lease_takes_no_step_though_nobody_took_over",
        ),
        more=(
            (STATS_WORKER, RENEW_CHECK, "    WHERE run_id = p_run_id\n    FOR UPDATE;"),
            (
                STATS_STEPS,
                PUBLISH_CHECK,
                "      AND r.phase = 'computed' AND r.retry_not_before IS NULL",
            ),
        ),
    ),
    Guard(
        "stats_publish_generation",
        STATS_STEPS,
        "    IF run.target_version <= v_state.applied_version THEN",
        "    IF false THEN",
        "a generation never publishes over a newer or equal applied one",
        STATS_TESTS,
        shadowed_by="stats_publish_base (a run's base is the applied generation it was"
        " claimed on, and its target is newer than that base)",
    ),
    Guard(
        "stats_publish_base",
        STATS_STEPS,
        "    ELSIF v_state.applied_version <> run.base_applied_version THEN",
        "    ELSIF false THEN",
        "a run publishes only on the base it computed from",
        ("tests/db/test_stats_worker.py::test_moved_base_rejects_and_successor_absorbs_scope",),
    ),
    Guard(
        "stats_lease_fence",
        STATS_STAGES,
        "       AND coalesce(current_setting('inventory.stats_lease_token', true), '')\n"
        "           <> OLD.lease_token::text\n",
        "       AND false\n",
        "a live lease changes only in a transaction that declared its token (LEASE)",
        ("tests/db/test_stats_worker.py::test_lease_fence_rejects_late_writes",),
    ),
    Guard(
        "stats_lease_cap",
        STATS_STAGES,
        "        WHERE l.slot <= st.active_lease_cap AND l.lease_until <= now()",
        "        WHERE l.lease_until <= now()",
        "leases granted under the current cap never outnumber it",
        (
            "tests/db/test_stats_leases.py::test_a_lowered_cap_stops_claims_above_it_and_lets_its_leases_finish",
            "tests/chaos/test_checks.py::test_leases_beyond_the_cap_are_seen_and_a_lowered_cap_lets_earlier_ones_run_out",
        ),
    ),
    Guard(
        "stats_give_back_holder",
        STATS_STEPS,
        "    WHERE r.id = p_run_id AND r.lease_token = p_lease_token"
        " AND r.lock_owner = p_lock_owner\n",
        "    WHERE r.id = p_run_id AND r.lease_token = p_lease_token\n",
        "a worker gives back only a run it still holds (a lapsed batch run resumed by another"
        " worker keeps its token)",
        (
            "tests/db/test_stats_interruptions.py::test_a_worker_whose_batch_run_was_resumed_elsewhere_gives_nothing_back",
        ),
    ),
    Guard(
        "profile_claim_active",
        "migrations/0016_server_side_claim_and_sliding_admission.sql",
        "            WHERE n.status = 'pending'\n"
        "              AND n.available_at <= now()\n"
        "              AND l.active\n"
        "              AND m.active\n",
        "            WHERE n.status = 'pending'\n              AND n.available_at <= now()\n",
        "a claim never starts at an inactive library or server (running work may finish)",
        (
            "tests/db/test_refresh.py::test_inactive_library_pauses_new_claims_but_running_work_finishes",
        ),
    ),
    Guard(
        "credential_release_kind",
        "migrations/0027_authentication_case_generation.sql",
        "       AND l.active AND m.active AND l.media_kind = i.provider_kind",
        "       AND l.active AND m.active",
        "a verified key releases only cases in a library of their own media kind",
        ("tests/db/test_credentials.py::test_only_valid_cases_predating_verification_qualify",),
    ),
    Guard(
        "admission_window",
        ADMISSION_QUERIES,
        "      AND (cardinality(a.recent_admissions) < c.capacity\n"
        "           OR a.recent_admissions[cardinality(a.recent_admissions) + 1 - c.capacity]\n"
        "              <= clock_timestamp() - c.span)\n",
        "",
        "no more admissions in a window than the rate, across processes",
        (
            "tests/db/test_admission.py::test_late_caller_does_not_push_a_sliding_second_over_the_rate",
        ),
    ),
)
