"""The simulator against the real engine: predicted / measured on the same workload.

1. Run the CPU reference engine (the `small` preset, 100M parameters, fp32) on a
   multi-turn workload whose KV is several times its device pool.
2. Describe this machine as a hardware profile: the host<->"device" link from
   `kvswap bench` (run here, on the CPU: memory copies, one shared bus, LOW
   chunks yielding to HIGH between blocks, as the CPU copy engine does), the
   per-chunk overhead of the real copy engine (a 1-block round trip through its
   worker thread), and the model's step cost measured here (fixed overhead,
   weight-streaming rate for decode, FLOP rate for prefill; efficiencies 1).
3. Simulate the same config and workload with that profile and the same
   scheduler, swapper and policy code.

Prints predicted / measured for throughput, swap-wait share and bytes moved per
direction, then one JSON line.

    .venv/bin/python benchmarks/calibration.py            # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.bench.bandwidth import run_bandwidth_bench
from kvswap.config_load import load_config
from kvswap.control.scheduler_records import ScheduledSeq, StepPlan
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.model.presets import preset_description
from kvswap.sim.hardware import hardware_from_report, hardware_preset
from kvswap.sim.simulator import Simulator
from kvswap.units import GIB, MIB
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic
from machine import add_out_argument, keep_result

CONFIG: dict[str, object] = {
    "kv_block_tokens": 16, "gpu_kv_capacity_blocks": 30, "cpu_kv_capacity_blocks": 256,
    "protected_sink_blocks": 2, "max_num_seqs": 8, "device": "cpu", "preset": "small",
    "dtype": "fp32",
}  # fmt: skip


def time_forward(engine: Engine, query_lens: list[int], context_lens: list[int]) -> float:
    """Median seconds of one engine step's model work (`ModelRunner.run`: batch
    building, the forward over the device pool, sampling): 9 timed after 2 warm-up."""
    num_slots = engine.capacities.num_gpu_blocks
    seqs = tuple(
        ScheduledSeq(index, (0,) * q, c - q, True)
        for index, (q, c) in enumerate(zip(query_lens, context_lens, strict=True))
    )
    tables = {
        index: [i % num_slots for i in range(-(-c // 16))] for index, c in enumerate(context_lens)
    }
    plan = StepPlan(0, seqs, 0.0)
    times = []
    with torch.inference_mode():
        for repeat in range(11):
            start_s = time.perf_counter()
            engine.runner.run(plan, tables)
            if repeat >= 2:
                times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def measure_compute(engine: Engine, num_params: int) -> dict[str, float]:
    """Fit step = overhead + seqs x per-seq overhead + max(bytes / rate, flops / rate)
    to measured forwards: FLOP rate and fixed cost by least squares over one-sequence
    prefill chunks (compute-bound); the byte rate from a 1-token decode (weight
    streaming); the per-sequence cost from 8 decodes at 256 tokens vs 1."""
    sizes = (32, 64, 128, 256)
    prefill = [time_forward(engine, [q], [q]) for q in sizes]
    slope, intercept = _line(sizes, prefill)
    fixed_s = max(0.0, intercept)  # step + one sequence's overhead
    decode_s = time_forward(engine, [1], [16])
    weights_bytes = num_params * 4
    bytes_per_s = weights_bytes / max(decode_s - fixed_s, 1e-6)
    batch_s = time_forward(engine, [1] * 8, [256] * 8)
    kv_bytes = 8 * 256 * engine.layout.block_bytes // 16
    seq_overhead_s = max(0.0, (batch_s - decode_s - kv_bytes / bytes_per_s) / 7)
    return {
        "overhead_s": max(0.0, fixed_s - seq_overhead_s), "seq_overhead_s": seq_overhead_s,
        "flops_per_s": 2 * num_params / slope, "bytes_per_s": bytes_per_s,
        **{f"prefill_{q}_s": t for q, t in zip(sizes, prefill, strict=True)},
        "decode_1_s": decode_s, "decode_8x256_s": batch_s,
    }  # fmt: skip


def _line(xs: tuple[int, ...], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


def measure_chunk_overhead(engine: Engine, link_gb_per_s: float) -> float:
    """Seconds one chunk costs beyond its bytes on the real CPU copy engine (submit,
    worker hand-off, completion): median of 1-block GPU->CPU round trips."""
    block_bytes = engine.layout.block_bytes
    times = []
    for index in range(25):
        chunk = TransferChunk(10_000_000 + index, Direction.GPU_TO_CPU, Priority.LOW, (0,), (0,),
                              block_bytes)  # fmt: skip
        start_s = time.perf_counter()
        engine.copy_engine.submit(chunk)
        engine.copy_engine.wait(chunk.transfer_id)
        times.append(time.perf_counter() - start_s)
    return max(0.0, statistics.median(times[5:]) - block_bytes / (link_gb_per_s * 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--output-tokens", type=int, default=32)
    add_out_argument(parser)
    args = parser.parse_args()
    config = load_config(None, overrides=CONFIG)
    workload = generate_synthetic(SyntheticSpec(
        num_sessions=args.num_sessions, turns_per_session=args.turns,
        prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        user_tokens_per_turn=32, system_prompt_tokens=32, seed=0,
    ))  # fmt: skip
    shape = preset_description("small")
    assert shape.num_params is not None
    with Engine(engine_settings(config, EngineOptions("small"))) as engine:
        block_bytes = engine.layout.block_bytes
        compute = measure_compute(engine, shape.num_params)
        bench = run_bandwidth_bench(
            device="cpu",
            block_bytes=block_bytes,
            chunk_blocks=(1, 4, 8),
            repeats=5,
            max_bytes=16 * MIB,
        )
        link = hardware_from_report(bench, hardware_preset("article-40gb"), source="bench")
        chunk_overhead_s = measure_chunk_overhead(engine, link.d2h_gb_per_s)
        measured = engine.run(workload).to_json()  # fmt: skip
    weights_bytes = shape.num_params * 4
    hardware = dataclasses.replace(
        link, name="this-machine", description="this machine's CPU, measured",
        transfer_overhead_s=chunk_overhead_s,
        gpu_mem_bytes=weights_bytes + 2 * GIB, host_mem_bytes=4 * GIB, gpu_reserve_bytes=0,
        hbm_gb_per_s=compute["bytes_per_s"] / 1e9, peak_tflops=compute["flops_per_s"] / 1e12,
        mem_efficiency=1.0, compute_efficiency=1.0, step_overhead_s=compute["overhead_s"],
        seq_overhead_s=compute["seq_overhead_s"],
    )  # fmt: skip
    predicted = Simulator(config, hardware, shape=shape).run(workload).to_json()
    rows = [
        ("throughput_tok_s", "throughput (tok/s)"),
        ("swap_wait_share", "swap-wait share"),
        ("bytes_gpu_to_cpu", "bytes GPU -> CPU"),
        ("bytes_cpu_to_gpu", "bytes CPU -> GPU"),
        ("num_steps", "steps"),
        ("duration_s", "duration (s)"),
    ]
    print(f"link (memcpy) {hardware.d2h_gb_per_s:.2f} GB/s, chunk overhead "
          f"{hardware.transfer_overhead_s * 1e6:.0f} us; compute: overhead "
          f"{compute['overhead_s'] * 1e3:.1f} ms + {compute['seq_overhead_s'] * 1e3:.1f} ms per "
          f"sequence, {compute['flops_per_s'] / 1e9:.1f} GFLOP/s, "
          f"weights streamed at {compute['bytes_per_s'] / 1e9:.2f} GB/s")  # fmt: skip
    print(f"{'figure':<22}{'measured':>16}{'predicted':>16}{'predicted/measured':>20}")
    figures: dict[str, object] = {"compute": compute, "link_gb_per_s": hardware.d2h_gb_per_s,
                                  "transfer_overhead_s": hardware.transfer_overhead_s}  # fmt: skip
    for key, label in rows:
        m, p = float(measured[key]), float(predicted[key])  # type: ignore[arg-type]
        ratio = p / m if m else None
        figures[key] = {"measured": m, "predicted": p, "ratio": ratio}
        shown = "n/a" if ratio is None else f"{ratio:.3f}"
        print(f"{label:<22}{m:>16.4g}{p:>16.4g}{shown:>20}")
    print(json.dumps(figures))
    keep_result(args.out, "calibration", "calibration.py", None, figures)


if __name__ == "__main__":
    main()
