"""`fleet --html FILE`: goodput against offered rate for the fleet's pick and runner-up, the SLO's
knee marked, as one self-contained page (drawn with svg.py, as the report is).

Goodput (DistServe's word) is the rate of requests served inside both p99 targets: the offered
rate times the share of requests that met both. It follows the offered rate up to the knee, then
falls away: past it the queue, not the work, sets TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from loadtest.fleet_search import FleetQuestion, candidate_step_cost, fleet_workload, simulate_rate

from ..reviews.fleet import FleetAnswer, FleetRow
from .svg import (
    BLUE,
    INK,
    VERMILLION,
    WIDTH,
    chart,
    figure,
    legend,
    line,
    nice_ticks,
    now,
    page,
    polyline,
    svg,
    text,
    xscale,
)

NUM_RATES = 9


def goodput_curve(lab: ModuleType, question: FleetQuestion, row: FleetRow) -> tuple[list[float], list[float], float]:
    """(offered rates per replica, goodput per replica, the row's largest rate meeting the SLO):
    whole runs from a quarter to twice that rate. A disaggregated row is drawn by its decode pool."""
    search = row.searches[-1]
    c = search.candidate
    workload = fleet_workload(lab, question.workload, question.num_requests, question.seed, question.max_model_len)
    cost = candidate_step_cost(lab, question, c)  # the step cost the row was searched with
    blocks = lab.plan_deployment(question.model, c.gpu, question.max_model_len, tensor_parallel_size=c.tp)
    transfer = lab.kv_bytes_per_token(lab.get_model(question.model)) / (c.tp * question.kv_link_bytes_per_s)
    rates = list(np.geomspace(search.max_rate / 4, search.max_rate * 2, NUM_RATES))
    goodput = []
    for rate in rates:
        run = simulate_rate(lab, cost, workload, rate, question.slo, c, blocks.num_kv_blocks, stop_early=False,
                            kv_transfer_s_per_token=transfer)
        goodput.append(rate * run.attainment)
    return rates, goodput, search.max_rate


def goodput_figure(curves: Sequence[tuple[str, list[float], list[float], float]], slo_text: str) -> str:
    """One panel per row: offered rate (x) against goodput (y), both per replica on one scale, the
    y = x line, the knee marked. Each panel is a chart whose box holds its axes, labels and title."""
    body = []
    panel_width = WIDTH // 2
    py0, py1 = 58, 296
    for i, (label, rates, goodput, knee) in enumerate(curves):
        bx0, bx1 = i * panel_width, (i + 1) * panel_width - 10  # the panel's box
        x0, x1 = bx0 + 72, bx1 - 16  # its plot: room on the left for the y axis' numbers and label
        ticks = nice_ticks(max(rates), 4)  # x and y alike: goodput never exceeds the offered rate
        sx, sy = xscale(0, ticks[-1], x0, x1), xscale(0, ticks[-1], py1, py0)
        panel = [text(bx0 + 4, 24, label[:70], size=13, weight="bold")]
        for t in ticks:
            panel.append(line(x0, sy(t), x1, sy(t), stroke="#e0e0e0"))
            panel.append(text(x0 - 6, sy(t) + 4, f"{t:g}", size=11, anchor="end"))
            panel.append(text(sx(t), py1 + 17, f"{t:g}", size=11, anchor="middle"))
        panel.append(line(x0, py1, x1, py1))
        panel.append(text((x0 + x1) / 2, py1 + 36, "offered rate per replica (requests/s)", size=12, anchor="middle"))
        mid = (py0 + py1) / 2
        panel.append(text(bx0 + 16, mid, "goodput per replica (requests/s)", size=12, anchor="middle",
                          transform=f"rotate(-90 {bx0 + 16} {mid:.1f})"))
        panel.append(polyline([(sx(0), sy(0)), (sx(ticks[-1]), sy(ticks[-1]))], "#bbbbbb", 1.5,
                              stroke_dasharray="4 4"))
        panel.append(polyline([(sx(r), sy(g)) for r, g in zip(rates, goodput)], BLUE if i == 0 else VERMILLION, 2.5))
        kx = sx(knee)
        panel.append(line(kx, py0 - 10, kx, py1, stroke=INK, width=1.5, stroke_dasharray="6 4"))
        right = kx < (x0 + x1) / 2  # the label on the side with room
        panel.append(text(kx + 5 if right else kx - 5, py0 - 2, f"SLO knee: {knee:.1f} req/s", size=12,
                          weight="bold", anchor="start" if right else "end"))
        body.append(chart(f"panel {i + 1}", (bx0, 0, bx1, py1 + 44), panel))
    drawn = [(BLUE, "pick"), (VERMILLION, "runner-up")][:len(curves)]
    leg, _ = legend(72, py1 + 62, drawn + [("#bbbbbb", "goodput = offered")])
    body += leg
    desc = "; ".join(f"{label}: knee {knee:.1f} req/s, goodput " + ", ".join(f"{g:.1f}" for g in goodput)
                     for label, _, goodput, knee in curves)
    return svg(py1 + 76, body, f"Goodput against offered rate ({slo_text})", desc)


def fleet_page(lab: ModuleType, question: FleetQuestion, answer: FleetAnswer) -> str:
    """The page: the goodput figure for the pick and the runner-up, and the fleet's printout."""
    met = [r for r in answer.rows if r.gpus]
    met.sort(key=lambda r: (round(r.usd_per_million, 9), -r.capacity))
    slo = f"p99 TTFT <= {question.slo.ttft_s * 1e3:g} ms, p99 TPOT <= {question.slo.tpot_s * 1e3:g} ms"
    curves = [(f"{title}: {row.label}", *goodput_curve(lab, question, row))
              for title, row in zip(("pick", "runner-up"), met[:2])]
    caption = (f"Goodput (requests/s inside both targets: {slo}) against the offered rate, per replica, "
               f"{question.num_requests} simulated requests per rate on the module's Scheduler. Up to the knee "
               "(the largest rate where 99% of requests meet both) goodput follows the offered rate; past it the "
               "queue grows, requests miss, and goodput falls away from the dashed line.")
    fig = figure("fleet-goodput", f"{question.model} at {question.qps:g} req/s: the pick and the runner-up",
                 goodput_figure(curves, slo), caption)
    printout = f"<pre>{answer.text.replace('&', '&amp;').replace('<', '&lt;')}</pre>"
    return page(f"Fleet for {question.model}", [fig, printout], f"python solution.py fleet, {now()}")
