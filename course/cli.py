"""The command line (vLLM: `vllm/entrypoints/cli/main.py`): `python solution.py ARGS` and
`python lab.py ARGS` are `main(<that module>, ARGS)`, so every command runs the module it came from.
With no command it prints the four design-review scenarios (the main job). The commands, each with
its arguments beside what it runs, are in commands.py; the types their arguments take, arguments.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from types import ModuleType

from .arguments import Parser
from .commands import COMMANDS, Run, scenarios
from .hints import HintsError
from .pages.trace_workloads import WORKLOADS
from .quiz.questions import QuizError


def build_parser(lab: ModuleType, prog: str) -> argparse.ArgumentParser:
    """The parser of every command (commands.py's COMMANDS), for the module `lab` run as `prog`."""
    parser = Parser(prog=prog, description="The design-review scenarios of the inference-serving lab. "
                                           "With no command: all four scenarios in order.")
    commands = parser.add_subparsers(dest="command", parser_class=Parser)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.description)
        if command.arguments is not None:
            command.arguments(sub, lab, prog)
    return parser


def run_benchmarks(prog: str, argv: list[str]) -> int:
    """`python solution.py bench ...` is `python -m tools.bench ... --module solution`, run from the
    repository's root: the benchmarks import the module they measure, never the other way round."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.call([sys.executable, "-m", "tools.bench", *argv, "--module", os.path.splitext(prog)[0]],
                           cwd=root)


# `serve` runs OpenBLAS on one thread (`python -m tools.bench blas-threads`: on two cores a second BLAS
# thread waits for the core the HTTP loop and the clients need, and decode steps got 1.6-2.4x
# slower), and so does `attack`, which times a server. OpenBLAS reads the variable once, when
# NumPy loads, so the command re-executes itself with it set; a value the user set wins.
SERVE_BLAS_THREADS = "1"


def _serve_with_one_blas_thread(argv: list[str]) -> None:
    if argv[:1] in (["serve"], ["attack"]) and "OPENBLAS_NUM_THREADS" not in os.environ:
        env = dict(os.environ, OPENBLAS_NUM_THREADS=SERVE_BLAS_THREADS)
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _reference_trace(lab: ModuleType, workload: str) -> str:
    """Where a stuck student sees the run `trace` could not record, on a correct engine: the student's
    copy ships each workload's page (docs/reference-traces/); the maintainers' checkout records it
    from the reference on demand."""
    recorded = workload if workload in WORKLOADS else "skewed"
    here = os.path.dirname(os.path.abspath(lab.__file__))
    page = os.path.join("docs", "reference-traces", f"{recorded}.html")
    if os.path.exists(os.path.join(here, page)):
        return f"{page} is that run on a correct engine"
    if os.path.exists(os.path.join(here, "solution.py")):
        return (f"`python solution.py trace --workload {recorded}` records that run on the reference engine "
                f"(solution-trace.html)")
    return f"{page} in the student's copy is that run on a correct engine"


def main(lab: ModuleType, argv: list[str] | None = None) -> int:
    """The command line for the module `lab`; returns the exit status. Called as a script
    (`argv` None), `serve` and `attack` first re-execute themselves with OPENBLAS_NUM_THREADS=1 unless it is set."""
    prog = os.path.basename(lab.__file__)
    if argv is None:
        _serve_with_one_blas_thread(sys.argv[1:])
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return run_benchmarks(prog, argv[1:])
    parser = build_parser(lab, prog)
    args = parser.parse_args(argv)
    try:
        run = scenarios if args.command is None else COMMANDS[args.command].run
        return run(lab, args, Run(prog, parser)) or 0
    except (HintsError, QuizError) as exc:
        parser.exit(1, f"{prog} {args.command}: error: {exc}\n")
    except ValueError as exc:
        parser.exit(2, f"{prog} {args.command or ''}: error: {exc}\n".replace("  ", " "))
    except OSError as exc:  # the network said no: a port in use, a server that is not there
        where = args.url if args.command == "loadtest" else f"{getattr(args, 'host', '')}:{getattr(args, 'port', '')}"
        parser.exit(2, f"{prog} {args.command}: error: {where}: {exc}\n")
    except NotImplementedError as exc:
        if args.command == "quiz":  # the quiz's answers come from the module: the stub must be written first
            parser.exit(1, f"{prog} quiz {args.exercise}: {exc} is still a stub: write it first, the quiz's answers "
                           f"come from it (see `python {prog} status`)\n")
        if args.command == "trace":
            parser.exit(1, f"{prog}: {exc} is still a stub: write it (see `python {prog} status`); meanwhile "
                           f"{_reference_trace(lab, args.workload)}\n")
        parser.exit(1, f"{prog}: {exc} is still a stub: write it (see `python {prog} status`)\n")
