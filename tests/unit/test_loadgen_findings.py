"""A load test judged by its own figures (`obs/loadgen_findings.py`), rule by rule.

Each test writes the loadgen summary a run would produce (only the keys the rule
reads) and checks what the page would say about it.
"""

from __future__ import annotations

import pytest

from kvswap.obs.html import LOADGEN_NO_FINDING
from kvswap.obs.loadgen_findings import CHECKED, judge


def summary(**overrides: object) -> dict[str, object]:
    """A clean run of 20 requests: all completed, no SLO, lengths as intended."""
    base: dict[str, object] = {
        "requests_planned": 20,
        "requests_sent": 20,
        "requests_completed": 20,
        "requests_failed": 0,
        "requests_cancelled": 0,
        "requests_not_sent": 0,
        "goodput_requests": 20,
        "slo_ttft_ms": None,
        "slo_tpot_ms": None,
        "slo_ttft_met_requests": None,
        "slo_tpot_met_requests": None,
        "ttft_ms": {"p50": 200.0, "p95": 400.0, "p99": 450.0},
        "send_delay_ms": {"p50": 1.0, "p95": 3.0, "p99": 4.0},
        "prompt_length": {
            "requests": 20,
            "sent_per_intended": {"min": 0.98, "p50": 1.01, "p95": 1.04, "max": 1.05},
        },
        "calibration": {"tokens_per_word": 5.04},
        "errors_by_kind": {},
        "errors": [],
        "stopped_by": None,
    }
    return base | overrides


def rules(data: dict[str, object], max_concurrency: int | None = None) -> list[str]:
    return [f.rule for f in judge(data, max_concurrency=max_concurrency)]


def test_a_clean_run_fires_nothing_and_the_page_says_what_was_checked() -> None:
    assert judge(summary()) == []
    assert LOADGEN_NO_FINDING == CHECKED
    checks = ("HTTP 413, 429, 400", "timeouts", "transport errors", "goodput",
              "cancelled or never sent", "prompt lengths", "send delay against TTFT")  # fmt: skip
    for checked in checks:
        assert checked in CHECKED, checked
    assert "healthy" not in CHECKED


def test_a_run_whose_every_request_was_413_has_goodput_0_and_says_why() -> None:
    """The user's report: goodput 0 was called healthy and the 413s were hidden."""
    found = judge(
        summary(
            requests_completed=0,
            requests_failed=20,
            goodput_requests=0,
            prompt_length=None,
            errors_by_kind={"HTTP 413": 20},
            errors=[
                {
                    "request_id": 0,
                    "kind": "HTTP 413",
                    "status": 413,
                    "message": "HTTP 413: prompt: 5178 tokens; allowed: at most 4064",
                }
            ],
        )
    )
    assert [f.rule for f in found] == ["goodput_zero", "requests_failed_http_413"]
    zero, too_long = found
    assert zero.symptom == "goodput 0: no request counted"
    assert (
        zero.figure == "none of 20 planned requests completed: 20 failed, 0 cancelled, 0 not sent"
    )
    assert too_long.figure == (
        "20 of 20 requests sent failed with HTTP 413; the first, request 0: HTTP 413: prompt: "
        "5178 tokens; allowed: at most 4064"
    )
    assert "--max-model-len" in too_long.advice and "--length-scale" in too_long.advice
    assert too_long.metric == "errors_by_kind[HTTP 413]"


@pytest.mark.parametrize(
    ("kind", "rule", "advice"),
    [
        ("HTTP 429", "requests_failed_http_429", "offer less load"),
        ("HTTP 400", "requests_failed_http_400", "check --model and --endpoint"),
        ("HTTP 401", "requests_failed_http_401", "--api-key"),
        ("HTTP 503", "requests_failed_http_503", "the server's log"),
        ("HTTP 418", "requests_failed_http_418", "read the message"),
        ("timeout", "requests_failed_timeout", "raise --timeout-s"),
        ("transport", "requests_failed_transport", "stayed up"),
        ("bad stream", "requests_failed_bad_stream", "stream_options.include_usage"),
    ],
)
def test_each_kind_of_failure_has_its_own_cause_and_advice(
    kind: str, rule: str, advice: str
) -> None:
    found = judge(
        summary(
            requests_completed=17,
            requests_failed=3,
            goodput_requests=17,
            errors_by_kind={kind: 3},
            errors=[{"request_id": 5, "kind": kind, "status": None, "message": "m"}],
        )
    )
    assert [f.rule for f in found] == [rule]
    assert advice in found[0].advice
    assert found[0].figure == f"3 of 20 requests sent failed with {kind}; the first, request 5: m"
    assert found[0].values == {"failed": 3.0, "sent": 20.0}


def test_failures_of_several_kinds_come_most_frequent_first() -> None:
    data = summary(requests_completed=14, requests_failed=6, goodput_requests=14,
                   errors_by_kind={"HTTP 429": 2, "timeout": 4})  # fmt: skip
    assert rules(data) == ["requests_failed_timeout", "requests_failed_http_429"]


def test_goodput_below_completed_names_the_objective_missed_most() -> None:
    found = judge(
        summary(
            goodput_requests=12,
            slo_ttft_ms=500.0,
            slo_tpot_ms=20.0,
            slo_ttft_met_requests=18,
            slo_tpot_met_requests=13,
        )
    )
    assert [f.rule for f in found] == ["slo_missed"]
    assert found[0].figure == (
        "12 of 20 completed requests met every SLO: TTFT <= 500 ms met by 18 of 20, "
        "TPOT <= 20 ms met by 13 of 20; TPOT was missed most (7 requests over 20 ms)"
    )
    assert "decod" in found[0].cause and "--max-concurrency" in found[0].advice
    assert found[0].values["tpot_met"] == 13.0


def test_a_goodput_of_0_from_missed_slos_is_one_finding_that_names_the_objective() -> None:
    found = judge(summary(goodput_requests=0, slo_ttft_ms=1.0, slo_ttft_met_requests=0))
    assert [f.rule for f in found] == ["goodput_zero"]
    assert found[0].figure == (
        "every one of 20 completed requests missed an SLO: TTFT <= 1 ms met by 0 of 20; "
        "TTFT was missed most (20 requests over 1 ms)"
    )


@pytest.mark.parametrize(
    ("stopped_by", "cause"),
    [
        ("duration", "--duration-s ended the run"),
        ("SIGINT", "stopped by SIGINT"),
        (None, "earlier turn did not complete"),
    ],
)
def test_requests_cut_from_the_run_say_what_stopped_it(stopped_by: str | None, cause: str) -> None:
    found = judge(summary(requests_completed=15, goodput_requests=15, requests_cancelled=2,
                          requests_not_sent=3, stopped_by=stopped_by))  # fmt: skip
    assert [f.rule for f in found] == ["requests_not_completed"]
    assert cause in found[0].cause
    assert found[0].figure == "2 requests cancelled in flight and 3 never sent, of 20 planned"


def test_prompts_off_their_intended_length_are_a_finding() -> None:
    uncalibrated = summary(
        prompt_length={"requests": 18,
                       "sent_per_intended": {"min": 5.06, "p50": 5.15, "p95": 9.75, "max": 9.75}},
        calibration={"tokens_per_word": None},
    )  # fmt: skip
    (found,) = judge(uncalibrated)
    assert found.rule == "prompt_length_mismatch"
    assert found.symptom == "prompts longer than the workload intends"
    assert found.figure == (
        "sent prompts are 5.15x their intended length at the median (5.06x to 9.75x over "
        "18 requests)"
    )
    assert "uncalibrated" in found.cause
    calibrated = uncalibrated | {"calibration": {"tokens_per_word": 5.04}}
    assert "the calibration did not carry over" in judge(calibrated)[0].cause
    within = summary(prompt_length={"requests": 9, "sent_per_intended": {"p50": 1.09}})
    assert rules(within) == []


def test_a_client_that_sent_late_is_client_bound() -> None:
    late = summary(send_delay_ms={"p50": 50.0, "p95": 150.0, "p99": 160.0})
    (held,) = judge(late, max_concurrency=4)
    assert held.rule == "client_bound"
    assert held.figure == "send delay P95 150.0 ms against a TTFT P50 of 200.0 ms"
    assert "--max-concurrency 4 slots" in held.cause
    (busy,) = judge(late)
    assert "could not send requests at their arrival times" in busy.cause
    # Small against TTFT, or below the floor: not client-bound.
    assert rules(summary(send_delay_ms={"p95": 90.0})) == []
    assert rules(summary(send_delay_ms={"p95": 9.0}, ttft_ms={"p50": 1.0})) == []
