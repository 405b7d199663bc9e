"""The Dagster UI in a real browser: with the webserver and daemon running and the
profile sensor's first refresh run done, the global asset lineage, library_profile's
Partitions tab and the run's page render what they should, and no page throws or logs
an error.

Headless Chromium driven by Playwright. Skipped only where the playwright package or a
Chromium binary is missing; CI installs both (pyproject's dev extra, .ci/run)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    from playwright.sync_api import ConsoleMessage, Error, Locator, Page, expect, sync_playwright
except ImportError:
    pytest.skip("the playwright package is not installed", allow_module_level=True)

from inventory_pipeline.db import connect
from inventory_pipeline.defs import profile_ranges as ranges
from inventory_pipeline.defs import profiles as profile_defs
from tests import factories as f
from tests.dagster import graphql as gql

pytestmark = pytest.mark.daemon

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium binary (chromium or chromium-browser)", allow_module_level=True)

ASSET = ranges.PROFILE_ASSET.to_user_string()
GROUP = profile_defs.library_profile.group_names_by_key[ranges.PROFILE_ASSET]
JOB = profile_defs.library_profile_refresh.name
# A page's first render waits on several GraphQL queries to a busy webserver.
RENDER_MS = 30_000

RUNS = """
query ($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { results { runId jobName status } }
  }
}
"""

# Dagster 1.13 opens a "Join the Dagster community" dialog a second after the first page
# loads on a 127.0.0.1 or localhost origin, over whatever the page shows. Its Skip
# button stores this key; setting it first is what a user who dismissed it once has.
NUX_DISMISSED = "window.localStorage.setItem('communityNux', JSON.stringify('1'))"


@pytest.fixture
def ui(server_url: str, template_name: str, tmp_path: Path) -> Iterator[gql.Dagster]:
    with gql.running_dagster(server_url, template_name, tmp_path / "dagster") as d:
        yield d


class Browser:
    """One headless Chromium page that records every uncaught exception and every
    console error of whatever it shows, and photographs each page it checks."""

    def __init__(self, page: Page, base_url: str, shots: Path) -> None:
        self.page = page
        self.base_url = base_url
        self.shots = shots
        self.errors: list[str] = []
        page.set_default_timeout(RENDER_MS)
        page.on("pageerror", self._page_error)
        page.on("console", self._console)

    def _page_error(self, error: Error) -> None:
        self.errors.append(f"{self.page.url}: uncaught {error.name}: {error.message}")

    def _console(self, message: ConsoleMessage) -> None:
        # Any console error fails: these pages log none (Dagster 1.13.27, Chromium 156).
        # Warnings pass: the run page logs Apollo's "An error occurred! ... message 85",
        # a warning that the UI's log subscription uses the deprecated
        # `onSubscriptionData` option (Apollo Client 3.14), which is Dagster's own code.
        if message.type == "error":
            where = message.location.get("url", "")
            self.errors.append(f"{self.page.url}: console error: {message.text} ({where})")

    def open(self, path: str) -> Page:
        self.page.goto(f"{self.base_url}{path}", wait_until="domcontentloaded")
        return self.page

    def done(self, name: str) -> None:
        """Photograph the page once its queries settled, then fail on anything it threw
        or logged as an error so far, while they settled included."""
        self.page.wait_for_load_state("networkidle")
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)
        assert self.errors == [], "\n".join(self.errors)


def visible(locator: Locator) -> None:
    expect(locator.first).to_be_visible(timeout=RENDER_MS)


def materialized_partitions(ui: gql.Dagster) -> list[str] | None:
    nodes = ui.query(gql.ASSET, key={"path": [ASSET]}, partition="")["assetNodes"]
    if not nodes:  # the code location is not loaded (yet)
        return None
    done: list[str] = nodes[0]["assetPartitionStatuses"]["materializedPartitions"]
    return done or None


def succeeded_run(ui: gql.Dagster) -> dict[str, Any] | None:
    data = ui.query(RUNS, filter={"pipelineName": JOB})["runsOrError"]
    assert data["__typename"] == "Runs", data
    done = [r for r in data["results"] if r["status"] == "SUCCESS"]
    return done[0] if done else None


def test_asset_lineage_partitions_and_run_pages_render_without_errors(
    ui: gql.Dagster, tmp_path: Path
) -> None:
    assert CHROMIUM is not None
    with connect(ui.app_url) as app:
        srv = f.server(app, "Living Room Plex")
        libraries = [f.library(app, srv, name=name) for name in ("Films", "Shows", "Docs")]
        for n, library in enumerate(libraries):
            f.items(app, library, 8, seed=n)
    keys = sorted({ranges.partition_of(lib) for lib in libraries})
    # The profile sensor is on by default: the daemon plans and launches the refresh.
    ui.start_daemon()
    run = ui.wait_for("a successful refresh run", lambda: succeeded_run(ui), 120)
    done = ui.wait_for("a materialized partition", lambda: materialized_partitions(ui), 60)
    assert sorted(done) == keys

    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            context = chromium.new_context(viewport={"width": 1400, "height": 900})
            context.add_init_script(NUX_DISMISSED)
            browser = Browser(context.new_page(), ui.url, shots)

            # Global asset lineage: one collapsed node per group; opening the asset's
            # group draws the asset, its partition filled and its check passed.
            page = browser.open("/asset-groups")
            graph = page.locator("foreignObject")
            graph.get_by_text(GROUP, exact=True).first.click()
            visible(graph.get_by_text(ASSET, exact=True))
            visible(graph.get_by_text("100% filled"))
            visible(graph.get_by_text("1 / 1 Passed"))
            browser.done("asset_lineage")

            # The asset's Partitions tab lists the refreshed range; selected, it shows
            # the run's materialization and the libraries it lists.
            page = browser.open(f"/assets/{ASSET}?view=partitions")
            page.get_by_text(keys[0], exact=True).first.click()
            visible(page.get_by_text("Materialized", exact=True))
            visible(page.get_by_role("link", name=JOB))
            visible(page.get_by_text("Films (movie)"))
            browser.done("partitions")

            # The run's page: its id, its job, its success event.
            page = browser.open(f"/runs/{run['runId']}")
            visible(page.get_by_text(run["runId"][:8]))
            visible(page.get_by_text(JOB))
            visible(page.get_by_text("RUN_SUCCESS"))
            browser.done("run")
        finally:
            chromium.close()
