"""test_costmodel.py: the measured step cost (loadtest/costmodel.py, provided): a step's seconds from
Vidur's published operator profiles, fitted on Llama-2-7B and -70B and the DGX all-reduces
(loadtest/vidur_profile.json, by tools/fleet/fit_vidur.py). Its contract: the four terms, each positive
where the step has that work, growing with the work, never below the roofline (the floor), for any
model shape; the roofline for GPUs without a profile. Where Vidur's CSVs are on this machine
($VIDUR_DIR, a clone or bare mirror of microsoft/vidur), the shipped coefficients are checked
against the held-out models' measured operators; elsewhere those tests skip, saying so."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import lab
from loadtest import costmodel

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILED = ("a100-80gb", "h100-80gb")
PRESETS = ("llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "mistral-7b")


def cost(model="llama-2-13b", gpu="a100-80gb", tp=2, **kw):
    return costmodel.measured_step_cost(lab, model, gpu, tp, **kw)


# --- the terms --------------------------------------------------------------------------------


@pytest.mark.provided
def test_a_decode_step_has_all_four_terms_positive_and_its_total_is_their_sum():
    parts = cost().parts(64, 64 * 500)
    terms = {name: getattr(parts, name) for name in ("linear", "attention", "allreduce", "overhead")}
    assert all(value > 0 for value in terms.values()), f"every term of a tp-2 decode step is positive: {terms}"
    assert parts.total == pytest.approx(sum(terms.values()), rel=1e-12), (
        "the terms add: one CUDA stream runs the kernels in turn, and a synchronous engine waits for its CPU")
    assert parts.bound in terms and terms[parts.bound] == max(terms.values()), "bound names the largest term"


@pytest.mark.provided
def test_one_gpu_has_no_allreduce_and_the_overhead_is_the_stated_cpu_time():
    parts = cost(tp=1).parts(8, 800)
    assert parts.allreduce == 0.0, "one GPU has nothing to all-reduce"
    assert parts.overhead == costmodel.CPU_OVERHEAD_S, "the default CPU time per step is the cited CPU_OVERHEAD_S"
    assert cost(tp=1, cpu_overhead_s=0.0).parts(8, 800).overhead == 0.0, "cpu_overhead_s=0: an overlapped engine"


@pytest.mark.provided
@settings(max_examples=60)
@given(st.sampled_from(PRESETS), st.sampled_from(PROFILED), st.sampled_from((1, 2, 4, 8)),
       st.integers(1, 4096), st.integers(1, 4096), st.integers(0, 200_000), st.integers(0, 200_000))
def test_more_tokens_or_more_context_never_cost_less(model, gpu, tp, a, b, c, d):
    step = cost(model, gpu, tp)
    few, many = min(a, b), max(a, b)
    small, large = step.parts(few, min(c, d)), step.parts(many, max(c, d))
    assert small.linear <= large.linear and small.allreduce <= large.allreduce, (
        f"{model} on {gpu} tp {tp}: {many} tokens cost less than {few} in the GEMMs or all-reduces")
    assert step.parts(few, min(c, d)).attention <= step.parts(few, max(c, d)).attention, (
        f"{model} on {gpu} tp {tp}: more context to read cost less attention")


@pytest.mark.provided
@settings(max_examples=60)
@given(st.sampled_from(PRESETS), st.sampled_from(PROFILED), st.sampled_from((1, 2, 4, 8)),
       st.integers(1, 4096), st.integers(0, 500_000))
def test_the_measured_step_is_never_below_the_roofline(model, gpu, tp, tokens, context):
    measured = cost(model, gpu, tp, cpu_overhead_s=0.0).parts(tokens, context).total
    floor = costmodel.roofline_step_cost(lab, model, gpu, tp).parts(tokens, context).total
    assert measured >= floor, (f"{model} on {gpu} tp {tp}, {tokens} tokens, {context} context: measured "
                               f"{measured * 1e3:.3f} ms under the roofline's {floor * 1e3:.3f} ms, a floor at peak")


@pytest.mark.provided
def test_a_smaller_shard_runs_further_from_peak_so_tp_8_costs_more_gpu_time_per_token_than_tp_2():
    two, eight = (cost(tp=tp, cpu_overhead_s=0.0).parts(64, 64 * 500) for tp in (2, 8))
    assert 8 * eight.linear > 2 * two.linear, "the GEMMs of a quarter shard take more GPU-seconds in all"
    assert 8 * eight.total > 2 * two.total, "tp 8 costs more GPU-time per token than tp 2 (quiz 8 asks why)"


@pytest.mark.provided
def test_attention_pairs_charge_a_prefill_its_flops():
    step = cost(tp=1)
    decode_like = step.parts(2048, 2048).attention
    prefill = step.parts(2048, 2048, attention_pairs=2048 * 2049 // 2).attention
    assert prefill > decode_like, "a 2048-token prompt's causal attention (2M query-key pairs) costs its FLOPs"


# --- the terms by hand, from the shipped coefficients -------------------------------------------


def coefficients(gpu="a100-80gb"):
    return costmodel.load_profile()["gpus"][gpu]


@pytest.mark.provided
@pytest.mark.parametrize("m", [1, 300])
def test_a_gemm_costs_a_launch_then_the_p_norm_of_its_memory_and_compute_times(m):
    g = coefficients()
    c, n, k = g["gemm"], 6912, 5120
    rows = -(-m // 64)                                  # the token rows a 64-row tile computes
    tiles = rows * -(-n // 128)
    efficiency = c["compute_efficiency"] * tiles / (tiles + c["tiles_per_sm_half"] * g["num_sms"])
    compute = 2 * rows * 64 * n * k / (g["peak_flops"] * efficiency)
    memory = 2 * (m * k + k * n + m * n) / (g["peak_bandwidth"] * c["bandwidth_efficiency"])
    p = c["blend"]
    expected = c["launch_s"] + (memory**p + compute**p) ** (1 / p)
    assert float(costmodel.gemm_seconds(g, m, n, k)) == pytest.approx(expected, rel=1e-12), (
        "a GEMM: its launch floor, then its memory and compute times (whole 64 x 128 tiles, at an efficiency rising "
        "with the tiles per SM) blended by the fitted p-norm")


@pytest.mark.provided
def test_the_allreduce_term_is_two_per_layer_of_the_steps_hidden_states():
    step = cost("llama-2-13b", "h100-80gb", 4)
    ring = coefficients("h100-80gb")["allreduce"]["4"]
    message = 48 * 5120 * 2                             # 48 tokens x hidden 5120 x 2 bytes
    moved = 2 * 3 / 4 * message / ring["bus_bandwidth"]
    one = (ring["latency_s"] ** ring["blend"] + moved ** ring["blend"]) ** (1 / ring["blend"])
    assert step.parts(48, 48 * 300).allreduce == pytest.approx(2 * 40 * one, rel=1e-12), (
        "Megatron's 2 all-reduces per layer (after attention, after the MLP), 40 layers, each of the step's hidden "
        "states, as the DGX profile's latency and bus bandwidth give")


@pytest.mark.provided
def test_decode_attention_reads_each_gpus_share_of_the_kv_at_the_paged_kernels_bandwidth():
    g = coefficients()
    step = cost("llama-2-70b", "a100-80gb", 4)
    kv = (64 * 1000 + 64) * 2 * (8 / 4) * 128 * 2       # the context read and the new tokens written, 2 of 8 KV heads
    read = kv / (g["peak_bandwidth"] * g["gemv_bandwidth_efficiency"] * costmodel.PAGED_KV_BANDWIDTH_SHARE)
    expected = 80 * (costmodel.ATTENTION_KERNELS_PER_LAYER * g["gemm"]["launch_s"] + read)
    assert step.parts(64, 64 * 1000).attention == pytest.approx(expected, rel=1e-12), (
        "a decode step's attention: per layer, its kernels' launch floors and the GPU's K/V read at the bandwidth a "
        "GEMV reaches, less the block table's 10%")


@pytest.mark.provided
def test_each_gemm_shard_splits_its_outputs_or_its_inputs_over_tp():
    shape = costmodel.layer_shape(lab.MODELS["llama-2-70b"])
    assert shape.gemms(8) == {"attn_pre_proj": ((64 + 2 * 8) * 128 / 8, 8192), "attn_post_proj": (8192, 64 * 128 / 8),
                              "mlp_up_proj": (2 * 28672 / 8, 8192), "mlp_down_proj": (8192, 28672 / 8)}, (
        "(n, k) per GPU: QKV and the gated up projection split their outputs (column-parallel), O and down their "
        "inputs (row-parallel)")


# --- any model, and the fallback ---------------------------------------------------------------


@pytest.mark.provided
def test_a_model_that_is_not_a_preset_costs_by_its_own_shape():
    # InternLM-20B's shape (config.json: hidden 5120, 40 heads, 60 layers, MLP 13824, gated)
    internlm = lab.ModelSpec("internlm-20b", 20_000_000_000, 60, 40, 128, num_attention_heads=40,
                             intermediate_size=13824)
    step = costmodel.measured_step_cost(lab, internlm, "h100-80gb", 4)
    parts = step.parts(32, 32 * 1000)
    assert min(parts.linear, parts.attention, parts.allreduce) > 0, f"every term of its tp-4 decode step: {parts}"
    assert step.shape.gemms(4)["mlp_down_proj"] == (5120, 13824 / 4), "the down projection: 13824 / tp in, 5120 out"
    assert step.num_layers == 60
    narrow = lab.ModelSpec("narrow", 20_000_000_000, 60, 40, 128, num_attention_heads=40, intermediate_size=6912)
    assert costmodel.measured_step_cost(lab, narrow, "h100-80gb", 4).parts(2048, 2048).linear < step.parts(
        2048, 2048).linear, "half the MLP's width costs less"


@pytest.mark.provided
def test_an_ungated_mlp_runs_one_up_projection_not_two():
    gated = lab.ModelSpec("g", 3_000_000_000, 32, 32, 80, num_attention_heads=32, intermediate_size=10240)
    plain = lab.ModelSpec("p", 3_000_000_000, 32, 32, 80, num_attention_heads=32, intermediate_size=10240,
                          gated_mlp=False)
    assert costmodel.layer_shape(plain).gemms(1)["mlp_up_proj"][0] == 10240, "phi-2 and GPT-2: one up projection"
    assert costmodel.layer_shape(gated).gemms(1)["mlp_up_proj"][0] == 2 * 10240, "SwiGLU: gate and up, fused"
    assert cost(plain, tp=1).parts(512, 512).linear < cost(gated, tp=1).parts(512, 512).linear


@pytest.mark.provided
def test_without_intermediate_size_the_mlp_width_comes_from_the_parameters():
    preset = lab.MODELS["llama-2-7b"]
    unknown = lab.ModelSpec("llama-2-7b?", preset.num_params, 32, 32, 128, num_attention_heads=32)
    width = costmodel.layer_shape(unknown).intermediate
    assert preset.intermediate_size <= width <= 1.07 * preset.intermediate_size, (
        f"the parameters attention leaves, all charged to the MLP (embeddings too), give {width} for Llama-2-7B's "
        f"{preset.intermediate_size}: a slight overestimate")


@pytest.mark.provided
def test_the_presets_carry_their_configs_mlp_width():
    widths = {"llama-2-7b": 11008, "llama-2-13b": 13824, "llama-2-70b": 28672, "llama-3-8b": 14336,
              "mistral-7b": 14336}
    assert {name: lab.MODELS[name].intermediate_size for name in widths} == widths, "config.json's intermediate_size"
    assert all(lab.MODELS[name].gated_mlp for name in widths), "Llama and Mistral MLPs are gated (SwiGLU)"


@pytest.mark.provided
@pytest.mark.parametrize("gpu", ["l4", "h200", "a100-40gb"])
def test_a_gpu_without_a_published_profile_falls_back_to_the_roofline(gpu):
    with pytest.raises(costmodel.NoProfile, match="a100-80gb"):
        costmodel.measured_step_cost(lab, "llama-2-7b", gpu)
    assert isinstance(costmodel.step_cost(lab, "llama-2-7b", gpu), costmodel.RooflineStepCost), (
        f"{gpu} has no published profile: step_cost answers with the roofline")
    assert isinstance(costmodel.step_cost(lab, "llama-2-7b", "a100-80gb"), costmodel.MeasuredStepCost)


@pytest.mark.provided
def test_tp_between_profiled_degrees_interpolates_and_past_one_node_has_no_profile():
    gpu = costmodel.load_profile()["gpus"]["a100-80gb"]
    two, three, four = (costmodel.allreduce_ring(gpu, tp)["latency_s"] for tp in (2, 3, 4))
    assert min(two, four) <= three <= max(two, four), "tp 3 lies between the profiled tp 2 and tp 4"
    with pytest.raises(costmodel.NoProfile, match="tp 16"):
        cost(tp=16)


@pytest.mark.provided
@pytest.mark.parametrize("kwargs, error, says", [
    (dict(cpu_overhead_s=-1e-3), ValueError, "cpu_overhead_s"),
    (dict(cpu_overhead_s=float("nan")), ValueError, "cpu_overhead_s"),
    (dict(tp=0), ValueError, "tensor_parallel_size"),
    (dict(model=lab.ModelSpec("m", 10**9, 8, 8, 64, gated_mlp="yes")), TypeError, "gated_mlp"),
    (dict(model=lab.ModelSpec("tiny", 1000, 8, 8, 64)), ValueError, "intermediate_size"),
])
def test_bad_input_is_an_error_naming_it(kwargs, error, says):
    with pytest.raises(error, match=says):
        cost(**kwargs)


@pytest.mark.provided
def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        cost().parts(-1, 0)


# --- the shipped table ----------------------------------------------------------------------------


@pytest.mark.provided
def test_the_shipped_table_says_where_it_comes_from_and_carries_the_mit_notice():
    profile = json.loads(costmodel.PROFILE_PATH.read_text())
    source = profile["source"]
    assert len(source["commit"]) == 40 and source["repository"] == "https://github.com/microsoft/vidur"
    fitted = " ".join(source["fitted_on"])
    assert "Llama-2-7b-hf" in fitted and "Llama-2-70b-hf" in fitted and "all_reduce.csv" in fitted
    assert not any(name in fitted for name in ("CodeLlama", "Qwen", "internlm", "phi-2", "Llama-3")), (
        "fitted on Llama-2-7B, Llama-2-70B and the DGX all-reduces only: the other models are the check")
    assert "MIT License" in profile["license"] and "Copyright (c) Microsoft Corporation" in profile["license"]
    assert set(profile["gpus"]) == set(PROFILED)


def _vidur() -> str | None:
    """$VIDUR_DIR if set; else a clone beside this checkout, or the bare mirror this project was fitted from."""
    given = os.environ.get("VIDUR_DIR")
    for path in [given] if given is not None else [ROOT.parent / "vidur", "/work/.mirror/microsoft+vidur/repo"]:
        if path and pathlib.Path(path).exists():
            return str(path)
    return None


def _fit_tool():
    from tools.fleet import fit_vidur
    return fit_vidur


needs_vidur = pytest.mark.skipif(_vidur() is None, reason="Vidur's profiles are not on this machine: set VIDUR_DIR "
                                                          "to a clone of https://github.com/microsoft/vidur")


@pytest.mark.provided
@needs_vidur
def test_the_shipped_table_predicts_the_held_out_models_linear_operators_within_15_percent():
    import numpy as np
    tool = _fit_tool()
    vidur = tool.Vidur(_vidur())
    profile = costmodel.load_profile()
    checked = []
    for gpu in PROFILED:
        for model in tool.HELD_OUT:
            rows = tool.load_compute(vidur, gpu, model)
            if rows is None:
                continue
            errors = np.abs(np.concatenate(list(tool.linear_errors(profile["gpus"][gpu], rows).values())))
            checked.append(model)
            assert np.median(errors) <= 0.15 and errors.max() <= 0.35, (
                f"{model} on {gpu}, tp 1-8, 1-4096 tokens: median |error| {np.median(errors):.1%} (at most 15%), "
                f"worst {errors.max():.1%} (at most 35%)")
    assert len(checked) == 10, f"6 held-out models on the A100, 4 on the H100; found {len(checked)}"


@pytest.mark.provided
@needs_vidur
def test_the_shipped_allreduce_is_within_25_percent_of_the_dgx_profiles_at_decode_and_prefill_sizes():
    tool = _fit_tool()
    vidur = tool.Vidur(_vidur())
    for gpu, coefficients in costmodel.load_profile()["gpus"].items():
        rings = tool.load_allreduce(vidur, gpu)
        for tp, ring in coefficients["allreduce"].items():
            for size, error in tool.allreduce_errors(ring, int(tp), *rings[int(tp)]).items():
                assert abs(error) <= 0.25, f"{gpu} tp {tp}, {size}: {error:+.0%} against the DGX profile"
