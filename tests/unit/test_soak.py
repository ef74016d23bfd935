"""The soak's pure parts: its kill schedule, which requests ran around a fault, the outcomes against the
fault-free run, latency percentiles, memory growth per service, and the flags it refuses."""

import random

import pytest

from cli.bench import soak
from cli.bench.soak_figures import (
    MIB,
    Fault,
    Run,
    around,
    fault_figures,
    kill_schedule,
    latency,
    memory,
    outcomes,
)
from cli.main import parser


def test_kills_come_every_period_within_the_duration_each_service_drawn_by_the_seed():
    schedule = kill_schedule(random.Random(3), ["cache", "compute", "gateway"], 360, 60)
    assert [at for at, _ in schedule] == [60, 120, 180, 240, 300]
    assert {service for _, service in schedule} <= {"cache", "compute", "gateway"}
    assert schedule == kill_schedule(random.Random(3), ["cache", "compute", "gateway"], 360, 60)
    assert kill_schedule(random.Random(3), ["gateway"], 1800, 120)[-1] == (1680, "gateway")
    assert len(kill_schedule(random.Random(3), ["gateway"], 1801, 120)) == 15
    assert kill_schedule(random.Random(3), ["cache"], 50, 60) == []


def test_a_request_is_around_a_fault_when_it_ran_between_the_kill_and_the_stack_serving_again():
    faults = [Fault("gateway", 7, at=10.0, back=12.0), Fault("cache", 8, at=30.0)]
    assert around(Run(0, sent=5.0, ended=10.5), faults), "running at the kill"
    assert around(Run(0, sent=11.0, ended=15.0), faults), "sent while the stack came back"
    assert not around(Run(0, sent=12.5, ended=20.0), faults), "after it served again"
    assert not around(Run(0, sent=1.0, ended=9.9), faults), "done before the kill"
    assert around(Run(0, sent=29.0, ended=31.0), faults), "a fault never back counts at its kill"
    assert not around(Run(0, sent=31.0, ended=35.0), faults)


def test_outcomes_count_identical_different_and_failed_requests():
    reference = {0: [1, 2, 3], 1: [4, 5]}
    runs = [
        Run(0, 0.0, token_ids=[1, 2, 3], resumes=1),
        Run(1, 0.0, token_ids=[4, 5]),
        Run(1, 0.0, token_ids=[4, 6]),
        Run(0, 0.0, token_ids=[1], error="UNAVAILABLE"),
        Run(0, 0.0, error="DEADLINE_EXCEEDED"),
    ]
    assert outcomes(runs, reference) == {
        "sent": 5, "completed": 3, "identical": 2, "different": 1, "failed": 2,
        "failures": {"UNAVAILABLE": 1, "DEADLINE_EXCEEDED": 1}, "resumed": 1,
    }  # fmt: skip


def test_latency_takes_ttft_from_sending_and_gaps_between_tokens():
    runs = [Run(0, 0.0, token_times=[0.1, 0.2, 0.5]), Run(1, 1.0, token_times=[1.3, 1.35]), Run(2, 2.0)]
    figures = latency(runs)
    assert figures["requests"] == 3
    assert (figures["ttft_p50_ms"], figures["ttft_p99_ms"]) == (100.0, 300.0)
    assert figures["itl_p99_ms"] == 300.0 and figures["itl_max_ms"] == 300.0
    assert figures["itl_p50_ms"] == 100.0


def test_each_fault_reports_its_recovery_and_the_next_token_after_it():
    faults = [Fault("compute", 9, at=100.0, back=104.5), Fault("cache", 10, at=200.0)]
    runs = [Run(0, 90.0, token_times=[99.0, 107.25]), Run(1, 95.0, token_times=[106.0])]
    assert fault_figures(faults, runs, start=40.0) == [
        {"service": "compute", "at_s": 60.0, "back_s": 4.5, "next_token_s": 6.0},
        {"service": "cache", "at_s": 160.0, "back_s": None, "next_token_s": None},
    ]


def test_memory_reports_growth_peak_and_processes_per_service():
    samples = {
        "cache": [(1, 100 * MIB), (1, 130 * MIB), (1, 120 * MIB)],
        "gateway": [(2, 400 * MIB), (3, 350 * MIB)],
        "compute": [],
    }
    assert memory(samples) == {
        "cache": {"rss_start_mib": 100.0, "rss_end_mib": 120.0, "rss_growth_mib": 20.0, "rss_peak_mib": 130.0,
                  "processes": 1},
        "gateway": {"rss_start_mib": 400.0, "rss_end_mib": 350.0, "rss_growth_mib": -50.0,
                    "rss_peak_mib": 400.0, "processes": 2},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--workload", "mixed", "--duration", "60"], "--duration is for --workload soak"),
        (["--workload", "latency", "--kill", "cache"], "--kill is for --workload soak"),
        (["--workload", "soak", "--target", "127.0.0.1:1"], "drop --target"),
        (["--workload", "soak", "--profile"], "drop --profile"),
        (["--workload", "soak", "--kill-every", "0"], "--kill-every must be > 0"),
    ],
)
def test_soak_flags_that_do_not_fit_are_refused(argv, says):
    args = parser("bench").parse_args(["bench", *argv])
    with pytest.raises(SystemExit, match=says):
        soak.check_flags(args)


def test_half_the_requests_are_seeded_and_none_shares_a_seed():
    kinds = [soak.sampling(i) for i in range(48)]
    assert all(kinds[i] == {"temperature": 0.0} for i in range(0, 48, 2))
    seeds = [kinds[i]["seed"] for i in range(1, 48, 2)]
    assert len(set(seeds)) == len(seeds)
