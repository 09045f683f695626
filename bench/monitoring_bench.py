"""What monitoring costs: the same run with --monitoring true and false, alternated, in fresh processes.

    python bench/monitoring_bench.py [--reps 3] [--steps 60] [--out bench/results/monitoring.md]

Two cases: the pretraining example's llama-8m on the Grimm tales (a short step, where any per-step cost
shows) at --logging_steps 1 (the worst case: every step is a logging step) and 20 (the default), and
the default job's MiniLM on Reuters R8. Each run's training time per step comes from its
train_results.json (the loop's wall time; no evaluation, no checkpoints). Runs alternate on and off so
that the machine's drift hits both; the figure is the ratio of the medians. Needs `make setup` (data).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "src" / "training_application.py"
CASES = {
    "llama-8m, logging_steps 1": [
        "--config", "configs/pretrain_grimm.yaml", "--logging_steps", "1", "--eval_on_start", "false",
        "--num_sample_prompts", "0",
    ],
    "llama-8m, logging_steps 20": [
        "--config", "configs/pretrain_grimm.yaml", "--logging_steps", "20", "--eval_on_start", "false",
        "--num_sample_prompts", "0",
    ],
    "MiniLM on R8, logging_steps 20": ["--max_length", "64", "--per_device_train_batch_size", "16"],
}  # fmt: skip


def seconds_per_step(args: list[str], monitoring: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(ENTRY), *args, "--max_steps", str(steps), "--eval_strategy", "no"]
        command += ["--monitoring", str(monitoring).lower(), "--output_dir", out, "--overwrite_output_dir", "true"]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
        train = json.loads((Path(out) / "train_results.json").read_text())
    return train["train_runtime_s"] / train["global_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    parser.add_argument("--cases", default=";".join(CASES), help="which cases, separated by ;")
    options = parser.parse_args()
    rows = ["| case | off: ms/step | on: ms/step | on / off |", "|---|---|---|---|"]
    for name in options.cases.split(";"):
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(options.reps):
            for monitoring in (False, True) if rep % 2 == 0 else (True, False):
                times[monitoring].append(seconds_per_step(CASES[name], monitoring, options.steps))
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append(f"| {name} | {off * 1000:.1f} | {on * 1000:.1f} | {on / off:.3f} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if options.out:
        Path(options.out).write_text(
            f"# Monitoring overhead\n\n`python bench/monitoring_bench.py --reps {options.reps} --steps "
            f"{options.steps}` (medians over the reps, runs alternating on and off, 2 CPU cores):\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
