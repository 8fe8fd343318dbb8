"""The pages' words, checked without running anything (tools/test_tooling.py runs the checks;
tools/handout/student_copy.py refuses a copy that fails them): no page names the round a figure
was taken in (history) or types the suite's counts (typed_counts: the scoreboard prints them); no
link points at a missing file or heading (link_problems); and the copy's pages narrate no
history, and show no command that runs the reference, a maintainers' tool, or the git history
(copy_problems); and no file of the copy names a file or folder the copy lacks (unheld_names).
The commands themselves are found and run by check_docs.py.
"""

from __future__ import annotations

import fnmatch
import io
import os
import re
import tokenize

from tools.pages.check_docs import FENCE, INLINE, INLINE_COMMAND, not_run, snippets_of

# The project's history, in any page: a figure carries its date and machine instead.
ROUNDS = re.compile(r"\b(?:this|that|earlier|last|previous|latest|prior)\s+rounds?\b|\bround\s+before\b"
                    r"|\brounds?'s?\s+code\b", re.I)
# ... and in the copy a course hands out, any narration of it: a student reads what is, not what was.
HISTORY = re.compile(ROUNDS.pattern + r"|\b(?:until\s+)?issues?\s+\d+\b"
                     r"|\b(?:an|the)\s+earlier\s+(?:version|engine|kernel|client|code)\b"
                     r"|\bthe\s+old\s+(?:code|client|kernel|engine)\b|\bused\s+to\s+(?:leave|be|run|take)\b", re.I)


def history(text: str, copy: bool = False) -> list[str]:
    """`line N: words` for each phrase of the project's history in a page (`copy`: the stricter
    rule of the student's copy)."""
    pattern = HISTORY if copy else ROUNDS
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group().split())!r}"
            for m in pattern.finditer(text)]


# The suite's own counts and time, which change with every test: the scoreboard prints them.
# (Hundreds of them: "at most 10 tests" is a limit, not a count.)
SUITE_COUNTS = re.compile(r"\b\d[\d,]{2,}\s+(?:of\s+\d[\d,]*\s+)?tests\b|\b\d[\d,]{2,}\s+(?:passed|green|on\s+stubs)\b",
                          re.I)


def typed_counts(text: str) -> list[str]:
    """`line N: words` for each count of the suite's tests typed into a page."""
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {' '.join(m.group().split())!r}"
            for m in SUITE_COUNTS.finditer(text)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(pages: dict[str, str], files: set[str]) -> list[str]:
    """Relative links that point at no file of `files` (or of a folder of them), or at no heading."""
    anchors = {path: {anchor(h) for h in re.findall(r"^#+\s+(.*?)\s*$", FENCE.sub("", text), re.M)}
               for path, text in pages.items()}
    problems = []
    for path, text in pages.items():
        for m in re.finditer(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if resolved not in files and not any(f.startswith(resolved.rstrip("/") + "/") for f in files):
                problems.append(f"{path}: a link to {target}, a file this checkout lacks")
            elif fragment and resolved in anchors and fragment not in anchors[resolved]:
                problems.append(f"{path}: a link to {target}, a heading {resolved} lacks")
    return problems


COPY_FILE = re.compile(r"(?<![\w/.])((?:tools|docs|tests|\.ci)/[\w./-]*\w|solution\.py)")
# A tool run as a module (`python -m tools.bench`): the file it runs is tools/bench.py.
TOOL_MODULE = re.compile(r"(?<![\w.])tools(?:\.\w+)+")


def module_file(module: str, files: set[str]) -> str:
    """The file or folder of `files` a dotted name under tools/ stands for (`tools.bench.main`:
    tools/bench.py), or the file it would be where `files` lack it (`tools.checks.mutants`:
    tools/checks/mutants.py)."""
    parts = module.split(".")
    for i in range(2, len(parts) + 1):
        path = "/".join(parts[:i])
        if f"{path}.py" in files:
            return f"{path}.py"
        if not any(f.startswith(path + "/") for f in files):
            return "/".join(parts) + ".py"
    return "/".join(parts)  # a package: its folder


def names_in(command: str, files: set[str]) -> list[str]:
    """The files of the checkout a command names: by path, or as a tool's module."""
    return COPY_FILE.findall(command) + [module_file(m, files) for m in TOOL_MODULE.findall(command)]


def copy_problems(pages: dict[str, str], files: set[str]) -> list[str]:
    """What in the copy's pages does not fit the copy: a phrase of history, a command that names
    the reference or a file the copy lacks or needs the project's git history, a link to no file."""
    problems = []
    for path, text in pages.items():
        problems += [f"{path}: {found} narrates history" for found in history(text, copy=True)]
        problems += [f"{path}: {found} is the suite's count typed by hand" for found in typed_counts(text)]
        for snippet in snippets_of(path, text):
            for command in snippet.commands:
                if not_run(snippet, command):
                    continue
                first = command.split("\n")[0]
                if re.search(r"\bsolution\b", command):
                    problems.append(f"{snippet.where}: `{first}` runs the reference, which the copy lacks")
                if re.search(r"--against\b|\bgit\s+show\b", command):
                    problems.append(f"{snippet.where}: `{first}` needs the project's git history")
                for name in names_in(command, files):
                    if name not in files and not any(f.startswith(name.rstrip("/") + "/") for f in files):
                        problems.append(f"{snippet.where}: `{first}` names {name}, which the copy lacks")
        prose = INLINE.sub(lambda m: m.group() if not INLINE_COMMAND.match(m.group(1)) else "", FENCE.sub("", text))
        for m in re.finditer(r"`([^`\n]+)`", prose):
            for name in COPY_FILE.findall(m.group(1)):
                if name != "solution.py" and name not in files and not any(f.startswith(name + "/") for f in files):
                    problems.append(f"{path}: `{m.group(1)}` names {name}, which the copy lacks")
    return problems + link_problems(pages, files)


def _words(path: str, text: str) -> list[tuple[int, str]]:
    """(line, words) of a file: all of a page or other text file; in Python, its comments and its
    strings with a space in them (docstrings, messages, help), not a bare name in code
    (`ROOT / "tools" / "handout"` is code that the copy never runs, not words a student reads)."""
    if not path.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return list(enumerate(text.splitlines(), 1))
    found = []
    for token in tokens:
        if token.type in kinds and (token.type == tokenize.COMMENT or re.search(r"\s", token.string)):
            found += [(token.start[0] + i, line) for i, line in enumerate(token.string.splitlines())]
    return found


def unheld_names(texts: dict[str, str], held: set[str], checkout: set[str],
                 allowed: tuple[str, ...] = ("solution.py",)) -> list[str]:
    """`path:line: name` for each file or folder the copy's words name that the copy does not hold:
    a path from the checkout's top (`tools/checks/...`, `docs/x.md`, `.ci/run`) that is no file or
    folder of `held` (a glob matching none), and the name of a file or folder the checkout keeps
    back from the copy (`make_lab.py`, `handout/`). `texts`: the copy's text files as it ships
    them; `checkout`: every file the checkout tracks; `allowed`: what the copy may name anyway
    (solution.py: the course hands it out later). A check of names, so it holds for files added later."""
    folders = {"/".join(p.split("/")[:i]) for p in held for i in range(1, p.count("/") + 1)}
    tops = {p.split("/")[0] for p in checkout}
    top_folders = sorted(t for t in tops if any(p.startswith(t + "/") for p in checkout))
    top_files = sorted(tops - set(top_folders))
    in_folder, top_file = "|".join(map(re.escape, top_folders)), "|".join(map(re.escape, top_files))
    rooted = re.compile(rf"(?<![\w./-])(?:(?:{in_folder})/[\w./*?-]*|(?:{top_file})(?![\w-]))")
    held_names = {p.split("/")[-1] for p in held} | {f + "/" for f in {p.split("/")[-1] for p in folders}}
    kept = {p.split("/")[-1] for p in checkout - held if "." in p.split("/")[-1].strip(".")}
    kept |= {part + "/" for p in checkout - held for part in p.split("/")[:-1]}
    kept -= held_names | set(allowed)
    kept_back = "|".join(re.escape(n) for n in sorted(kept, key=len, reverse=True))
    back = re.compile(rf"(?<![\w.-])(?:{kept_back})(?!\w)") if kept else None

    def held_path(name: str) -> bool:
        name = name.rstrip("/")
        if any(c in name for c in "*?"):
            return any(fnmatch.fnmatch(p, name) for p in held)
        return name in held or name in folders or name in allowed

    problems = []
    for path, text in sorted(texts.items()):
        for line, words in _words(path, text):
            names = [m.group().rstrip(".") for m in rooted.finditer(words)]
            names += [module_file(m, held) for m in TOOL_MODULE.findall(words)]
            names = [n for n in names if not held_path(n)]
            names += [m.group() for m in back.finditer(words) if not any(m.group() in n for n in names)] \
                if back else []
            problems += [f"{path}:{line}: {name}" for name in dict.fromkeys(names)]
    return problems
