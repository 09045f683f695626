"""Streaming against stored rows: time to the first optimizer step and peak resident memory, on a generated corpus.

Generates a JSON-lines corpus of the asked size (random words, documents of uneven length; never committed:
it goes under data/, which git ignores), then runs the training application twice in fresh processes, with
and without --streaming, on the llama-8m preset and the corpus's own tokenizer (trained here on a sample),
for a few steps, and reports for each: seconds from the process start to the first logged step, and the peak
resident memory of the process tree (sampled every 50 ms).

    python bench/streaming_bench.py --size_mb 200 [--steps 5] [--skip_stored]
"""

import argparse
import json
import random
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


def make_tokenizer(corpus: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"])
    backend.train_from_iterator([" ".join(WORDS)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(out)
    return out


def run(args: list[str]) -> dict:
    """Seconds to the first logged step and peak RSS (GiB) of a training run in a fresh process tree."""
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
    return {"first_step_s": round(first_step or float("nan"), 1), "peak_rss_gib": round(peak / 2**30, 2)}


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.Error:
        return 0


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size_mb", type=float, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip_stored", action="store_true", help="only the streaming run (a large corpus)")
    opts = parser.parse_args()
    corpus = make_corpus(REPO / "data" / "streaming-bench" / f"corpus-{opts.size_mb:g}mb.jsonl", opts.size_mb)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(corpus, Path(tmp) / "tokenizer")
        common = ["--task", "causal_lm", "--model_config", "llama-8m", "--tokenizer_name_or_path", str(tokenizer)]
        common += ["--max_steps", str(opts.steps), "--max_length", "256", "--per_device_train_batch_size", "8"]
        common += ["--logging_steps", "1", "--eval_strategy", "no", "--num_sample_prompts", "0", "--packing", "bfd"]
        common += ["--cache_dir", str(Path(tmp) / "cache"), "--mixed_precision", "no"]
        results = {}
        for name, extra in (("streaming", ["--streaming", "true", "--dataloader_num_workers", "1"]), ("stored", [])):
            if name == "stored" and opts.skip_stored:
                continue
            out = Path(tmp) / name
            validation = ["--validation_split_percentage", "1"] if name == "stored" else []
            results[name] = run([*common, *extra, *validation, "--train_file", str(corpus), "--output_dir", str(out)])
    print(json.dumps({"corpus_mb": opts.size_mb, **results}, indent=2))


if __name__ == "__main__":
    main()
