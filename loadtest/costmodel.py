"""Step cost models for the simulator: derived from a model, a GPU and a tensor-parallel degree by
Exercise 8's roofline or from the GPUs' published operator times, or fitted to steps measured on
this machine.

The simulator (simulator.py, and `fleet`'s search in fleet_search.py) asks one
question of a cost model: how many seconds does a step take that runs `num_tokens` new tokens and
reads `num_context_tokens` tokens of K/V? Three answers live here:

- `roofline_step_cost(model, gpu, tp)`: the plan's own arithmetic (plan_deployment, Exercise 8)
  applied per step. Reading the weights and the K/V at the memory bandwidth, or the FLOPs at peak,
  whichever is slower; for tp > 1 the all-reduces that stitch the layer's shards together, which no
  overlap hides. Peak figures: a lower bound, as the plan's decode step is.
- `measured_step_cost(lab, model, gpu, tp)`: what the GPU's kernels take, from Vidur's published
  operator profiles (Agrawal et al., MLSys'24, MIT licence; it predicts request latency within 9%
  because it uses measured operators, not peaks). Each GEMM of a layer at the efficiency a GEMM of
  that shard size reaches, the elementwise kernels at theirs, the all-reduces as a DGX measured
  them, attention at FlashAttention's and paged decoding's published efficiencies, plus the
  engine's CPU time per step. The terms add: one CUDA stream runs the kernels in turn, and a
  synchronous engine loop waits for the CPU. Coefficients in vidur_profile.json, fitted by
  tools/fleet/fit_vidur.py (docs/fleet.md: the form, the fit, the error table).
- `fit_step_cost(samples)`: a line through measured steps, `fixed + per_token * tokens +
  per_context_token * context`. On a CPU the parts add up (one core does the matmuls, the attention
  and the Python in turn), so a sum fits where a GPU's max() would not.

The roofline is the floor and names which term binds; the measured cost is what to answer with.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
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


# --- the measured cost: Vidur's operator profiles, fitted -------------------------------------

PROFILE_PATH = pathlib.Path(__file__).with_name("vidur_profile.json")
# The GEMM tile the compute term counts (token rows x output columns): a tensor-core GEMM computes
# whole tiles, so one token costs a 64-row tile's FLOPs, and a shard of few tiles leaves SMs idle.
GEMM_TILE_M, GEMM_TILE_N = 64, 128
# Vidur's operators, the elementwise ones by the kernel that runs them.
ELEMENTWISE_KIND = {"input_layernorm": "norm", "post_attention_layernorm": "norm", "attn_rope": "rope",
                    "mlp_act": "act", "add": "add"}
# Attention. Vidur's attention.csv files are not in the snapshot this project was fitted from (too
# large), so this term uses published kernel efficiencies instead:
# - prefill: FlashAttention-2's forward pass reaches 50-73% of an A100's peak FLOP/s (Dao, arXiv
#   2307.08691; the low end, as serving's chunks are short and causal) and 35% of an H100's (Shah et
#   al., FlashAttention-3, arXiv 2407.08608: FA2 is what vLLM ran on Hopper when Vidur profiled);
# - decode: reading K/V at the bandwidth the profiles show a GEMV reaching (gemv_bandwidth_efficiency,
#   fitted), times 0.9 for reading through a block table (FlashInfer's README: its sparse, paged
#   attention reaches 90% of the bandwidth of a dense kernel of the same size).
PREFILL_ATTENTION_FLOPS_EFFICIENCY = {"a100-80gb": 0.50, "h100-80gb": 0.35}
PAGED_KV_BANDWIDTH_SHARE = 0.9
ATTENTION_KERNELS_PER_LAYER = 2  # writing the new tokens' K/V into the cache, then attention
# The engine's CPU time per step (scheduling, preparing inputs, sampling, processing outputs):
# vLLM's profile of its synchronous loop, one scheduler step per forward pass (v0.5, July 2024),
# shows about 4 ms of GPU idle per decode step ("5-13 ms" in its text; vllm-project/vllm#6854). The
# chapter's engine runs that same loop. Engines that overlap the CPU's work with the GPU's (vLLM's
# async output processing and V1's async scheduling, SGLang's overlap scheduler) hide most of it:
# cpu_overhead_s=0 models that.
CPU_OVERHEAD_S = 4e-3


class NoProfile(ValueError):
    """The GPU (or the tensor-parallel degree) has no published profile: use the roofline."""


@functools.cache
def load_profile(path: str = str(PROFILE_PATH)) -> dict:
    """The fitted coefficients (vidur_profile.json, written by tools/fleet/fit_vidur.py)."""
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def has_profile(gpu_name: str) -> bool:
    return gpu_name in load_profile()["gpus"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One decoder layer as Vidur's profiles describe it (n_embd, n_head, n_kv_head, n_expanded_embd,
    use_gated_mlp): the shapes its kernels run at, per GPU of a tensor-parallel group."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool
    dtype_bytes: int = 2

    def gemms(self, tp: int) -> dict[str, tuple[float, float]]:
        """(n, k) per GPU of each GEMM, tokens x k times k x n, by Vidur's operator names: QKV and
        up projections split their outputs over tp (column-parallel), O and down their inputs."""
        h, d = self.hidden, self.head_dim
        return {"attn_pre_proj": ((self.num_heads + 2 * self.num_kv_heads) * d / tp, h),
                "attn_post_proj": (h, self.num_heads * d / tp),
                "mlp_up_proj": ((2 if self.gated else 1) * self.intermediate / tp, h),
                "mlp_down_proj": (h, self.intermediate / tp)}

    def elementwise_bytes(self, tp: int) -> dict[str, float]:
        """Bytes per token each elementwise kernel reads and writes: the norms and the residual add
        on the whole hidden state (replicated on every GPU), RoPE on the GPU's Q and K heads, the
        activation on its share of the MLP (a gated one reads two halves, writes one)."""
        e, h = self.dtype_bytes, self.hidden
        return {"input_layernorm": 2 * e * h, "post_attention_layernorm": 2 * e * h,
                "attn_rope": 2 * e * (self.num_heads + self.num_kv_heads) * self.head_dim / tp,
                "mlp_act": (3 if self.gated else 2) * e * self.intermediate / tp, "add": 3 * e * h}


def gemm_seconds(gpu: dict, m, n: float, k: float, dtype_bytes: int = 2):
    """One GEMM of m tokens (scalar or array) on one GPU of the profile `gpu`: a launch floor, then
    the memory and compute times blended by a p-norm (p = 1 adds them, p -> inf is the roofline's
    max). Memory: its three matrices at `bandwidth_efficiency` of peak. Compute: whole 64 x 128
    tiles, at an efficiency that rises with the tiles there are to spread over the SMs."""
    c = gpu["gemm"]
    m = np.maximum(np.asarray(m, dtype=np.float64), 1.0)
    rows = np.ceil(m / GEMM_TILE_M)
    tiles = rows * np.ceil(np.asarray(n) / GEMM_TILE_N)
    efficiency = c["compute_efficiency"] * tiles / (tiles + c["tiles_per_sm_half"] * gpu["num_sms"])
    compute = 2 * rows * GEMM_TILE_M * n * k / (gpu["peak_flops"] * efficiency)
    memory = dtype_bytes * (m * k + k * n + m * n) / (gpu["peak_bandwidth"] * c["bandwidth_efficiency"])
    p = c["blend"]
    return c["launch_s"] + (memory**p + compute**p) ** (1 / p)


def elementwise_seconds(gpu: dict, kind: str, nbytes):
    """One elementwise kernel moving `nbytes`: a launch floor plus the bytes at its bandwidth."""
    c = gpu["elementwise"][kind]
    return c["launch_s"] + np.asarray(nbytes, dtype=np.float64) / (gpu["peak_bandwidth"] * c["bandwidth_efficiency"])


def allreduce_seconds(ring: dict, tp: int, nbytes):
    """One all-reduce of `nbytes` over tp GPUs of a DGX: its latency and the ring's 2 (tp - 1) / tp
    of the bytes at the bus bandwidth, blended by a p-norm as a GEMM's terms are."""
    moved = 2 * (tp - 1) / tp * np.asarray(nbytes, dtype=np.float64) / ring["bus_bandwidth"]
    q = ring["blend"]
    return (ring["latency_s"] ** q + moved**q) ** (1 / q)


def layer_seconds(gpu: dict, shape: LayerShape, tp: int, m):
    """One layer's linear operators (GEMMs, norms, RoPE, activation, residual add) for m tokens."""
    total = sum(gemm_seconds(gpu, m, n, k, shape.dtype_bytes) for n, k in shape.gemms(tp).values())
    for op, per_token in shape.elementwise_bytes(tp).items():
        total = total + elementwise_seconds(gpu, ELEMENTWISE_KIND[op], np.asarray(m) * per_token)
    return total


def allreduce_ring(gpu: dict, tp: int) -> dict:
    """The all-reduce coefficients at tp: as profiled at 2, 4 and 8, interpolated in log2(tp)
    between them; past 8 a DGX's all-reduce crosses nodes, which the profiles do not cover."""
    rings = {int(k): v for k, v in gpu["allreduce"].items()}
    if tp in rings:
        return rings[tp]
    if not min(rings) < tp < max(rings):
        raise NoProfile(f"Vidur's DGX all-reduce profiles cover tp {', '.join(map(str, sorted(rings)))} "
                        f"(one node); tp {tp} has none")
    lo, hi = max(t for t in rings if t < tp), min(t for t in rings if t > tp)
    w = (math.log2(tp) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return {key: math.exp((1 - w) * math.log(rings[lo][key]) + w * math.log(rings[hi][key])) for key in rings[lo]}


@dataclasses.dataclass(frozen=True)
class MeasuredParts:
    """A step's seconds by term (`measured_step_cost`). They add: one CUDA stream runs the kernels
    in turn, and a synchronous engine waits for its CPU work between steps."""

    linear: float     # every layer's GEMMs, norms, RoPE, activation and residual add
    attention: float  # every layer's K/V write and attention: prefill's FLOPs, decode's K/V reads
    allreduce: float  # tensor parallelism's 2 per layer
    overhead: float   # the engine's CPU time per step

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.allreduce + self.overhead

    @property
    def bound(self) -> str:
        """The largest term: "linear", "attention", "allreduce" or "overhead"."""
        terms = {"linear": self.linear, "attention": self.attention, "allreduce": self.allreduce,
                 "overhead": self.overhead}
        return max(terms, key=terms.get)


@dataclasses.dataclass(frozen=True)
class MeasuredStepCost:
    """Seconds per step of one tensor-parallel group from the fitted profiles (see
    `measured_step_cost`). `parts` memoises the linear and all-reduce terms by token count."""

    gpu_name: str
    gpu: dict = dataclasses.field(repr=False)
    shape: LayerShape
    num_layers: int
    tensor_parallel_size: int
    kv_dtype_bytes: int
    cpu_overhead_s: float
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def ring(self) -> dict | None:
        tp = self.tensor_parallel_size
        return allreduce_ring(self.gpu, tp) if tp > 1 else None

    def _by_tokens(self, num_tokens: int) -> tuple[float, float]:
        if num_tokens not in self._memo:
            layers, tp = self.num_layers, self.tensor_parallel_size
            linear = layers * float(layer_seconds(self.gpu, self.shape, tp, num_tokens)) if num_tokens else 0.0
            message = num_tokens * self.shape.hidden * self.shape.dtype_bytes
            allreduce = 2 * layers * float(allreduce_seconds(self.ring, tp, message)) if tp > 1 and num_tokens else 0.0
            self._memo[num_tokens] = (linear, allreduce)
        return self._memo[num_tokens]

    def attention_time(self, num_tokens: int, num_context_tokens: int, attention_pairs: int | None = None) -> float:
        """Every layer's K/V write and attention: the larger of reading the context's K/V (and
        writing the new tokens') at the paged kernel's bandwidth and its FLOPs (4 per head dimension
        per query-key pair, `attention_pairs`; default one per context token, as in decode) at
        FlashAttention's efficiency, after the kernels' launch floors."""
        if not num_tokens:
            return 0.0
        s, tp, gpu = self.shape, self.tensor_parallel_size, self.gpu
        pairs = num_context_tokens if attention_pairs is None else attention_pairs
        kv_bytes = (num_context_tokens + num_tokens) * 2 * s.num_kv_heads / tp * s.head_dim * self.kv_dtype_bytes
        read = kv_bytes / (gpu["peak_bandwidth"] * gpu["gemv_bandwidth_efficiency"] * PAGED_KV_BANDWIDTH_SHARE)
        flops = 4 * s.num_heads / tp * s.head_dim * pairs
        compute = flops / (gpu["peak_flops"] * PREFILL_ATTENTION_FLOPS_EFFICIENCY[self.gpu_name])
        launches = ATTENTION_KERNELS_PER_LAYER * gpu["gemm"]["launch_s"]
        return self.num_layers * (launches + max(read, compute))

    def parts(self, num_tokens: int, num_context_tokens: int, attention_pairs: int | None = None) -> MeasuredParts:
        if num_tokens < 0 or num_context_tokens < 0:
            raise ValueError(f"num_tokens and num_context_tokens must be >= 0, got {num_tokens}, {num_context_tokens}")
        linear, allreduce = self._by_tokens(int(num_tokens))
        return MeasuredParts(linear, self.attention_time(num_tokens, num_context_tokens, attention_pairs),
                             allreduce, self.cpu_overhead_s)

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        return self.parts(num_tokens, num_context_tokens).total


def layer_shape(model) -> LayerShape:
    """The layer of a `ModelSpec`: hidden = attention heads x head_dim; the MLP's width from
    `intermediate_size`, or (None) from the parameters attention and the norms leave over, all of
    them charged to the MLP (the embeddings too: a slight overestimate)."""
    if not isinstance(model.gated_mlp, bool):
        raise TypeError(f"ModelSpec {model.name!r}: gated_mlp must be True or False, got {model.gated_mlp!r}")
    heads = model.num_attention_heads or model.num_kv_heads
    h, d = heads * model.head_dim, model.head_dim
    width = model.intermediate_size
    if width is None:
        attention = h * (heads + 2 * model.num_kv_heads) * d + heads * d * h
        width = round((model.num_params / model.num_layers - attention - 2 * h) / ((3 if model.gated_mlp else 2) * h))
        if width < 1:
            raise ValueError(f"{model.name}: {model.num_params} parameters over {model.num_layers} layers leave no "
                             f"MLP beside attention; give intermediate_size")
    return LayerShape(h, heads, model.num_kv_heads, d, width, model.gated_mlp, model.dtype_bytes)


def measured_step_cost(lab, model, gpu, tensor_parallel_size: int = 1,
                       cpu_overhead_s: float | None = None) -> MeasuredStepCost:
    """The step cost of `model` (a `lab.ModelSpec` or preset name; any shape) on a group of
    `tensor_parallel_size` GPUs `gpu` (a `lab.GPUSpec` or name) from Vidur's published profiles:
    `.parts(num_tokens, num_context_tokens)` gives `linear`, `attention`, `allreduce` and
    `overhead` in seconds and their `.total` (see MeasuredParts). `cpu_overhead_s` per step
    (default CPU_OVERHEAD_S). Raises NoProfile (a ValueError) for a GPU without a profile (only
    a100-80gb and h100-80gb have one: `roofline_step_cost` is the floor for any GPU) or a tp past 8."""
    model, gpu = lab.get_model(model), lab.get_gpu(gpu)
    tp = lab.check_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
    overhead = CPU_OVERHEAD_S if cpu_overhead_s is None else cpu_overhead_s
    if not (lab.is_number(overhead) and 0 <= overhead < math.inf):
        raise ValueError(f"cpu_overhead_s must be a finite number of seconds >= 0, got {cpu_overhead_s!r}")
    gpus = load_profile()["gpus"]
    if gpu.name not in gpus:
        raise NoProfile(f"no published profile for {gpu.name!r} (Vidur profiles {', '.join(gpus)}): "
                        f"use roofline_step_cost, the floor")
    cost = MeasuredStepCost(gpu.name, gpus[gpu.name], layer_shape(model), model.num_layers, tp,
                            model.dtype_bytes if model.kv_dtype_bytes is None else model.kv_dtype_bytes,
                            float(overhead))
    _ = cost.ring  # a tp without an all-reduce profile fails here, not in the first step
    return cost


def step_cost(lab, model, gpu, tensor_parallel_size: int = 1,
              cpu_overhead_s: float | None = None) -> MeasuredStepCost | RooflineStepCost:
    """The measured step cost where the GPU has a profile, else the roofline (the floor)."""
    try:
        return measured_step_cost(lab, model, gpu, tensor_parallel_size, cpu_overhead_s)
    except NoProfile:
        return roofline_step_cost(lab, model, gpu, tensor_parallel_size)


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
