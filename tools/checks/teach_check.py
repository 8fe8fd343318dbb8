#!/usr/bin/env python3
"""Plant realistic mistakes in the exercises and read each first failure as a student sees it.

tools/checks/mutants.py proves that the suite catches its mistakes somewhere. This tool asks a second
question: what does a student who made the mistake read first? Each mistake is one
edit inside its exercise's region of solution.py, none of them one of tools/checks/mutants.py's. The
mutated module is written to a scratch folder and the student's command runs on it:
`LAB_MODULE=<mistake> python -m pytest -x -q -m exerciseN test_lab.py`. The tool reports the
first failing test, its exercise, the first lines of the error (pytest's `E   ` lines) and a
class:

  a  names the broken rule: an assertion of the exercise's own tests whose message matches the
     mistake's rule (the table's regular expression);
  b  shows the symptom precisely: an assertion of the exercise's tests with a message that does
     not name the rule;
  c  bare or misleading: an assertion without a message, or an error raised in the exercise's
     own code;
  d  escaped: every test of the exercise passed (the tool then runs all of test_lab.py to say
     where it is caught, if anywhere), or the first failure is a crash inside provided code.

`hint` says whether the message points to `python lab.py hint N`. The regular expressions
stand in for a reader: a message that states the rule in other words is a b to this tool, so
the report's own reading may differ; a message that matches and is wrong is not excused.

    python -m tools.checks.teach_check               # every mistake, two at a time
    python -m tools.checks.teach_check -k reseeded   # those whose name contains this
    python -m tools.checks.teach_check -e 5          # Exercise 5's
    python -m tools.checks.teach_check --json out.json
    python -m tools.checks.teach_check --held-out    # mistakes written after the messages, held out from them
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.handout.make_lab import BEGIN, END, ROOT

# (name, exercise, old text, new text, the rule a message must name: a regular expression)
MISTAKES: list[tuple[str, int, str, str, str]] = [
    # --- Exercise 1 ---------------------------------------------------------------------------
    ("allocate hands out the most recently freed block first", 1,
     "block_id, _ = self._free.popitem(last=False)", "block_id, _ = self._free.popitem()",
     r"least recently freed|free pool is a queue"),
    ("free puts every block of a caching allocator in the evictable queue", 1,
     "queue = self._evictable if block_id in self._block_hash else self._free",
     "queue = self._evictable if self.enable_prefix_caching else self._free",
     r"plain free|nothing to evict|not evictable"),
    ("num_free_blocks forgets the cached but unreferenced blocks", 1,
     "return len(self._free) + len(self._evictable)", "return len(self._free)",
     r"cached but unreferenced|evictable.{0,40}(free|count)|(free|count).{0,40}evictable"),
    # --- Exercise 2 ---------------------------------------------------------------------------
    ("fork hands the child the parent's own list of block ids", 2,
     "child.block_ids = list(self.block_ids)", "child.block_ids = self.block_ids",
     r"table of its own|own copy|not the same list|independent"),
    ("truncate keeps only the full blocks (floor, not blocks_needed)", 2,
     "keep = blocks_needed(num_tokens, self.block_size)", "keep = num_tokens // self.block_size",
     r"partly filled block stays|blocks_needed|keep \d+ blocks"),
    ("free releases the blocks first to last", 2,
     "        self.truncate(0)\n",
     "        for block_id in self.block_ids:\n            self.allocator.free(block_id)\n"
     "        self.block_ids, self.token_ids, self._block_hashes = [], [], []\n",
     r"the last first|last to the first|from the last|deepest block first"),
    # --- Exercise 3 ---------------------------------------------------------------------------
    ("lookup counts a hit as a second query", 3,
     "        self.stats.hits += 1\n", "        self.stats.hits += 1\n        self.stats.queries += 1\n",
     r"(every|each) lookup is one query"),
    ("cache_full_blocks registers every block under the last block's hash", 3,
     "self.allocator.register(self.block_ids[i], hashes[i])",
     "self.allocator.register(self.block_ids[i], hashes[-1])",
     r"registers? (every|each) full block|chained hash|findable"),
    ("allocate_prompt records every full block's hash as registered", 3,
     "self._block_hashes = hashes[: len(run)]", "self._block_hashes = hashes",
     r"not registered yet|registers? (every|each) full block|findable.{0,40}computed"),
    # --- Exercise 4 ---------------------------------------------------------------------------
    ("the kernel reads another sequence's table row (tables not reordered with the lengths)", 4,
     "block_tables[order, :width]", "block_tables[:, :width]",
     r"its own row|block_tables\[b|another sequence's"),
    ("the stale-slot mask lets the slot at context_lens through", 4,
     "past_end = j * block_size + np.arange(k.shape[1]) >= lens[:n, None]",
     "past_end = j * block_size + np.arange(k.shape[1]) > lens[:n, None]",
     r"past context_lens|stale slot"),
    ("online softmax rescales the sum but not the accumulator", 4,
     "        a *= rescale[..., None]\n", "",
     r"one softmax over the whole context"),  # the rule; how the chunks combine is the hint's
    # --- Exercise 5 ---------------------------------------------------------------------------
    ("a preempted sequence is left in the running list", 5,
     "victim = self.running.pop()  # the newest", "victim = self.running[-1]  # the newest",
     r"leaves? the running list|left in the running|still (in )?running"),
    ("a sequence preempted while asking for blocks is still scheduled in that step", 5,
     "            if seq.status != SequenceStatus.RUNNING:\n                break\n            plan.add(seq, num_new)",
     "            plan.add(seq, num_new)",
     r"not scheduled in the step|preempted.{0,40}scheduled"),
    ("a finished sequence is left in the running list", 5,
     "            self._finish(seq, reason)\n            finished.append(seq)",
     "            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason\n"
     "            seq.block_table.free()\n            finished.append(seq)",
     r"leaves? the batch|retire"),
    # --- Exercise 6 ---------------------------------------------------------------------------
    ("accept test at the u = 0, p = 0 boundary (u <= ratio)", 6,
     "if rng.random() < min(1.0, p[i, x] / q[i, x]):", "if rng.random() <= min(1.0, p[i, x] / q[i, x]):",
     r"below min\(1, p/q\)|strictly|u = 0"),
    ("residual max(0, q - p): draft and target swapped", 6,
     "residual = np.maximum(p - q, 0.0)", "residual = np.maximum(q - p, 0.0)",
     r"max\(0, p - q\)"),
    ("a rejection resamples from the first position's rows", 6,
     "p=residual_distribution(p[i], q[i])", "p=residual_distribution(p[0], q[0])",
     r"rejected position|p_1 - q_1"),
    ("the residual has no fall-back to p when p == q (0/0)", 6,
     "    if mass <= 0.0:\n        return p\n", "",
     r"residual is then p|no residual mass|never 0/0"),
    # --- Exercise 7 ---------------------------------------------------------------------------
    ("the generator is reseeded each round", 7,
     "        committed = target_seq.table.num_tokens\n",
     "        committed = target_seq.table.num_tokens\n        rng = np.random.default_rng(sampling.seed)\n",
     r"one generator|reseed"),
    ("a round rolls the caches back to one token too many", 7,
     "            seq.rollback(committed + len(emitted) - 1)\n", "            seq.rollback(committed + len(emitted))\n",
     r"rolled back|committed tokens"),
    ("a round drafts without room for its bonus token", 7,
     "n_draft = min(k, limit - len(out) - 1)", "n_draft = min(k, limit - len(out))",
     r"tokens still wanted - 1|bonus token needs a position|draft fewer tokens"),
    ("the draft's cache is never rolled back (only the target's is)", 7,
     "        for seq in (target_seq, draft_seq):\n            seq.rollback(committed + len(emitted) - 1)\n"
     "            seq.extend(emitted[-1:])\n",
     "        target_seq.rollback(committed + len(emitted) - 1)\n"
     "        for seq in (target_seq, draft_seq):\n            seq.extend(emitted[-1:])\n",
     r"both caches are rolled back|rolled back to the committed"),
    # --- Exercise 8 ---------------------------------------------------------------------------
    ("KV blocks rounded to the nearest, not floored", 8,
     "num_kv_blocks = math.floor(free / block_bytes)", "num_kv_blocks = round(free / block_bytes)",
     r"floor|whole blocks that fit"),
    ("concurrency from cache tokens, not whole blocks per sequence", 8,
     "max_seqs = num_kv_blocks // per_seq_blocks", "max_seqs = num_kv_blocks * block_size // max_model_len",
     r"owns? whole blocks"),
    ("a decode step charges the whole output, not half of it", 8,
     "context = mean_prompt_len + mean_output_len / 2", "context = mean_prompt_len + mean_output_len",
     r"half the output|mean_output_len / 2|prompt \+ half"),
]

# Mistakes held out from the messages above (written after them, so the messages were not written
# to match them). `--held-out` runs these instead of MISTAKES.
HELD_OUT: list[tuple[str, int, str, str, str]] = [
    # --- Exercise 1 ---------------------------------------------------------------------------
    ("blocks_needed counts a block too many at the boundary", 1,
     "return (num_tokens + block_size - 1) // block_size", "return (num_tokens + block_size) // block_size",
     r"needed only when|one too many|fewest"),
    ("free returns a shared block to the pool at every free", 1,
     "        if self._ref_counts[block_id] == 0:\n            queue =", "        if True:\n            queue =",
     r"last free|another table still holds"),
    ("allocate evicts the most recently freed cached block", 1,
     "block_id, _ = self._evictable.popitem(last=False)", "block_id, _ = self._evictable.popitem()",
     r"least recently used|least recently freed"),
    # --- Exercise 2 ---------------------------------------------------------------------------
    ("fork does not incref the shared blocks", 2,
     "        for block_id in self.block_ids:\n            self.allocator.incref(block_id)\n", "",
     r"one more reference|incref|reference count|reference on every block"),
    ("truncate keeps the hash of a block no longer full", 2,
     "        del self._block_hashes[num_tokens // self.block_size :]\n", "",
     r"no longer (full|registered)|stale"),
    ("copy-on-write keeps this table's reference on the shared block", 2,
     "            self.allocator.free(src)\n", "",
     r"drops? (its|this table's) reference|reference on the (old|shared) block"),
    # --- Exercise 3 ---------------------------------------------------------------------------
    ("_evict forgets the block's hash but the cache still maps the hash to it", 3,
     "del self._cached[self._block_hash.pop(block_id)]", "self._block_hash.pop(block_id)",
     r"no longer findable|evicted block|other tokens"),
    ("lookup revives an evictable block but leaves it in the evictable queue", 3,
     "        if self._ref_counts[block_id] == 0:\n            del self._evictable[block_id]\n", "",
     r"revive|leaves? the free pool|handed out twice"),
    ("register lets a second block take over a cached hash", 3,
     "block_hash in self._cached or block_id", "block_id",
     r"first registration|first copy stays"),
    # --- Exercise 4 ---------------------------------------------------------------------------
    ("the kernel forgets the 1/sqrt(D) scale", 4,
     "qv = (q[order] * np.float32(1.0 / math.sqrt(head_dim)))[..., None]", "qv = q[order][..., None]",
     r"sqrt\(D\)|scale"),
    ("the kernel reads one block too few (floor, not blocks_needed)", 4,
     "num_used = -(-lens // block_size)", "num_used = lens // block_size",
     r"every block|too few|last block|blocks_needed"),
    ("the running max starts at 0, not -inf: exp underflows for very negative scores", 4,
     "run_max = np.full((batch, n_head, 1), -np.inf, np.float32)", "run_max = np.zeros((batch, n_head, 1), np.float32)",
     r"running max (starts|begins)|-inf|very negative|underflow"),
    ("the stale slots are masked in the scores but not cleared (0 * NaN)", 4,
     "            for gathered in (k, v, k_s, v_s):\n                if gathered is not None:\n"
     "                    gathered[past_end] = 0.0\n", "",
     r"NaN|stale slot"),
    # --- Exercise 5 ---------------------------------------------------------------------------
    ("admission does not charge the token budget", 5,
     "            plan.add(seq, num_new)\n            budget -= num_new\n        return plan",
     "            plan.add(seq, num_new)\n        return plan",
     r"max_num_batched_tokens|token budget"),
    ("a preempted sequence keeps its computed count", 5,
     "        seq.num_computed_tokens = 0\n", "",
     r"recompute|num_computed_tokens"),
    ("a preempted sequence waits at the back of the queue", 5,
     "self.waiting.appendleft(seq)", "self.waiting.append(seq)",
     r"front of the queue|FRONT"),
    ("a step admits newcomers after a preemption", 5,
     "while self.waiting and not plan.preempted and", "while self.waiting and",
     r"preempted anyone admits nobody|admits nobody|no admission"),
    ("a sequence that preempted itself asks for blocks again", 5,
     "                if victim is seq:\n                    break\n", "",
     r"its own victim|preempted itself|not scheduled in the step"),
    ("update does not make the computed full blocks findable", 5,
     "            seq.block_table.cache_full_blocks(seq.num_computed_tokens, seq.block_hashes())  # K/V written now\n",
     "",
     r"findable|cache_full_blocks"),
    # --- Exercise 6 ---------------------------------------------------------------------------
    ("the residual is not normalised", 6,
     "    return residual / mass\n", "    return residual\n",
     r"normalis|sums? to 1"),
    ("the step goes on after a rejection", 6,
     "p=residual_distribution(p[i], q[i]))))\n        return emitted\n", "p=residual_distribution(p[i], q[i]))))\n",
     r"step ends|first rejection"),
    ("the bonus token is drawn from the last draft position's row", 6,
     "emitted.append(int(rng.choice(vocab_size, p=p[-1])))", "emitted.append(int(rng.choice(vocab_size, p=p[-2])))",
     r"target_probs\[k\]|bonus"),
    # --- Exercise 7 ---------------------------------------------------------------------------
    ("a round rolls the caches back one token too far", 7,
     "seq.rollback(committed + len(emitted) - 1)\n", "seq.rollback(committed + len(emitted) - 2)\n",
     r"rolled back|committed tokens"),
    ("the draft samples at temperature 1, not the target's", 7,
     "q = token_probs(draft_seq.run()[-1], sampling.temperature)", "q = token_probs(draft_seq.run()[-1], 1.0)",
     r"target's temperature"),
    ("the output is not cut at the first stop token", 7,
     "return SpeculativeOutput(out[: first_stop + 1],", "return SpeculativeOutput(out,",
     r"first stop token|stop token \(kept\)"),
    # --- Exercise 8 ---------------------------------------------------------------------------
    ("the weights are not split over tp", 8,
     "weight_bytes = model.weight_bytes / tp", "weight_bytes = model.weight_bytes",
     r"split over tp|1/tp of the weights|weights.{0,40}tp"),
    ("the decode FLOPs are not split over tp", 8,
     "compute_s = 2 * model.num_params * max_seqs / (tp * gpu.flops)",
     "compute_s = 2 * model.num_params * max_seqs / gpu.flops",
     r"over tp|1/tp of the FLOPs"),
    ("activation_bytes do not come off the budget", 8,
     "free = budget - weight_bytes - activation_bytes", "free = budget - weight_bytes",
     r"activation"),
]

TIMEOUT_S = 300
FRAME = re.compile(r"^(\S+\.py):(\d+): in (\S+)")


def regions(source: str) -> list[tuple[int, int, int]]:
    """(exercise, first line, last line) of every solution region (0-based line numbers)."""
    found = []
    start = None
    for i, line in enumerate(source.split("\n")):
        if m := BEGIN.match(line):
            start = (int(m.group(2)), i)
        elif END.match(line) and start:
            found.append((start[0], start[1], i))
            start = None
    return found


def plant(source: str, exercise: int, old: str, new: str) -> str:
    """`source` with the one edit, which must apply once and inside an Exercise `exercise` region."""
    if source.count(old) != 1:
        raise ValueError(f"the text to change occurs {source.count(old)} times in solution.py")
    first = source[: source.index(old)].count("\n")
    last = first + old.rstrip("\n").count("\n")
    if not any(n == exercise and a < first and last < b for n, a, b in regions(source)):
        raise ValueError(f"the text to change is not inside an Exercise {exercise} region")
    return source.replace(old, new)


def pytest_run(module: str, workdir: Path, args: list[str]) -> dict:
    """Run pytest on `module`; the first failure's test, exercise, error lines and innermost frame."""
    report = workdir / f"{module}-{len(args)}.json"
    env = dict(os.environ, LAB_MODULE=module, LAB_REPORT=str(report), HYPOTHESIS_PROFILE="ci",
               PYTHONPATH=f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "pytest", *args, "-x", "-q", "-rf", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"test": None, "timeout": True}
    out = proc.stdout.splitlines()
    failed = [line.split()[1] for line in out if line.startswith("FAILED ")]
    if not failed:
        return {"test": None, "returncode": proc.returncode, "tail": out[-1:]}
    rows = json.loads(report.read_text()) if report.exists() else []
    exercise = next((r["exercise"] for r in rows if r["test"] == failed[0]), None)
    first_e = next((i for i, line in enumerate(out) if line.startswith("E   ")), len(out))
    errors = []
    for line in out[first_e:]:
        if not line.startswith("E   "):
            break
        errors.append(line[4:])
    frames = [m for line in out[:first_e] if (m := FRAME.match(line))]
    frame = frames[-1].groups() if frames else None
    return {"test": failed[0].split("::", 1)[-1], "exercise": exercise, "errors": errors, "frame": frame}


def innermost_is_provided(frame, module: str, source: str, exercise: int) -> bool:
    """Whether the failure was raised in provided code: the packages beside the chapter, or the module
    outside the exercise's regions."""
    if frame is None:
        return False
    path, line, _ = frame
    if path.startswith(("serving", "checkpoints", "loadtest", "course")):
        return True
    if Path(path).stem != module:
        return False  # the test file, numpy, ...
    line = int(line) - 1
    return not any(n == exercise and a < line < b for n, a, b in regions(source))


def classify(result: dict, exercise: int, rule: str, module: str, source: str) -> tuple[str, bool]:
    if result.get("test") is None or result.get("exercise") != exercise:
        return "d", False
    text = "\n".join(result["errors"])
    hint = f"python lab.py hint {exercise}" in text
    assertion = bool(result["errors"]) and result["errors"][0].startswith(("AssertionError", "Failed", "assert "))
    if not assertion:
        return ("d" if innermost_is_provided(result["frame"], module, source, exercise) else "c"), hint
    if result["errors"][0].startswith("assert ") or text.startswith("AssertionError\n"):
        return "c", hint  # no message: pytest shows only the comparison
    return ("a" if re.search(rule, text, re.S) else "b"), hint


def check(i: int, mistake: tuple, source: str, workdir: Path) -> dict:
    name, exercise, old, new, rule = mistake
    module = f"teach_{i:02d}"
    planted = plant(source, exercise, old, new)
    (workdir / f"{module}.py").write_text(planted)
    result = pytest_run(module, workdir, ["-m", f"exercise{exercise}", "test_lab.py"])
    if result.get("test") is None and not result.get("timeout"):
        # Escaped its exercise: where does the rest of the spec catch it, if anywhere?
        elsewhere = pytest_run(module, workdir, ["test_lab.py", "tests"])
        result["caught_elsewhere"] = {k: elsewhere.get(k) for k in ("test", "exercise", "errors")}
    cls, hint = classify(result, exercise, rule, module, planted)
    return {"name": name, "exercise": exercise, "class": cls, "hint": hint, **result}


def show(row: dict) -> str:
    lines = [f"[{row['class']}{'+hint' if row['hint'] else ''}] Exercise {row['exercise']}: {row['name']}"]
    if row.get("timeout"):
        lines.append(f"    timed out after {TIMEOUT_S} s")
    elif row["test"] is None:
        lines.append("    passed every test of its exercise")
        other = row.get("caught_elsewhere") or {}
        if other.get("test"):
            lines.append(f"    first caught by {other['test']} (exercise {other['exercise']})")
            lines += [f"      E {e}" for e in (other.get("errors") or [])[:4]]
        else:
            lines.append("    and every other test of test_lab.py and tests/")
    else:
        lines.append(f"    first failure: {row['test']}")
        if row["frame"]:
            lines.append(f"    raised at {row['frame'][0]}:{row['frame'][1]} in {row['frame'][2]}")
        lines += [f"      E {e}" for e in row["errors"][:6]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mistakes whose name contains this")
    parser.add_argument("-e", "--exercise", type=int, action="append", help="only this exercise's mistakes")
    parser.add_argument("-j", type=int, default=os.cpu_count() or 2, help="mistakes run at once")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--held-out", action="store_true", help="the mistakes held out from the messages instead")
    args = parser.parse_args(argv)
    source = (ROOT / "solution.py").read_text()
    mistakes = HELD_OUT if args.held_out else MISTAKES
    chosen = [(i, m) for i, m in enumerate(mistakes) if args.k in m[0] and m[1] in (args.exercise or [m[1]])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, args.j)) as pool:
        for row in pool.map(lambda im: check(*im, source, Path(tmp)), chosen):
            rows.append(row)
            print(show(row), flush=True)
    counts = {c: sum(r["class"] == c for r in rows) for c in "abcd"}
    pointed = sum(r["hint"] for r in rows)
    print(f"\n{len(rows)} mistakes: {counts['a']} name the rule (a), {counts['b']} show the symptom (b), "
          f"{counts['c']} bare or misleading (c), {counts['d']} escaped (d); {pointed} point to the hint")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if counts["a"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
