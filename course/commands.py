"""Every command of `python lab.py ...` / `python solution.py ...`: its arguments beside what it
runs, and the table the command line is built from (`COMMANDS`, in the order `--help` lists them).
Each command is handed the module (`lab`), its parsed arguments and a `Run` (the program's name,
the parser whose `exit` prints one line and sets the status).
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

from checkpoints.commands import checkpoint_engine, generate_text, speculate_checkpoints
from loadtest.benchmark_serving import loadtest, server_model_card
from loadtest.costmodel import CPU_OVERHEAD_S
from loadtest.datasets import LOAD_WORKLOADS
from loadtest.fleet_search import SLO, FleetQuestion
from serving.api_server import APIKeys, read_api_keys_file, serve

from .arguments import exercise_number, hint_level, positive, preset_names, prices, rates
from .hints import LEVELS, show_hint
from .pages.fleet_page import fleet_page
from .pages.report import write_report
from .pages.report.latency import load_report_html
from .pages.trace import write_trace
from .pages.trace_workloads import WORKLOADS
from .quiz import run_quiz
from .reviews.attack import AttackQuestion, run_attack
from .reviews.fleet import NoCandidateMeets, run_fleet
from .reviews.scenarios import run_all_scenarios, scenario_batching, scenario_speculate
from .reviews.sizing import SEED_SIZING, scenario_size
from .reviews.stacks import scenario_stack
from .status import status_report, unsolved_exercises

# The model `python solution.py serve` runs by default: the lab's GPT-2 with room for ShareGPT-
# like requests (prompt + output <= 512 tokens).
SERVE_MODEL = dict(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4)

# `serve` splits the model's big products over the CPUs it may run on, up to a few.
MAX_DEFAULT_THREADS = 8


def default_num_threads() -> int:
    """The CPUs this process may run on (its affinity, which a container or `taskset` narrows), at
    most MAX_DEFAULT_THREADS."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, min(len(cpus), MAX_DEFAULT_THREADS))


CPU_OVERHEAD_HELP = (f"the engine's CPU time per step in the measured cost (default {CPU_OVERHEAD_S * 1e3:g}: vLLM's "
                     "synchronous loop; 0: an engine that overlaps it with the GPU)")


class Run(NamedTuple):
    """What every command is handed besides the module and its arguments."""

    prog: str  # lab.py or solution.py, as the user typed it
    parser: argparse.ArgumentParser  # its exit() prints one line and sets the status


def default_page(prog: str, page: str) -> str:
    """A page's default file here, named for the module: lab.py's page never overwrites solution.py's."""
    return f"{os.path.splitext(prog)[0]}-{page}.html"


def scenarios(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """No command: the four design reviews (the main job). Stubs are where a lab starts, not an
    error: on a lab that has some, the exercise to write next comes first, each scenario that
    needs a stub says so, the last line says what to run, and the status is 0 (a real error's is not)."""
    todo = unsolved_exercises(lab)
    if todo:  # the earliest exercise, not the first scenario's (sizing needs Exercise 8)
        first = min(todo)
        print(f"{run.prog}: Exercise {first} is next: write {', '.join(todo[first])} "
              f"({len(todo)} of {len(lab.EXERCISES)} exercises still have stubs; the scenarios below run once "
              "the exercises they need are written)\n")
    text, _ = run_all_scenarios(lab)
    print(text)
    if todo:
        print(f"\nnext: write Exercise {first} in {run.prog}, then `python -m pytest -m exercise{first}`; "
              f"`python {run.prog} status` lists every stub")
    return 0


def _size_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    # choices: an unknown name is a usage error that lists the known ones, before any exercise runs.
    parser.add_argument("--model", default=SEED_SIZING["model"], choices=list(lab.MODELS))
    parser.add_argument("--gpu", default=SEED_SIZING["gpu"], choices=list(lab.GPUS))
    parser.add_argument("--max-model-len", type=positive(int), default=SEED_SIZING["max_model_len"])
    parser.add_argument("--block-size", type=positive(int), default=16)
    parser.add_argument("--gpu-memory-utilization", type=positive(float), default=0.9)
    parser.add_argument("--activation-gb", type=positive(float, allow_zero=True), default=0.0,
                        help="per-GPU activation reserve, GB")
    parser.add_argument("--tp", type=positive(int), default=1, help="tensor-parallel GPUs")
    parser.add_argument("--prompt-len", type=positive(float), help="mean prompt tokens (default: ShareGPT)")
    parser.add_argument("--output-len", type=positive(float), help="mean output tokens (default: ShareGPT)")
    parser.add_argument("--kv-cache-dtype", choices=list(lab.PLAN_KV_CACHE_DTYPES), default="auto",
                        help="KV-cache element type: auto (the model's), fp8 or int8 (1 byte)")
    parser.add_argument("--usd-per-gpu-hour", type=positive(float), help="GPU price: prints the cost per 1M tokens")
    parser.add_argument("--cpu-overhead-ms", type=positive(float, allow_zero=True), help=CPU_OVERHEAD_HELP)


def _size(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`size`: one deployment sized by the module's plan_deployment."""
    print(scenario_size(lab, args.model, args.gpu, args.max_model_len, args.block_size,
                        args.gpu_memory_utilization, args.activation_gb, args.tp, args.prompt_len,
                        args.output_len, args.kv_cache_dtype, args.usd_per_gpu_hour,
                        None if args.cpu_overhead_ms is None else args.cpu_overhead_ms / 1e3))


FLEET_HELP = ("Search GPU presets, tensor parallelism, max_num_seqs, the token budget and prefill/decode "
              "disaggregation in the simulator, with this module's Scheduler: the largest rate per replica meeting "
              "both p99 targets, then replicas, GPUs and $ per 1M output tokens.")


def _fleet_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--model", default=SEED_SIZING["model"], choices=list(lab.MODELS))
    parser.add_argument("--gpu", type=preset_names(lab.GPUS, "GPU"), default=(SEED_SIZING["gpu"],),
                        help="a GPU preset, or several: a100-80gb,h100-80gb")
    parser.add_argument("--qps", type=positive(float), default=100.0, help="requests per second to serve")
    parser.add_argument("--p99-ttft-ms", type=positive(float), default=200.0)
    parser.add_argument("--p99-tpot-ms", type=positive(float), default=50.0)
    parser.add_argument("--workload", choices=[w for w in LOAD_WORKLOADS if w != "tiny"], default="sharegpt")
    parser.add_argument("--usd-per-gpu-hour", type=prices, default=(2.0,),
                        help="one price, or one per --gpu (2,4); an example price, not a quote")
    parser.add_argument("--max-model-len", type=positive(int), default=2048,
                        help="requests longer are cut, as vLLM's benchmark filters ShareGPT (default 2048)")
    parser.add_argument("--num-requests", type=positive(int), default=FleetQuestion.num_requests,
                        help="simulated requests per rate tried: more is slower and finds rarer queues")
    parser.add_argument("--kv-link-gb-per-s", type=positive(float), default=25.0,
                        help="prefill -> decode K/V link per GPU, GB/s (default: 200 Gb/s InfiniBand)")
    parser.add_argument("--no-disaggregation", action="store_true", help="leave out the prefill/decode pools")
    parser.add_argument("--cpu-overhead-ms", type=positive(float, allow_zero=True), help=CPU_OVERHEAD_HELP)
    parser.add_argument("--jobs", type=positive(int), default=min(2, os.cpu_count() or 1),
                        help="searches at once, in forked processes (default: 2, or 1 on one core)")
    parser.add_argument("--seed", type=positive(int, allow_zero=True), default=0)
    parser.add_argument("--html", metavar="FILE", help="also draw goodput against offered rate for the pick and the "
                                                       "runner-up (more simulated runs: about a minute more)")


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


def _batching_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--slots", type=positive(int), default=16)
    parser.add_argument("--long", type=positive(int), default=2000, help="tokens of the long answer")
    parser.add_argument("--short", type=positive(int), default=50, help="tokens of each short answer")
    parser.add_argument("--num-short", type=positive(int), default=63)


def _batching(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`batching`: continuous against static batching, simulated."""
    print(scenario_batching(lab, args.slots, args.long, args.short, args.num_short))


def _speculate_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--alpha", type=float, help="acceptance rate of your draft, 0..1")
    parser.add_argument("--k", type=positive(int), help="draft tokens per step (default: the best)")
    parser.add_argument("--c", type=positive(float, allow_zero=True), default=0.05,
                        help="draft step cost / target step cost")
    parser.add_argument("--target", metavar="DIR", help="a GPT-2 checkpoint directory: measure on real text")
    parser.add_argument("--draft", metavar="DIR", help="its draft, sharing the tokenizer (e.g. distilgpt2)")
    parser.add_argument("--prompt", help="the text to continue (with --target/--draft)")
    parser.add_argument("--max-tokens", type=positive(int), default=64, help="with --target/--draft")
    parser.add_argument("--temperature", type=positive(float, allow_zero=True), default=0.0,
                        help="with --target/--draft")


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


def _generate_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--model", metavar="DIR", required=True, help="config.json, model.safetensors, vocab.json, "
                                                                     "merges.txt")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=positive(int), default=32)
    parser.add_argument("--temperature", type=positive(float, allow_zero=True), default=0.0)
    parser.add_argument("--seed", type=int, default=0)


def _generate(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`generate`: text from a checkpoint."""
    print(generate_text(lab, args.model, args.prompt, args.max_tokens, args.temperature, args.seed))


def _stack_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--hardware", help="the fleet, e.g. nvidia, amd")
    parser.add_argument("--priority", choices=("throughput", "latency"), default="throughput")
    parser.add_argument("--prefix-sharing", action="store_true", help="heavy shared prefixes")
    parser.add_argument("--structured-output", action="store_true", help="JSON / regex constrained output")


def _stack(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`stack`: vLLM, TensorRT-LLM or SGLang for a workload."""
    print(scenario_stack(lab, args.hardware, args.priority, args.prefix_sharing, args.structured_output))


def _status(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`status`: what is still a stub."""
    print(status_report(lab))


HINT_HELP = ("The next hint for exercise N: a nudge, then the idea, then the method. Which levels you have "
             "seen is kept in .hints.json beside the module.")


def _hint_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("exercise", metavar="N", type=exercise_number(lab), help="the exercise's number")
    parser.add_argument("--level", metavar="K", type=hint_level, help=f"show level K (1 to {LEVELS}) directly; "
                                                                   "it does not change which hint comes next")


def _hint(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`hint N`: the next hint."""
    print(show_hint(lab, args.exercise, args.level), end="")


QUIZ_HELP = ("Questions with numeric answers about exercise N, with figures drawn fresh each run: type each "
             "answer (a number; 2/3 is fine), and after each attempt the quiz shows the right value and why. "
             "The right values are computed by THIS module's own code, your exercises included, when the quiz "
             "asks: a wrong function gives a wrong 'right answer'. The quiz checks your understanding, not your "
             "code: the tests do that (python -m pytest -m exerciseN). A function the quiz needs that is still "
             "a stub stops it (exit status 1), naming the function.")


def _quiz_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("exercise", metavar="N", type=exercise_number(lab), help="the exercise's number")
    parser.add_argument("--seed", type=positive(int, allow_zero=True),
                        help="repeat the figures of an earlier run (default: fresh ones)")


def _quiz(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`quiz N`: questions the module's own code answers."""
    seed = random.randrange(10_000) if args.seed is None else args.seed
    return run_quiz(lab, args.exercise, seed, run.prog)


def _serve_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--duration", type=positive(float), help="stop after this many seconds")
    parser.add_argument("--model", metavar="DIR", help="a GPT-2 checkpoint directory to serve with its tokenizer "
                                                      "(default: a toy model with random weights, bytes as tokens)")
    for name, value in SERVE_MODEL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive(int), default=value, help="model")
    parser.add_argument("--seed", type=int, default=0, help="of the model's random weights")
    parser.add_argument("--block-size", type=positive(int), default=16)
    parser.add_argument("--num-blocks", type=positive(int), help="KV blocks (default: max-num-seqs full sequences)")
    parser.add_argument("--max-num-seqs", type=positive(int),
                        help="running sequences (default: 64 for a toy model, 4 for a --model checkpoint, whose "
                             "full-length K/V is 302 MB a sequence for GPT-2 small)")
    parser.add_argument("--stream-interval", type=positive(int), default=1,
                        help="tokens per streamed chunk (SGLang's flag): fewer, larger events for more throughput")
    parser.add_argument("--max-num-batched-tokens", type=positive(int), default=512)
    parser.add_argument("--num-threads", type=positive(int), default=default_num_threads(),
                        help="threads that share each big product of the model (default: the CPUs this process may "
                             f"run on, at most {MAX_DEFAULT_THREADS}; docs/performance.md)")
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the K/V of cached prompt blocks (on by default, as in vLLM V1); the samples of "
                             "n share their prompt's blocks only with it on")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model names clients may use (the first is the one answered with); default: the "
                             "checkpoint directory's name, or one made of the toy model's shape")
    parser.add_argument("--max-n", type=positive(int),
                        help="the largest n of one request, and how many of its choices (prompts x n) run at once "
                             "(default: half of --max-num-seqs)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                      help="require one of these keys in `Authorization: Bearer KEY` (vLLM's flag; repeat it or "
                           "list several); each key is a tenant of its own, with a prefix cache of its own")
    keys.add_argument("--api-keys-file", metavar="FILE",
                      help='a JSON object {"key": "tenant", ...}: keys of one tenant share its prefix cache, '
                           "tenants share none (docs/serving.md#keys-and-tenants)")
    parser.add_argument("--metrics-api-key", metavar="KEY",
                        help="require this key (`Authorization: Bearer KEY`) on /metrics, whose prefix-cache "
                             "counters say which prompts were sent before: the scraper's, not a client's "
                             "(docs/serving.md#who-reads-metrics)")


def _serve(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`serve`: the OpenAI server on a port."""
    if args.api_keys_file:  # read first: a bad file is exit status 2 before any model loads
        api_keys = read_api_keys_file(args.api_keys_file)
    else:  # --api-key: each key its own tenant (vLLM's keys have no tenants; here each is kept apart)
        api_keys = {key: f"api-key-{i}" for i, key in enumerate(dict.fromkeys(args.api_key or ()), 1)} or None
        if api_keys:
            APIKeys(api_keys)  # checked now: a key no header can carry is exit status 2 before any model loads
    if args.metrics_api_key is not None:
        APIKeys({args.metrics_api_key: "operator"}, "--metrics-api-key")  # likewise
    options = dict(num_blocks=args.num_blocks, block_size=args.block_size,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   enable_prefix_caching=args.enable_prefix_caching,
                   enable_chunked_prefill=not args.no_chunked_prefill)
    if args.model:  # max_model_len is the checkpoint's n_positions; the KV-cache fits max_num_seqs of them
        engine, tokenizer = checkpoint_engine(lab, args.model, args.max_num_seqs or 4, args.num_threads, **options)
        # The directory's name, and the --model string as given (vLLM's name for it)
        names = args.served_model_name or list(dict.fromkeys([os.path.basename(os.path.normpath(args.model)),
                                                              args.model]))
    else:
        model = lab.ToyTransformer(lab.ModelConfig(**{k: getattr(args, k) for k in SERVE_MODEL}),
                                   seed=args.seed, num_threads=args.num_threads)
        engine = lab.LLMEngine(model, max_num_seqs=args.max_num_seqs or 64,
                               **options)
        tokenizer = None
        names = args.served_model_name
    # Garbled text is what random weights write: say so before a client sees it.
    note = None if args.model else (f"the model's weights are random (--seed {args.seed}), so its text is "
                                    "noise; --model DIR serves a GPT-2 checkpoint (docs/checkpoints.md)")
    if not serve(engine, args.host, args.port, args.duration, note=note, lab=lab, tokenizer=tokenizer,
                 model_name=names, stream_interval=args.stream_interval, max_n=args.max_n, api_keys=api_keys,
                 metrics_api_key=args.metrics_api_key):
        run.parser.exit(1, f"{run.prog} serve: error: the server's HTTP front end stopped, so the server did\n")


def _loadtest_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--qps", type=rates, default=[1.0, 2.0, 4.0], help="offered req/s: 1,2,4 (inf: all at once)")
    parser.add_argument("--num-prompts", type=positive(int), default=50, help="requests per rate")
    parser.add_argument("--workload", choices=list(LOAD_WORKLOADS), default="sharegpt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-format", choices=("token-ids", "text"), default="token-ids",
                        help="text for servers with a real tokenizer (vLLM)")
    parser.add_argument("--model", help="default: the first model of /v1/models")
    parser.add_argument("--max-model-len", type=positive(int), help="default: from /v1/models, else 2048")
    parser.add_argument("--slo-ttft-ms", type=positive(float))
    parser.add_argument("--slo-tpot-ms", type=positive(float))
    parser.add_argument("--save-workload", metavar="FILE", help="write the requests as JSONL for vllm bench serve")
    parser.add_argument("--timeout", type=positive(float), default=300.0, help="seconds per request")
    parser.add_argument("--html", metavar="FILE", help="also draw latency against load as a self-contained HTML page")


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


ATTACK_HELP = ("A victim sends a secret system prompt; an attacker guesses prefixes and times the first token, on "
               "two servers of this module's engine side by side (one shared cache; per-tenant salts from API "
               "keys), and reads /metrics' prefix-cache hits around each guess. Prints the attacker's ROC AUC on "
               "each channel, its block-by-block recovery of the secret, and what salting costs in prefix hits and "
               "prefill tokens (docs/serving.md).")


def _attack_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    parser.add_argument("kind", choices=["prefix-cache"], help="the channel to measure")
    defaults = AttackQuestion()
    parser.add_argument("--trials", type=positive(int), default=defaults.trials,
                        help=f"correct and wrong guesses timed on each server, each (default {defaults.trials})")
    parser.add_argument("--secrets", type=positive(int), default=defaults.secrets,
                        help=f"secret prompts recovered block by block (default {defaults.secrets})")
    parser.add_argument("--candidates", type=positive(int), default=defaults.candidates,
                        help=f"the attacker's candidates for each block, the true one among them (default "
                             f"{defaults.candidates})")
    parser.add_argument("--seed", type=positive(int, allow_zero=True), default=defaults.seed)


def _attack(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`attack prefix-cache`: the timing channel and what salting costs, on the module's engine."""
    question = AttackQuestion(trials=args.trials, secrets=args.secrets, candidates=args.candidates, seed=args.seed)
    print(run_attack(lab, question, log=lambda line: print(line, flush=True)).text)


def _report_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    out = default_page(prog, "report")
    parser.add_argument("--out", default=out, help=f"the file to write (default: {out} here)")


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


def _trace_arguments(parser: argparse.ArgumentParser, lab: ModuleType, prog: str) -> None:
    out = default_page(prog, "trace")
    parser.add_argument("--workload", default="skewed", metavar="NAME|FILE",
                        help=f"{', '.join(WORKLOADS)} (default: skewed), or a file that `loadtest --save-workload` "
                             "wrote")
    parser.add_argument("--out", default=out, help=f"the file to write (default: {out} here)")


def _trace(lab: ModuleType, args: argparse.Namespace, run: Run) -> int | None:
    """`trace`: one recorded engine run as a page."""
    trace = write_trace(lab, args.workload, args.out)
    print(f"{os.path.abspath(args.out)}: {len(trace.frames) - 1} steps of {trace.workload.title}, "
          f"{os.path.getsize(args.out) / 1024:.0f} KB; open it in a browser")
    print(f"what to look for: {trace.workload.look_for}")
    if trace.error or trace.truncated:  # the page shows the steps up to there: worth a look
        why = trace.error or f"the run had not finished after {len(trace.frames) - 1} steps"
        run.parser.exit(1, f"{run.prog} trace: {why} (the page shows the steps before)\n")


class Command(NamedTuple):
    """One command: what `--help` says of it, the function that adds its arguments (None: it takes
    none) and the function that runs it (None: `bench`, which main() hands to `python -m tools.bench`)."""

    help: str
    arguments: Callable[[argparse.ArgumentParser, ModuleType, str], None] | None
    run: Callable[[ModuleType, argparse.Namespace, Run], int | None] | None
    description: str | None = None


# Each command by the name the user types, in the order `--help` lists them.
COMMANDS = {
    "size": Command("size a deployment: KV blocks, concurrency, QPS, KV waste", _size_arguments, _size),
    "fleet": Command("the cheapest deployment meeting p99 TTFT and TPOT targets at a rate", _fleet_arguments, _fleet,
                     FLEET_HELP),
    "batching": Command("static vs continuous batching: a skewed workload, then a stream", _batching_arguments,
                        _batching),
    "speculate": Command("expected speedup of speculative decoding", _speculate_arguments, _speculate),
    "generate": Command("continue a prompt with a GPT-2 checkpoint from disk", _generate_arguments, _generate),
    "stack": Command("vLLM vs TensorRT-LLM vs SGLang", _stack_arguments, _stack),
    "bench": Command("measure on this machine, side by side (python -m tools.bench; bench --help)", None, None),
    "status": Command("which exercises are done", None, _status),
    "hint": Command("the next of three hints for exercise N (docs/hints.md)", _hint_arguments, _hint, HINT_HELP),
    "quiz": Command("questions with numbers about exercise N, answered by this module's code", _quiz_arguments,
                    _quiz, QUIZ_HELP),
    "serve": Command("serve a toy model over HTTP, OpenAI-compatible, until Ctrl-C", _serve_arguments, _serve),
    "loadtest": Command("open-loop load test of any OpenAI-compatible server", _loadtest_arguments, _loadtest),
    "attack": Command("the prefix cache's side channels (timing, /metrics), measured on this module's engine: one "
                      "shared cache against per-tenant salts", _attack_arguments, _attack, ATTACK_HELP),
    "report": Command("one HTML file of pictures drawn from runs of this module's code", _report_arguments, _report),
    "trace": Command("one HTML page that steps through a run of this module's engine: the queues, the block pool, "
                     "the block tables", _trace_arguments, _trace),
}
