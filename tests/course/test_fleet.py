"""test_fleet.py: `python solution.py fleet` (course/reviews/fleet.py, loadtest/fleet_search.py) and the step
cost it charges (loadtest/costmodel.py, provided). The search drives the module's own Scheduler (Exercise 5) on KV
blocks its plan_deployment sizes (Exercise 8): those tests need exercises 1..8."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import lab
from course.reviews import fleet
from loadtest import costmodel, fleet_search
from measure import latency
from tests.support import run_cli

# --- the roofline cost model, by hand ------------------------------------------------------


@pytest.mark.provided
def test_roofline_step_of_13b_on_two_a100s_matches_the_hand_calculation():
    cost = costmodel.roofline_step_cost(lab, "llama-2-13b", "a100-80gb", 2)
    bandwidth, flops, nvlink = 2_039e9, 312e12, 300e9
    weights = 13_015_864_320 * 2 / 2 / bandwidth  # fp16 weights, half on each GPU
    kv_token = 2 * 40 * 40 * 128 * 2 / 2 / bandwidth  # K and V, 40 layers x 40 heads x 128, half a GPU's
    flops_token = 2 * 13_015_864_320 / 2 / flops
    # 2 all-reduces per layer; a ring moves 2 (tp-1)/tp of tokens x 5120 x 2 bytes through each GPU
    allreduce = 80 * 10e-6 + 64 * 80 * (2 * 0.5 * 5120 * 2) / nvlink
    expected = max(weights + 64 * 300 * kv_token, 64 * flops_token) + allreduce
    assert cost.step_time(64, 64 * 300) == pytest.approx(expected, rel=1e-12), (
        "a step costs max(weights + K/V read over bandwidth, FLOPs over peak) + the all-reduces, per GPU of tp")
    single = costmodel.roofline_step_cost(lab, "llama-2-13b", "a100-80gb", 1)
    assert single.parts(64, 0).allreduce == 0.0, "one GPU has nothing to all-reduce"


@pytest.mark.provided
@given(st.floats(1e-4, 1e-2), st.floats(0, 1e-4), st.floats(0, 1e-6), st.integers(0, 10_000))
def test_fit_step_cost_recovers_the_coefficients_of_exact_steps(fixed, per_token, per_context, seed):
    rng = np.random.default_rng(seed)
    steps = [(int(t), int(c), fixed + per_token * t + per_context * c) for t, c in rng.integers(1, 2000, (12, 2))]
    fit = costmodel.fit_step_cost(steps)
    for (t, c, seconds) in steps:
        assert fit.step_time(t, c) == pytest.approx(seconds, rel=1e-6, abs=1e-12)
    assert min(fit.fixed, fit.per_token, fit.per_context_token) >= 0


# --- the search ------------------------------------------------------------------------------

SLO = fleet_search.SLO(ttft_s=0.05, tpot_s=0.01)
SMALL = fleet_search.Candidate("h100-80gb", 1, 16, 256)


def small_case():
    workload = fleet_search.fleet_workload(lab, "alpaca", 40, seed=3, max_model_len=512)
    cost = costmodel.roofline_step_cost(lab, "llama-2-7b", "h100-80gb", 1)

    def run_at(rate):
        return fleet_search.simulate_rate(lab, cost, workload, rate, SLO, SMALL, num_blocks=400)
    return run_at


@pytest.mark.needs(8)
def test_search_finds_the_rate_a_brute_force_sweep_finds():
    run_at = small_case()
    search = fleet_search.search_max_rate(run_at, start=20.0, tolerance=0.02, candidate=SMALL)
    rates = np.geomspace(5, 2000, 60)
    first_miss = next(i for i, r in enumerate(rates) if not run_at(r).meets)
    assert first_miss > 0, "the sweep must start below the SLO's knee"
    below, above = rates[first_miss - 1], rates[first_miss]
    assert run_at(search.max_rate).meets, f"the search's answer {search.max_rate:.1f} req/s must meet the targets"
    assert below / 1.02 <= search.max_rate < above, (
        f"the search found {search.max_rate:.1f} req/s; a sweep meets at {below:.1f} and misses at {above:.1f}")
    assert not search.miss.meets and search.miss.rate <= search.max_rate * 1.02 * 1.0001, \
        "the search stops with a missing rate within its tolerance above the answer"


@pytest.mark.provided
@given(st.floats(0.05, 500.0), st.floats(0.1, 50.0), st.floats(1.0, 400.0))
def test_the_replicas_search_finds_the_fewest_replicas_whose_share_of_the_rate_meets(knee, start, qps):
    def run_at(rate):  # a replica meets both targets up to its knee
        return fleet_search.LoadRun(rate, rate <= knee, 0.0, 0.0, True)
    search = fleet_search.search_replicas(run_at, qps, start)
    if knee < start / 256:
        assert search.max_rate == 0 and search.best is None, "a knee below the lowest rate tried: no replica count"
        return
    fewest = math.ceil(qps / knee - 1e-9)
    while qps / fewest > knee:  # the smallest k with qps / k <= knee, by hand
        fewest += 1
    found = fleet_search.fleet_size(qps, search.max_rate, 1)[0]
    assert found == fewest and search.best.meets, (
        f"a replica meets up to {knee:.3f} req/s: {qps:.1f} req/s need {fewest} replicas, the search says {found}")
    assert search.miss is None if found == 1 else (not search.miss.meets and search.miss.rate == qps / (found - 1)), (
        "one replica fewer misses (its run is the search's miss)")


@pytest.mark.provided
def test_nearest_rank_p99_is_met_exactly_when_99_percent_are_within_the_target():
    values = list(range(1, 201))  # 200 values: the 198th smallest is p99
    assert latency.nearest_rank_quantile(values, fleet_search.SLO_QUANTILE) == 198
    assert fleet_search.allowed_misses(200) == 2


@pytest.mark.needs(8)
def test_fleet_arithmetic_of_one_configuration_matches_the_hand_calculation():
    slo = fleet_search.SLO(ttft_s=0.1, tpot_s=0.02)  # within reach of the measured step (~9 ms at tp 2 with the CPU's)
    question = fleet_search.FleetQuestion("llama-2-7b", ("h100-80gb",), qps=70.0, slo=slo, workload="alpaca",
                                          usd_per_gpu_hour=(3.0,), max_model_len=512, num_requests=40)
    candidate = fleet_search.Candidate("h100-80gb", 2, 16, 256)
    answer = fleet.run_fleet(lab, question, jobs=1, log=lambda line: None, candidates=[candidate])
    row = answer.pick
    rate = row.max_rate
    workload = fleet_search.fleet_workload(lab, "alpaca", 40, 0, 512)
    replicas = math.ceil(70.0 / rate)
    usd = replicas * 2 * 3.0 / (70.0 * np.mean(workload[2]) * 3600) * 1e6
    assert (row.replicas, row.gpus) == ((replicas,), replicas * 2), "replicas = ceil(QPS / rate), GPUs = replicas x tp"
    assert row.usd_per_million == pytest.approx(usd), "$ per 1M output tokens = GPUs x $/h / output tokens per hour"
    assert f"{row.gpus} GPUs for 70 req/s, ${usd:.2f} per 1M output tokens" in answer.text


@pytest.mark.needs(8)
def test_fleet_names_its_pick_once_and_counts_one_gpu_in_the_singular():
    question = fleet_search.FleetQuestion("llama-2-7b", ("h100-80gb",), qps=1.0, slo=fleet_search.SLO(0.1, 0.02),
                                          workload="alpaca", max_model_len=512, num_requests=40)
    answer = fleet.run_fleet(lab, question, jobs=1, log=lambda line: None,
                             candidates=[fleet_search.Candidate("h100-80gb", 1, 16, 256)])
    assert answer.pick.gpus == 1, "one request/s fits one replica of one GPU"
    assert answer.text.count("Pick:") == 1, f"the pick is named once:\n{answer.text}"
    assert "1 GPU for 1 req/s" in answer.text and "1 GPUs" not in answer.text, (
        f"one GPU is counted in the singular:\n{answer.text}")


@pytest.mark.needs(8)
def test_fleet_prints_what_it_searches_first_then_the_prefill_pools_quick_searches():
    question = fleet_search.FleetQuestion("llama-2-7b", ("h100-80gb",), qps=10.0, slo=fleet_search.SLO(0.1, 0.02),
                                          workload="alpaca", max_model_len=512, num_requests=40)
    candidates = [fleet_search.Candidate("h100-80gb", 1, 16, 256, role) for role in ("both", "decode", "prefill")]
    lines = []
    fleet.run_fleet(lab, question, jobs=1, log=lines.append, candidates=candidates)
    progress = [line for line in lines if line.startswith("  [")]
    assert lines[0].startswith("Fleet for llama-2-7b") and "candidates" in lines[0], (
        f"the first line says what will be searched, before any search runs: {lines[0]!r}")
    prefill = [i for i, line in enumerate(progress) if "] prefill: " in line]
    assert prefill == list(range(len(prefill))) and prefill, (
        "the prefill pools' searches (no decode: a fraction of a second each) report first:\n" + "\n".join(progress))


@pytest.mark.needs(8)
def test_fleet_answers_with_the_measured_cost_and_shows_the_roofline_beside_it():
    slo = fleet_search.SLO(ttft_s=0.1, tpot_s=0.02)
    question = fleet_search.FleetQuestion("llama-2-7b", ("h100-80gb",), qps=70.0, slo=slo, workload="alpaca",
                                          max_model_len=512, num_requests=40)
    answer = fleet.run_fleet(lab, question, jobs=1, log=lambda line: None,
                             candidates=[fleet_search.Candidate("h100-80gb", 2, 16, 256)])
    row = answer.pick
    assert row.measured and row.roofline is not None and row.roofline.gpus < row.gpus, (
        f"the pick is searched on the measured step cost ({row.gpus} GPUs), which needs more GPUs than the "
        f"roofline, a floor at peak ({row.roofline and row.roofline.gpus})")
    line = next(t for t in answer.text.splitlines() if t.startswith(row.label))
    assert line.split("|")[-1].split() == [str(row.roofline.gpus), f"{row.roofline.usd_per_million:.2f}"], (
        f"each row shows the roofline's GPUs and $ beside the measured ones: {line!r}")
    assert "h100-80gb tp2: a decode step of" in answer.text and "all-reduces" in answer.text, (
        "the words say why they differ at this tp: the GEMMs' efficiency at this shard size, the all-reduces")


@pytest.mark.needs(8)
def test_a_gpu_without_a_published_profile_is_costed_by_the_roofline_and_the_table_says_so():
    question = fleet_search.FleetQuestion("llama-2-7b", ("l4",), qps=10.0, slo=fleet_search.SLO(ttft_s=1.0, tpot_s=0.2),
                                          workload="alpaca", max_model_len=512, num_requests=40)
    answer = fleet.run_fleet(lab, question, jobs=1, log=lambda line: None,
                             candidates=[fleet_search.Candidate("l4", 1, 16, 256)])
    row = answer.pick
    assert not row.measured and row.roofline.gpus == row.gpus, "no profile: one search, on the roofline"
    assert f"{row.label} *" in answer.text and "no published profile" in answer.text, (
        "the table marks a GPU without a profile and says its answer is the roofline's")


@pytest.mark.provided
def test_fleet_size_rounds_replicas_up_but_not_past_an_exact_fit():
    assert fleet_search.fleet_size(100, 25.0, 2) == (4, 8)
    assert fleet_search.fleet_size(100, 24.9, 2) == (5, 10)


# --- the command line ------------------------------------------------------------------------


@pytest.mark.provided
@pytest.mark.parametrize("args, says", [
    (("--gpu", "tpu-v9"), "unknown GPU 'tpu-v9'"),
    (("--model", "gpt-5"), "choose from 'llama-2-7b'"),
    (("--qps", "0"), "--qps"),
    (("--p99-ttft-ms", "-200"), "--p99-ttft-ms"),
    (("--p99-tpot-ms", "nan"), "--p99-tpot-ms"),
    (("--usd-per-gpu-hour", "2,-1"), "--usd-per-gpu-hour"),
    (("--cpu-overhead-ms", "-1"), "--cpu-overhead-ms"),
])
def test_cli_fleet_bad_input_exits_2_with_one_line(args, says):
    proc = run_cli("fleet", *args)
    assert proc.returncode == 2, f"{args}: expected exit status 2, got {proc.returncode}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], f"expected one line of error mentioning {says!r}, got {lines}"


@pytest.mark.needs(8)
def test_cli_fleet_with_a_target_no_candidate_meets_names_the_nearest_miss():
    proc = run_cli("fleet", "--model", "llama-2-7b", "--gpu", "h100-80gb", "--workload", "alpaca",
                   "--p99-tpot-ms", "1", "--num-requests", "20", "--max-model-len", "512", "--jobs", "1",
                   "--no-disaggregation")
    assert proc.returncode == 2, f"expected exit status 2, got {proc.returncode}: {proc.stderr}"
    assert "nearest miss: h100-80gb tp8" in proc.stderr and "p99 TPOT" in proc.stderr, (
        f"no candidate meets a 1 ms TPOT (the fastest, tp8, steps in ~1.5 ms): the error must name it; "
        f"got {proc.stderr!r}")


@pytest.mark.needs(8)
def test_fleet_page_draws_goodput_against_offered_rate_with_the_knee_of_the_pick():
    from course.pages.fleet_page import fleet_page
    question = fleet_search.FleetQuestion("llama-2-7b", ("h100-80gb",), qps=70.0, slo=SLO, workload="alpaca",
                                          max_model_len=512, num_requests=40)
    candidates = [fleet_search.Candidate("h100-80gb", 1, 16, 256), fleet_search.Candidate("h100-80gb", 2, 16, 256)]
    answer = fleet.run_fleet(lab, question, jobs=1, log=lambda line: None, candidates=candidates)
    html = fleet_page(lab, question, answer)
    assert html.count("<svg") == 1 and f"SLO knee: {answer.pick.max_rate:.1f} req/s" in html, (
        "the page draws one figure, the pick's knee marked at the largest rate the search found")
