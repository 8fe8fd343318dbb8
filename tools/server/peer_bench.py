#!/usr/bin/env python3
"""Helpers to point a peer serving benchmark (SGLang's bench_serving, vLLM's `vllm bench serve`)
at the lab's server, on the same workload as `python solution.py loadtest`.

    python -m tools.server.peer_bench tokenizer DIR                      # the byte tokenizer, as a HF directory
    python -m tools.server.peer_bench sharegpt WORKLOAD.jsonl OUT.json   # loadtest's workload for bench_serving

Neither benchmark is a dependency of the lab: run them from a scratch virtual environment
(`pip install tokenizers transformers aiohttp` for these helpers and SGLang's script). The lab's
toy models read bytes: token id = UTF-8 byte value. `tokenizer` writes a tokenizer directory
that `transformers.AutoTokenizer.from_pretrained(DIR)` loads and that encodes exactly that way
(a byte-level BPE with no merges, keyed through GPT-2's byte-to-character table), so the peer
counts tokens as the server does. `sharegpt` turns the JSONL that `loadtest --save-workload`
writes (vLLM's `custom` dataset format, which `vllm bench serve` reads as it is) into the
ShareGPT JSON bench_serving reads, in an order its seeded shuffle turns back into loadtest's.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from checkpoints.tokenizer import bytes_to_unicode


def write_byte_tokenizer(out_dir: str) -> None:
    """A tokenizer directory whose encode(text) is list(text.encode("utf-8")); checks itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # scratch venv only

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}  # GPT-2's table, as ByteLevel uses it
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet()), "ByteLevel's alphabet is GPT-2's table"
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1_000_000,
                   "clean_up_tokenization_spaces": False}, fh)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out_dir)
    for text in ("a b c", "héllo wörld ✓", "\x00\x01 ctrl\n\ttabs", "  two  spaces "):
        assert loaded.encode(text) == list(text.encode("utf-8")), text
        assert loaded.decode(loaded.encode(text)) == text, text
    print(f"{out_dir}: encode = the UTF-8 bytes, vocabulary 256, decode round-trips")


def write_sharegpt(workload_path: str, out_path: str, seed: int = 1) -> None:
    """loadtest's JSONL ({"prompt", "output_tokens"} per line) as bench_serving's ShareGPT JSON:
    the answer turn is "x" * output_tokens (n byte tokens, so the peer asks for n), and rows are
    written in the inverse of `random.seed(seed); random.shuffle`, the peer's own shuffle."""
    with open(workload_path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    order = list(range(len(rows)))
    random.seed(seed)
    random.shuffle(order)  # the peer's k-th request is data[order[k]]
    data = [None] * len(rows)
    for k, i in enumerate(order):
        data[i] = {"id": f"req-{k}", "conversations": [{"from": "human", "value": rows[k]["prompt"]},
                                                       {"from": "gpt", "value": "x" * int(rows[k]["output_tokens"])}]}
    with open(out_path, "w") as fh:
        json.dump(data, fh)
    short = sum(len(r["prompt"].encode()) < 2 or int(r["output_tokens"]) < 2 for r in rows)
    print(f"{out_path}: {len(rows)} requests ({short} with a prompt or output under 2 tokens, which the peer drops)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("tokenizer", help="write the byte tokenizer directory").add_argument("dir")
    sharegpt = commands.add_parser("sharegpt", help="convert loadtest's saved workload for bench_serving")
    sharegpt.add_argument("workload")
    sharegpt.add_argument("out")
    sharegpt.add_argument("--seed", type=int, default=1, help="the seed the peer is run with")
    args = parser.parse_args(argv)
    if args.command == "tokenizer":
        write_byte_tokenizer(args.dir)
    else:
        write_sharegpt(args.workload, args.out, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
