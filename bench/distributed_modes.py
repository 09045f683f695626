"""Step time of DDP vs DeepSpeed ZeRO-1/2/3 with 2 CPU processes on a tiny random BERT.

    .venv/bin/python bench/distributed_modes.py [--steps 200] [--repetitions 2]

Each mode is a real `torchrun --nproc_per_node 2` launch of the application; the step time is the
training runtime (after start-up) over the step count, median over repetitions, with ratios to DDP
measured in the same run.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from cloudtrain.assets import default_model_dir

REPO = Path(__file__).resolve().parents[1]

MODES = {"DDP": [], "ZeRO-1": ["--zero_stage", "1"], "ZeRO-2": ["--zero_stage", "2"], "ZeRO-3": ["--zero_stage", "3"]}


def tiny_setup(folder: Path) -> tuple[Path, Path]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
    )
    BertModel(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    words = ["market", "shares", "goal", "match", "rain", "storm", "oil", "wheat"]
    rows = [{"text": " ".join(words[(i * 7 + j) % 8] for j in range(12)), "label": i % 4} for i in range(512)]
    pd.DataFrame(rows).to_csv(folder / "train.csv", index=False)
    return folder / "model", folder / "train.csv"


def run_mode(extra: list[str], model: Path, train: Path, out: Path, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        port,
        str(REPO / "src" / "training_application.py"),
        "--model_name_or_path",
        str(model),
        "--train_file",
        str(train),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        "8",
        "--max_length",
        "32",
        "--eval_strategy",
        "no",
        "--logging_steps",
        str(steps),
        "--output_dir",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ})
    result = json.loads((out / "train_results.json").read_text())
    return 1000 * result["train_runtime_s"] / result["global_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repetitions", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, train = tiny_setup(Path(tmp))
        times = {mode: [] for mode in MODES}
        for rep in range(args.repetitions):
            for mode, extra in MODES.items():  # interleaved, so machine noise hits every mode alike
                times[mode].append(run_mode(extra, model, train, Path(tmp) / f"{mode}-{rep}", args.steps))
    ddp = statistics.median(times["DDP"])
    print(f"| mode | ms/step (median of {args.repetitions}) | vs DDP |\n|---|---|---|")
    for mode, values in times.items():
        print(f"| {mode} | {statistics.median(values):.1f} | {statistics.median(values) / ddp:.2f}x |")


if __name__ == "__main__":
    main()
