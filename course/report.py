"""`python solution.py report`: the lab's mechanisms as pictures, drawn from real runs of the module.

Each figure function takes the module (`lab`) first, runs that module's own code when it is
called (an engine with prefix caching, a block table, the simulator on the module's schedulers,
`speculative_generate`, `plan_deployment`), and returns `(html_fragment, numbers)`: the
fragment is one `<figure id=...>` with a title, an inline SVG (its `<title>` and `<desc>` are
the text alternative) and a `<figcaption>` that says what to look at; `numbers` holds what the
labels show and the raw state they were computed from, so a test can recompute every label.
Every labelled number is an element with a `data-label` attribute whose text is the label.

`build_report(lab)` puts the six figures into ONE self-contained HTML file (inline SVG and CSS,
no script, no font or image fetched). A figure whose exercise is still a stub becomes a box
that names the stub (the NotImplementedError's message) and the others still draw. Colours are
Okabe and Ito's palette, which colour-blind readers can tell apart; shapes, hatching and
labels carry the meaning too, so the report also reads in grey on paper.
"""

from __future__ import annotations

import contextlib
import html
import math
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NamedTuple

import numpy as np

from loadtest.benchmark_serving import find_knee
from loadtest.simulator import recurring_workload, simulate_serving, skewed_workload

from .scenarios import make_early_exit_target
from .svg import (
    BLACK,
    BLUE,
    GREEN,
    GREY,
    INK,
    LIGHT,
    ORANGE,
    PURPLE,
    SKY,
    VERMILLION,
    WIDTH,
    el,
    figure,
    hatch,
    legend,
    line,
    nice_ticks,
    now,
    page,
    pct,
    polyline,
    rect,
    svg,
    text,
    xscale,
)

KV_MODEL = dict(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)
KV_BLOCKS, KV_BLOCK_SIZE = 16, 4
SEQ_COLORS = {"A": BLUE, "B": ORANGE, "B'": GREEN}


def pool_snapshot(lab: ModuleType, allocator, tables: dict, event: str, max_model_len: int,
                  copies: Sequence[tuple[int, int]] = ()) -> dict:
    """The pool as the allocator and the tables say it is now: per block its holders, reference
    count, whether the prefix cache finds it, and how many of its slots hold a token; per table
    its block ids and token count; and the two utilisations.

    paged = distinct physical slots holding a token / slots of the blocks in use (ref > 0);
    slab  = tokens of every table / (tables x max_model_len): what a contiguous max_model_len
    slab per sequence would hold (a fork's shared prefix is a second copy there)."""
    bs = allocator.block_size
    seqs = {name: {"block_ids": list(t.block_ids), "num_tokens": t.num_tokens} for name, t in tables.items()}
    filled: set[int] = set()
    for t in tables.values():
        filled.update(int(s) for s in t.slots(0, t.num_tokens))
    blocks = []
    for b in range(allocator.num_blocks):
        blocks.append({"id": b, "holders": [n for n, s in seqs.items() if b in s["block_ids"]],
                       "ref_count": allocator.ref_count(b), "cached": bool(allocator.is_cached(b)),
                       "filled": sum(b * bs + i in filled for i in range(bs))})
    in_use = sum(blk["ref_count"] > 0 for blk in blocks)
    tokens = sum(s["num_tokens"] for s in seqs.values())
    return {"event": event, "seqs": seqs, "blocks": blocks, "copies": [list(c) for c in copies],
            "paged_utilization": len(filled) / (in_use * bs) if in_use else 0.0,
            "slab_utilization": tokens / (len(seqs) * max_model_len) if seqs else 0.0,
            "blocks_in_use": in_use, "tokens_held": len(filled)}


def run_kv_pool(lab: ModuleType) -> dict:
    """The engine run the KV-pool figure shows, as four snapshots.

    Requests A and B share their first 8 tokens (two full blocks of 4). A arrives first; once
    its prefill has written those blocks they are in the prefix cache, so B, arriving a step
    later, reuses them. Then B's block table is forked (parallel sampling: B' shares all of B's
    blocks) and B' appends a token: B's last block is partly full and shared, so B' gets a
    private copy first (copy-on-write; the engine's KVCache copies the K/V). Last, A finishes:
    its full blocks stay in the prefix cache, free but findable; its partial block is plain free."""
    model = lab.ToyTransformer(lab.ModelConfig(**KV_MODEL), seed=0)
    engine = lab.LLMEngine(model, num_blocks=KV_BLOCKS, block_size=KV_BLOCK_SIZE, max_num_seqs=4,
                           enable_prefix_caching=True)
    max_model_len = model.config.n_positions
    shared = [7, 3, 9, 1, 4, 4, 2, 8]
    requests = {"A": lab.Request("A", shared + [5, 6], lab.SamplingParams(max_tokens=4)),
                "B": lab.Request("B", shared + [11, 12, 13], lab.SamplingParams(max_tokens=8))}

    def tables(extra=None) -> dict:
        running = {s.request_id: s.block_table for s in engine.scheduler.running}
        return {n: running[n] for n in ("A", "B") if n in running} | (extra or {})

    snaps = []
    engine.add_request(requests["A"])
    engine.step()
    snaps.append(pool_snapshot(lab, engine.allocator, tables(), "step 1: A's 10-token prompt is prefilled",
                               max_model_len))
    engine.add_request(requests["B"])
    engine.step()
    snaps.append(pool_snapshot(lab, engine.allocator, tables(),
                               "step 2: B arrives and finds A's first two blocks in the prefix cache", max_model_len))
    fork = tables()["B"].fork()
    copies = fork.append_tokens([21])
    engine.kv_cache.copy_blocks(copies)  # the K/V follows the table's copy
    snaps.append(pool_snapshot(lab, engine.allocator, tables({"B'": fork}),
                               "fork: B' = B.fork() appends a token (copy-on-write)", max_model_len, copies))
    for _ in range(8):  # A needs two more steps; bounded in any case
        if "A" not in tables():
            break
        engine.step()
    snaps.append(pool_snapshot(lab, engine.allocator, tables({"B'": fork}),
                               f"step {engine.num_steps}: A has finished and released its blocks", max_model_len))
    fork.free()
    return {"snapshots": snaps, "block_size": KV_BLOCK_SIZE, "num_blocks": KV_BLOCKS,
            "max_model_len": max_model_len, "hit_rate": engine.prefix_cache_hit_rate}


def _wrap(s: str, width: int) -> list[str]:
    words, lines = s.split(), [""]
    for w in words:
        if lines[-1] and len(lines[-1]) + 1 + len(w) > width:
            lines.append(w)
        else:
            lines[-1] = f"{lines[-1]} {w}".strip()
    return lines


def _block_cell(x: float, y: float, w: float, h: float, blk: dict, bs: int, copy_of: int | None,
                snap: int) -> list[str]:
    """One physical block: bands in its holders' colours, the slot ticks, the id and the state."""
    out = []
    if blk["ref_count"] == 0:
        fill = "url(#kv-cached)" if blk["cached"] else LIGHT
        out.append(rect(x, y, w, h, fill, stroke=GREY, stroke_width=1,
                        stroke_dasharray="4 3" if blk["cached"] else None))
        out.append(text(x + w / 2, y + h - 9, "cached" if blk["cached"] else "free", size=11, anchor="middle",
                        fill=INK if blk["cached"] else "#666666"))
    else:
        band = w / len(blk["holders"]) if blk["holders"] else w
        for i, holder in enumerate(blk["holders"]):
            out.append(rect(x + i * band, y, band, h, SEQ_COLORS.get(holder, PURPLE)))
        shared = blk["ref_count"] > 1
        out.append(rect(x, y, w, h, "none", stroke=BLACK, stroke_width=3 if shared else 1))
        # the slot ticks: filled slots dark, empty ones white (a partly filled last block)
        tick = (w - 10) / bs
        for i in range(bs):
            out.append(rect(x + 5 + i * tick + 1, y + h - 12, tick - 2, 7, INK if i < blk["filled"] else "#ffffff",
                            stroke=INK, stroke_width=0.6))
        if shared:
            out.append(rect(x + w - 27, y + 3, 24, 15, "#ffffff", rx=3))
            out.append(text(x + w - 15, y + 15, f"\u00d7{blk['ref_count']}", size=12, anchor="middle", weight="bold",
                            label=f"ref-{snap}-{blk['id']}"))
    out.append(rect(x + 3, y + 3, 22, 15, "#ffffff", rx=3))
    out.append(text(x + 14, y + 15, blk["id"], size=12, anchor="middle", weight="bold"))
    if copy_of is not None:
        out.append(rect(x + 2, y + 20, w - 4, 14, "#ffffff", rx=3))
        out.append(text(x + w / 2, y + 31, f"copy of {copy_of}", size=10, anchor="middle",
                        label="cow-copy"))
    return out


def figure_kv_pool(lab: ModuleType) -> tuple[str, dict]:
    run = run_kv_pool(lab)
    bs, mml = run["block_size"], run["max_model_len"]
    row_h, top = 128, 58
    cell_w, cell_h, per_row = 60, 46, 8
    grid_x, slab_x, util_x = 200, 740, 1100
    slot_w = (util_x - 56 - slab_x - 28) / mml
    body, _ = legend(0, 16, [(BLUE, "A"), (ORANGE, "B"), (GREEN, "B' (fork of B)"), ("url(#kv-cached)", "cached, free"),
                             (LIGHT, "free"), ("url(#kv-unused)", "slab slots reserved but empty")])
    body.append(text(0, 40, f"The physical pool: {run['num_blocks']} blocks; ticks = a block's {bs} slots; "
                           "\u00d7n = held by n (thick border)", size=12, fill="#444444"))
    body.append(text(slab_x, 40, f"The same tables as {mml}-slot slabs", size=12, fill="#444444"))
    body.append(text(util_x, 40, "slots holding tokens", size=12, fill="#444444"))
    for r, snap in enumerate(run["snapshots"]):
        y0 = top + r * row_h
        body.append(line(0, y0 - 6, WIDTH, y0 - 6, stroke="#cccccc"))
        for i, chunk in enumerate(_wrap(snap["event"], 26)):
            body.append(text(0, y0 + 14 + 17 * i, chunk, size=13, weight="bold" if i == 0 else None))
        copy_of = {dst: src for src, dst in snap["copies"]}
        for blk in snap["blocks"]:
            col, rr = blk["id"] % per_row, blk["id"] // per_row
            body += _block_cell(grid_x + col * (cell_w + 4), y0 + rr * (cell_h + 6), cell_w, cell_h, blk, bs,
                                copy_of.get(blk["id"]), r)
        for i, (name, seq) in enumerate(snap["seqs"].items()):
            y = y0 + 4 + i * 22
            body.append(text(slab_x, y + 12, name, size=12, weight="bold"))
            x = slab_x + 28
            body.append(rect(x, y, mml * slot_w, 15, "url(#kv-unused)", stroke=INK, stroke_width=0.6))
            body.append(rect(x, y, seq["num_tokens"] * slot_w, 15, SEQ_COLORS.get(name, PURPLE), stroke=INK,
                             stroke_width=0.6))
            body.append(text(x + mml * slot_w + 6, y + 12, f"{seq['num_tokens']}/{mml}", size=11,
                             label=f"slab-fill-{r}-{name}"))
        body.append(text(util_x, y0 + 18, "paged", size=13))
        body.append(text(WIDTH - 4, y0 + 18, pct(snap["paged_utilization"]), size=15, anchor="end", weight="bold",
                         label=f"paged-util-{r}"))
        body.append(text(util_x, y0 + 42, "slab", size=13))
        body.append(text(WIDTH - 4, y0 + 42, pct(snap["slab_utilization"]), size=15, anchor="end", weight="bold",
                         label=f"slab-util-{r}"))
        body.append(text(util_x, y0 + 66, f"{snap['tokens_held']} tokens in {snap['blocks_in_use']} blocks",
                         size=11, fill="#444444", label=f"held-{r}"))
    height = top + len(run["snapshots"]) * row_h
    last = run["snapshots"][-1]
    desc = "; ".join(f"{s['event']}: paged {pct(s['paged_utilization'])}, slab {pct(s['slab_utilization'])}"
                     for s in run["snapshots"])
    picture = svg(height, body, "The paged KV pool during an engine run", desc,
                  defs=[hatch("kv-cached", SKY), hatch("kv-unused", "#bbbbbb")])
    caption = (f"A real LLMEngine run (prefix caching on, {run['num_blocks']} blocks of {bs} tokens), one row per "
               "moment. Look at blocks 0 and 1: B found them in the prefix cache, so A, B and later B' hold the "
               "same physical blocks (\u00d72, \u00d73) instead of three copies. The fork shares everything until "
               "B' writes: its partly full last block is copied first (\u201ccopy of\u201d). When A finishes, its "
               "full blocks stay findable (cached, free) and its partial block is plain free. On the right, the "
               f"same sequences each reserving a {mml}-slot slab: most of every slab is empty, while paging wastes "
               f"less than one block per sequence (paged {pct(last['paged_utilization'])} against slab "
               f"{pct(last['slab_utilization'])} at the end).")
    return figure("kv-pool", "1. The paged KV pool: sharing, copy-on-write, the prefix cache",
                  picture, caption), run


# =====================================================================================
# 2. One block table: logical positions -> physical blocks and slots
# =====================================================================================

BT_BLOCKS, BT_BLOCK_SIZE = 12, 4


def run_block_table(lab: ModuleType) -> dict:
    """A 13-token table built in two appends (6, then 7 tokens) while another table takes blocks
    in between, so its blocks are not contiguous; its slots come from `BlockTable.slots`."""
    allocator = lab.BlockAllocator(BT_BLOCKS, BT_BLOCK_SIZE)
    other, table = lab.BlockTable(allocator), lab.BlockTable(allocator)
    other.append_tokens(list(range(5)))
    table.append_tokens(list(range(6)))
    other.append_tokens(list(range(4)))
    table.append_tokens(list(range(7)))
    n = table.num_tokens
    return {"block_size": BT_BLOCK_SIZE, "num_blocks": BT_BLOCKS, "num_tokens": n,
            "block_ids": list(table.block_ids), "other_block_ids": list(other.block_ids),
            "slots": [int(s) for s in table.slots(0, n)],
            "blocks_needed": lab.blocks_needed(n, BT_BLOCK_SIZE),
            "last_block_tokens": n - (len(table.block_ids) - 1) * BT_BLOCK_SIZE}


def figure_block_table(lab: ModuleType) -> tuple[str, dict]:
    run = run_block_table(lab)
    bs, n, ids = run["block_size"], run["num_tokens"], run["block_ids"]
    cell, gap, x0 = 62, 14, 110
    body = [text(0, 34, "position", size=13, weight="bold"), text(0, 74, "slot", size=13, weight="bold"),
            text(0, 96, "= block \u00d7 4", size=11, fill="#444444"), text(0, 110, "+ offset", size=11, fill="#444444")]
    for j in range(len(ids)):
        gx = x0 + j * (bs * cell + gap)
        body.append(text(gx + bs * cell / 2, 12, f"logical block {j}", size=12, anchor="middle", fill="#444444"))
        for i in range(bs):
            pos = j * bs + i
            x = gx + i * cell
            if pos < n:
                body.append(rect(x, 18, cell - 4, 26, ORANGE, stroke=INK, stroke_width=0.8))
                body.append(text(x + cell / 2 - 2, 36, pos, size=13, anchor="middle", weight="bold"))
                body.append(rect(x, 56, cell - 4, 26, "#ffffff", stroke=INK, stroke_width=0.8))
                body.append(text(x + cell / 2 - 2, 74, run["slots"][pos], size=13, anchor="middle",
                                 label=f"slot-{pos}"))
            else:
                body.append(rect(x, 18, cell - 4, 26, "url(#bt-empty)", stroke=INK, stroke_width=0.8,
                                 stroke_dasharray="4 3"))
                body.append(rect(x, 56, cell - 4, 26, "url(#bt-empty)", stroke=INK, stroke_width=0.8,
                                 stroke_dasharray="4 3"))
        body.append(text(gx + bs * cell / 2, 104, f"block_ids[{j}] = {ids[j]}", size=13, anchor="middle",
                         weight="bold", label=f"block-id-{j}"))
    # the physical pool underneath, with a line from each logical block to its physical block
    py, pw = 178, (WIDTH - 20) / run["num_blocks"]
    body.append(text(0, py - 12, f"the physical pool: {run['num_blocks']} blocks of {bs} slots", size=12,
                     fill="#444444"))
    for b in range(run["num_blocks"]):
        x = 10 + b * pw
        if b in ids:
            j = ids.index(b)
            fill, who = ORANGE, f"this table [{j}]"
            used = min(bs, n - j * bs)
            gx = x0 + j * (bs * cell + gap) + bs * cell / 2
            body.append(line(gx, 112, x + pw / 2 - 3, py - 4, stroke=INK, width=1.4,
                             marker_end="url(#bt-arrow)"))
        elif b in run["other_block_ids"]:
            fill, who, used = SKY, "another table", bs
        else:
            fill, who, used = LIGHT, "free", 0
        body.append(rect(x, py, pw - 6, 40, fill, stroke=INK, stroke_width=0.8))
        body.append(text(x + (pw - 6) / 2, py + 17, b, size=13, anchor="middle", weight="bold"))
        body.append(text(x + (pw - 6) / 2, py + 56, who, size=11, anchor="middle"))
        tick = (pw - 16) / bs
        for i in range(bs):
            body.append(rect(x + 5 + i * tick + 1, py + 25, tick - 2, 9, INK if i < used else "#ffffff",
                             stroke=INK, stroke_width=0.6))
    last = run["last_block_tokens"]
    body.append(text(0, py + 92, f"{n} tokens need blocks_needed({n}, {bs}) = {run['blocks_needed']} blocks; "
                                 f"the last holds {last} of {bs}", size=14, weight="bold", label="summary"))
    body.append(text(0, py + 114, f"Position {(len(ids) - 1) * bs} (token number {(len(ids) - 1) * bs + 1}) opened "
                                  f"block {ids[-1]}; positions {n}..{len(ids) * bs - 1} fit without a new block, "
                                  f"position {len(ids) * bs} will need one.", size=13))
    picture = svg(py + 126, body, "One sequence's block table",
                  f"{n} tokens in blocks {ids}; slot of position i is block_ids[i // {bs}] * {bs} + i % {bs}; "
                  f"the last block holds {last} of {bs} tokens.",
                  defs=[hatch("bt-empty", "#bbbbbb"),
                        f'<marker id="bt-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                        f'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
                        f'fill="{INK}"/></marker>'])
    caption = (f"A BlockTable that appended 6 tokens, then 7, while another table took blocks in between: its "
               f"blocks {ids} are scattered in the pool and it does not matter, because token i lives in "
               f"block_ids[i // {bs}] at offset i % {bs}. Look at the last block: it holds {last} of its {bs} "
               f"slots ({bs - last} empty), the only waste paging allows. The boundary rule is blocks_needed: a new "
               f"block opens when a token lands at a position divisible by {bs}, never when a block has just "
               "been filled (the append off-by-one).")
    return figure("block-table", "2. One block table: positions to blocks and slots", picture, caption), run


# =====================================================================================
# 3. Static vs continuous batching: the simulator's slot-by-step timelines
# =====================================================================================

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
    runs, start = [], 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or cells[i] != cells[start]:
            runs.append((start, i, cells[start]))
            start = i
    return runs


def figure_batching(lab: ModuleType) -> tuple[str, dict]:
    run = run_batching(lab)
    p = run["params"]
    slots, x0, x1 = p["slots"], 150, 910
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
        lens, long_cut = sim["output_lens"], 4 * float(np.median(sim["output_lens"]))
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


# =====================================================================================
# 4. Speculative decoding: the rounds of a real run, and the speedup curve
# =====================================================================================

SPEC_MODEL = dict(vocab_size=256, n_positions=256, n_embd=64, n_layer=4, n_head=4)
SPEC = dict(k=4, max_tokens=40, draft_layers=1, refinement_scale=0.2, seed=0, prompt=list(range(1, 9)))


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
        recorded, done = [], 0
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


def figure_speculative(lab: ModuleType) -> tuple[str, dict]:
    run = run_speculative(lab)
    k, rounds = run["params"]["k"], run["rounds"]
    cw, rh, x0, y0 = 44, 21, 78, 44
    body, _ = legend(0, 16, [(GREEN, "draft accepted"), (VERMILLION, "draft rejected"),
                             ("url(#sp-unjudged)", "drafted after a rejection: discarded unjudged"),
                             (ORANGE, "resampled from the residual"), (SKY, "bonus token (every draft accepted)")])
    body.append(text(x0, y0 - 6, f"drafted (k = {k})", size=12, fill="#444444"))
    body.append(text(x0 + k * cw + 8, y0 - 6, "+1", size=12, fill="#444444"))
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
    # the speedup curve for the measured alpha and c, with the measured point on it
    px0, px1, py0, py1 = 560, 1200, y0 + 10, y0 + 300
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
    body.append(text(mx + 12, my + (-10 if measured_above else 18), f"measured {run['measured_speedup']:.2f}\u00d7",
                     size=12, weight="bold", fill=VERMILLION, label="measured-speedup"))
    height = max(ty + 40, py1 + 44)
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
               f"c = {run['c']:.2f} (its share of the layers); the diamond is this run: tokens / (target passes + "
               "c \u00d7 draft steps). The per-round drafts are recorded by wrapping accept_or_resample during the "
               "run; the chapter's code is unchanged.")
    return figure("speculative", "4. Speculative decoding: rounds and speedup", picture, caption), run


# =====================================================================================
# 5. Latency against offered load, with the knee
# =====================================================================================

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
    for name, key, x0, x1, log in panels:
        values = [s[f"{p}_{key}"] * 1e3 for s in summaries for p in ("p50", "p99")
                  if s[f"{p}_{key}"] == s[f"{p}_{key}"]]
        sx = xscale(0, max(plot_rates) * 1.05, x0, x1)
        body.append(text(x0, 24, f"{name} (ms){', log scale' if log else ''}", size=14, weight="bold"))
        if log:  # decades from the one below the smallest value to the one above the largest
            positive = [v for v in values if v > 0] or [1.0]
            e_lo = math.floor(math.log10(max(min(positive), 1e-3)))
            e_hi = max(math.ceil(math.log10(max(positive))), e_lo + 1)
            to_y = xscale(e_lo, e_hi, py1, py0)

            def sy(v: float, to_y=to_y) -> float:
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
            body.append(text(kx + 5, py0 - 6, f"knee: {knee:g} req/s", size=12, weight="bold",
                             label=f"knee-{key}"))
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
    svg_height = py1 + 48
    desc = "; ".join(f"{r:g} req/s: TTFT p50 {_fmt_ms(s['p50_ttft'])} ms p99 {_fmt_ms(s['p99_ttft'])} ms, "
                     f"TPOT p50 {_fmt_ms(s['p50_tpot'])} ms p99 {_fmt_ms(s['p99_tpot'])} ms"
                     for r, s in zip(rates, summaries))
    desc += f"; knee {knee:g} req/s" if knee is not None else "; knee not reached"
    picture = svg(svg_height, body, "Latency against offered load", desc)
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
    table = f'<table class="numbers"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
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


# =====================================================================================
# 6. The capacity plan: where the GPU's memory goes, and how many sequences fit
# =====================================================================================

CAPACITY = dict(model="llama-2-13b", gpu="a100-80gb", max_model_len=8192,
                context_lens=[1024, 2048, 4096, 8192, 16384, 32768])


def run_capacity(lab: ModuleType) -> dict:
    p = CAPACITY
    out = {"params": dict(p), "plans": {}, "seqs": {}}
    for dtype in ("auto", "int8"):
        plan = lab.plan_deployment(p["model"], p["gpu"], p["max_model_len"], kv_cache_dtype=dtype)
        out["plans"][dtype] = {
            "memory_gb": plan.gpu.memory_bytes / lab.GB, "budget_gb": plan.memory_budget_bytes / lab.GB,
            "weights_gb": plan.weight_bytes_per_gpu / lab.GB, "activation_gb": plan.activation_bytes / lab.GB,
            "kv_pool_gb": plan.kv_pool_bytes / lab.GB, "num_kv_blocks": plan.num_kv_blocks,
            "max_concurrent_seqs": plan.max_concurrent_seqs,
            "kv_kib_per_token": lab.kv_bytes_per_token(plan.model) / 2**10,
            "utilization": plan.gpu_memory_utilization, "block_size": plan.block_size,
            "blocks_per_seq": lab.blocks_needed(plan.max_model_len, plan.block_size)}
        out["seqs"][dtype] = [lab.plan_deployment(p["model"], p["gpu"], n, kv_cache_dtype=dtype).max_concurrent_seqs
                              for n in p["context_lens"]]
    return out


def figure_capacity(lab: ModuleType) -> tuple[str, dict]:
    run = run_capacity(lab)
    p = run["params"]
    x0, x1 = 150, 1120
    names = {"auto": "fp16 KV cache", "int8": "int8 KV cache"}
    reserve = [(PURPLE, "activation reserve")] if run["plans"]["auto"]["activation_gb"] > 0 else []
    body, _ = legend(0, 16, [(BLUE, "weights"), *reserve, (GREEN, "KV blocks"), ("#ffffff", "left over (< 1 block)"),
                             ("url(#cap-reserve)", "not given to the engine (1 - gpu_memory_utilization)")])
    total = run["plans"]["auto"]["memory_gb"]
    sx = xscale(0, total, x0, x1)
    for i, dtype in enumerate(("auto", "int8")):
        plan = run["plans"][dtype]
        y = 44 + i * 74
        body.append(text(0, y + 16, names[dtype], size=13, weight="bold"))
        body.append(text(0, y + 32, f"{plan['kv_kib_per_token']:g} KiB per token", size=11, fill="#444444"))
        leftover = plan["budget_gb"] - plan["weights_gb"] - plan["activation_gb"] - plan["kv_pool_gb"]
        segments = [("weights", plan["weights_gb"], BLUE, "#ffffff"),
                    ("activations", plan["activation_gb"], PURPLE, INK),
                    ("kv", plan["kv_pool_gb"], GREEN, INK), ("leftover", leftover, "#ffffff", INK),
                    ("reserve", plan["memory_gb"] - plan["budget_gb"], "url(#cap-reserve)", INK)]
        x = x0
        for key, gb, fill, fg in segments:
            w = sx(gb) - x0
            if w <= 0:
                continue
            body.append(rect(x, y, w, 34, fill, stroke=INK, stroke_width=0.8))
            if key == "kv":
                words = f"KV {gb:.1f} GB: {plan['num_kv_blocks']} blocks"
            elif key in ("weights", "reserve"):
                words = f"{'weights ' if key == 'weights' else ''}{gb:.1f} GB"
            else:
                words = ""
            if words and w > 7 * len(words):
                if key == "reserve":
                    body.append(rect(x + w / 2 - 26, y + 9, 52, 17, "#ffffff"))
                body.append(text(x + w / 2, y + 22, words, size=13, anchor="middle", weight="bold", fill=fg,
                                 label=f"{dtype}-{key}-gb"))
            x += w
        body.append(text(x0, y + 52, f"{plan['max_concurrent_seqs']} sequences of {p['max_model_len']} tokens "
                                     f"fit ({plan['num_kv_blocks']} blocks // {plan['blocks_per_seq']} per sequence)",
                         size=12, label=f"{dtype}-max-seqs"))
        body.append(text(x1 + 8, y + 22, f"{plan['memory_gb']:.1f} GB", size=12, label=f"{dtype}-memory-gb"))
    # sequences that fit against the context length
    cy0, cy1 = 230, 470
    lens = p["context_lens"]
    top = max(max(v) for v in run["seqs"].values())
    ticks = nice_ticks(top, 5)
    sy = xscale(0, ticks[-1], cy1, cy0)
    body.append(text(0, cy0 - 22, f"Sequences that can all reach the context length at once ({p['model']} on "
                                  f"{p['gpu']})", size=14, weight="bold"))
    for t in ticks:
        body.append(line(x0, sy(t), x1, sy(t), stroke="#e0e0e0"))
        body.append(text(x0 - 6, sy(t) + 4, f"{t:g}", size=11, anchor="end"))
    group = (x1 - x0) / len(lens)
    for g, n in enumerate(lens):
        gx = x0 + g * group
        for j, (dtype, color) in enumerate((("auto", BLUE), ("int8", ORANGE))):
            v = run["seqs"][dtype][g]
            bx = gx + group / 2 - 44 + j * 46
            body.append(rect(bx, sy(v), 42, cy1 - sy(v), color, stroke=INK, stroke_width=0.6))
            body.append(text(bx + 21, sy(v) - 5, v, size=12, anchor="middle", weight="bold",
                             label=f"seqs-{dtype}-{n}"))
        body.append(text(gx + group / 2, cy1 + 18, f"{n}", size=12, anchor="middle",
                         weight="bold" if n == p["max_model_len"] else None))
    body.append(line(x0, cy1, x1, cy1))
    body.append(text((x0 + x1) / 2, cy1 + 38, "max_model_len (tokens)", size=12, anchor="middle"))
    leg, _ = legend(x1 - 300, cy0 - 4, [(BLUE, "fp16 KV cache"), (ORANGE, "int8 KV cache")], gap=12)
    body += leg
    a, b = run["plans"]["auto"], run["plans"]["int8"]
    desc = (f"{p['model']} on {p['gpu']} at {p['max_model_len']} tokens: weights {a['weights_gb']:.1f} GB, KV "
            f"{a['kv_pool_gb']:.1f} GB = {a['num_kv_blocks']} blocks, {a['max_concurrent_seqs']} sequences; with an "
            f"int8 cache {b['num_kv_blocks']} blocks, {b['max_concurrent_seqs']} sequences. By context length "
            + ", ".join(f"{n}: {u} / {v}" for n, u, v in zip(lens, run["seqs"]["auto"], run["seqs"]["int8"])))
    picture = svg(cy1 + 50, body, "The capacity plan", desc, defs=[hatch("cap-reserve", GREY)])
    caption = (f"plan_deployment for {p['model']} on one {p['gpu']} ({a['memory_gb']:.1f} GB as nvidia-smi reports "
               f"it). Top: the memory, left to right: weights, the KV pool cut into {a['block_size']}-token blocks, "
               "and the share "
               f"gpu_memory_utilization keeps back. The weights fit easily; what limits concurrency is that every "
               f"{p['max_model_len']}-token sequence may need {a['blocks_per_seq']} blocks: "
               f"{a['max_concurrent_seqs']} fit, {b['max_concurrent_seqs']} with an int8 cache (1 byte per element "
               "instead of 2, twice the blocks in the same bytes). Bottom: halving the context roughly doubles the "
               "sequences that fit, as does the int8 cache.")
    return figure("capacity", "6. The capacity plan", picture, caption), run


# =====================================================================================
# The page
# =====================================================================================

# (id, title, the function that draws it, the exercises whose code it runs)
FIGURES: list[tuple[str, str, Callable[[ModuleType], tuple[str, dict]], tuple[int, ...]]] = [
    ("kv-pool", "1. The paged KV pool: sharing, copy-on-write, the prefix cache", figure_kv_pool, (1, 2, 3, 4, 5)),
    ("block-table", "2. One block table: positions to blocks and slots", figure_block_table, (1, 2)),
    ("batching", "3. Static vs continuous batching", figure_batching, (1, 2, 3, 5)),
    ("speculative", "4. Speculative decoding: rounds and speedup", figure_speculative, (1, 2, 4, 6, 7)),
    ("latency-load", "5. Latency against offered load", figure_latency_load, (1, 2, 3, 5)),
    ("capacity", "6. The capacity plan", figure_capacity, (1, 8)),
]

def error_figure(fig_id: str, title: str, exc: Exception) -> str:
    """The box that stands in for a figure whose run raised: the module's code has a bug there."""
    message = f"{type(exc).__name__}: {exc}"
    body = (f'<div class="stub-box" data-error="{html.escape(message, quote=True)}">Not drawn: the run raised '
            f"<code>{html.escape(message)}</code>. The tests of its exercises will say more.</div>")
    return figure(fig_id, title, body, "This figure's run failed; the others are drawn.")


def stub_figure(fig_id: str, title: str, stub: str, prog: str, needs: Sequence[int]) -> str:
    """The box that stands in for a figure whose exercise is still a stub."""
    body = (f'<div class="stub-box" data-stub="{html.escape(stub, quote=True)}">Not drawn yet: '
            f"<code>{html.escape(stub)}</code> is still a stub. Write it, then run <code>python "
            f"{html.escape(prog)} report</code> again to see this figure drawn from your code.</div>")
    return figure(fig_id, title, body, f"This figure runs the code of Exercises {', '.join(map(str, needs))}.")


def _exercise_number(stub: str) -> int:
    """"Exercise 7: speculative_generate" -> 7 (a message of another form sorts last)."""
    head = stub.split(":", 1)[0].split()
    return int(head[-1]) if head and head[-1].isdigit() else 1 << 30


class Report(NamedTuple):
    """A built report: the page, the stubs that kept figures out (once each, in exercise order),
    and the errors other than stubs that did (figure id: exception)."""

    html: str
    stubs: list[str]
    errors: list[str]


def build_report(lab: ModuleType) -> Report:
    """The whole report for the module `lab`. A figure whose run hits a stub becomes a box naming
    the stub; one whose run raises anything else, a box naming the error; the others still draw."""
    prog = os.path.basename(lab.__file__)
    fragments, stubs, errors = [], [], []
    for fig_id, title, make, needs in FIGURES:
        try:
            fragment, _ = make(lab)
        except NotImplementedError as exc:
            stubs.append(str(exc))
            fragment = stub_figure(fig_id, title, str(exc), prog, needs)
        except Exception as exc:  # a bug in the module's code: show it, draw the rest
            errors.append(f"{fig_id}: {type(exc).__name__}: {exc}")
            fragment = error_figure(fig_id, title, exc)
        fragments.append(fragment)
    stubs = sorted(set(stubs), key=_exercise_number)
    subtitle = (f"Figures drawn from runs of {prog} ({os.path.abspath(lab.__file__)}) on {now()}. "
                + (f"Not drawn yet, still stubs: {', '.join(stubs)}. " if stubs else "")
                + (f"Failed: {'; '.join(errors)}." if errors else "")
                + ("Every figure is drawn." if not stubs and not errors else ""))
    return Report(page("The inference-serving lab in pictures", fragments, subtitle), stubs, errors)


def write_report(lab: ModuleType, path: str) -> Report:
    """Build the report for `lab` and write its page to `path`."""
    report = build_report(lab)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(report.html)
    return report
