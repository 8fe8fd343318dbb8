#!/usr/bin/env python3
"""The pages' own check: every command README.md and docs/ show runs as written (their words are
check_words.py's).

    python -m tools.pages.check_docs                 # run every command the pages show (minutes)
    python -m tools.pages.check_docs --list          # what would run, and the few that are not run, with why
    python -m tools.pages.check_docs --copy DIR      # the same in a student's copy (tools.handout.student_copy)
    python -m tools.pages.check_docs -k serving.md   # only the snippets whose page or text contains a word

A snippet is a fenced block of shell (```bash), a `$ `-prompted or indented block of commands, a
```python block, or the commands written inline on one line (`python solution.py size`). A
snippet runs command by command in a scratch folder of its own, so what one command writes the
next can read. `... &`, or a server that a later command of its snippet talks to, runs in the
background until the snippet ends; its port is waited for, as a user waits for its banner.

The scratch folder is a copy of the checkout (its git history linked) with `lab.py` a copy of
the reference (`solution.py`): the student's commands run on a lab with every exercise written
(OWN_LAB: but for a check of the checkout's own lab.py), and nothing a command writes
(lab-report.html, workload.jsonl) lands in the checkout. Placeholders in a template
(`hint N`) are given a value (PLACEHOLDERS).

Each command must exit 0 within FINISH_S seconds, except the ones that run until stopped or for
minutes (LONG: servers, load tests, benchmarks, the whole suite): those must not fail within CUT_S
seconds, then are stopped, with everything they started (each command runs in a session of its
own). A command shown with `...` for its arguments fails, and so does a snippet that leaves a file in the
checkout that git would list as untracked (a page's output belongs in an ignored folder, or its
name in .gitignore). NOT_RUN names the few that need what CI does not have, with why.

The words of the pages, checked without running anything, are check_words.py's. Run it from the
checkout's root; a copy's check runs there too, with the copy's environment active (the copy has
no tools/checks/).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]

FINISH_S = 90.0  # a command that is not LONG must be done by then (a loaded 2-core machine)
CUT_S = 2.0  # a LONG command must not have failed by then: its imports, its flags, its start

# A command (after its `VAR=value` prefixes) that runs until stopped, or for minutes: checked for
# CUT_S seconds, then stopped.
LONG = re.compile(r"""
    \s(serve|loadtest|fleet|bench|attack)\b    # the server, the load test, the fleet search, benchmarks, the attack
  | -m\ tools\.(?:\w+\.)?(bench\w*|peer_bench|probe_closes)\b      # the benchmarks and probes
  | -m\ tools\.(?:checks|pages)\.(mutants|teach_check|second_lab|check_stubs|check_docs|blame)\b   # the checks
  | -m\ pytest(?!.*\s-m\s)(?!.*::)(?!.*\stests/[\w/]+\.py)   # the whole suite (one exercise or file finishes)
  | protocol\.MAX_CHOICES                      # docs/serving.md's measurement of the choice cap, to 200,000
""", re.X)

# What is not run, with why: a command holding one of these (a whole block, if its first command
# holds one marked "block"). Keep this short: a snippet that can run, runs.
NOT_RUN: tuple[tuple[str, str, str], ...] = (
    ("vllm", "block", "needs vLLM: a GPU, or its CPU build in a scratch venv (docs/performance.md section 8)"),
    ("~/models/", "command", "needs a GPT-2 checkpoint downloaded from Hugging Face (docs/checkpoints.md)"),
    ("hf download", "command", "needs the network: downloads a checkpoint from Hugging Face"),
    ("pip install", "command", "installs from PyPI: CI runs the set-up line once, in a fresh clone (.ci/run), and "
                               "packages outside the lab's (torch, transformers, lm_eval) never go into it"),
    ("lmeval-venv/bin/", "command", "needs lm_eval, torch and transformers, outside the lab's dependencies"),
    ("torchvenv/bin/", "command", "needs torch and transformers, outside the lab's dependencies"),
    ("peer_bench tokenizer", "command", "needs Hugging Face's tokenizers package, outside the lab's dependencies"),
    ("python bench_serving.py", "command", "needs SGLang's bench_serving.py and its packages (docs/serving.md)"),
    ("from transformers import", "command", "needs transformers, outside the lab's dependencies"),
    ("tools.pages.check_docs", "command", "this check itself"),
    ("../graded-copy", "block", "CI runs this flow for every half-way state: .ci/run unpacks and sets up the "
                                "autograder so, and tools/handout/half_way.py --graded submits each state's lab.py"),
    ("--vidur DIR", "command", "needs Vidur's profiling CSVs (a clone of microsoft/vidur); the lab ships no CSV"),
)

# A template's placeholder and the value a run gives it (`python lab.py hint N`).
PLACEHOLDERS = ((re.compile(r"\bexerciseN\b"), "exercise1"), (re.compile(r"(?<= )[NK](?=\s|$)"), "1"),
                (re.compile(r"(?<=--seed )S\b"), "7"))

PAGES = ("README.md", "docs/*.md")
PROGRAM = r"(?:python3?|curl|pip|hf|vllm|mkdir|cat|cd|bash|\.venv[\w-]*/bin/\w+|/tmp/[\w/.-]+)"
COMMAND = re.compile(rf"^(?:\$ )?(?:[A-Z][A-Z0-9_]*=\S*\s+)*{PROGRAM}(?:\s|$)")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
INLINE_COMMAND = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*(?:python3?|curl|\.venv[\w-]*/bin/python)\s")
SERVER = re.compile(r"\sserve\b")
BACKGROUND = re.compile(r"(?<!&)&[ \t]*(#.*)?$")  # `serve &   # a comment`
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


class Snippet(NamedTuple):
    page: str
    line: int
    kind: str  # "bash", "python" or "inline"
    commands: list[str]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def logical_commands(text: str) -> list[str]:
    """Shell text as its commands: `\\` continuations joined, a here-document kept with its
    command, a double-quoted string over several lines kept whole; comments and blanks dropped."""
    lines = text.split("\n")
    commands = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command = line
        while command.endswith("\\") and i < len(lines):
            command += "\n" + lines[i]
            i += 1
        while _open_quote(command) and i < len(lines):
            command += "\n" + lines[i]
            i += 1
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)", command)
        if heredoc:
            while i < len(lines):
                command += "\n" + lines[i]
                i += 1
                if lines[i - 1].strip() == heredoc.group(1):
                    break
        commands.append(command)
    return commands


def _open_quote(text: str) -> bool:
    """Whether a double-quoted string is still open (outside single quotes and comments)."""
    quote = None
    for j, ch in enumerate(text):
        if quote is None and ch == "#" and (j == 0 or text[j - 1] in " \t"):
            return False
        if ch == "\\" and quote != "'":
            continue
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote and not (ch == '"' and j and text[j - 1] == "\\"):
            quote = None
    return quote == '"'


def _command_block(body: str) -> list[str] | None:
    """An untagged or indented block's commands: `$ ` lines if it has any, else all of it when
    it opens with a command; None for a block of output."""
    lines = [line for line in body.split("\n") if line.strip()]
    if not lines:
        return None
    if any(line.startswith("$ ") for line in lines):
        return [line[2:] for line in lines if line.startswith("$ ")]
    return logical_commands(body) if COMMAND.match(lines[0]) else None


def snippets(root: Path = ROOT) -> list[Snippet]:
    """Every snippet of the pages under `root`, in page order."""
    return [snippet for path, text in pages(root).items() for snippet in snippets_of(path, text)]


def pages(root: Path = ROOT) -> dict[str, str]:
    """README.md and docs/*.md under `root`, by path relative to it."""
    found = sorted({p for pattern in PAGES for p in root.glob(pattern)})
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in found}


def snippets_of(page: str, text: str) -> list[Snippet]:
    """The snippets of one page's text, in order."""
    found: list[Snippet] = []
    blocks = []  # (start, end) of fenced and indented code: no inline commands there
    for m in FENCE.finditer(text):
        blocks.append(m.span())
        line = text.count("\n", 0, m.start()) + 1
        lang, body = m.group(1), m.group(2)
        if lang in ("bash", "sh", "shell", "console"):
            commands = _command_block(body) if lang == "console" else logical_commands(body)
            found.append(Snippet(page, line, "bash", commands))
        elif lang == "python":
            found.append(Snippet(page, line, "python", [body]))
        elif lang == "" and (commands := _command_block(body)):
            found.append(Snippet(page, line, "bash", commands))
    for m in re.finditer(r"(?:^[ \t]*\n)((?:(?: {4}|\t).*\n|[ \t]*\n)+)", text, re.M):
        if any(a <= m.start(1) < b for a, b in blocks) or _in_list(text, m.start(1)):
            continue
        body = re.sub(r"^(?: {4}|\t)", "", m.group(1), flags=re.M)
        if commands := _command_block(body):
            blocks.append(m.span(1))
            found.append(Snippet(page, text.count("\n", 0, m.start(1)) + 1, "bash", commands))
    inline: dict[int, list[str]] = {}  # the commands written on one line run as one snippet, in order
    for m in INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in blocks) or not INLINE_COMMAND.match(m.group(1)):
            continue
        inline.setdefault(text.count("\n", 0, m.start()) + 1, []).append(m.group(1))
    found += [Snippet(page, line, "inline", commands) for line, commands in inline.items()]
    found.sort(key=lambda s: s.line)
    return found


def _in_list(text: str, start: int) -> bool:
    """Whether an indented block at `start` continues a list item (then it is the item's text)."""
    before = text[:start].rstrip("\n").split("\n")
    for line in reversed(before):
        if not line.strip():
            continue
        return bool(re.match(r"\s*([-*]|\d+\.)\s", line)) or line.startswith((" ", "\t"))
    return False


def not_run(snippet: Snippet, command: str) -> str | None:
    """Why `command` of `snippet` is not run, or None."""
    for needle, scope, why in NOT_RUN:
        if needle in command or (scope == "block" and needle in snippet.commands[0]):
            return why
    return None


def incomplete(command: str) -> bool:
    """A command shown with `...` in place of its arguments: not runnable as written."""
    return any(re.search(r"(^|\s)\.\.\.(\s|$)", line.split(" #")[0]) for line in command.split("\n"))


def runnable(command: str) -> str:
    """The command with its placeholders given values (`hint N`: `hint 1`)."""
    for pattern, value in PLACEHOLDERS:
        command = pattern.sub(value, command)
    return command


# --- running -------------------------------------------------------------------------------------


# A command that works on the checkout's own lab.py (checks it, copies it, fills its stubs): its
# snippet runs on that lab, not the reference.
OWN_LAB = ("make_lab --check", "tools.handout.student_copy", "tools.checks.second_lab")


def scratch_checkout(root: Path, lab: Path, where: Path) -> Path:
    """A copy of the checkout at `where` (its git history linked), with lab.py a copy of `lab`.
    A copy, not links: a tool finds the checkout from its own path, and finds this one."""
    junk = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".hypothesis", "*.egg-info")
    shutil.copytree(root, where, ignore=junk)
    if (root / ".git").exists():
        (where / ".git").symlink_to(root / ".git")
    shutil.copyfile(lab, where / "lab.py")
    return where


# Where a command names a file it writes: an output option, or a shell redirection (in its first line,
# continuations joined: the rest of a here-document or a quoted script is not shell)
WRITES = re.compile(r"--(?:html|out|save-workload|grade)[ =](?P<option>[^\s;&|]+)"
                    r"|(?<![<>&\d])>\s*(?P<redirect>[^\s;&|]+)")


def written_files(command: str) -> list[str]:
    """The files a page's command names as what it writes."""
    shell = command.replace("\\\n", " ").split("\n")[0]
    return [found["option"] or found["redirect"] for found in WRITES.finditer(shell)]


def files_in(checkout: Path) -> set[str]:
    """Every file under `checkout`, relative (check_docs' own snippet file left out)."""
    return {str(path.relative_to(checkout)) for path in checkout.rglob("*")
            if path.is_file() and path.name != ".snippet.py"}


def unignored(checkout: Path, paths: set[str]) -> list[str]:
    """Those of `paths` that git, by the checkout's .gitignore, would list as untracked (none where
    the checkout is no git repository: a student's copy)."""
    if not paths or not (checkout / ".git").exists():
        return []
    ignored = subprocess.run(["git", "-C", str(checkout), "check-ignore", "--no-index", "--stdin"],
                             input="\n".join(sorted(paths)), capture_output=True, text=True).stdout.split("\n")
    return sorted(paths - set(ignored))


def _and_list(shell: str) -> list[str]:
    """A command's parts joined by `&&`, outside quotes (`make_it && cd it`: `make_it`, `cd it`)."""
    parts = []
    quote = None
    start = 0
    for j, ch in enumerate(shell):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif quote is None and shell.startswith("&&", j):
            parts.append(shell[start:j].strip())
            start = j + 2
    return [*parts, shell[start:].split(" #")[0].strip()]


def _ports(command: str) -> list[int]:
    ports = [int(p) for p in re.findall(r"--port[ =](\d+)", command)]
    return ports or ([8000] if re.search(r"\sserve\b", command) else [])


def snippet_ports(snippet: Snippet) -> set[int]:
    """The ports a snippet serves on (`--port N`; `serve` alone: 8000) or talks to (127.0.0.1:N)."""
    found: set[int] = set()
    for command in snippet.commands:
        found.update(p for p in _ports(command) if p)
        found.update(int(p) for p in re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", command))
    return found


def _wait_for_port(port: int, proc: subprocess.Popen, limit: float) -> bool:
    """Until `port` takes a connection (True), `proc` exits or `limit` seconds pass (False)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen) -> None:
    """Stop a command and everything it started: Ctrl-C first (a server says goodbye), then
    SIGKILL to every process of its session (each command runs in a session of its own)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(1)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    for pid in _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _session(sid: int) -> list[int]:
    """The processes of session `sid` (Linux's /proc; elsewhere the process group)."""
    if not os.path.isdir("/proc/self"):
        return [sid]
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
                found.append(int(entry))
    return found


STARTED: list[subprocess.Popen] = []  # every command started, stopped at the latest when run_all() ends
STOPPING = threading.Event()  # set when run_all() ends: no command starts after it


def _kill_sessions(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process of each command's session: what it started goes with it."""
    for proc in procs:
        for pid in _session(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Outcome(NamedTuple):
    snippet: Snippet
    command: str
    status: str  # "ok", "cut" (LONG, stopped at CUT_S), "not run", "FAIL"
    detail: str = ""
    seconds: float = 0.0


def run_snippet(snippet: Snippet, cwd: Path, env: dict[str, str], seen: dict | None = None) -> list[Outcome]:
    """Run one snippet's commands in order in `cwd`; background ones are stopped at its end.
    `seen`: where each command that ran alone (no cd, export or server before it) passed; such a
    command shown again is not run again."""
    outcomes: list[Outcome] = []
    background: list[subprocess.Popen] = []
    started: list[subprocess.Popen] = []
    state: list[str] = []  # the block's `cd DIR` and `export VAR=...` so far: each command runs after them
    logs: list = []  # each command's output in a file of its own (a background server writes on)
    try:
        for i, command in enumerate(snippet.commands):
            if STOPPING.is_set():
                break
            why = not_run(snippet, command)
            if why:
                outcomes.append(Outcome(snippet, command, "not run", why))
                continue
            if incomplete(command):
                outcomes.append(Outcome(snippet, command, "FAIL", "not complete as written: `...` for its arguments"))
                break
            shell = runnable(command)
            in_background = _runs_in_background(snippet, i, shell)
            alone = seen is not None and snippet.kind != "python" and not (state or background or in_background)
            key = _seen_key(shell, cwd)
            if alone and key in seen:
                outcomes.append(Outcome(snippet, command, "same", f"as at {seen[key]}"))
                continue
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            start = time.monotonic()
            proc = subprocess.Popen(_argv(snippet, command, shell, state, in_background, cwd), cwd=cwd, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            started.append(proc)
            STARTED.append(proc)
            if in_background:
                background.append(proc)
            outcomes.append((_served if in_background else _waited)(snippet, command, shell, proc, log, start))
            if outcomes[-1].status == "FAIL":
                break
            if alone:
                seen[key] = snippet.where
            if outcomes[-1].status == "ok" and not in_background:
                state += [part for part in _and_list(shell) if re.match(r"(cd|export)\s", part)]
    finally:
        for proc in background:
            _stop(proc)
        _kill_sessions(started)  # what a finished command left running (a server's child) goes too
        for log in logs:
            log.close()
    return outcomes


def _runs_in_background(snippet: Snippet, i: int, shell: str) -> bool:
    """`serve &`, or a server that a later command of its snippet talks to: started, and its port
    waited for."""
    return snippet.kind != "python" and bool(BACKGROUND.search(shell) or (
        SERVER.search(shell) and any(f":{port}" in later for port in _ports(shell)
                                     for later in snippet.commands[i + 1:])))


def _seen_key(shell: str, cwd: Path) -> tuple:
    """A command as run_snippet's `seen` knows it: its text, and whether lab.py is the reference."""
    lab_is_reference = ((cwd / "lab.py").read_bytes() == (cwd / "solution.py").read_bytes()
                        if (cwd / "solution.py").exists() else None)
    return shell.split(" #")[0].strip(), lab_is_reference


def _argv(snippet: Snippet, command: str, shell: str, state: list[str], in_background: bool, cwd: Path) -> list[str]:
    """The process that runs a command: a Python snippet from a file, a shell command after the
    block's `cd` and `export` so far."""
    if snippet.kind == "python":
        script = cwd / ".snippet.py"
        script.write_text(command)
        return [sys.executable, str(script)]
    return ["bash", "-c", " && ".join([*state, BACKGROUND.sub("", shell) if in_background else shell])]


def _served(snippet: Snippet, command: str, shell: str, proc: subprocess.Popen, log, start: float) -> Outcome:
    """A command started in the background: it must open its port (if it names one) in FINISH_S."""
    ports = _ports(shell)
    if ports and not _wait_for_port(ports[0], proc, FINISH_S):
        return Outcome(snippet, command, "FAIL", f"never opened port {ports[0]}: " + _tail(log),
                       time.monotonic() - start)
    return Outcome(snippet, command, "ok", "in the background", time.monotonic() - start)


def _waited(snippet: Snippet, command: str, shell: str, proc: subprocess.Popen, log, start: float) -> Outcome:
    """A command in the foreground: it must exit 0 within FINISH_S, or (LONG) not fail within CUT_S,
    when it is stopped."""
    long = bool(LONG.search(" " + shell))
    try:
        rc = proc.wait(CUT_S if long else FINISH_S)
    except subprocess.TimeoutExpired:
        _stop(proc)
        seconds = time.monotonic() - start
        if long:
            return Outcome(snippet, command, "cut", f"ran {seconds:.0f} s, stopped", seconds)
        return Outcome(snippet, command, "FAIL", f"still running after {FINISH_S:.0f} s "
                       "(if it runs for minutes by design, LONG must say so): " + _tail(log), seconds)
    seconds = time.monotonic() - start
    if rc != 0:
        return Outcome(snippet, command, "FAIL", f"exit status {rc}: " + _tail(log), seconds)
    return Outcome(snippet, command, "ok", "", seconds)


def _tail(log, lines: int = 12) -> str:
    log.flush()
    log.seek(0)
    return "\n      ".join(log.read().rstrip().split("\n")[-lines:])


def environment(scratch: Path) -> dict[str, str]:
    """The set-up's environment (this interpreter's venv first on PATH), importing from `scratch`."""
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1", HYPOTHESIS_PROFILE="ci")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("LAB_MODULE", None)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run every command that README.md and docs/ show")
    parser.add_argument("--copy", type=Path, metavar="DIR", help="a student's copy to check instead of this checkout")
    parser.add_argument("--lab", type=Path, default=ROOT / "solution.py",
                        help="the lab.py the commands run on (default: the reference, every exercise written)")
    parser.add_argument("--list", action="store_true", help="list the snippets and what is not run; run nothing")
    parser.add_argument("--jobs", type=int, default=6, help="snippets run at once (default 6)")
    parser.add_argument("-k", metavar="WORD", help="only the snippets whose page or text contains WORD")
    args = parser.parse_args(argv)
    # Stop on Ctrl-C and on SIGTERM, even when started with SIGINT ignored (`... &` from a script),
    # and stop what it started (run_all's finally).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    root = (args.copy or ROOT).resolve()
    found = [s for s in snippets(root) if not args.k or args.k in s.page or any(args.k in c for c in s.commands)]
    if args.list:
        for snippet in found:
            for command in snippet.commands:
                why = not_run(snippet, command)
                first = command.split("\n")[0]
                print(f"{snippet.where:24} {'not run: ' + why if why else 'runs'}: {first}")
        return 0
    total_start = time.monotonic()
    unique = []  # inline commands shown on several pages run once
    done = set()
    for snippet in found:
        if snippet.kind == "inline":
            if tuple(snippet.commands) in done:
                continue
            done.add(tuple(snippet.commands))
        unique.append(snippet)
    counts, failed = run_all(unique, root, args.lab.resolve(), args.jobs)
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    print(f"{len(unique)} snippets of {root.name}: {summary}, in {time.monotonic() - total_start:.0f} s "
          f"(cut: a server or benchmark checked for {CUT_S:.0f} s, then stopped)")
    for outcome in failed:
        print(f"FAILED {outcome.snippet.where}: {outcome.command.split(chr(10))[0]}\n      {outcome.detail}")
    return 1 if failed else 0


def run_all(unique: list[Snippet], root: Path, lab: Path, jobs: int) -> tuple[dict[str, int], list[Outcome]]:
    """Run the snippets, `jobs` at a time, each in a scratch checkout of `root` of its own (with
    lab.py a copy of `lab`, or the checkout's own for OWN_LAB), printing each outcome as it comes;
    (the count of each status, the failures)."""
    counts: dict[str, int] = {}
    failed: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="check_docs-") as tmp:
        ports: dict[int, threading.Lock] = {}
        seen: dict = {}  # a command shown again runs once (run_snippet)
        guard = threading.Lock()

        def run(snippet: Snippet) -> list[Outcome]:
            with guard:  # a snippet holds the ports it serves on or talks to while it runs
                locks = [ports.setdefault(p, threading.Lock()) for p in sorted(snippet_ports(snippet))]
            for lock in locks:
                lock.acquire()
            try:  # each snippet in a scratch checkout of its own: `../lab-handout` is its own too
                where = Path(tmp) / str(unique.index(snippet)) / "checkout"
                own = any(needle in c for needle in OWN_LAB for c in snippet.commands)
                scratch = scratch_checkout(root, root / "lab.py" if own else lab, where)
                before = files_in(scratch)
                outcomes = run_snippet(snippet, scratch, environment(scratch), seen)
                left = unignored(scratch, files_in(scratch) - before)
                if left:
                    outcomes.append(Outcome(snippet, snippet.commands[-1], "FAIL",
                                            f"left {', '.join(left)} in the checkout, and git does not ignore "
                                            "it: write into an ignored folder, or name it in .gitignore"))
                return outcomes
            finally:
                for lock in locks:
                    lock.release()

        pool = ThreadPoolExecutor(jobs)
        try:
            for outcomes in pool.map(run, unique):
                for outcome in outcomes:
                    counts[outcome.status] = counts.get(outcome.status, 0) + 1
                    first = outcome.command.split("\n")[0][:100]
                    print(f"{outcome.status:7} {outcome.seconds:5.1f} s  {outcome.snippet.where:24} {first}"
                          + (f"\n      {outcome.detail}" if outcome.status in ("FAIL", "not run") else ""),
                          flush=True)
                    if outcome.status == "FAIL":
                        failed.append(outcome)
        finally:  # Ctrl-C included: no command starts after this, and none started stays behind
            STOPPING.set()
            pool.shutdown(wait=False, cancel_futures=True)
            _kill_sessions(STARTED)
    return counts, failed


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # what it started is stopped already
        sys.exit("check_docs: interrupted")
