"""DPO: cloudtrain's `--task dpo` against TRL's DPOTrainer on the same model, pairs and steps, fp32 on CPU.

    python bench/dpo_bench.py [--steps 12 --batch_size 8 --pairs 96 --threads 1 --preset llama-8m]

The work: Reuters R8 articles (data/r8-sft, written by `make sft`'s scripts/make_r8_sft.py) as preference
pairs: the question and the article's first words as the prompt, the right topic chosen, a wrong one (seeded)
rejected, in TRL's conversational format, so both apply the same chatml template. The model: the llama-8m preset
with the Grimm tokenizer (data/grimm/tokenizer) given chatml's two tokens, random weights from one seed, saved once;
both start from that folder. Both: DPO sigmoid loss, beta 0.1, AdamW, no weight decay, clipping at 1.0, a constant
learning rate, a live reference model (a frozen copy), dropout off, one thread, and the same batches in the same
order (TRL is given cloudtrain's seeded sampler). Each runner trains in a fresh process; it reports pairs per
second over its training call (setup inside it included, as a user waits for it), its loss per step and its peak
resident memory (VmHWM). Rows `ours-precompute` and `trl-precompute` compute the reference log-probabilities once
before training (`--precompute_reference true`, TRL's `precompute_ref_log_probs=True`); their time counts that pass.

Known difference in the work: TRL's tokenization of a conversational answer also trains the newline chatml writes
after <|im_end|> (one more target token per answer); ours leaves it out (the template's, never generated).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TOKENIZER = REPO / "data" / "grimm" / "tokenizer"
PAIRS_SOURCE = REPO / "data" / "r8-sft" / "train.jsonl"
RUNNERS = ("ours", "trl", "ours-precompute", "trl-precompute")


def write_pairs(path: Path, n: int, words: int, seed: int) -> None:
    """The first `n` R8 training articles as conversational preference pairs (a wrong topic rejected, seeded)."""
    rows = [json.loads(line) for line in PAIRS_SOURCE.read_text().splitlines()[:n]]
    topics = sorted({row["completion"] for row in json.loads(f"[{','.join(PAIRS_SOURCE.read_text().splitlines())}]")})
    rng = random.Random(seed)
    with path.open("w") as f:
        for row in rows:
            question, article = row["prompt"].split("\n\n", 1)
            prompt = f"{question}\n\n{' '.join(article.split()[:words])}"
            wrong = rng.choice([t for t in topics if t != row["completion"]])
            pair = {
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": row["completion"]}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
            f.write(json.dumps(pair) + "\n")


def build_model(folder: Path, preset: str, seed: int) -> None:
    """The preset with random weights, the Grimm tokenizer with chatml set (its tokens added), saved once."""
    import math

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.data.chat import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    ChatFormat.setup(tokenizer, "chatml")
    tokenizer.save_pretrained(folder)
    config = json.loads((REPO / "src" / "cloudtrain" / "model_presets" / f"{preset}.json").read_text())
    config.update(
        vocab_size=math.ceil(len(tokenizer) / 64) * 64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    model.save_pretrained(folder)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: a child does not inherit it, unlike ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------- the workers (one fresh process each)
def run_ours(spec: dict, out: str) -> tuple[float, list[float]]:
    from cloudtrain.config import build_config
    from cloudtrain.pipeline import build_run

    options = {
        "task": "dpo", "model_name_or_path": spec["model_dir"], "train_file": spec["pairs"],
        "validation_file": spec["pairs"], "output_dir": out, "max_length": spec["max_length"],
        "per_device_train_batch_size": spec["batch_size"], "max_steps": spec["steps"],
        "learning_rate": spec["learning_rate"], "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "mixed_precision": "no", "report_to": "none",
        "logging_steps": 1, "eval_strategy": "no", "num_sample_prompts": 0, "seed": spec["seed"],
        "monitoring": "false", "precompute_reference": str(spec["precompute"]).lower(),
    }  # fmt: skip
    start = time.perf_counter()
    run = build_run(build_config(options))  # the reference pass, when precomputed, happens here
    result = run.trainer.fit()
    seconds = time.perf_counter() - start
    run.run_log.finish({"train": result.summary()}, [])  # flushes metrics.jsonl
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return seconds, [r["train/loss"] for r in records if "train/loss" in r]


def run_trl(spec: dict, out: str) -> tuple[float, list[float]]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from cloudtrain.data.processing import EpochShuffleSampler

    class SameOrder(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):  # cloudtrain's batches, in cloudtrain's order
            return EpochShuffleSampler(len(train_dataset or self.train_dataset), spec["seed"])

    args = DPOConfig(
        output_dir=out, per_device_train_batch_size=spec["batch_size"], max_steps=spec["steps"],
        learning_rate=spec["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.1, loss_type=["sigmoid"], max_length=spec["max_length"], bf16=False, fp16=False,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=spec["seed"],
        precompute_ref_log_probs=spec["precompute"], gradient_checkpointing=False, dataloader_num_workers=0,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.load_dataset("json", data_files=spec["pairs"], split="train")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"])
    trainer = SameOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    seconds = time.perf_counter() - start
    return seconds, [e["loss"] for e in trainer.state.log_history if "loss" in e]


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as out:
        seconds, losses = (run_ours if spec["runner"].startswith("ours") else run_trl)(spec, out)
    pairs = spec["steps"] * spec["batch_size"]
    return {"runner": spec["runner"], "seconds": seconds, "pairs_per_s": pairs / seconds, "losses": losses,
            "peak_rss_mb": peak_rss_mb()}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--words", type=int, default=32)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="llama-8m")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # a child: one runner, its result as JSON on the last line
        print(json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return {}
    if not (PAIRS_SOURCE.is_file() and TOKENIZER.is_dir()):
        sys.exit("needs data/r8-sft and data/grimm/tokenizer: run `make setup` and `python scripts/make_r8_sft.py`")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        build_model(base / "model", args.preset, args.seed)
        write_pairs(base / "pairs.jsonl", args.pairs, args.words, args.seed)
        for runner in args.runners.split(","):
            spec = {**vars(args), "runner": runner, "precompute": runner.endswith("precompute"),
                    "model_dir": str(base / "model"), "pairs": str(base / "pairs.jsonl")}  # fmt: skip
            (base / "spec.json").write_text(json.dumps(spec))
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", str(base / "spec.json")], capture_output=True, text=True, env=env
            )
            if proc.returncode:
                sys.exit(f"{runner} failed:\n{proc.stderr[-3000:]}")
            results[runner] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report(results, args))
    return results


def report(results: dict, args: argparse.Namespace) -> str:
    lines = [
        f"DPO, {args.preset}, {args.steps} steps x {args.batch_size} pairs, fp32, {args.threads} thread(s)",
        f"{'runner':<16} {'pairs/s':>8} {'seconds':>8} {'first loss':>10} {'last loss':>10} {'peak RSS MB':>12}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<16} {r['pairs_per_s']:>8.2f} {r['seconds']:>8.1f} {r['losses'][0]:>10.4f} "
            f"{r['losses'][-1]:>10.4f} {r['peak_rss_mb']:>12.0f}"
        )
    for ours, trl in (("ours", "trl"), ("ours-precompute", "trl-precompute"), ("ours-precompute", "trl")):
        if ours in results and trl in results:
            a, b = results[ours], results[trl]
            lines.append(
                f"{ours} / {trl}: {a['pairs_per_s'] / b['pairs_per_s']:.2f}x pairs/s, peak memory "
                f"{a['peak_rss_mb'] / b['peak_rss_mb']:.2f}x"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
