"""test_scenarios.py"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import lab
from serving import (
    datasets,
    sizing,
    stacks,
)

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
