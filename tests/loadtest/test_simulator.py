"""test_simulator.py: the serving simulator (loadtest/simulator.py) and the serving statistics it
reports (measure/latency.py's summarize_serving). The simulator drives the module's own scheduler
(Exercise 5) on a clock of its own, so most of these tests are Exercise 5's."""

from __future__ import annotations

import math

import pytest

import loadtest
import loadtest.simulator
from conftest import lab
from course.reviews import scenarios
from measure import latency

# --- the simulator on hand-traced workloads (it runs Exercise 5's scheduler) ---------------


@pytest.mark.needs(5)
def test_simulator_without_a_timeline_measures_the_same():
    workload = [(0.1 * i, 8, 4 + i % 5) for i in range(20)]
    full = loadtest.simulate_serving(lab, workload, max_num_seqs=4)
    lean = loadtest.simulate_serving(lab, workload, max_num_seqs=4, record_timeline=False)
    assert lean.timeline == [] and len(full.timeline) == full.num_steps
    assert (lean.num_steps, lean.duration, lean.wasted_slot_steps) == (full.num_steps, full.duration,
                                                                       full.wasted_slot_steps)


@pytest.mark.needs(5)
def test_simulator_reports_a_request_that_can_never_fit_as_rejected():
    sim = loadtest.simulate_serving(lab, [(0.0, 8, 8), (0.0, 200, 8), (1.0, 8, 8)], num_blocks=4, block_size=8)
    reasons = [o.finish_reason for o in sim.outputs]
    assert reasons[1] == "rejected" and reasons[0] == reasons[2] == "length", (
        f"finish reasons {reasons}: like the engine, the simulator must reject a request larger than the "
        "whole cache and serve the others")


@pytest.mark.needs(5)
def test_simulator_counts_steps_and_wasted_slot_steps_of_a_hand_traced_workload():
    workload = [(0.0, 4, 1), (0.0, 4, 3), (0.0, 4, 1)]
    static = loadtest.simulate_serving(lab, workload, "static", max_num_seqs=2)
    continuous = loadtest.simulate_serving(lab, workload, "continuous", max_num_seqs=2)
    # static: {0,1} prefill (0 done) | 1 | 1 (done) | {2} -- slot of 0 idle for 2 steps while 2 waits
    assert (static.num_steps, static.wasted_slot_steps) == (4, 2)
    # continuous: {0,1} (0 done) | 1 + 2's prefill (2 done) | 1 (done)
    assert (continuous.num_steps, continuous.wasted_slot_steps) == (3, 0)
    assert static.num_output_tokens == continuous.num_output_tokens == 5
    assert [o.metrics.ttft for o in continuous.outputs_in_steps] == [1, 1, 2]


@pytest.mark.needs(5)
def test_simulated_time_of_a_hand_traced_workload():
    cost = loadtest.simulator.StepCostModel(weight_read_time=1.0, kv_read_time_per_token=0.1,
                                           compute_time_per_token=0.3)
    sim = loadtest.simulate_serving(lab, [(0.0, 4, 1), (0.0, 4, 3)], max_num_seqs=2, cost=cost)
    # step 1: both prefills, 8 tokens, 8 context: max(1.8, 2.4) | step 2: decode at context 5: 1.5 | 6: 1.6
    assert sim.num_steps == 3
    assert sim.duration == pytest.approx(2.4 + 1.5 + 1.6), (
        f"simulated {sim.duration:.2f} s, by hand 5.5 s: a step reads each scheduled sequence's computed "
        "tokens and its new ones (attention reads the new tokens' K/V too)")
    assert [o.metrics.ttft for o in sim.outputs] == pytest.approx([2.4, 2.4])
    assert sim.outputs[1].metrics.e2e_latency == pytest.approx(5.5)


@pytest.mark.needs(5)
def test_simulated_ttft_of_a_chunked_prefill_is_the_end_of_its_last_chunk():
    cost = loadtest.simulator.StepCostModel(weight_read_time=1.0, kv_read_time_per_token=0.1,
                                           compute_time_per_token=0.3)
    sim = loadtest.simulate_serving(lab, [(0.0, 8, 2)], max_num_batched_tokens=4, cost=cost)
    # chunk 0..3: max(1.4, 1.2) | chunk 4..7, first token: max(1.8, 1.2) | decode at context 9: 1.9
    metrics = sim.outputs[0].metrics
    assert (metrics.ttft, metrics.e2e_latency) == (pytest.approx(1.4 + 1.8), pytest.approx(5.1)), (
        f"TTFT {metrics.ttft:.2f} s, by hand 3.2 s: a request's first token comes with its last prefill chunk; "
        "a chunk that samples nothing is no token")
    assert metrics.itl == pytest.approx([1.9])


@pytest.mark.needs(5)
def test_simulator_shows_head_of_line_blocking_on_the_skewed_workload():
    workload = [(0.0, 16, 400)] + [(0.0, 16, 10)] * 31
    static = loadtest.simulate_serving(lab, workload, "static", max_num_seqs=8)
    continuous = loadtest.simulate_serving(lab, workload, "continuous", max_num_seqs=8)
    assert static.wasted_slot_steps > 50 * continuous.wasted_slot_steps + 1000
    assert continuous.summary()["mean_ttft"] < static.summary()["mean_ttft"] / 5
    picture = scenarios.format_timeline(static, width=40)
    assert "#" in picture and "." in picture, "the static timeline shows the long request and idle slots"
    report = scenarios.format_batching_report(static, continuous)
    assert "wasted slot-steps" in report and "throughput" in report


# --- the simulator's input and cost model (provided) ----------------------------------------


@pytest.mark.provided
@pytest.mark.parametrize("workload, says", [
    ([], "empty"),
    ([(0.0, 4, 0)], "output_len"),
    ([(0.0, 4, -3)], "output_len"),
    ([(float("nan"), 4, 4)], "arrival_time"),
    ([(0.0, 4.5, 4)], "prompt_len"),
])
def test_simulator_rejects_a_bad_workload_by_name(workload, says):
    with pytest.raises(ValueError, match=says):
        loadtest.simulate_serving(lab, workload)


@pytest.mark.provided
def test_a_simulated_step_costs_the_slower_of_memory_and_compute():
    cost = loadtest.simulator.StepCostModel(weight_read_time=1.0, kv_read_time_per_token=0.1,
                                           compute_time_per_token=0.3)
    assert cost.step_time(1, 5) == pytest.approx(1.5), "a decode step is memory-bound: 1 + 5 x 0.1 > 1 x 0.3"
    assert cost.step_time(8, 8) == pytest.approx(2.4), (
        "a prefill of 8 tokens is compute-bound: 8 x 0.3 > 1 + 8 x 0.1; a roofline takes the max, not the sum")


# --- summarize_serving ----------------------------------------------------------------------


@pytest.mark.provided
def test_summarize_serving_statistics_on_hand_made_metrics():
    outs = [lab.RequestOutput(str(i), [1], [1] * n, lab.RequestMetrics.from_times(0.0, times, times[-1]), "length")
            for i, (n, times) in enumerate(((3, [1.0, 2.0, 4.0]), (1, [2.0])))]
    assert outs[0].metrics.tpot == 1.5 and outs[0].metrics.itl == [1.0, 2.0]
    summary = latency.summarize_serving(outs, duration=4.0)
    assert summary["mean_ttft"] == 1.5 and summary["p50_e2e"] == 3.0
    assert summary["mean_tpot"] == 1.5, "a one-token request has no TPOT and is left out of it"
    assert summary["output_throughput"] == 1.0


@pytest.mark.provided
def test_the_nearest_rank_p99_holds_an_slo_that_the_interpolated_one_passes_wrongly():
    values = [1.0] * 49 + [100.0]  # 49 of 50 requests within a target of 60: 98%, under a p99 SLO
    assert latency.interpolated_percentile(values, 99) <= 60, "interpolated between the 49th and 50th: 1 + 0.51 x 99"
    assert latency.nearest_rank_quantile(values, 0.99) == 100.0, (
        "by nearest rank the p99 of 50 values is the 50th smallest: the SLO of 60 is missed, as 98% < 99%")
    assert math.isnan(latency.interpolated_percentile([], 99)) and math.isnan(latency.nearest_rank_quantile([], 0.99))


@pytest.mark.provided
def test_summarize_serving_counts_a_rejected_request_but_not_in_the_latencies():
    served = lab.RequestOutput("0", [1], [1, 1], lab.RequestMetrics.from_times(0.0, [1.0, 3.0], 3.0), "length")
    rejected = lab.RequestOutput("1", [1], [], lab.RequestMetrics.from_times(0.0, [], 0.5), "rejected")
    summary = latency.summarize_serving([served, rejected], duration=4.0)
    assert (summary["num_requests"], summary["num_rejected"], summary["num_output_tokens"]) == (2, 1, 2)
    assert (summary["mean_ttft"], summary["mean_e2e"], summary["mean_tpot"]) == (1.0, 3.0, 2.0), (
        "a rejected request produced no token: it counts as a request, never in TTFT, TPOT or E2E")
