#!/usr/bin/env python3
"""Plant the classic mistakes in scratch copies of solution.py and show that the suite catches each.

Every mutant is one textual edit of solution.py (the table in mutants_chapter.py), or of a file
of the packages beside it when a fifth field names it (mutants_packages.py); it must apply exactly
once. For a solution.py mutant the tool writes the mutated module to a temporary folder and runs
the students' suite (test_lab.py) against it (`LAB_MODULE=<mutant>`); for a package's mutant it
runs the suite against solution in a scratch copy of the project whose file is mutated. The suite
is the spec (test_lab.py) and the tests of the packages (tests/). It reports the first test that
went red; the tooling tests (tools/) never count as a catch. A mutant that survives is a hole in
the spec. A full run writes tools/checks/mutants_caught.json (which test caught which mutant);
later runs try that test first, so proving all of them takes minutes, not a quarter of an hour.

    python -m tools.checks.mutants              # all mutants, two at a time (-j), hints first
    python -m tools.checks.mutants -k slot      # those whose name contains "slot"
    python -m tools.checks.mutants --no-hints   # each mutant's whole marker: finds the first test that fails
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.checks.mutants_chapter import CHAPTER
from tools.checks.mutants_packages import PACKAGES

ROOT = Path(__file__).resolve().parents[2]

# (name, exercise marker to run, old text, new text[, file: default solution.py])
MUTANTS: list[tuple[str, ...]] = CHAPTER + PACKAGES


HINTS = Path(__file__).with_name("mutants_caught.json")  # mutant name -> the test (file::name) that caught it last time
SUITE = ["test_lab.py", "tests"]


def _pytest_env(module: str, pythonpath: str) -> dict:
    """The suite's environment for one mutant. Bytecode is written even where the caller asked
    for none (CI does): pytest keeps its rewritten test_lab.py there, and rewriting its asserts
    takes longer than most mutants' tests."""
    env = dict(os.environ, LAB_MODULE=module, PYTHONPATH=pythonpath, HYPOTHESIS_PROFILE="ci")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


# Each run is a process of its own, forked from a server that imported pytest, NumPy and Hypothesis
# once (multiprocessing's forkserver, one task a process): a new interpreter per run spent half its
# second importing them. Python 3.10 has no one-task pools: a subprocess per run there.
PRELOAD = ["pytest", "numpy", "hypothesis"]
PYTEST_ARGS = ["-x", "-q", "-rf", "-p", "no:cacheprovider"]


def _pytest_in_child(project: str, env: dict, args: list[str]) -> tuple[int, str]:
    """In a fresh process: `python -m pytest ARGS` as run in `project` under `env`, and its output.
    The forked process was not started in `project`: its import path is made what that command's
    would be (the working directory first, then PYTHONPATH's folders)."""
    os.chdir(project)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [project, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.dont_write_bytecode = False
    import pytest

    with tempfile.TemporaryFile("w+") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        code = int(pytest.main(args))
        sys.stdout.flush()
        sys.stderr.flush()
        out.seek(0)
        return code, out.read()


def _pool(jobs: int):
    """Where the runs go: one-task processes forked from a server with PRELOAD imported, or None."""
    if sys.version_info < (3, 11):
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=context, max_tasks_per_child=1)


_POOL: concurrent.futures.Executor | None = None


def _pytest(project: Path, env: dict, selection: list[str]) -> tuple[int, list[str], str]:
    args = [*selection, *PYTEST_ARGS]
    if _POOL is not None:
        code, out = _POOL.submit(_pytest_in_child, str(project), env, args).result()
    else:
        proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=project, env=env, capture_output=True,
                              text=True)
        code = proc.returncode
        out = proc.stdout + proc.stderr
    # "FAILED <node id> - <message>": a parametrized id may hold spaces, so cut at the dash
    failed = [line.removeprefix("FAILED ").split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED")]
    return code, failed, out.strip()


def run(name: str, marker: str, path: str, source: str, workdir: Path, hint: str | None = None) -> tuple[bool, str]:
    """Whether the suite goes red on the mutant, and the test that did it. With a `hint` (the test
    that caught this mutant before) that test runs first; only if it passes does the mutant's
    whole marker run: the proof is the same (a test of the spec fails), found in a second."""
    workdir.mkdir(parents=True, exist_ok=True)
    if path == "solution.py":
        module = "mutant_" + "".join(c if c.isalnum() else "_" for c in name)[:40]
        (workdir / f"{module}.py").write_text(source)
        project = ROOT
        pythonpath = f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    else:  # a scratch copy of the project, with this one file mutated
        module = "solution"
        project = workdir / "project"
        pythonpath = os.environ.get("PYTHONPATH", "")
        # __pycache__ comes along: it holds test_lab.py with pytest's assertions already rewritten
        # (about 4 s to redo per process), valid in the copy because copytree keeps mtimes.
        shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".git", ".hypothesis", ".venv"))
        (project / path).write_text(source)
    env = _pytest_env(module, pythonpath)
    if hint:
        code, failed, _ = _pytest(project, env, [hint])
        if code == 1 and failed:
            return True, failed[0]
    # serving/'s tests that run the exercises' code are marked needs(N), not exerciseN
    code, failed, out = _pytest(project, env, [*SUITE, "-m", marker if path == "solution.py" else f"{marker} or needs"])
    if failed:
        return code == 1, failed[0]
    return False, out.splitlines()[-1:] or f"pytest exited {code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("-j", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    parser.add_argument("--no-hints", action="store_true",
                        help="run each mutant's whole marker, ignoring " + HINTS.name)
    args = parser.parse_args(argv)
    hints = {} if args.no_hints or not HINTS.exists() else json.loads(HINTS.read_text())
    chosen = [(name, marker, old, new, where[0] if where else "solution.py")
              for name, marker, old, new, *where in MUTANTS if args.k in name]
    survivors = 0
    caught_by = {}
    global _POOL
    _POOL = _pool(args.j)
    # Once, before the workers start: pytest rewrites test_lab.py's asserts into __pycache__.
    _pytest(ROOT, _pytest_env("solution", os.environ.get("PYTHONPATH", "")), [*SUITE, "--collect-only"])

    def one(i: int, mutant: tuple) -> tuple[str, bool, str, float]:
        name, marker, old, new, path = mutant
        text = (ROOT / path).read_text()
        if text.count(old) != 1:
            return name, False, f"the text to mutate occurs {text.count(old)} times in {path}", 0.0
        start = time.perf_counter()
        caught, test = run(name, marker, path, text.replace(old, new), Path(tmp) / str(i), hints.get(name))
        return name, caught, test, time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, args.j)) as pool:
        for name, caught, test, seconds in pool.map(one, range(len(chosen)), chosen):  # in table order
            survivors += not caught
            if caught:
                caught_by[name] = test
            verdict = "caught by" if caught else "SURVIVED:"
            print(f"{'ok' if caught else '!!'} {name:<66} {verdict} {test}  ({seconds:.1f}s)", flush=True)
    if _POOL is not None:
        _POOL.shutdown()
    if not args.k:  # a full run refreshes the hints (only this file's own mutants' names are kept)
        HINTS.write_text(json.dumps(dict(sorted(caught_by.items())), indent=1) + "\n")
    print(f"{survivors} mutant(s) survived")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
