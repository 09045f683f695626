"""Streaming against stored rows: time to the first optimizer step, peak resident memory and steady-state
tokens/s, on generated corpora of growing size.

For each size, generates a JSON-lines corpus (random words, documents of uneven length; never committed: it
goes under data/, which git ignores), then runs the training application in fresh processes, with and without
--streaming, on the llama-8m preset and the corpus's own tokenizer, and reports for each run: seconds from the
process start to the first logged step, the peak memory of the process tree (proportional set sizes, summed;
sampled every 50 ms), and the median train/tokens_per_s of the logged steps after --warmup (steady state); per
size, streaming's tokens/s over the stored path's, measured in the same invocation. Streaming's first step and
memory should stay flat as the corpus grows; the stored path tokenizes the whole corpus before its first step.

    python bench/streaming_bench.py --sizes_gb 0.5 1 2 5 --steps 60 --warmup 10   # the issue's figures
    python bench/streaming_bench.py --sizes_gb 0.002 --steps 6 --warmup 2          # a quick check
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(2000)]


def make_corpus(path: Path, size_mb: float, seed: int = 0) -> Path:
    """Documents of 20-400 random words until the file holds `size_mb` megabytes."""
    if path.is_file() and path.stat().st_size >= size_mb * 1e6:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(path, "w") as f:
        while f.tell() < size_mb * 1e6:
            doc = " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))
            f.write(json.dumps({"text": doc}) + "\n")
    return path


def make_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"])
    backend.train_from_iterator([" ".join(WORDS)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(out)
    return out


def run(args: list[str], warmup: int) -> dict:
    """Seconds to the first logged step, peak memory (GiB) of a training run in a fresh process tree, and its
    steady-state tokens/s (the median over the logged steps after `warmup`)."""
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "src" / "training_application.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "2", **_env()},
    )
    peak, first_step = 0, None
    out = Path(args[args.index("--output_dir") + 1])
    while proc.poll() is None:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        peak = max(peak, sum(_rss(p) for p in tree))
        if first_step is None and (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            first_step = time.time() - start
        time.sleep(0.05)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"run failed:\n{output[-3000:]}")
    return {
        "first_step_s": round(first_step or float("nan"), 1),
        "peak_memory_gib": round(peak / 2**30, 2),
        "tokens_per_s": steady_tokens_per_s(out / "metrics.jsonl", warmup),
    }


def steady_tokens_per_s(metrics: Path, warmup: int) -> float:
    """The median train/tokens_per_s of the logged steps after `warmup` (all of them if none is left)."""
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [(m.get("step", 0), m["train/tokens_per_s"]) for m in logged if "train/tokens_per_s" in m]
    steady = [rate for step, rate in rates if step > warmup] or [rate for _, rate in rates]
    return round(statistics.median(steady), 1) if steady else float("nan")


def _rss(process: psutil.Process) -> int:
    """The process's proportional set size where Linux gives it (a loader worker forked from the trainer shares
    its pages: summed RSS would count them twice), else its RSS."""
    try:
        info = process.memory_full_info()
        return getattr(info, "pss", info.rss)
    except psutil.Error:
        return 0


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes_gb", type=float, nargs="+", default=[0.5, 1, 2, 5], help="corpus sizes (GB)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="logged steps left out of the steady state")
    parser.add_argument("--stored_up_to_gb", type=float, default=float("inf"), help="no stored run above this size")
    opts = parser.parse_args()
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
        common = ["--task", "causal_lm", "--model_config", "llama-8m", "--tokenizer_name_or_path", str(tokenizer)]
        common += ["--max_steps", str(opts.steps), "--max_length", "256", "--per_device_train_batch_size", "8"]
        common += ["--logging_steps", "1", "--eval_strategy", "no", "--num_sample_prompts", "0", "--packing", "bfd"]
        common += ["--mixed_precision", "no"]
        for size in opts.sizes_gb:
            corpus = make_corpus(REPO / "data" / "streaming-bench" / f"corpus-{size:g}gb.jsonl", size * 1000)
            results: dict = {"corpus_gb": size}
            for name, extra in (
                ("streaming", ["--streaming", "true", "--dataloader_num_workers", "1"]),
                ("stored", []),
            ):
                if name == "stored" and size > opts.stored_up_to_gb:
                    continue
                out = Path(tmp) / f"{name}-{size:g}"
                cache = ["--cache_dir", str(Path(tmp) / f"cache-{size:g}")]  # the stored path tokenizes afresh
                validation = ["--validation_split_percentage", "1"] if name == "stored" else []
                args = [*common, *extra, *cache, *validation, "--train_file", str(corpus), "--output_dir", str(out)]
                results[name] = run(args, opts.warmup)
            if "stored" in results:
                ratio = results["streaming"]["tokens_per_s"] / results["stored"]["tokens_per_s"]
                results["streaming_over_stored_tokens_per_s"] = round(ratio, 3)
            print(json.dumps(results), flush=True)
            report.append(results)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
