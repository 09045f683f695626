"""Streaming against stored rows: time to the first optimizer step, peak resident memory and steady-state
tokens/s, on generated corpora of growing size.

For each size, generates a JSON-lines corpus (random words, documents of uneven length; never committed: it
goes under data/, which git ignores; the largest is generated, the smaller ones are its prefixes), then runs
the training application in fresh processes, with and without --streaming, on the llama-8m preset and the
corpus's own tokenizer, and reports for each run: seconds from the process start to the first logged step
and to the trainer's banner (the model built and the data ready: before it come imports and setup, the same
for both paths, plus the stored path's tokenizing), the peak memory of the process tree (proportional set
sizes, summed; sampled every 50 ms), the median train/tokens_per_s of the logged steps after --warmup (steady
state), the seconds the first step waited for its batch and the median share of step time spent waiting for
data (what the input path costs, whatever the machine's load); per size, streaming's tokens/s over the stored
path's, measured in the same invocation. With --repeats N the two paths run N times, alternating, the order
flipped every pair (a shared machine's load drifts: each ratio is taken over runs next to each other), and the
median of the per-pair ratios is reported with their spread; every run's line gives the load average at its
end. Streaming's first step and memory should stay flat as the corpus grows; the stored path tokenizes the
whole corpus before its first step.

Separate runs see different loads on a shared machine (2x within minutes), which no number of repeats here
averages away cheaply: for the steady-state tokens/s ratio, bench/streaming_throughput.py interleaves the
two paths in one process in blocks of a few steps and also counts tokens per CPU second.

    python bench/streaming_bench.py --sizes_gb 0.5 1 2 5 --steps 60 --warmup 10   # the issue's figures
    python bench/streaming_bench.py --sizes_gb 0.002 --steps 6 --warmup 2          # a quick check
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(2000)]


def make_corpus(path: Path, size_mb: float, unique_mb: float = 1000, seed: int = 0) -> Path:
    """Documents of 20-400 random words until the file holds `size_mb` megabytes. Past `unique_mb` the
    documents repeat the first `unique_mb` megabytes' (generating text costs about a minute per 300 MB on a
    shared core; the stream reads and tokenizes every byte all the same)."""
    if path.is_file() and path.stat().st_size >= size_mb * 1e6:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    unique = path.with_name(f"unique-{min(size_mb, unique_mb):g}mb-seed{seed}.jsonl")
    if not (unique.is_file() and unique.stat().st_size >= min(size_mb, unique_mb) * 1e6):
        rng = random.Random(seed)
        with open(unique, "w") as f:
            while f.tell() < min(size_mb, unique_mb) * 1e6:
                doc = " ".join(rng.choices(WORDS, k=rng.randint(20, 400)))
                f.write(json.dumps({"text": doc}) + "\n")
    if size_mb <= unique_mb:
        unique.rename(path)
        return path
    with open(path, "wb") as dst:
        while dst.tell() < size_mb * 1e6:
            with open(unique, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 24)
    return path


def prefix_corpus(source: Path, path: Path, size_mb: float) -> Path:
    """The first whole lines of `source` holding `size_mb` megabytes (a smaller corpus without generating it)."""
    if path.is_file() and path.stat().st_size >= size_mb * 1e6:
        return path
    with open(source, "rb") as src, open(path, "wb") as dst:
        left = int(size_mb * 1e6)
        while left > 0:
            chunk = src.read(min(left, 1 << 24))
            if not chunk:
                break
            dst.write(chunk)
            left -= len(chunk)
        dst.write(src.readline())  # finish the last document
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
    """Seconds to the first logged step and to the trainer's banner, peak memory (GiB) of a training run in a
    fresh process tree, and its steady-state tokens/s (the median over the logged steps after `warmup`)."""
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-u", str(REPO / "src" / "training_application.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "2",
        },
    )
    lines: list[str] = []
    ready: list[float] = []  # when the trainer's banner came: the model is built and the data ready

    def read() -> None:
        for line in proc.stdout or []:
            if not ready and "Trainer: " in line:
                ready.append(time.time() - start)
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak, first_step = 0, None
    out = Path(args[args.index("--output_dir") + 1])
    while proc.poll() is None:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        peak = max(peak, sum(_rss(p) for p in tree))
        if first_step is None and (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            first_step = time.time() - start
        time.sleep(0.05)
    reader.join()
    if proc.returncode:
        raise SystemExit(f"run failed:\n{''.join(lines)[-3000:]}")
    first = first_step or float("nan")
    return {
        "first_step_s": round(first, 1),
        "ready_s": round(ready[0], 1) if ready else None,
        "first_step_after_ready_s": round(first - ready[0], 1) if ready else None,
        "peak_memory_gib": round(peak / 2**30, 2),
        "tokens_per_s": steady_tokens_per_s(out / "metrics.jsonl", warmup),
        **data_wait(out / "metrics.jsonl", warmup),
        "loadavg_1min": round(os.getloadavg()[0], 2),  # the machine's other load, at the run's end
    }


def steady_tokens_per_s(metrics: Path, warmup: int) -> float:
    """The median train/tokens_per_s of the logged steps after `warmup` (all of them if none is left)."""
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [(m.get("step", 0), m["train/tokens_per_s"]) for m in logged if "train/tokens_per_s" in m]
    steady = [rate for step, rate in rates if step > warmup] or [rate for _, rate in rates]
    return round(statistics.median(steady), 1) if steady else float("nan")


def data_wait(metrics: Path, warmup: int) -> dict:
    """Seconds the first step waited for its batch, and the median share of step time spent waiting for data
    after `warmup` (the trainer's train/data_time_share): what the input path costs, whatever the load."""
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [m for m in logged if "train/data_time_share" in m and "train/step_time_s" in m]
    if not steps:
        return {}
    steady = [m["train/data_time_share"] for m in steps if m["step"] > warmup] or [steps[-1]["train/data_time_share"]]
    return {
        "first_step_data_s": round(steps[0]["train/step_time_s"] * steps[0]["train/data_time_share"], 2),
        "steady_data_share": round(statistics.median(steady), 5),
    }


def _rss(process: psutil.Process) -> int:
    """The process's proportional set size where Linux gives it (a loader worker forked from the trainer shares
    its pages: summed RSS would count them twice), else its RSS."""
    try:
        info = process.memory_full_info()
        return getattr(info, "pss", info.rss)
    except psutil.Error:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes_gb", type=float, nargs="+", default=[0.5, 1, 2, 5], help="corpus sizes (GB)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="logged steps left out of the steady state")
    parser.add_argument("--stored_up_to_gb", type=float, default=float("inf"), help="no stored run above this size")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each path per size, alternating")
    parser.add_argument("--workers", type=int, default=0, help="streaming's --dataloader_num_workers")
    opts = parser.parse_args()
    report = []
    folder = REPO / "data" / "streaming-bench"
    largest = make_corpus(folder / f"corpus-{max(opts.sizes_gb):g}gb.jsonl", max(opts.sizes_gb) * 1000)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
        common = ["--task", "causal_lm", "--model_config", "llama-8m", "--tokenizer_name_or_path", str(tokenizer)]
        common += ["--max_steps", str(opts.steps), "--max_length", "256", "--per_device_train_batch_size", "8"]
        common += ["--logging_steps", "1", "--eval_strategy", "no", "--num_sample_prompts", "0", "--packing", "bfd"]
        common += ["--mixed_precision", "no"]
        for size in opts.sizes_gb:
            corpus = prefix_corpus(largest, folder / f"corpus-{size:g}gb.jsonl", size * 1000)
            runs: dict[str, list[dict]] = {"streaming": [], "stored": []}
            for repeat in range(opts.repeats):
                paths = [
                    ("streaming", ["--streaming", "true", "--dataloader_num_workers", str(opts.workers)]),
                    ("stored", []),
                ]
                for name, extra in paths if repeat % 2 == 0 else paths[::-1]:  # AB, BA, ...: drift cancels
                    if name == "stored" and size > opts.stored_up_to_gb:
                        continue
                    out = Path(tmp) / f"{name}-{size:g}-{repeat}"
                    cache = ["--cache_dir", str(Path(tmp) / f"cache-{size:g}-{repeat}")]  # tokenized afresh
                    validation = ["--validation_split_percentage", "1"] if name == "stored" else []
                    args = [*common, *extra, *cache, *validation, "--train_file", str(corpus), "--output_dir", str(out)]
                    runs[name].append(run(args, opts.warmup))
                    shutil.rmtree(Path(tmp) / f"cache-{size:g}-{repeat}", ignore_errors=True)
                    print(json.dumps({"corpus_gb": size, "path": name, "repeat": repeat, **runs[name][-1]}), flush=True)
            results: dict = {"corpus_gb": size, **{name: r for name, r in runs.items() if r}}
            if runs["stored"]:
                pairs = [
                    s["tokens_per_s"] / m["tokens_per_s"]
                    for s, m in zip(runs["streaming"], runs["stored"], strict=True)
                ]
                results["streaming_over_stored_tokens_per_s"] = [round(r, 3) for r in pairs]
                results["median_ratio"] = round(statistics.median(pairs), 3)
                results["ratio_min_max"] = [round(min(pairs), 3), round(max(pairs), 3)]
            print(json.dumps(results), flush=True)
            report.append(results)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
