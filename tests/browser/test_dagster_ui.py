"""The Dagster UI as a user sees it, in headless Chromium.

A real ``dagster-webserver`` (no daemon: nothing is launched) serves this
project's ``workspace.yaml`` from a temporary DAGSTER_HOME. Before it starts,
three observations of the WordCount sink topic are recorded in that home, one
a minute, with the numeric metadata an instance run logs (``_observe`` in
``jobs/instance_job.py``); and on the ``wordcount`` topology asset, what a
running deployment records there: two instances' observations
(:func:`~stream_assets.control.metrics.instance_metadata`), the metrics
sensor's materializations of the totals
(:func:`~stream_assets.control.metrics.topology_metadata`), one more instance
observation after them, and a crash alert (:func:`stream_assets.jobs.alerts.raise_alert`).
Playwright then drives Debian's ``chromium`` (``executable_path``: no browser
download) and checks:

- the topology's Lineage tab draws ``sourceTopic -> wordcount`` and an edge
  from ``wordcount`` to each of its output topics (the sink ``wordcount_out``
  among them), read from the drawn SVG: which node each arrow leaves and enters;
- the sink's Overview, Metadata -> Plots, has a chart per numeric key, and
  the ``records_per_s`` chart (a canvas) draws the recorded series: the
  vertices of its line, read from the canvas pixels, sit where 10, 30, 20 at
  equal time steps must sit (a linear map from value to pixel height);
- the sink's Events tab lists the three observations and shows each one's
  ``records_per_s`` value in its metadata table;
- the topology's Overview reads at a glance: its Metadata table starts with
  the headline (total lag, input and output rates, dead letters, instances
  running and desired, in that order) although an instance observed last, and
  its Plots start with the same six charts, in that order, with no chart for
  an identifier (instance index, generation);
- the crash alert is visibly an alert: the topology's Checks tab shows its
  crash check failed with the alert's line, and the Events tab lists only the
  metric events (the alert is not one more observation among them).

Screenshots of the lineage and the plot are left in the test's tmp dir; on a
failure the page (PNG and HTML) and the webserver log's tail are saved there too.

Needs Debian's ``chromium`` (``bash infra/dev.sh test`` installs it) and
Playwright for Python (a dev dependency). ``STREAM_ASSETS_TEST_CHROMIUM``
names another Chromium binary.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.events import (
    AssetObservationData,
    DagsterEvent,
    DagsterEventType,
    StepMaterializationData,
)
from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID
from playwright.sync_api import Locator, Page, expect, sync_playwright

from stream_assets.control.alerts import Alert
from stream_assets.control.lineage import topic_asset_key, topology_asset_key, topology_asset_specs
from stream_assets.control.metrics import (
    HEADLINE,
    InstanceNumbers,
    Rate,
    aggregate,
    instance_metadata,
    parse_instance_metadata,
    topology_metadata,
)
from stream_assets.control.registry import registration
from stream_assets.jobs.alerts import raise_alert
from stream_assets.jobs.checks import crash_check_key
from stream_assets.settings import PROJECT_ROOT, SupervisorSettings
from tests.browser.conftest import CALL_FAILED

pytestmark = pytest.mark.ui

VENV_BIN = Path(sys.executable).parent
TOPOLOGY = "wordcount"
SINK_TOPIC = "wordcount-out"
#: records_per_s of the three observations, oldest first, one a minute.
SERIES = (10.0, 30.0, 20.0)
STEP_S = 60.0
#: Deadline for the webserver to serve the code location (it imports PySpark).
SERVE_TIMEOUT_S = 90.0
#: Default wait of every Playwright action and expectation.
UI_TIMEOUT_MS = 20_000
#: As the machine's notes advise: no background connections on a closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str:
    """The system Chromium to drive; a failure (not a skip) saying what to install."""
    configured = os.environ.get("STREAM_ASSETS_TEST_CHROMIUM")
    candidates = [configured] if configured else ["chromium", "chromium-browser"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(
        "the UI test needs a Chromium binary: `apt-get install chromium` (Debian; "
        "`bash infra/dev.sh test` does it as root or with passwordless sudo), or set "
        f"STREAM_ASSETS_TEST_CHROMIUM to one (looked for {', '.join(candidates)})"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _observe(
    instance: dg.DagsterInstance, key: dg.AssetKey, metadata: dict[str, Any], ts: float
) -> None:
    """A runless AssetObservation at time ``ts``.

    ``report_runless_asset_event`` stamps "now"; the plot check needs known,
    evenly spaced times, so this stores the same event with its own timestamp.
    """
    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_OBSERVATION.value,
        event_specific_data=AssetObservationData(dg.AssetObservation(key, metadata=metadata)),
        job_name=RUNLESS_JOB_NAME,
    )
    instance.report_dagster_event(event, run_id=RUNLESS_RUN_ID, timestamp=ts)


def _materialize(
    instance: dg.DagsterInstance, key: dg.AssetKey, metadata: dict[str, Any], ts: float
) -> None:
    """A runless AssetMaterialization at time ``ts`` (as the metrics sensor's, reported
    by the daemon)."""
    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
        event_specific_data=StepMaterializationData(
            dg.AssetMaterialization(key, metadata=metadata)
        ),
        job_name=RUNLESS_JOB_NAME,
    )
    instance.report_dagster_event(event, run_id=RUNLESS_RUN_ID, timestamp=ts)


#: The crash the topology's alert is about (its failure message is looked for in the UI).
ALERT = Alert(TOPOLOGY, 1, "f00dfeed", "the broker refused the connection", crashes=1)
#: Metric events recorded on the topology asset: the sensor's materializations, and the
#: instances' observations (two before each materialization, one after the last).
TOPOLOGY_MATERIALIZATIONS = 2
TOPOLOGY_OBSERVATIONS = 2 * TOPOLOGY_MATERIALIZATIONS + 1


def _record_topology(instance: dg.DagsterInstance, start: float) -> None:
    """What a running two-instance deployment of the topology leaves on its asset.

    Instances 0 and 1 observe, the metrics sensor materializes their totals, twice;
    then instance 0 observes once more (the newest event is an instance's); then an
    instance run crashes and the alert sensor raises its alert.
    """
    key = topology_asset_key(TOPOLOGY)
    rate = Rate(20.0, 30.0)
    rates = {"records_in": rate, "records_out": rate}
    for step in range(TOPOLOGY_MATERIALIZATIONS):
        reports = []
        for index in (0, 1):
            numbers = InstanceNumbers(records_in=600 * (step + 1), lag=4 + index, dead_letters=1)
            metadata = instance_metadata(index, 3, numbers, rates)
            _observe(instance, key, metadata, start + step * STEP_S + index)
            report = parse_instance_metadata(metadata, run_id=f"run-{index}")
            assert report is not None
            reports.append(report)
        totals = topology_metadata(
            aggregate(reports),
            desired_instances=2,
            generation=3,
            running_instances=2,
            instances=reports,
        )
        _materialize(instance, key, totals, start + step * STEP_S + 5)
    numbers = InstanceNumbers(records_in=2000, lag=2)
    _observe(instance, key, instance_metadata(0, 3, numbers, rates), start + 2 * STEP_S)
    log = logging.getLogger(__name__)
    log.addHandler(logging.NullHandler())
    raise_alert(instance, ALERT, SupervisorSettings(alert_hooks=()), log)


def _metadata(records_per_s: float, i: int) -> dict[str, Any]:
    """Numeric metadata shaped like an instance's observation (``jobs/instance_job.py``)."""
    return {
        "records_in": 1000 * (i + 1),
        "records_out": 400 * (i + 1),
        "records_per_s": records_per_s,
        "lag": 5 * i,
    }


NUMERIC_KEYS = tuple(_metadata(0.0, 0))


def _graphql(url: str, query: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        body: dict[str, Any] = json.load(response)
        return body


_WORKSPACE_QUERY = """{ workspaceOrError { __typename ... on Workspace { locationEntries {
  name loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_until_served(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll the webserver's GraphQL until every code location is loaded, or fail."""
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dagster-webserver exited with {proc.returncode}:\n{_tail(log)}")
        try:
            answer = _graphql(url, _WORKSPACE_QUERY)["data"]["workspaceOrError"]
        except (OSError, urllib.error.URLError, KeyError, ValueError) as e:
            last = repr(e)
        else:
            entries = answer.get("locationEntries") or []
            last = json.dumps(answer)
            for entry in entries:
                error = entry.get("locationOrLoadError") or {}
                if error.get("__typename") == "PythonError":
                    pytest.fail(f"code location {entry['name']} failed to load: {error['message']}")
            if entries and all(
                e["loadStatus"] == "LOADED"
                and (e["locationOrLoadError"] or {}).get("__typename") == "RepositoryLocation"
                for e in entries
            ):
                return
        time.sleep(0.25)
    pytest.fail(
        f"dagster-webserver did not serve the code location within {SERVE_TIMEOUT_S:.0f} s "
        f"(last answer: {last}):\n{_tail(log)}"
    )


@dataclass(frozen=True)
class DagsterUI:
    url: str
    log: Path


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterUI]:
    """A dagster-webserver on a free port over a temporary home holding the observations."""
    home = tmp_path_factory.mktemp("dagster_ui_home")
    config = (PROJECT_ROOT / "infra" / "dagster" / "dagster.yaml").read_text()
    # No "join the community" dialog over the page a first visit would get.
    (home / "dagster.yaml").write_text(config + "\nnux:\n  enabled: false\n")
    # The storage is created here, before the webserver opens the same home.
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        start = time.time() - STEP_S * len(SERIES)
        for i, value in enumerate(SERIES):
            _observe(instance, topic_asset_key(SINK_TOPIC), _metadata(value, i), start + i * STEP_S)
        _record_topology(instance, start)
    finally:
        instance.dispose()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "webserver.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(VENV_BIN / "dagster-webserver"),
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--workspace", str(PROJECT_ROOT / "workspace.yaml")),
            ],
            cwd=PROJECT_ROOT,
            env={**os.environ, "DAGSTER_HOME": str(home)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_until_served(url, proc, log)
        yield DagsterUI(url, log)
    finally:
        # The webserver and its code server share the session started for it;
        # a clean stop takes ~10 s (the code server drains its RPCs first).
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def page(request: pytest.FixtureRequest, dagster_ui: DagsterUI, tmp_path: Path) -> Iterator[Page]:
    """A page of headless Debian Chromium; a failed test leaves the page and the log behind."""
    executable = _chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(UI_TIMEOUT_MS)
            expect.set_options(timeout=UI_TIMEOUT_MS)
            yield page
            if request.node.stash.get(CALL_FAILED, False):
                page.screenshot(path=tmp_path / "failure.png", full_page=True)
                (tmp_path / "failure.html").write_text(page.content())
                (tmp_path / "webserver.log").write_text(_tail(dagster_ui.log, 200))
                print(f"UI test failed on {page.url}; screenshot, page and log in {tmp_path}")
        finally:
            browser.close()


# --- lineage ---------------------------------------------------------------------------

#: Every drawn asset node (name, box) and every arrow (start and end point), in page pixels.
_GRAPH_JS = """() => {
  const nodes = Array.from(document.querySelectorAll('svg foreignObject')).map((fo) => {
    const r = fo.getBoundingClientRect();
    const text = fo.firstElementChild ? fo.firstElementChild.innerText : '';
    const name = text.split('\\n').map((s) => s.trim()).find((s) => s) || '';
    return {name, left: r.left, right: r.right, top: r.top, bottom: r.bottom};
  });
  const edges = Array.from(document.querySelectorAll('svg path[marker-end]')).map((p) => {
    const m = p.getScreenCTM();
    const a = p.getPointAtLength(0).matrixTransform(m);
    const b = p.getPointAtLength(p.getTotalLength()).matrixTransform(m);
    return [a.x, a.y, b.x, b.y];
  });
  return {nodes, edges};
}"""


def _drawn_edges(page: Page) -> set[tuple[str, str]]:
    """(from, to) node names of every arrow the graph draws.

    An arrow leaves a node's right side and ends, arrowhead first, just left of
    another node's left side, at a height inside each box.
    """
    graph = page.evaluate(_GRAPH_JS)
    nodes = [n for n in graph["nodes"] if n["name"]]

    def node_at(x: float, y: float, side: str) -> str:
        hits: list[str] = [
            n["name"]
            for n in nodes
            if abs(n[side] - x) <= 0.05 * (n["right"] - n["left"]) and n["top"] <= y <= n["bottom"]
        ]
        assert len(hits) == 1, f"arrow end ({x:.0f}, {y:.0f}) at the {side} of {hits}: {graph}"
        return hits[0]

    return {
        (node_at(ax, ay, "right"), node_at(bx, by, "left")) for ax, ay, bx, by in graph["edges"]
    }


def test_lineage_draws_topology_between_its_topics(
    dagster_ui: DagsterUI, page: Page, tmp_path: Path
) -> None:
    specs = topology_asset_specs(registration(TOPOLOGY).topology())
    expected = {(d.asset_key.path[-1], s.key.path[-1]) for s in specs for d in s.deps}
    sink = topic_asset_key(SINK_TOPIC).path[-1]
    assert ("sourceTopic", TOPOLOGY) in expected and (TOPOLOGY, sink) in expected

    page.goto(
        f"{dagster_ui.url}/assets/topologies/{TOPOLOGY}"
        "?view=lineage&lineageScope=neighbors&lineageDepth=1"
    )
    graph = page.locator("svg foreignObject")
    for name in sorted({n for edge in expected for n in edge}):
        expect(graph.get_by_text(name, exact=True)).to_be_visible()
    arrows = page.locator("svg path[marker-end]")
    expect(arrows).to_have_count(len(expected))
    page.screenshot(path=tmp_path / "lineage.png")

    assert _drawn_edges(page) == expected


# --- plots and events of the sink ------------------------------------------------------

#: Per canvas column that the line crosses: the middle of its strongly coloured pixels
#: (the line and point borders; grid, ticks and labels are grey).
_LINE_JS = """(canvas) => {
  const {width, height} = canvas;
  const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
  const columns = [];
  for (let x = 0; x < width; x++) {
    let top = -1, bottom = -1;
    for (let y = 0; y < height; y++) {
      const i = 4 * (y * width + x);
      const sat = Math.max(data[i], data[i + 1], data[i + 2])
                - Math.min(data[i], data[i + 1], data[i + 2]);
      if (data[i + 3] >= 128 && sat >= 80) { if (top < 0) top = y; bottom = y; }
    }
    if (top >= 0) columns.push([x, (top + bottom) / 2]);
  }
  return columns;
}"""


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def _plotted_vertices(columns: list[tuple[float, float]], count: int) -> list[float]:
    """Pixel heights of a polyline's ``count`` evenly spaced vertices.

    Each segment is fitted on its middle (away from the point markers) and the
    fits are evaluated at the vertices; an inner vertex averages its two segments.
    """
    x0, x1 = columns[0][0], columns[-1][0]
    step = (x1 - x0) / (count - 1)
    fits = []
    for k in range(count - 1):
        lo, hi = x0 + (k + 0.2) * step, x0 + (k + 0.8) * step
        fits.append(_fit([(x, y) for x, y in columns if lo <= x <= hi]))
    heights = []
    for k in range(count):
        x = x0 + k * step
        around = [fits[j] for j in (k - 1, k) if 0 <= j < len(fits)]
        heights.append(sum(a + b * x for a, b in around) / len(around))
    return heights


def _plot_canvas(page: Page, key: str) -> Locator:
    """The chart under the plot titled ``key``."""
    title = page.get_by_text(key, exact=True)
    return title.locator("xpath=ancestor::div[.//canvas][1]").locator("canvas")


def test_sink_plot_draws_the_observed_series(
    dagster_ui: DagsterUI, page: Page, tmp_path: Path
) -> None:
    sink = "/".join(topic_asset_key(SINK_TOPIC).path)
    page.goto(f"{dagster_ui.url}/assets/{sink}")
    page.get_by_role("button", name="Plots").click()
    for key in NUMERIC_KEYS:
        expect(_plot_canvas(page, key)).to_be_visible()

    canvas = _plot_canvas(page, "records_per_s")
    # Chart.js draws after layout: wait for the line itself.
    page.wait_for_function(
        f"(c) => ({_LINE_JS})(c).length > c.width / 2", arg=canvas.element_handle()
    )
    canvas.screenshot(path=tmp_path / "records_per_s.png")
    columns = [(float(x), float(y)) for x, y in canvas.evaluate(_LINE_JS)]
    heights = _plotted_vertices(columns, len(SERIES))

    # The vertices must be a linear image of the series, higher values drawn higher.
    a, b = _fit(list(zip(SERIES, heights, strict=True)))
    assert b < 0, f"larger records_per_s drawn lower: heights {heights}"
    span = abs(b) * (max(SERIES) - min(SERIES))
    off = [h - (a + b * v) for v, h in zip(SERIES, heights, strict=True)]
    assert max(abs(o) for o in off) <= 0.02 * span, (
        f"plotted heights {heights} are not the series {SERIES} (off by {off} px of {span:.0f})"
    )


def test_sink_events_list_each_observation(dagster_ui: DagsterUI, page: Page) -> None:
    sink = "/".join(topic_asset_key(SINK_TOPIC).path)
    page.goto(f"{dagster_ui.url}/assets/{sink}?view=events")
    rows = page.locator("[data-index]").filter(has=page.get_by_role("img", name="observation"))
    expect(rows).to_have_count(len(SERIES))
    value = page.locator("tr", has=page.get_by_text("records_per_s", exact=True)).locator("td")
    for row, expected in zip(rows.all(), reversed(SERIES), strict=True):  # newest first
        row.click()
        expect(value.nth(1)).to_have_text(re.compile(rf"^\s*{expected:g}(\.0+)?\s*$"))


# --- the topology at a glance ------------------------------------------------------------

#: Labels of the plots grid that holds ``title``, in the order the grid shows them.
_GRID_LABELS_JS = """(title) => {
  let cell = title;
  while (cell.parentElement && getComputedStyle(cell.parentElement).display !== 'grid') {
    cell = cell.parentElement;
  }
  return Array.from(cell.parentElement.children).map((c) => c.innerText.split('\\n')[0].trim());
}"""


def test_topology_overview_shows_the_headline_first(
    dagster_ui: DagsterUI, page: Page, tmp_path: Path
) -> None:
    page.goto(f"{dagster_ui.url}/assets/{'/'.join(topology_asset_key(TOPOLOGY).path)}")
    # The Metadata table (Key | Timestamp | Value): the latest materialization's entries in
    # their order, although an instance observed after it.
    table = page.locator("table", has=page.locator("thead td", has_text=re.compile(r"^Key$")))
    keys = table.locator("tbody > tr > td:first-child")
    expect(keys.first).to_have_text(HEADLINE[0])
    page.screenshot(path=tmp_path / "topology_overview.png", full_page=True)
    assert [k.strip() for k in keys.all_inner_texts()[: len(HEADLINE)]] == list(HEADLINE)

    page.get_by_role("button", name="Plots").click()
    first = page.get_by_text(HEADLINE[0], exact=True)
    expect(_plot_canvas(page, HEADLINE[0])).to_be_visible()
    labels = [str(label) for label in first.evaluate(_GRID_LABELS_JS)]
    page.screenshot(path=tmp_path / "topology_plots.png", full_page=True)
    assert labels[: len(HEADLINE)] == list(HEADLINE), labels
    # The per-instance detail is there, below; identifiers are never plotted.
    assert {"instance_0.lag", "instance_1.lag", "all.state_bytes"} <= set(labels), labels
    assert not {"instance", "generation", "phase"} & set(labels), labels


def test_a_crash_alert_shows_as_a_failed_check_not_as_an_event(
    dagster_ui: DagsterUI, page: Page, tmp_path: Path
) -> None:
    topology = "/".join(topology_asset_key(TOPOLOGY).path)
    check = crash_check_key(TOPOLOGY).name
    page.goto(f"{dagster_ui.url}/assets/{topology}?view=checks")

    def shown(text: str, exact: bool = False) -> Locator:
        # Visible matches only: the checks list also renders names into a hidden measure.
        return page.get_by_text(text, exact=exact).filter(visible=True).first

    # The topology's only check, selected: failed, with the alert's line as its result.
    expect(shown(check, exact=True)).to_be_visible()
    expect(shown("Failed", exact=True)).to_be_visible()
    expect(shown(f"instance {ALERT.instance} of {TOPOLOGY} failed")).to_be_visible()
    expect(shown(ALERT.message)).to_be_visible()
    page.screenshot(path=tmp_path / "topology_checks.png", full_page=True)

    # The Events tab lists the metric events only: the alert is not one more among them.
    page.goto(f"{dagster_ui.url}/assets/{topology}?view=events")
    rows = page.locator("[data-index]")
    # A materialization's row icon is "run_success", an observation's "observation".
    materializations = rows.filter(has=page.get_by_role("img", name="run_success"))
    observations = rows.filter(has=page.get_by_role("img", name="observation"))
    expect(materializations).to_have_count(TOPOLOGY_MATERIALIZATIONS)
    expect(observations).to_have_count(TOPOLOGY_OBSERVATIONS)
