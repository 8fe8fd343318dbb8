"""Quiz 4: paged attention (Exercise 4), every answer computed by the module under quiz."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from .questions import Question, ceil_div, fmt, question

STALE = 99.0


def _attention_one(lab: ModuleType, rng: np.random.Generator, scores, values, block_size: int):
    """paged_attention of one query over tokens with these scores (head_dim 1, q = 1) and values,
    stored in shuffled blocks, with STALE in every other slot and -1 padding in the table."""
    L = len(scores)
    used = ceil_div(L, block_size)
    num_blocks = used + 4
    ids = [int(b) for b in rng.permutation(num_blocks)[:used]]
    k_cache = np.full((num_blocks, block_size, 1, 1), STALE, np.float32)
    v_cache = np.full((num_blocks, block_size, 1, 1), STALE, np.float32)
    for t in range(L):
        k_cache[ids[t // block_size], t % block_size] = scores[t]
        v_cache[ids[t // block_size], t % block_size] = values[t]
    table = np.array([ids + [-1]], dtype=np.int64)
    out = lab.paged_attention(np.ones((1, 1, 1), np.float32), k_cache, v_cache, table, np.array([L]))
    return float(np.asarray(out).reshape(-1)[0]), ids


def quiz_paged_attention(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    B = int(rng.choice([2, 3, 4]))
    L = B * int(rng.integers(1, 3)) + int(rng.integers(1, B))
    values = [int(v) for v in rng.integers(1, 10, L)]
    out, ids = _attention_one(lab, rng, [0.0] * L, values, B)
    q1 = question(
        f"One sequence, one head, head_dim 1, block size {B}. Its {L} tokens live in blocks {ids} (its table "
        f"row is {ids + [-1]}: -1 is padding). Every token's score q.k/sqrt(D) is 0; their values v are "
        f"{values}. Every other slot of the cache, the rest of its last block included, holds {STALE:g}. "
        f"What does paged_attention return?", out, sum(values) / L,
        f"Equal scores give every token the weight 1/{L}: the mean of the values, {sum(values)} / {L} = "
        f"{fmt(sum(values) / L)}. The slots after token {L - 1} in its last block and the padding entry are "
        f"masked by position: read as data they would pull the mean towards {STALE:g}.", tolerance=0.01)

    B = 2
    weights = [int(w) for w in rng.integers(1, 5, int(rng.integers(3, 6)))]
    values = [int(v) for v in rng.integers(1, 10, len(weights))]
    out, ids = _attention_one(lab, rng, [math.log(w) for w in weights], values, B)
    names = ", ".join(f"ln {w}" for w in weights)
    ours = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    q2 = question(
        f"The same set-up, block size {B}: {len(weights)} tokens in blocks {ids}, with scores {names} (so "
        f"exp(score) = {', '.join(map(str, weights))}) and values v = {values}. What does paged_attention "
        f"return?", out, ours,
        f"softmax weights exp(s_i) / sum exp(s) = {weights} / {sum(weights)}; the output is "
        f"sum w_i v_i / sum w_i = {sum(w * v for w, v in zip(weights, values))} / {sum(weights)} = {fmt(ours)}. "
        f"The kernel gets there one block at a time: a running max, a running sum of exp(s - max) and an "
        f"accumulator, both rescaled by exp(old max - new max) whenever the max grows.", tolerance=0.01)

    B = int(rng.choice([4, 8, 16]))
    lens = [int(x) for x in rng.integers(1, 6 * B, 3)]
    used = sum(lab.blocks_needed(x, B) for x in lens)
    ours = sum(ceil_div(x, B) for x in lens)
    width = max(ceil_div(x, B) for x in lens)
    q3 = question(
        f"A decode batch of 3 sequences with context lengths {lens}, block size {B}: the block tables are padded "
        f"to {width} columns. How many table entries does the kernel read as block ids (the rest is padding it "
        f"must never use)?", used, ours,
        f"Each sequence uses blocks_needed(len, {B}) entries: "
        f"{' + '.join(str(ceil_div(x, B)) for x in lens)} = {ours} of {3 * width}. Past the last token of each "
        f"last block, {sum(ceil_div(x, B) * B - x for x in lens)} stale slots in all are masked by position "
        f"too.")
    return [q1, q2, q3]
