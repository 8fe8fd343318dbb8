#!/usr/bin/env python3
"""Check `checkpoints.load_gpt2` and `GPT2Tokenizer` against Hugging Face's own code, offline.

Needs torch, transformers and tokenizers, which the lab never depends on: run it from a scratch
venv (`python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers`), from the
repository's root:

    /tmp/hf/bin/python -m tools.checks.check_against_hf

1. Trains a byte-level BPE (2000 tokens) with `tokenizers` on the repository's own text, then
   encodes 600 strings (lines of the sources, random strings of letters, digits, marks, emoji and
   unusual white space, `<|endoftext|>`) with it, with `GPT2TokenizerFast` and with the lab's
   GPT2Tokenizer: the ids must agree.
2. Saves a random tiny `GPT2LMHeadModel` with `save_pretrained` in float32, float16 and
   bfloat16, loads each directory with `load_gpt2` and compares logits with Hugging Face's
   forward pass on the same (rounded) weights.
Nothing is downloaded.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    import solution as lab
    from checkpoints.model_loader import load_gpt2
    from checkpoints.tokenizer import GPT2Tokenizer

    work = Path(tempfile.mkdtemp(prefix="check-hf-"))
    corpus = [(ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "solution.py", "test_lab.py")]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=2000, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(work))
    mine = GPT2Tokenizer.from_dir(work)
    theirs = GPT2TokenizerFast.from_pretrained(str(work))
    rng = random.Random(0)
    lines = [line for text in corpus for line in text.splitlines() if line.strip()]
    alphabet = list("abc XYZ 019'sStvreml\n\t  .,!?-_²½Ⅻ①éмир漢字🙂\u0301\u00a0\u2003\x85") + ["<|endoftext|>"]
    samples = rng.sample(lines, 300) + ["".join(rng.choices(alphabet, k=rng.randint(1, 30))) for _ in range(300)]
    differ = [s for s in samples if mine.encode(s) != theirs.encode(s)]
    undecoded = [s for s in samples if mine.decode(mine.encode(s)) != theirs.decode(theirs.encode(s))]
    print(f"tokenizer: {len(samples)} strings; ids differ from GPT2TokenizerFast on {len(differ)}, "
          f"text on {len(undecoded)}{': ' + repr(differ[:3]) if differ else ''}")

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=mine.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    reference = GPT2LMHeadModel(config).eval()
    ids = mine.encode("def speculative_generate(target, draft):")
    worst = 0.0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        model = GPT2LMHeadModel(config).eval()
        model.load_state_dict(reference.state_dict())
        directory = work / str(dtype).removeprefix("torch.")
        model.to(dtype).save_pretrained(str(directory), safe_serialization=True)
        bpe.save_model(str(directory))
        loaded, _ = load_gpt2(lab, directory)
        with torch.no_grad():
            expected = model.float()(torch.tensor([ids])).logits[0].numpy()
        diff = float(np.abs(loaded.forward_dense(ids) - expected).max())
        worst = max(worst, diff)
        print(f"{directory.name}: max |logits - Hugging Face's| = {diff:.1e} (max |logit| "
              f"{float(np.abs(expected).max()):.2f})")
    return 0 if not differ and not undecoded and worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
