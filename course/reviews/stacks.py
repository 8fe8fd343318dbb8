"""Pick a stack: vLLM, TensorRT-LLM or SGLang, as data and rules, and what prefix sharing saves
measured on the handed module's own engine."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class ServingStack:
    """What a serving stack runs on and what it is built to be best at. All three do
    continuous batching, a paged KV cache, prefix caching and speculative decoding; what
    separates them is hardware reach and design centre."""

    name: str
    hardware: frozenset
    design_center: str
    prefix_reuse: str
    setup: str
    source: str


STACKS: dict[str, ServingStack] = {
    "vllm": ServingStack(
        name="vLLM",
        # docs.vllm.ai Installation: NVIDIA CUDA, AMD ROCm, Intel XPU, CPU (x86, ARM, Apple
        # silicon, IBM Z), Google TPU, Intel Gaudi, AWS Neuron; Ascend via the vllm-ascend plugin.
        hardware=frozenset({"nvidia", "amd", "intel", "tpu", "cpu", "aws-neuron", "ascend"}),
        design_center="throughput on open-weights models: PagedAttention, continuous batching, "
                      "the widest model and hardware coverage",
        prefix_reuse="automatic prefix caching (hash of each full block)",
        setup="pip install; loads a Hugging Face checkpoint directly",
        source="Kwon et al. SOSP'23; docs.vllm.ai getting_started/installation"),
    "tensorrt-llm": ServingStack(
        name="TensorRT-LLM",
        # NVIDIA/TensorRT-LLM README: "inference efficiently on NVIDIA GPUs".
        hardware=frozenset({"nvidia"}),
        design_center="lowest latency on NVIDIA GPUs: NVIDIA's own kernels and low-precision "
                      "(FP8/FP4) paths tuned per GPU generation",
        prefix_reuse="KV cache block reuse",
        # nvidia.github.io/TensorRT-LLM: the classic path builds a TensorRT engine per model,
        # GPU and max shapes (trtllm-build); the PyTorch backend (0.17+) loads HF checkpoints,
        # and the newest releases remove the engine backend.
        setup="NVIDIA containers; classic path compiles an engine per GPU and max shapes, "
              "newer releases load HF checkpoints via a PyTorch backend",
        source="nvidia.github.io/TensorRT-LLM (torch.html, legacy/tensorrt-backend-removal)"),
    "sglang": ServingStack(
        name="SGLang",
        # docs.sglang.io Hardware Platforms: NVIDIA GPUs, AMD GPUs, Ascend NPUs, CPU servers,
        # TPU, Intel XPU.
        hardware=frozenset({"nvidia", "amd", "ascend", "cpu", "tpu", "intel"}),
        design_center="prefix-heavy and structured workloads: RadixAttention keeps shared "
                      "prefixes' KV in a radix tree across requests; compressed-FSM constrained decoding",
        prefix_reuse="RadixAttention (radix tree over token prefixes, LRU eviction)",
        setup="pip install; loads a Hugging Face checkpoint directly",
        source="Zheng et al., SGLang (NeurIPS 2024); docs.sglang.io"),
}


class StackChoice(NamedTuple):
    stack: str                # a key of STACKS
    deciding_constraint: str  # the constraint that settled it, in a sentence


def choose_stack(hardware: str = "nvidia", priority: str = "throughput",
                 prefix_sharing: bool = False, structured_output: bool = False) -> StackChoice:
    """Pick a stack from STACKS for a workload. Rules, in order:
    1. hardware filters (TensorRT-LLM runs on NVIDIA only);
    2. heavy prefix sharing or constrained (JSON/regex) output -> SGLang, if it runs there;
    3. priority "latency" -> TensorRT-LLM, if the fleet is NVIDIA;
    4. otherwise vLLM. The deciding constraint is the rule that fired, or the hardware when
    it ruled out the stack the priority asked for."""
    if priority not in ("throughput", "latency"):
        raise ValueError(f"priority must be 'throughput' or 'latency', got {priority!r}")
    known = set().union(*(s.hardware for s in STACKS.values()))
    if hardware not in known:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(known))}")
    runs = {key for key, stack in STACKS.items() if hardware in stack.hardware}
    if (prefix_sharing or structured_output) and "sglang" in runs:
        why = ("heavy prefix sharing: RadixAttention reuses the shared prefixes' KV across requests"
               if prefix_sharing else "constrained output: compressed-FSM decoding for JSON/regex")
        return StackChoice("sglang", why)
    if priority == "latency":
        if "tensorrt-llm" in runs:
            return StackChoice("tensorrt-llm", "lowest latency on an NVIDIA-only fleet")
        return StackChoice("vllm", f"hardware: {hardware} rules out TensorRT-LLM (NVIDIA-only)")
    return StackChoice("vllm", "throughput on open weights, with the broadest model and hardware support")


# Example workloads for the design review: (description, choose_stack keyword arguments).
STACK_WORKLOADS = (
    ("batch summarisation with an open-weights Llama on A100s, throughput first",
     {"hardware": "nvidia", "priority": "throughput"}),
    ("voice assistant on H100s, tight per-token latency SLO, short distinct prompts",
     {"hardware": "nvidia", "priority": "latency"}),
    ("agent with a 4k-token shared system prompt and tools, JSON replies, on H100s",
     {"hardware": "nvidia", "priority": "latency", "prefix_sharing": True, "structured_output": True}),
    ("chat endpoint on AMD MI300X, latency first",
     {"hardware": "amd", "priority": "latency"}),
)


def format_stack_choice(workloads=STACK_WORKLOADS) -> str:
    """The stacks as a table, then each workload with the chosen stack and deciding constraint."""
    lines = ["Serving stacks (all three do continuous batching - TensorRT-LLM calls it in-flight "
             "batching -, a paged KV cache, prefix caching and speculative decoding)"]
    for stack in STACKS.values():
        lines.append(f"  {stack.name:<13} runs on {', '.join(sorted(stack.hardware))}")
        lines.append(f"  {'':<13} best at: {stack.design_center}")
        lines.append(f"  {'':<13} prefix reuse: {stack.prefix_reuse}; setup: {stack.setup}")
    lines.append("Workloads:")
    for description, constraints in workloads:
        choice = choose_stack(**constraints)
        lines.append(f"  {description}\n    -> {STACKS[choice.stack].name}: {choice.deciding_constraint}")
    return "\n".join(lines)


def _measured_prefix_sharing(lab: ModuleType, num_requests: int = 16, system_len: int = 96, user_len: int = 16) -> str:
    """What "complex prefix sharing" is worth, on the toy engine: requests that share a system
    prompt, with prefix caching off and on. One request warms the cache first (a block becomes
    findable once its K/V is computed, so requests admitted in the same step cannot share yet)."""
    model = lab.ToyTransformer(lab.ModelConfig(), seed=0)
    rng = np.random.default_rng(0)
    system = rng.integers(0, model.config.vocab_size, system_len).tolist()
    prompts = [system + rng.integers(0, model.config.vocab_size, user_len).tolist() for _ in range(num_requests)]
    sampling = lab.SamplingParams(max_tokens=8)
    runs = {}
    for caching in (False, True):
        engine = lab.LLMEngine(model, block_size=16, enable_prefix_caching=caching)
        outs = engine.generate(prompts[:1], sampling) + engine.generate(prompts[1:], sampling)
        reused = engine.allocator.stats.hits * engine.allocator.block_size
        runs[caching] = ([o.output_token_ids for o in outs], reused, engine.prefix_cache_hit_rate)
    (plain, _, _), (cached, reused, hit_rate) = runs[False], runs[True]
    total = sum(len(p) for p in prompts)
    return (f"Measured: prefix caching on the toy engine, {num_requests} requests sharing a {system_len}-token system "
            f"prompt (+{user_len} tokens each):\n  prefill tokens computed {total} -> {total - reused} "
            f"({reused / total:.0%} served from the cache, block hit rate {hit_rate:.0%}); outputs identical: "
            f"{plain == cached}")


def scenario_stack(lab: ModuleType, hardware: str | None = None, priority: str = "throughput",
                   prefix_sharing: bool = False, structured_output: bool = False) -> str:
    """Pick a stack: the example workloads, what prefix sharing saves (measured on the lab's own
    engine, or which stub it still needs), and the answer for yours when a hardware is given."""
    text = format_stack_choice()
    try:
        text += "\n\n" + _measured_prefix_sharing(lab)
    except NotImplementedError as exc:  # the table above is provided; the run needs the exercises
        text += f"\n\nMeasured prefix sharing: not yet: {exc} is still a stub"
    if hardware is not None:
        choice = choose_stack(hardware=hardware, priority=priority, prefix_sharing=prefix_sharing,
                              structured_output=structured_output)
        text += f"\n\nYour workload: {choice.stack}, decided by: {choice.deciding_constraint}"
    return text
