"""Figure 6 of the report: the capacity plan, where the GPU's memory goes and how many sequences
fit."""

from __future__ import annotations

from types import ModuleType

from ..svg import (
    BLUE,
    GREEN,
    GREY,
    INK,
    ORANGE,
    PURPLE,
    figure,
    hatch,
    legend,
    line,
    nice_ticks,
    rect,
    svg,
    text,
    xscale,
)

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


def _memory_bar(plan: dict, dtype: str, y: float, sx, x0: float, x1: float, max_model_len: int) -> list[str]:
    """One GPU's memory at height `y`, left to right: weights, activations, the KV blocks, what is
    left over, and what gpu_memory_utilization keeps back; then how many sequences fit."""
    names = {"auto": "fp16 KV cache", "int8": "int8 KV cache"}
    body = [text(0, y + 16, names[dtype], size=13, weight="bold"),
            text(0, y + 32, f"{plan['kv_kib_per_token']:g} KiB per token", size=11, fill="#444444")]
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
    body.append(text(x0, y + 52, f"{plan['max_concurrent_seqs']} sequences of {max_model_len} tokens "
                                 f"fit ({plan['num_kv_blocks']} blocks // {plan['blocks_per_seq']} per sequence)",
                     size=12, label=f"{dtype}-max-seqs"))
    body.append(text(x1 + 8, y + 22, f"{plan['memory_gb']:.1f} GB", size=12, label=f"{dtype}-memory-gb"))
    return body


def _seqs_by_context(run: dict, x0: float, x1: float, cy0: float, cy1: float) -> list[str]:
    """Sequences that can all reach the context length at once, fp16 and int8 KV cache side by side."""
    p = run["params"]
    lens = p["context_lens"]
    top = max(max(v) for v in run["seqs"].values())
    ticks = nice_ticks(top, 5)
    sy = xscale(0, ticks[-1], cy1, cy0)
    body = [text(0, cy0 - 22, f"Sequences that can all reach the context length at once ({p['model']} on "
                              f"{p['gpu']})", size=14, weight="bold")]
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
    return body


def figure_capacity(lab: ModuleType) -> tuple[str, dict]:
    run = run_capacity(lab)
    p = run["params"]
    x0, x1 = 150, 1120
    reserve = [(PURPLE, "activation reserve")] if run["plans"]["auto"]["activation_gb"] > 0 else []
    body, _ = legend(0, 16, [(BLUE, "weights"), *reserve, (GREEN, "KV blocks"), ("#ffffff", "left over (< 1 block)"),
                             ("url(#cap-reserve)", "not given to the engine (1 - gpu_memory_utilization)")])
    total = run["plans"]["auto"]["memory_gb"]
    sx = xscale(0, total, x0, x1)
    for i, dtype in enumerate(("auto", "int8")):
        body += _memory_bar(run["plans"][dtype], dtype, 44 + i * 74, sx, x0, x1, p["max_model_len"])
    cy0, cy1 = 230, 470
    body += _seqs_by_context(run, x0, x1, cy0, cy1)
    lens = p["context_lens"]
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
