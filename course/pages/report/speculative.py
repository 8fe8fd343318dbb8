"""Figure 4 of the report: speculative decoding, the rounds of a real run and the speedup curve."""

from __future__ import annotations

import contextlib
import math
from types import ModuleType

from ...reviews.scenarios import make_early_exit_target
from ..svg import (
    BLUE,
    GREEN,
    GREY,
    INK,
    ORANGE,
    SKY,
    VERMILLION,
    WIDTH,
    chart,
    el,
    figure,
    hatch,
    legend,
    line,
    nice_ticks,
    polyline,
    rect,
    svg,
    text,
    xscale,
)

SPEC_MODEL = dict(vocab_size=256, n_positions=256, n_embd=64, n_layer=4, n_head=4)
SPEC = dict(k=4, max_tokens=40, draft_layers=1, refinement_scale=0.2, seed=0, prompt=list(range(1, 9)))
CURVE_LEFT = 560  # the speedup curve's left edge


@contextlib.contextmanager
def _recording_verifications(lab: ModuleType, rounds: list):
    """While active, every `lab.accept_or_resample` call also appends (drafts, emitted) to
    `rounds`: speculative_generate's per-round detail, recorded without changing what it does."""
    original = lab.accept_or_resample

    def recorded(draft_token_ids, draft_probs, target_probs, rng):
        emitted = original(draft_token_ids, draft_probs, target_probs, rng)
        rounds.append(([int(t) for t in draft_token_ids], [int(t) for t in emitted]))
        return emitted

    lab.accept_or_resample = recorded
    try:
        yield
    finally:
        lab.accept_or_resample = original


def run_speculative(lab: ModuleType) -> dict:
    """`speculative_generate` on the toy pair (a 4-layer target whose later layers refine, its
    1-layer self-draft), sampled at T = 1; each round classified from what it drafted and emitted.
    The draft's cost c is its share of the target's layers (draft_layers / n_layer)."""
    config = lab.ModelConfig(**SPEC_MODEL)
    target = make_early_exit_target(lab, config, SPEC["draft_layers"], SPEC["refinement_scale"])
    draft = lab.make_self_draft(target, SPEC["draft_layers"])
    sampling = lab.SamplingParams(max_tokens=SPEC["max_tokens"], temperature=1.0, seed=SPEC["seed"])
    recorded: list = []
    with _recording_verifications(lab, recorded):
        out = lab.speculative_generate(target, draft, SPEC["prompt"], sampling, k=SPEC["k"])
    k = SPEC["k"]
    if len(recorded) != len(out.accepted_per_pass):
        # This speculative_generate verifies without calling lab.accept_or_resample: derive each
        # round from its accept count, the emitted tokens and the documented draft count
        # min(k, tokens still wanted - 1); a rejected or discarded draft's id is then unknown (-1).
        recorded = []
        done = 0
        for accepted in out.accepted_per_pass:
            emitted = out.token_ids[done : done + accepted + 1]
            n = min(k, SPEC["max_tokens"] - done - 1)
            recorded.append((emitted[:accepted] + [-1] * (n - accepted), emitted))
            done += accepted + 1
    rounds = []
    for (drafts, emitted), accepted in zip(recorded, out.accepted_per_pass):
        bonus = accepted == len(drafts)
        rounds.append({"drafts": drafts, "accepted": accepted, "extra": emitted[-1],
                       "kind": "bonus" if bonus else "resampled"})
    alpha = lab.estimate_alpha(out, k)
    c = SPEC["draft_layers"] / config.n_layer
    ks = list(range(1, 11))
    tokens = len(out.token_ids)
    return {"params": dict(SPEC), "rounds": rounds, "num_tokens": tokens, "num_target_passes": out.num_target_passes,
            "num_draft_tokens": out.num_draft_tokens, "num_accepted": out.num_accepted,
            "num_rejected": sum(r["kind"] == "resampled" for r in rounds),
            "num_bonus": sum(r["kind"] == "bonus" for r in rounds),
            "alpha": alpha, "c": c, "ks": ks, "speedups": [lab.speculative_speedup(alpha, kk, c) for kk in ks]
            if 0 < alpha < 1 else [], "predicted": lab.speculative_speedup(alpha, k, c) if 0 < alpha < 1 else math.nan,
            "measured_speedup": tokens / (out.num_target_passes + c * out.num_draft_tokens)}


def _rounds(run: dict, cw: float, rh: float, x0: float, y0: float) -> tuple[list[str], float]:
    """One row per round: its drafts (accepted, rejected, discarded unjudged) and the token the
    target's own pass added; then the run's tallies. Returns the elements and the tallies' top."""
    k, rounds = run["params"]["k"], run["rounds"]
    body = []
    for i, r in enumerate(rounds):
        y = y0 + i * rh
        body.append(text(x0 - 8, y + 15, f"round {i + 1}", size=11, anchor="end", fill="#444444"))
        for j, tok in enumerate(r["drafts"]):
            if j < r["accepted"]:
                fill, fg = GREEN, INK
            elif j == r["accepted"]:
                fill, fg = VERMILLION, "#ffffff"
            else:
                fill, fg = "url(#sp-unjudged)", INK
            body.append(rect(x0 + j * cw, y, cw - 3, rh - 3, fill, stroke=INK, stroke_width=0.5))
            shown = tok if tok >= 0 else "?"
            body.append(text(x0 + j * cw + cw / 2 - 1, y + 14, f"\u2717{shown}" if j == r["accepted"] else shown,
                             size=11, anchor="middle", fill=fg, weight="bold" if j == r["accepted"] else None,
                             text_decoration="line-through" if j > r["accepted"] else None))
        xe = x0 + k * cw + 8
        body.append(rect(xe, y, cw - 3, rh - 3, ORANGE if r["kind"] == "resampled" else SKY, stroke=INK,
                         stroke_width=0.5))
        body.append(text(xe + cw / 2 - 1, y + 14, r["extra"], size=11, anchor="middle"))
        body.append(text(xe + cw + 6, y + 14, f"+{r['accepted'] + 1}", size=11, fill="#444444"))
    ty = y0 + len(rounds) * rh + 22
    tallies = [("tokens", run["num_tokens"], "tokens"), ("target passes", run["num_target_passes"], "passes"),
               ("drafted", run["num_draft_tokens"], "drafted"), ("accepted", run["num_accepted"], "accepted"),
               ("rejected", run["num_rejected"], "rejected"), ("bonus", run["num_bonus"], "bonus")]
    for i, (name, value, key) in enumerate(tallies):
        x = i % 3 * 160
        yy = ty + i // 3 * 22
        body.append(text(x, yy, f"{name}", size=12, fill="#444444"))
        body.append(text(x + 135, yy, value, size=13, anchor="end", weight="bold", label=key))
    return body, ty


def _speedup_curve(run: dict, y0: float) -> tuple[list[str], float]:
    """The expected speedup against k for the measured alpha and c, with this run's point on it.
    Returns the elements and the axis' height."""
    k = run["params"]["k"]
    body = []
    px0, px1, py0, py1 = CURVE_LEFT, 1200, y0 + 10, y0 + 300
    ks, speedups = run["ks"], run["speedups"]
    top = max([*speedups, run["measured_speedup"], 1.0]) * 1.15
    sx, sy = xscale(ks[0] - 0.5, ks[-1] + 0.5, px0, px1), xscale(0, top, py1, py0)
    body.append(text(px0, y0 - 6, f"expected speedup against k (alpha = {run['alpha']:.3f}, c = {run['c']:.2f})",
                     size=13, weight="bold"))
    for t in nice_ticks(top, 5):
        if t <= top:
            body.append(line(px0, sy(t), px1, sy(t), stroke="#e0e0e0"))
            body.append(text(px0 - 6, sy(t) + 4, f"{t:g}\u00d7", size=11, anchor="end"))
    body.append(line(px0, sy(1), px1, sy(1), stroke=GREY, width=1.5, stroke_dasharray="5 4"))
    body.append(text(px1, sy(1) - 5, "1\u00d7 = plain decoding", size=11, anchor="end", fill="#555555"))
    body.append(line(px0, py1, px1, py1))
    for kk in ks:
        body.append(text(sx(kk), py1 + 16, kk, size=11, anchor="middle"))
    body.append(text((px0 + px1) / 2, py1 + 34, "k (draft tokens per round)", size=12, anchor="middle"))
    measured_above = run["measured_speedup"] >= run["predicted"]
    if speedups:
        body.append(polyline([(sx(kk), sy(s)) for kk, s in zip(ks, speedups)], BLUE, 2.5))
        for kk, s in zip(ks, speedups):
            body.append(el("circle", cx=f"{sx(kk):.1f}", cy=f"{sy(s):.1f}", r=4, fill=BLUE))
            below = kk == k and measured_above
            body.append(text(sx(kk), sy(s) + (17 if below else -9), f"{s:.2f}", size=11, anchor="middle",
                             fill=BLUE, label=f"speedup-k{kk}"))
    mx, my = sx(k), sy(run["measured_speedup"])
    body.append(el("path", d=f"M {mx:.1f} {my - 8:.1f} L {mx + 8:.1f} {my:.1f} L {mx:.1f} {my + 8:.1f} "
                             f"L {mx - 8:.1f} {my:.1f} z", fill=VERMILLION, stroke=INK, stroke_width=0.8))
    body.append(text(mx + 12, my + (-10 if measured_above else 18),
                     f"this run, counted: {run['measured_speedup']:.2f}\u00d7 at c = {run['c']:.2f}", size=12,
                     weight="bold", fill=VERMILLION, label="measured-speedup"))
    return body, py1


def figure_speculative(lab: ModuleType) -> tuple[str, dict]:
    run = run_speculative(lab)
    k, rounds = run["params"]["k"], run["rounds"]
    cw, rh, x0, y0 = 44, 21, 78, 44
    body, _ = legend(0, 16, [(GREEN, "draft accepted"), (VERMILLION, "draft rejected"),
                             ("url(#sp-unjudged)", "drafted after a rejection: discarded unjudged"),
                             (ORANGE, "resampled from the residual"), (SKY, "bonus token (every draft accepted)")])
    heads = [text(x0, y0 - 6, f"drafted (k = {k})", size=12, fill="#444444"),
             text(x0 + k * cw + 8, y0 - 6, "+1", size=12, fill="#444444")]
    rounds_drawn, ty = _rounds(run, cw, rh, x0, y0)
    curve, py1 = _speedup_curve(run, y0)
    height = max(ty + 40, py1 + 44)
    split = CURVE_LEFT - 60  # the rounds on the left, the curve (its numbers included) on the right
    body += [chart("rounds", (0, y0 - 22, split, height), heads + rounds_drawn),
             chart("speedup", (split, y0 - 22, WIDTH, height), curve)]
    desc = (f"{len(rounds)} rounds, {run['num_draft_tokens']} drafted, {run['num_accepted']} accepted, "
            f"{run['num_rejected']} rejected, {run['num_bonus']} bonus tokens; alpha {run['alpha']:.3f}; measured "
            f"speedup {run['measured_speedup']:.2f} at k = {k}, formula {run['predicted']:.2f}.")
    picture = svg(height, body, "Speculative decoding rounds and speedup", desc,
                  defs=[hatch("sp-unjudged", "#dddddd")])
    caption = (f"speculative_generate on a {SPEC_MODEL['n_layer']}-layer toy target and its "
               f"{SPEC['draft_layers']}-layer self-draft, sampled at T = 1, k = {k}: one row per round (verification "
               "pass), token ids in the cells. Each round emits its accepted drafts plus one token from the target's "
               "own pass: resampled at the first rejection, or a bonus when all drafts survive, so even a round "
               "that accepts nothing makes progress. On the right, the expected speedup (1 - alpha^(k+1)) / "
               f"((1 - alpha)(k c + 1)) for the measured alpha = {run['alpha']:.3f} (estimate_alpha) and draft cost "
               f"c = {run['c']:.2f} (its share of the layers: assumed, not timed); the diamond is this run's speedup "
               "counted, not timed: tokens / (target passes + c \u00d7 draft steps), its passes and steps counted "
               "and each draft step charged c of a target pass (`bench speculative` times both). The per-round "
               "drafts are recorded by wrapping accept_or_resample during the run; the chapter's code is unchanged.")
    return figure("speculative", "4. Speculative decoding: rounds and speedup", picture, caption), run
