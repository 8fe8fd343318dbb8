"""Figure 1 of the report: the paged KV pool during a real engine run (prefix caching, a fork,
copy-on-write), beside the same sequences as max_model_len slabs."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from ..svg import (
    BLACK,
    BLUE,
    GREEN,
    GREY,
    INK,
    LIGHT,
    ORANGE,
    PURPLE,
    SKY,
    WIDTH,
    figure,
    hatch,
    legend,
    line,
    pct,
    rect,
    svg,
    text,
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
    words = s.split()
    lines = [""]
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
