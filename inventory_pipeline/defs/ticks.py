"""What a sensor tick answered, in the tick's own log.

The UI's tick history shows a tick's logs ("No logs to display" otherwise), and a
skip reason only in a preview; so a sensor's answer is logged in its tick: a launch
always (INFO), a skip when it differs from the sensor's previous answer in this process
(DEBUG). Skips stay off the console `dev` prints, and an idle sensor does not open a
captured-log file every few seconds (Dagster keeps one per logging tick). A sensor
that keeps more than a launch count in its cursor reads it with `cursor_state`."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from typing import Any

import dagster as dg

_previous: dict[str, str] = {}  # sensor name -> its last logged skip
_lock = threading.Lock()


def answer_of(result: object) -> tuple[bool, str] | None:
    """Whether the result launches runs, and one line saying what it does; None when it
    says nothing."""
    if isinstance(result, dg.SkipReason):
        return False, f"skipped: {result.skip_message}" if result.skip_message else "skipped"
    if isinstance(result, dg.RunRequest):
        return True, "launching 1 run"
    if isinstance(result, dg.SensorResult):
        runs = len(result.run_requests or [])
        if runs:
            return True, f"launching {runs} run{'s' if runs != 1 else ''}"
        if result.skip_reason is not None and result.skip_reason.skip_message:
            return False, f"skipped: {result.skip_reason.skip_message}"
    return None


def logged(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    """The sensor function, logging its answer (`answer_of`) in the tick's log."""

    @functools.wraps(evaluate)
    def logging_evaluate(context: dg.SensorEvaluationContext, *args: Any, **kwargs: Any) -> Any:
        result = evaluate(context, *args, **kwargs)
        answer = answer_of(result)
        if answer is None:
            return result
        launches, line = answer
        with _lock:
            changed = _previous.get(evaluate.__name__) != line
            _previous[evaluate.__name__] = "" if launches else line
        if launches:
            context.log.info(line)
        elif changed:
            context.log.debug(line)
        return result

    return logging_evaluate


def cursor_state(cursor: str | None, counter: str) -> dict[str, Any]:
    """A sensor's JSON cursor holding a count of launches (`counter`) and whatever else
    the sensor keeps; a bare integer is the older cursor (the count only), and anything
    unreadable starts again from zero."""
    if cursor and cursor.isdigit():
        return {counter: int(cursor)}
    try:
        state = json.loads(cursor) if cursor else None
    except ValueError:
        state = None
    if isinstance(state, dict) and isinstance(state.get(counter), int):
        return state
    return {counter: 0}
