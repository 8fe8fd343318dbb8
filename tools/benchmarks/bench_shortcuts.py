"""`python -m tools.bench shortcuts`: the chapter's small shortcuts for speed, each against the
plainer code it replaced, side by side (docs/performance.md, section 6). The chapter keeps one
line of why beside each and points here."""

from __future__ import annotations

import time
from types import ModuleType

import numpy as np

from measure.timing import best_side_by_side
from tools.bench_common import Report


def _calls(fn, n: int):
    """`fn` run n times: one timed unit."""
    def run():
        for _ in range(n):
            fn()
    return run


def _plain_check_int(lab: ModuleType, name, value, minimum=None):
    """check_int without its first test (`type(value) is int`): the full test for every value."""
    if not lab.is_int(value):
        raise TypeError(name)
    if minimum is not None and value < minimum:
        raise ValueError(name)
    return int(value)


def _layer_norm_mean_var(x, weight, bias, eps):
    return (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(x.var(axis=-1, keepdims=True) + eps) * weight + bias


def _gelu_power(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def cases(lab: ModuleType, rng: np.random.Generator) -> list[tuple[str, str, str, object, object]]:
    """The module `lab`'s shortcuts: (where in the chapter, the shortcut, the plainer code,
    shortcut(), plain()), each checked first."""
    out = []
    ids = [int(t) for t in rng.integers(0, 50257, 150)]
    out.append(("check_int, 1000 calls", "`type(value) is int` first", "`is_int` for every value",
                _calls(lambda: lab.check_int("n", 7, 0), 1000), _calls(lambda: _plain_check_int(lab, "n", 7, 0), 1000)))
    out.append(("check_token_ids, 100 calls", "all plain ints >= 0: one pass", "`check_int` per id (150 ids)",
                _calls(lambda: lab.check_token_ids("ids", ids), 100),
                _calls(lambda: [lab.check_int(f"ids[{i}]", t, 0) for i, t in enumerate(ids)], 100)))
    dtype = np.dtype(np.int64)
    out.append(("_check_paged_attention_args, 1000 calls", '`dtype.kind in "iu"`', "`np.issubdtype(dtype, np.integer)`",
                _calls(lambda: dtype.kind in "iu", 1000), _calls(lambda: np.issubdtype(dtype, np.integer), 1000)))
    for rows in (1, 128):
        x = rng.standard_normal((rows, 3072)).astype(np.float32)
        out.append((f"_gelu, ({rows}, 3072)", "`x * x * x`", "`x**3` (float32 power)",
                    lambda x=x: lab._gelu(x), lambda x=x: _gelu_power(x)))
    for rows in (1, 128):
        x = rng.standard_normal((rows, 768)).astype(np.float32)
        w = np.ones(768, np.float32)
        b = np.zeros(768, np.float32)
        out.append((f"_layer_norm, ({rows}, 768)", "mean and variance as sums", "`x.mean`, `x.var`",
                    lambda x=x, w=w, b=b: lab._layer_norm(x, w, b, 1e-5),
                    lambda x=x, w=w, b=b: _layer_norm_mean_var(x, w, b, 1e-5)))
    q, k = (rng.standard_normal((64, 12, 64)).astype(np.float32) for _ in range(2))
    out.append(("ToyTransformer.forward, a prefill chunk's scores (64 tokens, 12 heads)", "`np.matmul` per head",
                '`np.einsum("qhd,khd->hqk")`', lambda: np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)),
                lambda: np.einsum("qhd,khd->hqk", q, k)))
    cache = rng.standard_normal((512, 16, 12, 64)).astype(np.float32)
    blocks = rng.integers(0, 512, (32, 8))
    buffer = np.empty((32, 8, 16, 12, 64), np.float32)
    out.append(("BlockGather.gather, 32 x 8 blocks", '`np.take(..., out=, mode="clip")`', '`mode="raise"`',
                lambda: np.take(cache, blocks, axis=0, out=buffer, mode="clip"),
                lambda: np.take(cache, blocks, axis=0, out=buffer, mode="raise")))
    wte_c = rng.standard_normal((16384, 768)).astype(np.float32)
    wte_f = np.asfortranarray(wte_c)
    x = rng.standard_normal((1, 768)).astype(np.float32)
    out.append(("_checked_gpt2_weights, the tied LM head (vocabulary 16384)", "`wte` stored column-major",
                "`wte` row-major", lambda: x @ wte_f.T, lambda: x @ wte_c.T))
    return out


def bench_shortcuts(lab: ModuleType, repeats: int = 7, log=print, clock=time.perf_counter) -> str:
    """Each shortcut of the module `lab` and its plainer form, in turns, best of `repeats`: the
    plain one's time over the shortcut's. Their outputs are compared first (equal, or within float32 rounding)."""
    rng = np.random.default_rng(0)
    say = Report(log)
    say(f"== The chapter's shortcuts against the plainer code, best of {repeats} in turns ==")
    say(f"{'where':<72}{'shortcut':>12}{'plain':>12}{'plain/shortcut':>16}")
    for where, shortcut, plain, fast, slow in cases(lab, rng):
        a, b = fast(), slow()
        if isinstance(a, np.ndarray):
            assert np.allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max()), f"{where}: the two forms disagree"
        best = best_side_by_side({"shortcut": fast, "plain": slow}, repeats, clock=clock)
        unit, scale = ("us", 1e6) if best["plain"] < 1e-2 else ("ms", 1e3)
        say(f"{where:<72}{best['shortcut'] * scale:>9.1f} {unit}{best['plain'] * scale:>9.1f} {unit}"
            f"{best['plain'] / best['shortcut']:>15.2f}x")
        say(f"    {shortcut} vs {plain}")
    return say.text()
