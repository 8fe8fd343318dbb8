# GENERATED from solution.py by tools/make_lab.py: do not edit, edit solution.py and regenerate.
"""Inference-serving internals, small enough to read in an afternoon.

The three mechanisms behind vLLM, TensorRT-LLM and SGLang, on a NumPy GPT-2:

1. Paged KV-cache (PagedAttention): K/V live in fixed-size blocks addressed through a
   per-sequence block table, like pages through a page table.
2. The model and the paged attention path: a GPT-2 that reads its past through block tables.
3. Continuous batching: admit and retire requests at every step, so the batch stays full.
4. Speculative decoding: a cheap draft proposes, the target verifies in one pass, and the
   accept/resample rule keeps the target's distribution exactly.
5. Capacity planning: the same ideas as arithmetic for a real GPU.
6. The command line: the design-review scenarios (`python solution.py --help`).

`lab.py` is generated from this file by `tools/make_lab.py`: every region between
`# BEGIN SOLUTION: Exercise N` and `# END SOLUTION` becomes a stub for the student to write.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import sys
from collections.abc import Sequence

import numpy as np

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
    """Blocks that hold `num_tokens` tokens: 0 for 0, 1 for 1..block_size, 2 for block_size+1...

    This is THE boundary rule of the paged cache; every other place asks it instead of
    doing its own arithmetic. A new block is needed only when token `block_size` (0-based)
    arrives, never when the last block has just been filled.
    """
    raise NotImplementedError("Exercise 1: blocks_needed")


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Content hash of one FULL block, chained on the hash of the block before it.

    Chaining makes the hash name the whole prefix, not just this block's tokens: two
    blocks with the same tokens after different prefixes hold different K/V (attention
    saw different pasts), so they must never be confused.
    """
    raise NotImplementedError("Exercise 3: hash_block")


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

    Invariants:
    - a block is in the free queue if and only if its reference count is 0;
    - the free queue is in least-recently-freed order: `allocate` takes from the front,
      `free` appends to the back. With prefix caching on, a freed block keeps its hash and
      stays findable until `allocate` reuses it (lazy eviction, least recently used first);
    - every error leaves the allocator exactly as it was.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # An ordered dict is a queue with O(1) removal from the middle (prefix-cache revival).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._block_hash: dict[int, int] = {}  # block id -> its hash, while it is cached
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate()` can hand out now: never used, freed, or cached but unreferenced."""
        raise NotImplementedError("Exercise 1: BlockAllocator.num_free_blocks")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")

    def allocate(self) -> int:
        """A block with reference count 1, the least recently freed one.

        Raises OutOfBlocksError when the pool is empty. A block taken from the front of the
        queue may still be in the prefix cache: it is evicted now, not earlier.
        """
        raise NotImplementedError("Exercise 1: BlockAllocator.allocate")

    def incref(self, block_id: int) -> None:
        """Share a block that is in use: one more table holds it."""
        raise NotImplementedError("Exercise 1: BlockAllocator.incref")

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes to the back of the free queue."""
        raise NotImplementedError("Exercise 1: BlockAllocator.free")

    def ref_count(self, block_id: int) -> int:
        """How many tables (or prefix-cache lookups) hold this block."""
        raise NotImplementedError("Exercise 1: BlockAllocator.ref_count")

    # --- prefix caching (Exercise 3) ---------------------------------------------------

    def is_cached(self, block_id: int) -> bool:
        """Whether the prefix cache can hand this block to another sequence."""
        return block_id in self._block_hash

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block cached under this hash, without taking a reference (a peek, for planning)."""
        return self._cached.get(block_hash) if self.enable_prefix_caching else None

    def lookup(self, block_hash: int) -> int | None:
        """A prefix-cache hit: take a reference on the cached block and return it.

        A hit on an evictable block (reference count 0) revives it: it leaves the free
        queue. Returns None on a miss, or when prefix caching is off.
        """
        raise NotImplementedError("Exercise 3: BlockAllocator.lookup")

    def register(self, block_id: int, block_hash: int) -> None:
        """Make a full block findable under its chained hash (no-op when caching is off).

        If another block already holds the same prefix, the first one stays the cached copy.
        """
        raise NotImplementedError("Exercise 3: BlockAllocator.register")

    def _evict(self, block_id: int) -> None:
        """Forget a cached block's hash: it is about to hold other tokens."""
        raise NotImplementedError("Exercise 3: BlockAllocator._evict")


class BlockTable:
    """One sequence's view of the cache: token `i` lives in `block_ids[i // block_size]`
    at offset `i % block_size`.

    Invariant: a block that another table or the prefix cache can see is never written.
    Before new tokens land in such a block, the table takes a private copy and reports the
    `(src, dst)` pair, so the caller can copy the K/V data (copy-on-write).
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []
        self._block_hashes: list[int] = []  # chained hashes of the full blocks, in order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def _is_shared(self, block_id: int) -> bool:
        return self.allocator.ref_count(block_id) > 1 or self.allocator.is_cached(block_id)

    def _register_full_blocks(self) -> None:
        """Register every full block that has no hash yet (prefix caching only)."""
        if not self.allocator.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(self._block_hashes), self.num_tokens // bs):
            parent = self._block_hashes[-1] if self._block_hashes else None
            block_hash = hash_block(parent, self.token_ids[i * bs : (i + 1) * bs])
            self._block_hashes.append(block_hash)
            self.allocator.register(self.block_ids[i], block_hash)

    def append_tokens(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens, allocating a block only when the last one is full.

        Returns the copy-on-write pairs `(src, dst)` whose K/V the caller must copy before
        writing. On OutOfBlocksError nothing changes (the table asks before it acts).
        """
        raise NotImplementedError("Exercise 2: BlockTable.append_tokens")

    def allocate_prompt(self, token_ids: Sequence[int]) -> int:
        """Fill an empty table with a prompt, reusing the longest cached run of full blocks.

        Returns how many leading tokens already have K/V (`num_computed_tokens`). When the
        whole prompt is cached, the last token is still reported as not computed, so the
        step that processes it produces the logits for the first output token. (Writing
        that token's K/V again into the cached block stores the value already there.)
        On OutOfBlocksError nothing changes: cache hits taken so far are given back.
        """
        raise NotImplementedError("Exercise 3: BlockTable.allocate_prompt")

    def fork(self) -> BlockTable:
        """A second sequence that shares every block of this one (parallel sampling)."""
        raise NotImplementedError("Exercise 2: BlockTable.fork")

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; release the blocks no longer needed.

        This is how rejected speculative tokens are rolled back. A block that keeps some
        tokens stays; the next append copies it first if it is shared or cached.
        """
        raise NotImplementedError("Exercise 2: BlockTable.truncate")

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slot ids `block * block_size + offset` of positions `start..stop-1`."""
        raise NotImplementedError("Exercise 2: BlockTable.slots")

    def free(self) -> None:
        """Release every block; the table is empty afterwards."""
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
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    # GPT-2's tanh approximation; Python-float constants keep float32 arrays float32.
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _softmax(scores: np.ndarray) -> np.ndarray:
    # Subtract the row max: exp never overflows, and masked (-inf) entries become exact zeros.
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class KVCache:
    """The physical KV-cache: `.k`, `.v` of shape (n_layer, num_blocks, block_size, n_head, head_dim).

    Slot `s` of a layer is `k[layer].reshape(-1, n_head, head_dim)[s]`, i.e. block `s // block_size`,
    offset `s % block_size`: exactly what `BlockTable.slots` returns.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        shape = (config.n_layer, num_blocks, block_size, config.n_head, config.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Carry out copy-on-write: block `dst` gets `src`'s K/V in every layer."""
        if not pairs:
            return
        src, dst = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
) -> np.ndarray:
    """Decode attention through block tables: one query per sequence.

    q (B, H, D); k_cache, v_cache (num_blocks, block_size, H, D) for one layer; block_tables
    (B, max_blocks) int, entries past a sequence's blocks are padding and never read as data;
    context_lens (B,) >= 1, counting the current token (its K/V is already in the cache).
    Returns (B, H, D) in q's dtype.
    """
    raise NotImplementedError("Exercise 4: paged_attention")


class ToyTransformer:
    """GPT-2: learned positions, pre-LayerNorm blocks, fused qkv, tanh-GELU MLP, tied LM head."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray] | None = None, seed: int = 0):
        self.config = config
        self.weights = self._validated(init_gpt2_weights(config, seed) if weights is None else weights)
        w = self.weights
        self.layers = [{name.split(".", 2)[2]: w[name] for name in w if name.startswith(f"h.{i}.")}
                       for i in range(config.n_layer)]

    def _validated(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Strip a `transformer.` prefix, drop GPT-2's mask buffers, check every name and shape."""
        expected = gpt2_weight_shapes(self.config)
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
            found[key] = np.ascontiguousarray(value, dtype=np.float32)
        missing = sorted(set(expected) - set(found))
        if missing:
            raise ValueError(f"missing weight(s) {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if lm_head is not None and not np.array_equal(lm_head, found["wte.weight"]):
            raise ValueError("lm_head.weight differs from wte.weight: GPT-2's LM head is tied to the embeddings")
        return found

    # --- the building blocks ---------------------------------------------------------

    def _ln(self, x: np.ndarray, layer: dict, name: str) -> np.ndarray:
        return _layer_norm(x, layer[f"{name}.weight"], layer[f"{name}.bias"], self.config.layer_norm_epsilon)

    def _qkv(self, x: np.ndarray, layer: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(T, C) -> q, k, v each (T, H, D)."""
        qkv = self._ln(x, layer, "ln_1") @ layer["attn.c_attn.weight"] + layer["attn.c_attn.bias"]
        T, H, D = x.shape[0], self.config.n_head, self.config.head_dim
        return tuple(qkv.reshape(T, 3, H, D).transpose(1, 0, 2, 3))

    def _finish_block(self, x: np.ndarray, attn: np.ndarray, layer: dict) -> np.ndarray:
        """Residual adds around the attention output projection and the MLP."""
        x = x + attn.reshape(x.shape) @ layer["attn.c_proj.weight"] + layer["attn.c_proj.bias"]
        h = _gelu(self._ln(x, layer, "ln_2") @ layer["mlp.c_fc.weight"] + layer["mlp.c_fc.bias"])
        return x + h @ layer["mlp.c_proj.weight"] + layer["mlp.c_proj.bias"]

    def _embed(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self.weights["wte.weight"][token_ids] + self.weights["wpe.weight"][positions]

    def _logits(self, x: np.ndarray) -> np.ndarray:
        w = self.weights
        return _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], self.config.layer_norm_epsilon) @ w["wte.weight"].T

    def _check_tokens(self, token_ids: np.ndarray, positions_end: int) -> None:
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_size - 1}")
        if positions_end > self.config.n_positions:
            raise ValueError(f"position {positions_end - 1} is beyond n_positions={self.config.n_positions}")

    # --- the reference path ----------------------------------------------------------

    def forward_dense(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits (T, vocab_size) for every position, with plain causal attention and no cache."""
        token_ids = np.asarray(token_ids, dtype=np.int64)
        T = len(token_ids)
        if T == 0:
            raise ValueError("forward_dense needs at least one token")
        self._check_tokens(token_ids, T)
        x = self._embed(token_ids, np.arange(T))
        causal = np.tril(np.ones((T, T), dtype=bool))
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        for layer in self.layers:
            q, k, v = self._qkv(x, layer)
            scores = np.einsum("qhd,khd->hqk", q, k) * scale
            probs = _softmax(np.where(causal, scores, -np.inf))
            x = self._finish_block(x, np.einsum("hqk,khd->qhd", probs, v), layer)
        return self._logits(x)

    # --- the serving path ------------------------------------------------------------

    def forward(
        self,
        kv_cache: KVCache,
        block_tables: Sequence[BlockTable],
        start_positions: Sequence[int],
        num_tokens: Sequence[int],
    ) -> np.ndarray:
        """One engine step over a batch that mixes prefill chunks and decode tokens.

        Sequence i contributes `block_tables[i].token_ids[start_i : start_i + n_i]`; the K/V of its
        positions before `start_i` must already be in `kv_cache`. Each new token's K/V is written
        into its slot before attention reads it. Returns logits (sum(num_tokens), vocab_size) for
        every processed token, in batch order.
        """
        batch = _PagedBatch(self.config, block_tables, start_positions, num_tokens)
        x = self._embed(batch.token_ids, batch.positions)
        scale = np.float32(1.0 / math.sqrt(self.config.head_dim))
        H, D = self.config.n_head, self.config.head_dim
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            k_flat = kv_cache.k[i].reshape(-1, H, D)  # views: slot-addressed
            v_flat = kv_cache.v[i].reshape(-1, H, D)
            k_flat[batch.slots] = k
            v_flat[batch.slots] = v
            attn = np.empty_like(q)
            if batch.decode_rows.size:
                attn[batch.decode_rows] = paged_attention(
                    q[batch.decode_rows], kv_cache.k[i], kv_cache.v[i], batch.decode_tables, batch.decode_lens)
            for rows, context_slots, mask in batch.prefills:
                scores = np.einsum("qhd,khd->hqk", q[rows], k_flat[context_slots]) * scale
                probs = _softmax(np.where(mask, scores, -np.inf))
                attn[rows] = np.einsum("hqk,khd->qhd", probs, v_flat[context_slots])
            x = self._finish_block(x, attn, layer)
        return self._logits(x)


class _PagedBatch:
    """The flat layout of one step, computed once and shared by every layer.

    Decode rows (one new token) go through `paged_attention` together; a prefill chunk of n
    tokens starting at position s attends over slots 0..s+n-1 with a causal mask in which
    query j (position s+j) sees keys 0..s+j.
    """

    def __init__(self, config: ModelConfig, block_tables, start_positions, num_tokens):
        if not (len(block_tables) == len(start_positions) == len(num_tokens)) or not block_tables:
            raise ValueError("forward needs one start position and one token count per block table")
        tokens, positions, slots, decode = [], [], [], []
        self.prefills = []
        row = 0
        for table, start, n in zip(block_tables, start_positions, num_tokens):
            stop = start + n
            if n < 1 or start < 0 or stop > table.num_tokens:
                raise ValueError(f"cannot process positions {start}..{stop - 1} of a sequence of {table.num_tokens} tokens")
            if stop > config.n_positions:
                raise ValueError(f"position {stop - 1} is beyond n_positions={config.n_positions}")
            tokens.append(table.token_ids[start:stop])
            positions.append(np.arange(start, stop))
            slots.append(table.slots(start, stop))
            if n == 1:
                decode.append((row, table, stop))
            else:
                mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]
                self.prefills.append((slice(row, row + n), table.slots(0, stop), mask))
            row += n
        self.token_ids = np.concatenate(tokens).astype(np.int64)
        if self.token_ids.min() < 0 or self.token_ids.max() >= config.vocab_size:
            raise ValueError(f"token ids must be in 0..{config.vocab_size - 1}")
        self.positions = np.concatenate(positions)
        self.slots = np.concatenate(slots)
        self.decode_rows = np.array([r for r, _, _ in decode], dtype=np.int64)
        width = max((len(t.block_ids) for _, t, _ in decode), default=0)
        self.decode_tables = np.zeros((len(decode), width), dtype=np.int64)
        for j, (_, table, _) in enumerate(decode):
            self.decode_tables[j, : len(table.block_ids)] = table.block_ids
        self.decode_lens = np.array([stop for _, _, stop in decode], dtype=np.int64)


# =====================================================================================
# 6. The command line
# =====================================================================================

EXERCISES = {
    1: "blocks and the allocator: blocks_needed, BlockAllocator",
    2: "the block table: BlockTable.append_tokens / fork / truncate / slots / free",
    3: "prefix caching: hash_block, lookup / register, allocate_prompt",
    4: "paged attention: paged_attention",
    5: "continuous batching: Scheduler.schedule",
    6: "speculative sampling: residual_distribution, accept_or_resample",
    7: "speculative generation: speculative_generate",
    8: "capacity planning: plan_deployment",
}


def unsolved_exercises(module_name: str | None = None) -> dict[int, list[str]]:
    """Exercise number -> the functions still stubbed in a module's source (empty when all are done)."""
    import inspect
    import re

    source = inspect.getsource(sys.modules[module_name or __name__])
    stubs: dict[int, list[str]] = {}
    for number, name in re.findall(r'raise NotImplementedError\("Exercise (\d+): ([\w.]+)"\)', source):
        stubs.setdefault(int(number), []).append(name)
    return stubs


def print_status() -> None:
    stubs = unsolved_exercises()
    import os

    print(f"{os.path.basename(sys.modules[__name__].__file__)}: the inference-serving lab")
    for number, title in EXERCISES.items():
        state = "to do: " + ", ".join(stubs[number]) if number in stubs else "done"
        print(f"  Exercise {number}  {title:<75} {state}")


def main(argv: list[str] | None = None) -> int:
    print_status()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
