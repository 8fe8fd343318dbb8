#!/usr/bin/env python3
"""Plant the classic mistakes in scratch copies of solution.py and show that the suite catches each.

Every mutant is one textual edit of solution.py (it must apply exactly once). For each, the tool
writes the mutated module to a temporary folder, runs the suite against it
(`LAB_MODULE=<mutant>`), and reports the first test that went red. A mutant that survives is a
hole in the students' spec.

    python tools/mutants.py              # all mutants
    python tools/mutants.py -k slot      # those whose name contains "slot"
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, exercise marker to run, old text, new text)
MUTANTS: list[tuple[str, str, str, str]] = [
    ("blocks_needed rounds down", "exercise1",
     "return (num_tokens + block_size - 1) // block_size", "return num_tokens // block_size + 1"),
    ("free returns a shared block to the pool", "exercise1",
     "        self._ref_counts[block_id] -= 1\n        if self._ref_counts[block_id] == 0:\n",
     "        self._ref_counts[block_id] = 0\n        if self._ref_counts[block_id] == 0:\n"),
    ("a freed cached block goes to the plain free queue", "exercise3",
     "queue = self._evictable if block_id in self._block_hash else self._free",
     "queue = self._free"),
    ("allocate evicts a cached block while plain free blocks are left", "exercise3",
     "        if self._free:\n            block_id, _ = self._free.popitem(last=False)",
     "        if self._free and not self._evictable:\n            block_id, _ = self._free.popitem(last=False)"),
    ("append allocates one token early", "exercise2",
     "new_blocks = blocks_needed(self.num_tokens + len(token_ids), block_size) - len(self.block_ids)",
     "new_blocks = blocks_needed(self.num_tokens + len(token_ids) + 1, block_size) - len(self.block_ids)"),
    ("forked table writes the shared last block without a copy", "exercise2",
     "cow = self.num_tokens % block_size != 0 and self._is_shared(self.block_ids[-1])", "cow = False"),
    ("slot = offset * block_size + block", "exercise2",
     "return blocks * self.block_size + positions % self.block_size",
     "return (positions % self.block_size) * self.block_size + blocks"),
    ("truncate leaks the dropped blocks", "exercise2",
     "        for block_id in reversed(self.block_ids[keep:]):\n            self.allocator.free(block_id)\n", ""),
    ("block hash not chained on the parent", "exercise3",
     "key = repr((parent_hash, cache_salt,", "key = repr((None, cache_salt,"),
    ("block hash is Python's salted hash()", "exercise3",
     'return int.from_bytes(hashlib.sha256(key).digest(), "big")', "return hash(key)"),
    ("cache salt left out of the hash", "exercise3",
     "key = repr((parent_hash, cache_salt,", "key = repr((parent_hash, None,"),
    ("eviction in most-recently-used order", "exercise3",
     "block_id, _ = self._evictable.popitem(last=False)", "block_id, _ = self._evictable.popitem(last=True)"),
    ("truncate frees a prefix from its first block (evicted first)", "exercise3",
     "for block_id in reversed(self.block_ids[keep:]):", "for block_id in self.block_ids[keep:]:"),
    ("lookup does not revive an evictable block", "exercise3",
     "        if self._ref_counts[block_id] == 0:\n            del self._evictable[block_id]\n", ""),
    ("truncate keeps stale block hashes", "exercise3",
     "        del self._block_hashes[num_tokens // self.block_size :]\n", ""),
    ("blocks registered at allocation, before their K/V is computed", "exercise3",
     "        self._block_hashes = hashes[: len(run)]\n        return len(run) * block_size\n",
     "        self._block_hashes = hashes[: len(run)]\n        self.cache_full_blocks(len(token_ids))\n        return len(run) * block_size\n"),
    ("computed blocks never registered", "exercise3",
     "            self.allocator.register(self.block_ids[i], block_hash)\n", "            pass\n"),
    ("a fully cached prompt reuses (and rewrites) its last cached block", "exercise3",
     "return run[:-1] if run and len(run) * self.block_size >= num_tokens else run", "return run"),
    ("attend before writing the new token's K/V", "exercise4",
     "            kv_cache.write(i, batch.slots, k, v)\n",
     "            kv_cache.write(i, batch.slots, k * 0.0, v * 0.0)\n"),
    ("causal mask off by one inside a prefill chunk", "exercise4",
     "mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]",
     "mask = np.arange(stop)[None, :] < np.arange(start, stop)[:, None] + (np.arange(start, stop)[:, None] == 0)"),
    ("a preempted sequence goes to the back of the queue", "exercise5",
     "        self.waiting.appendleft(seq)\n        # END SOLUTION",
     "        self.waiting.append(seq)\n        # END SOLUTION"),
    ("preempting without freeing blocks", "exercise5",
     "        seq.block_table.free()\n        seq.num_computed_tokens = 0\n",
     "        seq.block_table = BlockTable(self.allocator)\n        seq.num_computed_tokens = 0\n"),
    ("losing generated tokens on preemption", "exercise5",
     "        seq.num_computed_tokens = 0\n        seq.status = SequenceStatus.WAITING\n",
     "        seq.num_computed_tokens = 0\n        seq.output_token_ids.clear()\n"
     "        seq.status = SequenceStatus.WAITING\n"),
    ("admitting past the token budget", "exercise5",
     "            num_new = min(num_new, token_budget)\n        if num_new > token_budget:\n            return 0\n",
     "            pass\n"),
    ("accept with min(1, q/p)", "exercise6",
     "if rng.random() < min(1.0, p[i, x] / q[i, x]):", "if rng.random() < min(1.0, q[i, x] / p[i, x]):"),
    ("resample from p instead of the residual", "exercise6",
     "p=residual_distribution(p[i], q[i])", "p=p[i]"),
    ("no bonus token after k acceptances", "exercise6",
     "    emitted.append(int(rng.choice(vocab_size, p=p[-1])))\n", ""),
    ("verification reads the target rows one position late", "exercise7",
     "emitted = accept_or_resample(drafts, q_rows, p_rows, rng)",
     "emitted = accept_or_resample(drafts, q_rows, np.vstack([p_rows[1:], p_rows[-1:]]), rng)"),
    ("draft rows q one position early", "exercise7",
     "emitted = accept_or_resample(drafts, q_rows, p_rows, rng)",
     "emitted = accept_or_resample(drafts, np.vstack([q_rows[:1], q_rows[:-1]]), p_rows, rng)"),
    ("draft cache not rolled back", "exercise7",
     "            seq.rollback(committed + len(emitted) - 1)\n",
     "            seq.rollback(committed + len(emitted) - 1) if seq is target_seq else None\n"),
    ("KV bytes not split across tensor-parallel GPUs", "exercise8",
     "kv_token = kv_bytes_per_token(model) // tp", "kv_token = kv_bytes_per_token(model)"),
    ("KV blocks rounded up", "exercise8",
     "num_kv_blocks = math.floor(free / block_bytes)", "num_kv_blocks = math.ceil(free / block_bytes)"),

    ('block hash chained on whether there is a parent, not on its hash', 'exercise3',
     'key = repr((parent_hash, cache_salt,', 'key = repr((parent_hash is not None, cache_salt,'),
    ('allocate evicts a cached block that a table still holds', 'exercise3',
     '        else:\n            raise OutOfBlocksError',
     '        elif self._block_hash:\n            block_id = next(iter(self._block_hash))\n            self._evict(block_id)\n        else:\n            raise OutOfBlocksError'),
    ('the scheduler never registers computed blocks', 'exercise5',
     '            seq.block_table.cache_full_blocks(seq.num_computed_tokens)  # their K/V is written now\n', ''),
    ('the target verifies the drafts one forward pass per token', 'exercise7',
     '        p_rows = token_probs(target_seq.run(), sampling.temperature)  # ONE pass: last + n_draft tokens\n',
     '        p_rows = token_probs(np.concatenate([target_seq.model.forward(target_seq.cache, [target_seq.table], [s], [1])\n                                             for s in range(target_seq.num_computed, target_seq.table.num_tokens)]),\n                             sampling.temperature)\n        target_seq.num_computed = target_seq.table.num_tokens\n'),
    ('blocks_needed wrong at 1 token', 'exercise1',
     'return (num_tokens + block_size - 1) // block_size',
     'return 0 if num_tokens <= 1 else (num_tokens + block_size - 1) // block_size'),
    ('blocks_needed wrong at block_size + 1 tokens', 'exercise1',
     'return (num_tokens + block_size - 1) // block_size',
     'return max(1, num_tokens // block_size) if num_tokens else 0'),
    ("fork without incref: freeing one table frees the other's blocks", 'exercise2',
     '        for block_id in self.block_ids:\n            self.allocator.incref(block_id)\n',
     ''),
    ('copy-on-write only for cached blocks, not for forked ones', 'exercise2',
     'return self.allocator.ref_count(block_id) > 1 or self.allocator.is_cached(block_id)',
     'return self.allocator.is_cached(block_id)'),
    ('model path: slot = offset * block_size + block', 'exercise4',
     'slots.append(table.slots(start, stop))',
     'slots.append((np.arange(start, stop) % table.block_size) * table.block_size + np.asarray(table.block_ids)[np.arange(start, stop) // table.block_size])'),
    ('paged_attention: softmax over the slots past context_lens', 'exercise4',
     '            scores[np.broadcast_to(past_end[:, None, :], scores.shape)] = -np.inf   # mask by position\n',
     '            pass\n'),
    ('causal mask relative to the chunk, not the absolute position', 'exercise4',
     'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]',
     'mask = np.arange(stop)[None, :] <= np.arange(0, stop - start)[:, None]'),
    ('causal mask lets a token see the next one', 'exercise4',
     'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]',
     'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None] + 1'),
    ('attention gathers every block column at once (a copy of the whole K/V)', 'exercise4',
     'step = max(1, PAGED_ATTENTION_CHUNK_BYTES // column_bytes)', 'step = max(1, block_tables.shape[1])'),
    ('running prefill chunk not capped by the token budget', 'exercise5',
     'num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)',
     'num_new = seq.num_tokens - seq.num_computed_tokens'),
    ('residual max(0, p - q) not normalised', 'exercise6',
     '    return residual / mass\n',
     '    return residual\n'),
    ('target cache not rolled back', 'exercise7',
     '            seq.rollback(committed + len(emitted) - 1)\n',
     '            seq.rollback(committed + len(emitted) - 1) if seq is draft_seq else None\n'),
    ('weights not split across tensor-parallel GPUs', 'exercise8',
     'weight_bytes = model.weight_bytes / tp',
     'weight_bytes = model.weight_bytes'),
    ('K-only KV bytes (no factor 2) in plan_deployment', 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp',
     'kv_token = model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes // tp'),
    ('num_attention_heads instead of num_kv_heads in plan_deployment', 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp',
     'kv_token = 2 * model.num_layers * model.num_attention_heads * model.head_dim * model.dtype_bytes // tp'),
    ('int8 KV cache: scales not copied on copy-on-write', 'provided',
     'for array in (self.k, self.v, self.k_scale, self.v_scale):',
     'for array in (self.k, self.v):'),
    ('int8 KV cache: one scale per write instead of per token and head', 'provided',
     'scale = np.abs(x).max(axis=-1) * np.float32(1.0 / 127.0)',
     'scale = np.full(x.shape[:-1], np.abs(x).max(), np.float32) * np.float32(1.0 / 127.0)'),
    ('int8 KV cache: prefill reads int8 values without their scales', 'exercise4',
     'return dequantize_int8(views[0][slots], views[2][slots]), dequantize_int8(views[1][slots], views[3][slots])',
     'return views[0][slots].astype(np.float32), views[1][slots].astype(np.float32)'),
    ('int8 KV cache: kernel leaves the V scales out of the weighted sum', 'exercise4',
     '            p *= v_s.transpose(0, 2, 1)               # int8: sum p (s v) = sum (p s) v\n',
     '            pass\n'),
    ('int8 KV cache: kernel leaves the K scales out of the scores', 'exercise4',
     '            scores *= k_s.transpose(0, 2, 1)          # int8: q . (s k) = s (q . k)\n',
     '            pass\n'),
    ('int8 KV cache: the gather reads the scales of the first blocks, not of the ids', 'provided',
     's = np.take(self.scales[i], ids, axis=0,',
     's = np.take(self.scales[i], np.arange(ids.size).reshape(ids.shape), axis=0,'),
    ('paged_attention: stale slots checked on the longest sequence, not the shortest', 'exercise4',
     'stale = lens[n - 1] < (j + ids.shape[1]) * block_size',
     'stale = lens[0] < (j + ids.shape[1]) * block_size'),
    ('forward ignores logits_indices: the LM head runs on every row', 'exercise4',
     'return self._logits(x if rows is None else x[rows])', 'return self._logits(x)'),
    ("engine samples each prefill chunk's first row, not its last", 'exercise5',
     'logits_indices=np.cumsum(num_new) - 1)', 'logits_indices=np.cumsum(num_new) - num_new)'),
    ("forward takes a cache of another block size", 'exercise4',
     'if getattr(table, "block_size", None) != block_size:', 'if False:'),
    ("KV bytes from the weights' dtype, not the KV cache's, in plan_deployment", 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp',
     'kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes // tp'),
    ("disconnected client not aborted", "exercise5",
     "        except (_ClientGone, ConnectionError):\n            self._bridge.abort(request.request_id)\n",
     "        except (_ClientGone, ConnectionError):\n            pass\n"),
    ("load generator: TPOT divided by chunks, not tokens", "provided",
     "    n = result.num_output_tokens\n", "    n = len(times)\n"),
    ("load generator: goodput ignores the TPOT SLO", "provided",
     "and (slo_tpot is None or r.num_output_tokens < 2 or m.tpot <= slo_tpot)]", "]"),
    ("load generator: evenly spaced arrivals instead of Poisson", "provided",
     "gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)",
     "gaps = np.full(num_requests, 1.0 / rate)"),
    ('an append that needs a copy-on-write block does not count it before taking blocks', 'exercise2',
     'if cow + new_blocks > self.allocator.num_free_blocks:',
     'if new_blocks > self.allocator.num_free_blocks:'),
    ('a fork shares its parent\'s list of registered hashes', 'exercise3',
     'child._block_hashes = list(self._block_hashes)',
     'child._block_hashes = self._block_hashes'),
    ('online softmax keeps only the current chunk\'s max', 'exercise4',
     'new_max = np.maximum(m, scores.max(axis=-1, keepdims=True))',
     'new_max = scores.max(axis=-1, keepdims=True)'),
    ('the engine hands out a finished request\'s id again', 'exercise5',
     '                request = Request(str(next_id), prompt, SamplingParams() if params is None else params)\n                next_id += 1\n',
     '                request = Request(str(next_id), prompt, SamplingParams() if params is None else params)\n'),
    ('a step that preempted still admits waiting requests', 'exercise5',
     'while self.waiting and not plan.preempted and',
     'while self.waiting and'),
    ('update puts the sampled token into the block table before its K/V', 'exercise5',
     '            seq.output_token_ids.append(token)\n',
     '            seq.output_token_ids.append(token)\n            seq.block_table.append_tokens([token])\n'),
    ('the engine samples at temperature 1 whatever the request says', 'exercise5',
     'return int(rng.choice(p.size, p=p))',
     'return int(rng.choice(p.size, p=token_probs(logits, 1.0)))'),
    ('the draft samples greedily while the target samples', 'exercise7',
     'q = token_probs(draft_seq.run()[-1], sampling.temperature)',
     'q = token_probs(draft_seq.run()[-1], 0.0)'),
    ('decode step reads all the weights on every tensor-parallel GPU', 'exercise8',
     'step_bytes = weight_bytes + max_seqs',
     'step_bytes = model.weight_bytes + max_seqs'),
    ('prefill FLOPs not split across tensor-parallel GPUs', 'exercise8',
     'prefill_s = 2 * model.num_params * mean_prompt_len / (tp * gpu.flops)',
     'prefill_s = 2 * model.num_params * mean_prompt_len / gpu.flops'),
    ('format_plan prints the block size in MB as MiB', 'exercise8',
     '{plan.block_bytes_per_gpu / 2**20:g} MiB',
     '{plan.block_bytes_per_gpu / 1e6:g} MiB'),
]


def run(name: str, marker: str, source: str, workdir: Path) -> tuple[bool, str]:
    module = "mutant_" + "".join(c if c.isalnum() else "_" for c in name)[:40]
    (workdir / f"{module}.py").write_text(source)
    env = dict(os.environ, LAB_MODULE=module, PYTHONPATH=f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               HYPOTHESIS_PROFILE="ci")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-m", marker, "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    if failed:
        return proc.returncode == 1, failed[0].split("::", 1)[1]
    return False, (proc.stdout + proc.stderr).strip().splitlines()[-1:] or f"pytest exited {proc.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    args = parser.parse_args(argv)
    solution = (ROOT / "solution.py").read_text()
    survivors = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, marker, old, new in MUTANTS:
            if args.k not in name:
                continue
            if solution.count(old) != 1:
                print(f"?? {name}: the text to mutate occurs {solution.count(old)} times in solution.py")
                survivors += 1
                continue
            start = time.perf_counter()
            caught, test = run(name, marker, solution.replace(old, new), Path(tmp))
            survivors += not caught
            verdict = "caught by" if caught else "SURVIVED:"
            print(f"{'ok' if caught else '!!'} {name:<66} {verdict} {test}  ({time.perf_counter() - start:.1f}s)")
    print(f"{survivors} mutant(s) survived")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
