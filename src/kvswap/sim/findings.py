"""The seed article's five findings, measured side by side in the simulator.

Every finding runs the seed article's configuration (8B model, 40 GB GPU, PCIe
4.0, its watermarks and chunks) twice on the same seeded workloads, changing
one thing, and reports worse / better as a ratio:

    1  swap_out_chunk_blocks 512 vs 8        P99 token latency
    2  swap_out_high_watermark 1.0 vs 0.85   synchronous stalls (P99 in the note)
    3  pageable vs pinned host memory        P99 token latency (jitter)
    4  LRU without vs with sink protection   swap-ins of sink blocks
    5  min_residency_steps 0 vs 64           re-swaps (ping-pong)

Two workloads, both multi-turn chat over shared system prompts with KV at its
peak several times the GPU tier. CHAT (findings 1-3) is decode-heavy, so the
token-latency tail is set by conversations swapped back in; with long prompts
and short answers the P99 would be a 2048-token prefill step (~190 ms on this
hardware) whatever the swap settings. BURST (findings 4-5) admits sessions
faster than the GPU holds them, so paused sequences are preempted, prefetched
and resumed all the time.

Every finding runs on the `article-40gb` profile, whose host<->device copies
share ONE copy engine (`HardwareProfile.shared_copy_engine`), as the seed article's
"held the DMA engine" implies; finding 1 is also run with one engine per
direction, to separate the PCIe stall from the NVMe one.

What the model says about the mechanisms (see benchmarks/article_findings.py):
1. A HIGH chunk waits for at most the one LOW chunk holding its link (priority
   queues; a DMA chunk is not preempted), so a 1 GiB chunk adds <= 43 ms per
   swap-in at 25 GB/s, on a shared engine only: with one engine per direction
   (PCIe is full duplex) a GPU->CPU swap-out never delays a CPU->GPU swap-in.
   How often a swap-in meets a big chunk depends on the workload: kvswap offloads
   a finished turn at once and only its new blocks (a CPU copy of the earlier
   turns stays valid), so in CHAT most swap-out chunks are ~20 blocks whatever
   the cap, and the big ones (a first turn's whole prompt, ~190 blocks = ~16 ms,
   the seed article's "~20 ms") are rare: the link is busy ~3% of the time, so few
   swap-ins meet one, and the P99 rise on the shared engine is about the one on
   separate engines. It comes from the NVMe drive, which has the same stall: a
   512-block demotion (~215 ms at 5 GB/s) holds it against restores, whatever
   the PCIe engines.
2. kvswap offloads finished requests at once, so at 100% occupancy most GPU
   victims are clean copies whose eviction is a free drop: few synchronous
   stalls in absolute terms; the cost of 1.0 shows as many more preemptions and
   a higher P99.
5. The window stops prefetched blocks from being evicted before use, but
   preemption ignores it (`Swapper.swap_out_sequence`) and the window pins
   young blocks, so the scheduler preempts more, often the sequence it just
   resumed: per seed the effect can go either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvswap.config import KvSwapConfig
from kvswap.config_load import load_config
from kvswap.control.policy import PolicyOptions
from kvswap.progress import StageProgress as Progress
from kvswap.sim.hardware import HardwareProfile, copy_engines, hardware_preset
from kvswap.sim.simulator import SimOptions, Simulator, blocked_summary
from kvswap.workload.request import Workload
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

#: The seed article's starting configuration (configs/article-8b-40gb.toml), inline so
#: the findings do not depend on the working directory.
ARTICLE_SETTINGS: dict[str, object] = {
    "kv_block_tokens": 16, "gpu_kv_capacity_blocks": 3000, "cpu_kv_capacity_blocks": 12000,
    "nvme_kv_capacity_blocks": 40000, "swap_out_high_watermark": 0.85,
    "swap_in_low_watermark": 0.65, "evict_protected_blocks": 8, "swap_out_chunk_blocks": 8,
    "swap_in_chunk_blocks": 4, "prefetch_stream_count": 2, "nvme_dir": "/var/tmp/kvswap",
    "preset": "article-8b", "dtype": "fp16",
}  # fmt: skip


@dataclass(frozen=True)
class FindingsScale:
    """A seeded multi-turn chat workload over shared system prompts."""

    num_sessions: int
    turns_per_session: int
    prompt_tokens: int
    output_tokens: int
    user_tokens_per_turn: int
    arrival_rate_per_s: float
    think_time_s: float
    system_prompt_tokens: int = 512
    num_system_prompts: int = 4
    seed: int = 0

    def workload(self) -> Workload:
        return generate_synthetic(
            SyntheticSpec(
                num_sessions=self.num_sessions, turns_per_session=self.turns_per_session,
                prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
                user_tokens_per_turn=self.user_tokens_per_turn,
                system_prompt_tokens=self.system_prompt_tokens,
                num_system_prompts=self.num_system_prompts,
                arrival_rate_per_s=self.arrival_rate_per_s, think_time_s=self.think_time_s,
                length_jitter=0.3, seed=self.seed,
            )
        )  # fmt: skip


#: Decode-heavy chat (six turns, short user messages): the token-latency tail is set
#: by swap-ins of conversations coming back, not by prefill chunks (findings 1-3).
CHAT = FindingsScale(num_sessions=64, turns_per_session=6, prompt_tokens=3000,
                     output_tokens=256, user_tokens_per_turn=64, arrival_rate_per_s=2.0,
                     think_time_s=1.0)  # fmt: skip
#: Sessions arriving faster than the GPU holds them: preemption, resume and prefetch
#: of paused sequences all the time (findings 4-5).
BURST = FindingsScale(num_sessions=96, turns_per_session=3, prompt_tokens=3000,
                      output_tokens=160, user_tokens_per_turn=300, arrival_rate_per_s=6.0,
                      think_time_s=2.0)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    number: int
    title: str
    metric: str
    worse_label: str
    better_label: str
    worse_value: float
    better_value: float
    reproduced: bool
    note: str
    hardware: str  # the profile both runs used, with its copy engines
    worse_summary: dict[str, object] = dataclasses.field(repr=False, compare=False)
    better_summary: dict[str, object] = dataclasses.field(repr=False, compare=False)

    @property
    def ratio(self) -> float | None:
        """worse / better; None when `better` is 0 (then the worse run alone shows it)."""
        return self.worse_value / self.better_value if self.better_value else None

    def to_json(self) -> dict[str, object]:
        ratio = self.ratio
        return {
            "finding": self.number, "title": self.title, "metric": self.metric,
            "worse": self.worse_label, "better": self.better_label,
            "worse_value": self.worse_value, "better_value": self.better_value,
            "ratio": None if ratio is None else round(ratio, 3), "reproduced": self.reproduced,
            "note": self.note, "hardware": self.hardware,
        }  # fmt: skip


#: worse / better above this counts as reproduced.
REPRODUCED_RATIO = 1.05


def article_config(**overrides: object) -> KvSwapConfig:
    return load_config(None, overrides=overrides, defaults=ARTICLE_SETTINGS)


def simulate(
    workload: Workload,
    *,
    hardware: HardwareProfile | None = None,
    options: SimOptions | None = None,
    **overrides: object,
) -> dict[str, object]:
    """One run's summary, plus `swap_in_blocked_by_link`: the waits swap-out chunks
    imposed on swap-ins per link ("pcie" or "gpu_to_cpu"/"cpu_to_gpu", "nvme")."""
    hw = hardware if hardware is not None else ARTICLE_HARDWARE
    simulator = Simulator(article_config(**overrides), hw, options=options)
    summary = simulator.run(workload).to_json()
    summary["copy_engines"] = copy_engines(hw)
    summary["swap_in_blocked_by_link"] = {
        name: blocked_summary(delays_s)
        for name, delays_s in simulator.copy_engine.high_blocked_by_low_s_by_link.items()
    }
    return summary


def p99_itl_ms(summary: dict[str, object]) -> float:
    itl = summary["itl_ms"]
    assert isinstance(itl, dict)
    return float(itl["p99"])


def count(key: str) -> Callable[[dict[str, object]], float]:
    def read(summary: dict[str, object]) -> float:
        value = summary[key]
        assert isinstance(value, int | float)
        return float(value)

    return read


#: The seed article's machine: one copy engine shared by both directions (see hardware.py).
ARTICLE_HARDWARE = hardware_preset("article-40gb")
#: The same machine with one copy engine per direction: finding 1's contrast.
SEPARATE_ENGINES_HARDWARE = dataclasses.replace(
    ARTICLE_HARDWARE, name="article-40gb/separate-engines", shared_copy_engine=False
)

#: variant -> (article-config overrides, simulator options, hardware profile)
Variant = tuple[dict[str, object], SimOptions, HardwareProfile]
_CHUNK_512: dict[str, object] = {"swap_out_chunk_blocks": 512}
CHAT_VARIANTS: dict[str, Variant] = {
    "article": ({}, SimOptions(), ARTICLE_HARDWARE),
    "chunk_512": (_CHUNK_512, SimOptions(), ARTICLE_HARDWARE),
    "high_watermark_1.0": ({"swap_out_high_watermark": 1.0}, SimOptions(), ARTICLE_HARDWARE),
    "pageable": ({}, SimOptions(pinned_host=False), ARTICLE_HARDWARE),
    "article_separate_engines": ({}, SimOptions(), SEPARATE_ENGINES_HARDWARE),
    "chunk_512_separate_engines": (_CHUNK_512, SimOptions(), SEPARATE_ENGINES_HARDWARE),
}
BURST_VARIANTS: dict[str, Variant] = {
    "article": ({}, SimOptions(), ARTICLE_HARDWARE),
    "no_sink_protection": (
        {}, SimOptions(policy=PolicyOptions(sink_protection=False)), ARTICLE_HARDWARE,
    ),
    "min_residency_0": ({"min_residency_steps": 0}, SimOptions(), ARTICLE_HARDWARE),
}  # fmt: skip

Summaries = dict[str, list[dict[str, object]]]  # variant -> one summary per seed


def run_variants(
    scale: FindingsScale,
    variants: dict[str, Variant],
    seeds: tuple[int, ...] = (0,),
    *,
    progress: Progress | None = None,
) -> Summaries:
    """Every variant on the workload of each seed (the same workloads for all)."""
    results: Summaries = {}
    for seed in seeds:
        workload = dataclasses.replace(scale, seed=seed).workload()
        for name, (overrides, options, hw) in variants.items():
            summary = simulate(workload, hardware=hw, options=options, **overrides)
            results.setdefault(name, []).append(summary)
            if progress is not None:
                progress(f"seed {seed} {name}: P99 {p99_itl_ms(summary):.1f} ms")
    return results


def mean_p99(summaries: list[dict[str, object]]) -> float:
    return sum(p99_itl_ms(s) for s in summaries) / len(summaries)


def total(key: str) -> Callable[[list[dict[str, object]]], float]:
    return lambda summaries: sum(count(key)(s) for s in summaries)


def blocked_ms(
    summaries: list[dict[str, object]], link: str | None = None, key: str = "total_ms"
) -> float:
    """Swap-in waits imposed by swap-out chunks, summed over seeds (`key` "max_ms":
    the worst); on every link, or on `link` alone (0 where the run had no such link)."""
    values = []
    for summary in summaries:
        blocked = summary["swap_in_blocked_by_swap_out"]
        if link is not None:
            by_link = summary["swap_in_blocked_by_link"]
            assert isinstance(by_link, dict)
            blocked = by_link.get(link, {key: 0.0})
        assert isinstance(blocked, dict)
        values.append(float(blocked[key]))
    return max(values, default=0.0) if key == "max_ms" else sum(values)


def hardware_label(summaries: list[dict[str, object]]) -> str:
    """The profile a variant ran on, with its copy engines (from `simulate`)."""
    first = summaries[0]
    return f"{first['hardware']} ({first['copy_engines']})"


def findings(chat: Summaries, burst: Summaries) -> list[Finding]:
    """The five findings from `run_variants` outputs (separate-engine runs optional)."""

    def pair(
        number: int, title: str, metric: str, read: Callable[[list[dict[str, object]]], float],
        results: Summaries, worse: str, note: str,
    ) -> Finding:  # fmt: skip
        w, b = read(results[worse]), read(results["article"])
        reproduced = w > b * REPRODUCED_RATIO if b else w > 0
        hardware = hardware_label(results["article"])
        if hardware_label(results[worse]) != hardware:
            raise ValueError(f"finding {number}: {worse!r} and 'article' ran on other hardware")
        return Finding(number, title, metric, worse, "article", w, b, reproduced, note,
                       hardware, results[worse][0], results["article"][0])  # fmt: skip

    p99_note = (
        f"P99 {mean_p99(chat['high_watermark_1.0']):.1f} vs {mean_p99(chat['article']):.1f} ms"
    )
    return [
        pair(1, "swap-out chunk 512 vs 8 blocks", "P99 token latency (ms)", mean_p99, chat,
             "chunk_512", _chunk_note(chat)),
        pair(2, "high watermark 1.0 vs 0.85", "synchronous stalls", total("sync_stalls"), chat,
             "high_watermark_1.0", p99_note),
        pair(3, "pageable vs pinned host memory", "P99 token latency (ms)", mean_p99, chat,
             "pageable", "bandwidth x0.5 and seeded jitter on every GPU-leg chunk"),
        pair(4, "LRU without vs with sink protection", "swap-ins of sink blocks",
             total("sink_block_swap_ins"), burst, "no_sink_protection", ""),
        pair(5, "min residency 0 vs 64 steps", "re-swaps (swap-in within 64 steps of the last)",
             total("re_swaps"), burst, "min_residency_0",
             "per seed: " + ", ".join(
                 f"{int(count('re_swaps')(w))} vs {int(count('re_swaps')(b))}"
                 for w, b in zip(burst["min_residency_0"], burst["article"], strict=True))),
    ]  # fmt: skip


def _chunk_note(results: Summaries) -> str:
    big, small = results["chunk_512"], results["article"]
    pcie = "pcie" if "pcie" in small[0]["swap_in_blocked_by_link"] else "cpu_to_gpu"  # type: ignore[operator]
    note = (
        f"swap-ins waited behind swap-out chunks on the {pcie} link "
        f"{blocked_ms(big, pcie):.0f} vs {blocked_ms(small, pcie):.0f} ms in total "
        f"(worst {blocked_ms(big, pcie, 'max_ms'):.1f} vs {blocked_ms(small, pcie, 'max_ms'):.1f}"
        f" ms), behind NVMe demotions {blocked_ms(big, 'nvme'):.0f} vs "
        f"{blocked_ms(small, 'nvme'):.0f} ms"
    )
    if "chunk_512_separate_engines" in results:
        big_sep, small_sep = (
            results["chunk_512_separate_engines"],
            results["article_separate_engines"],
        )
        note += (
            f"; {hardware_label(big_sep)}: P99 {mean_p99(big_sep):.1f} vs "
            f"{mean_p99(small_sep):.1f} ms, NVMe waits {blocked_ms(big_sep, 'nvme'):.0f} vs "
            f"{blocked_ms(small_sep, 'nvme'):.0f} ms"
        )
    return note
