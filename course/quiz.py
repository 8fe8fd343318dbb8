"""`python lab.py quiz N`: questions with numeric answers about Exercise N, with figures drawn
fresh each run (`--seed` repeats them).

Every right answer is computed by the module the quiz was handed, at the moment it asks: a
student's quiz is answered by the student's own `blocks_needed`, `BlockTable`, scheduler,
`plan_deployment`... (and by the provided code around them). So the quiz checks the student's
understanding against the student's code; it is not the test suite, and a wrong function gives a
wrong "right answer". To make that visible, each question also carries the value its explanation
derives by hand, and the quiz says so when the module disagrees with it.

All answers are computed before the first question is asked: a stub the quiz needs stops it at
once (NotImplementedError, which the command line turns into "write it first", exit 1), and any
other exception from the module is a QuizError (exit 1). EOF on stdin ends the quiz cleanly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Callable
from fractions import Fraction
from types import ModuleType

import numpy as np

from loadtest.costmodel import has_profile, measured_step_cost, roofline_step_cost


class QuizError(Exception):
    """The module's code failed (not a stub) while the quiz computed its answers."""


@dataclasses.dataclass
class Question:
    text: str
    answer: float               # computed by the module under quiz
    expected: float | None      # what the explanation derives by hand (None: nothing to compare)
    explanation: str
    whole: bool = True          # a whole number, checked exactly
    tolerance: float = 0.0      # absolute, for the other answers
    within: str = ""            # the tolerance as the question states it: "0.01", "1%"


def _question(text: str, answer, expected, explanation: str, tolerance: float = 0.0, relative: bool = False):
    """A Question with the answer as a Python number; `relative`: tolerance is a fraction of it."""
    whole = tolerance == 0.0
    if isinstance(answer, (np.integer, np.floating)):
        answer = answer.item()
    if not (isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer)):
        raise QuizError(f"the module computed {answer!r} for a question that needs a finite number")
    if whole and answer != int(answer):
        raise QuizError(f"the module computed {answer!r} where a whole number is expected")
    answer = int(answer) if whole else float(answer)
    within = "" if whole else f"{tolerance:.0%}" if relative else f"{tolerance:g}"
    if relative:
        tolerance *= abs(answer)
    return Question(text, answer, expected, explanation, whole, tolerance, within)


def _fmt(x: float) -> str:
    if float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.4g}" if abs(x) >= 1e-3 else f"{x:.3g}"


def _list(values) -> str:
    return "[" + ", ".join(_fmt(float(v)) for v in values) + "]"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _n(count: int, word: str) -> str:
    """'1 block', '3 blocks'."""
    return f"{count} {word}{'' if count == 1 else 's'}"


# --- Exercise 1: blocks and the allocator -------------------------------------------------


def quiz_blocks(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    B = int(rng.choice([4, 8, 16, 32]))
    n = B * int(rng.integers(1, 6)) + int(rng.choice([-1, 0, 1]))
    blocks = lab.blocks_needed(n, B)
    ours = _ceil_div(n, B)
    q1 = _question(
        f"A prompt of {n} tokens, block size {B}: how many KV blocks does it occupy?", blocks, ours,
        f"blocks_needed({n}, {B}) = ceil({n} / {B}) = {ours}: block j holds tokens {B}j to {B}j + {B - 1} "
        f"(0-based), so the last token, number {n - 1}, is in block {(n - 1) // B}. A new block opens when "
        f"token {B}j arrives, not when the block before it has just filled.")
    empty = blocks * B - n
    q2 = _question(
        "...and how many of those blocks' slots stand empty?", empty, ours * B - n,
        f"{ours} blocks hold {ours * B} slots and {n} are used: {ours * B - n} empty, all in the last block. "
        f"Paging wastes less than one block per sequence; a slab reserved for max_model_len tokens wastes "
        f"everything the request never uses.")
    N = int(rng.integers(6, 13))
    a = int(rng.integers(3, N))
    s = int(rng.integers(1, a))
    pool = lab.BlockAllocator(N, B)
    ids = [pool.allocate() for _ in range(a)]
    for block in ids[:s]:
        pool.incref(block)
    for block in ids:
        pool.free(block)
    q3 = _question(
        f"A pool of {N} blocks. One table allocates {a} blocks and shares {s} of them with a second table "
        f"(incref); then the first table frees all {a}. How many blocks does num_free_blocks report now?",
        pool.num_free_blocks, N - s,
        f"A block goes back to the pool only when its reference count falls to 0: of the {a}, the {s} shared "
        f"still hold one reference each (the second table's), the rest ({a - s}) went back: {N} - {s} = "
        f"{N - s} free.")
    return [q1, q2, q3]


# --- Exercise 2: the block table ------------------------------------------------------------


def quiz_block_table(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    B = int(rng.choice([4, 8, 16]))
    n = B * int(rng.integers(1, 4))
    if rng.random() < 0.5:
        n -= int(rng.integers(1, B))
    pool = lab.BlockAllocator(64, B)
    table = lab.BlockTable(pool)
    table.append_tokens([7] * n)
    before = pool.num_free_blocks
    table.append_tokens([7])
    full = n % B == 0
    q1 = _question(
        f"A block table (block size {B}) holds {n} tokens. One more token is appended: how many new blocks "
        f"does the pool hand out?", before - pool.num_free_blocks, int(full),
        f"{n} tokens fill {_n(_ceil_div(n, B), 'block')}, the last with {n - (_ceil_div(n, B) - 1) * B} of {B} slots "
        + ("used: it is full, so token number " + str(n) + " opens a new block (1)." if full else
           "used: it has room, so the token goes there (0 new blocks).")
        + " A block taken one token early wastes a block per sequence; one taken late writes past the table's "
          "end, into another sequence's block.")

    pool = lab.BlockAllocator(16, B)
    taken = [pool.allocate() for _ in range(16)]
    for block in rng.permutation(taken)[: int(rng.integers(4, 9))]:  # the table gets these, in this order
        pool.free(int(block))
    m = int(rng.integers(2 * B + 1, 4 * B))
    table = lab.BlockTable(pool)
    table.append_tokens([7] * m)
    i = int(rng.integers(B, m))
    ids = [int(b) for b in table.block_ids]
    ours = ids[i // B] * B + i % B if i // B < len(ids) else None
    q2 = _question(
        f"A sequence of {m} tokens has the block table {ids} (block size {B}). Which physical slot "
        f"(block * block_size + offset) holds its token {i} (0-based)?",
        int(table.slots(i, i + 1)[0]), ours,
        f"Token {i} is in logical block {i} // {B} = {i // B}, at offset {i} % {B} = {i % B}; the table maps "
        f"logical block {i // B} to physical block {ids[i // B] if ours is not None else '?'}: slot "
        f"{ids[i // B] if ours is not None else '?'} * {B} + {i % B} = {ours}.")

    pool = lab.BlockAllocator(32, B)
    n = B * int(rng.integers(1, 4)) + (int(rng.integers(1, B)) if rng.random() < 0.75 else 0)
    parent = lab.BlockTable(pool)
    parent.append_tokens([7] * n)
    child = parent.fork()
    extra = int(rng.integers(1, B + 2))
    child.append_tokens([8] * extra)
    p, copy = _ceil_div(n, B), int(n % B != 0)
    grown = _ceil_div(n + extra, B) - p
    q3 = _question(
        f"A table of {n} tokens (block size {B}) is forked (parallel sampling), and the fork appends "
        f"{_n(extra, 'token')}. How many distinct blocks are in use now, both tables together?",
        pool.num_blocks - pool.num_free_blocks, p + copy + grown,
        f"The fork shares {'its' if p == 1 else 'all'} {_n(p, 'block')} (reference count 2). "
        + ("Its last block has room but is shared, so before writing into it the fork takes a private copy "
           "(copy-on-write: 1 block), " if copy else "Its last block is full, so nothing is copied, ")
        + f"then blocks_needed({n + extra}, {B}) - {p} = {grown} new: {p} + {copy} + {grown} = "
          f"{p + copy + grown}.")

    n = int(rng.integers(2 * B + 1, 5 * B))
    keep = int(rng.integers(1, n))
    table = lab.BlockTable(lab.BlockAllocator(16, B))
    table.append_tokens([7] * n)
    table.truncate(keep)
    q4 = _question(
        f"A table holds {n} tokens in blocks of {B} and is truncated to {keep} tokens (rejected speculative "
        f"tokens rolled back). How many blocks does it keep?", len(table.block_ids), _ceil_div(keep, B),
        f"It keeps blocks_needed({keep}, {B}) = {_ceil_div(keep, B)} of its {_ceil_div(n, B)} and frees the "
        f"rest, the last first; a kept block that is now partly full loses its hash, and is copied before the "
        f"next write if it is shared.")
    return [q1, q2, q3, q4]


# --- Exercise 3: prefix caching ---------------------------------------------------------------


def quiz_prefix_cache(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    B = int(rng.choice([4, 8]))
    pool = lab.BlockAllocator(64, B, enable_prefix_caching=True)
    n_a = B * int(rng.integers(3, 6)) + int(rng.integers(0, B))
    prompt_a = [int(t) for t in rng.integers(0, 1000, n_a)]
    first = lab.BlockTable(pool)
    first.allocate_prompt(prompt_a)
    first.cache_full_blocks(n_a)  # as the engine does after the forward pass
    shared = int(rng.integers(B, n_a))
    prompt_b = prompt_a[:shared] + [int(t) for t in rng.integers(1000, 2000, int(rng.integers(1, 2 * B)))]
    second = lab.BlockTable(pool)
    q1 = _question(
        f"Request A's {n_a}-token prompt has run, and its full blocks are cached (block size {B}). Request B's "
        f"prompt has {len(prompt_b)} tokens: the first {shared} are A's, the rest differ. How many of B's "
        f"tokens does allocate_prompt find already computed?",
        second.allocate_prompt(prompt_b), shared // B * B,
        f"A block is found by a hash chained on its whole prefix. B's first {_n(shared // B, 'full block')} hold "
        f"exactly A's tokens from the start, so their hashes match: {shared // B} x {B} = {shared // B * B} "
        f"tokens. Block {shared // B} mixes shared and new tokens; its hash differs, and so does every later "
        f"block's, since each chains on the one before.")

    pool = lab.BlockAllocator(64, B, enable_prefix_caching=True)
    k = int(rng.integers(2, 6))
    n = k * B if rng.random() < 0.6 else k * B + int(rng.integers(1, B))
    prompt = [int(t) for t in rng.integers(0, 1000, n)]
    first = lab.BlockTable(pool)
    first.allocate_prompt(prompt)
    first.cache_full_blocks(n)
    ours = n - B if n % B == 0 else n // B * B
    q2 = _question(
        f"A prompt of {n} tokens (block size {B}) has run and its full blocks are cached. The very same prompt "
        f"arrives again: how many of its tokens does allocate_prompt report already computed?",
        lab.BlockTable(pool).allocate_prompt(prompt), ours,
        (f"All {k} blocks are cached, but they cover the whole prompt: the last one is left out and recomputed "
         f"into a private block ({n} - {B} = {ours}). The last token must run anyway (its logits give the first "
         f"output token), and a block other requests read is never written."
         if n % B == 0 else
         f"Its {n // B} full blocks are cached ({ours} tokens); the partial last block ({n % B} tokens) never "
         f"had a hash (only full blocks are registered), so it is computed again."))

    N = int(rng.integers(8, 17))
    n = int(rng.integers(B + 1, min(N * B, 6 * B)))
    pool = lab.BlockAllocator(N, B, enable_prefix_caching=True)
    table = lab.BlockTable(pool)
    table.allocate_prompt([int(t) for t in rng.integers(0, 1000, n)])
    table.cache_full_blocks(n)
    table.free()
    q3 = _question(
        f"A pool of {N} blocks of {B} tokens, prefix caching on. A request of {n} tokens runs, its full blocks are "
        f"cached, and it finishes (its table frees every block). How many blocks can the prefix cache still "
        f"find?", sum(bool(pool.is_cached(b)) for b in range(N)), n // B,
        f"Freeing a cached block does not forget it: at reference count 0 it waits in the evictable queue, "
        f"still findable, until allocate needs it and no plain free block is left (lazy LRU eviction). "
        f"{'Its one full block was' if n // B == 1 else f'Its {n // B} full blocks were'} registered"
        f"{'; the partial last block was not.' if n % B else '.'}")
    q4 = _question(
        "...and how many blocks does num_free_blocks report?", pool.num_free_blocks, N,
        f"All {N}: an evictable block is free too (allocate can hand it out at once, evicting it then); the "
        f"cache only decides which free blocks go last.")
    return [q1, q2, q3, q4, *_quiz_tenant_salts(lab, rng, B)]


def _quiz_tenant_salts(lab: ModuleType, rng: np.random.Generator, B: int) -> list[Question]:
    """What a per-tenant cache salt costs (`python solution.py attack prefix-cache` measures why it is needed)."""
    T = int(rng.integers(3, 6))
    S = B * int(rng.integers(2, 5)) + int(rng.integers(0, B))
    q = int(rng.integers(1, B + 1))
    public = [int(t) for t in rng.integers(0, 1000, S)]
    prompts = [public + [int(t) for t in rng.integers(1000 * (i + 2), 1000 * (i + 3), q)] for i in range(T)]

    def prefilled(salted: bool) -> int:
        pool = lab.BlockAllocator(4 * T * _ceil_div(S + q, B), B, enable_prefix_caching=True)
        total = 0
        for i, prompt in enumerate(prompts):  # one after another: each runs before the next arrives
            table = lab.BlockTable(pool, f"tenant-{i}") if salted else lab.BlockTable(pool)
            total += len(prompt) - table.allocate_prompt(prompt)
            table.cache_full_blocks(len(prompt))
        return total

    shared_blocks = S // B
    shared = T * (S + q) - (T - 1) * shared_blocks * B
    q5 = _question(
        f"{T} tenants each send one request, one after another: the same {S}-token public system prompt, then a "
        f"question of {q} tokens of their own (block size {B}, prefix caching on, one shared cache). How many "
        f"prompt tokens are prefilled in all?", prefilled(False), shared,
        f"The first request prefills all {S + q} tokens; each of the other {T - 1} finds the public prompt's "
        f"{_n(shared_blocks, 'full block')} ({shared_blocks * B} tokens) cached and prefills the rest: "
        f"{T} x {S + q} - {T - 1} x {shared_blocks * B} = {shared}. "
        + (f"The block holding the prompt's last {S % B} tokens also holds a question's: it differs per tenant."
           if S % B else "The question starts a block of its own."))
    q6 = _question(
        "...and with a cache salt per tenant (derived by the server from each tenant's API key)?",
        prefilled(True), T * (S + q),
        f"All {T} x {S + q} = {T * (S + q)}: the salt is in every block's hash, so no tenant finds another's "
        f"blocks, and {T - 1} x {shared_blocks * B} = {(T - 1) * shared_blocks * B} more tokens are prefilled. "
        f"That is the whole cost: the same attacker who could time a hit on the public prompt could time a hit "
        f"on a private one, so the salt closes the channel by giving up exactly the sharing across tenants. "
        f"Requests of one tenant still share (same salt).")
    return [q5, q6]


# --- Exercise 4: paged attention ---------------------------------------------------------------


STALE = 99.0


def _attention_one(lab: ModuleType, rng: np.random.Generator, scores, values, block_size: int):
    """paged_attention of one query over tokens with these scores (head_dim 1, q = 1) and values,
    stored in shuffled blocks, with STALE in every other slot and -1 padding in the table."""
    L = len(scores)
    used = _ceil_div(L, block_size)
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
    q1 = _question(
        f"One sequence, one head, head_dim 1, block size {B}. Its {L} tokens live in blocks {ids} (its table "
        f"row is {ids + [-1]}: -1 is padding). Every token's score q.k/sqrt(D) is 0; their values v are "
        f"{values}. Every other slot of the cache, the rest of its last block included, holds {STALE:g}. "
        f"What does paged_attention return?", out, sum(values) / L,
        f"Equal scores give every token the weight 1/{L}: the mean of the values, {sum(values)} / {L} = "
        f"{_fmt(sum(values) / L)}. The slots after token {L - 1} in its last block and the padding entry are "
        f"masked by position: read as data they would pull the mean towards {STALE:g}.", tolerance=0.01)

    B = 2
    weights = [int(w) for w in rng.integers(1, 5, int(rng.integers(3, 6)))]
    values = [int(v) for v in rng.integers(1, 10, len(weights))]
    out, ids = _attention_one(lab, rng, [math.log(w) for w in weights], values, B)
    names = ", ".join(f"ln {w}" for w in weights)
    ours = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    q2 = _question(
        f"The same set-up, block size {B}: {len(weights)} tokens in blocks {ids}, with scores {names} (so "
        f"exp(score) = {', '.join(map(str, weights))}) and values v = {values}. What does paged_attention "
        f"return?", out, ours,
        f"softmax weights exp(s_i) / sum exp(s) = {weights} / {sum(weights)}; the output is "
        f"sum w_i v_i / sum w_i = {sum(w * v for w, v in zip(weights, values))} / {sum(weights)} = {_fmt(ours)}. "
        f"The kernel gets there one block at a time: a running max, a running sum of exp(s - max) and an "
        f"accumulator, both rescaled by exp(old max - new max) whenever the max grows.", tolerance=0.01)

    B = int(rng.choice([4, 8, 16]))
    lens = [int(x) for x in rng.integers(1, 6 * B, 3)]
    used = sum(lab.blocks_needed(x, B) for x in lens)
    ours = sum(_ceil_div(x, B) for x in lens)
    width = max(_ceil_div(x, B) for x in lens)
    q3 = _question(
        f"A decode batch of 3 sequences with context lengths {lens}, block size {B}: the block tables are padded "
        f"to {width} columns. How many table entries does the kernel read as block ids (the rest is padding it "
        f"must never use)?", used, ours,
        f"Each sequence uses blocks_needed(len, {B}) entries: "
        f"{' + '.join(str(_ceil_div(x, B)) for x in lens)} = {ours} of {3 * width}. Past the last token of each "
        f"last block, {sum(_ceil_div(x, B) * B - x for x in lens)} stale slots in all are masked by position "
        f"too.")
    return [q1, q2, q3]


# --- Exercise 5: continuous batching ------------------------------------------------------------


MAX_STEPS = 1000


@dataclasses.dataclass
class _StepRun:
    num_steps: int
    first_token_step: dict[str, int]  # request id -> the step (1-based) that sampled its first token


def _run_steps(lab: ModuleType, requests: list[tuple[int, int]], scheduling: str, max_num_seqs: int,
               max_num_batched_tokens: int = 512) -> _StepRun:
    """Drive the module's scheduler, with no model, over requests (prompt_len, output_len) that all
    arrive at step 0 (as loadtest/simulator.py does, without a clock), at most MAX_STEPS steps."""
    pool = lab.BlockAllocator(64, 16)
    scheduler = lab.make_scheduler(scheduling, pool, max_num_seqs, max_num_batched_tokens, True)
    for i, (prompt_len, output_len) in enumerate(requests):
        scheduler.add_request(lab.Request(str(i), [0] * prompt_len, lab.SamplingParams(max_tokens=output_len)))
    first: dict[str, int] = {}
    for step in range(1, MAX_STEPS + 1):
        if not scheduler.has_unfinished():
            return _StepRun(step - 1, first)
        plan = scheduler.plan_step()
        sampled = {seq.request_id: 0 for seq in plan.scheduled if plan.completes(seq)}
        scheduler.update(plan, sampled)
        for request_id in sampled:
            first.setdefault(request_id, step)
    raise QuizError(f"the {scheduling} scheduler had not finished {len(requests)} short requests after "
                    f"{MAX_STEPS} steps")


def quiz_batching(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    P = int(rng.integers(2, 9))
    a, b, c = int(rng.integers(12, 41)), int(rng.integers(3, 10)), int(rng.integers(3, 13))  # a > b
    runs = {s: _run_steps(lab, [(P, a), (P, b), (P, c)], s, max_num_seqs=2) for s in ("continuous", "static")}
    setting = (f"2 seats (max_num_seqs 2). Three requests arrive together, each with a {P}-token prompt; they "
               f"want {a}, {b} and {c} output tokens. A request's first step prefills its prompt and yields its "
               f"first token, then it gets one token per step.")
    q1 = _question(
        f"{setting} Static batching (a batch runs until ALL its requests finish): how many steps until all "
        f"three are done?", runs["static"].num_steps, max(a, b) + c,
        f"Requests 1 and 2 form the first batch, which lasts max({a}, {b}) = {max(a, b)} steps: request 2's seat "
        f"idles for {max(a, b) - min(a, b)} steps while request 3 waits (head-of-line blocking). Then request 3 "
        f"alone: {c} steps. "
        f"{max(a, b)} + {c} = {max(a, b) + c}.")
    q2 = _question(
        "The same three requests with continuous batching: how many steps?", runs["continuous"].num_steps,
        max(a, b + c),
        f"Request 2 finishes at step {b} and frees its seat in that very step; request 3 takes it at step "
        f"{b + 1} and finishes at step {b + c}, while request 1 runs to step {a}: max({a}, {b} + {c}) = "
        f"{max(a, b + c)}. Same tokens in fewer steps: a decode step reads all the weights whatever the batch, "
        f"so seats kept full are throughput.")
    static_ttft = runs["static"].first_token_step.get("2", 0)
    q3 = _question(
        "Under static batching, what is request 3's TTFT in steps (from its arrival, step 0, to the step that "
        "yields its first token)?", static_ttft, max(a, b) + 1,
        f"It waits for the whole first batch ({max(a, b)} steps), then its prefill step yields its first token: "
        f"{max(a, b) + 1}. With continuous batching it is {runs['continuous'].first_token_step.get('2', '?')} "
        f"(its prefill runs at step {b + 1}): continuous batching moves TTFT most; the decode steps (TPOT) are "
        f"what the batch size and speculative decoding move.")
    T = int(rng.choice([16, 32, 64]))
    n = int(rng.integers(2 * T + 1, 5 * T))
    lone = _run_steps(lab, [(n, 2)], "continuous", max_num_seqs=2, max_num_batched_tokens=T)
    q4 = _question(
        f"A lone request with a {n}-token prompt; the token budget is {T} tokens per step "
        f"(max_num_batched_tokens), chunked prefill on. In which step does its first token come out (its TTFT "
        f"in steps)?", lone.first_token_step.get("0", 0), _ceil_div(n, T),
        f"Each step gives it min(tokens still missing K/V, budget left) = at most {T}: ceil({n} / {T}) = "
        f"{_ceil_div(n, T)} chunks, and only the chunk that reaches the prompt's last token samples. Chunking "
        f"bounds how long one long prompt holds up everyone else's decode steps.")
    return [q1, q2, q3, q4]


# --- Exercise 6: speculative sampling -------------------------------------------------------------


class _FixedDraws(np.random.Generator):
    """A Generator whose `random()` is always `u` and whose `choice` always returns token 0: it
    finds out whether accept_or_resample keeps a draft at a given uniform."""

    def __init__(self, u: float):
        super().__init__(np.random.PCG64(0))
        self.u = u

    def random(self, *args, **kwargs):
        return self.u

    def choice(self, *args, **kwargs):
        return np.int64(0)


def _acceptance_probability(lab: ModuleType, x: int, p: np.ndarray, q: np.ndarray) -> float:
    """The u below which the module's accept_or_resample keeps draft x (k = 1), by bisection."""
    target = np.stack([p, p])

    def kept(u: float) -> bool:
        return len(lab.accept_or_resample([x], q[None, :], target, _FixedDraws(u))) == 2

    low, high = 0.0, 1.0 - 2.0 ** -53
    if not kept(low):
        return 0.0
    if kept(high):
        return 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if kept(mid) else (low, mid)
    return low


def _twentieths(rng: np.random.Generator, n: int) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, 20), n - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [20]])) / 20


def quiz_speculative_sampling(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    p = q = _twentieths(rng, 4)
    while np.allclose(p, q):
        q = _twentieths(rng, 4)
    x = int(rng.choice(np.flatnonzero(q > p)))
    y = int(rng.choice(np.flatnonzero(p > q)))
    z = int(rng.integers(0, 4))
    rows = f"The target's distribution is p = {_list(p)} and the draft's q = {_list(q)}, over tokens 0-3."
    residual = np.maximum(p - q, 0)
    q1 = _question(
        f"{rows} The draft proposed token {x}: with what probability is it accepted?",
        _acceptance_probability(lab, x, p, q), min(1.0, p[x] / q[x]),
        f"min(1, p({x}) / q({x})) = min(1, {_fmt(p[x])} / {_fmt(q[x])}) = {_fmt(min(1.0, p[x] / q[x]))}: the "
        f"draft proposes {x} more often than the target would emit it, so only that fraction of its proposals "
        f"is kept, and {x} comes out q({x}) x {_fmt(p[x] / q[x])} = p({x}) of the time from accepts.",
        tolerance=0.01)
    alpha = float(np.minimum(p, q).sum())
    q2 = _question(
        "With what probability is the draft's token accepted, whatever it is (alpha)?",
        lab.acceptance_rate(p, q), alpha,
        f"alpha = sum over x of q(x) min(1, p(x)/q(x)) = sum min(p, q) = {_fmt(alpha)}: one minus the total "
        f"variation distance between p and q.", tolerance=0.01)
    q3 = _question(
        f"A draft token was rejected. With what probability is token {y} the one drawn in its place?",
        lab.residual_distribution(p, q)[y], residual[y] / residual.sum(),
        f"The residual is max(0, p - q) normalised: {_list(residual)} / {_fmt(residual.sum())}, so token {y} "
        f"gets {_fmt(residual[y])} / {_fmt(residual.sum())} = {_fmt(residual[y] / residual.sum())}. Its total "
        f"{_fmt(residual.sum())} = 1 - alpha is exactly the probability of a rejection.", tolerance=0.01)
    q4 = _question(
        f"Over every draw (draft from q, then accept or resample), with what probability is the step's first "
        f"token {z}?", lab.speculative_output_distribution(p, q)[z], p[z],
        f"p({z}) = {_fmt(p[z])}, whatever q: accepts give min(p, q) and rejections (1 - alpha) x residual = "
        f"max(0, p - q); min(p, q) + max(0, p - q) = p. That is why speculative decoding changes the speed, "
        f"never the distribution.", tolerance=0.01)
    return [q1, q2, q3, q4]


# --- Exercise 7: speculative generation ----------------------------------------------------------


def quiz_speculative_generation(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    model = lab.ToyTransformer(lab.ModelConfig(), seed=int(rng.integers(0, 1000)))
    k, m = int(rng.integers(2, 6)), int(rng.integers(8, 21))
    prompt = [int(t) for t in rng.integers(0, model.config.vocab_size, int(rng.integers(3, 9)))]
    out = lab.speculative_generate(model, model, prompt, lab.SamplingParams(max_tokens=m), k=k)
    q1 = _question(
        f"Greedy speculative decoding whose draft always agrees with the target (the draft IS the target: "
        f"alpha = 1), k = {k} drafts per round, max_tokens = {m}. How many target passes (rounds) does it take?",
        out.num_target_passes, _ceil_div(m, k + 1),
        f"Every round keeps its drafts and adds the bonus token from the same pass: {k + 1} tokens a round, "
        f"and the last round drafts only what is still wanted. ceil({m} / {k + 1}) = {_ceil_div(m, k + 1)} "
        f"passes instead of {m}: fewer sequential target steps is what lowers TPOT.")
    alpha = float(rng.choice([0.6, 0.7, 0.8, 0.9]))
    k = int(rng.integers(2, 9))
    c = float(rng.choice([0.05, 0.1, 0.2]))
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    q2 = _question(
        f"A draft with acceptance rate alpha = {alpha:g} and k = {k}: how many tokens does one target pass "
        f"emit on average?", lab.expected_tokens_per_step(alpha, k), tokens,
        f"j+1 tokens when the first j drafts are kept: 1 + alpha + ... + alpha^{k} = (1 - alpha^{k + 1}) / "
        f"(1 - alpha) = {_fmt(tokens)} (taking acceptances as independent).", tolerance=0.01, relative=True)
    speedup = tokens / (k * c + 1)
    q3 = _question(
        f"The same draft costs c = {c:g} of a target step per draft token. What speedup over plain decoding "
        f"does that give?", lab.speculative_speedup(alpha, k, c), speedup,
        f"A round costs k draft steps and ONE target pass (bandwidth-bound, about one decode step): "
        f"{_fmt(tokens)} / ({k} x {c:g} + 1) = {_fmt(speedup)}. At large batch or in prefill the pass turns "
        f"compute-bound and costs more: the speedup shrinks.", tolerance=0.01, relative=True)
    return [q1, q2, q3]


# --- Exercise 8: capacity planning -----------------------------------------------------------------


def quiz_capacity(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    combos = [(m, g, length, block) for m in lab.MODELS for g in lab.GPUS
              for length in (2048, 4096, 8192) for block in (16, 32)]
    plan, refusals = None, []
    for i in rng.permutation(len(combos)):
        name, gpu_name, max_model_len, block_size = combos[i]
        try:
            plan = lab.plan_deployment(name, gpu_name, max_model_len, block_size)
            break
        except ValueError as exc:  # does not fit: try another (NotImplementedError goes up: a stub)
            refusals.append(str(exc))
    if plan is None:
        raise QuizError(f"plan_deployment refused every preset combination, e.g.: {refusals[0]}")
    model, gpu = plan.model, plan.gpu
    element = model.kv_dtype_bytes or model.dtype_bytes
    kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * element
    q1 = _question(
        f"{model.name}: {model.num_layers} layers, {model.num_kv_heads} KV heads of dimension {model.head_dim}, "
        f"{element}-byte elements. How many bytes of KV cache does one token take?", lab.kv_bytes_per_token(model),
        kv, f"A key AND a value vector (the 2) per KV head per layer: 2 x {model.num_layers} x "
            f"{model.num_kv_heads} x {model.head_dim} x {element} = {kv:,} bytes. Grouped-query attention "
            f"shrinks it through the KV heads; an 8-bit KV cache through the element size.")
    budget = plan.gpu_memory_utilization * gpu.memory_bytes
    free = budget - model.weight_bytes
    blocks = math.floor(free / (block_size * kv))
    q2 = _question(
        f"It runs on one {gpu.name} with {gpu.memory_bytes:,} bytes, gpu_memory_utilization "
        f"{plan.gpu_memory_utilization:g}: a budget of {budget:,.0f} bytes, of which the weights take "
        f"{model.weight_bytes:,}. With blocks of {block_size} tokens, how many KV blocks fit?",
        plan.num_kv_blocks, blocks,
        f"floor(({budget:,.0f} - {model.weight_bytes:,}) / ({block_size} x {kv:,})) = {blocks:,} blocks, "
        f"{blocks * block_size:,} tokens of cache.")
    per_seq = _ceil_div(max_model_len, block_size)
    q3 = _question(
        f"{plan.num_kv_blocks:,} blocks of {block_size} tokens, and every sequence may grow to max_model_len = "
        f"{max_model_len} tokens. How many sequences are guaranteed to fit at once?", plan.max_concurrent_seqs,
        plan.num_kv_blocks // per_seq,
        f"A sequence owns whole blocks: blocks_needed({max_model_len}, {block_size}) = {per_seq} each, so "
        f"{plan.num_kv_blocks:,} // {per_seq} = {plan.num_kv_blocks // per_seq}. Paging admits far more when "
        f"requests are shorter than max_model_len; this is the guarantee.")
    seats, step, prefill = plan.max_concurrent_seqs, plan.decode_step_s, plan.prefill_s
    held = plan.mean_output_len * step + seats * prefill
    q4 = _question(
        f"With {seats} seats, a request holds its seat for its {plan.mean_output_len:g} output tokens at "
        f"{step * 1e3:.3f} ms per decode step ({plan.decode_bound}-bound), plus {seats} prefills of "
        f"{prefill * 1e3:.3f} ms (one per seat turning over meanwhile). How many requests per second does "
        f"Little's law give?", plan.qps, seats / held,
        f"W = {plan.mean_output_len:g} x {step * 1e3:.3f} ms + {seats} x {prefill * 1e3:.3f} ms = "
        f"{held * 1e3:.1f} ms; QPS = L / W = {seats} / {held:.4f} s = {_fmt(seats / held)}. TPOT is the decode "
        f"step; TTFT waits for a prefill.", tolerance=0.02, relative=True)
    return [q1, q2, q3, q4, _quiz_tp_cost(lab, plan), _quiz_tp8_vs_tp2(lab, plan), _quiz_token_budget(lab, rng, plan)]


def _quiz_tp_cost(lab: ModuleType, plan) -> Question:
    """Why tensor parallelism shortens the decode step but does not make a token cheaper."""
    batch, context = plan.max_concurrent_seqs, plan.mean_context_len
    one = roofline_step_cost(lab, plan.model, plan.gpu, 1).step_time(batch, int(batch * context))
    two = roofline_step_cost(lab, plan.model, plan.gpu, 2).parts(batch, int(batch * context))
    per_token_1, per_token_2 = one / batch, 2 * two.total / batch
    return _question(
        f"Your plan's {batch} sequences, {context:.0f} tokens of context each, take a {one * 1e3:.3f} ms decode step "
        f"on one {plan.gpu.name}. On 2 GPUs (tensor parallelism) each reads half the weights and half the K/V, and "
        f"the layers' all-reduces add {two.allreduce * 1e3:.3f} ms: the step is {two.total * 1e3:.3f} ms. How many "
        f"GPU-milliseconds does one output token cost at tp 2 (GPUs x step / tokens per step)?",
        2 * two.total * 1e3 / batch, per_token_2 * 1e3,
        f"2 x {two.total * 1e3:.3f} ms / {batch} = {per_token_2 * 1e3:.4f} GPU-ms, against "
        f"{per_token_1 * 1e3:.4f} at tp 1: the step halves (TPOT falls) but the GPUs double, so the same batch "
        f"costs the same per token plus the all-reduces. What tp can buy is room: half the weights per GPU leaves "
        f"more memory for K/V, so more sequences fit; when the KV blocks bound the batch, that lowers the cost "
        f"(`python {os.path.basename(lab.__file__)} fleet` shows when).", tolerance=0.02, relative=True)


def _quiz_tp8_vs_tp2(lab: ModuleType, plan, batch: int = 64) -> Question:
    """Why tp 8 costs more per token than tp 2 on the same GPU, on the measured step cost."""
    gpu = plan.gpu.name if has_profile(plan.gpu.name) else "a100-80gb"
    context = round(batch * plan.mean_context_len)
    two, eight = (measured_step_cost(lab, plan.model, gpu, tp).parts(batch, context) for tp in (2, 8))

    def per_token(tp: int, seconds: float) -> str:  # GPU-milliseconds per output token
        return f"{tp * seconds * 1e3 / batch:.3f}"
    ratio = 8 * eight.total / (2 * two.total)
    layers = 2 * plan.model.num_layers
    return _question(
        f"On {gpu}, a decode step of {batch} sequences of {plan.model.name} ({plan.mean_context_len:.0f} tokens of "
        f"context each) takes {two.total * 1e3:.2f} ms at tp 2 and {eight.total * 1e3:.2f} ms at tp 8 by the measured "
        f"step cost (Vidur's profiles, fitted). How many times the GPU-milliseconds per output token of tp 2 does "
        f"tp 8 cost?", 8 * eight.total / (2 * two.total), ratio,
        f"8 x {eight.total * 1e3:.2f} / (2 x {two.total * 1e3:.2f}) = {ratio:.2f}. Per output token, tp 2 -> tp 8: the "
        f"GEMMs with their norms {per_token(2, two.linear)} -> {per_token(8, eight.linear)} GPU-ms (a quarter of each "
        f"shard runs further from peak: a launch floor per kernel, fewer tiles than SMs, and the norms and residual "
        f"adds are not split at all); attention {per_token(2, two.attention)} -> {per_token(8, eight.attention)} (its "
        f"K/V reads split over tp, its kernel launches do not); the {layers} all-reduces "
        f"{per_token(2, two.allreduce)} -> {per_token(8, eight.allreduce)} ({two.allreduce / layers * 1e6:.0f} -> "
        f"{eight.allreduce / layers * 1e6:.0f} us each: latency, whatever the shard); the engine's CPU "
        f"{per_token(2, two.overhead)} -> {per_token(8, eight.overhead)} ({two.overhead * 1e3:.0f} ms a step, with 8 "
        f"GPUs waiting through it). tp buys a shorter step (TPOT) and room for K/V, not cheaper tokens.",
        tolerance=0.02, relative=True)


def _quiz_token_budget(lab: ModuleType, rng: np.random.Generator, plan) -> Question:
    """Why the knee moves with max_num_batched_tokens: prefill gets what the decodes leave of it."""
    decoders, prompt, budget = int(rng.choice([4, 8])), int(rng.choice([300, 400, 500])), int(rng.choice([64, 128]))
    bigger = 4 * budget
    requests = [(1, 40)] * decoders + [(prompt, 2)]
    run = _run_steps(lab, requests, "continuous", decoders + 1, bigger)
    steps_small, steps_big = _ceil_div(prompt, budget - decoders), _ceil_div(prompt, bigger - decoders)
    step = roofline_step_cost(lab, plan.model, plan.gpu, 1)
    small_s, big_s = (step.step_time(m, int(decoders * plan.mean_context_len + prompt)) for m in (budget, bigger))
    return _question(
        f"{decoders} sequences are decoding (one token each per step) when a {prompt}-token prompt arrives. With "
        f"chunked prefill and max_num_batched_tokens = {budget}, the prompt gets {budget} - {decoders} tokens a step "
        f"and its first token comes at step {steps_small}. At which step does it come with "
        f"max_num_batched_tokens = {bigger}? (Your scheduler runs it.)",
        run.first_token_step[str(decoders)], steps_big,
        f"ceil({prompt} / ({bigger} - {decoders})) = {steps_big}. Prefill gets what the decodes leave of the budget "
        f"each step, so the prompt tokens per second a replica can take, and the request rate where TTFT starts to "
        f"queue (the knee), grow with the budget: on {plan.model.name} / {plan.gpu.name} a step of {budget} tokens "
        f"takes {small_s * 1e3:.1f} ms and one of {bigger} {big_s * 1e3:.1f} ms (roofline), so prefill runs at "
        f"{(budget - decoders) / small_s:,.0f} vs {(bigger - decoders) / big_s:,.0f} tokens/s. The price: a longer "
        f"step is every decoding sequence's TPOT, so past the point where the step turns compute-bound a bigger "
        f"budget moves the knee against the TPOT target instead.")


QUIZZES: dict[int, Callable[[ModuleType, np.random.Generator], list[Question]]] = {
    1: quiz_blocks,
    2: quiz_block_table,
    3: quiz_prefix_cache,
    4: quiz_paged_attention,
    5: quiz_batching,
    6: quiz_speculative_sampling,
    7: quiz_speculative_generation,
    8: quiz_capacity,
}

STUB = re.compile(r"^Exercise \d+: \S+$")
# Every quiz computes its answers in well under a second on a correct module; an endless loop in
# the module's code must not hang the quiz.
TIME_LIMIT_S = 30


@contextlib.contextmanager
def _time_limit(seconds: float):
    """A QuizError after `seconds` (POSIX main thread only: elsewhere no limit)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise QuizError(f"computing the answers took more than {seconds:g} s: is there an endless loop?")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def make_questions(lab: ModuleType, exercise: int, seed: int) -> list[Question]:
    """The questions of quiz `exercise`, every answer computed now by `lab`. A stub's
    NotImplementedError goes up as it is; any other failure of the module is a QuizError."""
    try:
        with _time_limit(TIME_LIMIT_S):
            return QUIZZES[exercise](lab, np.random.default_rng(seed))
    except NotImplementedError as exc:
        if STUB.match(str(exc)):
            raise
        raise QuizError(f"NotImplementedError: {exc}") from exc
    except QuizError:
        raise
    except Exception as exc:  # the module's own code failed: say so, as the quiz cannot go on
        raise QuizError(f"{type(exc).__name__}: {exc}") from exc


def parse_answer(text: str) -> float | None:
    """A number as typed: 3, 0.25, 2/3, 1e-3, 12,345; None if it is not one."""
    text = text.strip().replace(",", "").replace("_", "")
    try:
        if "/" in text:
            return float(Fraction(text.replace(" ", "")))
        value = float(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def is_right(question: Question, value: float) -> bool:
    if question.whole:
        return value == question.answer
    return abs(value - question.answer) <= question.tolerance + 1e-12


WIDTH = 100


def _wrap(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def run_quiz(lab: ModuleType, exercise: int, seed: int, prog: str, stdin=None, stdout=None) -> int:
    """Ask the questions on `stdout`, read the answers from `stdin`; returns the exit status (0)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    questions = make_questions(lab, exercise, seed)
    module = os.path.basename(lab.__file__)
    title = lab.EXERCISES[exercise].split(":")[0]

    def say(text: str = "", end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    say(_wrap(f"Quiz {exercise}: {title}. {len(questions)} questions, seed {seed} (`python {prog} quiz {exercise} "
              f"--seed {seed}` asks them again). The right answers are computed by {module} itself: they are as "
              f"right as its code. Type a number (2/3 is fine); Ctrl-D ends."))
    right = answered = 0
    echo = not (hasattr(stdin, "isatty") and stdin.isatty())
    for number, question in enumerate(questions, 1):
        kind = "a whole number" if question.whole else f"a number, within {question.within}"
        say("\n" + _wrap(f"Q{number} of {len(questions)}. {question.text} ({kind})", rest="  "))
        while True:
            say("answer> ", end="")
            line = stdin.readline()
            if not line:  # EOF
                say()
                say(f"Quiz ended before Q{number}: {right} right of {answered} answered.")
                return 0
            if echo:
                say(line.rstrip("\n"))
            value = parse_answer(line)
            if value is not None:
                break
            say(f"  {line.strip()!r} is not a number: answer with one, such as 3, 0.25 or 2/3.")
        answered += 1
        ok = is_right(question, value)
        right += ok
        say(f"  {'right' if ok else 'wrong'}: the answer is {_fmt(question.answer)}.")
        say(_wrap(question.explanation, "  Why: ", "       "))
        if question.expected is not None and not math.isclose(question.answer, question.expected,
                                                                rel_tol=1e-6, abs_tol=1e-9):
            say(_wrap(f"the reasoning above gives {_fmt(question.expected)}, but {module} computes "
                      f"{_fmt(question.answer)}: check your code with `python -m pytest -m exercise{exercise}`.",
                      "  Note: ", "        "))
    say(f"\nScore: {right} of {len(questions)} right.")
    return 0
