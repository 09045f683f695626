"""Tensor parallelism on CPU: tokens/s and peak memory per process of TP=2 on 2 processes, against 1 process and
against FSDP2 on 2 processes.

A Llama of hidden 256 and 4 layers (8 heads, 4 KV heads, MLP 704; random weights from the seed, saved as a
checkpoint that every run loads) is pretrained through the real application on Grimm's tales
(bench/lm_corpus.py; --packing wrapped rows of --max_length tokens, so every step computes the same shapes).
Each variant is its own `torchrun` launch of src/training_application.py's `cloudtrain.cli.main`, at the same
global batch:

- 1 process (reference): --training_type accelerated, the whole batch;
- TP=2, 2 processes: --tensor_parallel_size 2; both processes take the same rows (one tensor-parallel group),
  each holding half of every attention and MLP projection and of the LM head;
- FSDP2, 2 processes: --fsdp true, half the batch each, the weights, gradients and AdamW states sharded;
- with --context_parallel, also CP=2, 2 processes: --context_parallel_size 2; both processes take the same rows
  (one context-parallel group), each half of every row's tokens, attention over whole rows with half the heads
  (all-to-all, cloudtrain.parallel.sequence); the whole model on each.

Measured as bench/pipeline_bench.py measures (its rank entry runs each process): every optimizer step's end is
timed; tokens/s is the global batch's tokens over rank 0's median step time after --warmup; peak memory is each
process's VmHWM (resident-set high-water mark, /proc/self/status), start-up and saving included. The per-step
losses of every variant are compared with the reference's.

What it says on CPU, honestly: correctness and memory, not speed. Two processes share 2 cores with gloo, and
tensor parallelism's all-reduces of the hidden states (two per layer and pass) sit between the matmuls: on CPU
TP is expected to be slower than one process and than FSDP2. What should show is that each TP process holds
about half of the split projections' weights, gradients and AdamW states (the embeddings and norms stay whole),
and that TP trains what one process trains. The speed that matters needs GPUs on one node's NVLink: still to be
taken there (cloudtrain plan models it: docs/planner-formulas.md).

    .venv/bin/python bench/tp_bench.py [--steps 8] [--batch_size 8] [--max_length 128] [--hidden_size 256]
    .venv/bin/python bench/tp_bench.py --quick      # a tiny model, 4 steps (the test)
    .venv/bin/python bench/tp_bench.py --context_parallel --out bench/results/tp_cp.md   # + CP=2

Writes --out (markdown, default bench/results/tp.md) and the same name with .json.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import pipeline_bench  # noqa: E402  (its torchrun rank entry and launcher time every step)
from pipeline_bench import Variant  # noqa: E402

MODEL = {  # hidden 256, 4 layers; heads, KV heads and the MLP divide by 2
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,  # transformers' plan splits an untied LM head
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}
QUICK_MODEL = {**MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


@dataclass
class Settings:
    steps: int = 8
    warmup: int = 2  # step intervals left out of the medians
    batch_size: int = 8  # global rows per step
    max_length: int = 128
    vocab_size: int = 4096
    learning_rate: float = 1e-3
    seed: int = 42
    hidden_size: int = 256  # the model's width: the MLP 2.75 times it (a multiple of 64), a head per 32
    quick: bool = False
    tab: str | None = None  # an Orange .tab corpus other than the Grimm tales (tests)
    timeout: float = 900.0  # seconds per launch
    context_parallel: bool = False  # also CP=2 on 2 processes


def variants(s: Settings) -> list[Variant]:
    whole, half = str(s.batch_size), str(s.batch_size // 2)
    return [
        Variant("1 process (reference)", 1, ["--per_device_train_batch_size", whole], 1),
        Variant("TP=2, 2 processes", 2, ["--per_device_train_batch_size", whole, "--tensor_parallel_size", "2"], 1),
        Variant("FSDP2, 2 processes", 2, ["--per_device_train_batch_size", half, "--fsdp", "true"], 1),
    ] + ([Variant("CP=2, 2 processes", 2, ["--per_device_train_batch_size", whole, "--context_parallel_size", "2"], 1)]
         if s.context_parallel else [])  # fmt: skip


def shape(s: Settings) -> dict:
    """The model's config fields: MODEL at --hidden_size (QUICK_MODEL with --quick)."""
    if s.quick:
        return QUICK_MODEL
    h = s.hidden_size
    inter = 64 * round(2.75 * h / 64)
    return {**MODEL, "hidden_size": h, "intermediate_size": inter, "num_attention_heads": h // 32,
            "num_key_value_heads": h // 64}  # fmt: skip


def save_model(shape: dict, vocab_size: int, seed: int, folder: Path) -> Path:
    """The model as a checkpoint folder, its random weights drawn from `seed`: every variant loads the same
    weights (--tensor_parallel_size loads a checkpoint sharded; it does not build one from --model_config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {k: v for k, v in shape.items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(shape["model_type"], vocab_size=vocab_size, **fields)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def summarise(s: Settings, v: Variant, run: dict) -> dict:
    """Tokens/s of the global batch at rank 0's median step; every process's peak memory; the losses."""
    row = pipeline_bench.summarise(v, run, s.warmup)
    tokens = s.batch_size * s.max_length  # the same global batch in every variant
    return {
        "name": v.name,
        "processes": v.processes,
        "median_step_s": row["median_step_s"],
        "tokens_per_s": tokens / row["median_step_s"],
        "peak_rss_mb": [r["peak_rss_mb"] for r in row["ranks"]],
        "peak_rss_training_mb": [r["peak_rss_training_mb"] for r in row["ranks"]],
        "losses": row["losses"],
        "launch_s": row["launch_s"],
    }


def run(s: Settings, log) -> dict:
    import lm_corpus

    corpus = lm_corpus.prepare(s.vocab_size, Path(s.tab) if s.tab else None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tp_bench-") as tmp:
        model = save_model(shape(s), corpus.vocab_size, s.seed, Path(tmp) / "model")
        base = pipeline_bench.app_args(s, corpus, ["--model_name_or_path", str(model)], Path(tmp) / "cache")
        for i, v in enumerate(variants(s)):
            launched = pipeline_bench.launch(v, base, Path(tmp) / f"run{i}", log, s.timeout)
            rows.append(summarise(s, v, launched))
    reference = rows[0]
    for r in rows:
        r["loss_diff_vs_reference"] = max(abs(a - b) for a, b in zip(r["losses"], reference["losses"], strict=True))
        r["speed_vs_reference"] = r["tokens_per_s"] / reference["tokens_per_s"]
    import torch

    return {
        "settings": asdict(s),
        "model": shape(s),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average": os.getloadavg()[0]},
        "variants": rows,
    }


def markdown(result: dict) -> str:
    s, m = result["settings"], result["model"]
    lines = [
        "# Tensor parallelism on CPU: TP=2 vs 1 process vs FSDP2"
        + (" (and context parallelism: CP=2)" if s["context_parallel"] else ""),
        "",
        f"Llama hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} heads "
        f"({m['num_key_value_heads']} KV), MLP {m['intermediate_size']}; {s['batch_size']} rows x {s['max_length']} "
        f"tokens per step, {s['steps']} steps, fp32, gloo, {result['machine']['cpus']} CPUs, torch "
        f"{result['machine']['torch']}.",
        "",
        "| variant | tokens/s | vs 1 process | peak RSS MiB per process | max loss diff vs 1 process |",
        "|---|---|---|---|---|",
    ]
    for r in result["variants"]:
        rss = " / ".join(f"{x:.0f}" for x in r["peak_rss_mb"])
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.0f} | {r['speed_vs_reference']:.2f}x | {rss} "
            f"| {r['loss_diff_vs_reference']:.1e} |"
        )
    lines += [
        "",
        "On CPU the point is correctness and memory: 2 processes share 2 cores, and TP's all-reduces sit between "
        "the matmuls. Peak RSS includes each process's Python, torch and transformers (several hundred MiB), "
        "which TP does not split. Speed on GPUs is still to be taken.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Settings()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--batch_size", type=int, default=d.batch_size, help="global rows per step (even)")
    p.add_argument("--max_length", type=int, default=d.max_length)
    p.add_argument("--hidden_size", type=int, default=d.hidden_size, help="a multiple of 64 (MLP 2.75x)")
    p.add_argument("--quick", action="store_true", help="a tiny model and 4 steps (the test)")
    p.add_argument("--tab", default=None, help="an Orange .tab corpus instead of the Grimm tales")
    p.add_argument(
        "--context_parallel", action="store_true", help="also CP=2 on 2 processes (same rows, half the tokens)"
    )
    p.add_argument("--out", default=str(BENCH / "results" / "tp.md"))
    args = p.parse_args(argv)
    if args.batch_size % 2:
        p.error("--batch_size must be even: FSDP2 gives each of its 2 processes half")
    if args.hidden_size % 64:
        p.error("--hidden_size must be a multiple of 64 (a head per 32, KV heads half as many, split in 2)")
    s = Settings(
        args.steps,
        args.warmup,
        args.batch_size,
        args.max_length,
        hidden_size=args.hidden_size,
        tab=args.tab,
        context_parallel=args.context_parallel,
    )
    if args.quick:
        s = replace(s, steps=4, warmup=1, batch_size=4, max_length=64, vocab_size=512, quick=True)
    return s, args


def main(argv: list[str] | None = None) -> dict:
    s, args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        result = run(s, log)
    result["wall_s"] = time.perf_counter() - start
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
