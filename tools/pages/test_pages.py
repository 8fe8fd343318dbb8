"""The pages' words, held by the tools that check them: no narrated rounds nor hand-typed counts,
links that resolve, a student's copy whose pages fit it, and every command a page shows found
complete and run (tools/pages/check_words.py, tools/pages/check_docs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from course.commands import SERVE_MODEL
from tools.handout import student_copy
from tools.pages import check_docs, check_words
from tools.tool_support import tracked_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.provided
def test_no_page_narrates_the_projects_rounds_or_types_the_suites_counts_and_every_link_resolves():
    pages = check_docs.pages()
    rounds = [f"{path}: {found}" for path, text in pages.items() for found in check_words.history(text)]
    assert not rounds, "a figure carries its date and machine, not the round it was taken in:\n" + "\n".join(rounds)
    counts = [f"{path}: {found}" for path, text in pages.items() for found in check_words.typed_counts(text)]
    assert not counts, "the suite's counts change with every test: the scoreboard prints them\n" + "\n".join(counts)
    broken = check_words.link_problems(pages, tracked_files())
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.mark.provided
def test_the_copys_pages_fit_the_copy_no_history_no_reference_no_maintainers_file():
    texts, binaries = student_copy.copy_files()
    assert "docs/teaching.md" not in texts, "the graders' page ships only in the maintainers' checkout"
    pages = {path: text for path, text in texts.items() if student_copy.is_page(path)}
    assert {"README.md", "docs/hints.md", "docs/trace.md"} <= set(pages)
    unfit = student_copy.words_unfit(texts, binaries)
    assert not unfit, "the copy's pages say what the copy cannot do:\n" + "\n".join(unfit)
    shown = [c for path, text in pages.items() for s in check_docs.snippets_of(path, text)
             for c in s.commands]
    assert "python lab.py size" in shown and not [c for c in shown if "solution.py" in c], (
        "the copy's commands run lab.py where the maintainers' pages run solution.py")


@pytest.mark.provided
@pytest.mark.parametrize("page, says", [
    ("measured in this round's run", "narrates history"),
    ("the earlier rounds gave 2x", "narrates history"),
    ("Until issue 36 the entry kept", "narrates history"),
    ("the provided code passes (341 of 913 tests on stubs)", "the suite's count typed by hand"),
    ("see [the graders' page](teaching.md)", "a file this checkout lacks"),
    ("see [the load test](serving.md#no-such-heading)", "a heading docs/serving.md lacks"),
    ("run `python solution.py size`", "runs the reference"),
    ("```bash\npython -m tools.checks.mutants -k trace\n```", "names tools/checks/mutants.py, which the copy lacks"),
    ("    python -m tools.server.bench_server_cpu --against 8c096fd", "needs the project's git history"),
])
def test_the_copys_words_check_names_each_kind_of_word_that_does_not_fit(page, says):
    files = {"docs/x.md", "docs/serving.md", "tools/server/bench_server_cpu.py"}
    pages = {"docs/x.md": f"# A page\n\nText.\n\n{page}\n", "docs/serving.md": "# Serving\n\n## The load test\n"}
    found = check_words.copy_problems(pages, files)
    assert any(says in problem for problem in found), f"{page!r}: expected a problem saying {says!r}, got {found}"
    clean = {"docs/x.md": "# A page\n\nRun `python lab.py size`; a [link](serving.md#the-load-test); the "
                          "final round of speculation.\n", "docs/serving.md": pages["docs/serving.md"]}
    assert check_words.copy_problems(clean, files) == []


@pytest.mark.provided
def test_every_file_of_the_copy_names_only_files_and_folders_the_copy_holds_but_solution_py():
    texts, binaries = student_copy.copy_files()
    assert "tools/handout/make_lab.py" in tracked_files(), "test setup: the check needs a file the copy keeps back"
    unheld = student_copy.names_unheld(texts, binaries)
    assert not unheld, "the copy names what it does not hold (words inside `<!-- maintainers -->` are dropped from " \
                       "the copy's pages and pyproject.toml):\n" + "\n".join(unheld)


KEPT_BACK = {"tools/handout/make_lab.py", "tools/checks/mutants.py", "docs/teaching.md", ".ci/run", "solution.py"}
HELD = {"lab.py", "README.md", "docs/x.md", "tools/bench.py", "tools/checks_of_mine.txt", "course/cli.py"}


@pytest.mark.provided
@pytest.mark.parametrize("path, text, names", [
    ("README.md", "see `docs/y.md` and tools/handout/make_lab.py.", ["docs/y.md", "tools/handout/make_lab.py"]),
    ("README.md", "| `tools/` | `handout/`: the lab generator |", ["handout/"]),
    ("pyproject.toml", '"tools/checks/mutants_*.py" = ["E501"]', ["tools/checks/mutants_*.py"]),
    ("course/cli.py", "# regenerate with make_lab.py\nx = 1\n", ["make_lab.py"]),
    ("course/cli.py", 'def f():\n    """Graded as docs/teaching.md says."""\n', ["docs/teaching.md"]),
    ("course/cli.py", 'raise SystemExit(f"run {x} as .ci/run does")\n', [".ci/run"]),
])
def test_the_unheld_names_check_names_each_kept_back_or_missing_path(path, text, names):
    found = check_words.unheld_names({path: text}, HELD, HELD | KEPT_BACK)
    assert [problem.rsplit(": ", 1)[1] for problem in found] == names, found


@pytest.mark.provided
def test_the_unheld_names_check_lets_through_what_the_copy_holds_solution_py_others_paths_and_code():
    text = ('"""lab.py and solution.py; tools/bench.py and tools/*.py; docs/; vLLM\'s vllm/v1/core/sched/utils.py; '
            'min(1, p/q); text/html."""\nPATH = ROOT / "tools" / "checks" / "mutants.py"\nfrom make_lab import x\n')
    assert check_words.unheld_names({"course/cli.py": text}, HELD, HELD | KEPT_BACK) == []


@pytest.mark.provided
def test_every_command_shown_is_found_complete_and_the_few_not_run_say_why():
    found = check_docs.snippets()
    commands = [(s, c) for s in found for c in s.commands]
    blocks = [s.commands for s in found if s.page == "README.md" and s.kind == "bash"]
    setup = "python3 -m venv .venv && . .venv/bin/activate && python -m pip install -e '.[test]' && python solution.py"
    assert blocks[0] == [setup], f"the README's first block: one set-up line that ends in the main job: {blocks[0]}"
    assert ["LAB_MODULE=solution python -m pytest"] in blocks, "the README shows the command whose tests pass"
    served = "toy-gpt2-{n_layer}x{n_embd}-v{vocab_size}".format(**SERVE_MODEL)
    curl = [b for b in blocks if b[0].startswith("python solution.py serve &") and b[1].startswith("curl ")]
    assert curl and f'"model": "{served}"' in curl[0][1] and served in curl[0][0], (
        f"the README's first curl asks `serve` for the model id it prints ({served}): {curl}")
    incomplete = [f"{s.where}: {c}" for s, c in commands if check_docs.incomplete(c)]
    assert not incomplete, "a command shown must run as written (`...` is not an argument):\n" + "\n".join(incomplete)
    unused = [needle for needle, _, _ in check_docs.NOT_RUN if not any(needle in c for _, c in commands)]
    assert not unused, f"NOT_RUN names commands no page shows any more: {unused}"
    assert len(check_docs.NOT_RUN) <= 12, "a snippet that can run, runs: keep NOT_RUN short"
    assert sum(bool(check_docs.not_run(s, c)) for s, c in commands) < len(commands) / 4


@pytest.mark.provided
def test_every_file_a_pages_command_writes_into_the_checkout_is_one_git_ignores(tmp_path):
    written = {(s.where, path) for s in check_docs.snippets() for c in s.commands
               for path in check_docs.written_files(c) if not path.startswith(("/", "..", "~", "$"))}
    assert {"my-report.html", "t.html", "keys.json", "results.json", "workload.jsonl"} <= {p for _, p in written}, (
        f"the pages' outputs are found: {sorted(written)}")
    loose = check_docs.unignored(ROOT, {path for _, path in written} | {"load.html", "fleet.html"})
    assert not loose, ("a command of the pages leaves this in the checkout, and git would list it as untracked "
                       f"(an ignored folder, or its name in .gitignore): {loose} from {sorted(written)}")
    checkout = check_docs.scratch_checkout(ROOT, ROOT / "solution.py", tmp_path / "checkout")
    (checkout / "notes.txt").write_text("a file no page writes")
    assert check_docs.unignored(checkout, {"notes.txt", "x-report.html"}) == ["notes.txt"], (
        "the run's check names a file git would list as untracked, and only that one")


@pytest.mark.provided
def test_a_pages_shell_is_read_as_its_commands_continuations_here_documents_and_quotes_whole():
    text = ('a \\\n  b\n# a comment\n\ncat > f <<\'EOF\'\nx\n"\nEOF\npython -c "\nprint(1)"   # done\n'
            'serve &  # in the background\n')
    assert check_docs.logical_commands(text) == ["a \\\n  b", "cat > f <<'EOF'\nx\n\"\nEOF",
                                                 'python -c "\nprint(1)"   # done', "serve &  # in the background"]


@pytest.mark.provided
def test_the_snippet_runner_fails_a_failing_or_incomplete_command_and_keeps_a_blocks_cd_and_export(tmp_path):
    env = check_docs.environment(tmp_path)

    def status(*commands):
        return [o.status for o in check_docs.run_snippet(check_docs.Snippet("x.md", 1, "bash", list(commands)),
                                                         tmp_path, env)]
    assert status("python -c 'print(1)'", "true") == ["ok", "ok"]
    assert status("python -c 'raise SystemExit(3)'", "true") == ["FAIL"]
    assert status("python lab.py loadtest ...") == ["FAIL"]
    assert status("vllm serve meta-llama/Llama-3.1-8B-Instruct") == ["not run"]
    assert status("mkdir -p sub && cd sub", "export WORD=kept",  # a block's later commands run where it went
                  "python -c 'import os; assert os.getcwd().endswith(\"sub\") and os.environ[\"WORD\"] == \"kept\"'"
                  ) == ["ok", "ok", "ok"]
    seen: dict = {}  # a command shown again, alone, runs once; after a cd it runs again
    shown = [check_docs.Snippet("x.md", n, "bash", ["python -c 'print(1)'"]) for n in (1, 2)]
    assert [o.status for s in shown for o in check_docs.run_snippet(s, tmp_path, env, seen)] == ["ok", "same"]
    after_cd = check_docs.Snippet("x.md", 3, "bash", ["cd sub", "python -c 'print(1)'"])
    assert [o.status for o in check_docs.run_snippet(after_cd, tmp_path, env, seen)] == ["ok", "ok"]
