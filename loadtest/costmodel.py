"""Step cost models for the simulator: derived from a model, a GPU and a tensor-parallel degree by
Exercise 8's roofline, or fitted to steps measured on this machine.

The simulator (simulator.py, fleet.py) asks one question of a cost model: how many seconds does a
step take that runs `num_tokens` new tokens and reads `num_context_tokens` tokens of K/V? Two
answers live here:

- `roofline_step_cost(model, gpu, tp)`: the plan's own arithmetic (plan_deployment, Exercise 8)
  applied per step. Reading the weights and the K/V at the memory bandwidth, or the FLOPs at peak,
  whichever is slower; for tp > 1 the all-reduces that stitch the layer's shards together, which no
  overlap hides. Peak figures: a lower bound, as the plan's decode step is.
- `fit_step_cost(samples)`: a line through measured steps, `fixed + per_token * tokens +
  per_context_token * context`. On a CPU the parts add up (one core does the matmuls, the attention
  and the Python in turn), so a sum fits where a GPU's max() would not.

Vidur (Agrawal et al., MLSys'24) profiles each operator instead and predicts request latency within
9%; the two terms here are the teaching version of the same idea.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# The interconnect a tensor-parallel group's all-reduces cross, bytes/s per GPU in one direction
# (ASSUMED figures from the vendors' datasheets): NVLink 3 on an A100 SXM is 600 GB/s both ways,
# NVLink 4 on an H100/H200 SXM 900 GB/s; an L4 has no NVLink, so PCIe 4.0 x16 (~32 GB/s).
INTERCONNECT_BYTES_PER_S = {"a100-40gb": 300e9, "a100-80gb": 300e9, "h100-80gb": 450e9, "h200": 450e9, "l4": 32e9}
DEFAULT_INTERCONNECT_BYTES_PER_S = 32e9  # a GPU not listed: PCIe 4.0 x16
# One all-reduce's fixed cost (launch + ring latency); NCCL's small all-reduces on NVLink take
# ~10 us (an ASSUMED round figure: the term matters for decode steps, whose messages are small).
ALLREDUCE_LATENCY_S = 10e-6
# Megatron-style tensor parallelism all-reduces twice per layer: after attention's output
# projection and after the MLP's down projection.
ALLREDUCES_PER_LAYER = 2


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A step's seconds, term by term (what `why` reports): memory and compute overlap (the
    slower wins), communication adds."""

    weights: float
    kv: float
    compute: float
    allreduce: float

    @property
    def memory(self) -> float:
        return self.weights + self.kv

    @property
    def total(self) -> float:
        return max(self.memory, self.compute) + self.allreduce

    @property
    def bound(self) -> str:
        """The term that sets the step: "weights", "kv", "compute" or "allreduce"."""
        if self.allreduce > max(self.memory, self.compute):
            return "allreduce"
        if self.compute > self.memory:
            return "compute"
        return "weights" if self.weights >= self.kv else "kv"


@dataclasses.dataclass(frozen=True)
class RooflineStepCost:
    """Seconds per step of one tensor-parallel group, by the roofline (see the module docstring).
    Every field is per GPU of the group; `tensor_parallel_size` is kept for the printouts."""

    weight_read_time: float          # all weights / tp, read once per step
    kv_read_time_per_token: float    # one context token's K/V / tp
    compute_time_per_token: float    # 2 FLOPs per parameter / tp, at peak
    allreduce_time_per_token: float  # the bytes one token adds to every all-reduce of the step
    allreduce_fixed_time: float      # the all-reduces' latency, whatever the batch
    tensor_parallel_size: int = 1

    def parts(self, num_tokens: int, num_context_tokens: int) -> StepCost:
        return StepCost(self.weight_read_time, self.kv_read_time_per_token * num_context_tokens,
                        self.compute_time_per_token * num_tokens,
                        self.allreduce_fixed_time + self.allreduce_time_per_token * num_tokens
                        if self.tensor_parallel_size > 1 else 0.0)

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        return self.parts(num_tokens, num_context_tokens).total


def roofline_step_cost(lab, model, gpu, tensor_parallel_size: int = 1,
                       interconnect_bytes_per_s: float | None = None) -> RooflineStepCost:
    """The step cost of `model` (a `lab.ModelSpec` or preset name) on a group of
    `tensor_parallel_size` GPUs `gpu` (a `lab.GPUSpec` or name), by plan_deployment's roofline:
    weights (num_params * dtype_bytes / tp) and each context token's K/V (kv_bytes_per_token / tp)
    read at the GPU's bandwidth, 2 * num_params / tp FLOPs per token at its peak; plus, for tp > 1,
    ALLREDUCES_PER_LAYER ring all-reduces per layer of the step's hidden states (tokens x hidden x
    dtype_bytes; a ring moves 2 (tp - 1) / tp of it through each GPU) at `interconnect_bytes_per_s`
    (default: INTERCONNECT_BYTES_PER_S for the GPU), each with ALLREDUCE_LATENCY_S."""
    model, gpu = lab.get_model(model), lab.get_gpu(gpu)
    tp = lab.check_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
    link = interconnect_bytes_per_s or INTERCONNECT_BYTES_PER_S.get(gpu.name, DEFAULT_INTERCONNECT_BYTES_PER_S)
    if not link > 0:
        raise ValueError(f"interconnect_bytes_per_s must be > 0, got {interconnect_bytes_per_s!r}")
    hidden = (model.num_attention_heads or model.num_kv_heads) * model.head_dim
    num_allreduces = ALLREDUCES_PER_LAYER * model.num_layers
    ring_bytes_per_token = 2 * (tp - 1) / tp * hidden * model.dtype_bytes
    return RooflineStepCost(
        weight_read_time=model.weight_bytes / tp / gpu.bandwidth_bytes_per_s,
        kv_read_time_per_token=lab.kv_bytes_per_token(model) / tp / gpu.bandwidth_bytes_per_s,
        compute_time_per_token=2 * model.num_params / tp / gpu.flops,
        allreduce_time_per_token=num_allreduces * ring_bytes_per_token / link,
        allreduce_fixed_time=num_allreduces * ALLREDUCE_LATENCY_S,
        tensor_parallel_size=tp,
    )


@dataclasses.dataclass(frozen=True)
class LinearStepCost:
    """Seconds per step as a sum: `fixed + per_token * num_tokens + per_context_token *
    num_context_tokens` (a CPU engine: see the module docstring). `fit_step_cost` makes one."""

    fixed: float
    per_token: float
    per_context_token: float

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens + self.per_context_token * num_context_tokens


def fit_step_cost(samples: Sequence[tuple[int, int, float]]) -> LinearStepCost:
    """Least squares through measured steps, each (scheduled tokens, context tokens, seconds);
    no coefficient below 0 (one the fit wants negative is dropped and the rest refitted: a step
    never gets cheaper with more work). Needs 3 or more steps."""
    data = np.asarray(samples, dtype=np.float64)
    if data.ndim != 2 or data.shape[1] != 3 or len(data) < 3:
        raise ValueError(f"samples must be 3 or more (tokens, context tokens, seconds) rows, got shape {data.shape}")
    if not (np.isfinite(data).all() and (data >= 0).all()):
        raise ValueError("samples must be finite and >= 0")
    columns = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(columns[:, keep], data[:, 2], rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[keep] = np.maximum(coef, 0.0)
    return LinearStepCost(*map(float, full))
