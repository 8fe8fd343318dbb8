"""Tests of the project's own tooling, not the students' spec: what make_lab generates keeps the
contract, the chapter stays a chapter, and what runs it stands above it. Run with the README's test
command. They read solution.py and the lab text GENERATED from it, never the lab.py a student is
editing (whether lab.py is that text is CI's `python -m tools.handout.make_lab --check`)."""

from __future__ import annotations

import ast
import collections
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.benchmarks import bench_speculative
from tools.checks import second_lab
from tools.handout import make_lab, student_copy
from tools.tool_support import ROOT, tracked_files


def public_api(module) -> dict[str, str]:
    """Public names defined in the module, with the signatures of functions, classes and methods."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", module.__name__) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            try:
                api[name] = str(inspect.signature(obj))
            except ValueError:  # classes whose signature is a builtin's, e.g. exceptions
                api[name] = "builtin"
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if member.startswith("_") and member != "__init__":
                    continue
                if inspect.isfunction(value):
                    api[f"{name}.{member}"] = str(inspect.signature(value))
                elif isinstance(value, property):
                    api[f"{name}.{member}"] = "property"
        elif not inspect.ismodule(obj) and not callable(obj):
            api[name] = type(obj).__name__
    return api


def generated_lab_text() -> str:
    solution = make_lab.refresh_reading_map((ROOT / "solution.py").read_text())
    return make_lab.refresh_reading_map(make_lab.make_lab(solution))


def generated_lab_module(text: str | None = None, name: str = "generated_lab"):
    """The generated lab text (or `text`), imported as a module of its own (its `__main__` block does not run)."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        exec(compile(generated_lab_text() if text is None else text, str(ROOT / f"{name}.py"), "exec"),
             module.__dict__)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.provided
def test_lab_and_solution_expose_the_same_public_names_and_signatures():
    lab_api = public_api(generated_lab_module())
    solution_api = public_api(importlib.import_module("solution"))
    missing = sorted(set(solution_api) - set(lab_api))
    extra = sorted(set(lab_api) - set(solution_api))
    differ = sorted(n for n in set(lab_api) & set(solution_api) if lab_api[n] != solution_api[n])
    assert not (missing or extra or differ), (
        f"lab.py drifted from solution.py: missing {missing}, extra {extra}, different signatures {differ}; "
        "regenerate it with `python -m tools.handout.make_lab`"
    )


@pytest.mark.provided
def test_make_lab_turns_each_solution_region_into_a_stub_and_keeps_the_rest():
    source = (
        "class A:\n"
        "    def f(self, x):\n"
        '        """Doc stays."""\n'
        "        # BEGIN SOLUTION: Exercise 3\n"
        "        return x + 1\n"
        "        # END SOLUTION\n"
    )
    lab_text = make_lab.make_lab(source)
    assert '"""Doc stays."""' in lab_text and "return x + 1" not in lab_text
    assert '        raise NotImplementedError("Exercise 3: A.f")\n' in lab_text


@pytest.mark.provided
def test_make_lab_with_only_one_exercise_stubs_that_one_and_keeps_the_others():
    source = ("def f(x):\n    # BEGIN SOLUTION: Exercise 1\n    return x\n    # END SOLUTION\n\n\n"
              "def g(x):\n    # BEGIN SOLUTION: Exercise 2\n    return -x\n    # END SOLUTION\n")
    lab_text = make_lab.make_lab(source, only={"2"})
    assert "return x\n" in lab_text and 'raise NotImplementedError("Exercise 2: g")' in lab_text
    assert "Exercise 1: f" not in lab_text and "return -x" not in lab_text


@pytest.mark.provided
@pytest.mark.parametrize("source", [
    "def f():\n    # BEGIN SOLUTION: Exercise 1\n    return 1\n",
    "def f():\n    return 1\n    # END SOLUTION\n",
    "# BEGIN SOLUTION: Exercise 1\nx = 1\n# END SOLUTION\n",
], ids=["no-end", "no-begin", "outside-a-function"])
def test_make_lab_rejects_misplaced_markers(source):
    with pytest.raises(ValueError):
        make_lab.make_lab(source)


@pytest.mark.provided
def test_the_chapter_stays_a_chapter_and_each_reading_map_says_where():
    solution = (ROOT / "solution.py").read_text()
    lab_text = generated_lab_text()
    titles = [int(m.group(1)) for line in solution.split("\n") if (m := re.match(r"# (\d+)\. ", line))]
    assert titles == sorted(titles), f"sections must come in their numbered order, found {titles}"
    # The day's reading, the chapter's one budget: the mechanisms and their checks. What vLLM's API
    # adds (serving/sampling.py), what runs the chapter (server, simulator, scenarios, command line)
    # and what measures it live beside. lab.py is the same file with the exercises' bodies cut, so
    # the budget holds both. Its room is for writing clearly, not a target: sizes are a reviewer's
    # signal, and no other count of lines is held here.
    assert solution.count("\n") <= 3000, (
        f"solution.py has {solution.count(chr(10))} lines, more than a day's reading (3,000): what a student "
        "need not read belongs in serving/ or tools/")
    for name, text in (("solution.py", solution), ("lab.py", lab_text)):
        assert make_lab.refresh_reading_map(text) == text, (
            f"the reading map in {name}'s docstring names stale line ranges: run python -m tools.handout.make_lab")


PACKAGES = ("measure", "serving", "checkpoints", "loadtest", "course")  # the jobs beside the chapter


def modules_of(folder: str) -> list[Path]:
    """Every module of a package, its subpackages' included."""
    return sorted((ROOT / folder).rglob("*.py"))


def imported_packages(path: Path) -> set[str]:
    """The top-level names a module imports (absolute imports only; relative ones stay inside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.provided
def test_the_packages_are_handed_the_module_and_the_chapter_imports_the_course_only_in_main():
    for package in PACKAGES:
        for path in modules_of(package):
            found = imported_packages(path) & {"solution", "lab"}
            assert not found, f"{path.relative_to(ROOT)} imports {found} by name: hand it the module instead"
    solution = (ROOT / "solution.py").read_text()
    main = solution[solution.index('if __name__ == "__main__":'):]
    before = solution[: solution.index('if __name__ == "__main__":')]
    assert not re.search(rf"^\s*(from|import) ({'|'.join(PACKAGES)})\b", before, re.M), (
        "solution.py imports a package beside it outside `__main__`: the chapter stands below what runs it")
    assert "course.main(" in main, "`python solution.py` must hand the module to course.main, the command line's home"


@pytest.mark.provided
def test_imports_run_one_way_the_course_above_the_server_load_and_checkpoints():
    for package in PACKAGES[:-1]:
        for path in modules_of(package):
            assert "course" not in imported_packages(path), (
                f"{path.relative_to(ROOT)} imports the course: the course stands above {package}/, never below it")
    for path in modules_of("serving"):
        assert "loadtest" not in imported_packages(path), f"{path.relative_to(ROOT)} imports the load generator"
    for path in modules_of("checkpoints"):
        assert not imported_packages(path) & {"serving", "loadtest"}, (
            f"{path.relative_to(ROOT)} imports the server or the load generator: a checkpoint stands below both")


def import_tricks(source: str) -> list[str]:
    """What in a module imports past its `import` lines, where the import graph (and a reader) cannot
    see it: `importlib` or `runpy`, `__import__`, `sys.modules[...]` under any key (a name written out,
    or one recovered from an object), or a module-level `__getattr__` / `__dir__` (names handed out
    from elsewhere when asked for)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in ("importlib", "runpy")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("importlib", "runpy"):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", "")) in (
                "__import__", "import_module"):
            found.append(f"line {node.lineno}: {getattr(node, 'id', getattr(node, 'attr', ''))}")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "modules":
            found.append(f"line {node.lineno}: sys.modules[{ast.unparse(node.slice)}]")
    found += [f"line {node.lineno}: a module-level {node.name}" for node in tree.body
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("__getattr__", "__dir__")]
    return found


PLANTED_IMPORT_TRICKS = {
    "importlib": "import importlib\n\nmain = importlib.import_module('course.cli').main\n",
    "from importlib": "from importlib import import_module\n",
    "__import__": "main = __import__('course').main\n",
    "sys.modules by name": "import sys\n\nmain = sys.modules['course'].main\n",
    "sys.modules from an object": "import sys\n\nlab = sys.modules[type(engine).__module__]\n",
    "module __getattr__": "def __getattr__(name):\n    from course import cli\n    return getattr(cli, name)\n",
}


@pytest.mark.provided
@pytest.mark.parametrize("name", PLANTED_IMPORT_TRICKS)
def test_the_import_check_sees_an_import_planted_past_the_import_lines(name):
    assert import_tricks(PLANTED_IMPORT_TRICKS[name]), f"a planted {name} import went unseen"


@pytest.mark.provided
def test_no_package_nor_the_chapter_imports_past_its_import_lines():
    # A name handed out through importlib or a module __getattr__ is an arrow the import graph
    # cannot draw (a package could hand out the course's `main` that way, and the chapter would run
    # chapter -> server -> course). Every import is an `import` line, so the direction checks above see it.
    paths = [ROOT / "solution.py", *(path for package in PACKAGES for path in modules_of(package))]
    for path in paths:
        tricks = import_tricks(path.read_text())
        assert not tricks, f"{path.relative_to(ROOT)} imports where the import graph cannot see it: {tricks}"


def chapter_private_names() -> set[str]:
    """The private names the chapter defines: functions, classes and attributes named `_x` (not
    dunders), module-level or in a class or on `self`."""
    names = set()
    for node in ast.walk(ast.parse((ROOT / "solution.py").read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            name = node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        else:
            continue
        if name.startswith("_") and name.strip("_") and not name.endswith("__"):
            names.add(name)
    return names


def private_uses(source: str, private: set[str]) -> list[str]:
    """Where a module touches one of `private`: as an attribute of anything but its own `self` or
    `cls` (`engine.scheduler._preempt`, `lab._softmax`), or as a string (`getattr(x, "_free")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


# What listens to the chapter from beside it: the course (the trace above all) and the trace's tests.
LISTENERS = [*modules_of("course"), ROOT / "tests" / "course" / "test_trace.py",
             ROOT / "tests" / "course" / "test_trace_page.py", ROOT / "tests" / "test_events.py"]

PLANTED_PRIVATE_USES = {
    "a private method wrapped": "scheduler._preempt = recording_preempt\n",
    "a private queue read by name": "free = getattr(engine.allocator, '_free', None)\n",
    "private state written": "engine.allocator._ref_counts[3] = 1\n",
    "a private helper of the module": "probs = lab._softmax(scores)\n",
}


@pytest.mark.provided
@pytest.mark.parametrize("name", PLANTED_PRIVATE_USES)
def test_the_private_name_check_sees_a_planted_use(name):
    private = chapter_private_names()
    assert {"_free", "_evictable", "_allocate_slots", "_preempt", "_ref_counts"} <= private
    assert private_uses(PLANTED_PRIVATE_USES[name], private), f"{name} went unseen"
    assert not private_uses("self._free = []\nengine.allocator.ref_count(3)\n", private), "its own attributes are its"


@pytest.mark.provided
def test_the_course_and_the_trace_use_only_the_chapters_public_names():
    # The trace listens to the engine's events and reads public state: a private name of the
    # chapter renamed or rewritten (as a student may) must not break a page silently.
    private = chapter_private_names()
    for path in LISTENERS:
        uses = private_uses(path.read_text(), private)
        assert not uses, f"{path.relative_to(ROOT)} touches private names of the chapter: {uses}"


@pytest.mark.provided
def test_the_benchmarks_import_the_module_they_measure_and_it_never_imports_them():
    bench = (ROOT / "tools" / "bench.py").read_text()
    solution = (ROOT / "solution.py").read_text()
    assert "import_module(args.module)" in bench, "tools/bench.py must measure the module it is given (--module)"
    assert not re.search(r"^(from|import) (tools|bench)\b", solution, re.M), (
        "solution.py imports the benchmarks: measurement stands beside the model, not inside it")
    assert not re.search(r"^def bench_", solution, re.M), "benchmark code belongs in tools/bench.py"


@pytest.mark.provided
def test_no_package_beside_the_chapter_imports_the_tools():
    for package in PACKAGES:
        for path in modules_of(package):
            assert "tools" not in imported_packages(path), (
                f"{path.relative_to(ROOT)} imports tools/: the tools stand above every package they measure or check")


# --- the tools: packages run as `python -m tools.<module>`, importing one way ---------------------


def tool_room(module: str) -> str:
    """The part of tools/ a dotted name under it belongs to: a subpackage (`benchmarks/`) or a
    top-level module (`bench_common.py`)."""
    part = module.split(".")[1]
    return f"{part}/" if (ROOT / "tools" / part).is_dir() else f"{part}.py"


def tool_imports(source: str) -> set[str]:
    """The parts of tools/ (tool_room) a module imports, by its absolute `import` lines."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {tool_room(a.name) for a in node.names if a.name.startswith("tools.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tools":
            found |= {tool_room(f"{node.module}.{a.name}") for a in node.names}
    return found


def tools_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """Part of tools/ -> the other parts its modules import, for `files` (path -> source) under
    tools/; the tests (test_*.py) left out: a test may reach any part it checks."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path, source in files.items():
        if Path(path).name.startswith("test_"):
            continue
        room = tool_room(path.removesuffix(".py").replace("/", "."))
        graph[room] |= tool_imports(source) - {room}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each loop of the graph found by a depth-first walk (a part that reaches itself), as its path."""
    found = []
    done = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for after in sorted(graph.get(node, ())):
            walk(after, path + [node])
        done.add(node)

    for node in sorted(graph):
        walk(node, [])
    return found


def tools_files() -> dict[str, str]:
    return {path: (ROOT / path).read_text() for path in sorted(tracked_files())
            if path.startswith("tools/") and path.endswith(".py")}


@pytest.mark.provided
def test_the_tools_import_check_sees_a_planted_loop_and_a_part_named_by_its_module():
    planted = {"tools/handout/student_copy.py": "from tools.pages.check_words import copy_problems\n",
               "tools/pages/check_words.py": "from tools.handout import make_lab\n"}
    assert loops(tools_graph(planted)), "a loop between tools/handout/ and tools/pages/ went unseen"
    assert tool_imports("from tools import bench_common\nimport tools.benchmarks.bench_attention\n") == {
        "bench_common.py", "benchmarks/"}


@pytest.mark.provided
def test_the_tools_import_one_way():
    found = loops(tools_graph(tools_files()))
    assert not found, "parts of tools/ import each other in a loop (one must stand below the other):\n" + "\n".join(
        " -> ".join(loop) for loop in found)


@pytest.mark.provided
def test_what_the_student_copy_keeps_of_the_tools_imports_nothing_it_drops():
    dropped = {tool_room(path.removesuffix("/").removesuffix(".py").replace("/", "."))
               for path in student_copy.MAINTAINERS_ONLY if path.startswith("tools/")}
    assert {"handout/", "checks/", "pages/"} <= dropped, f"test setup: the copy drops {dropped}"
    kept = set(student_copy.shipped_files())
    for path, source in tools_files().items():
        if path in kept:
            reached = tool_imports(source) & dropped
            assert not reached, f"{path} is in the student's copy and imports {reached}, which the copy drops"


# --- the student's copy and its grade (docs/teaching.md) ----------------------------------------


@pytest.mark.provided
def test_the_student_copy_ships_no_reference_and_refuses_a_file_that_quotes_an_answer():
    shipped = student_copy.shipped_files()
    assert "lab.py" in shipped and "test_lab.py" in shipped and "conftest.py" in shipped
    kept_back = [p for p in shipped if p in student_copy.MAINTAINERS_ONLY or p.startswith(".ci/")]
    assert not kept_back, f"the student's copy would ship maintainers' files: {kept_back}"
    missing = [p for p in student_copy.MAINTAINERS_ONLY if not (ROOT / p).exists()]
    assert not missing, f"MAINTAINERS_ONLY names paths that are gone (renamed? then the copy ships them): {missing}"
    solution = (ROOT / "solution.py").read_text()
    region = solution[solution.index("# BEGIN SOLUTION: Exercise 5"):]
    quoted = region[:region.index("# END SOLUTION")]
    assert student_copy.leaks({"docs/notes.md": quoted}, solution), "a file quoting Exercise 5's answer must be refused"
    assert not student_copy.leaks({"lab.py": generated_lab_text()}, solution), "the stubbed lab holds no answer"
    readme = student_copy.student_readme((ROOT / "README.md").read_text())
    assert "<!-- maintainers" not in readme and "LAB_MODULE=solution" not in readme and "student's copy" in readme


@pytest.mark.provided
def test_grade_on_a_half_written_lab_is_a_gradescope_result_that_agrees_with_the_scoreboard(tmp_path):
    """Exercises 5-7 stubs, the others written; only Exercises 6 and 8 run (fast): 8 scores full,
    6 the share of its tests that pass without its functions and names them, the others say that
    none of their tests ran."""
    (tmp_path / "lab_half.py").write_text(make_lab.make_lab((ROOT / "solution.py").read_text(),
                                                                         only={"5", "6", "7"}))
    env = dict(os.environ, LAB_MODULE="lab_half", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    result_path = tmp_path / "results" / "results.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "test_lab.py",
                           "-m", "exercise6 or exercise8", "--grade", str(result_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    result = json.loads(result_path.read_text())
    assert set(result) >= {"score", "max_score", "tests"} and len(result["tests"]) == 8
    for test in result["tests"]:
        assert set(test) >= {"name", "score", "max_score", "output"}, test
        assert 0 <= test["score"] <= test["max_score"] and isinstance(test["output"], str)
    by_name = {t["name"].split(":")[0]: t for t in result["tests"]}
    assert by_name["Exercise 8"]["score"] == by_name["Exercise 8"]["max_score"] > 0
    assert by_name["Exercise 6"]["score"] < 1 and "accept_or_resample" in by_name["Exercise 6"]["output"]
    assert "no test of this exercise ran" in by_name["Exercise 1"]["output"] and by_name["Exercise 1"]["score"] == 0
    assert result["score"] == round(sum(t["score"] for t in result["tests"]), 2)
    board = proc.stdout[proc.stdout.index("scoreboard (lab_half)"):].splitlines()
    for number in (6, 8):
        test = by_name[f"Exercise {number}"]
        first = test["output"].splitlines()[0]
        assert first in board, f"Exercise {number}: the grade says {first!r}; the scoreboard: {board}"
        passed, total = map(int, re.search(r"\): (\d+)/(\d+)", first).groups())
        assert test["score"] == round(test["max_score"] * passed / total, 2), f"Exercise {number}: {test}"


@pytest.mark.provided
def test_the_second_implementation_fills_every_stub_of_the_generated_lab():
    # The suite on it is `python -m tools.checks.second_lab --run`: this checks it fits lab.py.
    text = second_lab.second_lab(generated_lab_text())
    assert "raise NotImplementedError(\"Exercise" not in text, "a stub of lab.py has no second implementation"
    compile(text, "second_lab.py", "exec")


def event_steps(module, workload) -> list[list]:
    """The events an engine of `module` sends running `workload`, step by step."""
    from course.pages import trace

    class Steps(list):
        def __call__(self, event):
            self[-1].append(event)

        def arrived(self, request_ids):
            self.append([])

        def stepped(self, outputs):
            pass

    steps = Steps()
    trace.drive(trace.build_engine(module, workload, observer=steps), module, workload, steps)
    return steps


@pytest.mark.provided
def test_the_second_implementation_reports_the_same_events():
    # The events come from provided code, so a correct implementation written another way reports
    # the same: the scheduler's events exactly, and as many of each kind of the pool's every step
    # (which physical block a table gets may differ: the second lab allocates in another order).
    from course.pages.trace_workloads import WORKLOADS, get_workload

    solution = importlib.import_module("solution")
    second = generated_lab_module(second_lab.second_lab(generated_lab_text()), "second_lab_events")
    scheduler = ("SCHEDULED", "OUT_OF_BLOCKS", "PREEMPTED")
    for name in WORKLOADS:
        workload = get_workload(name)
        ours, theirs = event_steps(solution, workload), event_steps(second, workload)
        assert len(ours) == len(theirs), f"{name}: {len(theirs)} steps, the reference {len(ours)}"
        for k, (a, b) in enumerate(zip(ours, theirs), 1):
            told = [[(e.type.name, e.request_id, e.num_tokens) for e in events if e.type.name in scheduler]
                    for events in (a, b)]
            assert told[0] == told[1], f"{name}, step {k}: the scheduler's events differ"
            counts = [sorted(collections.Counter(e.type.name for e in events).items()) for events in (a, b)]
            assert counts[0] == counts[1], f"{name}, step {k}: the pool's events differ"


@pytest.mark.provided
@pytest.mark.parametrize("measured, extended, alpha, says", [
    (1.38, 1.45, 0.90, ["prediction holds", "is NOT met: 1.38x at alpha 0.90",
                        "Worth adding for batch-1 decode all the same: 1.38x takes 28% off"]),
    (2.00, 2.00, 0.90, ["prediction holds", "is met: 2.00x", "Worth adding for batch-1 decode with a draft this good"]),
    (1.10, 1.50, 0.50, ["does NOT hold", "does not apply: alpha 0.50 < 0.7", "Not worth adding here"]),
], ids=["below the bar, still pays", "above the bar", "alpha below the bar's"])
def test_the_speculative_verdict_holds_each_number_to_its_own_bar(measured, extended, alpha, says):
    verdict = bench_speculative.speculative_verdict(measured, extended, alpha)
    missing = [words for words in says if words not in verdict]
    assert not missing, f"the verdict on {measured}x must say {missing}: {verdict}"
