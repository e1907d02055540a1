"""A load test's records as the report's `TimeSeries`, seen from the client.

The run [0, duration_s] is cut into equal windows (at most `max_points`, none
shorter than MIN_WINDOW_S). Per window, from completed requests (as the summary
counts them): inter-token latencies and TTFTs of the chunks that arrived in it,
output tokens received by its end (cumulative, as `SeriesPoint.tokens_generated`
is), and the requests in flight at its end (sent, not finished; all sent
requests). A request's output tokens are spread over its text chunks, the first
chunks taking the remainder, so a server that streams several tokens per chunk
is still counted exactly.

Engine-side fields (steps, swap wait, bytes per direction, tier occupancy) are
left empty: a remote server does not report them, and zeros would claim it did.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.timeseries import SeriesPoint, TimeSeries
from kvswap.serve.loadgen.results import Outcome, RequestRecord

MAX_POINTS = 120
MIN_WINDOW_S = 0.01


def token_arrivals(record: RequestRecord) -> list[tuple[float, int]]:
    """(time, tokens) per text chunk of `record`; the tokens sum to its output tokens."""
    times = record.chunk_times_s
    if not times:
        end_s = record.done_s if record.done_s is not None else 0.0
        return [(end_s, record.output_tokens)] if record.output_tokens else []
    base, extra = divmod(record.output_tokens, len(times))
    return [(t, base + (1 if i < extra else 0)) for i, t in enumerate(times)]


def loadgen_series(
    records: Sequence[RequestRecord], duration_s: float, max_points: int = MAX_POINTS
) -> TimeSeries:
    done = [r for r in records if r.outcome is Outcome.COMPLETED]
    tokens = sorted(arrival for r in done for arrival in token_arrivals(r))
    itls = sorted(
        (later, later - earlier)
        for r in done
        for earlier, later in itertools.pairwise(r.chunk_times_s)
    )
    ttfts = sorted((r.chunk_times_s[0], t) for r in done if (t := r.ttft_s) is not None)
    sent_s = sorted(r.sent_s for r in records if r.sent_s is not None)
    finished_s = sorted(
        r.done_s if r.done_s is not None else duration_s for r in records if r.sent_s is not None
    )
    whole_itl, whole_ttft = LogHistogram(), LogHistogram()
    whole_itl.add_all(v for _, v in itls)
    whole_ttft.add_all(v for _, v in ttfts)
    if duration_s <= 0:
        return TimeSeries((), whole_itl, whole_ttft)
    num_windows = max(1, min(max_points, math.ceil(duration_s / MIN_WINDOW_S)))
    points: list[SeriesPoint] = []
    cumulative_tokens = 0
    next_token = next_itl = next_ttft = 0
    for index in range(num_windows):
        start_s = duration_s * index / num_windows
        # The last window takes whatever arrived at or after the end (cancellations).
        end_s = duration_s * (index + 1) / num_windows if index + 1 < num_windows else math.inf
        while next_token < len(tokens) and tokens[next_token][0] <= end_s:
            cumulative_tokens += tokens[next_token][1]
            next_token += 1
        itl, next_itl = _window(itls, next_itl, end_s)
        ttft, next_ttft = _window(ttfts, next_ttft, end_s)
        at_s = min(end_s, duration_s)
        in_flight = bisect.bisect_right(sent_s, at_s) - bisect.bisect_right(finished_s, at_s)
        points.append(
            SeriesPoint(
                start_s=start_s,
                end_s=at_s,
                num_steps=0,
                step_s=0.0,
                swap_wait_s=0.0,
                bytes_by_direction={},
                usage_mean_by_tier={},
                usage_max_by_tier={},
                used_blocks_by_tier={},
                capacity_blocks_by_tier={},
                num_running=max(0, in_flight),
                num_waiting=0,
                num_preempted=0,
                tokens_generated=cumulative_tokens,
                itl=itl,
                ttft=ttft,
            )
        )
    return TimeSeries(tuple(points), whole_itl, whole_ttft)


def _window(
    events: Sequence[tuple[float, float]], first: int, end_s: float
) -> tuple[LogHistogram, int]:
    """The values of `events` (sorted by time) from index `first` up to `end_s`."""
    histogram = LogHistogram()
    index = first
    while index < len(events) and events[index][0] <= end_s:
        histogram.add(events[index][1])
        index += 1
    return histogram, index
