"""test_report.py"""

from __future__ import annotations

import functools
import html.parser
import math
import re

import pytest

import loadtest
import loadtest.simulator
import serving
from conftest import lab
from course.pages import report, svg
from course.pages.report import latency, speculative
from course.reviews import scenarios
from course.status import unsolved_exercises
from loadtest import benchmark_serving
from tests.support import (
    MODEL_CONFIGS,
    reraise_stub,
    run_cli,
)

# =====================================================================================
# The report: `python solution.py report`, one HTML page of figures drawn from real runs
# =====================================================================================
#
# Each figure function returns (html, numbers): the test reads the page back with the standard
# library's html.parser and recomputes every labelled number here, plainly, from the run's raw
# state or from a second run of the module's own code. A wrong label is a failing test.


class ReportPage(html.parser.HTMLParser):
    """A report (or one figure of it) as the tests read it: per `<figure id>` its h2 title, its
    figcaption, its SVG's text alternative (`<title>`, `<desc>`), its labels (`data-label` ->
    text) and its stub box, and for the page the scripts and outside references it has."""

    CAPTURED = {"h2": "title", "figcaption": "caption", "title": "svg_title", "desc": "svg_desc"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.figures = {}
        self.scripts = 0
        self.outside = []
        self._figure = None
        self._open = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.scripts += tag == "script"
        self.outside += [v for k, v in attrs if k in ("src", "href") and v and not v.startswith("#")]
        capture = None
        if tag == "figure":
            self._figure = self.figures.setdefault(a.get("id"), {"labels": {}, "svgs": 0, "stub": None, **{
                field: "" for field in self.CAPTURED.values()}})
        elif self._figure is not None:
            self._figure["svgs"] += tag == "svg"
            if "data-stub" in a:
                self._figure["stub"] = a["data-stub"]
            if "data-label" in a:
                capture = ("labels", a["data-label"])
                self._figure["labels"][a["data-label"]] = ""
            elif tag in self.CAPTURED:
                capture = (self.CAPTURED[tag], None)
        self._open.append((tag, capture))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag:
            pass
        if tag == "figure":
            self._figure = None

    def handle_data(self, data):
        capture = next((c for _, c in reversed(self._open) if c), None)
        if capture and self._figure is not None:
            field, key = capture
            if key is None:
                self._figure[field] += data
            else:
                self._figure["labels"][key] += data


@functools.cache
def drawn(name):
    """One figure (`report.figure_<name>`) drawn for the module under test, read back: (figure, numbers)."""
    make = next(make for _, _, make, _ in report.FIGURES if make.__name__ == f"figure_{name}")
    fragment, numbers = make(lab)
    figures = ReportPage(fragment).figures
    assert len(figures) == 1, f"figure_{name} must return exactly one <figure>, got {list(figures)}"
    return next(iter(figures.values())), numbers


def first_number(label):
    return float(re.search(r"-?\d+(?:\.\d+)?", label).group())


@pytest.mark.needs(5)
def test_report_kv_pool_utilisation_labels_are_the_slots_holding_tokens():
    fig, run = drawn("kv_pool")
    bs, mml = run["block_size"], run["max_model_len"]
    for r, snap in enumerate(run["snapshots"]):
        seqs = snap["seqs"].values()
        slots = {s["block_ids"][i // bs] * bs + i % bs for s in seqs for i in range(s["num_tokens"])}
        in_use = {b for s in seqs for b in s["block_ids"]}
        paged, slab = len(slots) / (len(in_use) * bs), sum(s["num_tokens"] for s in seqs) / (len(seqs) * mml)
        assert fig["labels"][f"paged-util-{r}"] == f"{100 * paged:.1f}%", (
            f"snapshot {r} ({snap['event']}): paged utilisation = distinct slots holding a token / slots of the "
            f"blocks in use = {len(slots)}/{len(in_use) * bs}, the figure says {fig['labels'][f'paged-util-{r}']}")
        assert fig["labels"][f"slab-util-{r}"] == f"{100 * slab:.1f}%", (
            f"snapshot {r}: slab utilisation = tokens / (sequences x max_model_len {mml})")


@pytest.mark.needs(5)
def test_report_kv_pool_shows_shared_blocks_a_copy_on_write_and_cached_free_blocks():
    fig, run = drawn("kv_pool")
    for r, snap in enumerate(run["snapshots"]):
        for blk in snap["blocks"]:
            assert blk["ref_count"] == len(blk["holders"]), (
                f"snapshot {r}, block {blk['id']}: reference count {blk['ref_count']} but held by {blk['holders']}")
    shared = [b for s in run["snapshots"] for b in s["blocks"] if b["ref_count"] > 1]
    assert shared, "B reuses A's cached prefix, so some block must have reference count > 1"
    ref_labels = {k: v for k, v in fig["labels"].items() if k.startswith("ref-")}
    assert ref_labels == {f"ref-{r}-{b['id']}": f"\u00d7{b['ref_count']}" for r, s in enumerate(run["snapshots"])
                          for b in s["blocks"] if b["ref_count"] > 1}, "every shared block is marked xN, no other"
    [fork] = [s for s in run["snapshots"] if s["copies"]]
    [(src, dst)] = fork["copies"]
    assert fig["labels"]["cow-copy"] == f"copy of {src}" and dst in fork["seqs"]["B'"]["block_ids"], (
        "the fork's append copies B's shared last block into a private block of B'")
    last = run["snapshots"][-1]["blocks"]
    assert any(b["cached"] and b["ref_count"] == 0 for b in last), "A's full blocks stay cached after it finishes"
    assert fig["title"] and fig["caption"] and fig["svg_title"] and fig["svg_desc"]


@pytest.mark.needs(2)
def test_report_block_table_slots_are_block_times_size_plus_offset():
    fig, run = drawn("block_table")
    bs, ids, n = run["block_size"], run["block_ids"], run["num_tokens"]
    assert len(ids) == -(-n // bs) and ids != sorted(range(ids[0], ids[0] + len(ids))), (
        f"{n} tokens take ceil({n}/{bs}) blocks, interleaved with another table's: got {ids}")
    for i in range(n):
        assert fig["labels"][f"slot-{i}"] == str(ids[i // bs] * bs + i % bs), f"position {i}: slot label"
    for j, b in enumerate(ids):
        assert fig["labels"][f"block-id-{j}"] == f"block_ids[{j}] = {b}"
    assert f"the last holds {n - (len(ids) - 1) * bs} of {bs}" in fig["labels"]["summary"], (
        "the last block is partly filled: n - (blocks - 1) * block_size tokens")


@pytest.mark.needs(5)
def test_report_batching_numbers_are_the_simulators():
    fig, run = drawn("batching")
    p = run["params"]
    workload = loadtest.simulator.skewed_workload(p["num_short"], p["long_len"], p["short_len"], p["prompt_len"])
    for scheduling in ("static", "continuous"):
        sim = loadtest.simulate_serving(lab, workload, scheduling, max_num_seqs=p["slots"])
        labels = {k.split("-", 1)[1]: v for k, v in fig["labels"].items() if k.startswith(scheduling + "-")}
        assert labels == {"steps": f"{sim.num_steps} steps", "throughput": f"{sim.throughput:.0f} tokens/s",
                          "mean-ttft": f"{sim.summary()['mean_ttft']:.2f} s", "wasted": str(sim.wasted_slot_steps)}, (
            f"{scheduling}: the figure's numbers must be simulate_serving's")
        assert run[scheduling]["timeline"] == sim.timeline


@pytest.mark.needs(7)
def test_report_speculative_rounds_count_what_speculative_generate_did():
    fig, run = drawn("speculative")
    p = run["params"]
    config = lab.ModelConfig(**speculative.SPEC_MODEL)
    target = scenarios.make_early_exit_target(lab, config, p["draft_layers"], p["refinement_scale"])
    out = lab.speculative_generate(target, lab.make_self_draft(target, p["draft_layers"]), p["prompt"],
                                   lab.SamplingParams(max_tokens=p["max_tokens"], temperature=1.0, seed=p["seed"]),
                                   k=p["k"])
    emitted, bonus = 0, 0
    for accepted in out.accepted_per_pass:
        bonus += accepted == min(p["k"], p["max_tokens"] - emitted - 1)  # every draft of the round survived
        emitted += accepted + 1
    labels = {k: int(fig["labels"][k]) for k in ("tokens", "passes", "drafted", "accepted", "rejected", "bonus")}
    assert labels == {"tokens": len(out.token_ids), "passes": out.num_target_passes,
                      "drafted": out.num_draft_tokens, "accepted": out.num_accepted,
                      "rejected": out.num_target_passes - bonus, "bonus": bonus}, (
        "the figure's tallies must be the run's: a round ends in a rejection (and a resampled token) or, when "
        "every draft it made was accepted, in a bonus token")
    assert [r["accepted"] for r in run["rounds"]] == out.accepted_per_pass


@pytest.mark.needs(7)
def test_report_speedup_curve_is_the_formula_at_the_measured_alpha():
    fig, run = drawn("speculative")
    assert run["alpha"] == lab.estimate_alpha(lab.SpeculativeOutput([0] * run["num_tokens"], run["num_target_passes"],
                                                                    run["num_draft_tokens"], run["num_accepted"],
                                                                    [r["accepted"] for r in run["rounds"]]),
                                              run["params"]["k"])
    for k in run["ks"]:
        assert fig["labels"][f"speedup-k{k}"] == f"{lab.speculative_speedup(run['alpha'], k, run['c']):.2f}"
    measured = run["num_tokens"] / (run["num_target_passes"] + run["c"] * run["num_draft_tokens"])
    assert fig["labels"]["measured-speedup"] == f"this run, counted: {measured:.2f}\u00d7 at c = {run['c']:.2f}", (
        "this run's speedup, counted: tokens / (target passes + c x draft steps), at the assumed c it names")


@pytest.mark.provided
def test_report_latency_figure_labels_every_rate_and_marks_the_knee():
    rates = [1.0, 2.0, 4.0, 8.0, math.inf]
    p99 = [0.05, 0.06, 0.07, 0.5, math.nan]
    summaries = [{"p50_ttft": t / 2, "p99_ttft": t, "p50_tpot": 0.01, "p99_tpot": 0.02, "output_throughput": 100 * r}
                 for r, t in zip(rates, p99)]
    fragment, numbers = latency.latency_figure(rates, summaries, "A test.")
    labels = ReportPage(f'<figure id="f">{fragment}</figure>').figures["f"]["labels"]
    assert numbers["knee"] == benchmark_serving.find_knee(rates, p99) == 4.0
    assert labels["knee-ttft"] == "knee: 4 req/s"
    assert [labels[f"p99_ttft-{i}"] for i in range(5)] == ["50.0", "60.0", "70.0", "500.0", "\u2013"], (
        "p99 TTFT in ms per rate; a rate where nothing completed (NaN) shows a dash")
    assert labels["rate-4"] == "inf"


@pytest.mark.needs(5)
def test_report_latency_numbers_are_the_simulators_at_each_rate():
    fig, run = drawn("latency_load")
    p, last = run["params"], len(run["rates"]) - 1
    workload = loadtest.simulator.recurring_workload(p["num_requests"], p["long_len"], p["short_len"],
                                                    p["prompt_len"], run["rates"][last])
    summary = loadtest.simulate_serving(lab, workload, "continuous", max_num_seqs=p["slots"],
                                       record_timeline=False).summary()
    for key in ("p50_ttft", "p99_ttft", "p50_tpot", "p99_tpot"):
        assert fig["labels"][f"{key}-{last}"] == f"{summary[key] * 1e3:.1f}", f"{key} at {run['rates'][last]} req/s"
    for i, s in enumerate(run["summaries"]):
        assert fig["labels"][f"p99_ttft-{i}"] == f"{s['p99_ttft'] * 1e3:.1f}"
    knee = benchmark_serving.find_knee(run["rates"], [s["p99_ttft"] for s in run["summaries"]])
    assert knee is not None and fig["labels"]["knee-ttft"] == f"knee: {knee:g} req/s", (
        "the simulated rates must reach past the knee, and the figure marks find_knee's rate")


@pytest.mark.needs(8)
def test_report_capacity_numbers_are_plan_deployments():
    fig, run = drawn("capacity")
    p = run["params"]
    for dtype in ("auto", "int8"):
        plan = lab.plan_deployment(p["model"], p["gpu"], p["max_model_len"], kv_cache_dtype=dtype)
        assert first_number(fig["labels"][f"{dtype}-max-seqs"]) == plan.max_concurrent_seqs
        kv = f"KV {plan.kv_pool_bytes / lab.GB:.1f} GB: {plan.num_kv_blocks} blocks"
        assert fig["labels"][f"{dtype}-kv-gb"] == kv
        assert fig["labels"][f"{dtype}-weights-gb"] == f"weights {plan.weight_bytes_per_gpu / lab.GB:.1f} GB"
        for n in p["context_lens"]:
            seqs = lab.plan_deployment(p["model"], p["gpu"], n, kv_cache_dtype=dtype).max_concurrent_seqs
            assert fig["labels"][f"seqs-{dtype}-{n}"] == str(seqs), f"{dtype} KV cache at max_model_len {n}"


@pytest.mark.reaches(8)  # each figure runs the exercises it draws where they are written
def test_report_cli_writes_one_self_contained_page_naming_the_stubs_it_needs(tmp_path):
    out = tmp_path / "r.html"
    proc = run_cli("report", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == str(out.resolve()), "the report prints the path it wrote"
    page = ReportPage(out.read_text(encoding="utf-8"))
    assert list(page.figures) == [fig_id for fig_id, *_ in report.FIGURES]
    assert page.scripts == 0 and page.outside == [], f"self-contained: no script, nothing fetched ({page.outside})"
    stubbed = {f"Exercise {n}: {name}" for n, names in unsolved_exercises(lab).items() for name in names}
    for fig_id, fig in page.figures.items():
        assert fig["title"] and fig["caption"], f"{fig_id}: every figure has a title and a caption"
        if fig["stub"] is None:
            assert fig["svgs"] >= 1 and fig["svg_title"] and fig["svg_desc"], (
                f"{fig_id}: a drawn figure is an SVG with a text alternative (<title>, <desc>)")
        else:
            assert fig["stub"] in stubbed and fig["stub"] in proc.stdout, (
                f"{fig_id} is a box naming {fig['stub']!r}, which must be one of the module's stubs and printed")
    assert bool(stubbed) == any(fig["stub"] for fig in page.figures.values())


@pytest.mark.provided
def test_report_draws_the_other_figures_when_one_hits_a_stub_and_names_an_error(monkeypatch):
    def drawn_fine(module):
        return svg.figure("fine", "Fine", svg.svg(10, [], "a title", "a description"), "A caption."), {}

    def stubbed(module):
        raise NotImplementedError("Exercise 2: BlockTable.fork")

    def broken(module):
        raise IndexError("list index out of range")

    monkeypatch.setattr(report, "FIGURES", [("stubbed", "S", stubbed, (2,)), ("fine", "Fine", drawn_fine, ()),
                                            ("broken", "B", broken, (1,))])
    built = report.build_report(lab)
    figures = ReportPage(built.html).figures
    assert list(figures) == ["stubbed", "fine", "broken"], "every figure keeps its place"
    assert figures["stubbed"]["stub"] == "Exercise 2: BlockTable.fork", "a stub's figure is a box naming the stub"
    assert built.stubs == ["Exercise 2: BlockTable.fork"]
    assert figures["fine"]["svgs"] == 1 and figures["fine"]["svg_desc"] == "a description"
    assert built.errors == ["broken: IndexError: list index out of range"], "a failure that is not a stub is named"


@pytest.mark.needs(5)
def test_loadtest_html_draws_latency_against_load_from_a_real_run(tmp_path):
    model = lab.ToyTransformer(lab.ModelConfig(**MODEL_CONFIGS["bytes"]))
    engine = lab.LLMEngine(model, num_blocks=256, block_size=4, max_num_seqs=8)
    out = tmp_path / "load.html"
    with serving.start_server(engine, lab=lab) as srv:
        proc = run_cli("loadtest", "--url", srv.url, "--qps", "inf,40", "--num-prompts", "4", "--workload", "tiny",
                       "--html", str(out))
    reraise_stub(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    fig = ReportPage(out.read_text(encoding="utf-8")).figures["latency-load"]
    assert [fig["labels"][f"rate-{i}"] for i in range(2)] == ["40", "inf"], "one row per offered rate, ascending"
    assert all(first_number(fig["labels"][f"p99_ttft-{i}"]) > 0 for i in range(2)), "measured TTFTs, in ms"
    assert srv.url in fig["caption"] and fig["svg_desc"]
