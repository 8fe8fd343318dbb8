"""Figure 5 of the report: latency against offered load, the knee marked (the simulator's, or a
real load test's for `loadtest --html`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

from loadtest.benchmark_serving import find_knee
from loadtest.simulator import recurring_workload, simulate_serving

from ..svg import (
    BLUE,
    INK,
    VERMILLION,
    chart,
    el,
    figure,
    legend,
    line,
    nice_ticks,
    now,
    page,
    polyline,
    rect,
    svg,
    text,
    xscale,
)

LOAD = dict(num_requests=100, long_len=160, short_len=16, prompt_len=128, slots=16,
            rates=[8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 64.0, 80.0])
LOAD_KEYS = ("p50_ttft", "p99_ttft", "p50_tpot", "p99_tpot", "output_throughput")


def run_latency_load(lab: ModuleType) -> dict:
    """The simulator at each offered rate (Poisson arrivals, one long answer in eight)."""
    p = LOAD
    summaries = []
    for rate in p["rates"]:
        workload = recurring_workload(p["num_requests"], p["long_len"], p["short_len"], p["prompt_len"], rate)
        sim = simulate_serving(lab, workload, "continuous", max_num_seqs=p["slots"], record_timeline=False)
        summaries.append({key: sim.summary()[key] for key in LOAD_KEYS})
    return {"params": dict(p), "rates": list(p["rates"]), "summaries": summaries}


def _fmt_ms(seconds: float) -> str:
    return "\u2013" if not seconds == seconds else f"{seconds * 1e3:.1f}"


def _panel(summaries: Sequence[dict], rates: list[float], plot_rates: list[float], knee: float | None,
           panel: tuple, py0: float, py1: float) -> list[str]:
    """One panel, TTFT or TPOT: p50 and p99 against the offered rate, the knee marked."""
    name, key, x0, x1, log = panel
    body = []
    values = [s[f"{p}_{key}"] * 1e3 for s in summaries for p in ("p50", "p99")
              if s[f"{p}_{key}"] == s[f"{p}_{key}"]]
    sx = xscale(0, max(plot_rates) * 1.05, x0, x1)
    body.append(text(x0, 24, f"{name} (ms){', log scale' if log else ''}", size=14, weight="bold"))
    if log:  # decades from the one below the smallest value to the one above the largest
        positive = [v for v in values if v > 0] or [1.0]
        e_lo = math.floor(math.log10(max(min(positive), 1e-3)))
        e_hi = max(math.ceil(math.log10(max(positive))), e_lo + 1)
        to_y = xscale(e_lo, e_hi, py1, py0)

        def sy(v: float) -> float:
            return to_y(math.log10(v))
        ticks = [10.0 ** e for e in range(e_lo, e_hi + 1)]
    else:
        ticks = nice_ticks(max(values, default=1.0), 4)
        sy = xscale(0, ticks[-1], py1, py0)
    for t in ticks:
        body.append(line(x0, sy(t), x1, sy(t), stroke="#e0e0e0"))
        body.append(text(x0 - 6, sy(t) + 4, f"{t:g}", size=11, anchor="end"))
    body.append(line(x0, py1, x1, py1))
    for r, pr in zip(rates, plot_rates):
        body.append(line(sx(pr), py1, sx(pr), py1 + 4))
        body.append(text(sx(pr), py1 + 17, "inf" if r == math.inf else f"{r:g}", size=11, anchor="middle"))
    body.append(text((x0 + x1) / 2, py1 + 36, "offered load (requests/s)", size=12, anchor="middle"))
    if knee is not None:
        kx = sx(plot_rates[rates.index(knee)])
        body.append(line(kx, py0 - 16, kx, py1, stroke=INK, width=1.5, stroke_dasharray="6 4"))
        right = kx < (x0 + x1) / 2  # the label on the side with room
        body.append(text(kx + 5 if right else kx - 5, py0 - 6, f"knee: {knee:g} req/s", size=12, weight="bold",
                         anchor="start" if right else "end", label=f"knee-{key}"))
    for p, color, dash in (("p50", BLUE, None), ("p99", VERMILLION, "7 4")):
        pts = [(sx(pr), sy(s[f"{p}_{key}"] * 1e3)) for pr, s in zip(plot_rates, summaries)
               if s[f"{p}_{key}"] == s[f"{p}_{key}"] and s[f"{p}_{key}"] > 0]
        body.append(polyline(pts, color, 2.5, stroke_dasharray=dash))
        for x, y in pts:
            if p == "p50":
                body.append(el("circle", cx=f"{x:.1f}", cy=f"{y:.1f}", r=4.5, fill=color))
            else:
                body.append(rect(x - 4.5, y - 4.5, 9, 9, color))
    leg, _ = legend(x1 - 110, 24, [(BLUE, "p50"), (VERMILLION, "p99 (dashed)")], gap=10)
    body += leg
    return body


def _table(rates: list[float], summaries: Sequence[dict], knee: float | None) -> str:
    """The numbers as a table, one row per offered rate, the knee's row marked."""
    head = "".join(f"<th>{h}</th>" for h in ("offered (req/s)", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
                                              "TPOT p99 (ms)", "output tokens/s"))
    rows = []
    for i, (r, s) in enumerate(zip(rates, summaries)):
        mark = ' class="knee"' if r == knee else ""
        cells = [el("td", "inf" if r == math.inf else f"{r:g}", data_label=f"rate-{i}")]
        cells += [el("td", _fmt_ms(s[k]), data_label=f"{k}-{i}") for k in LOAD_KEYS[:4]]
        tput = s["output_throughput"]
        cells.append(el("td", "\u2013" if not tput == tput else f"{tput:.0f}", data_label=f"output_throughput-{i}"))
        rows.append(f"<tr{mark}>{''.join(cells)}</tr>")
    return f'<table class="numbers"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def latency_figure(rates: Sequence[float], summaries: Sequence[dict], source: str) -> tuple[str, dict]:
    """The latency-against-load figure for any list of per-rate summaries (the simulator's, or a
    real load test's from benchmark_serving.loadtest): p50 and p99 TTFT (log scale) and TPOT
    against the offered rate, the knee marked (find_knee on p99 TTFT), and a table of the numbers."""
    if not rates or len(rates) != len(summaries):
        raise ValueError(f"need one summary per rate, got {len(rates)} rates and {len(summaries)} summaries")
    rates = [float(r) for r in rates]
    knee = find_knee(rates, [s["p99_ttft"] for s in summaries])
    finite = [r for r in rates if r < math.inf]
    hi = max(finite) if finite else 1.0
    plot_rates = [r if r < math.inf else hi * 1.25 for r in rates]  # "all at once" drawn past the last rate
    body = []
    panels = (("TTFT", "ttft", 60, 580, True), ("TPOT", "tpot", 680, 1200, False))
    py0, py1 = 58, 296
    for panel in panels:  # each in its box: its numbers on the left, its legend over the right edge
        _, key, x0, x1, _ = panel
        body.append(chart(key, (x0 - 58, 0, x1 + 40, py1 + 44), _panel(summaries, rates, plot_rates, knee, panel,
                                                                         py0, py1)))
    svg_height = py1 + 48
    desc = "; ".join(f"{r:g} req/s: TTFT p50 {_fmt_ms(s['p50_ttft'])} ms p99 {_fmt_ms(s['p99_ttft'])} ms, "
                     f"TPOT p50 {_fmt_ms(s['p50_tpot'])} ms p99 {_fmt_ms(s['p99_tpot'])} ms"
                     for r, s in zip(rates, summaries))
    desc += f"; knee {knee:g} req/s" if knee is not None else "; knee not reached"
    picture = svg(svg_height, body, "Latency against offered load", desc)
    table = _table(rates, summaries, knee)
    knee_text = (f"The knee is at {knee:g} req/s (marked; the highlighted row): past it p99 TTFT more than triples "
                 "its lowest value, because requests queue for a slot faster than slots free up."
                 if knee is not None else "No knee in the rates tried (p99 TTFT stays within 3x of its lowest): "
                                          "offer higher rates.")
    caption = (f"{source} Look at where the p99 TTFT line turns up: TTFT is queueing plus prefill, so once the "
               f"offered load passes what the server sustains it grows without bound, while TPOT, the decode step, "
               f"only rises with the batch. {knee_text}")
    numbers = {"rates": rates, "summaries": [dict(s) for s in summaries], "knee": knee}
    return picture + table, {"caption": caption, **numbers}


def figure_latency_load(lab: ModuleType) -> tuple[str, dict]:
    run = run_latency_load(lab)
    p = run["params"]
    body, numbers = latency_figure(run["rates"], run["summaries"],
                                   f"The simulator (the module's Scheduler, Llama-2-7B on an A100 by StepCostModel, "
                                   f"{p['slots']} slots) at each offered rate: {p['num_requests']} requests, Poisson "
                                   f"arrivals, one answer in eight {p['long_len']} tokens, the rest {p['short_len']}.")
    run.update(numbers)
    return figure("latency-load", "5. Latency against offered load", body, numbers["caption"]), run


def load_report_html(rates: Sequence[float], summaries: Sequence[dict], url: str, model: str,
                     num_prompts: int, workload: str) -> str:
    """`loadtest --html FILE`: the latency figure of a real load test, as a page of its own."""
    body, numbers = latency_figure(rates, summaries,
                                   f"A real load test of {url} (model {model}): {num_prompts} {workload} requests per "
                                   "rate, open loop (Poisson arrivals), latencies from the streamed chunks.")
    fig = figure("latency-load", f"Latency against offered load: {model} at {url}", body, numbers["caption"])
    return page(f"Load test of {url}", [fig], f"benchmark_serving.loadtest, {now()}")
