"""The command line (vLLM: `vllm/entrypoints/cli/main.py`): `python solution.py ARGS` and
`python lab.py ARGS` are `main(<that module>, ARGS)`, so every command runs the module it came from.
With no command it prints the four design-review scenarios (the main job).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import subprocess
import sys
from types import ModuleType
from typing import NamedTuple

from checkpoints.commands import checkpoint_engine, generate_text, speculate_checkpoints
from loadtest.benchmark_serving import loadtest, server_model_card
from loadtest.costmodel import CPU_OVERHEAD_S
from loadtest.datasets import LOAD_WORKLOADS
from serving.api_server import APIKeys, read_api_keys_file, serve

from .attack import AttackQuestion, run_attack
from .fleet import SLO, FleetQuestion, NoCandidateMeets, run_fleet
from .fleet_page import fleet_page
from .hints import LEVELS, HintsError, show_hint
from .quiz import QuizError, run_quiz
from .report import load_report_html, write_report
from .scenarios import run_all_scenarios, scenario_batching, scenario_speculate
from .sizing import SEED_SIZING, scenario_size
from .stacks import scenario_stack
from .status import status_report, unsolved_exercises  # noqa: F401 - unsolved_exercises: the course's one home
from .trace import WORKLOADS, write_trace

# The model `python solution.py serve` runs by default: the lab's GPT-2 with room for ShareGPT-
# like requests (prompt + output <= 512 tokens).
SERVE_MODEL = dict(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `solution.py size: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(kind, allow_zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with allow_zero); inf and nan are refused."""
    def parse(text: str):
        value = kind(text)
        if not (0 <= value if allow_zero else 0 < value) or not value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _exercise(lab: ModuleType):
    """An argparse type: the number of one of the module's exercises."""
    known = sorted(lab.EXERCISES)
    span = f"{known[0]} to {known[-1]}" if known == list(range(known[0], known[-1] + 1)) else ", ".join(map(str, known))

    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an exercise number (the exercises are {span})") from None
        if number not in lab.EXERCISES:
            raise argparse.ArgumentTypeError(f"there is no exercise {number} (the exercises are {span})")
        return number
    parse.__name__ = "exercise"
    return parse


def _level(text: str) -> int:
    """An argparse type: a hint level, 1 to LEVELS."""
    if not (text.strip().isdigit() and 1 <= int(text) <= LEVELS):
        raise argparse.ArgumentTypeError(f"the levels are 1 to {LEVELS}, got {text!r}")
    return int(text)


QUIZ_HELP = ("Questions with numeric answers about exercise N, with figures drawn fresh each run: type each "
             "answer (a number; 2/3 is fine), and after each attempt the quiz shows the right value and why. "
             "The right values are computed by THIS module's own code, your exercises included, when the quiz "
             "asks: a wrong function gives a wrong 'right answer'. The quiz checks your understanding, not your "
             "code: the tests do that (python -m pytest -m exerciseN). A function the quiz needs that is still "
             "a stub stops it (exit status 1), naming the function.")


def _rates(text: str) -> list[float]:
    """`--qps 1,2,4` (inf: all at once)."""
    rates = [float(r) for r in text.split(",")]
    if not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every rate must be > 0, got {text}")
    return rates


def _names(presets: dict, what: str):
    """An argparse type: one preset name or several, comma-separated; an unknown one lists the known."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(","))
        for name in names:
            if name not in presets:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; known: {', '.join(presets)}")
        return names
    parse.__name__ = what
    return parse


def _prices(text: str) -> tuple[float, ...]:
    """`--usd-per-gpu-hour 2` or `2,4`: finite prices > 0."""
    return tuple(_positive(float)(p) for p in text.split(","))


CPU_OVERHEAD_HELP = (f"the engine's CPU time per step in the measured cost (default {CPU_OVERHEAD_S * 1e3:g}: vLLM's "
                     "synchronous loop; 0: an engine that overlaps it with the GPU)")


def build_parser(lab: ModuleType, prog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="The design-review scenarios of the inference-serving lab. "
                                            "With no command: all four scenarios in order.")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    size = commands.add_parser("size", help="size a deployment: KV blocks, concurrency, QPS, KV waste")
    # choices: an unknown name is a usage error that lists the known ones, before any exercise runs.
    size.add_argument("--model", default=SEED_SIZING["model"], choices=list(lab.MODELS))
    size.add_argument("--gpu", default=SEED_SIZING["gpu"], choices=list(lab.GPUS))
    size.add_argument("--max-model-len", type=_positive(int), default=SEED_SIZING["max_model_len"])
    size.add_argument("--block-size", type=_positive(int), default=16)
    size.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.9)
    size.add_argument("--activation-gb", type=_positive(float, allow_zero=True), default=0.0,
                      help="per-GPU activation reserve, GB")
    size.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel GPUs")
    size.add_argument("--prompt-len", type=_positive(float), help="mean prompt tokens (default: ShareGPT)")
    size.add_argument("--output-len", type=_positive(float), help="mean output tokens (default: ShareGPT)")
    size.add_argument("--kv-cache-dtype", choices=list(lab.PLAN_KV_CACHE_DTYPES), default="auto",
                      help="KV-cache element type: auto (the model's), fp8 or int8 (1 byte)")
    size.add_argument("--usd-per-gpu-hour", type=_positive(float), help="GPU price: prints the cost per 1M tokens")
    size.add_argument("--cpu-overhead-ms", type=_positive(float, allow_zero=True), help=CPU_OVERHEAD_HELP)
    fleet = commands.add_parser("fleet", help="the cheapest deployment meeting p99 TTFT and TPOT targets at a rate",
                                description="Search GPU presets, tensor parallelism, max_num_seqs, the token "
                                            "budget and prefill/decode disaggregation in the simulator, with this "
                                            "module's Scheduler: the largest rate per replica meeting both p99 "
                                            "targets, then replicas, GPUs and $ per 1M output tokens.")
    fleet.add_argument("--model", default=SEED_SIZING["model"], choices=list(lab.MODELS))
    fleet.add_argument("--gpu", type=_names(lab.GPUS, "GPU"), default=(SEED_SIZING["gpu"],),
                       help="a GPU preset, or several: a100-80gb,h100-80gb")
    fleet.add_argument("--qps", type=_positive(float), default=100.0, help="requests per second to serve")
    fleet.add_argument("--p99-ttft-ms", type=_positive(float), default=200.0)
    fleet.add_argument("--p99-tpot-ms", type=_positive(float), default=50.0)
    fleet.add_argument("--workload", choices=[w for w in LOAD_WORKLOADS if w != "tiny"], default="sharegpt")
    fleet.add_argument("--usd-per-gpu-hour", type=_prices, default=(2.0,),
                       help="one price, or one per --gpu (2,4); an example price, not a quote")
    fleet.add_argument("--max-model-len", type=_positive(int), default=2048,
                       help="requests longer are cut, as vLLM's benchmark filters ShareGPT (default 2048)")
    fleet.add_argument("--num-requests", type=_positive(int), default=FleetQuestion.num_requests,
                       help="simulated requests per rate tried: more is slower and finds rarer queues")
    fleet.add_argument("--kv-link-gb-per-s", type=_positive(float), default=25.0,
                       help="prefill -> decode K/V link per GPU, GB/s (default: 200 Gb/s InfiniBand)")
    fleet.add_argument("--no-disaggregation", action="store_true", help="leave out the prefill/decode pools")
    fleet.add_argument("--cpu-overhead-ms", type=_positive(float, allow_zero=True), help=CPU_OVERHEAD_HELP)
    fleet.add_argument("--jobs", type=_positive(int), default=min(2, os.cpu_count() or 1),
                       help="searches at once, in forked processes (default: 2, or 1 on one core)")
    fleet.add_argument("--seed", type=_positive(int, allow_zero=True), default=0)
    fleet.add_argument("--html", metavar="FILE", help="also draw goodput against offered rate for the pick and the "
                                                      "runner-up (more simulated runs: about a minute more)")
    batching = commands.add_parser("batching", help="static vs continuous batching: a skewed workload, then a stream")
    batching.add_argument("--slots", type=_positive(int), default=16)
    batching.add_argument("--long", type=_positive(int), default=2000, help="tokens of the long answer")
    batching.add_argument("--short", type=_positive(int), default=50, help="tokens of each short answer")
    batching.add_argument("--num-short", type=_positive(int), default=63)
    speculate = commands.add_parser("speculate", help="expected speedup of speculative decoding")
    speculate.add_argument("--alpha", type=float, help="acceptance rate of your draft, 0..1")
    speculate.add_argument("--k", type=_positive(int), help="draft tokens per step (default: the best)")
    speculate.add_argument("--c", type=_positive(float, allow_zero=True), default=0.05,
                           help="draft step cost / target step cost")
    speculate.add_argument("--target", metavar="DIR", help="a GPT-2 checkpoint directory: measure on real text")
    speculate.add_argument("--draft", metavar="DIR", help="its draft, sharing the tokenizer (e.g. distilgpt2)")
    speculate.add_argument("--prompt", help="the text to continue (with --target/--draft)")
    speculate.add_argument("--max-tokens", type=_positive(int), default=64, help="with --target/--draft")
    speculate.add_argument("--temperature", type=_positive(float, allow_zero=True), default=0.0,
                           help="with --target/--draft")
    generate = commands.add_parser("generate", help="continue a prompt with a GPT-2 checkpoint from disk")
    generate.add_argument("--model", metavar="DIR", required=True, help="config.json, model.safetensors, vocab.json, "
                                                                       "merges.txt")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=_positive(int), default=32)
    generate.add_argument("--temperature", type=_positive(float, allow_zero=True), default=0.0)
    generate.add_argument("--seed", type=int, default=0)
    stack = commands.add_parser("stack", help="vLLM vs TensorRT-LLM vs SGLang")
    stack.add_argument("--hardware", help="the fleet, e.g. nvidia, amd")
    stack.add_argument("--priority", choices=("throughput", "latency"), default="throughput")
    stack.add_argument("--prefix-sharing", action="store_true", help="heavy shared prefixes")
    stack.add_argument("--structured-output", action="store_true", help="JSON / regex constrained output")
    # Listed for --help only: main() hands `bench ...` to tools/bench.py before parsing.
    commands.add_parser("bench", help="measure on this machine, side by side (tools/bench.py; bench --help)")
    commands.add_parser("status", help="which exercises are done")
    hint = commands.add_parser("hint", help="the next of three hints for exercise N (docs/hints.md)",
                               description="The next hint for exercise N: a nudge, then the idea, then the "
                                           "method. Which levels you have seen is kept in .hints.json beside "
                                           "the module.")
    hint.add_argument("exercise", metavar="N", type=_exercise(lab), help="the exercise's number")
    hint.add_argument("--level", metavar="K", type=_level, help=f"show level K (1 to {LEVELS}) directly; "
                                                                 "it does not change which hint comes next")
    quiz = commands.add_parser("quiz", help="questions with numbers about exercise N, answered by this module's code",
                               description=QUIZ_HELP)
    quiz.add_argument("exercise", metavar="N", type=_exercise(lab), help="the exercise's number")
    quiz.add_argument("--seed", type=_positive(int, allow_zero=True),
                      help="repeat the figures of an earlier run (default: fresh ones)")
    serve = commands.add_parser("serve", help="serve a toy model over HTTP, OpenAI-compatible, until Ctrl-C")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port")
    serve.add_argument("--duration", type=_positive(float), help="stop after this many seconds")
    serve.add_argument("--model", metavar="DIR", help="a GPT-2 checkpoint directory to serve with its tokenizer "
                                                     "(default: a toy model with random weights, bytes as tokens)")
    for name, value in SERVE_MODEL.items():
        serve.add_argument(f"--{name.replace('_', '-')}", type=_positive(int), default=value, help="model")
    serve.add_argument("--seed", type=int, default=0, help="of the model's random weights")
    serve.add_argument("--block-size", type=_positive(int), default=16)
    serve.add_argument("--num-blocks", type=_positive(int), help="KV blocks (default: max-num-seqs full sequences)")
    serve.add_argument("--max-num-seqs", type=_positive(int),
                       help="running sequences (default: 64 for a toy model, 4 for a --model checkpoint, whose "
                            "full-length K/V is 302 MB a sequence for GPT-2 small)")
    serve.add_argument("--stream-interval", type=_positive(int), default=1,
                       help="tokens per streamed chunk (SGLang's flag): fewer, larger events for more throughput")
    serve.add_argument("--max-num-batched-tokens", type=_positive(int), default=512)
    serve.add_argument("--no-chunked-prefill", action="store_true")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the K/V of cached prompt blocks (on by default, as in vLLM V1); the samples of "
                            "n share their prompt's blocks only with it on")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the model names clients may use (the first is the one answered with); default: the "
                            "checkpoint directory's name, or one made of the toy model's shape")
    serve.add_argument("--max-n", type=_positive(int),
                       help="the largest n of one request, and how many of its choices (prompts x n) run at once "
                            "(default: half of --max-num-seqs)")
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                      help="require one of these keys in `Authorization: Bearer KEY` (vLLM's flag; repeat it or "
                           "list several); each key is a tenant of its own, with a prefix cache of its own")
    keys.add_argument("--api-keys-file", metavar="FILE",
                      help='a JSON object {"key": "tenant", ...}: keys of one tenant share its prefix cache, '
                           "tenants share none (docs/serving.md#keys-and-tenants)")
    load = commands.add_parser("loadtest", help="open-loop load test of any OpenAI-compatible server")
    load.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    load.add_argument("--qps", type=_rates, default=[1.0, 2.0, 4.0], help="offered req/s: 1,2,4 (inf: all at once)")
    load.add_argument("--num-prompts", type=_positive(int), default=50, help="requests per rate")
    load.add_argument("--workload", choices=list(LOAD_WORKLOADS), default="sharegpt")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--prompt-format", choices=("token-ids", "text"), default="token-ids",
                      help="text for servers with a real tokenizer (vLLM)")
    load.add_argument("--model", help="default: the first model of /v1/models")
    load.add_argument("--max-model-len", type=_positive(int), help="default: from /v1/models, else 2048")
    load.add_argument("--slo-ttft-ms", type=_positive(float))
    load.add_argument("--slo-tpot-ms", type=_positive(float))
    load.add_argument("--save-workload", metavar="FILE", help="write the requests as JSONL for vllm bench serve")
    load.add_argument("--timeout", type=_positive(float), default=300.0, help="seconds per request")
    load.add_argument("--html", metavar="FILE", help="also draw latency against load as a self-contained HTML page")
    attack = commands.add_parser("attack", help="the prefix cache's timing side channel, measured on this module's "
                                                "engine: one shared cache against per-tenant salts",
                                 description="A victim sends a secret system prompt; an attacker guesses prefixes and "
                                             "times the first token, on two servers of this module's engine side by "
                                             "side (one shared cache; per-tenant salts from API keys). Prints the "
                                             "attacker's ROC AUC, its block-by-block recovery of the secret, and what "
                                             "salting costs in prefix hits and prefill tokens (docs/serving.md).")
    attack.add_argument("kind", choices=["prefix-cache"], help="the channel to measure")
    defaults = AttackQuestion()
    attack.add_argument("--trials", type=_positive(int), default=defaults.trials,
                        help=f"correct and wrong guesses timed on each server, each (default {defaults.trials})")
    attack.add_argument("--secrets", type=_positive(int), default=defaults.secrets,
                        help=f"secret prompts recovered block by block (default {defaults.secrets})")
    attack.add_argument("--candidates", type=_positive(int), default=defaults.candidates,
                        help=f"the attacker's candidates for each block, the true one among them (default "
                             f"{defaults.candidates})")
    attack.add_argument("--seed", type=_positive(int, allow_zero=True), default=defaults.seed)
    # Each page's default name carries the module's: lab.py's page never overwrites solution.py's.
    module = os.path.splitext(prog)[0]
    report = commands.add_parser("report", help="one HTML file of pictures drawn from runs of this module's code")
    report.add_argument("--out", default=f"{module}-report.html",
                        help=f"the file to write (default: {module}-report.html here)")
    trace = commands.add_parser("trace", help="one HTML page that steps through a run of this module's engine: "
                                              "the queues, the block pool, the block tables")
    trace.add_argument("--workload", default="skewed", metavar="NAME|FILE",
                       help=f"{', '.join(WORKLOADS)} (default: skewed), or a file that `loadtest --save-workload` "
                            "wrote")
    trace.add_argument("--out", default=f"{module}-trace.html",
                       help=f"the file to write (default: {module}-trace.html here)")
    return parser


def run_benchmarks(prog: str, argv: list[str]) -> int:
    """`python solution.py bench ...` is `python tools/bench.py ... --module solution`: the
    benchmarks import the module they measure, never the other way round."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench.py")
    return subprocess.call([sys.executable, bench, *argv, "--module", os.path.splitext(prog)[0]])


# `serve` runs OpenBLAS on one thread (tools/bench.py blas-threads: on two cores a second BLAS
# thread waits for the core the HTTP loop and the clients need, and decode steps got 1.6-2.4x
# slower), and so does `attack`, which times a server. OpenBLAS reads the variable once, when
# NumPy loads, so the command re-executes itself with it set; a value the user set wins.
SERVE_BLAS_THREADS = "1"


def _serve_with_one_blas_thread(argv: list[str]) -> None:
    if argv[:1] in (["serve"], ["attack"]) and "OPENBLAS_NUM_THREADS" not in os.environ:
        env = dict(os.environ, OPENBLAS_NUM_THREADS=SERVE_BLAS_THREADS)
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


class Run(NamedTuple):
    """What every command is handed besides the module and its arguments."""

    prog: str  # lab.py or solution.py, as the user typed it
    parser: argparse.ArgumentParser  # its exit() prints one line and sets the status


def _scenarios(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """No command: the four design reviews (the main job), naming the first stub they need."""
    text, stubs = run_all_scenarios(lab)
    print(text)
    if stubs:  # name the first exercise to write, not the first scenario that needed one
        raise NotImplementedError(min(stubs, key=lambda stub: int(re.search(r"\d+", stub).group())))


def _size(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`size`: one deployment sized by the module's plan_deployment."""
    print(scenario_size(lab, args.model, args.gpu, args.max_model_len, args.block_size,
                        args.gpu_memory_utilization, args.activation_gb, args.tp, args.prompt_len,
                        args.output_len, args.kv_cache_dtype, args.usd_per_gpu_hour,
                        None if args.cpu_overhead_ms is None else args.cpu_overhead_ms / 1e3))


def _fleet(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`fleet`: the cheapest deployment meeting both p99 targets."""
    slo = SLO(args.p99_ttft_ms / 1e3, args.p99_tpot_ms / 1e3)
    question = FleetQuestion(args.model, args.gpu, args.qps, slo, args.workload, args.usd_per_gpu_hour,
                             args.max_model_len, args.num_requests, args.seed,
                             args.kv_link_gb_per_s * 1e9, not args.no_disaggregation,
                             None if args.cpu_overhead_ms is None else args.cpu_overhead_ms / 1e3)
    try:
        answer = run_fleet(lab, question, args.jobs, log=lambda line: print(line, flush=True))
    except NoCandidateMeets as exc:
        print(exc.table)
        run.parser.exit(2, f"{run.prog} fleet: error: {exc}\n")
    print(answer.text)
    if args.html:
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(fleet_page(lab, question, answer))
        print(f"wrote {os.path.abspath(args.html)}")


def _batching(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`batching`: continuous against static batching, simulated."""
    print(scenario_batching(lab, args.slots, args.long, args.short, args.num_short))


def _speculate(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`speculate`: the speedup algebra on the module; with --target and --draft, measured on checkpoints."""
    if args.target or args.draft:
        if not (args.target and args.draft):
            run.parser.exit(2, f"{run.prog} speculate: error: --target and --draft go together\n")
        extra = {"prompt": args.prompt} if args.prompt else {}
        print(speculate_checkpoints(lab, args.target, args.draft, k=args.k or 4, max_tokens=args.max_tokens,
                                    temperature=args.temperature, **extra))
        return 0
    print(scenario_speculate(lab, args.alpha, args.k, args.c))


def _generate(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`generate`: text from a checkpoint."""
    print(generate_text(lab, args.model, args.prompt, args.max_tokens, args.temperature, args.seed))


def _stack(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`stack`: vLLM, TensorRT-LLM or SGLang for a workload."""
    print(scenario_stack(lab, args.hardware, args.priority, args.prefix_sharing, args.structured_output))


def _serve(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`serve`: the OpenAI server on a port."""
    if args.api_keys_file:  # read first: a bad file is exit status 2 before any model loads
        api_keys = read_api_keys_file(args.api_keys_file)
    else:  # --api-key: each key its own tenant (vLLM's keys have no tenants; here each is kept apart)
        api_keys = {key: f"api-key-{i}" for i, key in enumerate(dict.fromkeys(args.api_key or ()), 1)} or None
        if api_keys:
            APIKeys(api_keys)  # checked now: a key no header can carry is exit status 2 before any model loads
    options = dict(num_blocks=args.num_blocks, block_size=args.block_size,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=args.enable_prefix_caching,
                   enable_chunked_prefill=not args.no_chunked_prefill)
    if args.model:  # max_model_len is the checkpoint's n_positions; the KV-cache fits max_num_seqs of them
        engine, tokenizer = checkpoint_engine(lab, args.model, args.max_num_seqs or 4, **options)
        # The directory's name, and the --model string as given (vLLM's name for it)
        names = args.served_model_name or list(dict.fromkeys([os.path.basename(os.path.normpath(args.model)),
                                                              args.model]))
    else:
        model = lab.ToyTransformer(lab.ModelConfig(**{k: getattr(args, k) for k in SERVE_MODEL}),
                                   seed=args.seed)
        engine = lab.LLMEngine(model, max_num_seqs=args.max_num_seqs or 64,
                               **options)
        tokenizer, names = None, args.served_model_name
    # Garbled text is what random weights write: say so before a client sees it.
    note = None if args.model else (f"the model's weights are random (--seed {args.seed}), so its text is "
                                    "noise; --model DIR serves a GPT-2 checkpoint (docs/checkpoints.md)")
    if not serve(engine, args.host, args.port, args.duration, note=note, tokenizer=tokenizer,
                 model_name=names, stream_interval=args.stream_interval, max_n=args.max_n, api_keys=api_keys):
        run.parser.exit(1, f"{run.prog} serve: error: the server's HTTP front end stopped, so the server did\n")


def _loadtest(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`loadtest`: an open-loop load test of any OpenAI server."""
    summaries = loadtest(lab, args.url, args.qps, args.num_prompts, args.workload, args.seed,
                         args.prompt_format, args.model, args.max_model_len, args.slo_ttft_ms,
                         args.slo_tpot_ms, args.save_workload, args.timeout)
    if args.html:
        model = args.model or server_model_card(args.url)["id"]
        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(load_report_html(sorted(args.qps), summaries, args.url, model, args.num_prompts,
                                      args.workload))
        print(f"wrote {os.path.abspath(args.html)}")


def _attack(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`attack prefix-cache`: the timing channel and what salting costs, on the module's engine."""
    question = AttackQuestion(trials=args.trials, secrets=args.secrets, candidates=args.candidates, seed=args.seed)
    print(run_attack(lab, question, log=lambda line: print(line, flush=True)).text)


def _report(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`report`: one HTML page of figures; stubs keep figures out, named."""
    # Exit 0 with the file written even when stubs keep figures out, naming them (as the main
    # job names the first exercise to write): the other figures are worth looking at.
    report = write_report(lab, args.out)
    print(os.path.abspath(args.out))
    if report.stubs:
        print(f"some figures are not drawn yet, still stubs: {', '.join(report.stubs)} "
              f"(see `python {run.prog} status`)")
    if report.errors:  # not a stub: the module's code failed, and that is an error
        run.parser.exit(1, f"{run.prog} report: figures failed: {'; '.join(report.errors)}\n")


def _hint(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`hint N`: the next hint."""
    print(show_hint(lab, args.exercise, args.level), end="")


def _quiz(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`quiz N`: questions the module's own code answers."""
    seed = random.randrange(10_000) if args.seed is None else args.seed
    return run_quiz(lab, args.exercise, seed, run.prog)


def _trace(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`trace`: one recorded engine run as a page."""
    trace = write_trace(lab, args.workload, args.out)
    print(f"{os.path.abspath(args.out)}: {len(trace.frames) - 1} steps of {trace.workload.title}, "
          f"{os.path.getsize(args.out) / 1024:.0f} KB; open it in a browser")
    print(f"what to look for: {trace.workload.look_for}")
    if trace.error or trace.truncated:  # the page shows the steps up to there: worth a look
        why = trace.error or f"the run had not finished after {len(trace.frames) - 1} steps"
        run.parser.exit(1, f"{run.prog} trace: {why} (the page shows the steps before)\n")


def _status(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`status`: what is still a stub."""
    print(status_report(lab))


# Each command's function, by the name the user types (None: no command, the main job).
COMMANDS = {
    None: _scenarios,
    "size": _size,
    "fleet": _fleet,
    "batching": _batching,
    "speculate": _speculate,
    "generate": _generate,
    "stack": _stack,
    "serve": _serve,
    "loadtest": _loadtest,
    "attack": _attack,
    "report": _report,
    "hint": _hint,
    "quiz": _quiz,
    "trace": _trace,
    "status": _status,
}


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
        return COMMANDS[args.command](lab, args, Run(prog, parser)) or 0
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
        if args.command == "trace":  # the student's copy ships the same pages recorded on a correct engine
            recorded = args.workload if args.workload in WORKLOADS else "skewed"
            parser.exit(1, f"{prog}: {exc} is still a stub: write it (see `python {prog} status`); meanwhile "
                           f"docs/reference-traces/{recorded}.html in the student's copy is that run on a "
                           "correct engine\n")
        parser.exit(1, f"{prog}: {exc} is still a stub: write it (see `python {prog} status`)\n")
