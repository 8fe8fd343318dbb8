"""The design-review scenarios: what `python solution.py` prints, each computed by the handed module.

1. Size a deployment (`sizing.py`); 2. defend continuous batching (the simulator, below);
3. decide whether to add speculative decoding (the speedup algebra and a measured run, below);
4. pick a stack (`stacks.py`). A scenario whose exercise is still a stub says so, and the others run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from loadtest.simulator import ServingSimulation, recurring_workload, simulate_serving, skewed_workload

from .sizing import scenario_size
from .stacks import scenario_stack


def format_timeline(sim: ServingSimulation, width: int = 96) -> str:
    """The slots x steps picture: one line per slot, one column per `ceil(steps / width)` steps
    (the most frequent state in those steps). '#' a long request (output > 4x the median),
    letters the others (a new letter = a new request in the slot), '.' a slot idle while
    requests wait (wasted), ' ' idle with nothing to do."""
    per_col = max(1, math.ceil(sim.num_steps / width))
    long_cut = 4 * float(np.median(sim.output_lens))

    def glyph(cell: int) -> str:
        if cell < 0:
            return "." if cell == -1 else " "
        return "#" if sim.output_lens[cell] > long_cut else "abcdefghijklmnopqrstuvwxyz"[cell % 26]

    lines = [f"{sim.scheduling}: {sim.num_slots} slots x {sim.num_steps} steps, one column = {per_col} step(s)"]
    for slot in range(sim.num_slots):
        cols = []
        for c in range(0, sim.num_steps, per_col):
            cells = [row[slot] for row in sim.timeline[c : c + per_col]]
            cols.append(glyph(max(cells, key=cells.count)))
        lines.append(f"slot {slot:>2} |{''.join(cols)}|")
    return "\n".join(lines)


def format_batching_report(static: ServingSimulation, continuous: ServingSimulation, title: str = "",
                           timeline_width: int = 96) -> str:
    """The design-review slide: both timelines, then the numbers side by side."""
    rows = [("steps", "num_steps", "{:.0f}"), ("simulated time (s)", "duration", "{:.2f}"),
            ("throughput (tokens/s)", "throughput", "{:.0f}"), ("tokens per step", "tokens_per_step", "{:.2f}"),
            ("wasted slot-steps", "wasted_slot_steps", "{:.0f}"), ("preemptions", "num_preemptions", "{:.0f}")]
    lines = [title] if title else []
    lines += [format_timeline(static, timeline_width), "", format_timeline(continuous, timeline_width), ""]
    lines.append(f"{'':<28}{'static':>12}{'continuous':>12}")
    for label, attr, fmt in rows:
        a, b = getattr(static, attr), getattr(continuous, attr)
        lines.append(f"{label:<28}{fmt.format(a):>12}{fmt.format(b):>12}")
    for unit, in_steps, scale, fmt in (("s", False, 1.0, "{:.3f}"), ("steps", True, 1.0, "{:.1f}")):
        sa, sb = static.summary(in_steps), continuous.summary(in_steps)
        for key in ("mean_ttft", "p99_ttft", "mean_tpot", "p99_tpot"):
            label = f"{key} ({unit})"
            lines.append(f"{label:<28}{fmt.format(sa[key] * scale):>12}{fmt.format(sb[key] * scale):>12}")
    lines.append(f"continuous / static throughput: {continuous.throughput / static.throughput:.2f}x")
    return "\n".join(lines)


def _static_and_continuous(lab: ModuleType, workload, slots: int) -> tuple[ServingSimulation, ServingSimulation]:
    return (simulate_serving(lab, workload, "static", max_num_seqs=slots),
            simulate_serving(lab, workload, "continuous", max_num_seqs=slots))


def scenario_batching(lab: ModuleType, slots: int = 16, long_len: int = 2000, short_len: int = 50,
                      num_short: int = 63, timeline_width: int = 96) -> str:
    """The design review "defend continuous batching", in the simulator at real sizes (Llama-2-7B
    on an A100, StepCostModel): the skewed workload, then a stream where long answers recur."""
    out = []

    def both(workload):
        return _static_and_continuous(lab, workload, slots)

    skewed = skewed_workload(num_short=num_short, long_len=long_len, short_len=short_len, prompt_len=128)
    s, c = both(skewed)
    out.append(format_batching_report(s, c, "== Skewed: 1 request answers 2000 tokens, 63 answer 50 "
                                            f"(prompts 128, {slots} slots) ==", timeline_width))
    stream = recurring_workload(256, long_len=long_len, short_len=short_len, prompt_len=128, rate=4.0)
    s2, c2 = both(stream)
    out.append(format_batching_report(s2, c2, "\n== Stream: 256 requests arriving at 4/s, one in eight "
                                              f"answers {long_len} tokens, the rest {short_len} ==", timeline_width))

    out.append(
        f"\nWhy they differ: with ONE long answer the makespan is that answer in both schedules "
        f"({s.num_steps} vs {c.num_steps} steps), so throughput moves only {c.throughput / s.throughput:.2f}x; "
        f"what static batching loses there is latency (mean TTFT {s.summary()['mean_ttft']:.1f} s vs "
        f"{c.summary()['mean_ttft']:.2f} s) and {s.wasted_slot_steps} slot-steps. When long answers recur, "
        f"nearly every static batch holds one, so every batch lasts ~{long_len} steps at "
        f"{s2.tokens_per_step:.1f} tokens/step, while continuous batching refills the slots: "
        f"{c2.tokens_per_step:.1f} tokens/step, {c2.throughput / s2.throughput:.2f}x the throughput. A step costs "
        f"about the same either way (the weights are read once per step), so tokens per step is throughput. "
        f"TTFT is queueing + prefill: continuous batching moves it. TPOT is the decode step: it grows a little "
        f"with the batch ({s2.summary()['mean_tpot'] * 1e3:.1f} -> {c2.summary()['mean_tpot'] * 1e3:.1f} ms).")
    return "\n".join(out)


def format_speculation_table(lab: ModuleType, c: float, alphas=(0.5, 0.6, 0.7, 0.8, 0.9),
                             ks=(1, 2, 3, 4, 5, 6, 8)) -> str:
    """The design-review table "should we add speculative decoding?" for a draft of cost c.

    Rows alpha, columns k: expected speedup (`speculative_speedup`), then the best k, its speedup
    and its breakeven draft cost. Followed by why it helps decode but not prefill or large batches.
    """
    if not alphas or not ks:
        raise ValueError("alphas and ks must be non-empty")
    head = f"{'alpha':>6} |" + "".join(f"{'k=' + str(k):>7}" for k in ks) \
        + f" | {'best k':>6} {'speedup':>8} {'breakeven c':>12}"
    lines = [f"Expected speedup of speculative decoding, draft cost c = {c:g} target steps "
             "(verify pass = 1 decode step)",
             head, "-" * len(head)]
    for alpha in alphas:
        speedups = [lab.speculative_speedup(alpha, k, c) for k in ks]  # it checks alpha, k and c
        best = int(np.argmax(speedups))
        lines.append(f"{alpha:>6.2f} |" + "".join(f"{s:>7.2f}" for s in speedups)
                     + f" | {ks[best]:>6d} {speedups[best]:>8.2f}"
                     + f" {lab.breakeven_draft_cost(alpha, ks[best]):>12.3f}")
    lines.append("(< 1 is a slowdown. Breakeven c = the dearest draft that still pays at that k;"
                 " it is largest, c = alpha, at k = 1)")

    alpha, k = max(alphas), max(ks)
    tokens = lab.expected_tokens_per_step(alpha, k)
    compute_bound = lab.predicted_speedup(alpha, k, c, verify_cost=k + 1)
    lines += [
        "",
        "Why it helps decode: a decode step reads every weight (and the KV-cache) to produce",
        "ONE token per sequence, so it is memory-bandwidth-bound and the arithmetic units mostly",
        "idle. Scoring k+1 tokens in that pass reads the same bytes and costs about one step, so",
        f"at alpha = {alpha:g}, k = {k} a target pass yields {tokens:.2f} tokens instead of 1, "
        "for the price of k draft steps.",
        "Why not prefill: the prompt's tokens are all known and already go through one parallel,",
        "compute-bound pass; there are no sequential steps to save and no idle FLOPs to spend.",
        "When a pass is compute-bound, k+1 tokens cost ~k+1 steps and the speedup",
        f"E/(k*c + k+1) = {compute_bound:.2f} < 1 here: speculation can only lose.",
        "Why less at large batch: B sequences per step already use the idle compute; a verify",
        "pass of B*(k+1) tokens turns compute-bound, verify_cost grows toward k+1 and",
        "`predicted_speedup` toward (then below) 1; rejected drafts waste FLOPs the batch needs.",
        "Sources: Leviathan et al. 2023, Fast Inference from Transformers via Speculative",
        "Decoding; Chen et al. 2023, Accelerating Large Language Model Decoding with",
        "Speculative Sampling.",
    ]
    return "\n".join(lines)


def make_early_exit_target(lab: ModuleType, config, num_draft_layers: int, refinement_scale: float,
                           seed: int = 0):
    """A target whose layers from `num_draft_layers` on are small refinements of the residual stream.

    GPT-2 init, then `attn.c_proj` and `mlp.c_proj` weights of layers >= num_draft_layers are
    multiplied by `refinement_scale` (0 < scale <= 1; 1 is the plain init). The early layers and
    the head are untouched, so `lab.make_self_draft(target, num_draft_layers)` shares them exactly.
    """
    if not 1 <= num_draft_layers <= config.n_layer:
        raise ValueError(f"num_draft_layers must be in 1..{config.n_layer}, got {num_draft_layers}")
    if not 0.0 < refinement_scale <= 1.0:
        raise ValueError(f"refinement_scale must be in (0, 1], got {refinement_scale}")
    weights = lab.init_gpt2_weights(config, seed)
    for i in range(num_draft_layers, config.n_layer):
        for name in (f"h.{i}.attn.c_proj.weight", f"h.{i}.mlp.c_proj.weight"):
            weights[name] *= np.float32(refinement_scale)  # in place: stays float32
    return lab.ToyTransformer(config, weights)


def paged_greedy_generate(lab: ModuleType, model, prompt_token_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The baseline: plain greedy decoding on the paged cache, one forward pass per output token."""
    seq = lab.PagedSequence(model)
    seq.extend(list(prompt_token_ids))
    token = int(np.argmax(seq.run()[-1]))  # prefill the whole prompt
    out = [token]
    while len(out) < max_tokens:
        seq.extend([token])
        token = int(np.argmax(seq.run()[-1]))
        out.append(token)
    return out


# The toy pair `python solution.py speculate` runs: a 4-layer target whose later layers refine
# (scale 0.2: alpha ~0.7, the middle of the table) and its 1-layer self-draft; ~0.3 s.
_SPEC_DEMO_CONFIG = dict(vocab_size=256, n_positions=256, n_embd=64, n_layer=4, n_head=4)


def _measured_speculation(lab: ModuleType, k: int = 4, num_tokens: int = 100) -> str:
    """Run `speculative_generate` (Exercises 6 and 7) on the toy models, sampled at T = 1, and set
    the measured alpha and tokens per target pass beside the formulas' predictions: alpha =
    sum(min(p, q)) averaged over the positions of the output (p, q from forward_dense)."""
    config = lab.ModelConfig(**_SPEC_DEMO_CONFIG)
    target = make_early_exit_target(lab, config, 1, 0.2)
    draft = lab.make_self_draft(target, 1)
    prompt = list(range(1, 9))
    out = lab.speculative_generate(target, draft, prompt, lab.SamplingParams(max_tokens=num_tokens, temperature=1.0,
                                                                     seed=0), k=k)
    text = prompt + out.token_ids
    p = lab.token_probs(target.forward_dense(text)[len(prompt) - 1:-1], 1.0)
    q = lab.token_probs(draft.forward_dense(text)[len(prompt) - 1:-1], 1.0)
    predicted = float(np.minimum(p, q).sum(axis=1).mean())  # acceptance_rate, row by row
    measured = lab.estimate_alpha(out, k)
    # The proof, as arithmetic on these very rows: one accept/resample emits exactly p.
    exact = max(float(np.abs(lab.speculative_output_distribution(pi, qi) - pi).max()) for pi, qi in zip(p, q))
    return "\n".join([
        f"Measured: your speculative_generate on the toy models, sampled at T = 1, k = {k}: a "
        f"{config.n_layer}-layer target (later layers x 0.2) and its 1-layer self-draft",
        f"  {len(out.token_ids)} tokens in {out.num_target_passes} target passes",
        f"  alpha: measured {measured:.3f} (accepts / judged drafts), formula {predicted:.3f} "
        f"(sum(min(p, q)) averaged over the output's positions)",
        f"  tokens per target pass: measured {len(out.token_ids) / max(out.num_target_passes, 1):.2f}, "
        f"formula E(alpha, k) = {lab.expected_tokens_per_step(predicted, k):.2f}",
        f"  the output keeps the target's distribution: over these {len(p)} positions, "
        f"max |P(emitted) - p| = {exact:.1e} (speculative_output_distribution, exact arithmetic)",
    ])


def scenario_speculate(lab: ModuleType, alpha: float | None = None, k: int | None = None,
                       c: float = 0.05) -> str:
    """Decide whether to add speculative decoding: the speedup table for a draft of cost c, a
    measured run of the lab's own speculative decoding on the toy models (or which stub it still
    needs), and the verdict for one (alpha, k) when given."""
    text = format_speculation_table(lab, c)
    verdict = ""
    if alpha is not None:
        ks = [k] if k is not None else list(range(1, 9))
        best = max(ks, key=lambda kk: lab.speculative_speedup(alpha, kk, c))
        speedup = lab.speculative_speedup(alpha, best, c)
        verdict = (f"\n\nYour draft: alpha {alpha:g}, c {c:g}, k {best}: expected "
                   f"{lab.expected_tokens_per_step(alpha, best):.2f} tokens per target pass, speedup {speedup:.2f}x "
                   f"({'worth adding' if speedup > 1 else 'not worth it'}); breakeven draft cost at this alpha and k: "
                   f"c = {lab.breakeven_draft_cost(alpha, best):.3f}.")
    try:
        measured = _measured_speculation(lab)
    except NotImplementedError as exc:  # the formulas above are provided; the run needs the exercises
        measured = f"Measured: not yet: {exc} is still a stub (write it to see your speculative decoding run here)"
    return f"{text}\n\n{measured}{verdict}"


# An example price for the main job's cost line, not a quote: pass --usd-per-gpu-hour for yours.
EXAMPLE_USD_PER_GPU_HOUR = 2.0


def run_all_scenarios(lab: ModuleType) -> tuple[str, list[str]]:
    """The four design-review scenarios in order, and the stubs any of them hit (in lab.py a
    scenario whose exercise is not written yet says so and the others still run)."""
    sections = [
        ("1. Size a vLLM deployment", lambda: scenario_size(lab, usd_per_gpu_hour=EXAMPLE_USD_PER_GPU_HOUR)),
        ("2. Defend continuous batching", lambda: scenario_batching(lab)),
        ("3. Decide whether to add speculative decoding", lambda: scenario_speculate(lab)),
        ("4. Pick a stack", lambda: scenario_stack(lab)),
    ]
    bar = "=" * 100
    texts, stubs = [], []
    for title, make in sections:
        try:
            body = make()
        except NotImplementedError as exc:
            stubs.append(str(exc))
            body = f"(not yet: {exc} is still a stub)"
        texts.append(f"{bar}\n{title}\n{bar}\n{body}")
    return "\n\n".join(texts), stubs
