"""HTML for run reports: one self-contained page, readable offline.

No external assets: styles inline, plots referenced by relative path beside
the page. A small inline script marks `<body data-images-loaded="k/n">` (and
`data-all-images-loaded="true"` when k = n) once every image decoded, so a
headless browser can check the page without a human looking at it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from html import escape

from kvswap.obs.finding import Finding
from kvswap.obs.jsonvalues import integer_or, lookup, number_or
from kvswap.obs.loadgen_findings import CHECKED
from kvswap.obs.plots import PLOT_TITLES
from kvswap.units import format_bytes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1700px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr.diff td { background: #fff6d6; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 1em; }
.plots figure { margin: 0; } .plots img { width: 100%; height: auto; border: 1px solid #ddd; }
.finding { border-left: 4px solid #d9822b; padding: 0.3em 0.8em; margin: 0.5em 0;
  background: #fdf5ec; }
.ok { border-left: 4px solid #3a9a4a; padding: 0.3em 0.8em; background: #eef8ef; }
code { font-size: 0.9em; } .muted { color: #666; }
"""
_SCRIPT = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var ok = images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-loaded", ok + "/" + images.length);
  if (ok === images.length) { document.body.setAttribute("data-all-images-loaded", "true"); }
});
"""

Row = tuple[str, Callable[[Mapping[str, object]], str]]


def _pct(key: str) -> Callable[[Mapping[str, object]], str]:
    def cell(summary: Mapping[str, object]) -> str:
        return "  ".join(f"{q} {number_or(summary, key, q):.2f}" for q in ("p50", "p95", "p99"))

    return cell


def _bytes(direction: str) -> Callable[[Mapping[str, object]], str]:
    def cell(summary: Mapping[str, object]) -> str:
        text = format_bytes(integer_or(summary, f"bytes_{direction}"))
        gb_per_s = lookup(summary, f"{direction}_gb_per_s")
        return f"{text} at {gb_per_s:.2f} GB/s" if isinstance(gb_per_s, int | float) else text

    return cell


SUMMARY_ROWS: tuple[Row, ...] = (
    ("requests completed", lambda s: f"{integer_or(s, 'requests_completed')} "
     f"({integer_or(s, 'requests_rejected')} rejected)"),
    ("tokens generated", lambda s: str(integer_or(s, "tokens_generated"))),
    ("duration (s)", lambda s: f"{number_or(s, 'duration_s'):.2f}"),
    ("throughput (tok/s)", lambda s: f"{number_or(s, 'throughput_tok_s'):.1f}"),
    ("TTFT (ms)", _pct("ttft_ms")),
    ("TPOT (ms)", _pct("tpot_ms")),
    ("token latency (ms)", _pct("itl_ms")),
    ("swap-wait share", lambda s: f"{100 * number_or(s, 'swap_wait_share'):.2f} % of step time"),
    ("GPU -> CPU", _bytes("gpu_to_cpu")),
    ("CPU -> GPU", _bytes("cpu_to_gpu")),
    ("CPU -> NVMe", _bytes("cpu_to_nvme")),
    ("NVMe -> CPU", _bytes("nvme_to_cpu")),
    ("pinned pool peak", lambda s: f"{100 * number_or(s, 'pinned_pool_utilization_peak'):.1f} %"),
    ("sync stalls", lambda s: str(integer_or(s, "sync_stalls"))),
    ("preemptions", lambda s: str(integer_or(s, "preemptions"))),
    ("recomputed tokens", lambda s: str(integer_or(s, "recomputed_tokens"))),
    ("protected block saves", lambda s: str(integer_or(s, "protected_block_saves"))),
    ("prefix hits (tokens)", lambda s: _mapping_text(lookup(s, "prefix_hit_tokens"))),
    ("evictions", lambda s: _mapping_text(lookup(s, "evictions_by_reason"))),
    ("outputs digest", lambda s: str(lookup(s, "outputs_digest") or "")[:16]),
)  # fmt: skip


def _count_or_dash(summary: Mapping[str, object], key: str) -> str:
    value = lookup(summary, key)
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "-"


def _requests_cell(s: Mapping[str, object]) -> str:
    return (
        f"{integer_or(s, 'requests_completed')} completed, {integer_or(s, 'requests_failed')} "
        f"failed, {integer_or(s, 'requests_cancelled')} cancelled "
        f"({integer_or(s, 'requests_sent')} sent of {integer_or(s, 'requests_planned')})"
    )


def _goodput_cell(s: Mapping[str, object]) -> str:
    slos = [
        f"{name} <= {value:g} ms"
        for name, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
        if isinstance(value := lookup(s, key), int | float) and not isinstance(value, bool)
    ]
    within = " and ".join(slos) if slos else "no SLO given"
    return (
        f"{number_or(s, 'goodput_requests_per_s'):.2f} ({integer_or(s, 'goodput_requests')} of "
        f"{integer_or(s, 'requests_completed')} requests; {within})"
    )


def _cached_cell(s: Mapping[str, object]) -> str:
    share = lookup(s, "cached_token_share")
    if not isinstance(share, int | float) or isinstance(share, bool):
        return f"{_count_or_dash(s, 'cached_tokens')} (not reported by the server)"
    return f"{_count_or_dash(s, 'cached_tokens')} ({100 * share:.1f} % of prompt tokens)"


def _prompt_length_cell(s: Mapping[str, object]) -> str:
    ratio = lookup(s, "prompt_length", "sent_per_intended")
    if not isinstance(ratio, Mapping):
        return "- (the server reported no usage.prompt_tokens)"
    return (
        f"{number_or(ratio, 'p50'):.2f}x at the median ({number_or(ratio, 'min'):.2f}x to "
        f"{number_or(ratio, 'max'):.2f}x over {integer_or(s, 'prompt_length', 'requests')} "
        "requests)"
    )


#: A load test of a server (`kvswap loadgen`): what the client measured.
LOADGEN_SUMMARY_ROWS: tuple[Row, ...] = (
    ("requests", _requests_cell),
    ("duration (s)", lambda s: f"{number_or(s, 'duration_s'):.2f}"),
    ("request throughput (req/s)", lambda s: f"{number_or(s, 'requests_per_s'):.2f}"),
    ("output throughput (tok/s)", lambda s: f"{number_or(s, 'throughput_tok_s'):.1f}"),
    ("goodput (req/s)", _goodput_cell),
    ("TTFT (ms)", _pct("ttft_ms")),
    ("TPOT (ms)", _pct("tpot_ms")),
    ("inter-token latency (ms)", _pct("itl_ms")),
    ("end-to-end latency (ms)", _pct("e2e_latency_ms")),
    ("send delay (ms)", _pct("send_delay_ms")),
    ("output tokens", lambda s: str(integer_or(s, "tokens_generated"))),
    ("prompt tokens", lambda s: _count_or_dash(s, "prompt_tokens")),
    ("sent / intended prompt", _prompt_length_cell),
    ("cached prompt tokens", _cached_cell),
    ("errors", lambda s: _mapping_text(lookup(s, "errors_by_kind"))),
    ("stopped by", lambda s: str(lookup(s, "stopped_by") or "end of workload")),
)

NO_FINDING = "No rule fired: the four numbers look healthy."
#: A load test where no rule fired says what was checked (never "healthy").
LOADGEN_NO_FINDING = CHECKED


def _mapping_text(value: object) -> str:
    if not isinstance(value, Mapping) or not value:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in value.items())


def flatten(data: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """{'swap.swap_out_high_watermark': '0.85', ...} for a nested config."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = "-" if value is None else str(value)
    return out


def run_rows(run: Mapping[str, object], summary: Mapping[str, object]) -> list[tuple[str, str]]:
    """What ran: the command's own facts, then the driver's (device, model, block size)."""
    rows = [(str(k), str(v)) for k, v in run.items() if k != "label"]
    for key in ("device", "hardware", "model", "preemption", "block_bytes"):
        if key in summary and key not in run:
            rows.append((key, str(summary[key])))
    return rows


def table(header: Sequence[str], rows: Sequence[Sequence[str]], diff: Sequence[bool] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = ' class="diff"' if i < len(diff) and diff[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _findings(findings: Sequence[Finding], empty_text: str = NO_FINDING) -> str:
    if not findings:
        return f'<p class="ok">{escape(empty_text)}</p>'
    return "".join(
        f'<div class="finding"><b>{escape(f.symptom)}</b> &mdash; {escape(f.figure)}<br>'
        f"cause: {escape(f.cause)}<br>advice: {escape(f.advice)}<br>"
        f'<span class="muted">metric: <code>{escape(f.metric)}</code></span></div>'
        for f in findings
    )


def _plots(plots: Mapping[str, str]) -> str:
    figures = "".join(
        f'<figure><img src="{escape(file)}" alt="{escape(PLOT_TITLES.get(name, name))}"></figure>'
        for name, file in plots.items()
    )
    return f'<div class="plots">{figures}</div>'


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_STYLE}</style>"
        f"<script>{_SCRIPT}</script></head>\n<body><h1>{escape(title)}</h1>\n{body}\n"
        f"</body></html>\n"
    )


def run_page(
    title: str,
    run: Mapping[str, object],
    summary: Mapping[str, object],
    config: Mapping[str, object],
    findings: Sequence[Finding],
    plots: Mapping[str, str],
    rows: Sequence[Row] = SUMMARY_ROWS,
    no_finding: str = NO_FINDING,
    sections: Sequence[tuple[str, str]] = (),
) -> str:
    """`sections`: (title, HTML) shown after the summary (a load test's own tables)."""
    summary_rows = [(label, cell(summary)) for label, cell in rows]
    config_rows = sorted(flatten(config).items())
    raw = sorted((k, str(v)) for k, v in summary.items() if k not in ("rejections", "diagnosis"))
    body = (
        f"{table(('run', ''), run_rows(run, summary))}"
        f"<h2>Diagnosis</h2>{_findings(findings, no_finding)}"
        f"<h2>Plots</h2>{_plots(plots)}"
        f"<h2>Summary</h2>{table(('metric', 'value'), summary_rows)}"
        + "".join(f"<h2>{escape(title)}</h2>{html}" for title, html in sections)
        + f"<h2>Configuration</h2>{table(('setting', 'value'), config_rows)}"
        f"<details><summary>every summary key</summary>{table(('key', 'value'), raw)}</details>"
        '<p class="muted">Data: <a href="report.json">report.json</a></p>'
    )
    return _page(title, body)


def comparison_page(
    title: str,
    labels: Sequence[str],
    links: Sequence[str],
    summaries: Sequence[Mapping[str, object]],
    configs: Sequence[Mapping[str, object]],
    findings: Sequence[Sequence[Finding]],
    changes: Sequence[Finding | None],
    plots: Mapping[str, str],
    rows: Sequence[Row] = SUMMARY_ROWS,
    no_finding: str = NO_FINDING,
) -> str:
    header = ("", *labels)
    summary_rows = [[label] + [cell(s) for s in summaries] for label, cell in rows]
    flat = [flatten(c) for c in configs]
    keys = sorted({k for f in flat for k in f})
    config_rows = [[k] + [f.get(k, "-") for f in flat] for k in keys]
    differs = [len(set(row[1:])) > 1 for row in config_rows]
    runs = "".join(
        f'<li><a href="{escape(link)}">{escape(label)}</a></li>'
        for label, link in zip(labels, links, strict=True)
    )
    diagnosis = "".join(
        f"<h3>{escape(label)}</h3>{_findings(found, no_finding)}"
        + (f"<p>Compared with {escape(labels[0])}:</p>{_findings([change])}" if change else "")
        for label, found, change in zip(labels, findings, changes, strict=True)
    )
    body = (
        f"<ul>{runs}</ul><h2>Plots (runs overlaid)</h2>{_plots(plots)}"
        f"<h2>Summary</h2>{table(header, summary_rows)}"
        f"<h2>Diagnosis</h2>{diagnosis}"
        f"<h2>Configuration</h2><p class='muted'>Highlighted rows differ between runs.</p>"
        f"{table(header, config_rows, differs)}"
    )
    return _page(title, body)
