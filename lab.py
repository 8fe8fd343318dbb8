# The lab: generated from solution.py. Students: write each exercise here, in place of its
# `raise NotImplementedError`. Maintainers: edit solution.py, then generate this file again.
"""Inference-serving internals: the three mechanisms behind vLLM, TensorRT-LLM and SGLang,
on a NumPy GPT-2.

Reading map (this file's own line numbers): the chapter, read top to bottom, each idea after
the ideas it needs; the exercises' own code is an afternoon, the whole file a day.

   section                                     lines        what it holds
   0. Conventions                              42-155       checked arguments: what the exercises start from
   1. Paged KV-cache (PagedAttention)          156-396      blocks, allocator, block tables, prefix cache (Ex. 1-3)
   2. The model and the paged attention path   397-1039     a GPT-2 that reads its past through block tables (Ex. 4)
   3. Continuous batching                      1040-1796    requests, the scheduler, the engine (Ex. 5)
   4. Speculative decoding                     1797-2078    accept/resample, draft -> verify (Ex. 6-7)
   5. Capacity planning                        2079-2383    KV blocks, concurrency, QPS on a real GPU (Ex. 8)
   6. The exercises                            2384-2408    the list of exercises, and `__main__`

What runs the chapter for a user stands beside this file, a package per job: `serving/` (the
server), `checkpoints/`, `loadtest/` (with the simulator) and `course/` (the command line, the
design reviews): `python solution.py ARGS` hands this module to `course.main`. The benchmarks
live in tools/. `lab.py` is generated from this file: every region between
`# BEGIN SOLUTION: Exercise N` and `# END SOLUTION` becomes a stub for the student to write.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import itertools
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# =====================================================================================
# 0. Conventions: every argument is checked before anything changes
# =====================================================================================
#
# Every bad input is a ValueError (or TypeError) that names the argument and says what was
# wrong, raised before anything changes. Python and NumPy ints are ints; bools, floats and
# strings are not. The checks of each exercise's arguments are provided code that stands
# just above the exercise, so that the exercises start from checked arguments.


class ArgumentError(ValueError):
    """A bad argument. The message says what was wrong and what was expected; `.argument` names
    the argument (or the request's field) as data, so that a caller such as an HTTP server can
    point at it without reading the message."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


class NotAnIntError(ArgumentError, TypeError):
    """A bool, float or string where an int is meant. Both a TypeError and a ValueError, so
    that `except ValueError` (the lab's "bad input") catches it too."""


def is_int(value: object) -> bool:
    """A Python or NumPy integer, and not a bool (True is not 1 here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> bool:
    """A Python or NumPy real number, and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    """`value` as a Python int. Python and NumPy integers are accepted; a bool, a float (even
    2.0) or a string is a NotAnIntError naming `name`; below `minimum` an ArgumentError."""
    if type(value) is not int and not is_int(value):  # the first test settles most calls (docs/performance.md)
        raise NotAnIntError(name, f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ArgumentError(name, f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_token_ids(name: str, token_ids: object) -> list[int]:
    """A sequence of token ids as a new list of Python ints >= 0 (`check_int`); a string is refused."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (Sequence, np.ndarray)):
        raise NotAnIntError(name, f"{name} must be a list of token ids (ints), got {type(token_ids).__name__}")
    ids = list(token_ids)
    if all(type(t) is int and t >= 0 for t in ids):  # the common case, in one pass (docs/performance.md)
        return ids
    return [check_int(f"{name}[{i}]", t, minimum=0) for i, t in enumerate(ids)]


def check_request(request: Request, config: ModelConfig) -> list[int]:
    """Every field of a request, checked before it is queued: an ArgumentError (a ValueError) whose
    `.argument` is the field at fault, its message naming the request; so nothing fails later in a
    step. Returns the prompt as a new list of ints: the engine's one copy, passed on from there."""
    rid, s = request.request_id, request.sampling

    def require(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise ArgumentError(field, f"request {rid!r}: {field} {why}")

    def token_ids(field: str, ids: object) -> list[int]:
        try:
            ids = check_token_ids(field, ids)
        except NotAnIntError as exc:
            raise NotAnIntError(field, f"request {rid!r}: {exc}") from None
        except ArgumentError:  # a negative id: outside the vocabulary, which the next line says
            ids = [-1]
        require(all(0 <= t < config.vocab_size for t in ids), field,
                f"has a token id outside the vocabulary 0..{config.vocab_size - 1}")
        return ids

    def real(field: str, ok: Callable[[float], bool], limits: str) -> None:
        value = getattr(s, field)
        require(is_number(value) and math.isfinite(value) and ok(value), field,
                f"must be a finite number {limits}, got {value!r}")

    def integer(field: str, low: int, optional: bool = False) -> None:
        value = getattr(s, field)
        require((optional and value is None) or (is_int(value) and value >= low), field,
                f"must be {'None or ' if optional else ''}an int >= {low}, got {value!r}")

    require(isinstance(rid, str), "request_id", f"must be a str, got {type(rid).__name__}")
    require(isinstance(s, SamplingParams), "sampling", f"must be a SamplingParams, got {type(s).__name__}")
    prompt = request.prompt_token_ids
    # Its length first: a prompt far too long is refused without looking at each of its ids.
    if isinstance(prompt, (Sequence, np.ndarray)) and not isinstance(prompt, (str, bytes)):
        require(len(prompt) > 0, "prompt_token_ids", "is empty; expected at least one token id")
        require(len(prompt) < config.n_positions, "prompt_token_ids",
                f"has {len(prompt)} tokens; the model's n_positions = {config.n_positions} leaves no room for an "
                "output token")
    prompt = token_ids("prompt_token_ids", prompt)
    integer("max_tokens", 1)
    require(len(prompt) + s.max_tokens <= config.n_positions, "max_tokens",
            f"({s.max_tokens}) + the prompt ({len(prompt)} tokens) exceeds the model's n_positions = "
            f"{config.n_positions}")
    real("temperature", lambda t: t >= 0, ">= 0")
    integer("seed", 0, optional=True)
    require(isinstance(s.stop_token_ids, (tuple, list)), "stop_token_ids",
            f"must be a tuple or list of token ids, got {type(s.stop_token_ids).__name__}")
    token_ids("stop_token_ids", s.stop_token_ids)
    integer("top_k", 0)
    real("top_p", lambda p: 0 < p <= 1, "in (0, 1]")
    require(s.extra_args is None or isinstance(s.extra_args, dict), "extra_args",
            f"must be None or a dict, got {type(s.extra_args).__name__}")
    require(request.cache_salt is None or isinstance(request.cache_salt, str), "cache_salt",
            f"must be None or a str, got {type(request.cache_salt).__name__}")
    return prompt


# =====================================================================================
# 1. Paged KV-cache: blocks, the allocator, block tables, prefix caching
# =====================================================================================
#
# A sequence's KV-cache is not one contiguous slab of max_model_len slots. It is a list of
# fixed-size blocks taken from a shared pool on demand, so at most one block per sequence is
# partly empty (the paper's "near-zero fragmentation"). Blocks carry reference counts, so
# sequences can share them: a fork (parallel sampling) or the prefix cache.


class OutOfBlocksError(RuntimeError):
    """No free or evictable block is left in the pool."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens` tokens: 0 for 0, 1 for 1..block_size,
    2 for block_size + 1, ..., exact for every count however large. The paged cache's one boundary
    rule: every other place asks it. (Checked before your code: two ints, num_tokens >= 0,
    block_size >= 1.)"""
    num_tokens = check_int("num_tokens", num_tokens, 0)
    block_size = check_int("block_size", block_size, 1)
    raise NotImplementedError("Exercise 1: blocks_needed")


def hash_block(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """Content hash of one FULL block, chained on the hash of the block before it: equal hashes
    mean equal whole prefixes. `cache_salt` goes into every block's hash. The same int in every
    process, and collision-resistant: a collision serves one request another's K/V."""
    raise NotImplementedError("Exercise 3: hash_block")


def chained_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The chained hashes of every FULL block of `token_ids`, in order."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size], cache_salt))
    return hashes


@dataclasses.dataclass
class PrefixCacheStats:
    """Counts of the prefix cache: `hits / queries` is the hit rate."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    """The physical pool of KV blocks `0..num_blocks-1`, with reference counts.

    Invariants: a block with no reference is in one of the queues `_free` (plain) or `_evictable` (cached,
    still found), never both; blocks are handed out least recently freed first, a cached one only
    when no plain one is left, evicted then and not earlier; only a block in use can be registered;
    every error leaves the allocator exactly as it was."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = check_int("num_blocks", num_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref_counts = [0] * self.num_blocks
        # Ordered dicts are queues with O(1) removal from the middle (prefix-cache revival).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(self.num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._block_hash: dict[int, int] = {}  # block id -> its hash, while it is cached
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate()` can hand out now: never used, freed, or cached but unreferenced."""
        raise NotImplementedError("Exercise 1: BlockAllocator.num_free_blocks")

    def _checked_id(self, block_id: object, in_use: str | None = None) -> int:
        """A block id as an int (TypeError for a non-int, ValueError out of range). With
        `in_use`, a block whose reference count is 0 is a ValueError saying `in_use`."""
        block_id = check_int("block_id", block_id)
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")
        if in_use and self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: {in_use}")
        return block_id

    def allocate(self) -> int:
        """A block with reference count 1, as the class docstring orders them (a cached one is
        evicted, `_evict`). OutOfBlocksError, changing nothing, when none is left."""
        raise NotImplementedError("Exercise 1: BlockAllocator.allocate")

    def incref(self, block_id: int) -> None:
        """One more table holds this block. (Checked before your code: an id that is not an int in
        range, or a free block, raises and changes nothing.)"""
        block_id = self._checked_id(block_id, in_use="only a block in use can be shared")
        raise NotImplementedError("Exercise 1: BlockAllocator.incref")

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block can be handed out again, as the most recently freed
        (and, if `is_cached(block_id)`, still findable: evictable). (Checked before your code: an id
        that is not an int in range, or a block with no reference left, raises and changes nothing.)"""
        block_id = self._checked_id(block_id, in_use="it has no reference left (double free)")
        raise NotImplementedError("Exercise 1: BlockAllocator.free")

    def ref_count(self, block_id: int) -> int:
        """How many tables (or prefix-cache lookups) hold this block."""
        return self._ref_counts[self._checked_id(block_id)]

    # --- prefix caching (Exercise 3) ---------------------------------------------------

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache can hand this block to another sequence."""
        return block_id in self._block_hash

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block cached under this hash, without taking a reference (a peek, for planning)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def cached_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """The cached blocks a sequence of `num_tokens` tokens, whose full blocks have these
        chained hashes, can reuse (a peek: no reference is taken).

        That is the longest cached run of `block_hashes`, except when the run covers every
        token: then its last block is left out, to be recomputed into a private block. The
        last token must be computed anyway (its logits give the first output token), and
        its K/V must not be written into a block that other sequences read.
        """
        run = list(itertools.takewhile(lambda b: b is not None, map(self.get_cached_block, block_hashes)))
        return run[:-1] if run and len(run) * self.block_size >= num_tokens else run

    def lookup(self, block_hash: int) -> int | None:
        """A prefix-cache hit: take a reference on the block cached under `block_hash` and return it
        (a cached block with no reference is no longer free afterwards). None on a miss, or when
        caching is off. With caching on, each call counts one `stats.queries`, each hit one
        `stats.hits`; off, nothing counts."""
        raise NotImplementedError("Exercise 3: BlockAllocator.lookup")

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full block, in use and with its K/V written, findable under `block_hash` (a no-op
        when caching is off). When a block already holds that hash, it stays the cached copy; a block
        registered once keeps its first hash. (Checked before your code: a free block is a ValueError.)"""
        block_id = self._checked_id(block_id, in_use="only a block in use, with its K/V written, can be registered")
        raise NotImplementedError("Exercise 3: BlockAllocator.register")

    def _evict(self, block_id: int) -> None:
        """Forget a cached block's hash and count the eviction (it will hold other tokens)."""
        raise NotImplementedError("Exercise 3: BlockAllocator._evict")


class BlockTable:
    """One sequence's view of the cache: token `i` lives in `block_ids[i // block_size]` at offset
    `i % block_size`.

    Invariants: a block another table or the prefix cache can see is never written (new tokens
    bound for one land in a private copy, reported as `(src, dst)` so that the caller copies the
    K/V); a block becomes findable only once its K/V is computed (`cache_full_blocks`)."""

    def __init__(self, allocator: BlockAllocator, cache_salt: str | None = None):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.cache_salt = cache_salt
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []
        self._block_hashes: list[int] = []  # chained hashes of the registered full blocks, in order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def _is_shared(self, block_id: int) -> bool:
        return self.allocator.ref_count(block_id) > 1 or self.allocator.is_cached(block_id)

    def append_tokens(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens; a block is allocated only when the last one is full. Returns the
        copy-on-write pairs `(src, dst)` the caller must copy before writing (at most one). Registers
        nothing. On OutOfBlocksError nothing changes. (`token_ids` arrives checked: a list of ints.)"""
        token_ids = check_token_ids("token_ids", token_ids)
        raise NotImplementedError("Exercise 2: BlockTable.append_tokens")

    def allocate_prompt(self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None) -> int:
        """Fill an empty table with a prompt (or its first chunk), reusing the blocks of
        `allocator.cached_prefix(hashes, len(token_ids))`; the rest get fresh blocks, and nothing new is
        registered. Returns how many leading tokens already have K/V (the reused blocks' tokens).
        (`hashes`, of its full blocks, is provided: the caller's `block_hashes`, else computed here.)

        Reused blocks are taken with `allocator.lookup`; when a full block follows the reused run, one
        more `lookup` asks for it (a miss), unless the run stopped short because it covered the whole
        prompt. OutOfBlocksError, changing nothing, exactly when the fresh blocks and the reused
        blocks that had no reference (they leave the free pool too) outnumber `num_free_blocks`.
        (Checked before your code: an empty table, a list of ints.)"""
        if self.block_ids:
            raise ValueError("allocate_prompt needs an empty table; use append_tokens to extend one")
        token_ids = check_token_ids("token_ids", token_ids)
        hashes = (chained_block_hashes(token_ids, self.block_size, self.cache_salt) if block_hashes is None
                  else block_hashes[: len(token_ids) // self.block_size])
        raise NotImplementedError("Exercise 3: BlockTable.allocate_prompt")

    def cache_full_blocks(self, num_computed_tokens: int, block_hashes: Sequence[int] | None = None) -> None:
        """Make every full block among the first `num_computed_tokens` tokens that is not registered
        yet findable, in order, under its chained hash `hashes[i]` (provided, as in `allocate_prompt`);
        their K/V is written now. A no-op without prefix caching. (Checked before your code: an int in
        0..num_tokens.)"""
        check_int("num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > self.num_tokens:
            raise ValueError(f"num_computed_tokens = {num_computed_tokens} but the table holds {self.num_tokens}")
        if not self.allocator.enable_prefix_caching:
            return
        hashes = (chained_block_hashes(self.token_ids[:num_computed_tokens], self.block_size, self.cache_salt)
                  if block_hashes is None else block_hashes)
        raise NotImplementedError("Exercise 3: BlockTable.cache_full_blocks")

    def fork(self) -> BlockTable:
        """A second sequence sharing every block, registration and salt of this one (parallel sampling)."""
        raise NotImplementedError("Exercise 2: BlockTable.fork")

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (rolling back rejected speculative tokens) and release the
        blocks no longer needed, the last first: eviction follows the order of freeing, so a cached
        prefix loses its deepest block first. A block that keeps some tokens stays (written next only
        after a copy, if it is shared or cached), and a block no longer full is no longer registered
        here. (Checked before your code: an int in 0..num_tokens.)"""
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: the table holds {self.num_tokens}")
        raise NotImplementedError("Exercise 2: BlockTable.truncate")

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slot ids `block * block_size + offset` of positions `start..stop-1`, an int64
        array. (Checked before your code: ints with 0 <= start <= stop <= num_tokens.)"""
        start = check_int("start", start)
        stop = check_int("stop", stop)
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"positions {start}..{stop} are outside the table's 0..{self.num_tokens}")
        raise NotImplementedError("Exercise 2: BlockTable.slots")

    def free(self) -> None:
        """Release every block, the last first (as `truncate`); the table is empty afterwards."""
        raise NotImplementedError("Exercise 2: BlockTable.free")


# =====================================================================================
# 2. The model and the paged attention path
# =====================================================================================
#
# A GPT-2 in NumPy, under the checkpoint's own tensor names, so real GPT-2 weights load with a
# dictionary. `forward_dense` is the reference (no cache). `forward` is the serving path: each
# new token's K/V is written into its slot, then attention reads the past through block tables.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """GPT-2 hyper-parameters (the defaults make a toy model that runs in milliseconds)."""

    vocab_size: int = 256
    n_positions: int = 256
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} must be a multiple of n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def gpt2_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a GPT-2 checkpoint with its shape; linear weights are (in, out) (Conv1D)."""
    C, V = config.n_embd, config.vocab_size
    shapes = {"wte.weight": (V, C), "wpe.weight": (config.n_positions, C)}
    for i in range(config.n_layer):
        shapes |= {
            f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
            f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
            f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
            f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
            f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
            f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
        }
    return shapes | {"ln_f.weight": (C,), "ln_f.bias": (C,)}


def init_gpt2_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under GPT-2 checkpoint names, in the checkpoint's (in, out) layout.

    Shaped like GPT-2's init (normal weights, zero biases, unit LayerNorm gains, residual
    projections scaled by 1/sqrt(2 * n_layer)) but 20x wider: at GPT-2's std 0.02 an untrained
    toy has nearly flat logits, and greedy outputs would hinge on float rounding. These give
    decisive logits (top-2 gaps ~0.7) and varied outputs.
    """
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in gpt2_weight_shapes(config).items():
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            w = np.ones(shape)
        elif name.endswith("bias"):
            w = np.zeros(shape)
        elif name in ("wte.weight", "wpe.weight"):
            w = rng.normal(0.0, 0.3, shape)
        else:
            std = 0.4 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.4
            w = rng.normal(0.0, std, shape)
        weights[name] = w.astype(np.float32)
    return weights


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias, (T, C) -> (T, C)."""
    # Mean and variance as sums, not x.mean and x.var: docs/performance.md, section 6, says why.
    centred = x - x.sum(axis=-1, keepdims=True) / x.shape[-1]
    var = np.square(centred).sum(axis=-1, keepdims=True) / x.shape[-1]
    return centred / np.sqrt(var + eps) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    """GPT-2's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    # x * x * x, not x**3: docs/performance.md, section 6, says why.
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _softmax(scores: np.ndarray) -> np.ndarray:
    # Subtract the row max: exp never overflows, and masked (-inf) entries become exact zeros.
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# --- the KV-cache, in float32 or int8 -----------------------------------------------------
#
# Decode reads every cached K/V byte once per step: the element size sets how many tokens fit and
# how long a step takes. int8 stores each token's K (and V) per head as 127 levels of a float32
# scale, ~3.8x smaller than float32 (vLLM's fp8 cache is the same lever).


KV_CACHE_DTYPES = ("float32", "int8")


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per vector: x (..., D) float32 -> (values int8 (..., D), scale float32 (...)),
    scale = max|x| / 127, so values * scale is x within max|x| / 254 per element (an all-zero
    vector: scale 0, exact zeros). Non-finite input is refused: one inf would make its scale inf."""
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim < 1:
        raise ValueError(f"quantize_int8 takes a float32 array (..., D), got {x.dtype} {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("quantize_int8: x holds NaN or inf; a scale cannot represent it")
    scale = np.abs(x).max(axis=-1) * np.float32(1.0 / 127.0)
    # Divide by 1 where the scale is 0: those vectors are all zeros and stay zeros.
    safe = np.where(scale > 0, scale, np.float32(1.0))
    values = np.rint(x / safe[..., None]).astype(np.int8)  # |x / scale| <= 127: no overflow
    return values, scale


def dequantize_int8(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float32 vectors `values * scale[..., None]` (the inverse of `quantize_int8`)."""
    # One pass: int8 * float32 is computed and stored as float32, no float32 copy of `values`.
    return np.multiply(values, scale[..., None], dtype=np.float32)


class KVCache:
    """The physical KV-cache: `.k`, `.v` of shape (n_layer, num_blocks, block_size, n_head, head_dim);
    slot `s` of a layer (block `s // block_size`, offset `s % block_size`, as `BlockTable.slots`
    numbers them) is `k[layer].reshape(-1, n_head, head_dim)[s]`.

    `dtype="int8"` stores `.k`, `.v` as int8 with float32 `.k_scale`, `.v_scale` (n_layer,
    num_blocks, block_size, n_head) (`quantize_int8`); `write`, `read` and `attention_args`
    quantise on the way in and dequantise on the way out, so the model sees float32 either way."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if not (isinstance(dtype, str) and dtype in KV_CACHE_DTYPES):
            raise ValueError(f"dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {dtype!r}")
        shape = (config.n_layer, num_blocks, block_size, config.n_head, config.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        element = np.int8 if dtype == "int8" else np.float32
        self.k = np.zeros(shape, dtype=element)
        self.v = np.zeros(shape, dtype=element)
        self.k_scale = self.v_scale = None
        if dtype == "int8":
            self.k_scale = np.zeros(shape[:-1], dtype=np.float32)
            self.v_scale = np.zeros(shape[:-1], dtype=np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes the cache really holds: K and V, and their scales for int8."""
        return sum(a.nbytes for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    def _flat(self, layer: int) -> tuple:
        """Slot-addressed views (num_slots, H, D) of one layer's K, V (and (num_slots, H) scales)."""
        H, D = self.k.shape[3:]
        views = [self.k[layer].reshape(-1, H, D), self.v[layer].reshape(-1, H, D)]
        if self.dtype == "int8":
            views += [self.k_scale[layer].reshape(-1, H), self.v_scale[layer].reshape(-1, H)]
        return tuple(views)

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store float32 K/V (T, H, D) of T tokens into `slots` of `layer` (quantised for int8)."""
        if k.dtype != np.float32 or v.dtype != np.float32:
            raise ValueError(f"the KV-cache takes float32 K/V, got {k.dtype} and {v.dtype}")
        views = self._flat(layer)
        if self.dtype == "float32":
            views[0][slots] = k
            views[1][slots] = v
            return
        k_values, k_scales = quantize_int8(k)
        v_values, v_scales = quantize_int8(v)
        views[0][slots] = k_values
        views[1][slots] = v_values
        views[2][slots] = k_scales
        views[3][slots] = v_scales

    def read(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Float32 K/V (T, H, D) of `slots` in `layer`: a gathered copy, dequantised for int8."""
        views = self._flat(layer)
        if self.dtype == "float32":
            return views[0][slots], views[1][slots]
        return dequantize_int8(views[0][slots], views[2][slots]), dequantize_int8(views[1][slots], views[3][slots])

    def attention_args(self, layer: int) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
        """`(k_cache, v_cache), scales` of one layer, as `paged_attention(q, *caches, tables, lens, **scales)`
        takes them: scales is {} for float32, {"k_scale", "v_scale"} for int8."""
        caches = (self.k[layer], self.v[layer])
        if self.dtype == "float32":
            return caches, {}
        return caches, {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Carry out copy-on-write: block `dst` gets `src`'s K/V (and scales) in every layer."""
        if not pairs:
            return
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        for array in (self.k, self.v, self.k_scale, self.v_scale):
            if array is not None:
                array[:, dst] = array[:, src]


# --- paged attention: the kernel that reads K/V through block tables ----------------------


# Bytes of K (and as many of V) one step of the kernel gathers, as whole block columns (docs/performance.md).
PAGED_ATTENTION_CHUNK_BYTES = 2**20


def _check_paged_attention_args(q, k_cache, v_cache, block_tables, context_lens, k_scale=None, v_scale=None):
    """Validate the kernel's inputs; return (block_tables, context_lens) as int64 arrays. A table
    entry in use must name a block (a -1 would read the LAST block: NumPy's negative indexing);
    unsigned ints are converted once checked (`-x` of an unsigned x wraps around)."""
    if not (isinstance(q, np.ndarray) and q.ndim == 3 and q.dtype == np.float32):
        raise ValueError(f"q must be a float32 array (batch, n_head, head_dim), got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {np.shape(q)}")
    batch, n_head, head_dim = q.shape
    quantized = k_scale is not None or v_scale is not None
    element = np.int8 if quantized else np.float32
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (isinstance(cache, np.ndarray) and cache.ndim == 4 and cache.dtype == element
                and cache.shape[0] >= 1 and cache.shape[1] >= 1
                and cache.shape[2:] == (n_head, head_dim)):
            raise ValueError(f"{name} must be {np.dtype(element).name} (num_blocks, block_size, {n_head}, "
                             f"{head_dim}) to match q{' and the scales' if quantized else ''}, got "
                             f"{getattr(cache, 'dtype', '?')} {np.shape(cache)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must have one shape")
    if quantized:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (isinstance(scale, np.ndarray) and scale.dtype == np.float32
                    and scale.shape == k_cache.shape[:3]):
                raise ValueError(f"{name} must be float32 {k_cache.shape[:3]} (one scale per slot and "
                                 f"head of the int8 cache), got {getattr(scale, 'dtype', '?')} {np.shape(scale)}")
    block_tables = np.asarray(block_tables)
    context_lens = np.asarray(context_lens)
    # dtype.kind "i"/"u" is np.issubdtype(dtype, np.integer) (bool is "b"; docs/performance.md).
    if not (block_tables.ndim == 2 and block_tables.shape[0] == batch and block_tables.dtype.kind in "iu"):
        raise ValueError(f"block_tables must be an integer array ({batch}, max_blocks), got "
                         f"{block_tables.dtype} {block_tables.shape}")
    if not (context_lens.shape == (batch,) and context_lens.dtype.kind in "iu"):
        raise ValueError(f"context_lens must be an integer array ({batch},), got "
                         f"{context_lens.dtype} {context_lens.shape}")
    num_blocks, block_size = k_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    # Compared in their own dtype (exact for unsigned too), then converted: 1..capacity fits int64.
    if batch and (context_lens.min() < 1 or context_lens.max() > capacity):
        raise ValueError(f"context_lens must be in 1..{capacity} (max_blocks {block_tables.shape[1]} "
                         f"x block_size {block_size}), got {context_lens.tolist()}")
    context_lens = context_lens.astype(np.int64, copy=False)
    used = np.arange(block_tables.shape[1]) < -(-context_lens[:, None] // block_size)
    in_use = block_tables[used]
    if in_use.size and (in_use.min() < 0 or in_use.max() >= num_blocks):
        raise ValueError(f"a block table entry in use is not a block id in 0..{num_blocks - 1}")
    # Entries in use are now known to be < num_blocks; padding may wrap, and is never read.
    return block_tables.astype(np.int64, copy=False), context_lens


# --- reading blocks for paged_attention: a column at a time, dequantised on the way ---------


# Gather buffers kept between kernel calls, one set per thread: a fresh one costs page faults (docs/performance.md).
_GATHER_BUFFERS = threading.local()


def _reused_buffer(key: tuple, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A C-contiguous `shape` array of `dtype` carved from this thread's buffer `key`, which is
    grown when too small and otherwise reused. Its content is garbage; the next caller with the
    same key overwrites it."""
    size = math.prod(shape)
    buffer = getattr(_GATHER_BUFFERS, "arrays", None)
    if buffer is None:
        buffer = _GATHER_BUFFERS.arrays = {}
    array = buffer.get(key)
    if array is None or array.size < size:
        array = buffer[key] = np.empty(size, dtype)
    return array[:size].reshape(shape)


class BlockGather:
    """Gathers columns of blocks of one layer's K and V caches into reused float32 buffers.

    `BlockGather(k_cache, v_cache, k_scale, v_scale, batch, max_blocks)` holds buffers for
    `max_blocks` blocks of each of `batch` sequences (scales None for a float32 cache).
    `gather(ids)`, `ids` (n, c) valid block ids (n <= batch, c <= max_blocks), returns
    `(k, v, k_scales, v_scales)`: k, v (n, c * block_size, H, D) float32, token t of row i being
    slot t % block_size of block ids[i, t // block_size] (views of the buffers, overwritten by the
    next gather); the scales None for float32, else (n, c * block_size, H) float32 beside the
    int8 values cast to float32. So a kernel reads K as `k` for float32 and `k * k_scales[...,
    None]` for int8 (V alike): a scale per token and head factors out of the dot products over
    D (q . (s k) = s (q . k)), one multiply per score instead of per element. The caches are never
    written; the buffers are per thread (one kernel call at a time per thread, as the engine runs).
    """

    def __init__(self, k_cache: np.ndarray, v_cache: np.ndarray, k_scale: np.ndarray | None,
                 v_scale: np.ndarray | None, batch: int, max_blocks: int):
        self.caches = (k_cache, v_cache)
        self.scales = (k_scale, v_scale)
        self.batch = batch
        self.max_blocks = max_blocks
        _, block_size, n_head, head_dim = k_cache.shape
        shape = (batch, max_blocks, block_size, n_head, head_dim)
        self.values = [_reused_buffer((kv, "values"), shape, np.float32) for kv in "kv"]
        self.quantized = k_scale is not None
        if self.quantized:  # int8 into a staging buffer, then one cast into `values`
            self.staging = [_reused_buffer((kv, "staging"), shape, np.int8) for kv in "kv"]
            self.scale_buffers = [_reused_buffer((kv, "scales"), shape[:-1], np.float32) for kv in "kv"]

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        n, c = ids.shape
        if n > self.batch or c > self.max_blocks:
            raise ValueError(f"ids {ids.shape} exceed the buffers for {self.batch} sequences x "
                             f"{self.max_blocks} blocks this BlockGather was made with")
        values = []
        scales = [None, None]
        for i, cache in enumerate(self.caches):
            shape = (n, c, *cache.shape[1:])
            # np.take writes straight into the buffer's front; "clip", not "raise": docs/performance.md.
            out = _front(self.values[i], shape)
            if not self.quantized:
                np.take(cache, ids, axis=0, out=out, mode="clip")
            else:
                raw = np.take(cache, ids, axis=0, out=_front(self.staging[i], shape), mode="clip")
                np.copyto(out, raw)  # int8 -> float32, exact: the dequantisation's cast
                s = np.take(self.scales[i], ids, axis=0, out=_front(self.scale_buffers[i], shape[:-1]), mode="clip")
                scales[i] = s.reshape(n, -1, s.shape[-1])
            values.append(out.reshape(n, -1, *shape[3:]))
        return values[0], values[1], scales[0], scales[1]


def _front(buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The first prod(shape) elements of a C-contiguous buffer, as a contiguous `shape` array."""
    return buffer.reshape(-1)[:math.prod(shape)].reshape(shape)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, context_lens: np.ndarray, *,
                    k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None) -> np.ndarray:
    """Decode attention for a batch, one query per sequence, reading K/V through block tables.

    q (B, H, D) float32; k_cache, v_cache (num_blocks, block_size, H, D) float32, one layer;
    block_tables (B, max_blocks) int; context_lens (B,) int >= 1, counting the current token
    (its K/V is already in the cache). Token i of sequence b lives at
    k_cache[block_tables[b, i // block_size], i % block_size]. Returns (B, H, D) float32:
    softmax(q . k / sqrt(D)) @ v over the sequence's first context_lens[b] tokens.

    Invariants: nothing past a sequence's context is used as data (the table's padding entries
    may be -1 or garbage, the stale slots after its last token may hold NaN); no copy of the whole
    K/V is made: the kernel holds at most PAGED_ATTENTION_CHUNK_BYTES of gathered K/V at a time
    (but at least one block column); vectorised, no Python loop over tokens. `BlockGather` (just
    above) gathers blocks for you.

    An int8 cache comes as int8 k_cache, v_cache with float32 `k_scale`, `v_scale` (num_blocks,
    block_size, H): token i's K is k_cache[...] * k_scale[...]."""
    block_tables, context_lens = _check_paged_attention_args(q, k_cache, v_cache, block_tables,
                                                             context_lens, k_scale, v_scale)
    raise NotImplementedError("Exercise 4: paged_attention")


# --- the model's products, split over a CPU's cores -----------------------------------------
#
# On a CPU a step's time is its products with the weights (docs/performance.md): each weight
# matrix is read from memory once a step and, at 16 rows, multiplied on one core. NumPy lets
# threads multiply at once (BLAS runs without the GIL), so the model splits each big product
# over a few threads the two ways tensor parallelism splits a layer over GPUs: by the weight's
# columns (vLLM's ColumnParallelLinear: each thread owns whole output columns, nothing to add
# up) and, for the one row of a lone decode, by its rows (RowParallelLinear: partial products
# added, the all-reduce). A thread takes the next slice whenever it is free, so one whose core
# another job holds does less of the product instead of holding it back. OpenBLAS's own threads
# stay at one (`serve` pins them): they spin while they wait, and a busy core stalls them all.

# Slices a thread: they are handed out on demand, so a worker that wakes late finds its slice
# taken by a thread that is free; more slices cost more calls, and measured slower (docs/performance.md).
SLICES_PER_THREAD = 1
# A product is split only where each slice holds this much of b (1 MiB of float32): reading it
# takes several times what waking a worker does (tens of microseconds).
MIN_SLICE_ELEMENTS = 2**18


class ThreadedMatmul:
    """`a @ b` for 2-D float32 `a` (M, K) and `b` (K, N), split over `num_threads` threads: the
    caller's and `num_threads - 1` workers. With one thread, or a `b` too small for slices of
    `MIN_SLICE_ELEMENTS`, it is `a @ b` on the caller's thread. Otherwise the result equals
    `a @ b` up to float32 rounding, and is the same from call to call whichever thread took
    which slice: rows (M > 1) are split by b's columns, each column the same dot products as in
    `a @ b`; a single row (a matrix-vector product, which reads b's rows faster than its column
    slices) by b's rows, the slices' partial products added in order."""

    def __init__(self, num_threads: int = 1):
        self.num_threads = check_int("num_threads", num_threads, 1)
        self._workers = (ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="matmul")
                         if self.num_threads > 1 else None)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        (m, k), n = a.shape, b.shape[1]
        if self._workers is None or k * n < self.num_threads * SLICES_PER_THREAD * MIN_SLICE_ELEMENTS:
            return a @ b
        dtype = np.result_type(a, b)
        if m == 1:
            slices = self._slices(k)
            parts = np.empty((len(slices), n), dtype)
            self._run(lambda i, j: np.matmul(a[:, j], b[j], out=parts[i:i + 1]), slices)
            return parts.sum(axis=0, keepdims=True)
        out = np.empty((m, n), dtype)
        self._run(lambda i, j: np.matmul(a, b[:, j], out=out[:, j]), self._slices(n))
        return out

    def _slices(self, length: int) -> list[slice]:
        """`range(length)` cut into SLICES_PER_THREAD slices a thread (or fewer), in whole 64-element blocks."""
        share = -(-length // (self.num_threads * SLICES_PER_THREAD))
        width = -(-share // 64) * 64
        return [slice(j, j + width) for j in range(0, length, width)]

    def _run(self, task: Callable[[int, slice], object], slices: list[slice]) -> None:
        """`task(i, slices[i])` for every slice, each on whichever thread asks first."""
        todo = iter(enumerate(slices))  # shared: its next() hands each slice out once

        def work() -> None:
            for i, j in todo:
                task(i, j)

        pending = [self._workers.submit(work) for _ in range(self.num_threads - 1)]
        work()
        for worker in pending:  # one not yet started has nothing left: it must not hold the product back
            if not worker.cancel():
                worker.result()


# --- the model: a reference path and the serving path -------------------------------------


def _checked_gpt2_weights(config: ModelConfig, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Strip a `transformer.` prefix, drop GPT-2's mask buffers, check every name and shape.
    Returns float32 arrays, row-major except `wte.weight`, which is column-major (same values)."""
    expected = gpt2_weight_shapes(config)
    found: dict[str, np.ndarray] = {}
    lm_head = None
    for name, value in weights.items():
        key = name.removeprefix("transformer.")
        if key == "lm_head.weight":
            lm_head = np.asarray(value)
            continue
        if key.endswith((".attn.bias", ".attn.masked_bias")) and key.startswith("h."):
            continue  # causal-mask buffers, not parameters
        if key not in expected:
            raise ValueError(f"unknown weight {name!r}: not a GPT-2 tensor for this config")
        value = np.asarray(value)
        if value.shape != expected[key]:
            raise ValueError(f"weight {name!r} has shape {value.shape}, expected {expected[key]}")
        # wte column-major: the tied head's wte.T is then (in, out) row-major (docs/performance.md).
        found[key] = np.asarray(value, dtype=np.float32, order="F" if key == "wte.weight" else "C")
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"missing weight(s) {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if lm_head is not None and not np.array_equal(lm_head, found["wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight: GPT-2's LM head is tied to the embeddings")
    return found


def _check_tokens(config: ModelConfig, token_ids: np.ndarray, positions_end: int) -> None:
    """Token ids inside the vocabulary, positions (up to `positions_end`) inside n_positions."""
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= config.vocab_size):
        raise ValueError(f"token ids must be in 0..{config.vocab_size - 1}")
    if positions_end > config.n_positions:
        raise ValueError(f"position {positions_end - 1} is beyond n_positions={config.n_positions}")


def _check_logits_indices(logits_indices, num_rows: int) -> np.ndarray | None:
    """None, or the rows to keep as an int64 array of indices in 0..num_rows-1."""
    if logits_indices is None:
        return None
    rows = np.asarray(logits_indices)
    if not (rows.ndim == 1 and (np.issubdtype(rows.dtype, np.integer) or rows.size == 0)):
        raise ValueError(f"logits_indices must be a 1-D sequence of ints, got {rows.dtype} {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError(f"logits_indices must be rows in 0..{num_rows - 1} of this batch, got {rows.tolist()}")
    return rows.astype(np.int64)


class ToyTransformer:
    """GPT-2: learned positions, pre-LayerNorm blocks, fused qkv, tanh-GELU MLP, tied LM head.
    `num_threads` threads share each big product with the weights (`ThreadedMatmul`)."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray] | None = None, seed: int = 0,
                 num_threads: int = 1):
        self.config = config
        self.matmul = ThreadedMatmul(num_threads)
        self.weights = _checked_gpt2_weights(config, init_gpt2_weights(config, seed) if weights is None else weights)
        w = self.weights
        self.layers = [{name.split(".", 2)[2]: w[name] for name in w if name.startswith(f"h.{i}.")}
                       for i in range(config.n_layer)]

    # --- the building blocks ---------------------------------------------------------

    def _ln(self, x: np.ndarray, layer: dict, name: str) -> np.ndarray:
        return _layer_norm(x, layer[f"{name}.weight"], layer[f"{name}.bias"], self.config.layer_norm_epsilon)

    def _qkv(self, x: np.ndarray, layer: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The block's first half, up to attention: q, k, v = split(LN_1(x) W_attn + b_attn)."""
        T, H, D = x.shape[0], self.config.n_head, self.config.head_dim
        qkv = self.matmul(self._ln(x, layer, "ln_1"), layer["attn.c_attn.weight"])  # (T, 3C)
        qkv += layer["attn.c_attn.bias"]
        return tuple(qkv.reshape(T, 3, H, D).transpose(1, 0, 2, 3))  # q, k, v: (T, H, D) each

    def _finish_layer(self, x: np.ndarray, attn: np.ndarray, layer: dict) -> np.ndarray:
        """The block's second half, given attention's output (T, H, D): two residual adds."""
        x = x + self.matmul(attn.reshape(x.shape), layer["attn.c_proj.weight"]) + layer["attn.c_proj.bias"]  # (T, C)
        h = _gelu(self.matmul(self._ln(x, layer, "ln_2"), layer["mlp.c_fc.weight"]) + layer["mlp.c_fc.bias"])  # (T, 4C)
        return x + self.matmul(h, layer["mlp.c_proj.weight"]) + layer["mlp.c_proj.bias"]  # (T, C)

    def _embed(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x_0 = wte[token] + wpe[position]: (T,) ids -> (T, C)."""
        return self.weights["wte.weight"][token_ids] + self.weights["wpe.weight"][positions]

    def _logits(self, x: np.ndarray) -> np.ndarray:
        """LN_f(x) wte^T, the LM head tied to the embedding: (T, C) -> (T, V)."""
        w = self.weights
        return self.matmul(_layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], self.config.layer_norm_epsilon),
                           w["wte.weight"].T)

    # --- the reference path ----------------------------------------------------------

    def forward_dense(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits (T, vocab_size) for every position, with plain causal attention and no cache."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T = len(token_ids)
        if T == 0:
            raise ValueError("forward_dense needs at least one token")
        _check_tokens(self.config, token_ids, T)
        x = self._embed(token_ids, np.arange(T))
        causal = np.tril(np.ones((T, T), dtype=bool))
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        for layer in self.layers:
            q, k, v = self._qkv(x, layer)  # (T, H, D) each
            scores = np.einsum("qhd,khd->hqk", q, k) * scale  # (H, T, T): q . k / sqrt(D)
            probs = _softmax(np.where(causal, scores, -np.inf))  # query i attends to keys 0..i
            x = self._finish_layer(x, np.einsum("hqk,khd->qhd", probs, v), layer)  # (T, C)
        return self._logits(x)  # (T, V)

    # --- the serving path ------------------------------------------------------------

    def forward(
        self,
        kv_cache: KVCache,
        block_tables: Sequence[BlockTable],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
        logits_indices: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """One engine step over a batch that mixes prefill chunks and decode tokens.

        Sequence i contributes `block_tables[i].token_ids[start_i : start_i + n_i]`, the K/V of its
        positions before `start_i` already in `kv_cache`; each new token's K/V is written into its
        slot before attention reads it. Returns logits (sum(num_tokens), vocab_size) in batch
        order, or with `logits_indices` (vLLM's name) only those rows: the engine samples one row
        per sequence, and the LM head over a prefill chunk's other rows would be wasted work."""
        self._check_cache(kv_cache, block_tables)
        batch = _PagedBatch(self.config, block_tables, start_positions, num_tokens)
        rows = _check_logits_indices(logits_indices, len(batch.token_ids))
        x = self._embed(batch.token_ids, batch.positions)
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)  # (T, H, D) each, T = the step's new tokens
            kv_cache.write(i, batch.slots, k, v)  # into their slots first: attention then reads them
            caches, scales = kv_cache.attention_args(i)
            if not batch.prefills:  # decodes only (most steps): every row is a decode, in order, so no scatter
                attn = paged_attention(q, *caches, batch.decode_tables, batch.decode_lens, **scales)
            else:
                attn = np.empty_like(q)
                if batch.decode_rows.size:
                    attn[batch.decode_rows] = paged_attention(
                        q[batch.decode_rows], *caches, batch.decode_tables, batch.decode_lens, **scales)
                for prefill_rows, context_slots, mask in batch.prefills:
                    k_ctx, v_ctx = kv_cache.read(i, context_slots)
                    # Per head (q, D) @ (D, k), then (q, k) @ (k, D), as matmuls (docs/performance.md).
                    scores = np.matmul(q[prefill_rows].transpose(1, 0, 2), k_ctx.transpose(1, 2, 0)) * scale
                    probs = _softmax(np.where(mask, scores, -np.inf))  # (H, n, context)
                    attn[prefill_rows] = np.matmul(probs, v_ctx.transpose(1, 0, 2)).transpose(1, 0, 2)
            x = self._finish_layer(x, attn, layer)  # (T, C)
        return self._logits(x if rows is None else x[rows])  # (len(rows) or T, V)

    def _check_cache(self, kv_cache: KVCache, block_tables: Sequence[BlockTable]) -> None:
        """A cache of another model or block size would be read at the wrong slots: refuse it."""
        if not isinstance(kv_cache, KVCache):
            raise ValueError(f"kv_cache must be a KVCache, got {type(kv_cache).__name__}")
        c = self.config
        n_layer, num_blocks, block_size, n_head, head_dim = kv_cache.k.shape
        if (n_layer, n_head, head_dim) != (c.n_layer, c.n_head, c.head_dim):
            raise ValueError(f"kv_cache has {n_layer} layers x {n_head} heads x {head_dim}, the model "
                             f"{c.n_layer} layers x {c.n_head} heads x {c.head_dim}: a cache of another model")
        for table in block_tables:
            if getattr(table, "block_size", None) != block_size:
                raise ValueError(f"a block table has block_size {getattr(table, 'block_size', None)}, "
                                 f"the kv_cache {block_size}: its slots would name other tokens")
            if table.block_ids and max(table.block_ids) >= num_blocks:
                raise ValueError(f"a block table uses block {max(table.block_ids)}, the kv_cache has "
                                 f"only {num_blocks} blocks: the allocator and the cache must match")


class _PagedBatch:
    """The flat layout of one step, shared by every layer: decode rows (one new token) go through
    `paged_attention` together; a prefill chunk of n tokens from position s attends over slots
    0..s+n-1 with a causal mask (query j, at position s+j, sees keys 0..s+j)."""

    def __init__(self, config: ModelConfig, block_tables, start_positions, num_tokens):
        if not (len(block_tables) == len(start_positions) == len(num_tokens)) or not block_tables:
            raise ValueError("forward needs one start position and one token count per block table")
        tokens, positions, slots = [], [], []  # of each sequence's new tokens, in batch order
        decode = []  # (row, table, context length) of each decode
        self.prefills = []  # (rows, context slots, causal mask) of each prefill chunk
        row = 0
        for table, start, n in zip(block_tables, start_positions, num_tokens):
            start = check_int("start position", start, 0)
            n = check_int("num_tokens", n, 1)
            stop = start + n
            if stop > table.num_tokens:
                raise ValueError(f"cannot process positions {start}..{stop - 1} of {table.num_tokens} tokens")
            # A prompt from its start is read in place, not copied; later runs of tokens are short.
            tokens.append(table.token_ids[start:stop] if start else itertools.islice(table.token_ids, stop))
            positions.append(np.arange(start, stop))
            if n == 1:  # a decode reads its past through the block table, in paged_attention
                slots.append(table.slots(start, stop))
                decode.append((row, table, stop))
            else:  # a prefill chunk gathers its whole context: its own slots are the tail of it
                context_slots = table.slots(0, stop)
                slots.append(context_slots[start:])
                mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]
                self.prefills.append((slice(row, row + n), context_slots, mask))
            row += n
        self.token_ids = np.fromiter(itertools.chain.from_iterable(tokens), np.int64, count=row)
        _check_tokens(config, self.token_ids, max(p[-1] for p in positions) + 1)
        self.positions = np.concatenate(positions)
        self.slots = np.concatenate(slots)
        self.decode_rows = np.array([r for r, _, _ in decode], dtype=np.int64)
        width = max((len(t.block_ids) for _, t, _ in decode), default=0)
        self.decode_tables = np.zeros((len(decode), width), dtype=np.int64)
        for j, (_, table, _) in enumerate(decode):
            self.decode_tables[j, : len(table.block_ids)] = table.block_ids
        self.decode_lens = np.array([stop for _, _, stop in decode], dtype=np.int64)


# =====================================================================================
# 3. Continuous batching: requests, the scheduler, the engine
# =====================================================================================
#
# A static batch runs until its LAST sequence finishes, so one long answer holds every other
# slot hostage. Iteration-level scheduling decides again at every step: finished sequences
# leave at once and waiting ones take their slots. There is no prefill phase and no decode
# phase (vLLM v1): a step gives each sequence `min(tokens still missing K/V, budget left)` new
# tokens; a decode is "one token missing", chunked prefill "the budget ran out first".


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How each output token is picked and when a request stops, with vLLM's names and meanings.

    Temperature 0 is greedy (the argmax). Above 0 the token is drawn from softmax(logits / T)
    cut to the `top_k` most likely tokens (0: no limit), then to the most likely tokens whose
    mass reaches `top_p` (1.0: no limit), with the request's own `np.random.default_rng(seed)`.
    A request stops after `max_tokens` outputs ("length") or at a token of `stop_token_ids`
    ("stop"; the token is kept, as vLLM keeps it). `extra_args` is for the engine's logits
    processors (vLLM's field of that name); the chapter's sampler never reads it.
    """

    temperature: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    top_p: float = 1.0
    extra_args: dict | None = None


@dataclasses.dataclass
class Request:
    """One generation request. `arrival_time` (seconds) places it on a workload's clock for
    the simulator; the engine stamps its own clock when the request is added. Requests with
    different `cache_salt`s never share prefix-cache blocks (see `hash_block`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    arrival_time: float = 0.0
    cache_salt: str | None = None


@dataclasses.dataclass
class RequestMetrics:
    """Per-request latency with vLLM's benchmark definitions (seconds, or simulator steps):
    ttft = first token - arrival; tpot = (e2e - ttft) / (output tokens - 1), NaN with fewer than
    2 tokens; itl = the gaps between tokens; e2e_latency = finish - arrival."""

    ttft: float
    tpot: float
    itl: list[float]
    e2e_latency: float

    @classmethod
    def from_times(cls, arrival: float, token_times: list[float], finish: float,
                   num_tokens: int | None = None) -> RequestMetrics:
        """`token_times`: when each token (or each streamed chunk) arrived; `num_tokens`: how many
        tokens they carried (default one each), the divisor of TPOT."""
        if not token_times:  # rejected: no token was ever produced
            return cls(math.nan, math.nan, [], finish - arrival)
        num_tokens = len(token_times) if num_tokens is None else num_tokens
        ttft = token_times[0] - arrival
        e2e = finish - arrival
        tpot = (e2e - ttft) / (num_tokens - 1) if num_tokens > 1 else math.nan
        return cls(ttft, tpot, list(np.diff(token_times).tolist()), e2e)


@dataclasses.dataclass
class RequestOutput:
    """What a request produced, whole. `finish_reason` is "stop" (a stop token), "length"
    (max_tokens), "abort" (`LLMEngine.abort_request`), "rejected" (it can never fit; no
    tokens), "error" (the step it ran in raised), or None while running. `finish_detail` says
    why, in words, for "rejected" and "error"."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    metrics: RequestMetrics | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    finish_detail: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class EngineCoreOutput:
    """What is new for one request since its last output (vLLM's name): `new_token_ids` holds the
    tokens sampled since (one per `step()`; none for an abort); `finish_reason` is set in the last."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    finish_detail: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceState:
    """The scheduler's record of one request: its tokens, its block table, its progress.

    Invariant between steps: `block_table` holds exactly the first `num_computed_tokens`
    tokens, whose K/V is in the cache; the tokens after them (the rest of a prompt being
    prefilled, or the last sampled token) are still to be processed."""

    def __init__(self, request: Request, allocator: BlockAllocator):
        self.request = request
        prompt = request.prompt_token_ids  # the engine's boundary (check_request) copied it once
        self.prompt_token_ids = prompt if type(prompt) is list else [int(t) for t in prompt]
        self.output_token_ids: list[int] = []
        self.block_table = BlockTable(allocator, request.cache_salt)
        self._block_hashes: list[int] = []  # of its full blocks, each hashed once (`block_hashes`)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.finish_detail: str | None = None
        self.num_preemptions = 0
        self.num_samples = 1  # it and the samples it forks (LLMEngine.add_request's n)
        self.stop_token_set = frozenset(request.sampling.stop_token_ids)  # each token's check is O(1)
        # Filled in by whoever runs the steps (engine or simulator): its clock, its sampler.
        self.arrival_time = request.arrival_time
        self.token_times: list[float] = []
        self.finish_time = math.nan
        self.rng: np.random.Generator | None = None
        self.num_reported = 0  # output tokens the engine's caller has been given

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """(prompt + outputs)[start:stop], without building that whole list (a step is O(new tokens));
        the whole prompt is the prompt's own list, not a copy (no reader changes it)."""
        n = len(self.prompt_token_ids)
        if (start, stop) == (0, n):
            return self.prompt_token_ids
        return self.prompt_token_ids[start:stop] + self.output_token_ids[max(start - n, 0) : max(stop - n, 0)]

    def block_hashes(self) -> list[int]:
        """The chained hashes of its full blocks (prompt, then outputs), each hashed once and kept, as
        vLLM keeps them on the Request, for admission and caching; none without a prefix cache."""
        table = self.block_table
        hashes = self._block_hashes
        size = table.block_size
        while table.allocator.enable_prefix_caching and (len(hashes) + 1) * size <= self.num_tokens:
            block = self.token_ids_slice(len(hashes) * size, (len(hashes) + 1) * size)
            hashes.append(hash_block(hashes[-1] if hashes else None, block, table.cache_salt))
        return hashes

    def fork(self, request: Request) -> SequenceState:
        """A sample of `request` (same prompt) sharing this one's blocks, hashes and progress."""
        child = SequenceState(request, self.block_table.allocator)
        child.block_table = self.block_table.fork()
        child._block_hashes = list(self._block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def check_stop(self) -> str | None:
        """The finish reason its latest output token gives: "stop" for a token of
        `stop_token_ids` (checked first), "length" at `max_tokens` outputs, else None."""
        if self.output_token_ids[-1] in self.stop_token_set:
            return "stop"
        return "length" if len(self.output_token_ids) >= self.sampling.max_tokens else None

    def to_output(self) -> RequestOutput:
        metrics = (RequestMetrics.from_times(self.arrival_time, self.token_times, self.finish_time)
                   if self.finish_reason else None)
        return RequestOutput(self.request_id, list(self.prompt_token_ids), list(self.output_token_ids), metrics,
                             self.finish_reason, self.num_preemptions, self.finish_detail)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: which sequences run, with how many new tokens each (in batch order),
    which were preempted, and the copy-on-write block copies to do before the forward pass."""

    scheduled: list[SequenceState] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    preempted: list[SequenceState] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def add(self, seq: SequenceState, num_new_tokens: int) -> None:
        self.scheduled.append(seq)
        self.num_scheduled_tokens[seq.request_id] = num_new_tokens

    def completes(self, seq: SequenceState) -> bool:
        """Whether this step processes the sequence's last pending token: then its logits
        give the next output token (a prefill chunk that stops short samples nothing)."""
        return seq.num_computed_tokens + self.num_scheduled_tokens[seq.request_id] == seq.num_tokens


# --- what the engine reports: events, for whoever listens ------------------------------------
#
# An engine built with an observer (`LLMEngine(observer=...)`) tells it what happens, as it happens:
# each step's plan, each preemption and why, and every change to the block pool. The exercises
# know nothing of it: the events are sent by the provided code around them, and read from what
# they return and from public state, so every correct implementation reports the same. Without
# an observer nothing is sent and nothing is paid (vLLM likewise records its engine-core events
# only with `log_stats`, and its KV-cache events only when `kv_events_config` enables them).


class EngineEventType(enum.Enum):
    """What happened. The scheduler's (vLLM's `EngineCoreEventType`) name a request; the pool's
    (vLLM's KV-cache events `BlockStored`, `BlockRemoved`) name a block."""

    SCHEDULED = "scheduled"          # a sequence runs `num_tokens` new tokens in this step
    OUT_OF_BLOCKS = "out_of_blocks"  # a running sequence's next `num_tokens` tokens found no free block
    PREEMPTED = "preempted"          # a running sequence gives its blocks back, to recompute later
    COPIED = "copied"                # copy-on-write: `block_ids` (src, dst), copied before the forward pass
    ALLOCATED = "allocated"          # a block left the pool for a table (`allocate`)
    PREFIX_HIT = "prefix_hit"        # a cached block was found and taken (`lookup`)
    CACHED = "cached"                # a full block became findable under its hash (`register`)
    EVICTED = "evicted"              # a cached block lost its hash, to hold other tokens
    FREED = "freed"                  # a block's last reference went: it is back in the pool


@dataclasses.dataclass(frozen=True)
class EngineEvent:
    """One event: what happened, and to which request or blocks."""

    type: EngineEventType
    request_id: str | None = None
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


EngineObserver = Callable[[EngineEvent], None]


class ObservedBlockAllocator(BlockAllocator):
    """A BlockAllocator that tells `observer` of each change to its pool, one event per block, once
    the call that made it returns. The exercise's methods run as they are: each event is read from
    what they return and from public state (`stats`, `ref_count`, `is_cached`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, *,
                 observer: EngineObserver):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.observer = observer

    def _report(self, kind: EngineEventType, block_id: int) -> None:
        self.observer(EngineEvent(kind, block_ids=(int(block_id),)))

    def allocate(self) -> int:
        evictions = self.stats.evictions
        block_id = super().allocate()
        if self.stats.evictions > evictions:  # the block handed out was a cached one
            self._report(EngineEventType.EVICTED, block_id)
        self._report(EngineEventType.ALLOCATED, block_id)
        return block_id

    def lookup(self, block_hash: int) -> int | None:
        block_id = super().lookup(block_hash)
        if block_id is not None:
            self._report(EngineEventType.PREFIX_HIT, block_id)
        return block_id

    def register(self, block_id: int, block_hash: int) -> None:
        was_cached = self.is_cached(block_id)
        super().register(block_id, block_hash)
        if not was_cached and self.is_cached(block_id):
            self._report(EngineEventType.CACHED, block_id)

    def free(self, block_id: int) -> None:
        super().free(block_id)
        if self.ref_count(block_id) == 0:
            self._report(EngineEventType.FREED, block_id)


class Scheduler:
    """Iteration-level (continuous) batching with vLLM v1's policy.

    Each step, running sequences come first, oldest first, each given its missing tokens (one for a decode, a
    chunk for a prefill) within the `max_num_batched_tokens` budget; then waiting ones, first come first served,
    while `max_num_seqs` (a seat per sample), the budget and free blocks allow. A running sequence that cannot
    get a block preempts the most recently admitted running sequence by recompute: its blocks are freed and it
    waits at the FRONT of the queue with every token it produced; it and the scheduler each count it
    (`num_preemptions`). A step that preempted anyone admits nobody (a newcomer would be the next victim).

    Liveness: the oldest running sequence is never preempted for a newer one, and a request whose
    worst case cannot fit in the whole cache is rejected on arrival."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True):
        self.allocator = allocator
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []  # in admission order: the newest is last
        self.num_preemptions = 0
        self.observer: EngineObserver | None = None  # told of each step's plan and each preemption

    def add_request(self, request: Request, num_samples: int = 1) -> SequenceState:
        """Queue a request (that will fork `num_samples - 1` samples); one that can never run is finished
        at once as "rejected", the reason in `finish_detail`. An empty prompt, or max_tokens < 1, is a
        ValueError (nothing to run)."""
        if len(request.prompt_token_ids) == 0 or check_int("max_tokens", request.sampling.max_tokens) < 1:
            raise ValueError(f"request {request.request_id!r} needs a non-empty prompt and max_tokens >= 1")
        seq = SequenceState(request, self.allocator)
        seq.num_samples = num_samples
        reason = self._rejection(seq)
        if reason:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "rejected"
            seq.finish_detail = reason
        else:
            self.waiting.append(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _rejection(self, seq: SequenceState) -> str | None:
        """Why this request can never finish here (judged on prompt + max_tokens), or None."""
        worst = len(seq.prompt_token_ids) + seq.sampling.max_tokens
        need = blocks_needed(worst, self.allocator.block_size)
        if seq.num_samples > self.max_num_seqs:
            return f"n = {seq.num_samples} samples run at once, and max_num_seqs is {self.max_num_seqs}"
        if need > self.allocator.num_blocks:
            return (f"prompt + max_tokens = {worst} tokens need {need} KV blocks of "
                    f"{self.allocator.block_size}, the whole cache has {self.allocator.num_blocks}")
        if not self.enable_chunked_prefill and worst > self.max_num_batched_tokens:
            # Recomputing after a preemption processes prompt + output in one step.
            return (f"prompt + max_tokens = {worst} tokens exceed max_num_batched_tokens = "
                    f"{self.max_num_batched_tokens} and chunked prefill is off")
        return None

    def _allocate_slots(self, seq: SequenceState, num_new_tokens: int, plan: SchedulerOutput) -> bool:
        """Put the next `num_new_tokens` tokens into the block table; False (unchanged) if it can't."""
        stop = seq.num_computed_tokens + num_new_tokens
        try:
            plan.blocks_to_copy += seq.block_table.append_tokens(seq.token_ids_slice(seq.block_table.num_tokens, stop))
        except OutOfBlocksError:
            if self.observer is not None:
                self.observer(EngineEvent(EngineEventType.OUT_OF_BLOCKS, seq.request_id, num_tokens=num_new_tokens))
            return False
        return True

    def _try_admit(self, seq: SequenceState, token_budget: int) -> int:
        """Give a waiting sequence its first blocks (cache hits included); the tokens it runs now,
        0 if the budget, the seats or the free blocks say wait."""
        hashes = seq.block_hashes()  # prompt + output: a preempted sequence recomputes both
        num_cached = len(self.allocator.cached_prefix(hashes, seq.num_tokens)) * self.allocator.block_size  # a peek
        num_new = seq.num_tokens - num_cached
        if self.enable_chunked_prefill:
            num_new = min(num_new, token_budget)
        seats = sum(s.num_samples for s in self.running) + seq.num_samples  # its forks' seats too
        if not 0 < num_new <= token_budget or seats > self.max_num_seqs:
            return 0
        try:
            tokens = seq.token_ids_slice(0, num_cached + num_new)  # a whole prompt is passed on, not copied
            seq.num_computed_tokens = seq.block_table.allocate_prompt(tokens, hashes)
        except OutOfBlocksError:
            return 0
        return num_new

    def _preempt(self, seq: SequenceState) -> None:
        """Preemption by recompute (see the class docstring)."""
        if self.observer is not None:  # provided: whoever listens hears of it before it happens
            self.observer(EngineEvent(EngineEventType.PREEMPTED, seq.request_id))
        raise NotImplementedError("Exercise 5: Scheduler._preempt")

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the class docstring): at most `max_num_seqs` running sequences and
        `max_num_batched_tokens` scheduled tokens."""
        raise NotImplementedError("Exercise 5: Scheduler.schedule")

    # --- one step, for whoever drives the scheduler (the engine, the simulator) -----------

    def plan_step(self) -> SchedulerOutput:
        """`schedule()`, checked: an empty step while requests wait would repeat forever. An observer
        is told the plan: each sequence it runs (SCHEDULED, in batch order), then each block copy."""
        plan = self.schedule()
        if not plan.scheduled and self.has_unfinished():
            raise RuntimeError("the scheduler planned an empty step while requests are waiting")
        if self.observer is not None:
            for seq in plan.scheduled:
                num_tokens = plan.num_scheduled_tokens[seq.request_id]
                self.observer(EngineEvent(EngineEventType.SCHEDULED, seq.request_id, num_tokens=num_tokens))
            for pair in plan.blocks_to_copy:
                self.observer(EngineEvent(EngineEventType.COPIED, block_ids=tuple(int(b) for b in pair)))
        return plan

    def finish_step(self, plan: SchedulerOutput, sampled_token_ids: dict[str, int], now: float) -> list[SequenceState]:
        """`update()`, with the driver's clock: `now` stamps the step's tokens and retirements."""
        finished = self.update(plan, sampled_token_ids)
        for seq in plan.scheduled:
            if seq.request_id in sampled_token_ids:
                seq.token_times.append(now)
        for seq in finished:
            seq.finish_time = now
        return finished

    def _finish(self, seq: SequenceState, reason: str) -> None:
        """Retire `seq` from whichever queue holds it, its blocks back to the pool now."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.block_table.free()
        (self.running if seq in self.running else self.waiting).remove(seq)

    def abort(self, request_id: str) -> SequenceState | None:
        """Finish a waiting or running request as "abort" now (its client went away); None if
        no unfinished request has this id."""
        for seq in [*self.waiting, *self.running]:
            if seq.request_id == request_id:
                self._finish(seq, "abort")
                return seq
        return None

    def update(self, plan: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[SequenceState]:
        """After the step ran: each scheduled sequence has its scheduled tokens computed (their full
        blocks findable at once), each one in `sampled_token_ids` gets its token, and those done now
        (`seq.check_stop()`) retire, their blocks back in the pool. Returns the retired ones."""
        raise NotImplementedError("Exercise 5: Scheduler.update")


class StaticBatchScheduler(Scheduler):
    """The baseline: a batch of up to `batch_size` requests runs until ALL of them finished, and
    only then does the next batch start: a finished sequence's slot stays empty until the whole
    batch is done (head-of-line blocking). Like the static servers it stands for, it reserves each
    request's worst case (prompt + max_tokens, and its samples') at admission, so it never preempts."""

    def __init__(self, allocator: BlockAllocator, batch_size: int):
        super().__init__(allocator, max_num_seqs=batch_size, max_num_batched_tokens=sys.maxsize,
                         enable_chunked_prefill=False)

    def _worst_case(self, seq: SequenceState) -> int:
        """Blocks a request and the samples it forks may take: they share the prompt's full blocks."""
        prompt = len(seq.prompt_token_ids)
        size = self.allocator.block_size
        worst = blocks_needed(prompt + seq.sampling.max_tokens, size)
        return worst + (seq.num_samples - 1) * (worst - prompt // size)

    def _rejection(self, seq: SequenceState) -> str | None:
        need = self._worst_case(seq)
        if need > self.allocator.num_blocks:  # a batch holds a request's samples together
            return (f"{seq.num_samples} samples of prompt + max_tokens need {need} KV blocks at "
                    f"once in a static batch, the whole cache has {self.allocator.num_blocks}")
        return super()._rejection(seq)

    def schedule(self) -> SchedulerOutput:
        plan = SchedulerOutput()
        if not self.running:
            self._start_batch(plan)
            return plan
        for seq in self.running:
            num_new = seq.num_tokens - seq.num_computed_tokens
            if not self._allocate_slots(seq, num_new, plan):
                raise RuntimeError("a static batch ran out of the blocks it reserved")
            plan.add(seq, num_new)
        return plan

    def _start_batch(self, plan: SchedulerOutput) -> None:
        free = self.allocator.num_free_blocks
        reserved = 0  # blocks promised to the batch's worst cases so far
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            worst = self._worst_case(seq)
            if reserved + worst > free:
                break
            num_new = self._try_admit(seq, self.max_num_batched_tokens)
            if num_new == 0:  # its samples' seats are not left in this batch
                break
            reserved += worst
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.add(seq, num_new)


def make_scheduler(scheduling: str, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                    enable_chunked_prefill: bool) -> Scheduler:
    if scheduling == "continuous":
        return Scheduler(allocator, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    if scheduling == "static":
        return StaticBatchScheduler(allocator, batch_size=max_num_seqs)
    raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")


# --- the sampler ----------------------------------------------------------------------------


def token_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution a sampler draws from (SamplingParams), per row of `logits`, in float64;
    top-k keeps ties with the k-th token, top-p the token whose mass crosses it. At T = 0 it is
    one-hot on the argmax, so one accept/resample rule serves greedy speculation too."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        probs = np.zeros(logits.shape)
        np.put_along_axis(probs, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return probs
    # Subtract the max BEFORE dividing: at a tiny temperature logits / T overflows to inf,
    # and inf - inf is NaN; (logits - max) / T is at most 0 and only underflows to -inf.
    probs = _softmax((logits - logits.max(axis=-1, keepdims=True)) / temperature)
    vocab_size = probs.shape[-1]
    if 0 < top_k < vocab_size:
        kth = np.partition(probs, vocab_size - top_k, axis=-1)[..., vocab_size - top_k, None]
        probs = np.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        probs = probs / probs.sum(axis=-1, keepdims=True)
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        keep = np.cumsum(ranked, axis=-1) - ranked < top_p  # the mass before each token
        np.put_along_axis(probs, order, np.where(keep, ranked, 0.0), axis=-1)
    return probs / probs.sum(axis=-1, keepdims=True)


def sample_token(logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator | None) -> int:
    """One output token from one row of logits: the argmax at temperature 0, else one draw
    `rng.choice(V, p=token_probs(...))` from the request's own generator, so that what it samples
    depends neither on its batch nor on preemptions."""
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    p = token_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return int(rng.choice(p.size, p=p))


# --- the engine: the scheduler driving the model --------------------------------------------


LogitsProcessor = Callable[[SequenceState, np.ndarray], np.ndarray]


class LLMEngine:
    """Serves generation requests on a ToyTransformer with a paged KV-cache.

    `num_blocks=None` fits `max_num_seqs` sequences of the model's full length (nothing is ever
    preempted); pass fewer to study memory pressure. `scheduling`: "continuous" (Scheduler) or
    "static" (StaticBatchScheduler, batch_size = max_num_seqs). Metrics: `time.perf_counter` seconds.
    `kv_cache_dtype="int8"`: K/V as int8 with per-token scales (`KVCache`), 3.2-3.8x fewer bytes.

    `logits_processors` (vLLM's hook): each is called in order as `processor(seq, logits)` with
    a sequence about to sample and its raw logits row (or the previous one's result), and
    returns the row to sample from (it may change the row in place: the row is the sequence's
    own). vLLM's API extras (penalties, ...) are processors that the serving package supplies.

    `observer` is called with each EngineEvent as it happens: the step's plan and preemptions from
    the scheduler, every change to the pool from an ObservedBlockAllocator. None (the default)
    builds the plain BlockAllocator and sends nothing.
    """

    def __init__(self, model: ToyTransformer, num_blocks: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, scheduling: str = "continuous",
                 enable_prefix_caching: bool = False, enable_chunked_prefill: bool = True,
                 kv_cache_dtype: str = "float32", logits_processors: Sequence[LogitsProcessor] = (),
                 observer: EngineObserver | None = None):
        if not (isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {kv_cache_dtype!r}")
        if num_blocks is None:
            num_blocks = max_num_seqs * blocks_needed(model.config.n_positions, block_size)
        self.model = model
        if observer is None:
            self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        else:
            self.allocator = ObservedBlockAllocator(num_blocks, block_size, enable_prefix_caching, observer=observer)
        self.kv_cache = KVCache(model.config, num_blocks, block_size, dtype=kv_cache_dtype)
        self.scheduler = make_scheduler(scheduling, self.allocator, max_num_seqs, max_num_batched_tokens,
                                         enable_chunked_prefill)
        self.scheduler.observer = observer
        self.logits_processors = list(logits_processors)
        self.num_steps = 0
        self._next_id = 0
        self.requests: dict[str, SequenceState] = {}  # added, and not yet reported finished
        self._forks: dict[str, list[Request]] = {}  # request id -> the samples it forks once its prompt ran

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.allocator.stats.hit_rate

    def _in_flight(self) -> set[str]:  # ids taken: requests not yet reported, and samples to fork
        return set(self.requests) | {r.request_id for forks in self._forks.values() for r in forks}

    def _checked_requests(self, prompts: Sequence[Request | Sequence[int]],
                          sampling: Sequence[SamplingParams | None]) -> list[Request]:
        """Requests for these prompts, every field checked, ids fresh and unique: a ValueError
        for any bad one, and then nothing is queued (a batch is all or nothing)."""
        taken = self._in_flight()
        requests = []
        next_id = self._next_id
        for prompt, params in zip(prompts, sampling):
            if isinstance(prompt, Request):
                request = prompt
            else:
                while str(next_id) in taken:  # a caller's id may look like ours
                    next_id += 1
                request = Request(str(next_id), prompt, SamplingParams() if params is None else params)
                next_id += 1
            request = dataclasses.replace(request, prompt_token_ids=check_request(request, self.model.config))
            if request.request_id in taken:
                raise ArgumentError("request_id", f"request id {request.request_id!r} is already in flight; "
                                                  "ids must be unique")
            taken.add(request.request_id)
            requests.append(request)
        self._next_id = next_id  # only once the whole batch is accepted
        return requests

    def add_request(self, prompt: Request | Sequence[int], sampling: SamplingParams | None = None, n: int = 1) -> str:
        """Queue a Request (or a prompt with its SamplingParams); returns its request id. Its arrival is
        now on the engine's clock. A bad field or an id in flight is an ArgumentError, nothing queued.
        `n > 1` is parallel sampling by fork (the PagedAttention paper's): the prompt runs once, then
        samples "ID.1" .. "ID.{n-1}" (seed + i) fork its block table and draw their first tokens from its
        logits; a shared partial last block is copied at each one's first write."""
        n = check_int("n", n, 1)
        request = self._checked_requests([prompt], [sampling])[0]
        seed = request.sampling.seed
        forks = [dataclasses.replace(request, request_id=f"{request.request_id}.{i}", sampling=dataclasses.replace(
            request.sampling, seed=None if seed is None else seed + i)) for i in range(1, n)]
        if {f.request_id for f in forks} & self._in_flight():
            raise ArgumentError("request_id", f"the ids of the {n} samples of {request.request_id!r} are in flight")
        seq = self._add(request, n)
        if forks and not seq.finish_reason:  # a rejected request forks nothing
            self._forks[request.request_id] = forks
        return seq.request_id

    def _add(self, request: Request, n: int = 1) -> SequenceState:
        seq = self.scheduler.add_request(request, n)
        seq.arrival_time = time.perf_counter()
        seq.rng = np.random.default_rng(request.sampling.seed)
        self.requests[request.request_id] = seq
        seq.finish_time = seq.arrival_time if seq.finish_reason else seq.finish_time  # rejected now
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str) -> bool:
        """Drop a waiting or running request now and free its blocks (its client went away). Its last
        output, `finish_reason="abort"`, comes from the next `step()`. False for an unknown or finished id."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_time = time.perf_counter()
            self._forks.pop(request_id, None)
        return seq is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run, update, emit: what is new for every request since its last output (a finished
        one is reported once, then forgotten). If the model or the sampler raises, the step's sequences
        finish as "error" (blocks freed), the error propagates, and the next step reports them."""
        self._run_step()
        return self._emit()

    def _run_step(self) -> None:
        """Schedule, run, update: one step of every request in flight (vLLM's EngineCore.step)."""
        plan = self.scheduler.plan_step()
        self.scheduler.finish_step(plan, self._execute(plan), time.perf_counter())

    def _execute(self, plan: SchedulerOutput) -> dict[str, int]:
        """The forward pass and the sampler; on an error the step's sequences finish as "error"."""
        try:
            sampled = self._run_model(plan) if plan.scheduled else {}
        except Exception as exc:
            for seq in plan.scheduled:
                self.abort_request(seq.request_id)
                seq.finish_reason = "error"
                seq.finish_detail = f"{type(exc).__name__}: {exc}"
            raise
        self.num_steps += bool(plan.scheduled)
        return sampled

    def _emit(self) -> list[EngineCoreOutput]:
        outputs = []
        for seq in list(self.requests.values()):
            new = seq.output_token_ids[seq.num_reported :]
            if new or seq.finish_reason:
                seq.num_reported += len(new)
                outputs.append(EngineCoreOutput(seq.request_id, new, seq.finish_reason, seq.finish_detail))
            if seq.finish_reason:
                del self.requests[seq.request_id]
        return outputs

    def _run_model(self, plan: SchedulerOutput) -> dict[str, int]:
        """Forward and sample: request id -> token, for each sequence whose last pending token runs."""
        self.kv_cache.copy_blocks(plan.blocks_to_copy)  # before the forward writes into the copies
        seqs = plan.scheduled
        num_new = [plan.num_scheduled_tokens[s.request_id] for s in seqs]
        last_rows = np.cumsum(num_new) - 1
        samplers = [(s, row) for s, row in zip(seqs, last_rows) if plan.completes(s)]
        logits = self.model.forward(self.kv_cache, [s.block_table for s in seqs], [s.num_computed_tokens for s in seqs],
                                    num_new, logits_indices=np.array([row for _, row in samplers], dtype=np.int64))
        sampled = {}
        for (seq, _), row in zip(samplers, logits):
            for child in self._fork(seq, plan):  # its samples from this row, before it changes it
                sampled[child.request_id] = self._sample(child, row.copy())
            sampled[seq.request_id] = self._sample(seq, row)
        return sampled

    def _fork(self, seq: SequenceState, plan: SchedulerOutput) -> list[SequenceState]:
        """The samples of `seq` (`add_request`), its prompt's K/V written: they run on as it does."""
        children = [seq.fork(request) for request in self._forks.pop(seq.request_id, ())]
        seq.num_samples = 1  # each sample holds the seat it was admitted with
        for child in children:
            child.arrival_time = seq.arrival_time
            child.rng = np.random.default_rng(child.sampling.seed)
            self.requests[child.request_id] = child
            self.scheduler.running.append(child)
            plan.add(child, plan.num_scheduled_tokens[seq.request_id])
        return children

    def _sample(self, seq: SequenceState, logits: np.ndarray) -> int:
        for process in self.logits_processors:
            logits = process(seq, logits)
        return sample_token(logits, seq.sampling, seq.rng)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Offline (vLLM's `LLM.generate`): every prompt run to completion, one RequestOutput per prompt,
        in order, and not reported again by `step()`. `sampling`: one for all or one per prompt, all
        checked first (a ValueError, nothing runs). Requests added with `add_request` run alongside,
        reported by the next `step()`, as is this batch if a step raises (aborted, or "error")."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling)} SamplingParams")
        seqs = [self._add(request) for request in self._checked_requests(prompts, sampling)]
        try:
            while not all(seq.finish_reason for seq in seqs):
                self._run_step()  # not step(): it would report (and forget) the requests add_request queued
        except BaseException:
            for seq in seqs:
                self.abort_request(seq.request_id)
            raise
        return [self.requests.pop(seq.request_id).to_output() for seq in seqs]  # reported here, not by step()


# =====================================================================================
# 4. Speculative decoding: accept/resample, its exact distribution, the speedup algebra, and
#    draft -> verify on the paged model
# =====================================================================================
#
# References: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
# Decoding" (ICML); Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper 2023, "Accelerating Large
# Language Model Decoding with Speculative Sampling" (arXiv:2302.01318).


# A row is a distribution when finite, non-negative and summing to 1 within PROB_ATOL: 1e-5 admits
# float32 softmax rows over a large vocabulary and still rejects logits or a forgotten normalisation.
# Accepted rows are renormalised in float64 (`Generator.choice` wants a sum within ~1.5e-8).
PROB_ATOL = 1e-5


def _as_distributions(name: str, probs, ndim: int) -> np.ndarray:
    """`probs` as float64 rows that sum to exactly 1, or a ValueError naming the first bad row."""
    arr = np.asarray(probs, dtype=np.float64)
    if arr.ndim != ndim:
        expected = "a 1-D row (V,)" if ndim == 1 else "a 2-D array of rows (n, V)"
        raise ValueError(f"{name} must be {expected} of probabilities, got shape {arr.shape}")
    if arr.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary axis, shape {arr.shape}")
    rows = arr.reshape(-1, arr.shape[-1])
    sums = rows.sum(axis=1)
    # One cheap test on the common path; the diagnosis below runs only for bad input. NaN fails
    # every comparison, so `not (... <= ...)` also catches it.
    if rows.size and not (rows.min() >= 0.0 and np.abs(sums - 1.0).max() <= PROB_ATOL):
        problems = [
            (~np.isfinite(rows).all(axis=1), "contains NaN or inf"),
            ((rows < 0).any(axis=1), "has a negative entry (did you pass logits?)"),
            (~(np.abs(sums - 1.0) <= PROB_ATOL),
             f"does not sum to 1 within {PROB_ATOL:g} (apply softmax / normalise first)"),
        ]
        for bad, why in problems:
            if bad.any():
                i = int(np.argmax(bad))
                where = name if ndim == 1 else f"{name}[{i}]"
                raise ValueError(f"{where} {why}; expected a probability distribution over "
                                 f"the vocabulary, got {np.array2string(rows[i], precision=4)}")
    return arr / sums.reshape(arr.shape[:-1] + (1,))


def _check_same_vocab(p: np.ndarray, q: np.ndarray) -> None:
    if p.shape != q.shape:
        raise ValueError(f"target p has shape {p.shape} but draft q has shape {q.shape}; "
                         "both must be rows over the same vocabulary")


def residual_distribution(p, q) -> np.ndarray:
    """The distribution a rejected draft token is replaced from: `max(0, p - q)` normalised, `p`
    itself where that has no mass (p == q). `p` is the target row, `q` the draft row. Returns a
    float64 row summing to 1. (Checked before your code: p and q arrive as float64 rows that sum to
    1, of one vocabulary.)"""
    p = _as_distributions("p", p, ndim=1)
    q = _as_distributions("q", q, ndim=1)
    _check_same_vocab(p, q)
    raise NotImplementedError("Exercise 6: residual_distribution")


def _checked_speculative_inputs(draft_token_ids, draft_probs, target_probs,
                                rng) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The draft tokens, q (k, V) and p (k+1, V) as float64 distributions, or a ValueError (see below)."""
    q = _as_distributions("draft_probs", draft_probs, ndim=2)
    p = _as_distributions("target_probs", target_probs, ndim=2)
    k, vocab_size = q.shape
    if p.shape != (k + 1, vocab_size):
        raise ValueError(f"target_probs must have shape (k+1, V) = {(k + 1, vocab_size)} for "
                         f"draft_probs of shape {q.shape}; got {p.shape}")
    draft = list(draft_token_ids)
    if len(draft) != k:
        raise ValueError(f"got {len(draft)} draft tokens but draft_probs has k = {k} rows")
    for i, x in enumerate(draft):
        if not is_int(x):
            raise ValueError(f"draft token {i} is {x!r}; expected an int token id")
        if not 0 <= x < vocab_size:
            raise ValueError(f"draft token {i} is {x}; expected an id in [0, {vocab_size})")
        if q[i, x] == 0.0:
            raise ValueError(f"draft token {i} is {x} but draft_probs[{i}][{x}] == 0: the draft "
                             "could not have sampled it, so p/q is undefined")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator (np.random.default_rng(seed)), "
                         f"got {type(rng).__name__}")
    return [int(x) for x in draft], q, p


def accept_or_resample(draft_token_ids, draft_probs, target_probs,
                       rng: np.random.Generator) -> list[int]:
    """Verify `k` draft tokens against the target: the speculative-sampling accept/resample rule.

    `draft_token_ids` (k ints) were sampled from `draft_probs` (k, V), token i from row i;
    `target_probs` (k+1, V) are the target's rows at the same positions plus one, from ONE target
    pass. Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection one token is drawn from `residual_distribution(p_i, q_i)` and the step ends; if all
    k are accepted a bonus token is drawn from `target_probs[k]`. Returns the 1 to k+1 emitted
    token ids. Invariant: each emitted token has exactly the target's distribution.

    The draws, so that a seeded run is reproducible: one `rng.random()` per draft token judged
    (x_i is accepted iff it is below min(1, p_i/q_i)), then one `rng.choice(V, p=...)` for the
    residual or bonus token. (The arguments arrive checked.)"""
    draft, q, p = _checked_speculative_inputs(draft_token_ids, draft_probs, target_probs, rng)
    raise NotImplementedError("Exercise 6: accept_or_resample")


def speculative_output_distribution(p, q) -> np.ndarray:
    """Exact distribution of the first token one accept/resample step emits, for a draft x ~ q, in
    closed form: x is proposed with probability q(x) and kept with min(1, p(x)/q(x)), together
    min(p(x), q(x)); the rest, 1 - sum(min(p, q)), goes to the residual. The sum is p, whatever q."""
    p = _as_distributions("p", p, ndim=1)
    q = _as_distributions("q", q, ndim=1)
    _check_same_vocab(p, q)
    # q(x) == 0 means x is never proposed; keep those terms at 0 without dividing by 0.
    ratio = np.divide(p, q, out=np.ones_like(p), where=q > 0)
    kept = q * np.minimum(1.0, ratio)
    rejected = 1.0 - kept.sum()
    return kept + rejected * residual_distribution(p, q)


def acceptance_rate(p, q) -> float:
    """alpha = sum(min(p, q)): the probability one draft token from q is accepted (1 - TV(p, q))."""
    p = _as_distributions("p", p, ndim=1)
    q = _as_distributions("q", q, ndim=1)
    _check_same_vocab(p, q)
    return float(np.minimum(p, q).sum())


def _check_alpha_k(alpha: float, k: int) -> None:
    if not (is_number(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha is the acceptance rate, a probability in [0, 1]; got {alpha!r}")
    if not (is_int(k) and k >= 1):
        raise ValueError(f"k is the number of draft tokens per step, an int >= 1; got {k!r}")


def _check_cost(name: str, value: float, allow_zero: bool) -> None:
    if not (is_number(value) and np.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} is a cost relative to one target decode step, a finite number "
                         f"{bound}; got {value!r}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one draft+verify step emits: (1 - alpha**(k+1)) / (1 - alpha). With
    acceptances independent at rate alpha it emits j+1 tokens when the first j drafts are kept,
    so the mean is 1 + alpha + ... + alpha**k (k+1 at alpha = 1, where the closed form is 0/0)."""
    _check_alpha_k(alpha, k)
    alpha, k = float(alpha), int(k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s walltime improvement: (1 - alpha**(k+1)) / ((1 - alpha) * (k*c + 1)),
    c = draft step cost / target step cost: k draft steps plus ONE target pass, costed as one
    decode step although it scores k+1 tokens (true while decode is bandwidth-bound)."""
    _check_cost("c", c, allow_zero=True)
    return expected_tokens_per_step(alpha, k) / (k * c + 1.0)


def breakeven_draft_cost(alpha: float, k: int) -> float:
    """The draft cost c at which `speculative_speedup(alpha, k, c) == 1` (cheaper drafts win):
    c = (E - 1)/k = (alpha + ... + alpha**k)/k, 0 at alpha = 0 and 1 at alpha = 1."""
    return (expected_tokens_per_step(alpha, k) - 1.0) / k


def predicted_speedup(alpha: float, k: int, c: float, verify_cost: float) -> float:
    """Speedup when the target pass over k+1 tokens costs `verify_cost` decode steps: E / (k*c +
    verify_cost). `speculative_speedup` is verify_cost = 1, true while the pass is bandwidth-bound;
    compute-bound (prefill, large batch) it tends to k+1 and the speedup drops below 1."""
    _check_cost("verify_cost", verify_cost, allow_zero=False)
    _check_cost("c", c, allow_zero=True)
    return expected_tokens_per_step(alpha, k) / (k * c + verify_cost)


# --- draft -> verify on the paged model (Exercise 7) --------------------------------------


@dataclasses.dataclass
class SpeculativeOutput:
    """What `speculative_generate` produced and how the draft fared."""

    token_ids: list[int]
    num_target_passes: int  # verification passes (the prompt's prefill is not counted)
    num_draft_tokens: int
    num_accepted: int
    accepted_per_pass: list[int]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0


class PagedSequence:
    """One model's private paged cache for one sequence, with what it has computed so far."""

    def __init__(self, model: ToyTransformer, block_size: int = 16):
        num_blocks = blocks_needed(model.config.n_positions, block_size)
        self.model = model
        self.table = BlockTable(BlockAllocator(num_blocks, block_size))
        self.cache = KVCache(model.config, num_blocks, block_size)
        self.num_computed = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        self.cache.copy_blocks(self.table.append_tokens(token_ids))

    def run(self, stop: int | None = None) -> np.ndarray:
        """Process the tokens not computed yet (up to position `stop`); logits for each of them."""
        start = self.num_computed
        stop = self.table.num_tokens if stop is None else stop
        if stop == start:
            return np.empty((0, self.model.config.vocab_size), np.float32)
        self.num_computed = stop
        return self.model.forward(self.cache, [self.table], [start], [stop - start])

    def rollback(self, num_tokens: int) -> None:
        """Forget tokens past `num_tokens`: their blocks go back, their K/V is never read again."""
        self.table.truncate(num_tokens)
        self.num_computed = min(self.num_computed, num_tokens)


def make_self_draft(target: ToyTransformer, num_layers: int) -> ToyTransformer:
    """A self-speculative draft: the target's first `num_layers` blocks with its embeddings and head.

    It costs about num_layers / n_layer of a target step and needs no training; how often it
    agrees with the target (alpha) is measured, not assumed.
    """
    if not 1 <= num_layers <= target.config.n_layer:
        raise ValueError(f"a self-draft keeps 1..{target.config.n_layer} layers, got {num_layers}")
    config = dataclasses.replace(target.config, n_layer=num_layers)
    keep = gpt2_weight_shapes(config)
    return ToyTransformer(config, {name: w for name, w in target.weights.items() if name in keep})


def speculative_generate(
    target: ToyTransformer,
    draft: ToyTransformer,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    k: int = 4,
) -> SpeculativeOutput:
    """Generate with a draft that proposes up to `k` tokens and a target that verifies them in ONE
    paged forward pass per round. The output has the target's distribution (greedy: exactly the
    target's greedy tokens). (Checked before your code: prompt + max_tokens fits both models'
    n_positions.)

    Conventions the counters and the draws follow:
    - both models prefill the prompt but its last token, emitting nothing; `num_target_passes`
      counts the rounds after it;
    - a round drafts min(k, tokens still wanted - 1) tokens; `num_draft_tokens` counts the drafts
      made, `num_accepted` those accepted, past a stop token too;
    - one generator, `np.random.default_rng(sampling.seed)`, serves the draft's draws and
      accept_or_resample's, in the order they happen; the draft samples at the target's
      temperature (`token_probs`);
    - the output stops at the first stop token (kept) or at max_tokens; no round starts after a
      stop token."""
    prompt = list(prompt_token_ids)
    check_request(Request("speculative", prompt, sampling), target.config)
    unsupported = [f.name for f in dataclasses.fields(SamplingParams)[4:] if getattr(sampling, f.name) != f.default]
    if unsupported:  # never silently ignored
        raise ValueError(f"speculative_generate samples with temperature, max_tokens, seed and stop_token_ids "
                         f"only; got {', '.join(unsupported)}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocabulary {draft.config.vocab_size} != target vocabulary {target.config.vocab_size}")
    check_request(Request("speculative (draft)", prompt, sampling), draft.config)  # the draft's context too
    k = check_int("k", k, minimum=1)
    raise NotImplementedError("Exercise 7: speculative_generate")


def estimate_alpha(out: SpeculativeOutput, k: int) -> float:
    """Per-token acceptance probability alpha from a run's accept counts.

    Not `out.acceptance_rate` (accepted / drafted): drafts after the first rejection of a round
    are thrown away unjudged, so that ratio is (E - 1)/k, not alpha. Under the i.i.d. model behind
    `expected_tokens_per_step`, each round is a run of accepts ended by one rejection (or by
    reaching k), and the maximum-likelihood alpha is accepts / (accepts + rejections).
    """
    rejections = sum(1 for a in out.accepted_per_pass if a < k)
    judged = out.num_accepted + rejections
    return out.num_accepted / judged if judged else 0.0


# =====================================================================================
# 5. Capacity planning: KV blocks, concurrency and QPS for a real GPU
# =====================================================================================
#
# Units: bytes (int), bytes/s, FLOP/s, seconds. Printouts quote GB = 1e9 bytes (vendors' unit);
# device memory is what `nvidia-smi` reports, in MiB = 2**20 bytes: that, not the marketing
# figure, is what an engine such as vLLM multiplies by gpu_memory_utilization.


GB, MiB = 10**9, 2**20


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a decoder-only model costs to serve: parameters, and the shape of its KV cache and MLP.
    `num_kv_heads` equals the query heads (`num_attention_heads`) for multi-head attention and is
    smaller under grouped-query attention (GQA), each KV head serving a group of query heads.
    `max_position_embeddings` is the context the model was trained for (0: unknown)."""

    name: str
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_attention_heads: int | None = None
    max_position_embeddings: int = 0
    kv_dtype_bytes: int | None = None  # bytes per KV-cache element; None: dtype_bytes
    intermediate_size: int | None = None  # the MLP's width (config.json's); None: unknown
    gated_mlp: bool = True  # gate and up projections (SwiGLU: Llama, Mistral); False: one up (GPT-2)

    def __post_init__(self) -> None:
        optional = ("kv_dtype_bytes", "intermediate_size")  # None: as dtype_bytes; unknown
        for field in ("num_params", "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", *optional):
            if field not in optional or getattr(self, field) is not None:
                check_int(f"ModelSpec {self.name!r}: {field}", getattr(self, field), minimum=1)
        heads = self.num_attention_heads
        if heads is not None and (heads < self.num_kv_heads or heads % self.num_kv_heads):
            raise ValueError(
                f"ModelSpec {self.name!r}: num_attention_heads ({heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}): each KV head serves a whole group of query heads"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights: every parameter once, at `dtype_bytes` each."""
        return self.num_params * self.dtype_bytes


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One accelerator: memory (bytes), peak bandwidth (bytes/s), peak dense BF16 FLOP/s."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops: float

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bandwidth_bytes_per_s", "flops"):
            if not getattr(self, field) > 0:
                raise ValueError(f"GPUSpec {self.name!r}: {field} must be positive, got {getattr(self, field)!r}")


def kv_bytes_per_token(model: ModelSpec) -> int:
    """KV-cache bytes one token occupies: a key AND a value vector (the 2) of `head_dim` for every
    KV head (GQA: fewer than query heads) in every layer, at `kv_dtype_bytes` (8-bit: 1) each."""
    element = model.dtype_bytes if model.kv_dtype_bytes is None else model.kv_dtype_bytes
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * element


# --- presets: real models and GPUs, and the KV cache's dtype ------------------------------


# Presets. Model shapes from each Hugging Face config.json (num_hidden_layers, num_attention_heads,
# num_key_value_heads, hidden_size / heads = head_dim, max_position_embeddings, intermediate_size); params
# as the safetensors totals (test_model_presets_match_their_configs recomputes them).
MODELS: dict[str, ModelSpec] = {
    # meta-llama/Llama-2-7b-hf: 32 layers, 32 heads = 32 KV heads, hidden 4096, 4096 positions.
    "llama-2-7b": ModelSpec("llama-2-7b", 6_738_415_616, 32, 32, 128,
                            num_attention_heads=32, max_position_embeddings=4096, intermediate_size=11008),
    # meta-llama/Llama-2-13b-hf: 40 layers, 40 heads = 40 KV heads, hidden 5120, 4096 positions.
    "llama-2-13b": ModelSpec("llama-2-13b", 13_015_864_320, 40, 40, 128,
                             num_attention_heads=40, max_position_embeddings=4096, intermediate_size=13824),
    # meta-llama/Llama-2-70b-hf: 80 layers, 64 heads, 8 KV heads (GQA), hidden 8192, 4096 positions.
    "llama-2-70b": ModelSpec("llama-2-70b", 68_976_648_192, 80, 8, 128,
                             num_attention_heads=64, max_position_embeddings=4096, intermediate_size=28672),
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, 8 KV heads (GQA), hidden 4096, 8192 positions.
    "llama-3-8b": ModelSpec("llama-3-8b", 8_030_261_248, 32, 8, 128,
                            num_attention_heads=32, max_position_embeddings=8192, intermediate_size=14336),
    # mistralai/Mistral-7B-v0.1: 32 layers, 32 heads, 8 KV heads, hidden 4096, 32768 positions
    # (its 4096-token sliding window is ignored: the planner charges the full context, an upper bound).
    "mistral-7b": ModelSpec("mistral-7b", 7_241_732_096, 32, 8, 128,
                            num_attention_heads=32, max_position_embeddings=32768, intermediate_size=14336),
}


# Presets, SXM parts where there is a choice. memory_bytes is nvidia-smi's memory.total (MiB),
# not the marketing figure (the "80GB" A100 is 81920 MiB); bandwidth and dense BF16 FLOP/s from
# NVIDIA's datasheets (Hopper and Ada are quoted "with sparsity": the dense figure is half).
GPUS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("a100-40gb", 40_960 * MiB, 1_555e9, 312e12),  # HBM2, 1,555 GB/s, 312 TFLOPS
    "a100-80gb": GPUSpec("a100-80gb", 81_920 * MiB, 2_039e9, 312e12),  # HBM2e, 2,039 GB/s, 312 TFLOPS
    "h100-80gb": GPUSpec("h100-80gb", 81_559 * MiB, 3.35e12, 989e12),  # SXM5 HBM3, 3.35 TB/s, 1,979/2
    "h200": GPUSpec("h200", 143_771 * MiB, 4.8e12, 989e12),  # HBM3e, 4.8 TB/s, 1,979/2 TFLOPS
    "l4": GPUSpec("l4", 23_034 * MiB, 300e9, 121e12),  # GDDR6, 300 GB/s, 242/2 TFLOPS
}


def _preset(value, presets: dict, what: str):
    """`value` itself if it is a spec, else the preset of that name; an unknown name lists the known ones."""
    if not isinstance(value, str):
        return value
    if value not in presets:
        raise ValueError(f"unknown {what} {value!r}; known {what}s: {', '.join(presets)}")
    return presets[value]


def get_model(model: ModelSpec | str) -> ModelSpec:
    return _preset(model, MODELS, "model")


def get_gpu(gpu: GPUSpec | str) -> GPUSpec:
    return _preset(gpu, GPUS, "GPU")


# vLLM's `kv_cache_dtype`: "auto" is the model's dtype; fp8 and int8 store 1 byte per element
# (the few bytes of scales per block left out, as vLLM's sizing does for per-tensor fp8 scales).
PLAN_KV_CACHE_DTYPES = {"auto": None, "fp8": 1, "int8": 1}


def with_kv_cache_dtype(model: ModelSpec | str, kv_cache_dtype: str) -> ModelSpec:
    """`model` with its KV cache stored as `kv_cache_dtype`: "fp8"/"int8" (1 byte), "auto" as is."""
    if not (isinstance(kv_cache_dtype, str) and kv_cache_dtype in PLAN_KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, PLAN_KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    model = get_model(model)
    element = PLAN_KV_CACHE_DTYPES[kv_cache_dtype]  # "auto": None, as is
    return model if element is None else dataclasses.replace(model, kv_dtype_bytes=element)


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """Mean request lengths a paper reports for a trace, and where."""

    name: str
    mean_prompt_len: float
    mean_output_len: float
    source: str


# Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
# SOSP 2023, Fig. 11 (the means in its legends) and §6.1 (ShareGPT's prompts are 8.4x Alpaca's).
SHAREGPT = LengthStats("ShareGPT", 161.31, 337.99, "Kwon et al. SOSP'23, Fig. 11a")
ALPACA = LengthStats("Alpaca", 19.31, 58.45, "Kwon et al. SOSP'23, Fig. 11b")


# --- the plan -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeploymentPlan:
    """One serving configuration, sized per GPU (a tensor-parallel group of tp GPUs holds one copy
    of the model and one KV cache, 1/tp on each): what was asked (model ... mean_output_len), what
    `plan_deployment` computed (num_kv_blocks ... prefill_s), and properties derived from those."""

    model: ModelSpec
    gpu: GPUSpec
    max_model_len: int
    block_size: int
    gpu_memory_utilization: float
    activation_bytes: int
    tensor_parallel_size: int
    mean_prompt_len: float
    mean_output_len: float
    num_kv_blocks: int                # physical KV blocks per GPU (same count on every GPU)
    max_concurrent_seqs: int          # sequences that can all reach max_model_len at once
    decode_step_s: float              # one decode step of max_concurrent_seqs sequences
    decode_bound: str                 # "memory-bandwidth" or "compute"
    prefill_s: float                  # prefill of one mean prompt
    notes: tuple[str, ...] = ()

    def replan(self, **changes) -> DeploymentPlan:
        """`plan_deployment` again with the same inputs except `changes` (what-if variants)."""
        inputs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[:9]} | changes
        return plan_deployment(**inputs)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return kv_bytes_per_token(self.model) // self.tensor_parallel_size

    @property
    def block_bytes_per_gpu(self) -> int:
        return self.block_size * self.kv_bytes_per_token_per_gpu

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes / self.tensor_parallel_size

    @property
    def memory_budget_bytes(self) -> float:
        return self.gpu_memory_utilization * self.gpu.memory_bytes

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_kv_blocks * self.block_bytes_per_gpu

    @property
    def num_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def ceiling(self) -> str:
        """"kv-blocks" or "weights": see plan_deployment."""
        return "kv-blocks" if self.kv_pool_bytes > self.weight_bytes_per_gpu else "weights"

    @property
    def mean_context_len(self) -> float:
        """The context charged per sequence in a decode step: the prompt plus half the output."""
        return self.mean_prompt_len + self.mean_output_len / 2

    @property
    def request_latency_s(self) -> float:
        """Mean time a request holds its slot (Little's W): its decode steps, plus the prefills
        of the max_concurrent_seqs requests that turn over in the meantime."""
        return self.mean_output_len * self.decode_step_s + self.max_concurrent_seqs * self.prefill_s

    @property
    def qps(self) -> float:
        """Requests per second per tensor-parallel group (Little's law: L / W)."""
        return self.max_concurrent_seqs / self.request_latency_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.qps * self.mean_output_len


# The default traffic: the PagedAttention paper's ShareGPT means.
_DEFAULT_PROMPT_LEN, _DEFAULT_OUTPUT_LEN = SHAREGPT.mean_prompt_len, SHAREGPT.mean_output_len


def _check_plan_inputs(model: ModelSpec, max_model_len: int, block_size: int,
                       gpu_memory_utilization: float, activation_bytes: int,
                       tensor_parallel_size: int, mean_prompt_len: float,
                       mean_output_len: float) -> None:
    """plan_deployment's argument checks: a ValueError that names the bad argument."""
    for name, value in (("max_model_len", max_model_len), ("block_size", block_size),
                        ("tensor_parallel_size", tensor_parallel_size)):
        check_int(name, value, minimum=1)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    if model.num_kv_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must divide {model.name}'s "
                         f"{model.num_kv_heads} KV heads: each GPU holds whole KV heads")
    if not (mean_prompt_len > 0 and mean_output_len > 0):
        raise ValueError(f"mean_prompt_len and mean_output_len must be > 0, "
                         f"got {mean_prompt_len!r} and {mean_output_len!r}")
    if mean_prompt_len + mean_output_len > max_model_len:
        raise ValueError(f"mean prompt + output ({mean_prompt_len + mean_output_len:g} tokens) "
                         f"exceeds max_model_len {max_model_len}: the mean request would not fit")


def plan_deployment(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    max_model_len: int,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    activation_bytes: int = 0,
    tensor_parallel_size: int = 1,
    mean_prompt_len: float = _DEFAULT_PROMPT_LEN,
    mean_output_len: float = _DEFAULT_OUTPUT_LEN,
    kv_cache_dtype: str = "auto",
) -> DeploymentPlan:
    """Size a vLLM-style deployment of `model` on GPUs of type `gpu`, per GPU of a
    tensor-parallel group of `tensor_parallel_size` (tp) GPUs (each holds 1/tp of the weights and
    of the KV heads). Returns a `DeploymentPlan` of the inputs and what you compute:

    - `num_kv_blocks`: the engine may use `gpu_memory_utilization` of the GPU's memory; the weights
      (`num_params * dtype_bytes`, split over tp) and `activation_bytes` (per GPU) come off first,
      and the rest is whole blocks of `block_size` tokens' K/V (`kv_bytes_per_token`, split over tp);
    - `max_concurrent_seqs`: how many sequences can ALL reach `max_model_len` at once (a sequence
      owns whole blocks);
    - `decode_step_s`, `decode_bound`: one decode step of those sequences on the roofline: the
      time to read the weights once and each sequence's K/V at `DeploymentPlan.mean_context_len`
      tokens at the memory bandwidth, or to do its FLOPs (2 per parameter per sequence, over tp) at
      peak, whichever is longer; `decode_bound` is "memory-bandwidth" or "compute";
    - `prefill_s`: one mean prompt's FLOPs (2 per parameter per token, over tp; attention's own
      ignored) at peak;
    - `notes`: one line, when `max_model_len` exceeds the model's known `max_position_embeddings`,
      saying it was trained for only that many positions.

    The plan derives the rest (see `DeploymentPlan`). Raises ValueError for weights (plus
    activations) that do not fit the budget (saying by how many GB) and for a cache too small for
    one `max_model_len` sequence (a message with the word "blocks"); the inputs arrive checked.
    `kv_cache_dtype` "fp8"/"int8" stores K/V at 1 byte per element."""
    model = with_kv_cache_dtype(model, kv_cache_dtype)  # kv_bytes_per_token(model) follows it
    model, gpu = get_model(model), get_gpu(gpu)
    _check_plan_inputs(model, max_model_len, block_size, gpu_memory_utilization,
                       activation_bytes, tensor_parallel_size, mean_prompt_len, mean_output_len)
    raise NotImplementedError("Exercise 8: plan_deployment")


# =====================================================================================
# 6. The exercises, and the command line
# =====================================================================================
#
# `python solution.py ARGS` (and `python lab.py ARGS`) hand this module to `course.main`: what
# runs it lives in course/ and the packages below it, handed the module, never importing it.


EXERCISES = {
    1: "blocks and the allocator: blocks_needed, BlockAllocator",
    2: "the block table: BlockTable.append_tokens / fork / truncate / slots / free",
    3: "prefix caching: hash_block, lookup / register / _evict, allocate_prompt, cache_full_blocks",
    4: "paged attention: paged_attention",
    5: "continuous batching: Scheduler.schedule / update / _preempt",
    6: "speculative sampling: residual_distribution, accept_or_resample",
    7: "speculative generation: speculative_generate",
    8: "capacity planning: plan_deployment",
}


if __name__ == "__main__":
    import __main__  # this file, run as the program: the module the command line is handed
    import course

    raise SystemExit(course.main(__main__))
