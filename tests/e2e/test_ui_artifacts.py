"""The Prefect UI as the run's dashboard: a finished run's report and evaluation table, opened in headless
Chromium from the real server the end-to-end run used, show the plots and the numbers."""

from __future__ import annotations

import json

from tests.e2e.conftest import DeployedRun
from tests.support.chromium import chromium_page
from tests.support.prefect_server import PrefectAPI

PLOTS = ("reward.png", "logprob_diff.png", "response_length.png", "eval_scores.png")
# [complete, naturalWidth] of every inline PNG in the rendered report
IMAGES = ("[...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/png'))"
          ".map(i => [i.alt, i.complete, i.naturalWidth])")
TABLE_ROWS = ("[...document.querySelectorAll('tbody tr')]"
              ".map(r => [...r.querySelectorAll('td')].map(c => c.innerText.trim()))")


def test_the_report_shows_its_plots_and_the_eval_table_its_numbers(prefect_api: PrefectAPI, deployed_run: DeployedRun,
                                                                    tmp_path):
    artifacts = prefect_api.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [
        deployed_run.flow_run["id"]]}}}).json()
    # Keys are "<run>-report", "<run>-eval", "<run>-metrics", "<run>-link-report", ...: the link artifacts are
    # markdown too, so the kind is what follows the run's own key (taken from the only "-eval" key).
    by_key = {a["key"]: a for a in artifacts if a["key"]}
    [run_key] = [key.removesuffix("-eval") for key in by_key if key.endswith("-eval")]
    report, evaluation = by_key[f"{run_key}-report"], by_key[f"{run_key}-eval"]
    eval_rows = json.loads(evaluation["data"])
    ui = prefect_api.url.removesuffix("/api")

    with chromium_page(tmp_path / "profile") as page:
        images = page.open(f"{ui}/artifacts/artifact/{report['id']}", IMAGES,
                           until=lambda v: len(v or []) == len(PLOTS) and all(done for _, done, _ in v))
        page.screenshot(tmp_path / "report.png")
        assert sorted(alt for alt, _, _ in images) == sorted(PLOTS)
        assert all(width == 600 for _, _, width in images), images  # figsize 6 in at 100 dpi: decoded, not broken
        headings = page.evaluate("[...document.querySelectorAll('h1, h2')].map(h => h.innerText.trim())")
        assert {"Training", "Evaluation", "Plots"} <= set(headings), headings

        rows = page.open(f"{ui}/artifacts/artifact/{evaluation['id']}", TABLE_ROWS,
                         until=lambda v: len(v or []) == len(eval_rows))
        page.screenshot(tmp_path / "eval-table.png")
    for expected in eval_rows:  # each row's cells: the set, the metric and both numbers, in the columns' order
        [shown] = [r for r in rows if r[:2] == [expected["eval set"], expected["metric"]]]
        assert [float(x) for x in shown[2:]] == [expected["before training"], expected["final"]], (shown, expected)
    assert (tmp_path / "report.png").stat().st_size > 20_000  # a page with four plots, not a blank one
