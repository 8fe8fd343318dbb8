#!/usr/bin/env python3
"""A request's trip, counted: copies of its prompt's token list and calls of the hash chain from
the engine's process boundary (the pickle the server's front end sends) through the first step.

    python -m tools.server.bench_request_trip                      # solution.py
    python -m tools.server.bench_request_trip --against HEAD~5     # and solution.py of that commit, side by side

Counting, not timing: the prompt's token ids are ints above 256, each its own object (CPython
shares only -5..256), and every opcode the trip runs is traced. Whenever the reference count
of the prompt's LAST token is above its floor, the lists and tuples that hold it are collected (and kept
alive, so that no id is reused): each one is a copy of the whole prompt or of a tail slice of
it. The last token sits in the partial last block, so the hash chain's per-block slices are
not among them: `hash_block` calls count those. The int64 array the model reads is not a
Python container and is not counted, in either version. Run with prefix caching on and off. Then a whole run of two
requests in which the second waits at the head of the queue, counting the hash chain's calls.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import pickle
import sys

import numpy as np

from tools.bench_common import DEFAULT_MODULE, solution_at


class CopyCounter:
    """Traces every opcode; records each new list or tuple that holds `token` (see the module doc)."""

    def __init__(self, token: int):
        self.token = token
        self.held: dict[int, object] = {}
        self.sites: list[str] = []
        self.floor = sys.getrefcount(token)
        self.last = "start"

    def _check(self, frame) -> None:
        # Scan while the count is above its lowest since the last find: a token moved from the
        # stack into a new list (a comprehension's append) does not change the count.
        refs = sys.getrefcount(self.token)
        if refs > self.floor:
            for holder in gc.get_referrers(self.token):
                if type(holder) in (list, tuple) and id(holder) not in self.held:
                    self.held[id(holder)] = holder
                    self.sites.append(self.last)  # made since the previous opcode
                    self.floor = refs
        self.floor = min(self.floor, refs)
        self.last = f"{frame.f_code.co_name}:{frame.f_lineno}"

    def trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        self._check(frame)
        return self._local

    def _local(self, frame, event, arg):
        self._check(frame)
        return self._local


def count_trip(lab, prefix_caching: bool, prompt_len: int = 150, block_size: int = 16) -> dict:
    """One request, pickled and unpickled as the server's front end sends it, added to an engine
    and stepped once: its first forward pass, and the step's bookkeeping after it."""
    config = lab.ModelConfig(vocab_size=1024, n_positions=256, n_embd=32, n_layer=1, n_head=2)
    engine = lab.LLMEngine(lab.ToyTransformer(config), block_size=block_size, max_num_seqs=4,
                           enable_prefix_caching=prefix_caching)
    prompt = [300 + (7 * i) % 700 for i in range(prompt_len)]  # distinct ints > 256
    wire = pickle.dumps(lab.Request("r", prompt, lab.SamplingParams(max_tokens=2)))
    hash_calls = [0]
    real_hash = lab.hash_block

    def counted_hash(*args, **kwargs):
        hash_calls[0] += 1
        return real_hash(*args, **kwargs)

    request = pickle.loads(wire)  # the engine process's side of the boundary: copy 1, its own ints
    counter = CopyCounter(request.prompt_token_ids[-1])
    counter.held[id(request.prompt_token_ids)] = request.prompt_token_ids
    counter.sites.append("pickle.loads")
    lab.hash_block = counted_hash
    try:
        sys.settrace(counter.trace)
        engine.add_request(request)
        while engine.num_steps == 0:
            engine.step()
    finally:
        sys.settrace(None)
        lab.hash_block = real_hash
    return {"copies": len(counter.held), "hash_block calls": hash_calls[0], "sites": counter.sites}


def count_waiting(lab, prefix_caching: bool, prompt_len: int = 150, block_size: int = 16) -> tuple[int, int]:
    """hash_block calls over a whole run of two requests of `prompt_len` tokens in a pool that holds
    one at a time: the second waits at the head of the queue while the first runs. Returns (calls,
    steps)."""
    config = lab.ModelConfig(vocab_size=1024, n_positions=256, n_embd=32, n_layer=1, n_head=2)
    num_blocks = -(-(prompt_len + 20) // block_size)
    engine = lab.LLMEngine(lab.ToyTransformer(config), num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=4, enable_prefix_caching=prefix_caching)
    calls = [0]
    real_hash = lab.hash_block

    def counted_hash(*args, **kwargs):
        calls[0] += 1
        return real_hash(*args, **kwargs)

    lab.hash_block = counted_hash
    try:
        for seed in (1, 2):
            prompt = np.random.default_rng(seed).integers(0, 1024, prompt_len).tolist()
            engine.add_request(prompt, lab.SamplingParams(max_tokens=20))
        while engine.has_unfinished():
            engine.step()
    finally:
        lab.hash_block = real_hash
    return calls[0], engine.num_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", default=DEFAULT_MODULE,
                        help="the module to measure (default: solution, or lab in the student's copy)")
    parser.add_argument("--against", metavar="REV", help="also count solution.py of this git revision")
    parser.add_argument("--sites", action="store_true", help="print where each copy was made")
    args = parser.parse_args(argv)
    modules = {args.module: importlib.import_module(args.module)}
    if args.against:
        modules = {args.against: solution_at(args.against), **modules}
    print("one request of 150 tokens, blocks of 16: unpickled -> engine.add_request -> first step (its forward)")
    print(f"{'module':<22}{'prefix caching':>16}{'list/tuple copies':>19}{'hash_block calls':>18}")
    for name, module in modules.items():
        for caching in (False, True):
            got = count_trip(module, caching)
            print(f"{name:<22}{'on' if caching else 'off':>16}{got['copies']:>19}{got['hash_block calls']:>18}")
            if args.sites:
                print("    " + ", ".join(got["sites"]))
    print("\ntwo such requests, 20 output tokens each, in a pool that holds one: the second waits at the head")
    print(f"{'module':<22}{'prefix caching':>16}{'steps':>7}{'hash_block calls over the run':>31}")
    for name, module in modules.items():
        for caching in (False, True):
            calls, steps = count_waiting(module, caching)
            print(f"{name:<22}{'on' if caching else 'off':>16}{steps:>7}{calls:>31}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
