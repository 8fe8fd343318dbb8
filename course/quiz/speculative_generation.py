"""Quiz 7: speculative generation (Exercise 7), every answer computed by the module under quiz."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from .questions import Question, ceil_div, fmt, question


def quiz_speculative_generation(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    model = lab.ToyTransformer(lab.ModelConfig(), seed=int(rng.integers(0, 1000)))
    k, m = int(rng.integers(2, 6)), int(rng.integers(8, 21))
    prompt = [int(t) for t in rng.integers(0, model.config.vocab_size, int(rng.integers(3, 9)))]
    out = lab.speculative_generate(model, model, prompt, lab.SamplingParams(max_tokens=m), k=k)
    q1 = question(
        f"Greedy speculative decoding whose draft always agrees with the target (the draft IS the target: "
        f"alpha = 1), k = {k} drafts per round, max_tokens = {m}. How many target passes (rounds) does it take?",
        out.num_target_passes, ceil_div(m, k + 1),
        f"Every round keeps its drafts and adds the bonus token from the same pass: {k + 1} tokens a round, "
        f"and the last round drafts only what is still wanted. ceil({m} / {k + 1}) = {ceil_div(m, k + 1)} "
        f"passes instead of {m}: fewer sequential target steps is what lowers TPOT.")
    alpha = float(rng.choice([0.6, 0.7, 0.8, 0.9]))
    k = int(rng.integers(2, 9))
    c = float(rng.choice([0.05, 0.1, 0.2]))
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    q2 = question(
        f"A draft with acceptance rate alpha = {alpha:g} and k = {k}: how many tokens does one target pass "
        f"emit on average?", lab.expected_tokens_per_step(alpha, k), tokens,
        f"j+1 tokens when the first j drafts are kept: 1 + alpha + ... + alpha^{k} = (1 - alpha^{k + 1}) / "
        f"(1 - alpha) = {fmt(tokens)} (taking acceptances as independent).", tolerance=0.01, relative=True)
    speedup = tokens / (k * c + 1)
    q3 = question(
        f"The same draft costs c = {c:g} of a target step per draft token. What speedup over plain decoding "
        f"does that give?", lab.speculative_speedup(alpha, k, c), speedup,
        f"A round costs k draft steps and ONE target pass (bandwidth-bound, about one decode step): "
        f"{fmt(tokens)} / ({k} x {c:g} + 1) = {fmt(speedup)}. At large batch or in prefill the pass turns "
        f"compute-bound and costs more: the speedup shrinks.", tolerance=0.01, relative=True)
    return [q1, q2, q3]
