"""What `kvswap serve` tells its operator, as vLLM prints it: one logger, plain lines.

    INFO 12-02 01:23:45 kvswap serve: model small (fp32 on cpu), 16-token blocks; tiers:
         GPU 256 blocks (4,096 tokens), CPU 512 blocks (8,192 tokens), NVMe -, remote -;
         up to 16 running sequences, a request at most 4,064 tokens
    INFO ... kvswap serve: listening on http://127.0.0.1:8000
    INFO ... request 7: 200, prompt 512 tokens (480 cached), 16 generated, TTFT 35.2 ms, stop
    INFO ... stats: prompt 812.0 tok/s, generation 96.5 tok/s; 4 running, 2 waiting;
         KV GPU 81.2 %, CPU 40.0 %, NVMe 0.0 %; link out 1.20 / in 0.80 GB/s; swap wait 2.1 %
    WARNING ... request refused (413): the prompt has 9000 tokens; allowed: at most 4064

Access lines (one per request that reached the engine) go with
`--disable-log-requests`; the stats line (every `--log-stats-interval-s`, only
after steps ran) with `--disable-log-stats`. Refusals (400 / 413 / 429), aborts,
disconnects and the drain are always said.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from kvswap.obs.observer import StepObserver, StepSample

LOGGER_NAME = "kvswap.serve"
DEFAULT_STATS_INTERVAL_S = 10.0  # vLLM's log-stats interval

log = logging.getLogger(LOGGER_NAME)


def configure_server_log(*, log_requests: bool) -> None:
    """Send `kvswap.serve` lines to stderr as `LEVEL MM-DD HH:MM:SS message` (vLLM's
    shape); `log_requests` False keeps the per-request access lines out."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S")
    )
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    # By level, not `disabled`: uvicorn's logging config re-enables every existing logger.
    access_log.setLevel(logging.INFO if log_requests else logging.WARNING)


#: The per-request access lines, a child logger so they can be silenced alone.
access_log = logging.getLogger(f"{LOGGER_NAME}.access")


@dataclass(frozen=True)
class RequestLine:
    """One request's access line."""

    request_id: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    finish_reason: str

    def text(self) -> str:
        ttft = f"TTFT {self.ttft_s * 1e3:.1f} ms" if self.ttft_s is not None else "no token"
        return (
            f"request {self.request_id}: 200, prompt {self.prompt_tokens} tokens "
            f"({self.cached_tokens} cached), {self.completion_tokens} generated, {ttft}, "
            f"{self.finish_reason}"
        )


class StatsLine(StepObserver):
    """Every `interval_s` of wall time in which steps ran: one line of the run's rates
    and occupancy since the previous line (a StepObserver on the engine thread)."""

    def __init__(self, interval_s: float = DEFAULT_STATS_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: StepSample | None = None
        self._last_wall_s = time.monotonic()
        self._prompt_tokens = 0  # computed since the last line

    def on_step(self, sample: StepSample) -> None:
        self._prompt_tokens += sample.num_prefill_tokens
        now_s = time.monotonic()
        if self._last is None:
            self._last, self._last_wall_s = sample, now_s
            return
        if now_s - self._last_wall_s < self.interval_s:
            return
        log.info(stats_text(self._last, sample, now_s - self._last_wall_s, self._prompt_tokens))
        self._last, self._last_wall_s, self._prompt_tokens = sample, now_s, 0


def stats_text(before: StepSample, now: StepSample, wall_s: float, prompt_tokens: int) -> str:
    """The stats line for the steps between two samples, `wall_s` apart."""
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0
    generated_tokens = now.tokens_generated - before.tokens_generated
    tiers = ", ".join(
        f"{tier.upper() if tier != 'nvme' else 'NVMe'} "
        f"{100 * now.used_blocks_by_tier.get(tier, 0) / capacity:.1f} %"
        for tier, capacity in now.capacity_blocks_by_tier.items()
        if capacity
    )

    def gb_per_s(direction: str) -> float:
        moved_bytes = now.bytes_by_direction.get(direction, 0) - before.bytes_by_direction.get(
            direction, 0
        )
        return moved_bytes * per_s / 1e9

    step_s = now.step_total_s - before.step_total_s
    waited_s = now.swap_wait_total_s - before.swap_wait_total_s
    return (
        f"stats: prompt {prompt_tokens * per_s:.1f} tok/s, generation "
        f"{generated_tokens * per_s:.1f} tok/s; {now.num_running} running, "
        f"{now.num_waiting} waiting; KV {tiers or '-'}; "
        f"link out {gb_per_s('gpu_to_cpu'):.2f} / in {gb_per_s('cpu_to_gpu'):.2f} GB/s; "
        f"swap wait {100 * waited_s / step_s if step_s > 0 else 0.0:.1f} %"
    )
