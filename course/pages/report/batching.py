"""Figure 3 of the report: static against continuous batching, the simulator's slot-by-step
timelines."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from loadtest.simulator import simulate_serving, skewed_workload

from ..svg import BLUE, GREY, LIGHT, VERMILLION, WIDTH, figure, hatch, legend, line, nice_ticks, rect, svg, text, xscale

BATCHING = dict(num_short=31, long_len=400, short_len=40, prompt_len=128, slots=8)


def run_batching(lab: ModuleType) -> dict:
    """The skewed workload (one long answer, then many short ones, all queued at once) through
    the module's StaticBatchScheduler and Scheduler in the simulator."""
    p = BATCHING
    workload = skewed_workload(p["num_short"], p["long_len"], p["short_len"], p["prompt_len"])
    out = {"params": dict(p)}
    for scheduling in ("static", "continuous"):
        sim = simulate_serving(lab, workload, scheduling, max_num_seqs=p["slots"])
        s = sim.summary()
        out[scheduling] = {"timeline": sim.timeline, "num_steps": sim.num_steps, "throughput": sim.throughput,
                           "mean_ttft": s["mean_ttft"], "wasted_slot_steps": sim.wasted_slot_steps,
                           "duration": sim.duration, "output_lens": sim.output_lens}
    return out


def _runs(cells: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, stop, value) runs of equal consecutive cells."""
    runs = []
    start = 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or cells[i] != cells[start]:
            runs.append((start, i, cells[start]))
            start = i
    return runs


def figure_batching(lab: ModuleType) -> tuple[str, dict]:
    run = run_batching(lab)
    p = run["params"]
    slots = p["slots"]
    x0, x1 = 150, 910
    max_steps = max(run[s]["num_steps"] for s in ("static", "continuous"))
    sx = xscale(0, max_steps, x0, x1)
    slot_h, panel_h = 17, p["slots"] * 17 + 58
    body, _ = legend(0, 16, [(VERMILLION, f"the long request ({p['long_len']} tokens)"),
                             (BLUE, f"short requests ({p['short_len']} tokens each)"),
                             ("url(#bat-idle)", "idle while requests wait (head-of-line blocking)"),
                             (LIGHT, "idle, nothing waiting")])
    for k, scheduling in enumerate(("static", "continuous")):
        sim = run[scheduling]
        y0 = 44 + k * panel_h
        body.append(text(0, y0 + 14, scheduling, size=15, weight="bold"))
        body.append(text(0, y0 + 32, "batching", size=13))
        lens = sim["output_lens"]
        long_cut = 4 * float(np.median(sim["output_lens"]))
        for slot in range(slots):
            y = y0 + 4 + slot * slot_h
            body.append(text(x0 - 8, y + 12, f"slot {slot}", size=11, anchor="end", fill="#444444"))
            for start, stop, value in _runs([row[slot] for row in sim["timeline"]]):
                xa, xb = sx(start), sx(stop)
                if value >= 0:
                    fill = VERMILLION if lens[value] > long_cut else BLUE
                    body.append(rect(xa, y, max(xb - xa - 1, 0.8), slot_h - 3, fill))  # 1 px gap: a new request
                else:
                    body.append(rect(xa, y, xb - xa, slot_h - 3, "url(#bat-idle)" if value == -1 else LIGHT))
        ya = y0 + 4 + slots * slot_h + 2
        body.append(line(x0, ya, sx(sim["num_steps"]), ya))
        for t in nice_ticks(max_steps, 8):
            if t <= sim["num_steps"]:
                body.append(line(sx(t), ya, sx(t), ya + 4))
                body.append(text(sx(t), ya + 16, f"{t:g}", size=11, anchor="middle"))
        body.append(text(sx(sim["num_steps"]) + 6, ya + 4, f"{sim['num_steps']} steps", size=12, weight="bold",
                         label=f"{scheduling}-steps"))
        nx = 960
        for i, (name, value, key) in enumerate((
                ("throughput", f"{sim['throughput']:.0f} tokens/s", "throughput"),
                ("mean TTFT", f"{sim['mean_ttft']:.2f} s", "mean-ttft"),
                ("wasted slot-steps", f"{sim['wasted_slot_steps']}", "wasted"))):
            body.append(text(nx, y0 + 22 + 34 * i, name, size=12, fill="#444444"))
            body.append(text(WIDTH - 4, y0 + 22 + 34 * i, value, size=16, anchor="end", weight="bold",
                             label=f"{scheduling}-{key}"))
    body.append(text(x0, 44 + 2 * panel_h - 6, "engine steps (simulated: Llama-2-7B on an A100, StepCostModel)",
                     size=12, fill="#444444"))
    s, c = run["static"], run["continuous"]
    desc = (f"static: {s['num_steps']} steps, {s['throughput']:.0f} tokens/s, mean TTFT {s['mean_ttft']:.2f} s, "
            f"{s['wasted_slot_steps']} wasted slot-steps; continuous: {c['num_steps']} steps, "
            f"{c['throughput']:.0f} tokens/s, mean TTFT {c['mean_ttft']:.2f} s, {c['wasted_slot_steps']} wasted.")
    picture = svg(44 + 2 * panel_h + 4, body, "Static vs continuous batching", desc, defs=[hatch("bat-idle", GREY)])
    caption = (f"The simulator runs {1 + p['num_short']} requests queued at once ({p['slots']} slots, prompts of "
               f"{p['prompt_len']} tokens) through the module's StaticBatchScheduler and Scheduler. Look at the "
               "hatched area: in a static batch the short requests finish early but their slots stay empty until "
               "the long one ends, while the rest of the queue waits. Continuous batching refills a slot the step "
               f"it frees: mean time to first token falls from {s['mean_ttft']:.2f} s to {c['mean_ttft']:.2f} s. "
               "With only one long answer, throughput moves less: the long answer sets the makespan either way.")
    return figure("batching", "3. Static vs continuous batching", picture, caption), run
