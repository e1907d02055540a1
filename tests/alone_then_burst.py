"""A Mooncake-format trace for the queueing tests: one request alone, then a burst.

The first request arrives alone and is long done when the others arrive together
(`burst_at_ms` later): loadgen reads what an unqueued first token costs from it
(the median of the requests sent while nothing else was in flight), and the burst
queues behind a server that runs one sequence at a time. Without the lone request,
a server whose API process is starved by its engine on 2 cores can deliver even
the burst's first token at the burst's end, and nothing shows an unqueued one.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_alone_then_burst(
    path: Path,
    *,
    num_burst: int = 47,
    burst_at_ms: int = 3000,
    prompt_tokens: int = 32,
    output_tokens: int = 64,
) -> Path:
    """Write the trace to `path` (1 + `num_burst` rows, no prefix shared) and return it."""
    rows = [
        {"timestamp": 0 if i == 0 else burst_at_ms, "input_length": prompt_tokens,
         "output_length": output_tokens, "hash_ids": [i]}
        for i in range(1 + num_burst)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
