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

One module per figure, each with the run it draws (`run_...`) beside its drawing (`figure_...`):

    kv_pool.py      1. the paged KV pool: sharing, copy-on-write, the prefix cache
    block_table.py  2. one block table: positions to blocks and slots
    batching.py     3. static vs continuous batching
    speculative.py  4. speculative decoding: rounds and speedup
    latency.py      5. latency against offered load (also `loadtest --html`'s page)
    capacity.py     6. the capacity plan
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NamedTuple

from ..svg import figure, now, page
from .batching import figure_batching
from .block_table import figure_block_table
from .capacity import figure_capacity
from .kv_pool import figure_kv_pool
from .latency import figure_latency_load
from .speculative import figure_speculative

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
