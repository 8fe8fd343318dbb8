#!/usr/bin/env python3
"""Plant the classic mistakes in scratch copies of solution.py and show that the suite catches each.

Every mutant is one textual edit of solution.py, or of a file of serving/ when a fifth field
names it (it must apply exactly once). For a solution.py mutant the tool writes the mutated
module to a temporary folder and runs the students' suite (test_lab.py) against it
(`LAB_MODULE=<mutant>`); for a serving/ mutant it runs the suite against solution in a scratch
copy of the project whose file is mutated. The suite is the spec (test_lab.py) and the tests of
serving/ (tests/). It reports the first test that went red; the tooling tests (tools/) never
count as a catch. A mutant that survives is a hole in the spec.
A full run writes tools/mutants_caught.json (which test caught which mutant); later runs try
that test first, so proving all of them takes minutes, not a quarter of an hour.

    python tools/mutants.py              # all mutants, two at a time (-j), hints first
    python tools/mutants.py -k slot      # those whose name contains "slot"
    python tools/mutants.py --no-hints   # each mutant's whole marker: finds the first test that fails
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, exercise marker to run, old text, new text[, file: default solution.py])
MUTANTS: list[tuple[str, ...]] = [
    ('blocks_needed rounds down', 'exercise1',
     'return (num_tokens + block_size - 1) // block_size', 'return num_tokens // block_size + 1'),
    ('free returns a shared block to the pool', 'exercise1',
     '        self._ref_counts[block_id] -= 1\n        if self._ref_counts[block_id] == 0:\n', '        self._ref_counts[block_id] = 0\n        if self._ref_counts[block_id] == 0:\n'),
    ('a freed cached block goes to the plain free queue', 'exercise3',
     'queue = self._evictable if block_id in self._block_hash else self._free', 'queue = self._free'),
    ('allocate evicts a cached block while plain free blocks are left', 'exercise3',
     '        if self._free:\n            block_id, _ = self._free.popitem(last=False)', '        if self._free and not self._evictable:\n            block_id, _ = self._free.popitem(last=False)'),
    ('append allocates one token early', 'exercise2',
     'new_blocks = blocks_needed(self.num_tokens + len(token_ids), block_size) - len(self.block_ids)', 'new_blocks = blocks_needed(self.num_tokens + len(token_ids) + 1, block_size) - len(self.block_ids)'),
    ('forked table writes the shared last block without a copy', 'exercise2',
     'cow = self.num_tokens % block_size != 0 and self._is_shared(self.block_ids[-1])', 'cow = False'),
    ('slot = offset * block_size + block', 'exercise2',
     'return blocks * self.block_size + positions % self.block_size', 'return (positions % self.block_size) * self.block_size + blocks'),
    ('truncate leaks the dropped blocks', 'exercise2',
     '        for block_id in reversed(self.block_ids[keep:]):\n            self.allocator.free(block_id)\n', ''),
    ('block hash not chained on the parent', 'exercise3',
     'key = repr((parent_hash, cache_salt,', 'key = repr((None, cache_salt,'),
    ("block hash is Python's salted hash()", 'exercise3',
     'return int.from_bytes(hashlib.sha256(key).digest(), "big")', 'return hash(key)'),
    ('cache salt left out of the hash', 'exercise3',
     'key = repr((parent_hash, cache_salt,', 'key = repr((parent_hash, None,'),
    ('eviction in most-recently-used order', 'exercise3',
     'block_id, _ = self._evictable.popitem(last=False)', 'block_id, _ = self._evictable.popitem(last=True)'),
    ('truncate frees a prefix from its first block (evicted first)', 'exercise3',
     'for block_id in reversed(self.block_ids[keep:]):', 'for block_id in self.block_ids[keep:]:'),
    ('lookup does not revive an evictable block', 'exercise3',
     '        if self._ref_counts[block_id] == 0:\n            del self._evictable[block_id]\n', ''),
    ('truncate keeps stale block hashes', 'exercise3',
     '        del self._block_hashes[num_tokens // self.block_size :]\n', ''),
    ('blocks registered at allocation, before their K/V is computed', 'exercise3',
     '        self._block_hashes = hashes[: len(run)]\n        return len(run) * block_size\n', '        self._block_hashes = hashes[: len(run)]\n        self.cache_full_blocks(len(token_ids))\n        return len(run) * block_size\n'),
    ('computed blocks never registered', 'exercise3',
     '            self.allocator.register(self.block_ids[i], hashes[i])\n', '            pass\n'),
    ('a fully cached prompt reuses (and rewrites) its last cached block', 'exercise3',
     'return run[:-1] if run and len(run) * self.block_size >= num_tokens else run', 'return run'),
    ("attend before writing the new token's K/V", 'exercise4',
     '            kv_cache.write(i, batch.slots, k, v)  #', '            kv_cache.write(i, batch.slots, k * 0.0, v * 0.0)  #'),
    ('causal mask off by one inside a prefill chunk', 'exercise4',
     'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]', 'mask = np.arange(stop)[None, :] < np.arange(start, stop)[:, None] + (np.arange(start, stop)[:, None] == 0)'),
    ('preemption takes the sequence asking for a block, not the newest', 'exercise5',
     'victim = self.running.pop()  # the newest', 'victim = self.running.pop(self.running.index(seq))  # the newest'),
    ('a preempted sequence goes to the back of the queue', 'exercise5',
     '        self.waiting.appendleft(seq)\n        # END SOLUTION', '        self.waiting.append(seq)\n        # END SOLUTION'),
    ('preempting without freeing blocks', 'exercise5',
     '        seq.block_table.free()\n        seq.num_computed_tokens = 0\n', '        seq.block_table = BlockTable(self.allocator)\n        seq.num_computed_tokens = 0\n'),
    ('losing generated tokens on preemption', 'exercise5',
     '        seq.num_computed_tokens = 0\n        seq.status = SequenceStatus.WAITING\n', '        seq.num_computed_tokens = 0\n        seq.output_token_ids.clear()\n        seq.status = SequenceStatus.WAITING\n'),
    ('admitting past the token budget', 'exercise5',
     '            num_new = min(num_new, token_budget)\n        if not 0 < num_new <= token_budget or ',
     '            pass\n        if not 0 < num_new or '),
    ('accept with min(1, q/p)', 'exercise6',
     'if rng.random() < min(1.0, p[i, x] / q[i, x]):', 'if rng.random() < min(1.0, q[i, x] / p[i, x]):'),
    ('resample from p instead of the residual', 'exercise6',
     'p=residual_distribution(p[i], q[i])', 'p=p[i]'),
    ('no bonus token after k acceptances', 'exercise6',
     '    emitted.append(int(rng.choice(vocab_size, p=p[-1])))\n', ''),
    ('verification reads the target rows one position late', 'exercise7',
     'emitted = accept_or_resample(drafts, q_rows, p_rows, rng)', 'emitted = accept_or_resample(drafts, q_rows, np.vstack([p_rows[1:], p_rows[-1:]]), rng)'),
    ('draft rows q one position early', 'exercise7',
     'emitted = accept_or_resample(drafts, q_rows, p_rows, rng)', 'emitted = accept_or_resample(drafts, np.vstack([q_rows[:1], q_rows[:-1]]), p_rows, rng)'),
    ('draft cache not rolled back', 'exercise7',
     '            seq.rollback(committed + len(emitted) - 1)\n', '            seq.rollback(committed + len(emitted) - 1) if seq is target_seq else None\n'),
    ('KV bytes not split across tensor-parallel GPUs', 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp', 'kv_token = kv_bytes_per_token(model)'),
    ('KV blocks rounded up', 'exercise8',
     'num_kv_blocks = math.floor(free / block_bytes)', 'num_kv_blocks = math.ceil(free / block_bytes)'),
    ('block hash chained on whether there is a parent, not on its hash', 'exercise3',
     'key = repr((parent_hash, cache_salt,', 'key = repr((parent_hash is not None, cache_salt,'),
    ('allocate evicts a cached block that a table still holds', 'exercise3',
     '        else:\n            raise OutOfBlocksError', '        elif self._block_hash:\n            block_id = next(iter(self._block_hash))\n            self._evict(block_id)\n        else:\n            raise OutOfBlocksError'),
    ('the scheduler never registers computed blocks', 'exercise5',
     '            seq.block_table.cache_full_blocks(seq.num_computed_tokens, seq.block_hashes())  # K/V written now\n', ''),
    ('the target verifies the drafts one forward pass per token', 'exercise7',
     '        p_rows = token_probs(target_seq.run(), sampling.temperature)  # ONE pass: last + n_draft tokens\n', '        p_rows = token_probs(np.concatenate([target_seq.model.forward(target_seq.cache, [target_seq.table], [s], [1])\n                                             for s in range(target_seq.num_computed, target_seq.table.num_tokens)]),\n                             sampling.temperature)\n        target_seq.num_computed = target_seq.table.num_tokens\n'),
    ('blocks_needed wrong at 1 token', 'exercise1',
     'return (num_tokens + block_size - 1) // block_size', 'return 0 if num_tokens <= 1 else (num_tokens + block_size - 1) // block_size'),
    ('blocks_needed wrong at block_size + 1 tokens', 'exercise1',
     'return (num_tokens + block_size - 1) // block_size', 'return max(1, num_tokens // block_size) if num_tokens else 0'),
    ("fork without incref: freeing one table frees the other's blocks", 'exercise2',
     '        for block_id in self.block_ids:\n            self.allocator.incref(block_id)\n', ''),
    ('copy-on-write only for cached blocks, not for forked ones', 'exercise2',
     'return self.allocator.ref_count(block_id) > 1 or self.allocator.is_cached(block_id)', 'return self.allocator.is_cached(block_id)'),
    ('model path: slot = offset * block_size + block', 'exercise4',
     'slots.append(table.slots(start, stop))', 'slots.append((np.arange(start, stop) % table.block_size) * table.block_size + np.asarray(table.block_ids)[np.arange(start, stop) // table.block_size])'),
    ('paged_attention: softmax over the slots past context_lens', 'exercise4',
     '            np.copyto(scores, -np.inf, where=past_end[:, None, :])   # mask by position\n', '            pass\n'),
    ('causal mask relative to the chunk, not the absolute position', 'exercise4',
     'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]', 'mask = np.arange(stop)[None, :] <= np.arange(0, stop - start)[:, None]'),
    ('causal mask lets a token see the next one', 'exercise4',
     'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None]', 'mask = np.arange(stop)[None, :] <= np.arange(start, stop)[:, None] + 1'),
    ('attention gathers every block column at once (a copy of the whole K/V)', 'exercise4',
     'step = max(1, PAGED_ATTENTION_CHUNK_BYTES // column_bytes)', 'step = max(1, block_tables.shape[1])'),
    ('running prefill chunk not capped by the token budget', 'exercise5',
     'num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)', 'num_new = seq.num_tokens - seq.num_computed_tokens'),
    ('residual max(0, p - q) not normalised', 'exercise6',
     '    return residual / mass\n', '    return residual\n'),
    ('target cache not rolled back', 'exercise7',
     '            seq.rollback(committed + len(emitted) - 1)\n', '            seq.rollback(committed + len(emitted) - 1) if seq is draft_seq else None\n'),
    ('weights not split across tensor-parallel GPUs', 'exercise8',
     'weight_bytes = model.weight_bytes / tp', 'weight_bytes = model.weight_bytes'),
    ('K-only KV bytes (no factor 2) in plan_deployment', 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp', 'kv_token = model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes // tp'),
    ('num_attention_heads instead of num_kv_heads in plan_deployment', 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp', 'kv_token = 2 * model.num_layers * model.num_attention_heads * model.head_dim * model.dtype_bytes // tp'),
    ('int8 KV cache: scales not copied on copy-on-write', 'provided',
     'for array in (self.k, self.v, self.k_scale, self.v_scale):', 'for array in (self.k, self.v):'),
    ('int8 KV cache: one scale per write instead of per token and head', 'provided',
     'scale = np.abs(x).max(axis=-1) * np.float32(1.0 / 127.0)', 'scale = np.full(x.shape[:-1], np.abs(x).max(), np.float32) * np.float32(1.0 / 127.0)'),
    ('int8 KV cache: prefill reads int8 values without their scales', 'exercise4',
     'return dequantize_int8(views[0][slots], views[2][slots]), dequantize_int8(views[1][slots], views[3][slots])', 'return views[0][slots].astype(np.float32), views[1][slots].astype(np.float32)'),
    ('int8 KV cache: kernel leaves the V scales out of the weighted sum', 'exercise4',
     '            p *= v_s.transpose(0, 2, 1)               # int8: sum p (s v) = sum (p s) v\n', '            pass\n'),
    ('int8 KV cache: kernel leaves the K scales out of the scores', 'exercise4',
     '            scores *= k_s.transpose(0, 2, 1)          # int8: q . (s k) = s (q . k)\n', '            pass\n'),
    ('int8 KV cache: the gather reads the scales of the first blocks, not of the ids', 'provided',
     's = np.take(self.scales[i], ids, axis=0,', 's = np.take(self.scales[i], np.arange(ids.size).reshape(ids.shape), axis=0,'),
    ('paged_attention: stale slots checked on the longest sequence, not the shortest', 'exercise4',
     'stale = lens[n - 1] < (j + ids.shape[1]) * block_size', 'stale = lens[0] < (j + ids.shape[1]) * block_size'),
    ('forward ignores logits_indices: the LM head runs on every row', 'exercise4',
     'return self._logits(x if rows is None else x[rows])', 'return self._logits(x)'),
    ("engine samples each prefill chunk's first row, not its last", 'exercise5',
     'last_rows = np.cumsum(num_new) - 1', 'last_rows = np.cumsum(num_new) - np.array(num_new)'),
    ('forward takes a cache of another block size', 'exercise4',
     'if getattr(table, "block_size", None) != block_size:', 'if False:'),
    ("KV bytes from the weights' dtype, not the KV cache's, in plan_deployment", 'exercise8',
     'kv_token = kv_bytes_per_token(model) // tp', 'kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype_bytes // tp'),
    ('disconnected client not aborted', 'exercise5',
     '                if not state.finished:  # the client went, or a choice failed: the rest must not run on\n', '                if False:\n', 'serving/serving_engine.py'),
    ('load generator: TPOT divided by chunks, not tokens', 'provided',
     'result.send_time, times, times[-1], result.num_output_tokens)', 'result.send_time, times, times[-1], len(times))', 'loadtest/benchmark_serving.py'),
    ('load generator: goodput ignores the TPOT SLO', 'provided',
     'and (slo_tpot is None or r.num_output_tokens < 2 or m.tpot <= slo_tpot)]', ']', 'loadtest/benchmark_serving.py'),
    ('fleet: replicas rounded down', 'provided',
     'replicas = math.ceil(qps / rate_per_replica * (1 - 1e-12))', 'replicas = math.floor(qps / rate_per_replica)',
     'course/fleet.py'),
    ('fleet: a ring all-reduce charged half its traffic', 'provided',
     'ring_bytes_per_token = 2 * (tp - 1) / tp * hidden', 'ring_bytes_per_token = (tp - 1) / tp * hidden',
     'loadtest/costmodel.py'),
    ('fleet: p99 by interpolation, not nearest rank', 'provided',
     'return float(sorted(values)[max(1, math.ceil(round(q * len(values), 9))) - 1])',
     'return float(np.percentile(values, 100 * q))', 'course/fleet.py'),
    ('load generator: evenly spaced arrivals instead of Poisson', 'provided',
     'gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)', 'gaps = np.full(num_requests, 1.0 / rate)', 'loadtest/datasets.py'),
    ('an append that needs a copy-on-write block does not count it before taking blocks', 'exercise2',
     'if cow + new_blocks > self.allocator.num_free_blocks:', 'if new_blocks > self.allocator.num_free_blocks:'),
    ("a fork shares its parent's list of registered hashes", 'exercise3',
     'child.token_ids = list(self.token_ids)\n        child._block_hashes = list(self._block_hashes)',
     'child.token_ids = list(self.token_ids)\n        child._block_hashes = self._block_hashes'),
    ('stale V slots not cleared: 0 weight x NaN value', 'exercise4',
     'for gathered in (k, v, k_s, v_s):', 'for gathered in (k, k_s):'),
    ("online softmax keeps only the current chunk's max", 'exercise4',
     'new_max = np.maximum(m, scores.max(axis=-1, keepdims=True))', 'new_max = scores.max(axis=-1, keepdims=True)'),
    ("the engine hands out a finished request's id again", 'exercise5',
     '                request = Request(str(next_id), prompt, SamplingParams() if params is None else params)\n                next_id += 1\n', '                request = Request(str(next_id), prompt, SamplingParams() if params is None else params)\n'),
    ('a step that preempted still admits waiting requests', 'exercise5',
     'while self.waiting and not plan.preempted and', 'while self.waiting and'),
    ('update puts the sampled token into the block table before its K/V', 'exercise5',
     '            seq.output_token_ids.append(token)\n', '            seq.output_token_ids.append(token)\n            seq.block_table.append_tokens([token])\n'),
    ('the engine samples at temperature 1 whatever the request says', 'exercise5',
     'return int(rng.choice(p.size, p=p))', 'return int(rng.choice(p.size, p=token_probs(logits, 1.0)))'),
    ('top-p drops the token that crosses the mass', 'provided',
     'keep = np.cumsum(ranked, axis=-1) - ranked < top_p', 'keep = np.cumsum(ranked, axis=-1) < top_p'),
    ('top-k keeps one token too many', 'provided',
     'kth = np.partition(probs, vocab_size - top_k, axis=-1)[..., vocab_size - top_k, None]', 'kth = np.partition(probs, vocab_size - top_k - 1, axis=-1)[..., vocab_size - top_k - 1, None]'),
    ('min_p taken before the temperature', 'provided',
     'logits[np.exp((logits.astype(np.float64) - logits.max()) / temperature) < min_p] = -np.inf', 'logits[np.exp(logits.astype(np.float64) - logits.max()) < min_p] = -np.inf', 'serving/sampling.py'),
    ('presence penalty applied per occurrence', 'provided',
     'return logits - f * counts - p * (counts > 0)', 'return logits - f * counts - p * counts', 'serving/sampling.py'),
    ('repetition penalty multiplies positive logits instead of dividing them', 'provided',
     'np.where(logits > 0, logits / r, logits * r)', 'logits * r', 'serving/sampling.py'),
    ('repetition penalty ignores the prompt', 'provided',
     '            seen[np.asarray(seq.prompt_token_ids, dtype=np.int64)] = True\n', '', 'serving/sampling.py'),
    ('logit bias applied after the penalties', 'provided',
     'return [Logprobs(), MinTokens(eos_token_id), LogitBias(), Penalties(), MinP()]', 'return [Logprobs(), MinTokens(eos_token_id), Penalties(), LogitBias(), MinP()]', 'serving/sampling.py'),
    ('min_tokens masks nothing', 'provided',
     'if len(seq.output_token_ids) < _args(seq).get("min_tokens", 0):', 'if False:', 'serving/sampling.py'),
    ('EOS never ends a request', 'exercise5',
     '    engine_stops = tuple(stop_ids) + ((eos,) if eos is not None and eos not in stop_ids else ())', '    engine_stops = tuple(stop_ids)', 'serving/protocol.py'),
    ('ignore_eos ignored', 'exercise5',
     '    eos = None if ignore_eos else served.tokenizer.eos_token_id', '    eos = served.tokenizer.eos_token_id', 'serving/protocol.py'),
    ('stop_reason not recorded', 'exercise5',
     '                self.stop_reason = self.token_ids[-1]  # the stop token, as vLLM reports it (None for EOS)\n', '                pass\n', 'serving/output.py'),
    ('logprobs of the temperature-scaled logits', 'exercise5',
     '            self.rows[seq.request_id] = np.array(logits, dtype=np.float32)  # later processors change the row', '            self.rows[seq.request_id] = np.array(logits, dtype=np.float32) / max(seq.sampling.temperature, 1e-3)', 'serving/sampling.py'),
    ("prompt logprob rows run into the prompt's last row", 'exercise5',
     '    logits = model.forward_dense(prompt_token_ids)[:-1]', '    logits = model.forward_dense(prompt_token_ids)[1:]', 'serving/sampling.py'),
    ('prompt logprobs one token late', 'exercise5',
     '    return [None, *token_logprobs(logits, prompt_token_ids[1:], num_top)]', '    return [None, *token_logprobs(logits, prompt_token_ids[:-1], num_top)]', 'serving/sampling.py'),
    ('the samples of n share one generator', 'exercise5',
     'seed=None if seed is None else seed + j,', 'seed=seed,', 'serving/protocol.py'),
    ('the samples of n do not count against max_num_seqs', 'provided',
     'max_n = max(1, engine.scheduler.max_num_seqs // 2) if max_n is None else max_n', 'max_n = engine.scheduler.max_num_seqs if max_n is None else max_n', 'serving/api_server.py'),
    ("the samples of n copy the prompt's blocks instead of sharing them", 'exercise5',
     '        share = n > 1 and share_prefix\n', '        share = False\n', 'serving/serving_engine.py'),
    ('the draft samples greedily while the target samples', 'exercise7',
     'q = token_probs(draft_seq.run()[-1], sampling.temperature)', 'q = token_probs(draft_seq.run()[-1], 0.0)'),
    ('decode step reads all the weights on every tensor-parallel GPU', 'exercise8',
     'step_bytes = weight_bytes + max_seqs', 'step_bytes = model.weight_bytes + max_seqs'),
    ('prefill FLOPs not split across tensor-parallel GPUs', 'exercise8',
     'prefill_s = 2 * model.num_params * mean_prompt_len / (tp * gpu.flops)', 'prefill_s = 2 * model.num_params * mean_prompt_len / gpu.flops'),
    ('stop string not held back across a token boundary', 'exercise5',
     'release = len(self.text) if self.finished else len(self.text) - self._hold_back()', 'release = len(self.text)', 'serving/output.py'),
    ("stop string searched only in the newest token's text", 'exercise5',
     'if (at := self.text.find(s, max(0, before - len(s) + 1))) >= 0]', 'if (at := self.text.find(s, before)) >= 0]', 'serving/output.py'),
    ("a failed step's requests never answered: the engine core waits for nothing", 'exercise5',
     'if self.send(("failed", f"the engine failed: {type(exc).__name__}: {exc}")):', 'if False:', 'serving/async_llm.py'),
    ("one response's choices all go to the engine at once", 'provided',
     'while self.ready and len(self.running) < self.cap:', 'while self.ready:', 'serving/serving_engine.py'),
    ("a finished choice keeps its place among one response's running ones", 'provided',
     '        if finished:\n            self.running.discard(request_id)', '        if False:\n            pass',
     'serving/serving_engine.py'),
    ("an engine refusal keeps the engine's request id", 'provided',
     'APIError(error.removeprefix(f"request {request_id!r}: "), param=field)', 'APIError(error, param=field)',
     'serving/async_llm.py'),
    ("an engine refusal keeps the engine's name for the field", 'provided',
     'message = message.replace(field.split("[", 1)[0], param, 1)', 'pass', 'serving/protocol.py'),
    ("the load generator's client leaves the chunked framing in the body", 'provided',
     'if headers.get("transfer-encoding", "").lower() == "chunked":', 'if False:', 'loadtest/benchmark_serving.py'),
    ("the load generator's client waits without a deadline", 'provided',
     'for exchange in [e for e in self.active if e.deadline <= now]:', 'for exchange in []:', 'loadtest/benchmark_serving.py'),
    ("the load generator's client reports a finished stream as timed out while its framing drains", 'provided',
     '                if not exchange.parser.decided:\n                    exchange.result.error = "TimeoutError', '                if True:\n                    exchange.result.error = "TimeoutError', 'loadtest/benchmark_serving.py'),
    ("the load generator's client waits its whole timeout for a finished response's last chunk", 'provided',
     'self.deadline = min(self.deadline, time.perf_counter() + DRAIN_S)', 'pass', 'loadtest/benchmark_serving.py'),
    ("the load generator's client sends every request at once, whatever its arrival time", 'provided',
     'while order and start + arrivals[order[-1]] <= now:', 'while order:', 'loadtest/benchmark_serving.py'),
    ("the load generator's client reports an error with a huge chunk as over the limit, not by its status", 'provided',
     "if self.status != 200:  # an error's status says what matters; its text can go unread", 'if False:', 'loadtest/benchmark_serving.py'),
    ('a server whose front end was killed runs on, unreachable', 'provided',
     '        return self._core.join(timeout)\n', '        return False\n', 'serving/api_server.py'),
    ("the load generator's client never reuses a kept-alive connection", 'provided',
     '            self.client.finish(self, reuse=self.parser.keep_alive and not self.parser.buffer)\n', '            self.client.finish(self, reuse=False)\n', 'loadtest/benchmark_serving.py'),
    ("the load generator's client fails a request on a connection the server closed while idle", 'provided',
     'if self.reused and not self.received and isinstance(exc, ConnectionError):', 'if False:', 'loadtest/benchmark_serving.py'),
    ('the engine reads a command with one read, whatever arrived', 'provided',
     '        while len(data) < n:\n            chunk = os.read(self.fd, n - len(data))', '        if True:\n            chunk = os.read(self.fd, n - len(data))', 'serving/async_llm.py'),
    ("the front end's loop writes its commands blocking", 'provided',
     '        os.set_blocking(self.fd, False)\n        self._loop, self._on_gone = loop, on_gone', '        self._on_gone = on_gone', 'serving/async_llm.py'),
    ('a command that does not fit the pipe is dropped, not kept for later', 'provided',
     '        self._wait_writable(bool(self._unsent))', '        self._unsent.clear()', 'serving/async_llm.py'),
    ('stop string not aborted in the engine', 'exercise5',
     '                if not item.finished:  # a stop string: the engine must stop too\n                    self.bridge.abort(item.request_id)\n', '', 'serving/serving_engine.py'),
    ('each token detokenized alone (U+FFFD for a split character)', 'exercise5',
     'return self._decoder.decode(self.tokenizer.token_bytes(token_id))', 'return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")', 'checkpoints/tokenizer.py'),
    ('keep-alive connection closed after one request', 'provided',
     'return sink.keep_alive and not self.stopping', 'return False', 'serving/http_server.py'),
    ('Connection: close not honoured', 'provided',
     'keep_alive = "close" not in tokens if', 'keep_alive = True if', 'serving/http_server.py'),
    ('HEAD answered with the body', 'provided',
     'body = b"" if self.request.method == "HEAD" else data', 'body = data', 'serving/http_server.py'),
    ('an HTTP/1.0 stream sent chunked', 'exercise5',
     'self.chunked = length is None and self.request.version == "HTTP/1.1"', 'self.chunked = length is None', 'serving/http_server.py'),
    ('close() waits for idle keep-alive connections', 'provided',
     '            if conn.idle:\n                task.cancel()\n', '            if conn.idle:\n                pass\n', 'serving/http_server.py'),
    ('model name not checked', 'provided',
     'if model and model not in served.names:', 'if False:', 'serving/protocol.py'),
    ('temperature defaults to greedy', 'provided',
     'temperature = f.number("temperature", 1.0)', 'temperature = f.number("temperature", 0.0)', 'serving/protocol.py'),
    ('engine sampling fields silently dropped', 'provided',
     '    for name, value in values.items():\n        if name not in EXTRA_ARGS:', '    for name, value in {}.items():\n        if name not in EXTRA_ARGS:', 'serving/sampling.py'),
    ('echo ignored', 'provided',
     'choice: dict = {"index": state.index, "text": (self.prompt_of(gen, state.index)[1] if gen.echo and first\n                                                       else "") + text}', 'choice: dict = {"index": state.index, "text": text}', 'serving/serving_completion.py'),
    ('a large body parsed on the event loop', 'provided',
     'if len(request.body) <= INLINE_PARSE_BYTES:', 'if True:', 'serving/api_server.py'),
    ('NaN accepted as a number', 'provided',
     'payload = json.loads(body, parse_constant=_reject_constant)', 'payload = json.loads(body)', 'serving/protocol.py'),
    ('format_plan prints the block size in MB as MiB', 'exercise8',
     '{plan.block_bytes_per_gpu / 2**20:g} MiB', '{plan.block_bytes_per_gpu / 1e6:g} MiB', 'course/sizing.py'),
    ("the report's paged utilisation divides by the whole pool, not the blocks in use", 'exercise5',
     '"paged_utilization": len(filled) / (in_use * bs) if in_use else 0.0', '"paged_utilization": len(filled) / (allocator.num_blocks * bs) if in_use else 0.0', 'course/report.py'),
    ('the report calls a round that accepted all its (fewer than k) drafts a rejection', 'exercise7',
     'bonus = accepted == len(drafts)', 'bonus = accepted == k', 'course/report.py'),
    ('the report plans every context length with the fp16 cache', 'exercise8',
     'out["seqs"][dtype] = [lab.plan_deployment(p["model"], p["gpu"], n, kv_cache_dtype=dtype).max_concurrent_seqs', 'out["seqs"][dtype] = [lab.plan_deployment(p["model"], p["gpu"], n).max_concurrent_seqs', 'course/report.py'),
    ('a forked table loses the cache salt', 'exercise3',
     'child = BlockTable(self.allocator, self.cache_salt)', 'child = BlockTable(self.allocator)'),
    ("the engine's block tables lose the request's cache salt", 'exercise5',
     'self.block_table = BlockTable(allocator, request.cache_salt)', 'self.block_table = BlockTable(allocator)'),
    ("a sequence hashes its blocks without the request's salt", 'exercise5',
     'hashes.append(hash_block(hashes[-1] if hashes else None, block, table.cache_salt))', 'hashes.append(hash_block(hashes[-1] if hashes else None, block))'),
    ("a step's blocks registered one step late", 'exercise5',
     '            seq.num_computed_tokens += plan.num_scheduled_tokens[seq.request_id]\n            seq.block_table.cache_full_blocks(seq.num_computed_tokens, seq.block_hashes())  # K/V written now\n', '            seq.block_table.cache_full_blocks(seq.num_computed_tokens, seq.block_hashes())  # K/V written now\n            seq.num_computed_tokens += plan.num_scheduled_tokens[seq.request_id]\n'),
    ('prefix-cache queries counted while caching is off', 'exercise3',
     '        if not self.enable_prefix_caching:\n            return None\n        self.stats.queries += 1\n', '        self.stats.queries += 1\n        if not self.enable_prefix_caching:\n            return None\n'),
    ('register caches a block while caching is off', 'exercise3',
     'if not self.enable_prefix_caching or block_hash in self._cached or block_id in self._block_hash:', 'if block_hash in self._cached or block_id in self._block_hash:'),
    ('blocks_needed as a float ceiling', 'exercise1',
     'return (num_tokens + block_size - 1) // block_size', 'return math.ceil(num_tokens / block_size)'),
    ('speculation runs more rounds after a stop token', 'exercise7',
     'while len(out) < limit and not stop_ids.intersection(out):', 'while len(out) < limit:'),
    ('output-token rate of B tokens per decode step, prefill ignored', 'exercise8',
     'return self.mean_output_len * self.decode_step_s + self.max_concurrent_seqs * self.prefill_s', 'return self.mean_output_len * self.decode_step_s'),
    ('step never reports a request that finished without a new token (abort, rejection, error)', 'exercise5',
     '            if new or seq.finish_reason:\n', '            if new:\n'),
    ('a failing step leaves its sequences running', 'exercise5',
     '                self.abort_request(seq.request_id)\n                seq.finish_reason', '                seq.finish_reason'),
    ('without chunked prefill the budget check forgets the output', 'exercise5',
     'if not self.enable_chunked_prefill and worst > self.max_num_batched_tokens:', 'if not self.enable_chunked_prefill and len(seq.prompt_token_ids) > self.max_num_batched_tokens:'),
    ("a stream interval holds a choice's last tokens back until more come", 'exercise5',
     'if len(delta.token_ids) < self.stream_interval and not delta.finish_reason:', 'if len(delta.token_ids) < self.stream_interval:', 'serving/serving_engine.py'),
    ('/metrics counts generated tokens only of requests that complete', 'exercise5',
     'self.stats.counters["generation_tokens"] += len(delta.token_ids)', 'self.stats.counters["generation_tokens"] += len(state.token_ids) if state.finished else 0', 'serving/serving_engine.py'),
    ('server-sent events end with one newline, not a blank line', 'exercise5',
     'return self.piece(f"data: {data}\\n\\n".encode())', 'return self.piece(f"data: {data}\\n".encode())', 'serving/http_server.py'),
    ("simulator: a step's cost reads the context before its new tokens", 'exercise5',
     'context = sum(s.num_computed_tokens + plan.num_scheduled_tokens[s.request_id] for s in plan.scheduled)', 'context = sum(s.num_computed_tokens for s in plan.scheduled)', 'loadtest/simulator.py'),
    ('simulator: a step costs memory time plus compute time', 'provided',
     'return max(memory, self.compute_time_per_token * num_tokens)', 'return memory + self.compute_time_per_token * num_tokens', 'loadtest/simulator.py'),
    ('format_plan prices a tensor-parallel group as one GPU', 'exercise8',
     'return usd_per_gpu_hour * tp / (p.output_tokens_per_s * 3600) * 1e6', 'return usd_per_gpu_hour / (p.output_tokens_per_s * 3600) * 1e6', 'course/sizing.py'),
    ('TTFT histogram buckets count values below the bound, not up to it', 'provided',
     'self.counts[i] += value <= bound', 'self.counts[i] += value < bound', 'serving/metrics.py'),
    ("a static batch reserves each request's prompt, not its worst case", 'exercise5',
     'worst = blocks_needed(len(seq.prompt_token_ids) + seq.sampling.max_tokens, self.allocator.block_size)', 'worst = blocks_needed(len(seq.prompt_token_ids), self.allocator.block_size)'),
    ('a request that exactly fills the whole cache is rejected', 'exercise5',
     'if need > self.allocator.num_blocks:', 'if need >= self.allocator.num_blocks:'),
    ('check_request refuses a request that fills n_positions exactly', 'provided',
     'require(len(prompt) + s.max_tokens <= config.n_positions, "max_tokens",', 'require(len(prompt) + s.max_tokens < config.n_positions, "max_tokens",'),
    ('step reports a prefill chunk that sampled nothing', 'exercise5',
     '            if new or seq.finish_reason:\n', '            if True:\n'),
    ('step reports the same tokens again', 'exercise5',
     '                seq.num_reported += len(new)\n', ''),
    ("generate's outputs are reported again by the next step", 'exercise5',
     'return [self.requests.pop(seq.request_id).to_output() for seq in seqs]', 'return [seq.to_output() for seq in seqs]'),
    ("a sequence's block hashes stop at its prompt", 'exercise5',
     '(len(hashes) + 1) * size <= self.num_tokens:', '(len(hashes) + 1) * size <= len(self.prompt_token_ids):'),
    ("forked samples share their parent's seed", 'exercise5',
     'request.sampling, seed=None if seed is None else seed + i)) for i in range(1, n)]', 'request.sampling, seed=seed)) for i in range(1, n)]'),
    ('copy-on-write pairs are never copied in the KV cache', 'exercise5',
     '        self.kv_cache.copy_blocks(plan.blocks_to_copy)  # before the forward writes into the copies\n', ''),
    ('a forked sample gets a table of its own instead of sharing its blocks', 'exercise5',
     '        child.block_table = self.block_table.fork()\n', '        child.block_table.allocate_prompt(self.block_table.token_ids)\n'),
    ('a token time stamped for a prefill chunk that sampled nothing', 'exercise5',
     '            if seq.request_id in sampled_token_ids:\n                seq.token_times.append(now)', '            if seq.request_id in plan.num_scheduled_tokens:\n                seq.token_times.append(now)'),
    ('generate leaves the rest of its batch running after a step raised', 'exercise5',
     '            for seq in seqs:\n                self.abort_request(seq.request_id)\n', '            for seq in seqs:\n                pass\n'),
    ('the default cache holds one full-length sequence, not max_num_seqs', 'exercise5',
     'num_blocks = max_num_seqs * blocks_needed(model.config.n_positions, block_size)', 'num_blocks = blocks_needed(model.config.n_positions, block_size)'),
    ('summarize_serving counts rejected requests in the latencies', 'provided',
     'served = [o for o in outputs if o.metrics is not None and o.output_token_ids]', 'served = [o for o in outputs if o.metrics is not None]', 'serving/metrics.py'),
    ("the ceiling compares one GPU's KV pool with the whole model's weights", 'exercise8',
     'return "kv-blocks" if self.kv_pool_bytes > self.weight_bytes_per_gpu else "weights"', 'return "kv-blocks" if self.kv_pool_bytes > self.model.weight_bytes else "weights"'),
    ('decode compute not split across tensor-parallel GPUs', 'exercise8',
     'compute_s = 2 * model.num_params * max_seqs / (tp * gpu.flops)', 'compute_s = 2 * model.num_params * max_seqs / gpu.flops'),
    ('the trace draws each block table one step late', 'exercise5',
     '            "tables": tables,\n', '            "tables": before,\n', 'course/trace.py'),
    ('the trace takes the reference counts from the step before', 'exercise5',
     '            "ref": ref,\n', '            "ref": self.frames[-1]["ref"] if self.frames else ref,\n', 'course/trace.py'),
    ('the trace draws a recompute after a preemption as a first prefill', 'exercise5',
     'kind = "recompute" if seq.num_preemptions else "prefill"', 'kind = "prefill"', 'course/trace.py'),
    ("the trace counts a newcomer's first chunk in its prefix-cache hit", 'exercise5',
     'self._admitted[seq.request_id] = seq.num_computed_tokens', 'self._admitted[seq.request_id] = seq.num_computed_tokens + event.num_tokens', 'course/trace.py'),
    # issue 44: the engine's events (provided code around the exercises), held to its public state by tests/test_events.py
    ('the pool reports a block freed at every dropped reference, not its last', 'needs',
     '        if self.ref_count(block_id) == 0:\n            self._report(EngineEventType.FREED, block_id)',
     '        if True:\n            self._report(EngineEventType.FREED, block_id)'),
    ('the pool does not report an eviction', 'needs',
     'if self.stats.evictions > evictions:  #', 'if False:  #'),
    ('the pool does not report a prefix hit', 'needs',
     '            self._report(EngineEventType.PREFIX_HIT, block_id)\n', '            pass\n'),
    ('the pool reports a register that cached nothing', 'needs',
     'if not was_cached and self.is_cached(block_id):', 'if not was_cached:'),
    ('a preemption is not reported', 'needs',
     '            self.observer(EngineEvent(EngineEventType.PREEMPTED, seq.request_id))\n', '            pass\n'),
    ('the request short of a block is not reported', 'needs',
     '                self.observer(EngineEvent(EngineEventType.OUT_OF_BLOCKS, seq.request_id, num_tokens=num_new_tokens))\n',
     '                pass\n'),
    ("a step's plan reported with the step's total for each sequence", 'needs',
     'num_tokens = plan.num_scheduled_tokens[seq.request_id]\n', 'num_tokens = plan.total_num_scheduled_tokens\n'),
    ('copy-on-write is not reported', 'needs',
     '            for pair in plan.blocks_to_copy:\n', '            for pair in ():\n'),
    ('the trace takes a block the events freed for one still held', 'needs',
     '                self._held.discard(b)\n', '                pass\n', 'course/trace.py'),
    ('issue 28: top_k larger than the vocabulary keeps one token', 'provided',
     '    if 0 < top_k < vocab_size:\n', '    if top_k > 0:\n'),
    ('issue 28: top_p keeps a token after the kept mass reached it exactly', 'provided',
     'keep = np.cumsum(ranked, axis=-1) - ranked < top_p', 'keep = np.cumsum(ranked, axis=-1) - ranked <= top_p'),
    ('issue 28: min_tokens lets the end-of-text token through', 'provided',
     'logits[np.array([*seq.sampling.stop_token_ids, *self.eos], dtype=np.int64)] = -np.inf', 'logits[np.array([*seq.sampling.stop_token_ids], dtype=np.int64)] = -np.inf', 'serving/sampling.py'),
    ('issue 28: min_tokens holds stop tokens back one output too long', 'provided',
     'if len(seq.output_token_ids) < _args(seq).get("min_tokens", 0):', 'if len(seq.output_token_ids) <= _args(seq).get("min_tokens", 0):', 'serving/sampling.py'),
    ('issue 28: a request gets the prompt logprobs of the last request added', 'exercise5',
     'self._prompt_logprobs.pop(request_id, None),', 'self._prompt_logprobs.popitem()[1] if self._prompt_logprobs else None,', 'serving/async_llm.py'),
    ("issue 28: the samples of n lose the request's sampling extras", 'exercise5',
     'extra = args if j == 0 or not args else {k: v for k, v in args.items() if k != "prompt_logprobs"} or None', 'extra = args if j == 0 else None', 'serving/protocol.py'),
    ('issue 28: of several stop strings, the first listed wins', 'provided',
     '*_, at, s = min(found)', '*_, at, s = found[0]', 'serving/output.py'),
    ('issue 28: top_logprobs without the chosen token', 'exercise5',
     'top = [(token_id, chosen)] + [(t, lp) for t, lp in pairs[:k] if t != token_id]', 'top = [(t, lp) for t, lp in pairs[:k]]', 'serving/output.py'),
    ('issue 28: chat logprobs without top_logprobs give none', 'exercise5',
     'logprobs=(top or 0) if want_logprobs else None', 'logprobs=top if want_logprobs else None', 'serving/chat.py'),
    ('issue 28: a streamed echo repeated in every chunk', 'exercise5',
     'if gen.echo and first', 'if gen.echo', 'serving/serving_completion.py'),
    ('issue 28: every choice echoes the first prompt', 'exercise5',
     '        i = index // gen.n\n', '        i = 0\n', 'serving/serving_completion.py'),
    ('issue 28: an HTTP/1.0 connection persists by default', 'provided',
     'else "keep-alive" in tokens', 'else "close" not in tokens', 'serving/http_server.py'),
    ('issue 28: a head ended by bare LFs waits for a CRLF blank line', 'provided',
     'HEAD_END = re.compile(rb"\\r?\\n\\r?\\n")', 'HEAD_END = re.compile(rb"\\r\\n\\r\\n")', 'serving/http_server.py'),
    ('issue 28: a request cut off by shutdown is closed without an answer', 'provided',
     '            conn.writer.write(error_response(SHUTTING_DOWN))\n            raise\n', '            raise\n', 'serving/http_server.py'),
    ('issue 28: an unknown field is logged at every request', 'provided',
     '            self._logged.update(new)\n', '            pass\n', 'serving/api_server.py'),
    ('issue 28: at most four stop strings, as OpenAI', 'exercise5',
     'MAX_STOP_STRINGS = 64', 'MAX_STOP_STRINGS = 4', 'serving/protocol.py'),
    ("issue 28: echoed text offsets skip a special token's text", 'provided',
     'IncrementalDetokenizer(tokenizer, skip_special_tokens=False), [], 0', 'IncrementalDetokenizer(tokenizer), [], 0', 'serving/output.py'),
    ('issue 28: only the first served name is answered', 'exercise5',
     'if model and model not in served.names:', 'if model and model != served.name:', 'serving/protocol.py'),
    ("issue 28: GPT-2's byte table keeps the soft hyphen as itself", 'provided',
     '*range(ord("®"), ord("ÿ") + 1)]', '*range(ord("\\xad"), ord("ÿ") + 1)]', 'checkpoints/tokenizer.py'),
    ('issue 28: min_tokens lets stop strings end the text early', 'provided',
     'if self.stop and len(self.token_ids) > self.min_tokens and self._cut_at_stop_string(before):', 'if self.stop and self._cut_at_stop_string(before):', 'serving/output.py'),
    # issue 35: the tests through the contract, and the first failures that check their cause
    ('a freed plain block of a caching allocator goes to the evictable queue', 'exercise1',
     'queue = self._evictable if block_id in self._block_hash else self._free',
     'queue = self._evictable if self.enable_prefix_caching else self._free'),
    ('num_free_blocks counts only the plain free queue', 'exercise1',
     'return len(self._free) + len(self._evictable)', 'return len(self._free)'),
    ("_evict forgets the block's hash but not the hash's block", 'exercise3',
     'del self._cached[self._block_hash.pop(block_id)]', 'self._block_hash.pop(block_id)'),
    ('paged_attention without the 1/sqrt(D) scale', 'exercise4',
     'qv = (q[order] * np.float32(1.0 / math.sqrt(head_dim)))[..., None]', 'qv = q[order][..., None]'),
    ('paged_attention reads whole blocks only (floor)', 'exercise4',
     'num_used = -(-lens // block_size)', 'num_used = lens // block_size'),
    ('paged_attention starts the running max at 0', 'exercise4',
     'run_max = np.full((batch, n_head, 1), -np.inf, np.float32)', 'run_max = np.zeros((batch, n_head, 1), np.float32)'),
    ('admissions not charged to the token budget', 'exercise5',
     '            plan.add(seq, num_new)\n            budget -= num_new\n        return plan',
     '            plan.add(seq, num_new)\n        return plan'),
    ('a sequence that preempted itself asks for blocks again', 'exercise5',
     '                if victim is seq:\n                    break\n', ''),
    ('accept_or_resample goes on after a rejection', 'exercise6',
     'p=residual_distribution(p[i], q[i]))))\n        return emitted\n', 'p=residual_distribution(p[i], q[i]))))\n'),
    ('speculative output not cut at a stop token accepted mid-round', 'exercise7',
     'return SpeculativeOutput(out[: first_stop + 1],', 'return SpeculativeOutput(out,'),
    ("the draft samples at temperature 1, not the target's", 'exercise7',
     'q = token_probs(draft_seq.run()[-1], sampling.temperature)', 'q = token_probs(draft_seq.run()[-1], 1.0)'),
    # issue 36: what real clients trip on
    ('issue 36: top_logprobs keep the first of tokens spelled alike, not the likeliest', 'provided',
     'out[text] = max(logprob, out.get(text, logprob))', 'out.setdefault(text, logprob)', 'serving/output.py'),
    ('issue 36: a chunked body is held to the limit chunk by chunk, not in total', 'provided',
     'if len(body) + size > limit:', 'if size > limit:', 'serving/http_server.py'),
    ("issue 36: a chunk's data is not checked for the CRLF after it", 'provided',
     'if await self.read_line(1) != b"":', 'if await self.read_line(1) is None:', 'serving/http_server.py'),
    ('issue 36: a chunk size read as decimal', 'provided',
     'return int(size, 16)', 'return int(size)', 'serving/http_server.py'),
    ('issue 36: blank lines before a request escape the head limit', 'provided',
     'if skipped + len(self.buffer) > MAX_HEADER_BYTES:', 'if len(self.buffer) > MAX_HEADER_BYTES:', 'serving/http_server.py'),
    ('issue 36: only a begun request line earns a 408, not blank lines', 'provided',
     'if conn.heard:  # a request (or blank lines)', 'if conn.buffer.strip():  # a request (or blank lines)', 'serving/http_server.py'),
    ('issue 36: a body that stops arriving is closed without a word', 'provided',
     '''raise APIError(f"the request's body did not arrive within {READ_TIMEOUT_S:g} s", 408) from None''', 'raise', 'serving/http_server.py'),
    ("issue 36: a request cut short by the client's end of stream is closed without a word", 'provided',
     '                if conn.heard:\n                    conn.writer.write(error_response(INCOMPLETE))\n', '', 'serving/http_server.py'),
    ('issue 36: an end of stream after a whole request is taken for a disconnect', 'provided',
     '                await self.fill()\n            return False\n', '                return not await self.fill()\n            return False\n', 'serving/http_server.py'),
    ('issue 36: the server closes at once, not gracefully (a reset destroys its error)', 'provided',
     '                await conn.linger()\n', '                pass\n', 'serving/http_server.py'),
    ('issue 36: the server installs no logits processors', 'provided',
     'engine.logits_processors = sampling.with_api_processors(', 'engine.logits_processors = list(', 'serving/api_server.py'),
    ('issue 36: an engine with any API processor is taken as having them all', 'provided',
     'if len(have) == len(kinds):', 'if have:', 'serving/sampling.py'),
    ("issue 36: close() leaves the API's processors in the engine", 'provided',
     '            self.engine.logits_processors = self._own_processors\n', '            pass\n', 'serving/api_server.py'),
    ('issue 36: at most 128 prompts a request again', 'provided',
     'MAX_CHOICES = 2048', 'MAX_CHOICES = 128', 'serving/protocol.py'),
    ('issue 36: serve --model DIR answers only to the directory name', 'provided',
     '                                                              args.model]))\n', '                                                              ][:1]))\n', 'course/cli.py'),
]


HINTS = ROOT / "tools" / "mutants_caught.json"  # mutant name -> the test (file::name) that caught it last time
SUITE = ["test_lab.py", "tests"]


def _pytest_env(module: str, pythonpath: str) -> dict:
    """The suite's environment for one mutant. Bytecode is written even where the caller asked
    for none (CI does): pytest keeps its rewritten test_lab.py there, and rewriting its asserts
    takes longer than most mutants' tests."""
    env = dict(os.environ, LAB_MODULE=module, PYTHONPATH=pythonpath, HYPOTHESIS_PROFILE="ci")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _pytest(project: Path, env: dict, selection: list[str]) -> tuple[int, list[str], str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", *selection, "-x", "-q", "-rf", "-p", "no:cacheprovider"],
                          cwd=project, env=env, capture_output=True, text=True)
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    return proc.returncode, failed, (proc.stdout + proc.stderr).strip()


def run(name: str, marker: str, path: str, source: str, workdir: Path, hint: str | None = None) -> tuple[bool, str]:
    """Whether the suite goes red on the mutant, and the test that did it. With a `hint` (the test
    that caught this mutant before) that test runs first; only if it passes does the mutant's
    whole marker run: the proof is the same (a test of the spec fails), found in a second."""
    workdir.mkdir(parents=True, exist_ok=True)
    if path == "solution.py":
        module = "mutant_" + "".join(c if c.isalnum() else "_" for c in name)[:40]
        (workdir / f"{module}.py").write_text(source)
        project, pythonpath = ROOT, f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    else:  # a scratch copy of the project, with this one file mutated
        module, project, pythonpath = "solution", workdir / "project", os.environ.get("PYTHONPATH", "")
        # __pycache__ comes along: it holds test_lab.py with pytest's assertions already rewritten
        # (about 4 s to redo per process), valid in the copy because copytree keeps mtimes.
        shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".git", ".hypothesis", ".venv"))
        (project / path).write_text(source)
    env = _pytest_env(module, pythonpath)
    if hint:
        code, failed, _ = _pytest(project, env, [hint])
        if code == 1 and failed:
            return True, failed[0]
    # serving/'s tests that run the exercises' code are marked needs(N), not exerciseN
    code, failed, out = _pytest(project, env, [*SUITE, "-m", marker if path == "solution.py" else f"{marker} or needs"])
    if failed:
        return code == 1, failed[0]
    return False, out.splitlines()[-1:] or f"pytest exited {code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("-j", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    parser.add_argument("--no-hints", action="store_true", help="run each mutant's whole marker, ignoring " + HINTS.name)
    args = parser.parse_args(argv)
    hints = {} if args.no_hints or not HINTS.exists() else json.loads(HINTS.read_text())
    chosen = [(name, marker, old, new, where[0] if where else "solution.py")
              for name, marker, old, new, *where in MUTANTS if args.k in name]
    survivors, caught_by = 0, {}
    # Once, before the workers start: pytest rewrites test_lab.py's asserts into __pycache__.
    _pytest(ROOT, _pytest_env("solution", os.environ.get("PYTHONPATH", "")), [*SUITE, "--collect-only"])

    def one(i: int, mutant: tuple) -> tuple[str, bool, str, float]:
        name, marker, old, new, path = mutant
        text = (ROOT / path).read_text()
        if text.count(old) != 1:
            return name, False, f"the text to mutate occurs {text.count(old)} times in {path}", 0.0
        start = time.perf_counter()
        caught, test = run(name, marker, path, text.replace(old, new), Path(tmp) / str(i), hints.get(name))
        return name, caught, test, time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, args.j)) as pool:
        for name, caught, test, seconds in pool.map(one, range(len(chosen)), chosen):  # in table order
            survivors += not caught
            if caught:
                caught_by[name] = test
            verdict = "caught by" if caught else "SURVIVED:"
            print(f"{'ok' if caught else '!!'} {name:<66} {verdict} {test}  ({seconds:.1f}s)", flush=True)
    if not args.k:  # a full run refreshes the hints (only this file's own mutants' names are kept)
        HINTS.write_text(json.dumps(dict(sorted(caught_by.items())), indent=1) + "\n")
    print(f"{survivors} mutant(s) survived")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
