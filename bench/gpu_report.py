"""bench/gpu.py's planner estimates and report: each variant's measured peak against the planner's estimate for
the same options (the plan command run as a user runs it), the ratios to the plain loop, and the markdown copy.

A variant's planner options (`planner_options`): the application's variants pass on the options the plan
command takes (`PLANNED`); a compiled run has no Liger modules under --liger_kernels auto; the plain loop is
planned as what it runs (full causal rows with no mask: no dense mask, the model's own modules, the full
logits), the HF Trainer as transformers runs packed rows (sdpa with a dense mask).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "src" / "training_application.py"
GIB = 2**30
PLANNED = ("attn_implementation", "fused_cross_entropy", "liger_kernels")  # run options the plan command takes
OWN_MODULES = {"fused_cross_entropy": "false", "liger_kernels": "false"}
FLOORS = {
    "plain": {"attn_implementation": "varlen", **OWN_MODULES},  # varlen keeps what a maskless sdpa keeps
    "hf_trainer": {"attn_implementation": "sdpa", **OWN_MODULES},
}


def planner_options(run: dict) -> dict:
    """The plan command's options for this variant (see the module's docstring)."""
    if run["runner"] in FLOORS:
        return dict(FLOORS[run["runner"]])
    options = {k: str(v).lower() for k, v in run["options"].items() if k in PLANNED}
    if str(run["options"].get("torch_compile", "false")).lower() == "true":
        options.setdefault("liger_kernels", "false")  # auto leaves Liger's modules to the compiler
    return options


def planner_estimates(args: argparse.Namespace, runs: list[dict], tokenizer_dir: Path, memory_gb: float) -> dict:
    """{options as JSON: the planner's estimate}, one plan per distinct set of options among `runs`, in parallel."""
    keys = sorted({json.dumps(planner_options(r), sort_keys=True) for r in runs})
    with ThreadPoolExecutor(max_workers=max(1, len(keys))) as pool:
        found = pool.map(lambda key: planner_estimate(args, tokenizer_dir, memory_gb, json.loads(key)), keys)
        return dict(zip(keys, found, strict=True))


def planner_estimate(args: argparse.Namespace, tokenizer_dir: Path, gpu_memory_gb: float, options: dict) -> dict:
    """The planner's single-GPU DDP row for this run with `options`, through its command line; {"error": ...}
    when it cannot plan a causal LM."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(ENTRY), "plan", "--task", "causal_lm", "--model_config", args.preset]
        command += ["--tokenizer_name_or_path", str(tokenizer_dir), "--num_gpus", "1"]
        command += ["--gpu_memory_gb", f"{gpu_memory_gb:g}", "--per_device_train_batch_size", str(args.batch_size)]
        command += ["--max_length", str(args.max_length), "--mixed_precision", args.mixed_precision]
        command += ["--packing", args.packing]  # bfd plans the varlen kernel (no dense mask), as the defaults run
        command += [arg for k, v in options.items() for arg in (f"--{k}", v)]
        command += ["--json", "--output_dir", tmp]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}  # the planner needs no GPU
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1][:300] if lines else f"exit {proc.returncode}"}
    try:
        plan = json.loads(proc.stdout)
        checkpointing = args.gradient_checkpointing == "true"
        row = next(
            r for r in plan["strategies"] if r["strategy"] == "ddp" and r["gradient_checkpointing"] == checkpointing
        )
    except (ValueError, KeyError, StopIteration) as err:
        return {"error": f"unexpected planner output ({type(err).__name__})"}
    estimate = row["estimate"]
    if plan["model"].get("vocab_size", 1) == 0 or plan["model"].get("task", "causal_lm") != "causal_lm":
        return {"error": "the planner estimated a classification model, not the causal LM"}
    parts = ("parameters", "gradients", "optimizer_states", "activations", "logits", "overhead")
    return {
        "options": options,
        "total": estimate["total"],
        "overhead": estimate["overhead"],
        "without_overhead": estimate["total"] - estimate["overhead"],
        "parts": {k: estimate.get(k, 0) for k in parts},
        "parameters": plan["model"].get("num_params"),
        "fits": row["fits"],
    }


def attach_planner(report: dict, estimates: dict) -> None:
    """Each ok run's own estimate (`planner`), and the report's `planner`: the defaults' (the first run's)."""
    for run in report["runs"]:
        if run.get("status") == "ok":
            run["planner"] = estimates[json.dumps(planner_options(run), sort_keys=True)]
    report["planner"] = estimates.get(json.dumps({}), next(iter(estimates.values())))


# ---------------------------------------------------------------- report
def compare(report: dict) -> None:
    """Each run's tokens/s over the plain loop's, and peak memory over the defaults'."""
    ok = {r["variant"]: r for r in report["runs"] if r.get("status") == "ok"}
    plain, base = ok.get("plain"), next((r for r in report["runs"] if r.get("runner") == "cloudtrain"), None)
    for r in ok.values():
        r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain else None
        base_peak = (base or {}).get("peak_memory") if base and base.get("status") == "ok" else None
        mine = r.get("peak_memory")
        r["memory_vs_defaults"] = mine["allocated"] / base_peak["allocated"] if mine and base_peak else None


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def render(report: dict) -> str:
    a = report["settings"]
    peak = report.get("peak_flops")
    lines = [
        f"{a['preset']} (random weights), precision {a['mixed_precision']}, packing {a['packing']}, "
        f"{a['batch_size']} rows x {a['max_length']} tokens per step, {a['steps']} timed steps, on {report['device']}",
        f"corpus: {report['corpus']['train_documents']} Grimm paragraphs, tokenizer {report['corpus']['vocab_size']}"
        f" tokens; MFU against {f'{peak / 1e12:.0f} TFLOP/s' if peak else report.get('peak_note') or 'no peak'}",
        "",
    ]
    header = ("variant", "tokens/s", "vs plain", "MFU", "peak alloc GiB", "reserved GiB", "loss @ steps", "eval loss")
    header += ("wall s", "loop s")
    table = [header]
    runs = report["runs"]
    for r in (r for r in runs if r.get("status") == "ok"):
        peak_mem = r.get("peak_memory") or {}
        table.append(
            (
                r["variant"],
                f"{r['tokens_per_s']:,.0f}",
                "n/a" if r.get("vs_plain") is None else f"{r['vs_plain']:.2f}x",
                _pct(r.get("mfu")),
                _gib(peak_mem.get("allocated")),
                _gib(peak_mem.get("reserved")),
                "n/a" if r.get("loss_at_steps") is None else f"{r['loss_at_steps']:.3f}",
                f"{r['eval_loss']:.3f}",
                "n/a" if r.get("wall_s") is None else f"{r['wall_s']:.0f}",
                "n/a" if r.get("fit_s") is None else f"{r['fit_s']:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines += [f"{r['variant']}: {r['error']}" for r in runs if r.get("status") != "ok"] + [""]
    lines += _planner_lines(a, report["planner"], runs) + [""]
    from cloudtrain.observe.profile import summary_line

    lines += [f"profile {r['variant']}: {summary_line(r['profile'])}" for r in runs if r.get("profile")]
    return "\n".join(lines).rstrip()


def _planner_lines(a: dict, plan: dict, runs: list[dict]) -> list[str]:
    if "error" in plan:
        return [f"planner estimate: n/a ({plan['error']})"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in plan["parts"].items() if v)
    planned = " ".join(f"--{k} {v}" for k, v in (plan.get("options") or {}).items()) or "the defaults"
    lines = [
        f"planner estimate (1 GPU, DDP row, checkpointing {a['gradient_checkpointing']}, {planned}): "
        f"{plan['total'] / GIB:.2f} GiB in all, {plan['without_overhead'] / GIB:.2f} GiB without "
        f"its overhead term (CUDA context, DDP buckets, fragmentation) [{parts}]"
    ]
    for r in (r for r in runs if r.get("status") == "ok" and r.get("peak_memory")):
        own = r.get("planner") or plan
        if "error" in own:
            lines.append(f"  {r['variant']}: planner n/a ({own['error']})")
            continue
        allocated, options = r["peak_memory"]["allocated"], own.get("options")
        planned = " ".join(f"--{k} {v}" for k, v in (options or {}).items()) or "the defaults"
        lines.append(
            f"  {r['variant']}: measured peak allocated {allocated / GIB:.2f} GiB = "
            f"{allocated / own['without_overhead']:.0%} of the estimate without overhead"
            + (f" ({own['without_overhead'] / GIB:.2f} GiB, planned with {planned})" if options is not None else "")
        )
    return lines


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text("# bench/gpu.py\n\n```\n" + render(report) + "\n```\n")
