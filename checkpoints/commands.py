"""What the command line does with a GPT-2 checkpoint directory: serve it, generate from it,
speculate with a pair of them.

    python solution.py generate --model DIR --prompt "..."     -> generate_text
    python solution.py speculate --target DIR --draft DIR      -> speculate_checkpoints
    python solution.py serve --model DIR                       -> checkpoint_engine, then the server

Each function is handed the lab module (`lab`) whose engine and speculative decoding it runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np

from measure.timing import best_side_by_side

from .model_loader import load_gpt2
from .tokenizer import GPT2Tokenizer

# A few sentences of ordinary English for `speculate` to continue.
DEFAULT_PROMPT = ("The city council met on Tuesday to discuss the new budget. After a long debate, the members "
                  "agreed that")


def checkpoint_engine(lab: ModuleType, model_dir: str | os.PathLike, max_num_seqs: int = 4, num_threads: int = 1,
                      **engine_kwargs) -> tuple[object, GPT2Tokenizer]:
    """`(lab.LLMEngine, tokenizer)` for a checkpoint, its KV-cache sized for `max_num_seqs`
    sequences of the model's full length (n_positions = the server's max_model_len), the model's
    products split over `num_threads` threads. The server
    installs the API's logits processors with the tokenizer's `<|endoftext|>` (min_tokens holds
    it back) when it is handed the engine.

    GPT-2 124M holds 73.7 KB of float32 K/V per token (2 x 12 layers x 768), so the default 4 x
    1024 tokens take 302 MB; the engine's own default of 64 sequences would take 4.8 GB.
    """
    model, tokenizer = load_gpt2(lab, model_dir, num_threads)
    return lab.LLMEngine(model, max_num_seqs=max_num_seqs, **engine_kwargs), tokenizer


def _prompt_ids(tokenizer: GPT2Tokenizer, prompt: str, n_positions: int) -> list[int]:
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt is empty; expected at least one token")
    if len(ids) >= n_positions:
        raise ValueError(f"prompt is {len(ids)} tokens; the model's context (n_positions) holds {n_positions}, "
                         f"with room for at least one output token")
    return ids


def generate_text(lab: ModuleType, model_dir: str | os.PathLike, prompt: str, max_tokens: int = 32,
                  temperature: float = 0.0, seed: int | None = 0) -> str:
    """The completion of `prompt` by the checkpoint in `model_dir`, through `lab.LLMEngine`.

    Greedy at temperature 0. Stops at `<|endoftext|>` (not part of the text) or after
    `max_tokens` tokens, fewer if the context (n_positions) fills up first.
    """
    model, tokenizer = load_gpt2(lab, model_dir)
    ids = _prompt_ids(tokenizer, prompt, model.config.n_positions)
    max_tokens = min(lab.check_int("max_tokens", max_tokens, 1), model.config.n_positions - len(ids))
    stop = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    engine = lab.LLMEngine(model, max_num_seqs=1)
    sampling = lab.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, stop_token_ids=stop)
    out = engine.generate([ids], sampling)[0]
    if out.finish_reason in ("rejected", "error"):
        raise RuntimeError(f"the engine did not run the prompt: {out.finish_reason}: {out.finish_detail}")
    return tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


# --- speculation on two checkpoints ------------------------------------------------------


def _plain_decode(lab: ModuleType, model, prompt: Sequence[int], num_tokens: int, temperature: float,
                  seed: int | None) -> tuple[list[int], float, float]:
    """The baseline speculation must beat: one paged forward pass per token, on the same
    block-table machinery `speculative_generate` uses. Returns (tokens, prefill s, decode s)."""
    block_size = 16
    num_blocks = lab.blocks_needed(model.config.n_positions, block_size)
    table = lab.BlockTable(lab.BlockAllocator(num_blocks, block_size))
    cache = lab.KVCache(model.config, num_blocks, block_size)
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    out = []
    times = [time.perf_counter()]
    computed = 0
    while len(out) < num_tokens:
        cache.copy_blocks(table.append_tokens(tokens[computed:]))
        logits = model.forward(cache, [table], [computed], [len(tokens) - computed])[-1]
        computed = len(tokens)
        token = int(np.argmax(logits)) if temperature == 0 else int(rng.choice(len(logits),
                                                                            p=lab.token_probs(logits, temperature)))
        out.append(token)
        tokens.append(token)
        times.append(time.perf_counter())
    return out, times[1] - times[0], times[-1] - times[1]


def forward_pass(lab: ModuleType, model, context_len: int, num_new: int, batch: int = 1) -> Callable[[], object]:
    """One paged forward of `model` to time: each of `batch` sequences has `context_len` tokens
    cached and runs `num_new` more (1: a decode step; k + 1: a verify pass; from context 0: a
    prefill). Each call rewrites the same slots, so every call does the same work. A TypeError
    where the model's activations come out other than float32 (a pass in float64 costs twice)."""
    block_size = 16
    per_seq = lab.blocks_needed(context_len + num_new, block_size)
    allocator = lab.BlockAllocator(batch * per_seq, block_size)
    cache = lab.KVCache(model.config, batch * per_seq, block_size)
    rng = np.random.default_rng(0)
    tables = [lab.BlockTable(allocator) for _ in range(batch)]
    for table in tables:
        table.append_tokens(rng.integers(0, model.config.vocab_size, context_len + num_new).tolist())
    starts, counts = [context_len] * batch, [num_new] * batch
    if model.forward(cache, tables, starts, counts).dtype != np.float32:
        raise TypeError("the model path promoted its activations to float64: keep it float32")
    return lambda: model.forward(cache, tables, starts, counts)


def measure_verify_cost(lab: ModuleType, model, context_len: int, k: int, repeats: int = 5, *, batch: int = 1,
                        clock: Callable[[], float] = time.perf_counter) -> float:
    """How many decode steps one verify pass costs: the best time of a forward over k + 1 new
    tokens per sequence after `context_len`, over the best time of one over a single token, the
    two timed in turns (`forward_pass`)."""
    best = best_side_by_side({n: forward_pass(lab, model, context_len, n, batch) for n in (1, k + 1)}, repeats,
                             clock=clock)
    return best[k + 1] / best[1]


def _target_and_draft(lab: ModuleType, target_dir: str | os.PathLike, draft_dir: str | os.PathLike):
    """(target, its tokenizer, draft) from two checkpoints; a ValueError unless the draft shares the
    target's tokenizer and vocabulary."""
    target, tokenizer = load_gpt2(lab, target_dir)
    draft, draft_tokenizer = load_gpt2(lab, draft_dir)
    if not tokenizer.same_vocabulary(draft_tokenizer):
        raise ValueError(f"{draft_dir}: its vocab.json/merges.txt differ from {target_dir}'s; a draft must share "
                         f"the target's tokenizer")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"{draft_dir}: vocab_size {draft.config.vocab_size}, the target's is "
                         f"{target.config.vocab_size}; a draft must score the same tokens")
    return target, tokenizer, draft


def _best_times(lab: ModuleType, target, draft, ids: list[int], sampling, k: int, repeats: int):
    """The target alone, the draft alone and speculative decoding, timed `repeats` times in turns
    after a warm-up: (the best (total, decode) seconds of each and the best speculative seconds,
    the target's own tokens, the speculative output)."""
    max_tokens, temperature, seed = sampling.max_tokens, sampling.temperature, sampling.seed
    best = {"target": (np.inf, np.inf), "draft": (np.inf, np.inf), "speculative": np.inf}
    for _ in range(1 + repeats):  # in turns, so drift hits all three alike; the first run warms up
        base, prefill, decode = _plain_decode(lab, target, ids, max_tokens, temperature, seed)
        best["target"] = min(best["target"], (prefill + decode, decode))
        _, prefill, decode = _plain_decode(lab, draft, ids, max_tokens, temperature, seed)
        best["draft"] = min(best["draft"], (prefill + decode, decode))
        start = time.perf_counter()
        out = lab.speculative_generate(target, draft, ids, sampling, k=k)
        best["speculative"] = min(best["speculative"], time.perf_counter() - start)
    return best, base, out


def _formula_alpha(lab: ModuleType, target, draft, ids: list[int], output_ids, temperature: float) -> float:
    """alpha by its formula over the output's positions: sum(min(p, q)) at T > 0, the two models'
    argmax agreement at T = 0 (p, q from `forward_dense`)."""
    text_ids = ids + list(output_ids)
    rows = slice(len(ids) - 1, len(text_ids) - 1)  # the positions that predicted an output token
    p_logits, q_logits = target.forward_dense(text_ids)[rows], draft.forward_dense(text_ids)[rows]
    if temperature == 0:
        return float(np.mean(p_logits.argmax(axis=1) == q_logits.argmax(axis=1)))
    return float(np.minimum(lab.token_probs(p_logits, temperature),
                            lab.token_probs(q_logits, temperature)).sum(axis=1).mean())


def _same_as_target(output_ids, target_ids, temperature: float) -> str:
    """Whether the speculative output is the target's own greedy tokens (at T = 0), in words."""
    if temperature != 0:
        return f"sampled at T = {temperature:g}: the target's distribution, not its tokens"
    match = next((i for i, (a, b) in enumerate(zip(output_ids, target_ids)) if a != b), None)
    if match is None and len(output_ids) == len(target_ids):
        return "identical to the target's own greedy tokens"
    return f"DIFFERS from the target's greedy tokens from token {match} on (a near-tie in float32?)"


def _shape(model, where) -> str:
    cfg = model.config
    return f"{os.path.basename(os.path.normpath(os.fspath(where)))} (n_layer {cfg.n_layer}, n_embd {cfg.n_embd})"


def speculate_checkpoints(lab: ModuleType, target_dir: str | os.PathLike, draft_dir: str | os.PathLike,
                          prompt: str = DEFAULT_PROMPT, k: int = 4, max_tokens: int = 64,
                          temperature: float = 0.0, seed: int | None = 0, repeats: int = 2) -> str:
    """Measure speculative decoding with a real draft model: alpha, tokens per target pass,
    the draft's cost c and the speedup, each beside its formula (Leviathan et al. 2023).

    The two checkpoints must share a tokenizer (distilgpt2 drafting for gpt2 do). Runs, in
    turn: the target alone and the draft alone (one paged pass per token: the baseline, and c =
    draft decode time / target decode time), then `lab.speculative_generate`. All three make
    `max_tokens` tokens with no stop token, so every run does the same work; each is timed
    `repeats` times after a warm-up, in turns, and the best time counts. At temperature 0
    the speculative output must equal the target's own greedy tokens; the report says whether
    it does. It also times one verify pass of k + 1 tokens against a one-token pass: the
    formula's speedup assumes they cost the same, which holds on a GPU at small batch and can
    fail on a CPU, where NumPy's matrix products are not bound by reading the weights alone.
    Formula alpha: at T > 0, sum(min(p, q)) averaged over the output's positions (p, q from
    `forward_dense`); at T = 0, how often the two models' argmax agree there.
    """
    target, tokenizer, draft = _target_and_draft(lab, target_dir, draft_dir)
    k, repeats = lab.check_int("k", k, 1), lab.check_int("repeats", repeats, 1)
    n_positions = min(target.config.n_positions, draft.config.n_positions)
    ids = _prompt_ids(tokenizer, prompt, n_positions)
    max_tokens = min(lab.check_int("max_tokens", max_tokens, 1), n_positions - len(ids))

    sampling = lab.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    best, base, out = _best_times(lab, target, draft, ids, sampling, k, repeats)
    (baseline_time, target_decode), (_, draft_decode) = best["target"], best["draft"]
    spec_time = best["speculative"]
    verify_cost = measure_verify_cost(lab, target, len(ids), k, repeats=max(repeats, 5))

    alpha = lab.estimate_alpha(out, k)  # accepts / judged drafts: a round ends at its first rejection
    formula_alpha = _formula_alpha(lab, target, draft, ids, out.token_ids, temperature)
    steps = max(max_tokens - 1, 1)
    c = (draft_decode / steps) / (target_decode / steps)
    passes = max(out.num_target_passes, 1)
    expected = lab.expected_tokens_per_step(min(alpha, 1.0), k)
    return "\n".join([
        f"Speculative decoding on checkpoints: target {_shape(target, target_dir)}, draft {_shape(draft, draft_dir)},"
        f" k = {k}, T = {temperature:g}, {len(out.token_ids)} tokens after a {len(ids)}-token prompt",
        f"  alpha: measured {alpha:.3f} (accepts / judged drafts), formula {formula_alpha:.3f} "
        f"({'argmax agreement' if temperature == 0 else 'sum(min(p, q))'} over the output's positions)",
        f"  tokens per target pass: measured {len(out.token_ids) / passes:.2f}, "
        f"formula E(alpha, k) = {expected:.2f}",
        f"  draft cost c = {c:.3f} target steps (decode: draft {1e3 * draft_decode / steps:.1f} ms/token, "
        f"target {1e3 * target_decode / steps:.1f} ms/token)",
        f"  a verify pass of k + 1 = {k + 1} tokens costs {verify_cost:.2f} target decode steps here "
        f"(the formula assumes 1: true while a step is bound by reading the weights)",
        f"  speedup: measured {baseline_time / spec_time:.2f}x (target alone {baseline_time:.2f} s, speculative "
        f"{spec_time:.2f} s); formula speculative_speedup(alpha, k, c) = "
        f"{lab.speculative_speedup(min(alpha, 1.0), k, c):.2f}x, with the measured verify cost "
        f"E / (k c + {verify_cost:.2f}) = {expected / (k * c + verify_cost):.2f}x",
        f"  output: {_same_as_target(out.token_ids, base, temperature)}",
        f"  text: {tokenizer.decode(out.token_ids, skip_special_tokens=True)!r}",
    ])
