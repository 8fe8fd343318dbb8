#!/usr/bin/env python3
"""What a served request with `n` costs the engine: prompt tokens computed and KV blocks held,
this checkout against an earlier one, side by side in one run.

    python -m tools.server.bench_parallel_sampling --against 56cc7bd [--n 4] [--prompt-len 200] [--max-tokens 32]

Each side's own tree (the earlier one unpacked from git) serves its own engine on 127.0.0.1, in a
process of its own, with prefix caching off and on: the toy model of `serve` (256-token
vocabulary, 512 positions, 2 layers of 64), blocks of 16. One client sends one completion of a
`--prompt-len`-token prompt with `n`, a seed, temperature 1 and ignore_eos. The engine's observer
(`LLMEngine(observer=...)`, the same in both trees) counts what happened:

- prompt tokens computed: the tokens the steps ran, less one per output token after each
  sample's first (each sample's decode steps);
- blocks: the most held at once (allocated, not yet back in the pool), and copies on write;
- prefix-cache hits (blocks), and the engine's steps for the whole request.

The samples' tokens are checked first: a seeded sample must be the same on both sides.
Counting, not timing: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tools.bench_common import ROOT, tree_at

# Run by each side's python in its own tree (the working directory, where `python -c` imports
# from): the same measurement of either server.
MEASURE = r"""
import collections, http.client, json, sys
import solution as lab
import serving
from serving.sampling import logits_processors

n, prompt_len, max_tokens, caching = json.loads(sys.argv[1])
model = lab.ToyTransformer(lab.ModelConfig(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4), seed=0)
events = []
engine = lab.LLMEngine(model, block_size=16, max_num_seqs=64, enable_prefix_caching=caching,
                       logits_processors=logits_processors(), observer=events.append)
prompt = [(7 * i + 3) % 256 for i in range(prompt_len)]
with serving.start_server(engine) as server:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "prompt": prompt, "n": n, "seed": 0, "temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True,
        "return_token_ids": True}))
    response = conn.getresponse()
    body = json.loads(response.read())
    assert response.status == 200, body
tokens = [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]
counts = collections.Counter(e.type.value for e in events)
held = peak = 0
for e in events:
    held += (e.type.value == "allocated") - (e.type.value == "freed")
    peak = max(peak, held)
scheduled = sum(e.num_tokens for e in events if e.type.value == "scheduled")
print(json.dumps({"tokens": tokens, "prompt tokens computed": scheduled - sum(len(t) - 1 for t in tokens),
                  "peak blocks held": peak, "blocks allocated": counts["allocated"],
                  "copies on write": counts["copied"], "prefix-cache hits": counts["prefix_hit"],
                  "engine steps": engine.num_steps}))
"""

COLUMNS = ("prompt tokens computed", "peak blocks held", "blocks allocated", "copies on write", "prefix-cache hits",
           "engine steps")


def measure(tree: Path, n: int, prompt_len: int, max_tokens: int, caching: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEASURE, json.dumps([n, prompt_len, max_tokens, caching])],
                          cwd=tree, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: the measurement failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="REV", help="the earlier revision (e.g. 56cc7bd)")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    trees = {args.against: tree_at(args.against), "this checkout": ROOT}
    rows = []
    for caching in (False, True):
        results = {name: measure(tree, args.n, args.prompt_len, args.max_tokens, caching)
                   for name, tree in trees.items()}
        first, *others = results.values()
        if any(r["tokens"] != first["tokens"] for r in others):
            raise SystemExit(f"prefix caching {caching}: the samples differ between the sides; nothing to compare")
        rows += [(name, caching, r) for name, r in results.items()]
    print(f"one completion, n = {args.n}, a prompt of {args.prompt_len} tokens, {args.max_tokens} tokens per sample "
          f"(seeded; each side's samples equal), blocks of 16")
    print(f"| server | prefix caching | {' | '.join(COLUMNS)} |")
    print("| --- | --- |" + " ---: |" * len(COLUMNS))
    for name, caching, r in rows:
        print(f"| {name} | {'on' if caching else 'off'} | {' | '.join(str(r[c]) for c in COLUMNS)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
