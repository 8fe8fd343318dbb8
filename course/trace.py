"""`python solution.py trace`: watch the module's own engine run, one step at a time.

The trace runs a small workload through the module's `LLMEngine` (so through the student's
scheduler, block tables and allocator), records every step, and writes ONE self-contained HTML
page: the recording as inline JSON, the CSS and the script that draws a step inline, nothing
fetched, so it works from `file://`.

Recording wraps nothing and reads nothing private. The trace builds its own engine with a
`Recorder` as its observer (`LLMEngine(observer=...)`): the engine sends it an event for each
sequence a step runs, each preemption and the request that was short of a block, each
copy-on-write, and every block the pool allocates, finds in the prefix cache, caches, evicts and
frees. After each `engine.step()` it reads the queues, the block pool and the block tables through
public attributes and methods, and checks them against its own account of the pool, kept from the
events. An engine built without an observer sends nothing and runs the plain BlockAllocator:
tracing costs nothing when it is not asked for (`python solution.py bench trace` measures both).

The page's frame N is the state after step N (frame 0: before the first step), with what step N
did: the requests it ran (a prefill chunk, a decode step, or the recompute of a preempted one),
the prefix-cache hits of the ones it admitted, its preemptions and why, its copies, the pool's
events and the tokens it sampled. Every number the page draws at step N is read from frame N; the
script derives nothing but the slot ranges of a table's rows (from the recorded slot runs) and
each request's tokens so far.
"""

from __future__ import annotations

import collections
import dataclasses
import html
import json
import os
import zlib
from collections.abc import Sequence
from types import ModuleType

import numpy as np

# The toy model every workload runs on: a step takes milliseconds, so a 200-step trace takes about
# a second. Blocks of 4 tokens make a table of a few dozen tokens a row of several blocks.
TRACE_MODEL = dict(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=4)
MODEL_SEED = 0
MAX_STEPS = 1000  # a scheduler that never finishes still gets a page: the first MAX_STEPS steps


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
    arrivals, step = [], 0
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
    arrivals, total = [], 0
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


# =====================================================================================
# Running a workload, and recording it
# =====================================================================================


def build_engine(lab: ModuleType, workload: Workload, observer=None):
    """The workload's engine on the module's toy GPT-2; with `observer`, an engine that reports to it."""
    model = lab.ToyTransformer(lab.ModelConfig(**workload.model), seed=MODEL_SEED)
    if observer is None:
        return lab.LLMEngine(model, **workload.engine)
    return lab.LLMEngine(model, **workload.engine, observer=observer)


def drive(engine, lab: ModuleType, workload: Workload, recorder: Recorder | None = None,
          max_steps: int = MAX_STEPS) -> list[list]:
    """Run the workload on the engine: before each step add the requests whose step has come
    (an idle engine skips ahead to the next arrivals), then step, until every request is done or
    `max_steps` steps ran. Returns each step's outputs (`engine.step()`'s list)."""
    pending = collections.deque(sorted(workload.arrivals, key=lambda a: a.step))
    outputs: list[list] = []
    skipped = 0  # steps of the workload's clock that an idle engine skipped
    while (pending or engine.has_unfinished()) and len(outputs) < max_steps:
        if pending and not engine.has_unfinished():
            skipped = max(skipped, pending[0].step - len(outputs))
        arrived = []
        while pending and pending[0].step <= len(outputs) + skipped:
            arrival = pending.popleft()
            if arrival.n > 1:  # only then: a lab whose engine predates `n` still runs the other workloads
                arrived.append(engine.add_request(arrival.request(lab), n=arrival.n))
            else:
                arrived.append(engine.add_request(arrival.request(lab)))
        if recorder is not None:
            recorder.arrived(arrived)
        outputs.append(engine.step())
        if recorder is not None:
            recorder.stepped(outputs[-1])
    return outputs


def _slot_runs(slots: Sequence[int]) -> list[list[int]]:
    """Positions -> slots as runs `[first position, first slot, length]` of consecutive slots."""
    runs: list[list[int]] = []
    for pos, slot in enumerate(int(s) for s in slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([pos, slot, 1])
    return runs


STATES = {".": "free", "e": "cached", "h": "held", "H": "held+cached", "!": "inconsistent"}
POOL_EVENTS = ("allocated", "prefix_hit", "cached", "evicted", "freed")  # EngineEventType values, the pool's


class Recorder:
    """Records one engine's steps as frames (plain dicts, the page's JSON). It listens: it is the
    engine's observer (`build_engine(lab, workload, observer=recorder)`, then `watch(engine)`), and
    what a step did comes from the events the engine sent during it; the state after the step is
    read through public attributes and methods. It keeps its own account of the pool from the
    events (which blocks are out of the pool, which are cached) and reports every block where the
    allocator's own answers (`ref_count`, `is_cached`) disagree with it."""

    def __init__(self, lab: ModuleType):
        self.types = lab.EngineEventType
        self.engine = None
        self.frames: list[dict] = []
        self._held: set[int] = set()  # blocks the events took out of the pool and did not give back
        self._cached: set[int] = set()  # blocks the events made findable and did not evict
        self._arrived: list[str] = []
        self._begin_step()

    def watch(self, engine) -> None:
        """Start recording `engine`, built with this recorder as its observer: frame 0."""
        self.engine = engine
        self._begin_step()
        self.frames.append(self._frame(0, [], []))

    def _begin_step(self) -> None:
        """Forget the last step's events; the queues as the next step starts (public attributes)."""
        scheduler = self.engine.scheduler if self.engine is not None else None
        self._waiting_before = {seq.request_id for seq in scheduler.waiting} if scheduler else set()
        self._running_before = [seq.request_id for seq in scheduler.running] if scheduler else []
        self._ran: list[dict] = []
        self._admitted: dict[str, int] = {}
        self._preempted: list[dict] = []
        self._copies: list[list[int]] = []
        self._blocks: dict[str, list[int]] = {kind: [] for kind in POOL_EVENTS}
        self._short: tuple[str, int, int] | None = None  # the last sequence that found no free block

    def __call__(self, event) -> None:
        """One event from the engine, as it happens."""
        kind = event.type
        if kind is self.types.SCHEDULED:
            seq = self.engine.requests[event.request_id]
            self._ran.append(self._scheduled(seq, event.num_tokens))
            if seq.request_id in self._waiting_before:  # admitted now: what it starts from is its cache hit
                self._admitted[seq.request_id] = seq.num_computed_tokens
        elif kind is self.types.OUT_OF_BLOCKS:
            self._short = (event.request_id, event.num_tokens, self.engine.allocator.num_free_blocks)
        elif kind is self.types.PREEMPTED:
            self._preempted.append({"id": event.request_id, "reason": self._reason(event.request_id)})
        elif kind is self.types.COPIED:
            self._copies.append([int(b) for b in event.block_ids])
        else:
            self._account(kind.value, [int(b) for b in event.block_ids])

    def _account(self, kind: str, block_ids: list[int]) -> None:
        """A pool event, into this step's list and the recorder's own account of the pool."""
        self._blocks[kind] += block_ids
        for b in block_ids:
            if kind in ("allocated", "prefix_hit"):
                self._held.add(b)
            elif kind == "freed":
                self._held.discard(b)
            elif kind == "cached":
                self._cached.add(b)
            else:  # evicted
                self._cached.discard(b)

    def _reason(self, victim: str) -> str:
        """Why `victim` is being preempted, in words: who was short of a block, and whether the
        victim is the newest request still running (the one the chapter's scheduler picks)."""
        gone = {p["id"] for p in self._preempted}
        left = [rid for rid in self._running_before if rid not in gone]
        newest = left[-1] if left else None
        which = ("the newest running request" if victim == newest else
                 f"not the newest running request ({newest})" if newest else "a request that was not running")
        if self._short is None:
            return f"the pool had no free block for the running requests' next tokens; {victim} is {which}"
        who, n, free = self._short
        need = f"{who} needed a new block for its next {n} token{'s' if n != 1 else ''} and {free} were free"
        if who == victim:
            return f"{need}; {victim}, {which}, gave up its own blocks (it will recompute)"
        return f"{need}: {victim}, {which}, gave its blocks back (it will recompute)"

    @staticmethod
    def _scheduled(seq, n: int) -> dict:
        start, total, prompt = seq.num_computed_tokens, seq.num_tokens, len(seq.prompt_token_ids)
        if n == 1 and start == total - 1 and total > prompt:
            kind = "decode"
        else:
            kind = "recompute" if seq.num_preemptions else "prefill"
        return {"id": seq.request_id, "n": n, "kind": kind, "start": start, "samples": start + n == total}

    def arrived(self, request_ids: list[str]) -> None:
        """Requests added before the next step (frame 0 takes those added before the first)."""
        if len(self.frames) == 1:  # before the first step
            self.frames[0] = self._frame(0, request_ids, [])
        else:
            self._arrived = list(request_ids)
        self._begin_step()

    def stepped(self, outputs: list) -> None:
        """After `engine.step()` returned `outputs`: frame N, from the events of the step."""
        frame = self._frame(len(self.frames), self._arrived, outputs)
        self._arrived = []
        self.frames.append(frame)
        self._begin_step()

    def _pool(self) -> tuple[str, list[int], list[str]]:
        """Each block's state code (STATES) and reference count, as the allocator answers, and
        where those answers disagree with what the events said happened to the block."""
        alloc = self.engine.allocator
        codes, refs, problems = [], [], []
        for b in range(alloc.num_blocks):
            ref, cached = alloc.ref_count(b), alloc.is_cached(b)
            held = b in self._held
            if (ref > 0) != held or cached != (b in self._cached):
                codes.append("!")
                told = f"{'held' if held else 'free'}{', cached' if b in self._cached else ''}"
                problems.append(f"block {b}: the engine's events left it {told}, but the allocator says "
                                f"reference count {ref}{', cached' if cached else ''}")
            else:
                codes.append(("H" if cached else "h") if ref else ("e" if cached else "."))
            refs.append(ref)
        return "".join(codes), refs, problems

    def _tables(self) -> dict[str, dict]:
        """Every unfinished sequence's block table that holds blocks: its block ids, its tokens,
        its computed tokens and its positions -> slots as the table's own `slots()` gives them:
        None when they are `block * block_size + offset` for every position (the page then
        draws that), else their runs (`_slot_runs`), so a wrong mapping is drawn as it is."""
        scheduler, tables = self.engine.scheduler, {}
        for seq in [*scheduler.running, *scheduler.waiting]:
            table = seq.block_table
            if not table.block_ids:
                continue
            blocks, n, size = [int(b) for b in table.block_ids], table.num_tokens, table.block_size
            slots = np.asarray(table.slots(0, n))
            positions = np.arange(n)
            usual = slots.shape == (n,) and bool(np.all(slots == np.asarray(blocks)[positions // size] * size
                                                        + positions % size))
            tables[seq.request_id] = {"blocks": blocks, "tokens": n, "computed": seq.num_computed_tokens,
                                      "slots": None if usual else _slot_runs(slots.ravel())}
        return tables

    def _frame(self, step: int, arrived: list[str], outputs: list) -> dict:
        scheduler, stats = self.engine.scheduler, self.engine.allocator.stats
        state, ref, problems = self._pool()
        tables = self._tables()
        before = self.frames[-1]["tables"] if self.frames else {}
        holders = collections.Counter(b for t in tables.values() for b in t["blocks"])
        problems += [f"block {b} has reference count {r} but {holders[b]} block table(s) hold it"
                     for b, r in enumerate(ref) if r != holders[b]]
        return {
            "step": step,
            "arrived": list(arrived),
            "ran": self._ran if step else [],
            "admitted": self._admitted if step else {},
            "preempted": self._preempted if step else [],
            "copies": self._copies if step else [],
            "blocks": self._blocks if step else {kind: [] for kind in POOL_EVENTS},
            "sampled": {out.request_id: [int(t) for t in out.new_token_ids] for out in outputs if out.new_token_ids},
            "finished": {out.request_id: out.finish_reason for out in outputs if out.finish_reason},
            "waiting": [seq.request_id for seq in scheduler.waiting],
            "running": [seq.request_id for seq in scheduler.running],
            "state": state,
            "ref": ref,
            "tables": tables,
            "grew": {rid: [b for b in t["blocks"] if b not in before.get(rid, {}).get("blocks", ())]
                     for rid, t in tables.items()},
            "cache": [stats.queries, stats.hits, stats.evictions],
            "problems": problems,
        }


@dataclasses.dataclass
class Trace:
    """A recorded run: the workload, the engine's settings, one frame per step, and how it ended."""

    workload: Workload
    prog: str
    frames: list[dict]
    error: str | None = None  # the step that raised (not a stub), in words
    truncated: bool = False  # stopped after MAX_STEPS with requests unfinished

    @property
    def outputs(self) -> dict[str, list[int]]:
        """Each request's output tokens, as the steps returned them."""
        tokens: dict[str, list[int]] = {rid: [] for a in self.workload.arrivals for rid in a.request_ids}
        for frame in self.frames:
            for rid, new in frame["sampled"].items():
                tokens[rid] += new
        return tokens

    def data(self) -> dict:
        """What the page embeds: the run's settings, the requests, the frames."""
        w = self.workload
        return {
            "prog": self.prog, "workload": w.name, "title": w.title, "look_for": w.look_for,
            "engine": w.engine, "model": w.model, "error": self.error, "truncated": self.truncated,
            "num_blocks": w.engine["num_blocks"], "block_size": w.engine["block_size"],
            "requests": {rid: {"prompt": list(a.prompt), "max_tokens": a.max_tokens, "salt": a.cache_salt}
                         for a in w.arrivals for rid in a.request_ids},
            "frames": self.frames, "open": opening_step(self.frames),
        }


def opening_step(frames: list[dict]) -> int:
    """The step the page opens on (without `#step=N`): the first where the mechanisms show, a
    preemption, a copy-on-write or a prefix-cache hit; else the first that retires a request;
    else the first step that ran anything. Step 0 is the empty state before the run."""
    def hit(i: int) -> bool:
        return frames[i]["cache"][1] > frames[i - 1]["cache"][1]

    for wanted in (lambda i: frames[i]["preempted"] or frames[i]["copies"] or hit(i),
                   lambda i: frames[i]["finished"], lambda i: frames[i]["ran"]):
        found = next((i for i in range(1, len(frames)) if wanted(i)), None)
        if found is not None:
            return found
    return 0


def record(lab: ModuleType, workload: Workload, max_steps: int = MAX_STEPS) -> Trace:
    """Run the workload on a fresh engine of the module, recording every step. A stub raises its
    NotImplementedError (there is nothing to draw); any other error of a step ends the recording
    there, and the trace keeps the steps before it and says what raised."""
    recorder = Recorder(lab)
    engine = build_engine(lab, workload, observer=recorder)
    recorder.watch(engine)
    trace = Trace(workload, os.path.basename(lab.__file__), recorder.frames)
    try:
        drive(engine, lab, workload, recorder, max_steps)
    except NotImplementedError:
        raise
    except Exception as exc:
        trace.error = f"step {len(recorder.frames)} raised {type(exc).__name__}: {exc}"
    trace.truncated = trace.error is None and engine.has_unfinished()
    return trace


# =====================================================================================
# The page
# =====================================================================================


def page_json(trace: Trace) -> str:
    """The recording as the page embeds it: compact JSON that cannot close its <script>."""
    text = json.dumps(trace.data(), separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(trace: Trace) -> str:
    title = f"Trace of {trace.prog}: {trace.workload.title}"
    return (PAGE.replace("%TITLE%", html.escape(title))
                .replace("%CSS%", CSS)
                .replace("%SCRIPT%", SCRIPT)
                .replace("%DATA%", page_json(trace)))


def write_trace(lab: ModuleType, workload: str, path: str) -> Trace:
    """Record the workload (a name or a `loadtest --save-workload` file) on the module's engine
    and write the page to `path`."""
    trace = record(lab, get_workload(workload))
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render_page(trace))
    except OSError as exc:  # a ValueError: the command line says it in one line, exit 2
        raise ValueError(f"cannot write the page to {path}: {exc.strerror or exc}") from None
    return trace


CSS = """
:root { color-scheme: light; --ink: #222222; --muted: #5a5a5a; --line: #d0d0d0; }
* { box-sizing: border-box; }
body { margin: 0 auto; padding: 0 20px 40px; max-width: 1280px; color: var(--ink); background: #ffffff;
       font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
h1 { font-size: 21px; margin: 14px 0 2px; }
h2 { font-size: 15px; margin: 0 0 6px; }
header p { margin: 3px 0; color: #333333; max-width: 1180px; }
header .config { color: var(--muted); font-size: 13px; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 12.5px; }
#controls { position: sticky; top: 0; z-index: 2; background: #ffffff; display: flex; align-items: center;
            gap: 8px; padding: 8px 0; border-bottom: 2px solid #dddddd; }
#controls button { font: inherit; padding: 3px 10px; border: 1px solid #999999; border-radius: 4px;
                   background: #f6f6f6; cursor: pointer; min-width: 34px; }
#controls button:hover { background: #e8e8e8; }
#slider { flex: 1; }
#step-label { font-weight: 600; min-width: 130px; text-align: right; }
#timeline { display: block; width: 100%; height: 46px; margin: 6px 0 0; cursor: pointer; }
.timeline-caption { font-size: 12px; }
.banner { margin: 8px 0; padding: 6px 10px; border-radius: 4px; }
.banner.bad { background: #fde8e0; border: 1px solid #D55E00; }
.banner.ok { background: #eef7f1; border: 1px solid #9fd3b8; color: #1d5e3f; }
.grid { display: grid; grid-template-columns: 440px 1fr; gap: 18px; margin-top: 10px; }
section { border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; margin-bottom: 14px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 2px 6px; border-bottom: 1px solid #eeeeee; vertical-align: top; }
th { font-weight: 600; color: var(--muted); font-size: 12px; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.kind { display: inline-block; padding: 0 6px; border-radius: 3px; font-size: 12px; }
.kind.prefill { background: #dcecf7; } .kind.decode { background: #e4f4ec; } .kind.recompute { background: #fbe3d3; }
.queue { display: flex; flex-wrap: wrap; gap: 4px; min-height: 24px; margin: 2px 0 8px; padding: 0; list-style: none; }
.chip { display: inline-block; padding: 1px 7px; border-radius: 10px; border: 2px solid transparent;
        cursor: pointer; font-size: 12.5px; color: #111111; white-space: nowrap; }
.chip.sel { border-color: #000000; box-shadow: 0 0 0 1px #ffffff inset; font-weight: 700; }
.muted { color: var(--muted); }
.events li { margin: 2px 0; }
.events { margin: 4px 0; padding-left: 18px; }
#pool { display: grid; grid-template-columns: repeat(auto-fill, 50px); gap: 4px; }
.block { position: relative; height: 42px; border-radius: 4px; border: 1px solid #888888; font-size: 11px;
         padding: 2px 3px; overflow: hidden; cursor: default; }
.block .bid { color: #333333; }
.block .ref { position: absolute; right: 3px; bottom: 1px; font-weight: 700; font-size: 12px; }
.block .own { position: absolute; left: 3px; bottom: 1px; font-size: 11px; }
.block.free { background: #ffffff; border: 1px dashed #b0b0b0; color: #999999; }
.block.cached { background: repeating-linear-gradient(45deg, #ffffff, #ffffff 4px, #d9d9d9 4px, #d9d9d9 7px);
                border: 1px dashed #0072B2; color: #333333; }
.block.held, .block.held-cached { border-color: #555555; }
.block.held-cached { box-shadow: inset 0 0 0 2px #0072B2; }
.block.inconsistent { background: #D55E00; color: #ffffff; }
.block.new { outline: 2px dotted #000000; outline-offset: 1px; }
.block.dim { opacity: 0.25; }
.block.hl { outline: 3px solid #000000; outline-offset: 1px; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; margin: 8px 0 0; font-size: 12px; color: var(--muted); }
.legend .block { display: inline-block; width: 22px; height: 16px; vertical-align: middle; margin-right: 4px; }
.tables .row { display: flex; align-items: center; gap: 6px; margin: 3px 0; flex-wrap: wrap; }
.tables .cell { display: inline-block; min-width: 28px; padding: 0 4px; border: 1px solid #888888; border-radius: 3px;
                text-align: center; font-size: 12px; background: #ffffff; }
.tables .cell.shared { box-shadow: inset 0 0 0 2px #0072B2; }
.tables .cell.new { outline: 2px dotted #000000; }
table.detail { width: auto; }
.detail td, .detail th { font-size: 12.5px; padding: 2px 14px; }
.tokens { word-break: break-all; }
.tok-new { background: #F0E442; font-weight: 700; }
.tok-prompt { color: var(--muted); }
kbd { border: 1px solid #bbbbbb; border-radius: 3px; padding: 0 4px; font-size: 12px; background: #f6f6f6; }
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title><style>%CSS%</style></head>
<body>
<header><h1 id="title">%TITLE%</h1><p id="look-for"></p><p class="config" id="config"></p></header>
<div id="controls">
  <button id="first" title="first step (Home)">&#x7C;&#x25C0;</button>
  <button id="back" title="back one step (Left arrow)">&#x25C0;</button>
  <button id="play" title="play / pause (Space)">&#x25B6;</button>
  <button id="next" title="one step (Right arrow)">&#x25B6;&#x7C;</button>
  <input id="slider" type="range" min="0" value="0" aria-label="step">
  <span id="step-label"></span>
</div>
<svg id="timeline" role="img" aria-label="blocks held per step; red ticks: preemptions"></svg>
<div class="muted timeline-caption">Every step of the run: blue, the blocks held after it; red, a preemption;
black, a broken pool invariant. Click to go there.</div>
<main id="view" data-step="0">
  <div id="banners"></div>
  <div class="grid">
    <div>
      <section id="step-section"><h2 id="step-title"></h2><div id="plan"></div><div id="events"></div></section>
      <section><h2>Queues after the step</h2>
        <div class="muted">waiting (first come, first served; a preempted request goes to the front)</div>
        <ol class="queue" data-queue="waiting" id="waiting"></ol>
        <div class="muted">running (in admission order: the newest, last, is the first preempted)</div>
        <ol class="queue" data-queue="running" id="running"></ol>
        <div class="muted">finished</div>
        <ol class="queue" data-queue="finished" id="finished"></ol>
      </section>
    </div>
    <div>
      <section><h2 id="pool-title">The block pool</h2><div id="pool"></div>
        <div class="legend">
          <span><span class="block free"></span>free</span>
          <span><span class="block cached"></span>cached, evictable (reference count 0)</span>
          <span><span class="block held" style="background:#dddddd"></span>held by a table (colour: its request)</span>
          <span><span class="block held-cached" style="background:#dddddd"></span>held and in the prefix cache</span>
          <span><span class="block new" style="background:#ffffff"></span>new in a table this step</span>
          <span>&times;N: reference count above 1</span>
        </div>
      </section>
      <section class="tables"><h2>Block tables after the step</h2><div id="tables"></div></section>
      <section id="detail-section"><h2 id="detail-title">Click a request to follow it</h2><div id="detail"></div>
      </section>
      <p class="muted">Keys: <kbd>&larr;</kbd> <kbd>&rarr;</kbd> step, <kbd>Space</kbd> play, <kbd>Home</kbd>
      <kbd>End</kbd>. The address keeps the state: <code>#step=37&amp;request=r3</code> opens it directly.</p>
    </div>
  </div>
</main>
<script type="application/json" id="trace-data">%DATA%</script>
<script>%SCRIPT%</script>
</body></html>
"""

SCRIPT = r"""
"use strict";
const T = JSON.parse(document.getElementById("trace-data").textContent);
const F = T.frames, BS = T.block_size, LAST = F.length - 1;
const STATE = {".": "free", "e": "cached", "h": "held", "H": "held-cached", "!": "inconsistent"};
const PALETTE = ["#56B4E9", "#E69F00", "#009E73", "#F0E442", "#CC79A7", "#0072B2", "#D55E00", "#9ad0a0",
                 "#c8a2e8", "#f4b183", "#8fb8de", "#e3c26f"];
const IDS = Object.keys(T.requests);
const COLOR = {};
IDS.forEach((id, i) => { COLOR[id] = PALETTE[i % PALETTE.length]; });
const $ = (id) => document.getElementById(id);
let cur = T.open, sel = null, timer = null;

function esc(s) {
  const entity = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  return String(s).replace(/[&<>"']/g, (c) => entity[c]);
}
function textColor(hex) {
  const n = parseInt(hex.slice(1), 16), r = n >> 16, g = (n >> 8) & 255, b = n & 255;
  return (0.299 * r + 0.587 * g + 0.114 * b) > 140 ? "#111111" : "#ffffff";
}
function chip(id, extra) {
  const c = COLOR[id] || "#dddddd";
  return `<li class="chip${id === sel ? " sel" : ""}" data-request="${esc(id)}" style="background:${c};` +
         `color:${textColor(c)}">${esc(id)}${extra || ""}</li>`;
}
function plural(n, word) { return `${n} ${word}${n === 1 ? "" : "s"}`; }

// Each request's outputs up to frame n, and where it stands then: all read from the frames.
function outputsUpTo(n) {
  const out = {};
  for (const id of IDS) out[id] = [];
  for (let k = 0; k <= n; k++) for (const [id, toks] of Object.entries(F[k].sampled)) out[id].push(...toks);
  return out;
}
function statusAt(n) {
  const st = {}, f = F[n];
  for (let k = 0; k <= n; k++) {
    for (const id of F[k].arrived) st[id] = "waiting";
    for (const [id, why] of Object.entries(F[k].finished)) st[id] = "finished (" + why + ")";
  }
  for (const id of f.waiting) st[id] = "waiting";
  for (const id of f.running) st[id] = "running";
  return st;
}
function eventsUpTo(n, id) {
  let preemptions = 0;
  const admissions = [];
  for (let k = 0; k <= n; k++) {
    preemptions += F[k].preempted.filter((p) => p.id === id).length;
    if (id in F[k].admitted) admissions.push(`step ${k}` + (T.engine.enable_prefix_caching ?
      ` (prefix-cache hit: ${F[k].admitted[id]} tokens)` : ""));
  }
  return {preemptions, admissions};
}

function drawHeader() {
  $("look-for").textContent = "What to look for: " + T.look_for;
  const e = T.engine, m = T.model;
  $("config").textContent = `${T.prog}'s LLMEngine: ${e.num_blocks} blocks of ${e.block_size} tokens, ` +
    `max_num_seqs ${e.max_num_seqs}, max_num_batched_tokens ${e.max_num_batched_tokens}, prefix caching ` +
    `${e.enable_prefix_caching ? "on" : "off"}; a toy GPT-2 (${m.n_layer} layers, ${m.n_embd} wide, vocabulary ` +
    `${m.vocab_size}, context ${m.n_positions}); ${IDS.length} requests, ${LAST} steps. ` +
    `A step's frame is the state after it; step 0 is before the first.`;
  $("slider").max = LAST;
}

function drawTimeline() {
  const svg = $("timeline"), w = svg.clientWidth || 1240, h = 46, n = F.length, bw = w / n;
  let body = "";
  F.forEach((f, k) => {
    const used = [...f.state].filter((c) => c === "h" || c === "H").length / f.state.length;
    body += `<rect x="${(k * bw).toFixed(2)}" y="${(h - 4 - used * 34).toFixed(2)}" width="${Math.max(bw - 0.3, 0.6)
      .toFixed(2)}" height="${(used * 34).toFixed(2)}" fill="#9ab8d0"/>`;
    if (f.preempted.length) body += `<rect x="${(k * bw).toFixed(2)}" y="2" width="${Math.max(bw, 2).toFixed(2)}"` +
      ` height="8" fill="#D55E00"/>`;
    if (f.problems.length) body += `<rect x="${(k * bw).toFixed(2)}" y="${h - 4}" width="${Math.max(bw, 2)
      .toFixed(2)}" height="4" fill="#000000"/>`;
  });
  body += `<rect id="cursor" x="0" y="0" width="${Math.max(bw, 2).toFixed(2)}" height="${h}" fill="none" ` +
          `stroke="#000000" stroke-width="1.5"/>`;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.innerHTML = `<title>blocks in use per step (blue), preemptions (red ticks)</title>` + body;
  svg.onclick = (ev) => go(Math.floor(ev.offsetX / bw));
}

function drawPlan(f) {
  $("step-title").textContent = f.step === 0 ? "Before the first step" :
    `Step ${f.step}: ${plural(f.ran.length, "request")} ran, ` +
    `${f.ran.reduce((a, r) => a + r.n, 0)} of ${T.engine.max_num_batched_tokens} batched tokens`;
  let rows = "";
  for (const r of f.ran) {
    const toks = f.sampled[r.id] || [];
    const hit = !(r.id in f.admitted) ? "" : T.engine.enable_prefix_caching ?
      `admitted, prefix-cache hit: ${f.admitted[r.id]} tokens` : "admitted";
    const what = r.kind === "decode" ? "decode" : `${r.kind} ${r.start}..${r.start + r.n - 1}` +
      (r.samples ? "" : " (chunk)");
    rows += `<tr data-scheduled="${esc(r.id)}" data-tokens="${r.n}" data-kind="${r.kind}" data-start="${r.start}"` +
      ` data-sampled="${toks.join(" ")}"><td><ol class="queue" style="margin:0">${chip(r.id)}</ol></td>` +
      `<td><span class="kind ${r.kind}">${esc(what)}</span> <span class="muted">${hit}</span></td>` +
      `<td class="num">${r.n}</td><td class="num mono">${toks.length ? toks.join(" ") : "&ndash;"}</td></tr>`;
  }
  $("plan").innerHTML = f.ran.length ? `<table><thead><tr><th>request</th><th>what ran (positions)</th>` +
    `<th class="num">tokens</th><th class="num">sampled</th></tr></thead><tbody>${rows}</tbody></table>` :
    `<p class="muted">Nothing has run yet.</p>`;
  const ev = [];
  if (f.arrived.length) {
    ev.push(`<li data-event="arrived">arrived before this step: ${f.arrived.map(esc).join(", ")}</li>`);
  }
  for (const p of f.preempted) ev.push(`<li data-preempted="${esc(p.id)}" data-reason="${esc(p.reason)}">` +
    `<b style="color:#D55E00">preempted ${esc(p.id)}</b>: ${esc(p.reason)}</li>`);
  for (const [id, why] of Object.entries(f.finished)) {
    ev.push(`<li data-finished="${esc(id)}">${esc(id)} finished (${esc(why)})</li>`);
  }
  const copies = f.copies.map((c) => `block ${c[0]} &rarr; ${c[1]}`).join(", ");
  ev.push(`<li data-event="copies">copy-on-write: ${copies || "none"}</li>`);
  const pool = Object.entries(f.blocks).filter(([, ids]) => ids.length)
    .map(([kind, ids]) => `${kind.replace("_", " ")} ${ids.join(", ")}`).join("; ");
  ev.push(`<li data-event="blocks">the pool's events: ${pool || "none"}</li>`);
  const c = f.cache;
  if (T.engine.enable_prefix_caching) ev.push(`<li data-event="cache">prefix cache so far: ${c[1]} hits of ${c[0]} ` +
    `lookups, ${plural(c[2], "eviction")}</li>`);
  $("events").innerHTML = `<ul class="events">${ev.join("")}</ul>`;
}

function drawQueues(f) {
  $("waiting").innerHTML = f.waiting.map((id) => chip(id)).join("") || `<li class="muted">empty</li>`;
  $("running").innerHTML = f.running.map((id) => chip(id)).join("") || `<li class="muted">empty</li>`;
  const st = statusAt(cur);
  const done = IDS.filter((id) => (st[id] || "").startsWith("finished"));
  $("finished").innerHTML = done.map((id) => chip(id)).join("") || `<li class="muted">none yet</li>`;
}

function owners(f) {
  const own = {};
  for (const [id, t] of Object.entries(f.tables)) for (const b of t.blocks) (own[b] = own[b] || []).push(id);
  return own;
}

function drawPool(f) {
  const own = owners(f), mine = sel && f.tables[sel] ? new Set(f.tables[sel].blocks) : null;
  const fresh = new Set(Object.values(f.grew).flat());
  let cells = "";
  for (let b = 0; b < f.state.length; b++) {
    const st = STATE[f.state[b]], ref = f.ref[b], who = own[b] || [];
    let style = "", cls = `block ${st}`;
    if ((st === "held" || st === "held-cached") && who.length) {
      const c = who.length === 1 ? COLOR[who[0]] : "#bdbdbd";
      style = ` style="background:${c};color:${textColor(c)}"`;
    }
    if (fresh.has(b)) cls += " new";
    if (mine) cls += mine.has(b) ? " hl" : " dim";
    const label = who.length === 1 ? esc(who[0]) : "";
    cells += `<div class="${cls}" data-block="${b}" data-state="${st}" data-refcount="${ref}"${style} ` +
      `title="block ${b}: ${st}, reference count ${ref}${who.length ? ", held by " + who.map(esc).join(", ") : ""}">` +
      `<span class="bid">${b}</span><span class="own">${label}</span>` +
      `<span class="ref">${ref > 1 ? "&times;" + ref : ""}</span></div>`;
  }
  $("pool").innerHTML = cells;
  const counts = {free: 0, cached: 0, held: 0};
  for (const ch of f.state) counts[ch === "." ? "free" : ch === "e" ? "cached" : "held"] += 1;
  $("pool-title").textContent = `The block pool: ${f.state.length} blocks of ${BS} tokens; ${counts.held} held, ` +
    `${counts.cached} cached and evictable, ${counts.free} free`;
}

function drawTables(f) {
  const rows = [];
  for (const [id, t] of Object.entries(f.tables)) {
    const grew = new Set(f.grew[id] || []);
    const cells = t.blocks.map((b, j) => `<span class="cell${f.ref[b] > 1 || f.state[b] === "H" ? " shared" : ""}` +
      `${grew.has(b) ? " new" : ""}" title="block_ids[${j}] = ${b}: positions ${j * BS}..${Math.min((j + 1) * BS,
      t.tokens) - 1}">${b}</span>`).join("");
    rows.push(`<div class="row" data-table="${esc(id)}" data-blocks="${t.blocks.join(" ")}" ` +
      `data-tokens="${t.tokens}">` +
      `<ol class="queue" style="margin:0">${chip(id)}</ol>${cells}<span class="muted">${t.tokens} tokens in ` +
      `${plural(t.blocks.length, "block")}</span></div>`);
  }
  $("tables").innerHTML = rows.join("") || `<p class="muted">No table holds a block.</p>`;
}

function drawDetail(f) {
  if (!sel || !(sel in T.requests)) {
    $("detail-title").textContent = "Click a request to follow it";
    $("detail").innerHTML = `<p class="muted">Its blocks light up in the pool, and its block table, positions ` +
      `to blocks and slots, is drawn here.</p>`;
    $("detail-section").removeAttribute("data-request");
    return;
  }
  const req = T.requests[sel], st = statusAt(cur)[sel] || "not arrived yet", out = outputsUpTo(cur)[sel];
  const ev = eventsUpTo(cur, sel), now = f.sampled[sel] || [];
  $("detail-section").setAttribute("data-request", sel);
  $("detail-title").textContent = `${sel}: ${st}`;
  const t = f.tables[sel];
  let rows = "";
  if (t) {
    const slotOf = (pos) => {
      if (t.slots === null) return t.blocks[Math.floor(pos / BS)] * BS + pos % BS;  // what slots() returned
      for (const [p, s, n] of t.slots) if (pos >= p && pos < p + n) return s + pos - p;
      return "?";
    };
    t.blocks.forEach((b, j) => {
      const lo = j * BS, hi = Math.min((j + 1) * BS, t.tokens) - 1;
      rows += `<tr data-row="${j}" data-block="${b}" data-positions="${lo}-${hi}" ` +
        `data-slots="${slotOf(lo)}-${slotOf(hi)}">` +
        `<td class="num">${j}</td><td class="num">${b}</td><td class="num">${lo}..${hi}</td>` +
        `<td class="num">${slotOf(lo)}..${slotOf(hi)}</td><td class="num">${hi - lo + 1} of ${BS}</td>` +
        `<td class="num">${f.ref[b]}</td></tr>`;
    });
  }
  const salt = req.salt ? `, cache_salt ${esc(req.salt)}` : "";
  const outText = out.map((tok, i) => i >= out.length - now.length ? `<span class="tok-new">${tok}</span>` : tok)
    .join(" ");
  $("detail").innerHTML =
    `<p>prompt ${req.prompt.length} tokens, max_tokens ${req.max_tokens}${salt}; ` +
    `admitted: ${ev.admissions.length ? ev.admissions.join(", then ") : "not yet"}; ` +
    `preempted ${ev.preemptions} time${ev.preemptions === 1 ? "" : "s"} so far.</p>` +
    `<p class="tokens mono"><span class="tok-prompt">${req.prompt.join(" ")}</span> | ` +
    `<span data-output="${esc(sel)}">${outText || "<span class='muted'>no output yet</span>"}</span></p>` +
    (t ? `<table class="detail" data-table-detail="${esc(sel)}" data-computed="${t.computed}"><thead><tr>` +
      `<th class="num">j</th><th class="num">block_ids[j]</th><th class="num">positions</th>` +
      `<th class="num">slots</th>` +
      `<th class="num">filled</th><th class="num">ref</th></tr></thead><tbody>${rows}</tbody></table>` +
      `<p class="muted">slot = block &times; ${BS} + offset; ${t.tokens} tokens in the table, ` +
      `${t.computed} computed.</p>` : `<p class="muted">It holds no block now.</p>`);
}

function drawBanners(f) {
  const b = [];
  if (T.error && cur === LAST) {
    b.push(`<div class="banner bad" data-banner="error">The run stopped: ${esc(T.error)}</div>`);
  }
  if (T.truncated && cur === LAST) b.push(`<div class="banner bad" data-banner="truncated">The run had not finished ` +
    `after ${LAST} steps; the trace stops here.</div>`);
  if (f.problems.length) b.push(`<div class="banner bad" data-banner="problems">The pool's invariants are broken ` +
    `at this step:<ul>${f.problems.map((p) => `<li>${esc(p)}</li>`).join("")}</ul></div>`);
  $("banners").innerHTML = b.join("");
}

function render() {
  const f = F[cur];
  $("view").setAttribute("data-step", cur);
  if (sel) $("view").setAttribute("data-selected", sel); else $("view").removeAttribute("data-selected");
  $("slider").value = cur;
  $("step-label").textContent = `step ${cur} of ${LAST}`;
  drawBanners(f); drawPlan(f); drawQueues(f); drawPool(f); drawTables(f); drawDetail(f);
  const cursor = document.getElementById("cursor");
  if (cursor) cursor.setAttribute("x", (cur * (parseFloat($("timeline").getAttribute("viewBox").split(" ")[2]) /
    F.length)).toFixed(2));
  const hash = `#step=${cur}` + (sel ? `&request=${encodeURIComponent(sel)}` : "");
  if (location.hash !== hash) { try { history.replaceState(null, "", hash); } catch (e) { /* file:// may refuse */ } }
}

function go(n) { cur = Math.max(0, Math.min(LAST, n | 0)); render(); }
function play() {
  if (timer) { clearInterval(timer); timer = null; $("play").innerHTML = "&#x25B6;"; return; }
  if (cur === LAST) cur = 0;
  $("play").innerHTML = "&#x275A;&#x275A;";
  timer = setInterval(() => { if (cur >= LAST) play(); else go(cur + 1); }, 450);
}
function fromHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  const n = parseInt(p.get("step"), 10);
  cur = Number.isFinite(n) ? Math.max(0, Math.min(LAST, n)) : cur;
  const r = p.get("request");
  sel = r && r in T.requests ? r : null;
  render();
}

$("first").onclick = () => go(0);
$("back").onclick = () => go(cur - 1);
$("next").onclick = () => go(cur + 1);
$("play").onclick = play;
$("slider").oninput = (e) => go(parseInt(e.target.value, 10));
document.addEventListener("click", (e) => {
  const c = e.target.closest("[data-request]");
  if (c && c.classList.contains("chip")) { sel = sel === c.dataset.request ? null : c.dataset.request; render(); }
});
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "INPUT" && e.key !== " ") return;
  if (e.key === "ArrowRight") go(cur + 1); else if (e.key === "ArrowLeft") go(cur - 1);
  else if (e.key === "Home") go(0); else if (e.key === "End") go(LAST);
  else if (e.key === " ") { e.preventDefault(); play(); } else return;
});
window.addEventListener("hashchange", fromHash);
drawHeader();
drawTimeline();
fromHash();
"""
