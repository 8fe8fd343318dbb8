"""`python -m tools.bench vs-transformers`: the engine against Hugging Face `generate` on PyTorch (CPU)."""

from __future__ import annotations

import collections
import math
import os
import time
from types import ModuleType

import numpy as np

from measure.timing import best_side_by_side, best_time
from tools.bench_common import Report

# --- the engine against Hugging Face transformers' generate (PyTorch eager, CPU) ----------

VS_TRANSFORMERS_MODEL = dict(vocab_size=4096, n_positions=512, n_embd=512, n_layer=6, n_head=8)


VS_TRANSFORMERS_INSTALL = (
    "bench vs-transformers needs torch and transformers, which are never dependencies of the lab: "
    "install them beside it, e.g. `python -m venv /tmp/torch && /tmp/torch/bin/pip install numpy torch "
    "transformers` (a CPU wheel is enough), then run `/tmp/torch/bin/python -m tools.bench vs-transformers`")


def _vs_transformers_workload(num_requests: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: prompts of 32-96 tokens; one request in eight asks for 192-256
    output tokens, the others for 8-32 (a chat mix: most answers short, a few long)."""
    rng = np.random.default_rng(seed)
    vocab = VS_TRANSFORMERS_MODEL["vocab_size"]
    requests = []
    for i in range(num_requests):
        prompt = rng.integers(0, vocab, int(rng.integers(32, 97))).tolist()
        max_tokens = int(rng.integers(192, 257)) if i % 8 == 0 else int(rng.integers(8, 33))
        requests.append((prompt, max_tokens))
    return requests


def hf_gpt2(torch, transformers, model):
    """A transformers GPT2LMHeadModel holding exactly the lab model's weights (both use GPT-2's
    Conv1D (in, out) layout and checkpoint names), in eval mode, never stopping at an EOS."""
    c = model.config
    config = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
                                     n_layer=c.n_layer, n_head=c.n_head, layer_norm_epsilon=c.layer_norm_epsilon,
                                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=None,
                                     eos_token_id=None, pad_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    state = {f"transformer.{name}": torch.from_numpy(w.copy()) for name, w in model.weights.items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("attn.bias") and not m.endswith("masked_bias")]:
        raise RuntimeError(f"the GPT-2 weights did not map onto transformers: missing {missing}, "
                           f"unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _hf_generate(torch, hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy `generate` of a static batch: left-padded prompts, every row runs max_new_tokens."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    return [row[width:].tolist() for row in out]


def _engine_breakdown(lab: ModuleType, model, batch: int, clock, prompt_len: int = 64,
                      steps: int = 16) -> dict[str, float]:
    """Seconds per decode step of the engine at `batch` running sequences, split by where the
    time goes: weight GEMMs (the same products on random rows, measured apart), attention
    (`paged_attention`), the rest of the forward (LayerNorm, GELU, embedding, K/V writes, the
    batch layout: NumPy calls and Python), sampling, and the engine's own scheduling and
    bookkeeping (everything of `step()` outside the model call)."""
    timers = collections.Counter()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[name] += clock() - start
        return wrapper

    rng = np.random.default_rng(batch)
    engine = lab.LLMEngine(model, max_num_seqs=batch)
    for _ in range(batch):
        engine.add_request(rng.integers(0, model.config.vocab_size, prompt_len).tolist(),
                           lab.SamplingParams(max_tokens=steps + 8))
    while engine.scheduler.waiting or engine.num_steps < 2:  # every prompt prefilled, then decode only
        engine.step()
    engine.step()
    saved = lab.paged_attention, lab.sample_token
    lab.paged_attention = timed("attention", lab.paged_attention)
    lab.sample_token = timed("sampling", lab.sample_token)
    engine.model = model_wrapper = _TimedForward(model, timed)
    engine._run_model = timed("model call", engine._run_model)
    try:
        start = clock()
        for _ in range(steps):
            engine.step()
        total = clock() - start
    finally:
        lab.paged_attention, lab.sample_token = saved
    del model_wrapper
    x = rng.standard_normal((batch, model.config.n_embd), dtype=np.float32)
    h = rng.standard_normal((batch, 4 * model.config.n_embd), dtype=np.float32)

    def weight_gemms():
        for layer in model.layers:
            x @ layer["attn.c_attn.weight"], x @ layer["attn.c_proj.weight"]
            x @ layer["mlp.c_fc.weight"], h @ layer["mlp.c_proj.weight"]
        return x @ model.weights["wte.weight"].T

    weights = best_time(weight_gemms, 5, clock=clock)
    per = {name: t / steps for name, t in timers.items()}
    forward_rest = per["forward"] - per["attention"] - weights
    return {"step": total / steps, "weights": weights, "attention": per["attention"],
            "rest of forward": max(0.0, forward_rest), "sampling": per["sampling"],
            "scheduling": total / steps - per["model call"],
            "model call rest": per["model call"] - per["forward"] - per["sampling"]}


class _TimedForward:
    """The model with its `forward` timed (everything else passed through)."""

    def __init__(self, model, timed):
        self._model = model
        self.forward = timed("forward", model.forward)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _greedy_divergence(torch, hf, model, prompt, ours, theirs) -> tuple[int, float, float]:
    """Where two greedy outputs of the same weights first differ: (position, how far apart the
    two chosen tokens' logits are there, the max |logit difference| of the two implementations
    on that row). Float32 rounding flips a greedy choice only where the gap is within the error."""
    i = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    context = prompt + ours[:i]
    lab_row = model.forward_dense(context)[-1]
    with torch.inference_mode():
        hf_row = hf(torch.tensor([context])).logits[0, -1].numpy()
    gap = abs(float(lab_row[ours[i]] - lab_row[theirs[i]]))
    return i, gap, float(np.abs(lab_row - hf_row).max())


def bench_vs_transformers(lab: ModuleType, num_requests: int = 64, static_batch: int = 8, decode_tokens: int = 128,
                          rounds: int = 2, log=print, clock=time.perf_counter) -> str:
    """`python -m tools.bench vs-transformers`: the engine of the module `lab` against what users
    run instead, timed by `clock`.

    The same GPT-2 weights (VS_TRANSFORMERS_MODEL, random) in the lab's engine and in
    transformers' GPT2LMHeadModel (PyTorch eager, CPU, one intra-op thread like OpenBLAS here).
    The workload (`_vs_transformers_workload`) runs greedy through (a) `LLMEngine.generate`,
    all requests at once, (b) `generate` one request at a time, (c) `generate` in static
    batches of `static_batch` (arrival order, left-padded, each batch runs to its longest
    request); (a) and (b) `rounds` times each, in turns, best of each (a noisy minute of the machine
    moves both sides). Outputs are compared token by token before any time is reported. Useful
    tokens/s counts each request's own max_tokens (what a static batch computes beyond them is
    waste). Then the batch-1 decode step of both, and where the engine's step time goes.
    """
    try:
        import torch
        import transformers
    except ImportError:
        if log is not None:
            log(VS_TRANSFORMERS_INSTALL)
        return VS_TRANSFORMERS_INSTALL
    say = Report(log)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    model = lab.ToyTransformer(lab.ModelConfig(**VS_TRANSFORMERS_MODEL), seed=0)
    hf = hf_gpt2(torch, transformers, model)
    requests = _vs_transformers_workload(num_requests)
    useful = sum(m for _, m in requests)
    c = model.config
    say(f"bench vs-transformers: GPT-2 n_embd {c.n_embd}, {c.n_layer} layers, {c.n_head} heads, vocab "
        f"{c.vocab_size}, the same float32 weights in both; {num_requests} requests, prompts 32-96 tokens, "
        f"1 in 8 asking 192-256 output tokens, the rest 8-32 ({useful} useful tokens), greedy; torch "
        f"{torch.__version__} ({torch.get_num_threads()} thread), transformers {transformers.__version__}, "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, clock {clock.__name__}")
    _against_generate(lab, say, torch, hf, model, requests, static_batch, rounds, clock)

    # Batch 1: a decode step = (time of 1 + n tokens - time of 1 token) / n, sampling included.
    prompt = requests[1][0]
    one = lab.SamplingParams(max_tokens=1)
    many = lab.SamplingParams(max_tokens=1 + decode_tokens)
    fns = {"engine 1": lambda: lab.LLMEngine(model).generate([prompt], one),
           "engine n": lambda: lab.LLMEngine(model).generate([prompt], many),
           "hf 1": lambda: _hf_generate(torch, hf, [prompt], 1),
           "hf n": lambda: _hf_generate(torch, hf, [prompt], 1 + decode_tokens)}
    t = best_side_by_side(fns, 3, clock=clock)
    step_engine = (t["engine n"] - t["engine 1"]) / decode_tokens
    step_hf = (t["hf n"] - t["hf 1"]) / decode_tokens
    weight_bytes = sum(w.nbytes for name, w in model.weights.items() if name != "wpe.weight")
    say(f"  batch-1 decode step: engine {step_engine * 1e3:.2f} ms, transformers {step_hf * 1e3:.2f} ms: "
        f"engine / transformers = {step_engine / step_hf:.2f}x (goal <= 0.8x); the weights are "
        f"{weight_bytes / 2**20:.0f} MiB, {weight_bytes / step_engine / 1e9:.1f} GB/s for the engine")

    say("  where an engine decode step goes (ms per step; weights = the step's GEMMs timed on their own):")
    keys = ("weights", "attention", "rest of forward", "sampling", "model call rest", "scheduling")
    say("    batch " + "".join(f"{k:>17}" for k in ("step",) + keys))
    for batch in (1, 8, 32, 64):
        b = _engine_breakdown(lab, model, batch, clock)
        say(f"    {batch:5d} " + "".join(f"{b[k] * 1e3:17.2f}" for k in ("step",) + keys))
    return say.text()


def _against_generate(lab: ModuleType, say: Report, torch, hf, model, requests: list, static_batch: int, rounds: int,
                      clock) -> None:
    """The workload through the engine, through `generate` one request at a time (in turns,
    best of `rounds`) and in static batches; the outputs compared token by token (a divergence
    must be a near tie of the two float32 implementations) before the ratios are reported."""
    num_requests = len(requests)
    useful = sum(m for _, m in requests)
    # Correctness first: the logits of one prompt agree, then every greedy output, token by token.
    prompt = requests[0][0]
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([prompt])).logits[0].numpy()
    logit_err = float(np.abs(hf_logits - model.forward_dense(prompt)).max())

    t_engine = t_single = math.inf
    for _ in range(rounds):
        start = clock()
        ours = lab.LLMEngine(model).generate([p for p, _ in requests],
                                             [lab.SamplingParams(max_tokens=m) for _, m in requests])
        t_engine = min(t_engine, clock() - start)
        start = clock()
        one_by_one = [_hf_generate(torch, hf, [p], m)[0] for p, m in requests]
        t_single = min(t_single, clock() - start)
    say(f"  engine (continuous batching, all {num_requests} at once), best of {rounds} in turns with the next: "
        f"{t_engine:.1f} s = {useful / t_engine:.0f} useful tokens/s; max |logit difference| to transformers on "
        f"one prompt {logit_err:.1e}")
    say(f"  transformers generate, one request at a time, best of {rounds}: {t_single:.1f} s = "
        f"{useful / t_single:.0f} useful tokens/s")

    start = clock()
    static = []
    computed = 0
    for i in range(0, num_requests, static_batch):
        group = requests[i:i + static_batch]
        longest = max(m for _, m in group)
        outs = _hf_generate(torch, hf, [p for p, _ in group], longest)
        static += [out[:m] for out, (_, m) in zip(outs, group)]
        computed += longest * len(group)
    t_static = clock() - start
    say(f"  transformers generate, static batches of {static_batch}: {t_static:.1f} s = {useful / t_static:.0f} "
        f"useful tokens/s ({computed} tokens computed, {useful / computed:.0%} of them useful)")

    same_single = sum(o.output_token_ids == h for o, h in zip(ours, one_by_one))
    same_static = sum(o.output_token_ids == h for o, h in zip(ours, static))
    ties = [_greedy_divergence(torch, hf, model, p, o.output_token_ids, h)
            for (p, _), o, h in zip(requests, ours, one_by_one) if o.output_token_ids != h]
    say(f"  identical greedy outputs: engine vs one at a time {same_single}/{num_requests}, vs static batches "
        f"{same_static}/{num_requests}")
    for position, gap, err in ties:
        say(f"    a request diverges at output token {position}: there the two tokens' logits are {gap:.3f} apart, "
            f"and the two float32 implementations' logits differ by up to {err:.3f} (a near tie, not a bug)")
    if any(gap > 2 * err for _, gap, err in ties):
        raise AssertionError("the engine's greedy outputs differ from transformers' generate on the same "
                             "weights where the logits are no near tie")
    say(f"  engine / generate one at a time = {t_single / t_engine:.2f}x (goal >= 4x), engine / static "
        f"batches of {static_batch} = {t_static / t_engine:.2f}x (goal >= 5x)")
