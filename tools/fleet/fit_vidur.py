#!/usr/bin/env python3
"""Fit loadtest/vidur_profile.json, the measured cost model's coefficients, from Vidur's published
operator profiles, and print the error table: predicted against measured, per model, GPU and tp.

    python -m tools.fleet.fit_vidur --vidur DIR            # fit, print the coefficients and the error tables
    python -m tools.fleet.fit_vidur --vidur DIR --write    # ... and write loadtest/vidur_profile.json
    python -m tools.fleet.fit_vidur --vidur DIR --check    # the SHIPPED table against the profiles; exit 1 if a
                                                     # held-out target is missed
    python -m tools.fleet.fit_vidur --vidur DIR --leave-one-out   # fit on one Llama-2, predict the other

DIR is a clone of https://github.com/microsoft/vidur (MIT licence; its data/profiling/ is read) or
a bare git mirror of it (read with `git show`); default $VIDUR_DIR. Nothing of it is copied into
this project but the coefficients, their provenance and the licence notice.

What is fitted, and on what (docs/fleet.md explains the form):
- the GEMMs and elementwise kernels of a layer, per GPU, on Llama-2-7B and Llama-2-70B only
  (compute/{a100,h100}/meta-llama/Llama-2-{7,70}b-hf/mlp.csv: every operator by tokens and tp);
- the all-reduce, per GPU and tp, on network/{a100,h100}_dgx/all_reduce.csv (one node, NVSwitch).
The other models of those folders (CodeLlama-34B, Qwen-72B, InternLM-20B, phi-2, Llama-3-8B and
-70B) are never fitted on: they are the check. The form was chosen among five by fitting on one
Llama-2 and predicting the other (--leave-one-out) before the held-out models were evaluated
(docs/fleet.md says what was evaluated on them, and when).

The fit is least squares of log(predicted / measured) per operator row (the median of Vidur's
repeated timings), Levenberg-Marquardt in the logs of the coefficients (all positive): numpy only,
deterministic, about ten seconds.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import pathlib
import statistics
import subprocess

import numpy as np

from loadtest import costmodel
from tools.bench_common import ROOT

FITTED = ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf")
HELD_OUT = ("codellama/CodeLlama-34b-Instruct-hf", "Qwen/Qwen-72B", "internlm/internlm-20b", "microsoft/phi-2",
            "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B")
# This project's GPU presets, Vidur's names for them (its A100 is the 80 GB SXM part), and the
# hardware facts the form uses: the datasheets' dense FP16 peaks (as the presets) and SM counts.
GPUS = {"a100-80gb": dict(compute="a100", network="a100_dgx", peak_flops=312e12, peak_bandwidth=2.039e12,
                          num_sms=108),
        "h100-80gb": dict(compute="h100", network="h100_dgx", peak_flops=989e12, peak_bandwidth=3.35e12,
                          num_sms=132)}
MAX_TOKENS = 4096           # the range checked (Llama-3's profiles go to 32768; the others stop here)
TP_DEGREES = (1, 2, 4, 8)
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")  # Vidur's layer, less attention (emb is not in it)
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# All-reduce sizes: a step sends tokens x hidden x 2 bytes per all-reduce. A decode step of 1-256
# sequences of a 4096-8192 hidden model sends 8 KB - 4 MB (the latency band); prefill chunks of
# 512-4096 tokens 4-64 MB (the bandwidth band).
DECODE_BAND = (8 * 1024, 4.2e6)
PREFILL_TOKENS = (512, 1024, 2048, 4096)
HIDDENS = (4096, 5120, 8192)
TARGETS = {"linear median": 0.15, "linear worst": 0.35, "allreduce": 0.25}


# --- reading the profiles ------------------------------------------------------------------------


class Vidur:
    """Vidur's repository: a work tree (DIR/data/profiling/...) or a bare git mirror."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self.bare = not (self.path / "data").is_dir()
        if self.bare and not (self.path / "HEAD").is_file():
            raise SystemExit(f"fit_vidur: {path} is neither a clone of microsoft/vidur nor a bare mirror of it")

    def _git(self, *args: str) -> str:
        flag = ["--git-dir", str(self.path)] if self.bare else ["-C", str(self.path)]
        return subprocess.run(["git", *flag, *args], check=True, capture_output=True, text=True).stdout

    def read(self, path: str) -> str:
        if not self.bare:
            return (self.path / path).read_text()
        return self._git("show", f"HEAD:{path}")

    def provenance(self, files: list[str]) -> dict:
        head, date = self._git("log", "-1", "--format=%H %cs").split()
        changed, changed_date = self._git("log", "-1", "--format=%H %cs", "--", *files).split()
        return {"repository": "https://github.com/microsoft/vidur", "commit": head, "commit_date": date,
                "profiles_last_changed": {"commit": changed, "date": changed_date}}

    def licence(self) -> str:
        return self.read("LICENSE").strip()


def compute_path(gpu: str, model: str) -> str:
    return f"data/profiling/compute/{GPUS[gpu]['compute']}/{model}/mlp.csv"


def network_path(gpu: str) -> str:
    return f"data/profiling/network/{GPUS[gpu]['network']}/all_reduce.csv"


def load_compute(vidur: Vidur, gpu: str, model: str) -> list[dict] | None:
    """Rows (tokens, tp, the layer's shape, each operator's median seconds) up to MAX_TOKENS; the
    median over duplicate rows. None when the model has no profile on this GPU."""
    try:
        text = vidur.read(compute_path(gpu, model))
    except (OSError, subprocess.CalledProcessError):
        return None
    groups: dict[tuple[int, int], list[dict]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        key = int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
        if key[0] <= MAX_TOKENS:
            groups.setdefault(key, []).append(row)
    rows = []
    for (tokens, tp), group in sorted(groups.items()):
        first = group[0]
        heads, hidden = int(first["n_head"]), int(first["n_embd"])
        shape = costmodel.LayerShape(hidden, heads, int(first["n_kv_head"]), hidden // heads,
                                     int(first["n_expanded_embd"]), first["use_gated_mlp"] == "True")
        ops = {key[len("time_stats."):-len(".median")]: statistics.median(float(r[key]) for r in group) * 1e-3
               for key in first if key.startswith("time_stats.") and key.endswith(".median")}
        rows.append(dict(tokens=tokens, tp=tp, shape=shape, ops=ops))
    return rows


def load_allreduce(vidur: Vidur, gpu: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{tp: (sizes in bytes, median seconds)} of the all-reduces within one DGX node."""
    by_size: dict[int, dict[int, list[float]]] = {}
    for row in csv.DictReader(io.StringIO(vidur.read(network_path(gpu)))):
        tp = int(row["num_workers"])
        if row["collective"] == "all_reduce" and int(row["devices_per_node"]) == tp:
            by_size.setdefault(tp, {}).setdefault(int(row["size"]), []).append(
                float(row["time_stats.all_reduce.median"]) * 1e-3)
    return {tp: (np.array(sorted(sizes), dtype=np.float64), np.array([np.median(sizes[s]) for s in sorted(sizes)]))
            for tp, sizes in sorted(by_size.items())}


# --- fitting ---------------------------------------------------------------------------------------


def levenberg_marquardt(residuals, theta: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Minimise |residuals(theta)|^2 (numerical Jacobian, adaptive damping)."""
    damping = 1e-3
    r = residuals(theta)
    cost = r @ r
    for _ in range(iterations):
        jac = np.empty((len(r), len(theta)))
        for j in range(len(theta)):
            step = np.zeros(len(theta))
            step[j] = 1e-6
            jac[:, j] = (residuals(theta + step) - r) / 1e-6
        a, g = jac.T @ jac, jac.T @ r
        while True:
            delta = np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-12), -g)
            trial = residuals(theta + delta)
            if trial @ trial < cost:
                gain = cost - trial @ trial
                theta = theta + delta
                r = trial
                cost = trial @ trial
                damping = damping / 3
                break
            damping *= 4
            if damping > 1e10:
                return theta
        if gain < 1e-10 * cost:
            break
    return theta


def hardware(gpu: str) -> dict:
    return {k: GPUS[gpu][k] for k in ("peak_flops", "peak_bandwidth", "num_sms")}


def fit_gemm(gpu: str, rows: list[dict]) -> dict:
    samples = np.array([(r["tokens"], *r["shape"].gemms(r["tp"])[op], r["ops"][op]) for r in rows for op in GEMM_OPS])
    names = ("launch_s", "bandwidth_efficiency", "compute_efficiency", "blend", "tiles_per_sm_half")

    def residuals(theta):
        coefficients = dict(hardware(gpu), gemm=dict(zip(names, np.exp(theta))))
        return np.log(costmodel.gemm_seconds(coefficients, samples[:, 0], samples[:, 1], samples[:, 2]) / samples[:, 3])
    theta = levenberg_marquardt(residuals, np.log([5e-6, 0.8, 0.7, 2.0, 0.5]))
    return dict(zip(names, map(float, np.exp(theta))))


def fit_elementwise(gpu: str, rows: list[dict]) -> dict:
    out = {}
    for kind in sorted(set(costmodel.ELEMENTWISE_KIND.values())):
        samples = np.array([(r["shape"].elementwise_bytes(r["tp"])[op] * r["tokens"], r["ops"][op]) for r in rows
                            for op, k in costmodel.ELEMENTWISE_KIND.items() if k == kind and op in r["ops"]])

        def residuals(theta, samples=samples, kind=kind):
            launch, efficiency = np.exp(theta)
            kernel = dict(launch_s=launch, bandwidth_efficiency=efficiency)
            coefficients = dict(hardware(gpu), elementwise={kind: kernel})
            return np.log(costmodel.elementwise_seconds(coefficients, kind, samples[:, 0]) / samples[:, 1])
        launch, efficiency = np.exp(levenberg_marquardt(residuals, np.log([3e-6, 0.5])))
        out[kind] = dict(launch_s=float(launch), bandwidth_efficiency=float(efficiency))
    return out


def gemv_efficiency(gpu: str, rows: list[dict]) -> float:
    """The bandwidth a one-token GEMM reaches: the median over the fitted models' GEMMs at tp 1."""
    shares = [r["shape"].dtype_bytes * n * k / r["ops"][op] / GPUS[gpu]["peak_bandwidth"]
              for r in rows if r["tokens"] == 1 and r["tp"] == 1 for op, (n, k) in r["shape"].gemms(1).items()]
    return float(np.median(shares))


def log_bins(sizes: np.ndarray, times: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Medians of (size, time) in `count` log-spaced bins of size: each decade weighs the same."""
    edges = np.geomspace(sizes.min(), sizes.max() * 1.0001, count + 1)
    keep = [(lo <= sizes) & (sizes < hi) for lo, hi in zip(edges[:-1], edges[1:])]
    return (np.array([np.median(sizes[m]) for m in keep if m.any()]),
            np.array([np.median(times[m]) for m in keep if m.any()]))


def fit_allreduce(tp: int, sizes: np.ndarray, times: np.ndarray) -> dict:
    """Latency: the median over the decode band (small all-reduces flip between two modes from one
    size to the next, so a curve through each size would chase noise). Bus bandwidth and blend:
    least squares over log bins of the sizes from 4 MB up, the latency held."""
    band = (sizes >= DECODE_BAND[0]) & (sizes <= DECODE_BAND[1])
    latency = float(np.median(times[band]))
    s, t = log_bins(sizes[sizes >= 4e6], times[sizes >= 4e6], 12)

    def residuals(theta):
        bandwidth, excess = np.exp(theta)
        ring = dict(latency_s=latency, bus_bandwidth=bandwidth, blend=1 + excess)
        return np.log(costmodel.allreduce_seconds(ring, tp, s) / t)
    bandwidth, excess = np.exp(levenberg_marquardt(residuals, np.log([200e9, 1.0])))
    return dict(latency_s=latency, bus_bandwidth=float(bandwidth), blend=float(1 + excess))


def fit(vidur: Vidur, models: tuple[str, ...] = FITTED) -> dict:
    profile = {"gpus": {}}
    files = []
    for gpu in GPUS:
        rows = []
        for model in models:
            rows += load_compute(vidur, gpu, model)
            files.append(compute_path(gpu, model))
        rings = load_allreduce(vidur, gpu)
        files.append(network_path(gpu))
        profile["gpus"][gpu] = dict(
            hardware(gpu), vidur_name=GPUS[gpu]["compute"], gemm=fit_gemm(gpu, rows),
            elementwise=fit_elementwise(gpu, rows), gemv_bandwidth_efficiency=gemv_efficiency(gpu, rows),
            allreduce={str(tp): fit_allreduce(tp, *rings[tp]) for tp in TP_DEGREES[1:]})
    profile["source"] = dict(vidur.provenance(files), fitted_on=files,
                             held_out=[m for m in HELD_OUT], tool="tools/fleet/fit_vidur.py")
    profile["license"] = ("The coefficients are fitted to data from microsoft/vidur, distributed under this "
                          "licence:\n\n" + vidur.licence())
    return profile


# --- checking ------------------------------------------------------------------------------------


def linear_errors(gpu_coefficients: dict, rows: list[dict]) -> dict[int, np.ndarray]:
    """{tp: relative errors of the predicted layer (linear operators) against Vidur's sum of them},
    the prediction from the shape alone (two norms: a model with one, as phi-2, is charged two)."""
    out: dict[int, np.ndarray] = {}
    for tp in sorted({r["tp"] for r in rows}):
        group = [r for r in rows if r["tp"] == tp]  # one shape per file
        measured = np.array([sum(r["ops"].get(op, 0.0) for op in LAYER_OPS) for r in group])
        tokens = np.array([r["tokens"] for r in group])
        out[tp] = costmodel.layer_seconds(gpu_coefficients, group[0]["shape"], tp, tokens) / measured - 1
    return out


def window_median(sizes: np.ndarray, times: np.ndarray, size: float) -> float:
    """The profile near `size`: the median within +-10%, or of the 16 nearest sizes."""
    near = (sizes >= size / 1.1) & (sizes <= size * 1.1)
    if near.sum() < 16:
        near = np.zeros(len(sizes), bool)
        near[np.argsort(np.abs(sizes - size))[:16]] = True
    return float(np.median(times[near]))


def allreduce_errors(ring: dict, tp: int, sizes: np.ndarray, times: np.ndarray) -> dict[str, float]:
    band = (sizes >= DECODE_BAND[0]) & (sizes <= DECODE_BAND[1])
    out = {"decode": float(np.median(costmodel.allreduce_seconds(ring, tp, sizes[band])) / np.median(times[band]) - 1)}
    for tokens in PREFILL_TOKENS:
        errs = [float(costmodel.allreduce_seconds(ring, tp, n)) / window_median(sizes, times, n) - 1
                for n in (tokens * h * 2 for h in HIDDENS)]
        out[f"prefill {tokens}"] = max(errs, key=abs)
    return out


def report(vidur: Vidur, profile: dict) -> tuple[str, bool]:
    """The error tables (markdown) and whether every held-out target is met."""
    ok = True
    lines = ["Linear operators of a layer, predicted against Vidur's measured sum, tokens 1-4096: median |error| / "
             "worst |error| (signed mean) per tp", "",
             "| model | GPU | set | " + " | ".join(f"tp {tp}" for tp in TP_DEGREES) + " | all tp |",
             "| --- | --- | --- | " + " | ".join("---" for _ in TP_DEGREES) + " | --- |"]
    for gpu, coefficients in profile["gpus"].items():
        for model in FITTED + HELD_OUT:
            rows = load_compute(vidur, gpu, model)
            if rows is None:
                continue
            errors = linear_errors(coefficients, rows)
            cells = []
            for tp in TP_DEGREES:
                e = errors.get(tp)
                cells.append("-" if e is None else f"{100 * np.median(np.abs(e)):.1f}% / "
                             f"{100 * np.abs(e).max():.0f}% ({100 * e.mean():+.1f}%)")
            every = np.concatenate(list(errors.values()))
            med = np.median(np.abs(every))
            worst = np.abs(every).max()
            held = model in HELD_OUT
            if held and (med > TARGETS["linear median"] or worst > TARGETS["linear worst"]):
                ok = False
            lines.append(f"| {model.split('/')[1]} | {gpu} | {'held out' if held else 'fitted'} | " + " | ".join(cells)
                         + f" | {100 * med:.1f}% / {100 * worst:.0f}% |")
    lines += ["", "All-reduce on one DGX node, predicted against Vidur's profile: the decode band (8 KB - 4 MB: "
              "1-256 tokens) by its median; prefill (512-4096 tokens of hidden 4096, 5120, 8192) by the profile "
              "within +-10% of the size, the largest error of the three hidden sizes", "",
              "| GPU | tp | latency | bus bandwidth | decode band | "
              + " | ".join(f"prefill {t}" for t in PREFILL_TOKENS) + " |",
              "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in PREFILL_TOKENS) + " |"]
    for gpu, coefficients in profile["gpus"].items():
        rings = load_allreduce(vidur, gpu)
        for tp_text, ring in coefficients["allreduce"].items():
            tp = int(tp_text)
            errors = allreduce_errors(ring, tp, *rings[tp])
            ok &= all(abs(e) <= TARGETS["allreduce"] for e in errors.values())
            lines.append(f"| {gpu} | {tp} | {ring['latency_s'] * 1e6:.0f} us | "
                         f"{ring['bus_bandwidth'] / 1e9:.0f} GB/s | "
                         + " | ".join(f"{100 * e:+.0f}%" for e in errors.values()) + " |")
    return "\n".join(lines), ok


def coefficient_table(profile: dict) -> str:
    lines = []
    for gpu, c in profile["gpus"].items():
        g, ew = c["gemm"], c["elementwise"]
        lines.append(f"{gpu}: GEMM launch {g['launch_s'] * 1e6:.2f} us, memory at "
                     f"{g['bandwidth_efficiency']:.3f} x peak bandwidth, compute up to "
                     f"{g['compute_efficiency']:.3f} x peak FLOP/s (half of it at "
                     f"{g['tiles_per_sm_half']:.3f} tiles per SM), blend p = {g['blend']:.3f}; a one-token GEMM "
                     f"reaches {c['gemv_bandwidth_efficiency']:.3f} x peak bandwidth")
        lines.append("  elementwise: " + "; ".join(f"{k} {v['launch_s'] * 1e6:.2f} us + bytes at "
                                                   f"{v['bandwidth_efficiency']:.3f} x peak" for k, v in ew.items()))
        lines.append("  all-reduce: " + "; ".join(
            f"tp {tp} {r['latency_s'] * 1e6:.1f} us, {r['bus_bandwidth'] / 1e9:.0f} GB/s, p = {r['blend']:.2f}"
            for tp, r in c["allreduce"].items()))
    return "\n".join(lines)


def leave_one_out(vidur: Vidur) -> str:
    """Fit the kernels on one Llama-2, predict the other's layers: how the form was chosen."""
    lines = ["| fitted on | predicted | GPU | median |error| | worst |error| |", "| --- | --- | --- | --- | --- |"]
    for fitted, predicted in (FITTED, FITTED[::-1]):
        profile = fit(vidur, (fitted,))
        for gpu, coefficients in profile["gpus"].items():
            errors = np.abs(np.concatenate(list(linear_errors(coefficients, load_compute(vidur, gpu, predicted))
                                                .values())))
            lines.append(f"| {fitted.split('/')[1]} | {predicted.split('/')[1]} | {gpu} | "
                         f"{100 * np.median(errors):.1f}% | {100 * errors.max():.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur", default=os.environ.get("VIDUR_DIR"),
                        help="a clone or bare mirror of microsoft/vidur (default $VIDUR_DIR)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="write loadtest/vidur_profile.json")
    what.add_argument("--check", action="store_true", help="check the shipped table; exit 1 if a target is missed")
    what.add_argument("--leave-one-out", action="store_true", help="fit on one Llama-2, predict the other")
    args = parser.parse_args(argv)
    if not args.vidur:
        parser.error("no profiles: give --vidur DIR (a clone of https://github.com/microsoft/vidur) or set VIDUR_DIR")
    vidur = Vidur(args.vidur)
    if args.leave_one_out:
        print(leave_one_out(vidur))
        return 0
    if args.check:
        profile = costmodel.load_profile()
        shipped = costmodel.PROFILE_PATH.relative_to(ROOT)
        print(f"checking the shipped {shipped} (Vidur {profile['source']['commit'][:7]})")
    else:
        profile = fit(vidur)
        print(coefficient_table(profile))
    table, ok = report(vidur, profile)
    print()
    print(table)
    print()
    print("held-out targets (linear: median <= 15%, worst <= 35%; all-reduce within 25%): "
          + ("met" if ok else "MISSED"))
    if args.write:
        costmodel.PROFILE_PATH.write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {costmodel.PROFILE_PATH.relative_to(ROOT)}")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
