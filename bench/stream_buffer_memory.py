"""A stream buffer's peak memory on long documents, with and without its byte cap (--stream_buffer_mb).

Generates a JSON-lines corpus of `--docs` documents of `--doc_mb` MB each (random words; under a temporary
folder, removed after), then trains the llama-8m preset for two steps on it in fresh processes at
--stream_buffer 256, once per cap, and prints each run's peak memory (the process tree's proportional set
sizes, sampled every 50 ms) and the ratio to the uncapped run measured in the same invocation. The source ends
after one pass (--mixture_exhausted stop), so the uncapped buffer holds the whole corpus once.

    python bench/stream_buffer_memory.py      # 8 documents of 8 MB: caps 0 (none) and 4 (the default)
    python bench/stream_buffer_memory.py --docs 4 --doc_mb 2 --caps 0 1
"""

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streaming_bench import WORDS, make_tokenizer, run  # noqa: E402


def long_documents(path: Path, docs: int, doc_mb: float) -> Path:
    rng = random.Random(0)
    words = int(doc_mb * 1e6 / 5)  # "w123 " is about five bytes
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=words))}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc_mb", type=float, default=8)
    parser.add_argument("--caps", type=float, nargs="+", default=[0, 4], help="--stream_buffer_mb values (0: none)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = long_documents(Path(tmp) / "long.jsonl", opts.docs, opts.doc_mb)
        validation = Path(tmp) / "validation.jsonl"
        validation.write_text(json.dumps({"text": " ".join(WORDS[:300])}) + "\n")
        tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
        peaks = {}
        for cap in opts.caps:
            out = Path(tmp) / f"run-{cap:g}"
            args = ["--task", "causal_lm", "--model_config", "llama-8m", "--tokenizer_name_or_path", str(tokenizer)]
            args += ["--streaming", "true", "--stream_buffer", "256", "--stream_buffer_mb", str(cap)]
            args += ["--mixture_exhausted", "stop", "--max_steps", "2", "--max_length", "256"]
            args += ["--per_device_train_batch_size", "8", "--eval_strategy", "no", "--num_sample_prompts", "0"]
            args += ["--mixed_precision", "no", "--train_file", str(corpus), "--validation_file", str(validation)]
            peaks[cap] = run([*args, "--output_dir", str(out)], warmup=0)["peak_memory_gib"]
            print(f"--stream_buffer_mb {cap:g}: peak {peaks[cap]:.2f} GiB", flush=True)
        base = peaks[opts.caps[0]]
        print(f"corpus: {opts.docs} documents of {opts.doc_mb:g} MB, --stream_buffer 256")
        for cap, peak in peaks.items():
            print(f"  cap {cap:g} MiB: {peak:.2f} GiB ({peak / base:.2f}x the cap-{opts.caps[0]:g} run)")


if __name__ == "__main__":
    main()
