"""Quiz 3: prefix caching (Exercise 3), every answer computed by the module under quiz."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from .questions import Question, ceil_div, plural, question


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
    q1 = question(
        f"Request A's {n_a}-token prompt has run, and its full blocks are cached (block size {B}). Request B's "
        f"prompt has {len(prompt_b)} tokens: the first {shared} are A's, the rest differ. How many of B's "
        f"tokens does allocate_prompt find already computed?",
        second.allocate_prompt(prompt_b), shared // B * B,
        f"A block is found by a hash chained on its whole prefix. B's first {plural(shared // B, 'full block')} hold "
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
    q2 = question(
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
    q3 = question(
        f"A pool of {N} blocks of {B} tokens, prefix caching on. A request of {n} tokens runs, its full blocks are "
        f"cached, and it finishes (its table frees every block). How many blocks can the prefix cache still "
        f"find?", sum(bool(pool.is_cached(b)) for b in range(N)), n // B,
        f"Freeing a cached block does not forget it: at reference count 0 it waits in the evictable queue, "
        f"still findable, until allocate needs it and no plain free block is left (lazy LRU eviction). "
        f"{'Its one full block was' if n // B == 1 else f'Its {n // B} full blocks were'} registered"
        f"{'; the partial last block was not.' if n % B else '.'}")
    q4 = question(
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
        pool = lab.BlockAllocator(4 * T * ceil_div(S + q, B), B, enable_prefix_caching=True)
        total = 0
        for i, prompt in enumerate(prompts):  # one after another: each runs before the next arrives
            table = lab.BlockTable(pool, f"tenant-{i}") if salted else lab.BlockTable(pool)
            total += len(prompt) - table.allocate_prompt(prompt)
            table.cache_full_blocks(len(prompt))
        return total

    shared_blocks = S // B
    shared = T * (S + q) - (T - 1) * shared_blocks * B
    q5 = question(
        f"{T} tenants each send one request, one after another: the same {S}-token public system prompt, then a "
        f"question of {q} tokens of their own (block size {B}, prefix caching on, one shared cache). How many "
        f"prompt tokens are prefilled in all?", prefilled(False), shared,
        f"The first request prefills all {S + q} tokens; each of the other {T - 1} finds the public prompt's "
        f"{plural(shared_blocks, 'full block')} ({shared_blocks * B} tokens) cached and prefills the rest: "
        f"{T} x {S + q} - {T - 1} x {shared_blocks * B} = {shared}. "
        + (f"The block holding the prompt's last {S % B} tokens also holds a question's: it differs per tenant."
           if S % B else "The question starts a block of its own."))
    q6 = question(
        "...and with a cache salt per tenant (derived by the server from each tenant's API key)?",
        prefilled(True), T * (S + q),
        f"All {T} x {S + q} = {T * (S + q)}: the salt is in every block's hash, so no tenant finds another's "
        f"blocks, and {T - 1} x {shared_blocks * B} = {(T - 1) * shared_blocks * B} more tokens are prefilled. "
        f"That is the whole cost: the same attacker who could time a hit on the public prompt could time a hit "
        f"on a private one, so the salt closes the channel by giving up exactly the sharing across tenants. "
        f"Requests of one tenant still share (same salt).")
    return [q5, q6]
