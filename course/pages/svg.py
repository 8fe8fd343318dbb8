"""The pages' drawing: a few SVG element builders (every attribute escaped), axes, a legend, one
figure, and one self-contained HTML page (inline CSS, no script, nothing fetched). Colours are
Okabe and Ito's palette, which colour-blind readers can tell apart. `report` and `fleet --html`
draw with these."""

from __future__ import annotations

import datetime
import html
import math
from collections.abc import Callable, Sequence

# Okabe & Ito (2008), "Color Universal Design": eight colours distinguishable under every
# common colour-vision deficiency.
BLUE, ORANGE, GREEN, VERMILLION = "#0072B2", "#E69F00", "#009E73", "#D55E00"
SKY, PURPLE, YELLOW, BLACK = "#56B4E9", "#CC79A7", "#F0E442", "#000000"
GREY, LIGHT, INK = "#9a9a9a", "#eeeeee", "#222222"
WIDTH = 1240  # every figure's SVG width: the page is read at 1280 px


# =====================================================================================
# The SVG helper layer: a few element builders, every attribute escaped
# =====================================================================================


def _attrs(attrs: dict) -> str:
    """`key="value"` pairs; a trailing underscore is dropped (class_) and _ becomes - (data_label)."""
    parts = []
    for key, value in attrs.items():
        if value is None:
            continue
        name = key.rstrip("_").replace("_", "-")
        parts.append(f'{name}="{html.escape(str(value), quote=True)}"')
    return " ".join(parts)


def el(tag: str, text: str | None = None, **attrs) -> str:
    """One element; `text` is escaped. No text: a self-closing element."""
    if text is None:
        return f"<{tag} {_attrs(attrs)}/>"
    return f"<{tag} {_attrs(attrs)}>{html.escape(str(text))}</{tag}>"


def rect(x: float, y: float, w: float, h: float, fill: str, **attrs) -> str:
    return el("rect", x=f"{x:.1f}", y=f"{y:.1f}", width=f"{max(w, 0):.1f}", height=f"{max(h, 0):.1f}",
              fill=fill, **attrs)


def text(x: float, y: float, s: object, size: int = 13, anchor: str = "start", weight: str | None = None,
         fill: str = INK, label: str | None = None, **attrs) -> str:
    """A text at (x, y) (the baseline). `label` names a number the tests read back (data-label)."""
    return el("text", str(s), x=f"{x:.1f}", y=f"{y:.1f}", font_size=size, text_anchor=anchor,
              font_weight=weight, fill=fill, data_label=label, **attrs)


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = INK, width: float = 1, **attrs) -> str:
    return el("line", x1=f"{x1:.1f}", y1=f"{y1:.1f}", x2=f"{x2:.1f}", y2=f"{y2:.1f}", stroke=stroke,
              stroke_width=width, **attrs)


def polyline(points: Sequence[tuple[float, float]], stroke: str, width: float = 2, **attrs) -> str:
    return el("polyline", points=" ".join(f"{x:.1f},{y:.1f}" for x, y in points), fill="none",
              stroke=stroke, stroke_width=width, **attrs)


def hatch(pattern_id: str, color: str = GREY, background: str = "#ffffff") -> str:
    """A diagonal-stripe fill (`fill="url(#id)"`): shading that survives greyscale printing."""
    return (f'<pattern id="{pattern_id}" width="6" height="6" patternUnits="userSpaceOnUse" '
            f'patternTransform="rotate(45)">{rect(0, 0, 6, 6, background)}'
            f'{line(0, 0, 0, 6, stroke=color, width=2.2)}</pattern>')


def svg(height: float, body: Sequence[str], title: str, desc: str, defs: Sequence[str] = ()) -> str:
    """An inline SVG image, WIDTH wide, that scales with the page; `title` and `desc` are its
    text alternative (role="img": a screen reader reads them instead of the drawing)."""
    ident = "svg-" + "".join(c if c.isalnum() else "-" for c in title.lower())[:40]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height:.0f}" role="img" '
            f'aria-labelledby="{ident}-t {ident}-d" font-family="inherit">'
            f'<title id="{ident}-t">{html.escape(title)}</title><desc id="{ident}-d">{html.escape(desc)}</desc>'
            + (f"<defs>{''.join(defs)}</defs>" if defs else "") + "".join(body) + "</svg>")


def chart(name: str, box: tuple[float, float, float, float], body: Sequence[str]) -> str:
    """One chart of a figure with several: its elements in a group whose box (x0, y0, x1, y1, in the
    SVG's units) they all lie inside, axis labels and title included; the pages' browser test holds
    them to it (`data-box`)."""
    x0, y0, x1, y1 = box
    return (f'<g {_attrs(dict(data_chart=name, data_box=f"{x0:.1f} {y0:.1f} {x1:.1f} {y1:.1f}"))}>'
            + "".join(body) + "</g>")


def legend(x: float, y: float, items: Sequence[tuple[str, str]], gap: int = 26) -> tuple[list[str], float]:
    """Swatches and names in one row from (x, y); returns the elements and the x after them."""
    out = []
    for fill, name in items:
        out.append(rect(x, y - 11, 14, 14, fill, stroke=INK, stroke_width=0.6))
        out.append(text(x + 19, y, name, size=12))
        x += 19 + 7 * len(name) + gap
    return out, x


def figure(fig_id: str, title: str, body: str, caption: str) -> str:
    return (f'<figure id="{fig_id}"><h2>{html.escape(title)}</h2>{body}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def xscale(lo: float, hi: float, x0: float, x1: float) -> Callable[[float], float]:
    return lambda v: x0 + (v - lo) / (hi - lo) * (x1 - x0) if hi > lo else x0


def nice_ticks(top: float, n: int = 5) -> list[float]:
    """0 and round steps up to at least `top` (1, 2 or 5 times a power of ten)."""
    if not top > 0:
        return [0.0, 1.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(top / step)) + 1)]


# =====================================================================================
# The page: the figures in one self-contained HTML file
# =====================================================================================


CSS = """
:root { color-scheme: light; }
body { background: #ffffff; color: #222222; margin: 0 auto; padding: 16px 20px 40px; max-width: 1240px;
       font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
h1 { font-size: 26px; margin: 8px 0 4px; }
header p { margin: 4px 0; color: #444444; }
figure { margin: 28px 0 0; padding: 14px 0 0; border-top: 2px solid #dddddd; break-inside: avoid; }
figure h2 { font-size: 19px; margin: 0 0 10px; }
figure svg { width: 100%; height: auto; display: block; }
figcaption { margin-top: 10px; max-width: 1100px; color: #333333; }
table.numbers { border-collapse: collapse; margin-top: 10px; font-size: 13px; }
table.numbers th, table.numbers td { border: 1px solid #cccccc; padding: 3px 10px; text-align: right; }
table.numbers th { background: #f3f3f3; }
table.numbers tr.knee td { font-weight: bold; background: #fff3d6; }
pre { font-size: 12px; white-space: pre-wrap; overflow-wrap: anywhere; }  /* a wide printout wraps in the page */
.stub-box { border: 2px dashed #D55E00; background: #fff8f3; padding: 18px 22px; font-size: 16px; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 0.95em; }
@page { size: A4 landscape; margin: 10mm; }
@media print {
  body { max-width: none; padding: 0; font-size: 11pt; }
  figure { break-inside: avoid; page-break-inside: avoid; margin-top: 12px; }
  figure svg { max-height: 115mm; }  /* the viewBox keeps the proportions: a tall figure shrinks */
}
"""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def page(title: str, fragments: Sequence[str], subtitle: str) -> str:
    """One self-contained HTML page: inline CSS, no script, nothing fetched."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{html.escape(title)}"
            f"</title><style>{CSS}</style></head><body><header><h1>{html.escape(title)}</h1>"
            f"<p>{html.escape(subtitle)}</p></header>" + "\n".join(fragments) + "</body></html>\n")
