"""The pages in a real browser: headless Chromium opens a page and dumps the DOM its scripts left,
for the tests of the pages we draw (the trace, the report, the load test's, the fleet's). Where
Chromium is absent those tests skip, saying so.

Chromium runs with a fresh profile and its background services off (no network, no updates, no
sync): the machine's closed network refuses their connections, which would hold the run up.
"""

from __future__ import annotations

import html
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT = 60
WINDOW = (1280, 900)  # the pages are laid out for a 1280 px window
needs_browser = pytest.mark.skipif(BROWSER is None, reason="needs Chromium to render the page: apt-get install "
                                   "chromium (or any chromium / chromium-browser on PATH)")


def dump_dom(path: Path, fragment: str = "") -> str:
    """The DOM of the page at `path` (opened at `#fragment`) once its scripts have run."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000", f"--window-size={WINDOW[0]},{WINDOW[1]}",
             "--hide-scrollbars", "--dump-dom", f"{path.as_uri()}#{fragment}"],
            capture_output=True, text=True, timeout=BROWSER_TIMEOUT)
    if proc.returncode != 0 or "<body" not in proc.stdout:  # not an AssertionError: the page was not checked
        raise RuntimeError(f"chromium --dump-dom exited {proc.returncode}: {proc.stderr[-500:]}")
    return proc.stdout


# Run in the page once it has loaded (and its own scripts drawn it): every element a chart draws
# must lie inside that chart's box, and nothing may stick out of the window sideways. A chart is
# an <svg> (its box: the drawing) or an element with `data-chart`: an SVG group whose `data-box`
# ("x0 y0 x1 y1" in its SVG's units) is the box, or an HTML element, whose own box is. What is not
# drawn (a <title>, <desc>, <defs>, an empty element) is not measured. The problems go into
# <pre id="layout-problems"> as JSON, for the DOM dump.
LAYOUT_CHECK = """
<script>
window.addEventListener("load", () => setTimeout(() => {
  const problems = [], root = document.documentElement, width = root.clientWidth, slack = 1;
  const say = (el) => {
    const words = (el.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 60);
    const label = el.getAttribute("data-label") || el.id;
    return `<${el.tagName.toLowerCase()}${label ? " " + label : ""}>` + (words ? ` "${words}"` : "");
  };
  const drawn = (el) => {
    if (el.closest("title, desc, defs, script, style")) return null;
    const r = el.getBoundingClientRect();
    return r.width > 0 || r.height > 0 ? r : null;
  };
  const px = (v) => Math.round(v);
  if (root.scrollWidth > width + slack)
    problems.push(`the page is ${root.scrollWidth} px wide in a ${width} px window: it scrolls sideways`);
  for (const el of document.body.querySelectorAll("*")) {
    const r = drawn(el);
    if (r && (r.left < -slack || r.right > width + slack))
      problems.push(`${say(el)} spans x ${px(r.left)}..${px(r.right)}, outside the ${width} px window`);
  }
  const boxOf = (chart) => {
    if (chart.dataset.box === undefined) return chart.getBoundingClientRect();
    const [x0, y0, x1, y1] = chart.dataset.box.split(" ").map(Number), m = chart.ownerSVGElement.getScreenCTM();
    const a = new DOMPoint(x0, y0).matrixTransform(m), b = new DOMPoint(x1, y1).matrixTransform(m);
    return {left: Math.min(a.x, b.x), right: Math.max(a.x, b.x), top: Math.min(a.y, b.y), bottom: Math.max(a.y, b.y)};
  };
  for (const chart of document.querySelectorAll("svg, [data-chart]")) {
    const box = boxOf(chart), name = chart.dataset.chart || chart.id || chart.getAttribute("role") || "svg";
    for (const el of chart.querySelectorAll("*")) {
      const r = drawn(el);
      if (r && (r.left < box.left - slack || r.right > box.right + slack || r.top < box.top - slack ||
                r.bottom > box.bottom + slack))
        problems.push(`${say(el)} at x ${px(r.left)}..${px(r.right)}, y ${px(r.top)}..${px(r.bottom)} leaves the ` +
                      `chart ${name} (x ${px(box.left)}..${px(box.right)}, y ${px(box.top)}..${px(box.bottom)})`);
    }
  }
  const out = document.createElement("pre");
  out.id = "layout-problems";
  out.textContent = JSON.stringify(problems);
  document.body.appendChild(out);
}, 0));
</script>
"""


def layout_problems(page: str, where: Path, fragment: str = "") -> list[str]:
    """What the layout check finds in the page `page` (its HTML), rendered by Chromium in a 1280 px
    window from a copy in `where`: each an element outside its chart's box, or outside the window."""
    path = where / "layout-check.html"
    path.write_text(page.replace("</body>", LAYOUT_CHECK + "</body>", 1), encoding="utf-8")
    dom = dump_dom(path, fragment)
    start = dom.find('<pre id="layout-problems">')
    if start < 0:  # not an AssertionError: the check did not run
        raise RuntimeError("the layout check left no result in the page (did the page load?)")
    start += len('<pre id="layout-problems">')
    return json.loads(html.unescape(dom[start:dom.index("</pre>", start)]))
