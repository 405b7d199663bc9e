"""What a sensor tick answered, in the tick's own log.

The UI's tick history shows a tick's logs ("No logs to display" otherwise), and a
skip reason only in a preview; so each sensor's answer is also logged: the skip reason,
or how many runs it launches."""

# No `from __future__ import annotations` here: Dagster reads the wrapped sensor's
# signature (its context and resource parameters) through `functools.wraps`.

import functools
from collections.abc import Callable
from typing import Any

import dagster as dg


def answer_of(result: object) -> str | None:
    """One line saying what a sensor's result does, or None when it says nothing."""
    if isinstance(result, dg.SkipReason):
        return f"skipped: {result.skip_message}" if result.skip_message else "skipped"
    if isinstance(result, dg.RunRequest):
        return "launching 1 run"
    if isinstance(result, dg.SensorResult):
        runs = len(result.run_requests or [])
        if runs:
            return f"launching {runs} run{'s' if runs != 1 else ''}"
        if result.skip_reason is not None and result.skip_reason.skip_message:
            return f"skipped: {result.skip_reason.skip_message}"
    return None


def logged(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    """The sensor function, logging its answer (`answer_of`) in the tick's log."""

    @functools.wraps(evaluate)
    def logging_evaluate(context: dg.SensorEvaluationContext, *args: Any, **kwargs: Any) -> Any:
        result = evaluate(context, *args, **kwargs)
        line = answer_of(result)
        if line is not None:
            context.log.info(line)
        return result

    return logging_evaluate
