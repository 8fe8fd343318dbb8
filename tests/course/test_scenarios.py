"""test_scenarios.py"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import lab
from course.reviews import scenarios, sizing, stacks
from loadtest import datasets
from tests.support import MODEL_CONFIGS

# --- KV memory waste ----------------------------------------------------------------------


@pytest.mark.provided
def test_kv_utilization_small_example_by_hand():
    # lengths 1, 16, 17 with blocks of 16: paged reserves 16 + 16 + 32 = 64 slots, slabs 3 x 32 = 96
    util = sizing.kv_memory_utilization(lab, [1, 16, 17], max_model_len=32, block_size=16)
    assert util.paged == pytest.approx(34 / 64)
    assert util.slab == pytest.approx(34 / 96)


@pytest.mark.provided
@settings(max_examples=50)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40), block_size=st.sampled_from([1, 4, 16, 32]))
def test_paged_waste_is_under_one_block_per_sequence(lengths, block_size):
    util = sizing.kv_memory_utilization(lab, lengths, max_model_len=300, block_size=block_size)
    held, n = sum(lengths), len(lengths)
    assert held / (held + n * (block_size - 1)) <= util.paged + 1e-12, "paging wastes < block_size slots per sequence"
    assert util.paged <= 1.0
    assert util.slab == pytest.approx(held / (n * 300))


@pytest.mark.provided
def test_sampled_lengths_match_the_paper_means_and_are_deterministic():
    prompts, outputs = datasets.sample_request_lengths(lab, lab.SHAREGPT, 20_000, seed=0)
    assert prompts.mean() == pytest.approx(161.31, rel=0.05) and outputs.mean() == pytest.approx(337.99, rel=0.05)
    again = datasets.sample_request_lengths(lab, lab.SHAREGPT, 20_000, seed=0)
    assert np.array_equal(prompts, again[0]) and np.array_equal(outputs, again[1])
    p, o = datasets.sample_request_lengths(lab, lab.ALPACA, 1000, seed=1, max_model_len=64)
    assert p.min() >= 1 and o.min() >= 1 and (p + o).max() <= 64


@pytest.mark.provided
def test_paged_above_95_percent_and_slab_far_lower_on_sharegpt():
    prompts, outputs = datasets.sample_request_lengths(lab, lab.SHAREGPT, 10_000, seed=0, max_model_len=2048)
    util = sizing.kv_memory_utilization(lab, prompts + outputs, max_model_len=2048, block_size=16)
    assert util.paged > 0.95, f"paged blocks should hold > 95% real tokens, got {util.paged:.3f}"
    assert util.slab < 0.35, f"a 2048-token slab per request should waste most of itself, got {util.slab:.3f}"
    assert "ShareGPT" in sizing.format_waste(lab) and "Alpaca" in sizing.format_waste(lab)


@pytest.mark.provided
@pytest.mark.parametrize("lengths", [[], [0, 5], [5, 3000], [1.5, 2.0]])
def test_kv_utilization_rejects_lengths_outside_one_to_max(lengths):
    with pytest.raises(ValueError):
        sizing.kv_memory_utilization(lab, lengths, max_model_len=2048, block_size=16)


# --- the stack choice ---------------------------------------------------------------------


@pytest.mark.provided
@pytest.mark.parametrize("constraints, stack, deciding", [
    ({"hardware": "nvidia", "priority": "throughput"}, "vllm", "throughput"),
    ({"hardware": "nvidia", "priority": "latency"}, "tensorrt-llm", "latency"),
    ({"hardware": "nvidia", "prefix_sharing": True}, "sglang", "prefix"),
    ({"hardware": "amd", "priority": "latency"}, "vllm", "hardware"),
    ({"hardware": "tpu", "priority": "throughput"}, "vllm", "throughput"),
])
def test_choose_stack_clear_cut_workloads(constraints, stack, deciding):
    choice = stacks.choose_stack(**constraints)
    assert choice.stack == stack, f"{constraints}: expected {stack}, got {choice.stack}"
    assert deciding in choice.deciding_constraint
    name, reason = choice  # also a (stack, deciding_constraint) pair
    assert (name, reason) == (choice.stack, choice.deciding_constraint)


@pytest.mark.provided
def test_tensorrt_llm_is_never_chosen_off_nvidia():
    hardware = set().union(*(s.hardware for s in stacks.STACKS.values())) - {"nvidia"}
    for hw in hardware:
        for priority in ("throughput", "latency"):
            for prefix in (False, True):
                choice = stacks.choose_stack(hardware=hw, priority=priority, prefix_sharing=prefix)
                assert choice.stack != "tensorrt-llm" and hw in stacks.STACKS[choice.stack].hardware


@pytest.mark.provided
def test_choose_stack_rejects_unknown_constraints():
    with pytest.raises(ValueError, match="priority"):
        stacks.choose_stack(priority="cheapest")
    with pytest.raises(ValueError, match="nvidia"):
        stacks.choose_stack(hardware="abacus")


@pytest.mark.provided
def test_format_stack_choice_names_each_stack_and_deciding_constraint():
    text = stacks.format_stack_choice()
    for name in ("vLLM", "TensorRT-LLM", "SGLang"):
        assert f"-> {name}:" in text, f"the example workloads should include one that picks {name}"


# --- the sizing printout (course/reviews/sizing.py's format_plan, on Exercise 8's plan) ------------


@pytest.mark.needs(8)
def test_format_plan_shows_the_kv_blocks_set_the_ceiling():
    text = sizing.format_plan(lab, lab.plan_deployment(**sizing.SEED_SIZING))
    assert "The KV blocks, not the weights, set the ceiling" in text
    assert "3912" in text and "// 512 blocks = 7" in text
    assert "deleting the weights altogether -> 11" in text, "zero-byte weights only lift 7 to 11 sequences"
    assert "QPS" in text


@pytest.mark.needs(8)
def test_format_plan_prices_a_million_output_tokens_from_the_plans_throughput():
    plan = lab.plan_deployment(**sizing.SEED_SIZING)
    text = sizing.format_plan(lab, plan, usd_per_gpu_hour=2.0)
    roofline = 2.0 / (plan.output_tokens_per_s * 3600) * 1e6   # one GPU's hour over its tokens
    measured = 2.0 / (sizing.measure_plan(lab, plan).qps * plan.mean_output_len * 3600) * 1e6
    assert f"${measured:.2f} per 1M output tokens measured, ${roofline:.2f} on the roofline" in text, (
        f"expected ${measured:.2f} per 1M output tokens measured and ${roofline:.2f} on the roofline (price per hour "
        f"/ output tokens per hour at each's throughput):\n{text}")


@pytest.mark.needs(8)
def test_size_runs_littles_law_on_the_measured_step_beside_the_roofline():
    from loadtest.costmodel import measured_step_cost
    plan = lab.plan_deployment(**sizing.SEED_SIZING)
    step = measured_step_cost(lab, plan.model, plan.gpu, 1)
    seats, prompt = plan.max_concurrent_seqs, round(plan.mean_prompt_len)
    decode = step.step_time(seats, round(seats * plan.mean_context_len))
    prefill = step.parts(prompt, prompt, prompt * (prompt + 1) // 2).total
    qps = seats / (plan.mean_output_len * decode + seats * prefill)
    measured = sizing.measure_plan(lab, plan)
    assert measured.qps == pytest.approx(qps, rel=1e-12), (
        "size's measured QPS: Little's law with the measured decode step of the plan's seats and one mean prompt's "
        "prefill step")
    assert f"decode step {decode * 1e3:.1f} ms" in sizing.format_plan(lab, plan)


@pytest.mark.needs(8)
def test_format_plan_prices_a_tensor_parallel_group_at_every_gpu_it_holds():
    plan = lab.plan_deployment("llama-3-8b", "a100-40gb", 8192, tensor_parallel_size=2)
    text = sizing.format_plan(lab, plan, usd_per_gpu_hour=2.0)
    per_million = 2 * 2.0 / (plan.output_tokens_per_s * 3600) * 1e6   # the group's 2 GPUs, its tokens
    assert f"${per_million:.2f} per 1M output tokens" in text, (
        f"expected ${per_million:.2f} per 1M output tokens: output_tokens_per_s is the whole tp=2 group's, "
        f"so the price is both GPUs' hour:\n{text}")


@pytest.mark.needs(8)
def test_format_plan_prints_the_block_size_in_mib_of_two_to_the_twenty_bytes():
    # 16 tokens x 819,200 B = 13,107,200 B = 12.5 x 2**20 (13.1 million: MB would be the other unit)
    text = sizing.format_plan(lab, lab.plan_deployment(**sizing.SEED_SIZING))
    assert "3912 blocks x 12.5 MiB" in text, (
        "the plan prints its KV blocks as '3912 blocks x 12.5 MiB': a MiB is 2**20 bytes, like nvidia-smi's")
    text2 = sizing.format_plan(lab, lab.plan_deployment("llama-3-8b", "a100-40gb", 8192, tensor_parallel_size=2))
    assert "29205 blocks x 1 MiB" in text2, "with tp=2 a llama-3-8b block is 1,048,576 B per GPU = 1 MiB"


# --- speculation: the design-review table, the early-exit target, paged greedy decoding ------


@pytest.mark.provided
def test_speculation_table_shows_speedups_breakeven_and_reasons():
    text = scenarios.format_speculation_table(lab, 0.05, alphas=(0.6, 0.8), ks=(1, 4))
    assert f"{lab.speculative_speedup(0.8, 4, 0.05):.2f}" in text
    assert f"{lab.breakeven_draft_cost(0.8, 4):.3f}" in text
    for needle in ("prefill", "batch", "bandwidth", "Leviathan", "Chen"):
        assert needle in text, f"the design-review table should mention {needle!r}"


@pytest.mark.provided
def test_early_exit_target_shrinks_only_later_residual_projections():
    config = lab.ModelConfig(**MODEL_CONFIGS["early_exit"])
    plain = lab.ToyTransformer(config, lab.init_gpt2_weights(config, 0))
    target = scenarios.make_early_exit_target(lab, config, 1, 0.25)
    for name, w in target.weights.items():
        assert w.dtype == np.float32, f"{name} became {w.dtype}: the model path must stay float32"
        later = name.startswith(("h.1.", "h.2.")) and name.endswith("c_proj.weight")
        expected = plain.weights[name] * np.float32(0.25) if later else plain.weights[name]
        assert np.array_equal(w, expected), f"{name}: only c_proj of layers >= 1 may be scaled"


@pytest.mark.needs(4)
def test_paged_greedy_generate_matches_dense_greedy():
    config = lab.ModelConfig(**MODEL_CONFIGS["short"])
    model = lab.ToyTransformer(config)
    prompt = [3, 1, 4, 1, 5]
    out = scenarios.paged_greedy_generate(lab, model, prompt, 6)
    tokens = list(prompt)
    for _ in range(6):  # the reference: re-run the whole sequence densely, no cache
        tokens.append(int(np.argmax(model.forward_dense(tokens)[-1])))
    assert out == tokens[len(prompt):], "plain paged decoding must emit the dense model's greedy tokens"
