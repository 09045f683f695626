"""The benchmark (`make bench`): our BasicTrainer and AcceleratedTrainer against a minimal PyTorch loop
(the overhead floor) and transformers.Trainer, on the same model, data, sequence length, batch size,
precision, threads and steps; plus tokenization throughput and the optimizations, each on and off;
plus the causal-LM case (bench/lm_bench.py, `--lm false` skips it): sequence packing none / wrapped /
bfd, real tokens/s and validation loss at an equal number of tokens seen; plus the SFT case
(bench/sft_bench.py, `--sft false` skips it): ours with and without packing against
transformers.Trainer and TRL's SFTTrainer, real tokens/s, peak memory and held-out loss; plus the PEFT case
(bench/peft_bench.py, `--peft false` skips it): full fine-tuning vs LoRA vs DoRA, step time, peak memory,
trainable parameters and checkpoint sizes (also written to peft.md).

Every run is a fresh interpreter (bench/worker.py), so peak memory is per run; repetitions are
interleaved across runners so a busy machine slows them all alike. Writes bench/results/latest.json,
latest.md (the table the README links) and latest.png. One process per run; no multi-GPU runs.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import lm_bench
import peft_bench
import sft_bench
import torch
from common import Spec
from report import write_chart, write_markdown

from cloudtrain.config import MIXED_PRECISION
from cloudtrain.hardware import resolve_precision

BENCH = Path(__file__).resolve().parent
RUNNERS = ("basic", "accelerated", "reference", "hf_trainer")
# Each optimization as a change to the BasicTrainer's default settings; the baseline is the BasicTrainer row.
ABLATIONS = {
    "fixed padding (pad to max_length)": {"fixed_padding": True},
    "group_by_length": {"group_by_length": True},
    "2 DataLoader workers + pin_memory": {"num_workers": 2, "pin_memory": True},
    "1 thread": {"threads": 1},
    "glibc allocator defaults (freed memory returned to the OS)": {"keep_freed_memory": False},
    "fp32 (no bf16 autocast)": {"mixed_precision": "no"},
    "bf16 autocast": {"mixed_precision": "bf16"},
    "AdamW for_loop (torch's CPU default)": {"adamw": "for_loop"},
    "AdamW foreach (torch's CUDA default)": {"adamw": "foreach"},
    "AdamW fused": {"adamw": "fused"},
    "torch.compile": {"torch_compile": True},  # last: its compilation is the slowest run
}
METRICS = (
    "train_samples_per_s",
    "train_tokens_per_s",
    "eval_samples_per_s",
    "peak_rss_mb",
    "time_to_first_step_s",
    "accuracy",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the built-in all-MiniLM-L6-v2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_length", type=int, default=64)
    p.add_argument("--eval_samples", type=int, default=160, help="test examples evaluated after training")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads in every run (0: torch's default)")
    p.add_argument(
        "--mixed_precision",
        default="auto",
        choices=MIXED_PRECISION,
        help="the same in every run; auto: what cloudtrain picks on this machine (bf16 where native)",
    )
    p.add_argument("--runners", default=",".join(RUNNERS), help=f"comma-separated, from {', '.join(RUNNERS)}")
    p.add_argument("--ablations", default="all", help="comma-separated names from ABLATIONS, all, or none")
    p.add_argument("--ablation_repetitions", type=int, default=1)
    p.add_argument("--ablation_timeout", type=float, default=600, help="seconds before an ablation run is given up")
    p.add_argument("--data_bench", default="true", choices=("true", "false"))
    lm = lm_bench.LMSettings()
    p.add_argument(
        "--lm",
        default="true",
        choices=("true", "false"),
        help="the causal-LM packing comparison (bench/lm_bench.py; about 2 minutes on 2 cores)",
    )
    p.add_argument("--lm_repetitions", type=int, default=2)
    p.add_argument("--lm_token_budget", type=int, default=lm.token_budget, help="real training tokens per variant")
    p.add_argument("--lm_block_size", type=int, default=lm.block_size, help="tokens per LM row (smaller: tests)")
    p.add_argument("--lm_batch_size", type=int, default=lm.batch_size, help="full LM rows per step (smaller: tests)")
    p.add_argument("--lm_threads", type=int, default=lm.threads, help="torch threads in each LM run (0: default)")
    p.add_argument("--lm_tab", default=None, help="an Orange .tab corpus instead of the Grimm tales (tests)")
    p.add_argument(
        "--sft",
        default="true",
        choices=("true", "false"),
        help="the SFT comparison (bench/sft_bench.py; about 5 minutes on 2 cores)",
    )
    p.add_argument("--sft_repetitions", type=int, default=1)
    p.add_argument("--sft_steps", type=int, default=None, help="optimizer steps per SFT runner (default: its own)")
    p.add_argument(
        "--peft",
        default="true",
        choices=("true", "false"),
        help="full fine-tuning vs LoRA vs DoRA (bench/peft_bench.py; about 8 minutes on 2 cores)",
    )
    p.add_argument("--out", default=str(BENCH / "results"), help="folder for latest.json/.md/.png")
    args = p.parse_args(argv)
    args.runners = [r for r in args.runners.split(",") if r]
    unknown = set(args.runners) - set(RUNNERS)
    names = (
        list(ABLATIONS) if args.ablations == "all" else [] if args.ablations == "none" else args.ablations.split(",")
    )
    unknown |= set(names) - set(ABLATIONS)
    if unknown:
        p.error(f"unknown runner or ablation: {', '.join(sorted(unknown))}")
    args.ablations = names
    args.mixed_precision = resolve_precision(args.mixed_precision)
    return args


def run_worker(spec: Spec, log, timeout: float | None = None) -> dict | None:
    """One run in a fresh interpreter; its output goes to the log, its result comes back as a dict
    (None when it ran past `timeout` seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        try:
            proc = subprocess.run(
                [sys.executable, str(BENCH / "worker.py"), json.dumps(spec.to_dict()), str(result_path)],
                cwd=BENCH,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            print(f"  gave up after {timeout:.0f}s", flush=True)
            return None
        if proc.returncode != 0:
            raise SystemExit(f"benchmark run {spec.runner} failed (exit {proc.returncode}); see {log.name}")
        return json.loads(result_path.read_text())


def summarize(runs: list[dict]) -> dict | None:
    """Median, min and max of each metric over the repetitions (None if none finished)."""
    runs = [r for r in runs if r is not None]
    if not runs:
        return None
    return {
        m: {
            "median": statistics.median(r[m] for r in runs),
            "min": min(r[m] for r in runs),
            "max": max(r[m] for r in runs),
        }
        for m in METRICS
    }


def measure(reps: int, variants: dict[str, Spec], log, timeout: float | None = None) -> dict[str, dict]:
    """Interleaved repetitions of every variant, in an order rotated each repetition;
    {name: {"runs": [...], "summary": {...}}}."""
    runs: dict[str, list] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(reps):
        shift = rep % max(len(names), 1)
        for name in names[shift:] + names[:shift]:  # rotated: no runner always goes first
            spec = variants[name]
            print(f"[{time.strftime('%H:%M:%S')}] repetition {rep + 1}/{reps}: {name}", flush=True)
            runs[name].append(run_worker(spec, log, timeout))
    return {name: {"spec": variants[name].to_dict(), "runs": r, "summary": summarize(r)} for name, r in runs.items()}


def measure_lm(args: argparse.Namespace, log) -> dict:
    """The causal-LM packing comparison; {"skipped": reason} when its corpus cannot be fetched."""
    settings = replace(
        lm_bench.LMSettings(),
        token_budget=args.lm_token_budget,
        block_size=args.lm_block_size,
        batch_size=args.lm_batch_size,
        threads=args.lm_threads,
        mixed_precision=args.mixed_precision,
        tab=args.lm_tab,
    )
    if not args.lm_tab:
        import lm_corpus

        try:
            lm_corpus.fetch_grimm()
        except RuntimeError as err:  # no registry: the rest of the benchmark still stands
            print(f"causal-LM comparison skipped: {err}", flush=True)
            return {"skipped": str(err)}
    return lm_bench.run(settings, args.lm_repetitions, log)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.model is None:
        from cloudtrain.assets import default_model_dir

        args.model = default_model_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Spec(
        runner="basic",
        model=args.model,
        steps=args.steps,
        batch_size=args.batch_size,
        max_length=args.max_length,
        eval_samples=args.eval_samples,
        threads=args.threads,
        mixed_precision=args.mixed_precision,
    )
    phases = {}
    with open(out / "latest.log", "w") as log:
        data = run_worker(replace(base, runner="data"), log) if args.data_bench == "true" else None
        runners = measure(args.repetitions, {r: replace(base, runner=r) for r in args.runners}, log)
        phases["comparison_s"] = time.perf_counter() - start
        changed = {n: replace(base, **ABLATIONS[n]) for n in args.ablations}
        changed = {n: spec for n, spec in changed.items() if spec != base}  # e.g. bf16 when that is the default
        ablations = measure(args.ablation_repetitions, changed, log, timeout=args.ablation_timeout)
        phases["ablations_s"] = time.perf_counter() - start - phases["comparison_s"]
        lm = None
        if args.lm == "true":
            lm_start = time.perf_counter()
            lm = measure_lm(args, log)
            phases["lm_s"] = time.perf_counter() - lm_start
        sft_text, sft = "", None
        if args.sft == "true":
            sft_start = time.perf_counter()
            sft_text, sft = sft_bench.run_section(args.sft_repetitions, args.sft_steps, log=log)
            phases["sft_s"] = time.perf_counter() - sft_start
        peft_text, peft = "", None
        if args.peft == "true":
            peft_start = time.perf_counter()
            peft_text, peft = peft_bench.run_section(log=log)
            phases["peft_s"] = time.perf_counter() - peft_start
    reference = runners.get("reference", {}).get("summary")
    for entry in runners.values():
        entry["vs_reference"] = (
            (entry["summary"]["train_samples_per_s"]["median"] / reference["train_samples_per_s"]["median"])
            if reference
            else None
        )
    baseline = runners.get("basic", {}).get("summary")
    for entry in ablations.values():
        entry["vs_baseline"] = (
            (entry["summary"]["train_samples_per_s"]["median"] / baseline["train_samples_per_s"]["median"])
            if baseline and entry["summary"]
            else None
        )
    results = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "data_processing": data,
        "runners": runners,
        "ablations": ablations,
        "lm": lm,
        "sft": sft,
        "peft": peft,
        "phases": phases,
        "wall_s": time.perf_counter() - start,
    }
    (out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, out / "latest.md")
    if sft_text:
        with open(out / "latest.md", "a") as md:
            md.write("\n" + sft_text.rstrip() + "\n")
    if peft_text:
        (out / "peft.md").write_text(peft_text)
        with open(out / "latest.md", "a") as md:
            md.write("\n" + peft_text.rstrip() + "\n")
    write_chart(results, out / "latest.png")
    print((out / "latest.md").read_text())
    print(f"benchmark finished in {results['wall_s']:.0f}s; results in {out}")
    return results


if __name__ == "__main__":
    main()
