"""`afl report`: the HTML is self-contained and shows the table, plots and ROC curves.

Results come from :func:`afl.lab.simulate.grid.simulate` on the small synthetic federation of
tests/lab/synthetic.py; the Table II cells are checked against the results JSON, the plots by
decoding their inline PNGs, and (when Chromium is installed) by rendering the page in headless
Chromium.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from afl.lab.report.cmd import add_arguments, run
from afl.lab.report.plots import macro_figure
from afl.lab.report.simulation import ReportError, render_report, write_report
from afl.lab.simulate.dataset import save_dataset
from afl.lab.simulate.grid import SimulationConfig, missing_settings, simulate
from tests.helpers.browser import (
    CHROMIUM,
    SKIP_REASON,
    blank_tail_fraction,
    full_page_screenshot,
    headless_flags,
    shot_path,
)
from tests.lab.synthetic import small_federation

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMG_RE = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _results(save_dir: Path | None = None) -> dict[str, Any]:
    fed = small_federation()
    settings = missing_settings([1, 3], num_sites=4, num_classes=4, seed=5)
    saved: dict[str, str] = {}

    def keep(setting: str, method: str, weights: NDArray[np.float64]) -> None:
        if save_dir is not None:
            path = save_dir / "weights" / f"{len(saved)}.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, weights)
            # as `afl simulate --save-dir run` records them: relative to its working directory
            saved[f"{setting}/{method}"] = str(Path("run") / path.relative_to(save_dir))

    config = SimulationConfig(settings=settings, baselines=("fedavg",))
    results = simulate(fed, config, progress=False, on_weights=keep)
    if save_dir is not None:
        save_dataset(fed, save_dir / "data")
        results["saved"] = {"data": "run/data", "weights": saved}
    return results


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("saved")
    results = _results(root)
    path = root / "results.json"
    path.write_text(json.dumps(results), encoding="utf-8")
    return path, results


@pytest.fixture(scope="module")
def saved_html(saved_run: tuple[Path, dict[str, Any]]) -> str:
    path, results = saved_run
    return render_report(results, base_dir=path.parent)


def _pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in IMG_RE.findall(html)]


def test_report_has_table_ii_plots_and_no_external_resources(
    saved_run: tuple[Path, dict[str, Any]], saved_html: str
) -> None:
    _, results = saved_run
    html = saved_html
    assert '<table class="table-ii">' in html
    for name, body in results["settings"].items():
        assert f'<th colspan="3">{name}</th>' in html
        for row in body["rows"]:
            auc = row["macro"]["auc"]
            assert f"{100 * auc:.2f}" in html  # every macro AUC is in the table
    assert "fedavg" in html and "SURROGATE FEATURES" in html
    pngs = _pngs(html)
    # macro plot + one per-class figure per setting + one ROC figure per setting
    assert len(pngs) == 1 + 2 * len(results["settings"])
    assert all(p.startswith(PNG_MAGIC) and len(p) > 1000 for p in pngs)
    assert "ROC curves on the 400 test rows" in html
    assert "No saved weights (so no curve) for: fedavg" in html
    # self-contained: nothing is fetched (no src/href to another resource, no scripts)
    assert not re.search(r'(src|href)="(?!data:)', html)
    assert "<script" not in html and "<link" not in html


def test_without_saved_scores_the_report_says_roc_needs_save_dir() -> None:
    results = _results()
    html = render_report(results)
    assert "--save-dir" in html
    assert len(_pngs(html)) == 1 + len(results["settings"])


def test_assignments_and_communication_follow_the_results(
    saved_run: tuple[Path, dict[str, Any]], saved_html: str
) -> None:
    _, results = saved_run
    html = saved_html
    m3 = results["settings"]["missing-3"]["assignment"]
    table = html.split('<table class="assignment">')[2].split("</table>")[0]
    for site, labelled in m3.items():
        row = table.split(f'<td class="name">{site}</td>')[1].split("</tr>")[0]
        assert row.count("✓") == len(labelled) == 1
    up = results["settings"]["missing-1"]["rows"][0]["communication"]["bytes_up_per_site"]
    assert f'title="{up} bytes"' in html


def test_text_from_the_json_is_escaped(saved_run: tuple[Path, dict[str, Any]]) -> None:
    _, results = saved_run
    hostile = json.loads(json.dumps(results))
    hostile["data"]["provenance"] = "<script>alert(1)</script>"
    hostile.pop("saved")
    html = render_report(hostile)
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_cli_writes_html_and_rejects_other_json(
    saved_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, _ = saved_run
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "r.html"
    assert run(parser.parse_args([str(path), "--out", str(out)])) == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    bad = tmp_path / "bad.json"
    bad.write_text('{"suite": "stats"}', encoding="utf-8")
    assert run(parser.parse_args([str(bad)])) == 2
    with pytest.raises(ReportError):
        write_report(bad, tmp_path / "x.html")


# Appended to a copy of the report (the report itself has no script): writes what the browser
# actually rendered into the DOM, which --dump-dom prints.
PROBE = """<pre id="probe"></pre><script>
const imgs = [...document.images];
document.getElementById('probe').textContent = JSON.stringify({
  tableRows: document.querySelector('table.table-ii').rows.length,
  images: imgs.length,
  decoded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
def test_report_renders_in_headless_chromium(
    saved_run: tuple[Path, dict[str, Any]], saved_html: str, tmp_path: Path
) -> None:
    assert CHROMIUM is not None
    _, results = saved_run
    page = tmp_path / "page.html"
    html = saved_html
    page.write_text(html.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    flags = headless_flags(tmp_path / "profile")
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    probe = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1))  # type: ignore[union-attr]
    methods = {r["method"] for body in results["settings"].values() for r in body["rows"]}
    assert probe["tableRows"] == 2 + len(methods) + 1  # two header rows, methods, centralised
    assert probe["images"] == len(_pngs(html)) > 0
    assert probe["decoded"] == probe["images"]
    shot = full_page_screenshot(
        CHROMIUM, _plain_page(tmp_path, html), shot_path(tmp_path, "simulation-report.png"),
        profile=tmp_path / "profile",
    )  # fmt: skip
    assert shot.read_bytes().startswith(PNG_MAGIC)
    assert blank_tail_fraction(shot) < 0.05  # the page ends where its content ends


def _plain_page(tmp: Path, html: str) -> Path:
    page = tmp / "report.html"
    page.write_text(html, encoding="utf-8")
    return page


def test_one_setting_is_drawn_on_a_full_axis_and_the_oracle_row_is_explained(
    saved_run: tuple[Path, dict[str, Any]], saved_html: str
) -> None:
    """with one setting, a bar per method on 0-100 % (not two dots on an
    autoscaled axis); several settings are drawn on 0-100 % too; the oracle row's difference
    from the global-scope rows is explained."""
    _, results = saved_run
    first = next(iter(results["settings"]))
    one = {**results, "settings": {first: results["settings"][first]}}
    fig = macro_figure(one)
    methods = {r["method"] for r in one["settings"][first]["rows"]}
    for ax in fig.axes:
        assert ax.get_xlim() == (0.0, 100.0)
        assert len(ax.patches) == len(methods)  # one bar per method
    assert all(ax.get_ylim() == (0.0, 100.0) for ax in macro_figure(results).axes)
    assert "the oracle is a correctness check, not an upper bound" in saved_html
    assert "<code>gram_scope = global</code>" in saved_html
