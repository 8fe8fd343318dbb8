#!/usr/bin/env python3
"""A second implementation of every exercise, written from lab.py's docstrings alone.

It proves that test_lab.py holds a student to the docstrings' contract and nothing more: the
work is divided differently from solution.py, and the suite must still be green on it. This file
holds answers; it is a maintainers' tool and stays out of the student's copy.

    python -m tools.checks.second_lab --out DIR       # write DIR/second_lab.py (lab.py, stubs filled)
    python -m tools.checks.second_lab --run [ARGS]    # write it to a scratch folder and run the suite:
        # LAB_MODULE=second_lab PYTHONPATH=DIR:. python -m pytest -q test_lab.py tests ARGS
        # (the checkout on the path too: tests/course/test_cli.py runs the module as a script)

The module is lab.py with every `raise NotImplementedError("Exercise N: <name>")` (one per
`# BEGIN SOLUTION` region of solution.py, tools/handout/make_lab.py) replaced by the body below of that
name. Where it differs from solution.py:

- Ex 1: free asks `is_cached`; the queues are used as plain dicts (first key = least recently
  freed); `num_free_blocks` counts the blocks with no reference instead of the queues'
  lengths; `allocate` only peeks at the evictable queue: `_evict` takes the block off it.
  `blocks_needed` by divmod.
- Ex 2: `append_tokens` allocates the new tail blocks before the copy-on-write block; `fork`
  increfs last to first; `truncate` and `free` pop blocks one by one (free does not call
  truncate); `slots` builds the ids with a Python list.
- Ex 3: `hash_block` is BLAKE2b over a JSON text (not SHA-256 over a repr); `lookup` takes the
  reference before reviving; `allocate_prompt` decides on the miss lookup first, allocates the
  fresh blocks, then asks it; `cache_full_blocks` recomputes the whole chain with
  `chained_block_hashes` and registers the blocks past those already registered.
- Ex 4: one sequence at a time (a Python loop over sequences, none over tokens), chunks of
  block ids of that sequence alone, masks with np.where; the scale applied to the scores.
- Ex 5: `_preempt` removes the victim from `running` itself (solution's `schedule` pops it);
  `schedule` counts the tokens used, not the budget left, and looks the victim up as
  `running[-1]`; `update` computes every sequence first, then appends the tokens.
- Ex 6: the residual by np.clip; the accept test `u < p/q` (u < 1 makes the min redundant).
- Ex 7: greedy drafts are argmaxes, drawing nothing (one-hot rows: the output is the same for
  every seed); the draft's cache rolls back to the round's start and recomputes the accepted
  drafts; counters kept as the rounds go; the round after a stop token is never run.
- Ex 8: per-token K/V bytes divided as floats; block counts with `//` on floats; the
  roofline's two times compared by `max` over a dict.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUB = re.compile(r'^(\s*)raise NotImplementedError\("Exercise (\d+): ([\w.]+)"\)\s*$')

BODIES: dict[str, str] = {}


def body(name: str):
    """Register the text of a function's body (its first line at column 0) under `name`."""
    def add(text: str) -> str:
        BODIES[name] = textwrap.dedent(text).strip("\n") + "\n"
        return text
    return add


# --- Exercise 1 --------------------------------------------------------------------------------

body("blocks_needed")("""
    full, rest = divmod(num_tokens, block_size)
    return full + (1 if rest else 0)
""")

body("BlockAllocator.num_free_blocks")("""
    return self._ref_counts.count(0)
""")

body("BlockAllocator.allocate")("""
    if self._free:
        block_id = next(iter(self._free))
        del self._free[block_id]
    elif self._evictable:
        block_id = next(iter(self._evictable))
        self._evict(block_id)  # takes it off the evictable queue too
    else:
        raise OutOfBlocksError(f"no free block among {self.num_blocks}")
    self._ref_counts[block_id] += 1
    return block_id
""")

body("BlockAllocator.incref")("""
    self._ref_counts[block_id] = self._ref_counts[block_id] + 1
""")

body("BlockAllocator.free")("""
    left = self._ref_counts[block_id] - 1
    self._ref_counts[block_id] = left
    if left:
        return
    if self.is_cached(block_id):
        self._evictable[block_id] = None
    else:
        self._free[block_id] = None
""")

# --- Exercise 2 --------------------------------------------------------------------------------

body("BlockTable.append_tokens")("""
    if len(token_ids) == 0:
        return []
    size = self.block_size
    total = self.num_tokens + len(token_ids)
    fresh = -(-total // size) - len(self.block_ids)
    room_in_last = self.num_tokens % size
    last = self.block_ids[-1] if self.block_ids else None
    copy_last = bool(room_in_last) and (self.allocator.ref_count(last) > 1 or self.allocator.is_cached(last))
    if fresh + int(copy_last) > self.allocator.num_free_blocks:
        raise OutOfBlocksError(f"{fresh + int(copy_last)} blocks needed, {self.allocator.num_free_blocks} free")
    tail = [self.allocator.allocate() for _ in range(fresh)]
    pairs = []
    if copy_last:
        private = self.allocator.allocate()
        self.block_ids[-1] = private
        self.allocator.free(last)
        pairs.append((last, private))
    self.block_ids += tail
    self.token_ids += token_ids
    return pairs
""")

body("BlockTable.fork")("""
    twin = BlockTable(self.allocator, cache_salt=self.cache_salt)
    for block_id in self.block_ids[::-1]:
        self.allocator.incref(block_id)
    twin.block_ids = self.block_ids[:]
    twin.token_ids = self.token_ids[:]
    twin._block_hashes = self._block_hashes[:]
    return twin
""")

body("BlockTable.truncate")("""
    size = self.block_size
    keep = num_tokens // size + (num_tokens % size > 0)
    while len(self.block_ids) > keep:
        self.allocator.free(self.block_ids.pop())
    self.token_ids = self.token_ids[:num_tokens]
    self._block_hashes = self._block_hashes[: num_tokens // size]
""")

body("BlockTable.slots")("""
    size = self.block_size
    return np.array([self.block_ids[i // size] * size + i % size for i in range(start, stop)], dtype=np.int64)
""")

body("BlockTable.free")("""
    while self.block_ids:
        self.allocator.free(self.block_ids.pop())
    self.token_ids = []
    self._block_hashes = []
""")

# --- Exercise 3 --------------------------------------------------------------------------------

body("hash_block")("""
    import json
    text = json.dumps([parent_hash, cache_salt, [int(t) for t in token_ids]])
    return int(hashlib.blake2b(text.encode(), digest_size=32).hexdigest(), 16)
""")

body("BlockAllocator.lookup")("""
    if not self.enable_prefix_caching:
        return None
    self.stats.queries += 1
    if block_hash not in self._cached:
        return None
    block_id = self._cached[block_hash]
    self.stats.hits += 1
    self._ref_counts[block_id] += 1
    if self._ref_counts[block_id] == 1:
        self._evictable.pop(block_id)
    return block_id
""")

body("BlockAllocator.register")("""
    if not self.enable_prefix_caching:
        return
    if block_id not in self._block_hash and block_hash not in self._cached:
        self._block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
""")

body("BlockAllocator._evict")("""
    self._evictable.pop(block_id, None)
    block_hash = self._block_hash.pop(block_id)
    self._cached.pop(block_hash)
    self.stats.evictions = self.stats.evictions + 1
""")

body("BlockTable.allocate_prompt")("""
    size = self.block_size
    chain = chained_block_hashes(token_ids, size, self.cache_salt)
    reuse = self.allocator.cached_prefix(chain, len(token_ids))
    n_blocks = len(token_ids) // size + (len(token_ids) % size > 0)
    fresh = n_blocks - len(reuse)
    unreferenced = len([b for b in reuse if self.allocator.ref_count(b) == 0])
    if fresh + unreferenced > self.allocator.num_free_blocks:
        raise OutOfBlocksError(f"{fresh + unreferenced} blocks needed, {self.allocator.num_free_blocks} free")
    ask_miss = len(reuse) < len(chain) and self.allocator.get_cached_block(chain[len(reuse)]) is None
    taken = []
    for block_hash in chain[: len(reuse)]:
        taken.append(self.allocator.lookup(block_hash))
    taken.extend(self.allocator.allocate() for _ in range(fresh))
    if ask_miss:
        self.allocator.lookup(chain[len(reuse)])
    self.block_ids = taken
    self.token_ids = list(token_ids)
    self._block_hashes = chain[: len(reuse)]
    return size * len(reuse)
""")

body("BlockTable.cache_full_blocks")("""
    if self.allocator.enable_prefix_caching:
        size = self.block_size
        full = num_computed_tokens // size
        chain = chained_block_hashes(self.token_ids[: full * size], size, self.cache_salt)
        for i in range(len(self._block_hashes), full):
            self.allocator.register(self.block_ids[i], chain[i])
            self._block_hashes.append(chain[i])
""")

# --- Exercise 4 --------------------------------------------------------------------------------

body("paged_attention")("""
    batch, n_head, head_dim = q.shape
    block_size = k_cache.shape[1]
    per_block = block_size * n_head * head_dim * 4
    blocks_per_chunk = max(1, PAGED_ATTENTION_CHUNK_BYTES // per_block)
    scale = np.float32(1.0) / np.sqrt(np.float32(head_dim))
    out = np.zeros_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        n_blocks = -(-length // block_size)
        ids_all = block_tables[b, :n_blocks]
        best = np.full(n_head, -np.inf, dtype=np.float32)
        denom = np.zeros(n_head, dtype=np.float32)
        weighted = np.zeros((n_head, head_dim), dtype=np.float32)
        for first in range(0, n_blocks, blocks_per_chunk):
            ids = ids_all[first : first + blocks_per_chunk]
            k = k_cache[ids].astype(np.float32).reshape(-1, n_head, head_dim)
            v = v_cache[ids].astype(np.float32).reshape(-1, n_head, head_dim)
            if k_scale is not None:
                k = k * k_scale[ids].reshape(-1, n_head)[..., None]
                v = v * v_scale[ids].reshape(-1, n_head)[..., None]
            positions = first * block_size + np.arange(k.shape[0])
            valid = positions < length
            k = np.where(valid[:, None, None], k, np.float32(0))
            v = np.where(valid[:, None, None], v, np.float32(0))
            scores = np.einsum("hd,thd->ht", q[b], k) * scale
            scores = np.where(valid[None, :], scores, -np.inf).astype(np.float32)
            top = np.maximum(best, scores.max(axis=1))
            shrink = np.exp(best - top)
            weights = np.exp(scores - top[:, None])
            denom = denom * shrink + weights.sum(axis=1)
            weighted = weighted * shrink[:, None] + np.einsum("ht,thd->hd", weights, v)
            best = top
        out[b] = weighted / denom[:, None]
    return out
""")

# --- Exercise 5 --------------------------------------------------------------------------------

body("Scheduler._preempt")("""
    if seq in self.running:
        self.running.remove(seq)
    self.waiting.appendleft(seq)
    seq.status = SequenceStatus.WAITING
    self.num_preemptions += 1
    seq.num_preemptions += 1
    seq.block_table.free()
    seq.num_computed_tokens = 0
""")

body("Scheduler.schedule")("""
    plan = SchedulerOutput()
    used = 0
    limit = self.max_num_batched_tokens
    position = 0
    while position < len(self.running) and used < limit:
        seq = self.running[position]
        want = min(seq.num_tokens - seq.num_computed_tokens, limit - used)
        got_slots = self._allocate_slots(seq, want, plan)
        while not got_slots:
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                break
            got_slots = self._allocate_slots(seq, want, plan)
        if not got_slots:
            break
        plan.add(seq, want)
        used += want
        position += 1
    if plan.preempted:
        return plan
    while self.waiting and used < limit and len(self.running) < self.max_num_seqs:
        candidate = self.waiting[0]
        tokens = self._try_admit(candidate, limit - used)
        if not tokens:
            break
        self.waiting.popleft()
        self.running.append(candidate)
        candidate.status = SequenceStatus.RUNNING
        plan.add(candidate, tokens)
        used += tokens
    return plan
""")

body("Scheduler.update")("""
    for seq in plan.scheduled:
        seq.num_computed_tokens = seq.num_computed_tokens + plan.num_scheduled_tokens[seq.request_id]
        seq.block_table.cache_full_blocks(seq.num_computed_tokens)
    done = []
    for seq in plan.scheduled:
        if seq.request_id not in sampled_token_ids:
            continue
        seq.output_token_ids.append(sampled_token_ids[seq.request_id])
        why = seq.check_stop()
        if why:
            self._finish(seq, why)
            done.append(seq)
    return done
""")

# --- Exercise 6 --------------------------------------------------------------------------------

body("residual_distribution")("""
    leftover = np.clip(p - q, 0.0, None)
    total = float(leftover.sum())
    return leftover / total if total > 0.0 else p.copy()
""")

body("accept_or_resample")("""
    k, vocab = q.shape
    tokens: list[int] = []
    i = 0
    while i < k:
        x = draft[i]
        if rng.random() < p[i, x] / q[i, x]:
            tokens.append(x)
            i += 1
        else:
            tokens.append(int(rng.choice(vocab, p=residual_distribution(p[i], q[i]))))
            return tokens
    tokens.append(int(rng.choice(vocab, p=p[k])))
    return tokens
""")

# --- Exercise 7 --------------------------------------------------------------------------------

body("speculative_generate")("""
    rng = np.random.default_rng(sampling.seed)
    greedy = sampling.temperature == 0
    stops = frozenset(sampling.stop_token_ids)
    big, small = PagedSequence(target), PagedSequence(draft)
    for model_seq in (big, small):
        model_seq.extend(prompt)
        model_seq.run(stop=len(prompt) - 1)
    room = min(target.config.n_positions, draft.config.n_positions) - len(prompt)
    wanted = min(sampling.max_tokens, room)
    tokens: list[int] = []
    per_round: list[int] = []
    drafted = accepted = 0
    while len(tokens) < wanted:
        start = big.table.num_tokens
        n = min(k, wanted - len(tokens) - 1)
        proposals, rows = [], np.zeros((n, target.config.vocab_size))
        for j in range(n):
            rows[j] = token_probs(small.run()[-1], sampling.temperature)
            token = int(np.argmax(rows[j])) if greedy else int(rng.choice(rows.shape[1], p=rows[j]))
            proposals.append(token)
            small.extend([token])
        big.extend(proposals)
        p_rows = token_probs(big.run(), sampling.temperature)
        emitted = accept_or_resample(proposals, rows, p_rows, rng)
        drafted += n
        accepted += len(emitted) - 1
        per_round.append(len(emitted) - 1)
        big.rollback(start + len(emitted) - 1)
        big.extend(emitted[-1:])
        small.rollback(start)
        small.extend(emitted)
        for token in emitted:
            tokens.append(token)
            if token in stops:
                break
        if tokens[-1] in stops:
            break
    return SpeculativeOutput(tokens, len(per_round), drafted, accepted, per_round)
""")

# --- Exercise 8 --------------------------------------------------------------------------------

body("plan_deployment")("""
    tp = tensor_parallel_size
    per_token = kv_bytes_per_token(model) / tp
    weights = model.num_params * model.dtype_bytes / tp
    usable = gpu.memory_bytes * gpu_memory_utilization
    room = usable - activation_bytes - weights
    if room < 0:
        raise ValueError(f"{model.name} on {gpu.name} (tp={tp}): weights {weights / GB:.2f} GB plus "
                         f"activations {activation_bytes / GB:.2f} GB exceed the budget of {usable / GB:.2f} GB "
                         f"by {-room / GB:.2f} GB")
    blocks = int(room // (per_token * block_size))
    per_seq = -(-max_model_len // block_size)
    seqs = blocks // per_seq
    if seqs < 1:
        raise ValueError(f"a {max_model_len}-token sequence needs {per_seq} blocks; the cache holds {blocks} blocks")
    flops_per_token = 2 * model.num_params / tp
    times = {
        "memory-bandwidth": (weights + seqs * (mean_prompt_len + 0.5 * mean_output_len) * per_token)
        / gpu.bandwidth_bytes_per_s,
        "compute": seqs * flops_per_token / gpu.flops,
    }
    bound = "compute" if times["compute"] > times["memory-bandwidth"] else "memory-bandwidth"
    notes = ()
    if model.max_position_embeddings and max_model_len > model.max_position_embeddings:
        notes = (f"{model.name} was trained for {model.max_position_embeddings} positions; {max_model_len} needs "
                 "a long-context variant",)
    return DeploymentPlan(model=model, gpu=gpu, max_model_len=max_model_len, block_size=block_size,
                          gpu_memory_utilization=gpu_memory_utilization, activation_bytes=activation_bytes,
                          tensor_parallel_size=tp, mean_prompt_len=mean_prompt_len,
                          mean_output_len=mean_output_len, num_kv_blocks=blocks, max_concurrent_seqs=seqs,
                          decode_step_s=times[bound], decode_bound=bound,
                          prefill_s=mean_prompt_len * flops_per_token / gpu.flops, notes=notes)
""")


def second_lab(lab_text: str) -> str:
    """lab.py's text with every stub replaced by its body here; ValueError if one has none."""
    out = []
    missing = []
    used = set()
    for line in lab_text.splitlines(keepends=True):
        stub = STUB.match(line)
        if not stub:
            out.append(line)
            continue
        indent, name = stub.group(1), stub.group(3)
        if name not in BODIES:
            missing.append(name)
            continue
        used.add(name)
        out.append(textwrap.indent(BODIES[name], indent))
    if missing:
        raise ValueError(f"no second implementation of {', '.join(missing)}")
    unused = set(BODIES) - used
    if unused:
        raise ValueError(f"bodies for no stub of lab.py: {', '.join(sorted(unused))}")
    return "".join(out)


def write(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "second_lab.py"
    path.write_text(second_lab((ROOT / "lab.py").read_text()))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write second_lab.py into this folder")
    parser.add_argument("--run", action="store_true", help="run test_lab.py and tests/ on it (extra args to pytest)")
    args, rest = parser.parse_known_args(argv)
    if not args.run:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        print(write(args.out or Path(".")))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        write(folder)
        env = dict(os.environ, LAB_MODULE="second_lab",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(folder), str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(rest or ["test_lab.py", "tests"])]
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
