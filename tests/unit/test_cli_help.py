"""The CLI's dispatch table: every command and `stats` action has a handler, says what it
does in its --help with an example, and a handler's refusal stays one line."""

from __future__ import annotations

import argparse

import pytest

from inventory_pipeline import cli
from inventory_pipeline.settings import Settings
from inventory_pipeline.stats.runbook import RunbookError


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser below `parser` (groups and leaves), with its command path."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.append(((*path, name), child))
                found.extend(commands(child, (*path, name)))
    return found


def leaves(
    parser: argparse.ArgumentParser,
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return [
        (path, child)
        for path, child in commands(parser)
        if not any(isinstance(a, argparse._SubParsersAction) for a in child._actions)
    ]


ALL = [path for path, _ in commands(cli._parser())]


def test_the_table_covers_every_command() -> None:
    assert {" ".join(path) for path, _ in leaves(cli._parser())} == {
        "dev",
        "migrate",
        "status",
        "demo",
        "refresh",
        "observe",
        "mark-dirty",
        "tmdb-key",
        "stats settings",
        "stats pause",
        "stats resume",
        "stats retry",
        "stats drain",
        "proposals list",
        "proposals approve",
        "proposals reject",
    }
    for path, parser in leaves(cli._parser()):
        assert callable(parser.get_default("func")), path


@pytest.mark.parametrize("path", [(), *ALL], ids=lambda p: " ".join(p) or "top")
def test_help_describes_with_an_example(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*path, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "Example" in out
    examples = out[out.index("Example") :].splitlines()[1:]
    assert examples and all(
        line.startswith(f"  {cli.PROG} {' '.join(path)}".rstrip()) for line in examples
    ), out
    # A description beyond the usage lines and the options.
    assert out.split("\n\n")[1].strip() and "options:" not in out.split("\n\n")[1]


def test_main_calls_the_handler_the_command_names(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int | None]] = []

    def fake_retry(args: argparse.Namespace, settings: Settings) -> int:
        calls.append(("retry", args.job_id))
        return 7

    def fake_status(args: argparse.Namespace, settings: Settings) -> int:
        calls.append(("status", None))
        return 0

    monkeypatch.setattr(cli, "_stats_retry", fake_retry)
    monkeypatch.setattr(cli, "_status", fake_status)
    assert cli.main(["stats", "retry", "42"]) == 7
    assert cli.main(["status"]) == 0
    assert calls == [("retry", 42), ("status", None)]


def test_a_handlers_refusal_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(args: argparse.Namespace, settings: Settings) -> int:
        raise RunbookError("job 42 did not fail\nsecond line")

    monkeypatch.setattr(cli, "_stats_retry", refuse)
    assert cli.main(["stats", "retry", "42"]) == 1
    assert capsys.readouterr().err == "inventory-pipeline: error: job 42 did not fail\n"
