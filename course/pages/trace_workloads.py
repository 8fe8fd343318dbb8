"""The trace's workloads: small runs that each teach one mechanism, on a toy GPT-2 (`python
solution.py trace --workload NAME`), and the replay of a `loadtest --save-workload` file.

A workload is its requests (`Arrival`: what is added, and before which step), the engine's settings
and what to look for on the page. The trace (trace.py) runs one on the module's own engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from types import ModuleType

import numpy as np

# The toy model every workload runs on: a step takes milliseconds, so a 200-step trace takes about
# a second. Blocks of 4 tokens make a table of a few dozen tokens a row of several blocks.
TRACE_MODEL = dict(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=4)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request of a workload, added between steps once `step` steps have run (0: before the first)."""

    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    cache_salt: str | None = None
    n: int = 1  # parallel samples, forked from the prompt's blocks (LLMEngine.add_request's n)

    def request(self, lab: ModuleType):
        sampling = lab.SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, seed=self.seed)
        return lab.Request(self.request_id, list(self.prompt), sampling, cache_salt=self.cache_salt)

    @property
    def request_ids(self) -> list[str]:
        """Its own id, then its samples' ("ID.1" ... "ID.{n-1}", as the engine names them)."""
        return [self.request_id] + [f"{self.request_id}.{i}" for i in range(1, self.n)]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload that teaches: its requests, the engine it runs on, and what to look for."""

    name: str
    title: str
    look_for: str
    engine: dict
    arrivals: tuple[Arrival, ...]
    model: dict = dataclasses.field(default_factory=lambda: dict(TRACE_MODEL))


def _tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(1, TRACE_MODEL["vocab_size"], n))


def skewed_workload() -> Workload:
    rng = np.random.default_rng(1)
    arrivals = [Arrival(0, "r0", _tokens(rng, 10), 96, seed=0)]
    for i in range(1, 16):
        arrivals.append(Arrival(0, f"r{i}", _tokens(rng, int(rng.integers(4, 15))), int(rng.integers(4, 13)), seed=i))
    return Workload(
        "skewed", "One long answer among many short ones (the seed's skewed workload)",
        "r0's long answer holds one of the 4 seats for the whole run, while the short requests flow through the other "
        "three: a seat that a finished request frees is taken by the next waiting one in the very next step "
        "(continuous batching). A static batch would have kept those seats empty until r0 finished.",
        dict(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32), tuple(arrivals))


SYSTEM_PROMPT_LEN = 16


def shared_prefix_workload() -> Workload:
    rng = np.random.default_rng(2)
    system = _tokens(rng, SYSTEM_PROMPT_LEN)
    plan = [  # (step, id, user tokens, max_tokens, salt)
        (0, "r0", 5, 8, None), (0, "r1", 7, 8, None), (2, "r2", 3, 6, None), (3, "r3", 9, 6, "tenant-b"),
        (4, "r4", 0, 6, None), (40, "r5", 6, 8, None), (41, "r6", 40, 12, None), (41, "r7", 36, 12, None),
        (48, "r8", 4, 6, None),
    ]
    arrivals = tuple(Arrival(step, rid, system + _tokens(rng, n), out, seed=i, cache_salt=salt)
                     for i, (step, rid, n, out, salt) in enumerate(plan))
    return Workload(
        "shared-prefix", f"A shared system prompt of {SYSTEM_PROMPT_LEN} tokens, with prefix caching",
        "r0 and r1 arrive together and share nothing: a block enters the prefix cache only after the forward pass "
        "that wrote it. r2, admitted two steps later, reuses r0's four system-prompt blocks (their reference counts "
        "go above 1); r3 has another cache_salt and reuses none. r4's prompt is exactly the system prompt: it reuses "
        "three blocks and recomputes the last into a private one, so no request ever writes into a shared block "
        "(the copy-on-write line stays 'none'). Between requests the cached blocks stay in the pool, evictable with "
        "reference count 0, until r5 revives them; r6 and r7 then need so many blocks that the least recently used "
        "cached blocks are evicted, while the system prompt's, in use, survive for r8.",
        dict(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=True),
        arrivals)


def memory_pressure_workload() -> Workload:
    rng = np.random.default_rng(3)
    arrivals = tuple(Arrival(0, f"r{i}", _tokens(rng, int(rng.integers(6, 10))), int(rng.integers(20, 29)), seed=i)
                     for i in range(6))
    return Workload(
        "memory-pressure", "Six growing answers in a pool of 16 blocks",
        "The pool runs dry as the answers grow. Then the newest running request is preempted: its blocks go back to "
        "the pool at once, its tokens are kept, and it waits at the FRONT of the queue. Readmitted, it recomputes "
        "its prompt and everything it had generated in one prefill (kind: recompute) before it decodes again.",
        dict(num_blocks=16, block_size=4, max_num_seqs=6, max_num_batched_tokens=32), arrivals)


def arrivals_workload() -> Workload:
    rng = np.random.default_rng(4)
    arrivals = []
    step = 0
    for i in range(14):
        # Seeds from 100: with seed 0, r0's second draw falls 5e-8 from a boundary of its token CDF, so
        # its prefill in chunks and in one piece (which round differently) would sample different tokens.
        arrivals.append(Arrival(step, f"r{i}", _tokens(rng, int(rng.integers(4, 41))), int(rng.integers(4, 17)),
                                seed=100 + i))
        step += int(rng.exponential(4.0))
    return Workload(
        "arrivals", "A stream of arrivals, with chunked prefill",
        "Requests join between steps, at the step shown under 'arrived'. The token budget is 16 a step, so a long "
        "prompt is prefilled in chunks of what the running requests' decodes leave of it (kind: prefill, several "
        "steps in a row) while they keep decoding; a newcomer waits only while the 4 seats or the budget are taken.",
        dict(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=16), tuple(arrivals))


def parallel_sampling_workload() -> Workload:
    rng = np.random.default_rng(5)
    arrivals = (Arrival(0, "r0", _tokens(rng, 10), 8, seed=0, n=3), Arrival(0, "r1", _tokens(rng, 6), 6, seed=9))
    return Workload(
        "parallel-sampling", "Three samples of one prompt, forked (parallel sampling, copy-on-write)",
        "r0 asks for n = 3 samples. Its prompt of 10 tokens runs once (step 1); in that step r0.1 and r0.2 fork "
        "its block table: all three hold the same 3 blocks, reference count 3, and each draws its first token from "
        "the same logits. In step 2 each writes that token at position 10, into the shared, half-full third block: "
        "r0 and r0.1 each get a private copy of it first (the copy-on-write line shows the (src, dst) pairs, which "
        "the engine copies in the KV cache before the forward pass), and r0.2, its last holder, writes in place. "
        "The two full blocks stay shared to the end; r1 beside them shares nothing.",
        dict(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=32), arrivals)


WORKLOADS = {
    "skewed": skewed_workload,
    "shared-prefix": shared_prefix_workload,
    "memory-pressure": memory_pressure_workload,
    "arrivals": arrivals_workload,
    "parallel-sampling": parallel_sampling_workload,
}

# A `loadtest --save-workload` file replayed on the toy model: its prompts are cut to fit.
FILE_MAX_REQUESTS, FILE_MAX_PROMPT, FILE_MAX_OUTPUT = 64, 48, 24


def workload_from_file(path: str) -> Workload:
    """Replay the JSONL that `loadtest --save-workload` writes (one {"prompt": text, "output_tokens":
    n} per line): every word of a prompt becomes one token id the toy model knows (a CRC of the
    word), prompts are cut to FILE_MAX_PROMPT tokens and outputs to FILE_MAX_OUTPUT (the toy model's
    context is 128), at most FILE_MAX_REQUESTS requests, all queued before the first step (the file
    has no send times: as `--qps inf`). A file that cannot be read or is not such JSONL is a
    ValueError that names it."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the workload file {path}: {exc}") from None
    arrivals = []
    total = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not JSON ({exc.msg}); expected what `loadtest "
                             "--save-workload` writes: one {\"prompt\": text, \"output_tokens\": n} per line") from None
        prompt, out = (row.get("prompt"), row.get("output_tokens")) if isinstance(row, dict) else (None, None)
        if not (isinstance(prompt, str) and prompt.split()):
            raise ValueError(f"{path}, line {number}: \"prompt\" must be a non-empty text, got {prompt!r}")
        if not (isinstance(out, int) and not isinstance(out, bool) and out >= 1):
            raise ValueError(f"{path}, line {number}: \"output_tokens\" must be an int >= 1, got {out!r}")
        total += 1
        if len(arrivals) < FILE_MAX_REQUESTS:
            ids = tuple(zlib.crc32(word.encode()) % TRACE_MODEL["vocab_size"] for word in prompt.split())
            arrivals.append(Arrival(0, f"r{len(arrivals)}", ids[:FILE_MAX_PROMPT], min(out, FILE_MAX_OUTPUT),
                                    seed=len(arrivals)))
    if not arrivals:
        raise ValueError(f"{path}: no requests in it; expected what `loadtest --save-workload` writes")
    kept = f"the first {len(arrivals)} of {total}" if total > len(arrivals) else f"{total}"
    return Workload(
        os.path.basename(path), f"{kept} requests of {os.path.basename(path)}, replayed on the toy model",
        f"Prompts cut to {FILE_MAX_PROMPT} tokens and outputs to {FILE_MAX_OUTPUT} (the toy model's context is "
        f"{TRACE_MODEL['n_positions']}), all queued before the first step (the file has no send times). Watch the "
        "waiting queue drain into the 8 seats. Eight long requests do not fit in 96 blocks at once, so the pool "
        "runs short and the newest are preempted (the red ticks); readmitted, a request finds the full blocks it "
        "had computed still in the prefix cache unless they were evicted meanwhile.",
        dict(num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True),
        tuple(arrivals))


def get_workload(name_or_path: str) -> Workload:
    """A workload by name, else the `loadtest --save-workload` file of that path."""
    if name_or_path in WORKLOADS:
        return WORKLOADS[name_or_path]()
    if not os.path.exists(name_or_path):
        raise ValueError(f"--workload {name_or_path!r}: no workload of that name ({', '.join(WORKLOADS)}) and no "
                         "file of that path")
    return workload_from_file(name_or_path)
