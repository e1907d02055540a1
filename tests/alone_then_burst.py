"""A Mooncake-format trace for the queueing tests: one request alone, then a burst.

The first request arrives alone and is long done when the others arrive together
(`BURST_AT_MS` later): loadgen reads what an unqueued first token costs from it
(the median of the requests sent while nothing else was in flight), and the burst
queues behind a server that runs one sequence at a time. Without the lone request,
a server whose API process is starved by its engine on 2 cores can deliver even
the burst's first token at the burst's end, and nothing shows an unqueued one.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The trace's requests: the lone one and the burst.
NUM_REQUESTS = 1 + 47
#: When the burst arrives, after the lone request (ms).
BURST_AT_MS = 3000
#: Each request's prompt and output.
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 64


def write(path: Path, num_requests: int = NUM_REQUESTS, burst_at_ms: int = BURST_AT_MS) -> Path:
    """Write the trace to `path` (`num_requests` rows: the lone one, then the burst
    `burst_at_ms` later; no prefix shared) and return it."""
    rows = [
        {"timestamp": 0 if i == 0 else burst_at_ms, "input_length": PROMPT_TOKENS,
         "output_length": OUTPUT_TOKENS, "hash_ids": [i]}
        for i in range(num_requests)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
