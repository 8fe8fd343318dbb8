"""`python -m tools.bench kv-int8`: what an int8 KV cache costs in accuracy."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from tools.bench_common import Report


def bench_kv_int8(lab: ModuleType, num_prompts: int = 32, max_tokens: int = 32, seed: int = 0, log=print) -> str:
    """What an int8 KV cache of the module `lab` costs in accuracy: the same greedy requests on a float32 and an
    int8 engine, for the default ModelConfig and a wider one.

    Reports the cache bytes, how many whole greedy outputs and first tokens agree, and, teacher
    forced along the float32 engine's outputs (so both caches see the same tokens), the share of
    positions whose argmax agrees and the max |logit difference|.
    """
    say = Report(log)
    for config in (lab.ModelConfig(), lab.ModelConfig(vocab_size=1024, n_embd=256, n_layer=4, n_head=4)):
        model = lab.ToyTransformer(config, seed=seed)
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, config.vocab_size, int(rng.integers(4, 64))).tolist() for _ in range(num_prompts)]
        sampling = lab.SamplingParams(max_tokens=max_tokens)
        engines = {dtype: lab.LLMEngine(model, max_num_seqs=8, kv_cache_dtype=dtype) for dtype in lab.KV_CACHE_DTYPES}
        outs = {dtype: engine.generate(prompts, sampling) for dtype, engine in engines.items()}
        whole = sum(a.output_token_ids == b.output_token_ids for a, b in zip(outs["float32"], outs["int8"]))
        first = sum(a.output_token_ids[0] == b.output_token_ids[0] for a, b in zip(outs["float32"], outs["int8"]))
        agree = total = 0
        max_err = max_logit = 0.0
        for prompt, out in zip(prompts, outs["float32"]):
            tokens = prompt + out.output_token_ids[:-1]
            logits = {}
            for dtype in lab.KV_CACHE_DTYPES:
                seq = lab.PagedSequence(model)
                seq.cache = lab.KVCache(config, seq.cache.num_blocks, seq.cache.block_size, dtype=dtype)
                seq.extend(tokens)
                logits[dtype] = seq.run()[len(prompt) - 1:]   # the positions that chose an output
            agree += int((logits["float32"].argmax(-1) == logits["int8"].argmax(-1)).sum())
            total += len(out.output_token_ids)
            max_err = max(max_err, float(np.abs(logits["float32"] - logits["int8"]).max()))
            max_logit = max(max_logit, float(np.abs(logits["float32"]).max()))
        f32, i8 = engines["float32"].kv_cache.nbytes, engines["int8"].kv_cache.nbytes
        say(f"bench kv-int8: n_embd {config.n_embd}, {config.n_layer} layers, {config.n_head} heads x "
            f"{config.head_dim}, vocab {config.vocab_size}, {num_prompts} prompts x {max_tokens} greedy tokens")
        say(f"  cache {f32 / 2**20:.1f} MiB float32 -> {i8 / 2**20:.1f} MiB int8 ({f32 / i8:.2f}x smaller, "
            f"scales included)")
        say(f"  greedy outputs identical {whole}/{num_prompts}, first tokens {first}/{num_prompts}; teacher-"
            f"forced argmax agreement {agree}/{total} = {agree / total:.1%}; max |logit diff| {max_err:.3f} "
            f"(logits up to {max_logit:.1f})")
    return say.text()
