"""Figure 2 of the report: one block table, logical positions to physical blocks and slots."""

from __future__ import annotations

from types import ModuleType

from ..svg import INK, LIGHT, ORANGE, SKY, WIDTH, figure, hatch, line, rect, svg, text

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


def _physical_pool(run: dict, py: float, logical_x) -> list[str]:
    """The physical pool at height `py`, with a line from each logical block (centred at
    `logical_x(j)`) to its physical block."""
    bs, n, ids = run["block_size"], run["num_tokens"], run["block_ids"]
    pw = (WIDTH - 20) / run["num_blocks"]
    body = [text(0, py - 12, f"the physical pool: {run['num_blocks']} blocks of {bs} slots", size=12, fill="#444444")]
    for b in range(run["num_blocks"]):
        x = 10 + b * pw
        if b in ids:
            j = ids.index(b)
            fill, who = ORANGE, f"this table [{j}]"
            used = min(bs, n - j * bs)
            body.append(line(logical_x(j), 112, x + pw / 2 - 3, py - 4, stroke=INK, width=1.4,
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
    return body


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
    py = 178
    body += _physical_pool(run, py, lambda j: x0 + j * (bs * cell + gap) + bs * cell / 2)
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
