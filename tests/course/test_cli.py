"""test_cli.py"""

from __future__ import annotations

import fnmatch
import os
import re

import pytest

from conftest import lab
from course.status import unsolved_exercises
from tests.support import (
    ROOT,
    reraise_stub,
    run_cli,
    run_script,
)

# =====================================================================================
# The command line: the design-review scenarios (`python solution.py ...`)
# =====================================================================================


@pytest.mark.needs(8)
def test_cli_size_shows_13b_on_80gb_at_8k_and_that_kv_blocks_set_the_ceiling():
    proc = run_cli("size")
    assert proc.returncode == 0, proc.stderr
    assert "llama-2-13b on a100-80gb, max_model_len 8192" in proc.stdout
    assert "The KV blocks, not the weights, set the ceiling" in proc.stdout
    assert re.search(r"max concurrent sequences at 8192 tokens: \d+ // 512 blocks = \d+", proc.stdout)


@pytest.mark.needs(8)
def test_cli_size_with_options():
    proc = run_cli("size", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--max-model-len", "4096", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    assert "llama-3-8b on 2 x h100-80gb, max_model_len 4096" in proc.stdout


@pytest.mark.needs(8)
def test_cli_size_with_an_int8_kv_cache_shows_the_blocks_and_concurrency_double():
    proc = run_cli("size", "--kv-cache-dtype", "int8")
    assert proc.returncode == 0, proc.stderr
    assert "x 128 x 1 B (8-bit KV cache)" in proc.stdout
    assert "max concurrent sequences at 8192 tokens: 7824 // 512 blocks = 15" in proc.stdout
    default = run_cli("size")
    assert "an 8-bit KV cache (--kv-cache-dtype int8) -> 15 (7824 blocks)" in default.stdout, \
        "the default sizing names the int8 KV cache among the levers"


@pytest.mark.needs(5)
def test_cli_batching_shows_both_timelines():
    proc = run_cli("batching", "--long", "400", "--short", "20", "--num-short", "15")
    assert proc.returncode == 0, proc.stderr
    assert "static:" in proc.stdout and "continuous:" in proc.stdout and "wasted slot-steps" in proc.stdout


# The reviews run the exercises they measure with where they are written, and name the stub where not.
@pytest.mark.parametrize("args, headline", [
    pytest.param(("speculate", "--alpha", "0.8", "--k", "4", "--c", "0.1"), "Your draft: alpha 0.8, c 0.1, k 4",
                 marks=pytest.mark.reaches(7)),
    pytest.param(("stack", "--hardware", "amd"), "Your workload: vllm", marks=pytest.mark.reaches(5)),
])
def test_cli_reviews_exit_0_and_print_their_headline_stubs_or_not(args, headline):
    proc = run_cli(*args)
    assert proc.returncode == 0 and headline in proc.stdout, f"{args}: exit {proc.returncode}\n{proc.stderr}"


@pytest.mark.provided
@pytest.mark.parametrize("args, headline", [
    (("status",), "Exercise 1"),
    (("--help",), "size"),
    (("bench", "--help"), "attention"),
])
def test_cli_subcommands_exit_0_and_print_their_headline(args, headline):
    proc = (run_script if args[0] == "bench" else run_cli)(*args)  # bench runs tools/bench.py, a process
    assert proc.returncode == 0 and headline in proc.stdout, f"{args}: exit {proc.returncode}\n{proc.stderr}"


@pytest.mark.needs(7)
def test_cli_speculate_runs_speculative_generate_and_sets_measured_alpha_beside_the_formula():
    proc = run_cli("speculate")
    reraise_stub(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"alpha: measured 0\.\d+ .*formula 0\.\d+", proc.stdout), (
        f"`python {lab.__name__}.py speculate` must run speculative_generate on the toy models and print "
        f"the measured alpha beside the formula's; got:\n{proc.stdout[-600:]}")
    assert re.search(r"max \|P\(emitted\) - p\| = \d\.\de-1[5-9]", proc.stdout), (
        "the speculate scenario must show, on the measured rows, that accept/resample emits exactly p")


@pytest.mark.needs(5)
def test_cli_stack_measures_what_prefix_sharing_saves_on_the_lab_engine():
    proc = run_cli("stack")
    reraise_stub(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"prefill tokens computed (\d+) -> (\d+) .*outputs identical: (\w+)", proc.stdout)
    assert found, f"`stack` must print what prefix caching saved on the toy engine; got:\n{proc.stdout[-600:]}"
    total, computed, same = int(found.group(1)), int(found.group(2)), found.group(3)
    assert computed < total / 2 and same == "True", (
        f"16 requests sharing a 96-token system prompt computed {computed} of {total} prefill tokens "
        f"(outputs identical: {same}): after the first request, the shared blocks must come from the cache")


@pytest.mark.provided
@pytest.mark.parametrize("args, says", [
    (("size", "--model", "gpt-5"), "choose from 'llama-2-7b'"),
    (("size", "--gpu", "tpu-v9"), "choose from 'a100-40gb'"),
    (("size", "--max-model-len", "-1"), "--max-model-len"),
    (("size", "--activation-gb", "inf"), "--activation-gb"),
    (("size", "--usd-per-gpu-hour", "-2"), "--usd-per-gpu-hour"),
    (("speculate", "--c", "nan"), "--c"),
    (("size", "--kv-cache-dtype", "fp4"), "--kv-cache-dtype"),
    (("speculate", "--alpha", "1.5"), "alpha"),
    (("stack", "--priority", "cheap"), "--priority"),
    (("frobnicate",), "invalid choice"),
    (("speculate", "--target", "."), "--target and --draft go together"),
    (("loadtest", "--url", "http://127.0.0.1:9", "--num-prompts", "1", "--timeout", "2"), "http://127.0.0.1:9"),
])
def test_cli_bad_options_exit_2_with_one_line(args, says):
    proc = run_cli(*args)
    assert proc.returncode == 2, f"{args}: expected exit status 2, got {proc.returncode}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], f"expected one line of error mentioning {says!r}, got {lines}"


@pytest.mark.reaches(8)
def test_cli_main_job_prints_the_four_scenarios_in_order_and_exits_0_naming_the_next_exercise_first():
    proc = run_script()
    prog = f"{lab.__name__}.py"
    assert proc.returncode == 0, f"`python {prog}` is the set-up line's last command: it exits 0, stubs or not\n" \
                                 f"{proc.stderr}"
    headlines = ["1. Size a vLLM deployment", "2. Defend continuous batching",
                 "3. Decide whether to add speculative decoding", "4. Pick a stack"]
    positions = [proc.stdout.find(h) for h in headlines]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), (
        f"`python {prog}` must print the four design-review scenarios in order; found {positions}")
    todo = unsolved_exercises(lab)
    lines = proc.stdout.strip().splitlines()
    if todo:
        first = min(todo)
        assert f"Exercise {first} is next" in lines[0] and all(name in lines[0] for name in todo[first]), (
            f"on a lab with stubs, the first line names the earliest exercise still to write, {first}, and its "
            f"functions {todo[first]}; got {lines[0]!r}")
        assert f"python -m pytest -m exercise{first}" in lines[-1], f"the last line says what to run next: " \
                                                                     f"{lines[-1]!r}"
    else:
        assert "is next" not in proc.stdout and "still a stub" not in proc.stdout, "a finished lab names no stub"


@pytest.mark.provided
def test_cli_main_job_does_not_exit_0_on_an_error_that_is_not_a_stub(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the lab, not a stub")

    monkeypatch.setattr(lab, "plan_deployment", broken)  # the first scenario's, so nothing else runs
    with pytest.raises(RuntimeError, match="a bug in the lab"):
        run_cli()  # a script exits 1 with its traceback: a real error is not a stub to write


@pytest.mark.needs(1)
def test_serve_says_in_its_banner_that_the_toy_models_weights_are_random():
    proc = run_cli("serve", "--port", "0", "--duration", "0.1")
    assert proc.returncode == 0, proc.stderr
    banner = " ".join(proc.stdout.split())
    assert "serving " in banner and "weights are random (--seed 0)" in banner and "--model DIR" in banner, (
        f"without --model the banner must say the weights are random (so garbled text is no surprise): {banner}")


@pytest.mark.provided
def test_report_and_trace_name_their_default_page_for_the_module_so_a_labs_never_overwrites_the_references():
    from course.cli import build_parser
    pages = {prog: [build_parser(lab, prog).parse_args([command]).out for command in ("report", "trace")]
             for prog in ("lab.py", "solution.py")}
    assert pages == {"lab.py": ["lab-report.html", "lab-trace.html"],
                     "solution.py": ["solution-report.html", "solution-trace.html"]}, (
        f"`report` and `trace` must write `<module>-report.html` and `<module>-trace.html` by default: {pages}")
    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = [page for names in pages.values() for page in names
               if not any(fnmatch.fnmatch(page, pattern) for pattern in patterns)]
    assert not tracked, f".gitignore must ignore the pages the commands write by default: {tracked}"


@pytest.mark.needs(5)
def test_trace_writes_its_page_under_the_modules_name_in_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_cli("trace", "--workload", "shared-prefix")
    assert proc.returncode == 0, proc.stderr
    module = os.path.splitext(os.path.basename(lab.__file__))[0]
    assert [p.name for p in tmp_path.iterdir()] == [f"{module}-trace.html"], (
        f"`python {module}.py trace` must write {module}-trace.html here, and say where: {proc.stdout}")
    assert str(tmp_path / f"{module}-trace.html") in proc.stdout
