"""GPU benchmark (`make gpu-bench`): pretrain a ~0.5B Llama from the llama-600m preset through the real
application and report tokens/s, MFU and peak GPU memory next to the planner's estimate.

What runs, once per attention kernel (sdpa, and flash_attention_2 when the flash-attn package is
installed), each in a fresh process so that peak memory is that run's alone:

- the corpus: Grimm's tales split into paragraphs (bench/lm_corpus.py; fetched at set-up, the GPU
  machine needs no network once data/grimm/ is there) and a byte-level BPE tokenizer trained on them
  (--vocab_size is an upper bound: the corpus supports about 7.5k tokens; the application rounds
  the model's vocabulary up to a multiple of 64);
- the model: `--model_config llama-600m` (random weights from the seed, nothing downloaded), bf16
  autocast over fp32 master weights, --packing bfd (whole paragraphs per row, kept apart by
  restarting position_ids), rows of --max_length tokens, fused AdamW, no gradient checkpointing;
- `cloudtrain.pipeline.build_run(cfg)` then `run.trainer.fit()`: the application's own loop, which
  logs train/tokens_per_s (real, non-padding tokens) and, on GPUs whose peak it knows
  (cloudtrain.observe.flops.PEAK_FLOPS), train/mfu to <output_dir>/metrics.jsonl. Reported:
  the medians over the logging intervals after the first (warm-up), the peak of
  torch.cuda.max_memory_allocated / max_memory_reserved over fit(), and the validation loss.

The planner (`python src/training_application.py plan --task causal_lm --model_config llama-600m
--tokenizer_name_or_path ... --json`) is run as a user runs it, for the same micro-batch, length and
precision; its single-GPU DDP row without checkpointing is printed beside the measurement (total,
and total without its overhead term: the 1 GiB CUDA context, DDP's gradient buckets, which one
process does not allocate, and 5% fragmentation). Where the planner cannot plan a causal LM the
line reads "planner estimate: n/a" with the reason.

    python bench/gpu.py [--steps 300] [--batch_size 8] [--max_length 2048] [--attention auto]
    python bench/gpu.py --dry_run      # the same code path, tiny, on CPU: llama-8m, 2 steps

Without CUDA (and without --dry_run / --device cpu) it prints one line and exits with status 2.
Results also go to bench/results/gpu.json (not committed).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ENTRY = REPO / "src" / "training_application.py"
GIB = 2**30
KERNELS = ("sdpa", "flash_attention_2")
DRY_RUN = {
    "device": "cpu",
    "preset": "llama-8m",
    "steps": 2,
    "batch_size": 2,
    "max_length": 64,
    "logging_steps": 1,
    "vocab_size": 512,
    "attention": "sdpa",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-600m", help="a model preset or config.json (--model_config)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=8, help="rows per step (one GPU, no accumulation)")
    p.add_argument("--max_length", type=int, default=2048, help="tokens per row")
    p.add_argument("--packing", default="bfd", choices=("bfd", "wrapped", "none"))
    p.add_argument(
        "--attention",
        default="auto",
        help="comma-separated kernels, or auto: sdpa, plus flash_attention_2 where flash-attn is installed",
    )
    p.add_argument("--vocab_size", type=int, default=32000, help="BPE vocabulary requested (an upper bound)")
    p.add_argument("--learning_rate", type=float, default=3e-4)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--mixed_precision", default="bf16", choices=("bf16", "fp16", "no"))
    p.add_argument("--gradient_checkpointing", default="false", choices=("true", "false"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: only to test this script")
    p.add_argument(
        "--dry_run",
        action="store_true",
        help=f"the same code path, tiny, on CPU: {', '.join(f'--{k} {v}' for k, v in DRY_RUN.items())}",
    )
    p.add_argument("--tab", default=None, help="an Orange .tab corpus instead of the Grimm tales (tests)")
    p.add_argument("--out", default=str(BENCH / "results" / "gpu.json"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds before one kernel's run is given up")
    args = p.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    if min(args.steps, args.batch_size, args.logging_steps) < 1 or args.max_length < 2:
        p.error("--steps, --batch_size and --logging_steps must be at least 1, --max_length at least 2")
    return args


def kernels(choice: str) -> list[str]:
    """The attention kernels to run: the named ones, or sdpa (+ flash_attention_2 when it can run here)."""
    if choice != "auto":
        names = [k for k in choice.split(",") if k]
        unknown = set(names) - set(KERNELS)
        if unknown or not names:
            raise SystemExit(f"error: --attention takes auto or names from {', '.join(KERNELS)}")
        return names
    from transformers.utils import is_flash_attn_2_available

    return ["sdpa"] + (["flash_attention_2"] if is_flash_attn_2_available() else [])


# ---------------------------------------------------------------- one kernel (a fresh process)
def train_one(spec: dict) -> dict:
    """build_run + fit through the application; tokens/s and MFU from its metrics.jsonl, peak memory."""
    import resource

    import torch

    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import read_metrics
    from cloudtrain.pipeline import build_run

    cuda = torch.cuda.is_available()
    out = Path(spec["output_dir"])
    cfg = build_config(
        {
            "task": "causal_lm",
            "model_config": spec["preset"],
            "tokenizer_name_or_path": spec["tokenizer"],
            "train_file": spec["train_file"],
            "validation_file": spec["validation_file"],
            "packing": spec["packing"],
            "max_length": spec["max_length"],
            "per_device_train_batch_size": spec["batch_size"],
            "per_device_eval_batch_size": spec["batch_size"],
            "max_steps": spec["steps"],
            "logging_steps": spec["logging_steps"],
            "learning_rate": spec["learning_rate"],
            "warmup_ratio": 0.05,
            "lr_scheduler_type": "cosine",
            "weight_decay": 0.1,
            "mixed_precision": spec["mixed_precision"],
            "attn_implementation": spec["attention"],
            "gradient_checkpointing": spec["gradient_checkpointing"],
            "eval_strategy": "no",
            "report_to": ["none"],
            "sample_prompts": ["Once upon a time"],
            "sample_max_new_tokens": 1,
            "output_dir": str(out),
            "overwrite_output_dir": True,
            "training_type": "accelerated",
            "seed": 42,
        }
    )
    run = build_run(cfg)
    params = sum(p.numel() for p in run.model.parameters())
    rows = run.data.train
    fill = sum(sum(n) for n in rows["seq_lengths"]) / (len(rows) * spec["max_length"])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = run.trainer.fit()
    if cuda:
        torch.cuda.synchronize()
    fit_s = time.perf_counter() - start
    peak = (
        {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()} if cuda else None
    )
    metrics = run.trainer.evaluate("validation")
    logged = [r for r in read_metrics(run.run_log.path) if "train/tokens_per_s" in r]
    steady = logged[1:] or logged  # the first interval holds the warm-up (allocator, cuBLAS autotuning)
    mfu = [r["train/mfu"] for r in steady if "train/mfu" in r]
    return {
        "attention": spec["attention"],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "device_memory": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "parameters": params,
        "vocab_size": run.model.config.vocab_size,
        "train_rows": len(rows),
        "row_fill": fill,
        "steps": result.global_step,
        "fit_s": fit_s,
        "train_tokens": result.train_tokens,
        "tokens_per_s": statistics.median(r["train/tokens_per_s"] for r in steady),
        "samples_per_s": statistics.median(r["train/samples_per_s"] for r in steady),
        "mfu": statistics.median(mfu) if mfu else None,
        "logging_intervals": len(logged),
        "first_loss": logged[0]["train/loss"],
        "last_loss": logged[-1]["train/loss"],
        "eval_loss": metrics["loss"],
        "peak_memory": peak,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_one(spec: dict, timeout: float) -> dict:
    """One kernel in a fresh interpreter; a failure is reported, not raised (the other kernels still run)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--_one", json.dumps(spec), str(result)],
                cwd=REPO,
                timeout=timeout,
                stdout=sys.stderr,
                stderr=subprocess.STDOUT,
            )
        except subprocess.TimeoutExpired:
            return {"attention": spec["attention"], "error": f"gave up after {timeout:.0f}s"}
        if proc.returncode != 0 or not result.is_file():
            error = result.with_suffix(".err")
            reason = error.read_text().strip() if error.is_file() else f"exit {proc.returncode}"
            return {"attention": spec["attention"], "error": reason}
        return json.loads(result.read_text())


def _one_main(spec_json: str, result_path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        result = train_one(json.loads(spec_json))
    except BaseException as err:  # its one line goes to the report; the traceback to the log
        Path(result_path).with_suffix(".err").write_text(
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"
        )
        raise
    Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- the planner
def planner_estimate(args: argparse.Namespace, tokenizer_dir: Path, gpu_memory_gb: float) -> dict:
    """The planner's single-GPU DDP row for this run, through its command line; {"error": ...} when it
    cannot plan a causal LM (yet)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            str(ENTRY),
            "plan",
            "--task",
            "causal_lm",
            "--model_config",
            args.preset,
            "--tokenizer_name_or_path",
            str(tokenizer_dir),
            "--num_gpus",
            "1",
            "--gpu_memory_gb",
            f"{gpu_memory_gb:g}",
            "--per_device_train_batch_size",
            str(args.batch_size),
            "--max_length",
            str(args.max_length),
            "--mixed_precision",
            args.mixed_precision,
            "--json",
            "--output_dir",
            tmp,
        ]
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
    return {
        "total": estimate["total"],
        "overhead": estimate["overhead"],
        "without_overhead": estimate["total"] - estimate["overhead"],
        "parts": {
            k: estimate.get(k, 0)
            for k in ("parameters", "gradients", "optimizer_states", "activations", "logits", "overhead")
        },
        "parameters": plan["model"].get("num_params"),
        "fits": row["fits"],
    }


# ---------------------------------------------------------------- report
def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def render(report: dict) -> str:
    a, plan = report["settings"], report["planner"]
    lines = [
        f"{a['preset']} (random weights), bf16 autocast"
        if a["mixed_precision"] == "bf16"
        else f"{a['preset']} (random weights), precision {a['mixed_precision']}",
        f"  packing {a['packing']}, {a['batch_size']} rows x {a['max_length']} tokens per step, {a['steps']} "
        f"steps, on {report['device']}; corpus: {report['corpus']['train_documents']} Grimm paragraphs, "
        f"tokenizer {report['corpus']['vocab_size']} tokens",
        "",
    ]
    header = (
        "attention",
        "params",
        "tokens/s",
        "MFU",
        "peak alloc GiB",
        "peak reserved GiB",
        "train loss",
        "eval loss",
    )
    table = [header]
    for r in (r for r in report["runs"] if "error" not in r):
        peak = r["peak_memory"] or {}
        table.append(
            (
                r["attention"],
                f"{r['parameters'] / 1e6:.0f}M",
                f"{r['tokens_per_s']:,.0f}",
                "n/a (no GPU peak known)" if r["mfu"] is None else f"{r['mfu']:.1%}",
                _gib(peak.get("allocated")),
                _gib(peak.get("reserved")),
                f"{r['first_loss']:.2f} -> {r['last_loss']:.2f}",
                f"{r['eval_loss']:.3f}",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines += [f"{r['attention']}: failed: {r['error']}" for r in report["runs"] if "error" in r] + [""]
    if "error" in plan:
        lines.append(f"planner estimate: n/a ({plan['error']})")
    else:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in plan["parts"].items() if v)
        lines.append(
            f"planner estimate (1 GPU, DDP row, checkpointing {a['gradient_checkpointing']}): "
            f"{plan['total'] / GIB:.2f} GiB in all, {plan['without_overhead'] / GIB:.2f} GiB without "
            f"its overhead term (CUDA context, DDP buckets, fragmentation) [{parts}]"
        )
        measured = [r for r in report["runs"] if "error" not in r and r["peak_memory"]]
        for r in measured:
            allocated = r["peak_memory"]["allocated"]
            lines.append(
                f"  {r['attention']}: measured peak allocated {allocated / GIB:.2f} GiB = "
                f"{allocated / plan['without_overhead']:.0%} of the estimate without overhead"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: this process and its children
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu.py needs a CUDA GPU and none is visible here; on CPU, `--dry_run` runs the same code path tiny",
            file=sys.stderr,
        )
        return 2
    import lm_corpus

    corpus = lm_corpus.prepare(args.vocab_size, Path(args.tab) if args.tab else None)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for kernel in kernels(args.attention):
            print(f"[{time.strftime('%H:%M:%S')}] {args.preset}, attention {kernel}: {args.steps} steps", flush=True)
            spec = {
                "preset": args.preset,
                "tokenizer": str(corpus.tokenizer_dir),
                "train_file": str(corpus.train_file),
                "validation_file": str(corpus.validation_file),
                "packing": args.packing,
                "max_length": args.max_length,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "logging_steps": args.logging_steps,
                "learning_rate": args.learning_rate,
                "mixed_precision": args.mixed_precision,
                "attention": kernel,
                "gradient_checkpointing": args.gradient_checkpointing == "true",
                "output_dir": str(Path(tmp) / kernel),
            }
            runs.append(run_one(spec, args.timeout))
    # The device as the runs saw it: this process never initialises CUDA (its context would hold GPU memory).
    done = [r for r in runs if "error" not in r]
    device = done[0]["device"] if done else args.device
    memory = done[0]["device_memory"] if done and done[0]["device_memory"] else 80 * GIB
    plan = planner_estimate(args, corpus.tokenizer_dir, memory / GIB)
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "timeout")},
        "device": device,
        "corpus": {
            "train_documents": corpus.train_documents,
            "vocab_size": corpus.vocab_size,
            "tokenizer": corpus.tokenizer_source,
        },
        "runs": runs,
        "planner": plan,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    print(f"results in {out}")
    return 0 if any("error" not in r for r in runs) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_one":
        _one_main(*sys.argv[2:4])
    else:
        sys.exit(main())
