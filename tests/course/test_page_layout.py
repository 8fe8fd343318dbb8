"""test_page_layout.py: every page we draw (the report, the trace, the load test's, the fleet's), as
headless Chromium lays it out in a 1280 px window: each element a chart draws lies inside that
chart's box (an <svg>'s drawing; a panel's `data-box`; an HTML chart's own box), and nothing sticks
out of the window sideways (tests/course/browser.py's check)."""

from __future__ import annotations

import math

import pytest

from conftest import lab
from course.pages import svg
from course.pages.fleet_page import fleet_page
from course.pages.report import build_report
from course.pages.report.latency import load_report_html, run_latency_load
from course.reviews import fleet
from loadtest import fleet_search
from tests.course.browser import layout_problems, needs_browser
from tests.course.test_trace_page import busiest_step, page_of


def assert_laid_out(problems: list[str], page: str) -> None:
    assert not problems, (f"the {page}: every element of a chart lies inside its box, and the page fits the window "
                          "(1280 px):\n  " + "\n  ".join(problems))


@pytest.mark.provided
@needs_browser
def test_the_check_finds_an_element_outside_its_chart_and_a_page_wider_than_the_window(tmp_path):
    inside = svg.chart("left", (10, 10, 200, 90), [svg.line(20, 20, 190, 80)])
    outside = svg.chart("right", (210, 10, 400, 90), [svg.line(220, 20, 460, 80)])  # into the space beyond
    picture = svg.svg(100, [inside, outside], "two panels", "one line crosses its panel's edge")
    html_chart = ('<section data-chart="boxed" style="width: 300px"><div style="width: 200px">fits</div>'
                  '<div style="width: 500px">sticks out</div></section>')
    page = svg.page("planted", [svg.figure("planted", "planted", picture, "caption"), html_chart,
                                '<div style="width: 1600px">a block wider than the window</div>'], "a test")
    problems = layout_problems(page, tmp_path)
    assert any("leaves the chart right" in p for p in problems), f"a line past its panel's box is found: {problems}"
    assert not any("chart left" in p for p in problems), f"the line inside its box is not: {problems}"
    boxed = [p for p in problems if "chart boxed" in p]
    assert boxed and all('"sticks out"' in p for p in boxed), (
        f"an HTML chart's child wider than it is found, and only that one: {problems}")
    assert any("scrolls sideways" in p for p in problems), f"a page wider than the window is found: {problems}"


@pytest.mark.needs(8)
@needs_browser
def test_the_report_lies_inside_its_charts_and_the_window(tmp_path):
    assert_laid_out(layout_problems(build_report(lab).html, tmp_path), "report")


@pytest.mark.needs(5)
@needs_browser
def test_the_trace_lies_inside_its_charts_and_the_window(tmp_path):
    rec, data, path = page_of("memory-pressure", tmp_path)
    page = path.read_text()
    step = busiest_step(data, "r3")
    assert_laid_out(layout_problems(page, tmp_path, f"step={step}&request=r3"), f"trace at step {step}")


@pytest.mark.needs(5)
@needs_browser
def test_the_load_tests_page_lies_inside_its_charts_and_the_window(tmp_path):
    run = run_latency_load(lab)
    rates = run["rates"][:-1] + [math.inf]  # the last rate "all at once", as --qps inf sends it
    page = load_report_html(rates, run["summaries"], "http://127.0.0.1:8000", "toy-gpt2-2x64-v256", 100, "alpaca")
    assert_laid_out(layout_problems(page, tmp_path), "load test's page")
    # Its knee marked as late as it goes (the rate before the last: p99 TTFT jumps at the last),
    # the label by the panels' right edge
    flat = run["summaries"][0]["p99_ttft"]
    late = [dict(s, p99_ttft=flat * (10 if i == len(rates) - 1 else 1)) for i, s in enumerate(run["summaries"])]
    page = load_report_html(run["rates"], late, "http://127.0.0.1:8000", "toy-gpt2-2x64-v256", 100, "alpaca")
    assert f"knee: {run['rates'][-2]:g} req/s" in page, "the hand-made knee is the rate before the last"
    assert_laid_out(layout_problems(page, tmp_path), "load test's page with its knee at the last rate")


@pytest.mark.needs(8)
@needs_browser
def test_the_fleets_page_lies_inside_its_charts_and_the_window(tmp_path):
    question = fleet_search.FleetQuestion("llama-2-7b", ("h100-80gb",), qps=70.0, slo=fleet_search.SLO(0.1, 0.02),
                                          workload="alpaca", max_model_len=512, num_requests=40)
    candidates = [fleet_search.Candidate("h100-80gb", 1, 16, 256), fleet_search.Candidate("h100-80gb", 2, 16, 256)]
    answer = fleet.run_fleet(lab, question, jobs=1, log=lambda line: None, candidates=candidates)
    assert len([row for row in answer.rows if row.gpus]) == 2, "both rows meet the targets: the page draws two panels"
    assert_laid_out(layout_problems(fleet_page(lab, question, answer), tmp_path), "fleet's page")
