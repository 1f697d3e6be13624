"""`afl report`: one self-contained HTML file from an `afl simulate` results JSON.

Sections: data provenance (SURROGATE features flagged in a banner), the paper's Table II layout
(methods × settings × macro BACC / AUC in %, mAP in 0-1, best per column in bold), macro metrics
across settings, per-class bars per setting, ROC curves (when the results carry ``saved``
scores, :mod:`afl.lab.report.plots`), the site × class assignments, communication per method,
timings and parameters. CSS is inline and every plot is an inline base64 PNG: the file needs no
network and no other file. All text from the JSON is HTML-escaped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from afl.lab.report.plots import macro_plot, per_class_plot, roc_figures

__all__ = ["ReportError", "html_page", "html_table", "render_report", "write_report"]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;
margin-top:2em}
table{border-collapse:collapse;margin:.6em 0;font-size:.85em}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}
th{background:#f2f2f2}td.name,th.name,table.kv td{text-align:left}
tr.central td{background:#f7f7ff}
.banner{padding:.8em 1em;border-radius:4px;margin:1em 0;font-weight:600}
.surrogate{background:#fde2e1;border:2px solid #c0392b;color:#7b1d14}
.real{background:#e3f4e5;border:1px solid #3a7;color:#1f5e2e}
.note{color:#555;font-size:.9em}
img{max-width:100%;height:auto;display:block;margin:.5em 0}
.on{color:#1f7a3a;font-weight:700}table.assignment td{text-align:center}
"""


class ReportError(ValueError):
    """The file is not an `afl simulate` results JSON."""


def _cell(value: Any, *, percent: bool) -> str:
    if not isinstance(value, int | float):
        return "n/a"
    return f"{100 * value:.2f}" if percent else f"{value:.4f}"


def html_table(head: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "") -> str:
    """An HTML table; cells are given already escaped, the first column is left-aligned."""
    out = [f'<table class="{cls}">' if cls else "<table>", "<tr>"]
    out += [f'<th class="name">{h}</th>' if i == 0 else f"<th>{h}</th>" for i, h in enumerate(head)]
    out.append("</tr>")
    for row in rows:
        cells = [
            f'<td class="name">{c}</td>' if i == 0 else f"<td>{c}</td>" for i, c in enumerate(row)
        ]
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _methods(results: dict[str, Any]) -> list[str]:
    seen: dict[str, None] = {}
    for body in results["settings"].values():
        for row in body["rows"]:
            seen.setdefault(row["method"], None)
    return list(seen)


def _cells(results: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (row["method"], name): row
        for name, body in results["settings"].items()
        for row in body["rows"]
    }


def table_ii_html(results: dict[str, Any]) -> str:
    """Table II layout; the best value of each column is bold."""
    settings = list(results["settings"])
    cells = _cells(results)
    metrics = (("bacc", True), ("auc", True), ("map", False))
    best = {
        (s, m): max(
            (
                r["macro"][m]
                for (_, s2), r in cells.items()
                if s2 == s and r["macro"][m] is not None
            ),
            default=None,
        )
        for s in settings
        for m, _ in metrics
    }
    out = ['<table class="table-ii">', '<tr><th class="name" rowspan="2">method</th>']
    out += [f'<th colspan="3">{escape(s)}</th>' for s in settings]
    out.append("</tr><tr>" + "<th>BACC %</th><th>AUC %</th><th>mAP</th>" * len(settings) + "</tr>")
    for method in _methods(results):
        tds = [f'<td class="name">{escape(method)}</td>']
        for s in settings:
            row = cells.get((method, s))
            for m, pct in metrics:
                value = row["macro"][m] if row else None
                text = _cell(value, percent=pct) if row else ""
                bold = value is not None and value == best[(s, m)]
                tds.append(f"<td><b>{text}</b></td>" if bold else f"<td>{text}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    central = results.get("centralised")
    if central:
        m = central["macro"]
        values = "".join(f"<td>{_cell(m[k], percent=p)}</td>" for k, p in metrics) * len(settings)
        out.append(
            f'<tr class="central"><td class="name">{escape(central["method"])} '
            f"(same in every setting)</td>{values}</tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _oracle_note(results: dict[str, Any]) -> str:
    """Why the Theorem-1 oracle row may score differently from the federated rows it sits among
    (with ``gram_scope = global`` they are not the same estimator)."""
    rows = [row for body in results["settings"].values() for row in body["rows"]]
    has_oracle = any(str(r.get("method", "")).startswith("oracle") for r in rows)
    if not has_oracle or not any(r.get("gram_scope") == "global" for r in rows):
        return ""
    return (
        '<p class="note">The oracle row is the pooled ridge regression per coverage set (the '
        "rows of the sites that label each class; Theorem 1): it is what the federated method "
        "computes with <code>gram_scope = per-class</code>, exactly (the check below). With "
        "<code>gram_scope = global</code> the federated method pools one Gram matrix over every "
        "site, a different estimator, so its scores can be above or below the oracle's: the "
        "oracle is a correctness check, not an upper bound.</p>"
    )


def _theorem1_note(results: dict[str, Any]) -> str:
    checks = [
        f"{escape(s)}: {row['max_rel_diff_vs_federated_per_class']:.1e}"
        for s, body in results["settings"].items()
        for row in body["rows"]
        if isinstance(row.get("max_rel_diff_vs_federated_per_class"), int | float)
    ]
    if not checks:
        return ""
    return (
        '<p class="note">Theorem 1 check, max relative ‖W<sub>fed</sub> − W<sub>oracle</sub>‖ '
        "per class: " + ", ".join(checks) + "</p>"
    )


def _provenance(data: dict[str, Any]) -> str:
    if data.get("surrogate"):
        banner = (
            '<div class="banner surrogate">SURROGATE FEATURES: synthetic features stand in for '
            "image features; these figures are NOT the paper's and say nothing about clinical "
            "accuracy.</div>"
        )
    else:
        banner = '<div class="banner real">Features extracted from real images.</div>'
    rows = []
    for key, value in data.items():
        if isinstance(value, list) and len(value) > 20:
            text = f"{len(value)} entries (not shown)"
        elif isinstance(value, dict | list):
            text = json.dumps(value, ensure_ascii=False)
            if len(text) > 400:
                text = text[:400] + " …"
        else:
            text = str(value)
        rows.append((escape(str(key)), escape(text)))
    return banner + html_table(["field", "value"], rows, cls="kv")


def _assignments(results: dict[str, Any]) -> str:
    classes = list(results["data"]["classes"])
    parts = []
    for name, body in results["settings"].items():
        seed = f" (seed {body['seed']})" if body.get("seed") is not None else ""
        head = [f"{escape(name)}{escape(seed)}", *(escape(c) for c in classes)]
        rows = [
            [escape(site)]
            + ['<span class="on">✓</span>' if c in labelled else "·" for c in classes]
            for site, labelled in body["assignment"].items()
        ]
        parts.append(html_table(head, rows, cls="assignment"))
        for site, reasons in body.get("skipped", {}).items():
            parts.append(
                f'<p class="note">{escape(site)} skipped: {escape("; ".join(reasons))}</p>'
            )
    return "\n".join(parts)


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f'<span title="{int(n)} bytes">{value:.1f} {unit}</span>'
        value /= 1024
    return str(n)  # pragma: no cover


def _communication(results: dict[str, Any]) -> str:
    settings = list(results["settings"])
    cells = _cells(results)
    rows = []
    for method in _methods(results):
        comms = [
            cells[(method, s)].get("communication") if (method, s) in cells else None
            for s in settings
        ]
        if not any(comms):
            continue
        rounds = next((c["rounds"] for c in comms if c), "n/a")
        rows.append(
            [escape(method), escape(str(rounds))]
            + [
                f"↑ {_bytes(c['bytes_up_per_site'])} / ↓ {_bytes(c['bytes_down_per_site'])}"
                if c
                else ""
                for c in comms
            ]
        )
    if not rows:
        return '<p class="note">No communication accounting in these results.</p>'
    note = (
        '<p class="note">Bytes per site (the busiest site for analytic methods), computed for the '
        "in-process simulation (float64 payloads); on-the-wire figures come from the daemons.</p>"
    )
    return note + html_table(["method", "rounds", *(escape(s) for s in settings)], rows)


def _timings(results: dict[str, Any]) -> str:
    settings = list(results["settings"])
    cells = _cells(results)
    total = [
        (escape(k), f"{v:.3f}")
        for k, v in results.get("timings", {}).items()
        if isinstance(v, int | float)
    ]
    parts = [html_table(["phase", "seconds"], total)] if total else []
    rows = []
    for method in _methods(results):
        secs = [cells.get((method, s), {}).get("solve_s") for s in settings]
        if any(isinstance(x, int | float) for x in secs):
            rows.append(
                [escape(method)] + [f"{x:.3f}" if isinstance(x, int | float) else "" for x in secs]
            )
    if rows:
        parts.append('<p class="note">Seconds to solve (or train) each method:</p>')
        parts.append(html_table(["method", *(escape(s) for s in settings)], rows))
    return "\n".join(parts) or '<p class="note">No timings recorded.</p>'


def _params(results: dict[str, Any]) -> str:
    params = results.get("params") or {}
    rows = [(escape(str(k)), escape(json.dumps(v, ensure_ascii=False))) for k, v in params.items()]
    return html_table(["parameter", "value"], rows, cls="kv") if rows else ""


def _img(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{escape(alt)}">'


def render_report(
    results: dict[str, Any], *, base_dir: Path | None = None, title: str | None = None
) -> str:
    """The HTML text. ``base_dir`` resolves relative paths of the ``saved`` section."""
    if not isinstance(results, dict) or not isinstance(results.get("settings"), dict):
        raise ReportError("not an `afl simulate` results JSON (no 'settings' object)")
    if "data" not in results or "classes" not in results["data"]:
        raise ReportError("not an `afl simulate` results JSON (no 'data.classes')")
    title = title or "Analytic federated learning: simulation report"
    roc = roc_figures(results, base_dir=base_dir)
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="note">Features: {escape(str(results["data"].get("provenance", "unknown")))}</p>',
        "<h2>Data provenance</h2>",
        _provenance(results["data"]),
        "<h2>Results (Table II layout)</h2>",
        '<p class="note">Macro means over classes on the full test set: BACC and AUC in %, '
        "mAP in 0-1; best per column in bold.</p>",
        table_ii_html(results),
        _oracle_note(results),
        _theorem1_note(results),
    ]
    if results["settings"]:
        body += ["<h2>Macro metrics across settings</h2>", _img(macro_plot(results), "macro")]
        body.append("<h2>Per-class metrics</h2>")
        body += [_img(per_class_plot(results, s), f"per-class {s}") for s in results["settings"]]
    body += ["<h2>ROC curves</h2>", f'<p class="note">{escape(roc.note)}</p>']
    body += [_img(uri, f"ROC {s}") for s, uri in roc.figures.items()]
    body += [
        "<h2>Assignments (site × class labelled)</h2>",
        _assignments(results),
        "<h2>Communication per method</h2>",
        _communication(results),
        "<h2>Timings</h2>",
        _timings(results),
        "<h2>Parameters</h2>",
        _params(results),
    ]
    return html_page(title, body)


def html_page(title: str, body: Sequence[str]) -> str:
    """A self-contained page: the inline CSS and ``body`` (already escaped HTML parts)."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def write_report(results_path: Path, out_path: Path, *, title: str | None = None) -> Path:
    """Read a results JSON, render it and write the HTML; returns ``out_path``."""
    try:
        results = json.loads(results_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{results_path} is not JSON ({exc})") from exc
    html = render_report(results, base_dir=results_path.parent, title=title)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(html, encoding="utf-8")
    return out_path
