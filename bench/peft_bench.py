"""The PEFT case of `make bench`: full fine-tuning against `--peft lora` and `--peft dora`, on CPU.

Two models, each trained by the three methods through the real application (`cloudtrain.pipeline.build_run`,
then `trainer.fit()` with the product's Checkpointer, then `trainer.save_model`, as `run_training` does):

- classification: the built-in all-MiniLM-L6-v2 on Reuters R8 (the application's defaults, data/reuters-r8);
- causal_lm: a Llama from the shipped preset (llama-8m unless told otherwise, optionally enlarged), random
  weights from the seed, its vocabulary fitted to data/grimm/tokenizer as `--model_config` does, saved once
  with save_pretrained (adapters refuse --model_config: they need a saved base); trained on the Grimm tales
  (data/grimm/train.txt, validation.txt).

Adapters use the application's defaults (rank, alpha, dropout, all-linear targets; --lora_dropout changes the
dropout, which costs memory: PEFT keeps a dropped-out copy of each adapted layer's input for the backward pass);
every method the same data, batches, steps, learning rate, precision (`auto`: fp32 on a CPU without native
bf16) and threads.

Reported per method: trainable parameters (the run log's count); median step time over the steps after the
warm-up steps (the interval between optimizer steps: data, forward, backward, step); peak RSS of the run's
process at its end (VmHWM, see sft_bench.peak_rss_mb: after training, the checkpoint and the final save);
the size of the one checkpoint folder (`--checkpointing_steps` at the last step: weights, optimizer,
scheduler, RNG) and of the final weights (model.safetensors, or adapter_model.safetensors with the modules
trained in full). Ratios are against full fine-tuning of the same run.

Each run is a fresh interpreter (`python bench/peft_bench.py --worker SPEC RESULT`, bench/fresh_process.py), on
one thread by default; the data is tokenized into the cache before the first run, so no run pays for it;
repetitions are interleaved, in an order rotated each repetition. At the defaults: about 7.5 minutes on 2 shared
CPU cores.

    python bench/peft_bench.py [--steps 30] [--warmup_steps 5] [--repetitions 1] [--out bench/results]
    python bench/peft_bench.py --lm_overrides '{"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8}'
    run_section(repetitions, steps, log=...) -> (markdown, results)          # from bench/run.py
"""

import argparse
import json
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
GRIMM = REPO / "data" / "grimm"
CASES = ("classification", "causal_lm")
METHODS = ("full", "lora", "dora")
TITLE = "## PEFT: full fine-tuning vs LoRA vs DoRA"


@dataclass
class PEFTSettings:
    """What every method shares; only --peft differs between the runs of a case."""

    steps: int = 30  # timed steps, after the warm-up ones
    warmup_steps: int = 5
    learning_rate: float = 1e-4
    mixed_precision: str = "auto"  # the application's default
    threads: int = 1  # one thread: the least disturbed by other tenants of a shared machine (0: torch's default)
    seed: int = 42
    classifier_model: str | None = None  # None: the built-in all-MiniLM-L6-v2
    classifier_max_length: int = 64  # bench/run.py's (the application's default is 128)
    classifier_batch_size: int = 16
    lm_model: str | None = None  # None: built from lm_preset + lm_overrides
    lm_preset: str = "llama-8m"
    lm_overrides: dict = field(default_factory=dict)
    lm_max_length: int = 128
    lm_batch_size: int = 8
    lora_dropout: float | None = None  # None: the application's default
    cases: list = field(default_factory=lambda: list(CASES))
    methods: list = field(default_factory=lambda: list(METHODS))


# ---------------------------------------------------------------- the parent: models, data, plan
def build_lm(s: PEFTSettings, folder: Path) -> str:
    """The preset (with `lm_overrides`) as a saved model with random weights from the seed, and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.tasks.causal_lm import CausalLMTask, model_config_file

    tokenizer = AutoTokenizer.from_pretrained(GRIMM / "tokenizer")
    config = AutoConfig.from_pretrained(model_config_file(s.lm_preset))
    config.update(s.lm_overrides)
    CausalLMTask.fit_config(config, tokenizer, s.lm_preset)  # what --model_config does to a preset
    torch.manual_seed(s.seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def options(s: PEFTSettings, case: str, method: str, model_dir: str | None, cache_dir: str) -> dict:
    """The application's options for one run (the worker adds its output_dir)."""
    total = s.warmup_steps + s.steps
    common = {
        "model_name_or_path": model_dir,
        "peft": "none" if method == "full" else method,
        "max_steps": total,
        "checkpointing_steps": str(total),
        "logging_steps": total,
        "learning_rate": s.learning_rate,
        "mixed_precision": s.mixed_precision,
        "seed": s.seed,
        "eval_strategy": "no",
        "max_eval_samples": 16,
        "report_to": ["none"],
        "cache_dir": cache_dir,
        "training_type": "accelerated",
    }
    if s.lora_dropout is not None:
        common["lora_dropout"] = s.lora_dropout
    if case == "classification":
        return {**common, "max_length": s.classifier_max_length, "per_device_train_batch_size": s.classifier_batch_size}
    return {
        **common,
        "task": "causal_lm",
        "train_file": str(GRIMM / "train.txt"),
        "validation_file": str(GRIMM / "validation.txt"),
        "max_length": s.lm_max_length,
        "per_device_train_batch_size": s.lm_batch_size,
        "num_sample_prompts": 0,
    }


def tokenize_into_cache(opts: dict) -> None:
    """Fill the processed-data cache, so that no measured run tokenizes (and no run's peak memory holds it)."""
    from cloudtrain.config import build_config
    from cloudtrain.data.sources import connect_data
    from cloudtrain.models.load import load_tokenizer
    from cloudtrain.pipeline import resolve
    from cloudtrain.tasks import build_task

    cfg = build_config(opts)
    task = build_task(cfg)
    cfg = resolve(cfg, task)
    task.process(connect_data(cfg.data, task.columns(cfg.data)), load_tokenizer(cfg.model), cfg)


def run_worker(spec: dict, log) -> dict:
    return run_script(__file__, spec, log, f"PEFT benchmark run {spec['case']} {spec['method']}")


def measure(specs: dict, repetitions: int, log) -> dict:
    """{(case, method): [result, ...]}: every case's methods, interleaved, in an order rotated each repetition."""
    runs = {key: [] for key in specs}
    for rep in range(repetitions):
        for case in dict.fromkeys(c for c, _ in specs):
            keys = [k for k in specs if k[0] == case]
            shift = rep % len(keys)
            for key in keys[shift:] + keys[:shift]:
                print(
                    f"[{time.strftime('%H:%M:%S')}] PEFT repetition {rep + 1}/{repetitions}: {case} {key[1]}",
                    file=sys.stderr,
                    flush=True,
                )
                runs[key].append(run_worker(specs[key], log))
    return runs


def summarize(runs: list[dict], base: list[dict] | None) -> dict:
    """Medians over the repetitions (sizes and counts do not vary), and their ratios to full fine-tuning's."""
    out = {k: statistics.median(r[k] for r in runs) for k in ("median_step_s", "peak_rss_mb")}
    out.update(
        {
            k: runs[0][k]
            for k in (
                "trainable_parameters",
                "parameters",
                "checkpoint_bytes",
                "output_file",
                "output_bytes",
                "adapter",
                "mixed_precision",
            )
        }
    )
    if base:
        full = summarize(base, None)
        out["vs_full"] = {
            k: out[k] / full[k]
            for k in ("trainable_parameters", "median_step_s", "peak_rss_mb", "checkpoint_bytes", "output_bytes")
        }
    return out


def run(s: PEFTSettings, repetitions: int = 1, log=None) -> dict:
    """Every case and method; {"settings", "repetitions", "cases": {case: {"model", "methods"}}, "wall_s"}."""
    start = time.perf_counter()
    own_log = log is None
    with tempfile.TemporaryDirectory() as tmp:
        log = log or tempfile.NamedTemporaryFile("w", prefix="peft_bench-", suffix=".log", delete=False)
        try:
            cache = str(Path(tmp) / "cache")
            models = {"classification": s.classifier_model, "causal_lm": s.lm_model}
            if "causal_lm" in s.cases and not s.lm_model:
                models["causal_lm"] = build_lm(s, Path(tmp) / "lm")
            specs = {}
            for case in s.cases:
                tokenize_into_cache(options(s, case, "full", models[case], cache))
                for method in s.methods:
                    specs[case, method] = {
                        "case": case,
                        "method": method,
                        "threads": s.threads,
                        "warmup_steps": s.warmup_steps,
                        "options": options(s, case, method, models[case], cache),
                    }
            runs = measure(specs, repetitions, log)
        finally:
            if own_log:
                log.close()
        if own_log:  # reached only when every run succeeded
            os.unlink(log.name)
    cases = {
        case: {
            "model": model_name(s, case),
            "methods": {
                m: {"runs": runs[case, m], "summary": summarize(runs[case, m], runs.get((case, "full")))}
                for m in s.methods
            },
        }
        for case in s.cases
    }
    return {"settings": asdict(s), "repetitions": repetitions, "cases": cases, "wall_s": time.perf_counter() - start}


def model_name(s: PEFTSettings, case: str) -> str:
    if case == "classification":
        return f"{Path(s.classifier_model).name} (given)" if s.classifier_model else "all-MiniLM-L6-v2"
    if s.lm_model:
        return f"{Path(s.lm_model).name} (given)"
    return f"Llama from preset {s.lm_preset}" + (f" with {json.dumps(s.lm_overrides)}" if s.lm_overrides else "")


# ---------------------------------------------------------------- one run (a fresh interpreter)
def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def adapter(m) -> str | None:
    """The adapter settings the run used (the application's ModelConfig), None for full fine-tuning."""
    if m.peft == "none":
        return None
    return f"r={m.lora_r} alpha={m.lora_alpha:g} dropout={m.lora_dropout:g} on {','.join(m.lora_target_modules)}"


def train_once(spec: dict) -> dict:
    """Build the run, train warm-up + timed steps with one checkpoint at the end, save the final weights."""
    import torch
    from sft_bench import peak_rss_mb

    from cloudtrain.checkpointing import Checkpointer, complete_checkpoints
    from cloudtrain.config import build_config
    from cloudtrain.paths import checkpoint_dir
    from cloudtrain.pipeline import build_run

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as out:
        run = build_run(build_config({**spec["options"], "output_dir": out}))
        cfg, trainer = run.cfg, run.trainer
        ends = []
        step = trainer.optimizer_step

        def timed_step() -> None:
            step()
            ends.append(time.perf_counter())

        trainer.optimizer_step = timed_step
        checkpointer = Checkpointer(
            cfg, checkpoint_dir(cfg, run.output_dir), run.output_dir, run.runtime.is_main, run.runtime.barrier
        )
        start = time.perf_counter()
        result = trainer.fit(checkpointer)
        trainer.save_model(run.output_dir)
        peak = peak_rss_mb()
        ((_, checkpoint),) = complete_checkpoints(checkpoint_dir(cfg, run.output_dir))
        weights = sorted(run.output_dir.glob("*.safetensors"))
        times = [b - a for a, b in pairwise([start, *ends])]
        return {
            "steps": result.global_step,
            "median_step_s": statistics.median(times[spec["warmup_steps"] :]),
            "peak_rss_mb": peak,
            "trainable_parameters": run.run_log.run_info["trainable_parameters"],
            "parameters": run.run_log.run_info["num_parameters"],
            "checkpoint_bytes": folder_bytes(checkpoint),
            "output_file": "+".join(w.name for w in weights),
            "output_bytes": sum(w.stat().st_size for w in weights),
            "adapter": adapter(cfg.model),
            "mixed_precision": cfg.training.mixed_precision,
            "train_loss": result.train_loss,
            "num_threads": torch.get_num_threads(),
        }


def _worker_main(spec_json: str, result_path: str) -> None:
    start = time.perf_counter()
    prepare_worker()
    result = train_once(json.loads(spec_json))
    result["process_s"] = time.perf_counter() - start
    Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- the report
def markdown(peft: dict) -> str:
    """The section: a table per case, one row per method, ratios against full fine-tuning of the same run."""
    s = peft["settings"]
    lines = [
        TITLE,
        "",
        f"Each method through the application: {s['warmup_steps']} warm-up steps, then {s['steps']} timed steps "
        f"(median s/step over those), lr {s['learning_rate']:g}, {s['threads'] or 'default'} thread(s), one "
        f"checkpoint at the last step, then the final save. Peak RSS: the run's process at its end (VmHWM). "
        f"Medians of {peft['repetitions']} interleaved repetition(s), each a fresh process; wall time "
        f"{peft['wall_s']:.0f}s. Ratios (x) are against full fine-tuning of this run.",
    ]
    for case, c in peft["cases"].items():
        lines += ["", *case_table(case, c, s)]
    return "\n".join(lines) + "\n"


def case_table(case: str, c: dict, s: dict) -> list[str]:
    methods = c["methods"]
    summaries = [m["summary"] for m in methods.values()]
    adapters = next((m["adapter"] for m in summaries if m["adapter"]), "none")
    full = f"{methods['full']['summary']['parameters']:,} parameters, " if "full" in methods else ""
    shape = (
        f"R8, max_length {s['classifier_max_length']}, batch {s['classifier_batch_size']}"
        if case == "classification"
        else f"Grimm tales, rows of {s['lm_max_length']} tokens, batch {s['lm_batch_size']}"
    )
    lines = [
        f"### {case}: {c['model']}, {shape}",
        "",
        f"Model: {full}precision {summaries[0]['mixed_precision']}; adapters: {adapters}.",
        "",
        "| method | trainable params | vs full | s/step | vs full | peak RSS MB | vs full | checkpoint MB "
        "| vs full | final weights | MB | vs full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(m: dict, key: str) -> str:
        return f"{m['vs_full'][key]:.3f}x" if "vs_full" in m else ""

    for name, entry in methods.items():
        m = entry["summary"]
        lines.append(
            f"| {name} | {m['trainable_parameters']:,} ({m['trainable_parameters'] / m['parameters']:.2%}) | "
            f"{ratio(m, 'trainable_parameters')} | {m['median_step_s']:.3f} | {ratio(m, 'median_step_s')} | "
            f"{m['peak_rss_mb']:.0f} | {ratio(m, 'peak_rss_mb')} | {m['checkpoint_bytes'] / 2**20:.2f} | "
            f"{ratio(m, 'checkpoint_bytes')} | {m['output_file']} | {m['output_bytes'] / 2**20:.2f} | "
            f"{ratio(m, 'output_bytes')} |"
        )
    return lines


def run_section(repetitions: int = 1, steps: int | None = None, log=None, **overrides) -> tuple[str, dict]:
    """The section for bench/run.py: (markdown, results). `overrides` set PEFTSettings fields."""
    settings = replace(PEFTSettings(), **overrides, **({"steps": steps} if steps else {}))
    results = run(settings, repetitions, log=log)
    return markdown(results), results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = PEFTSettings()
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--out", type=Path, default=BENCH / "results", help="write peft.md and peft.json here")
    for name in (
        "steps",
        "warmup_steps",
        "threads",
        "seed",
        "classifier_max_length",
        "classifier_batch_size",
        "lm_max_length",
        "lm_batch_size",
    ):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--learning_rate", type=float, default=defaults.learning_rate)
    p.add_argument("--lora_dropout", type=float, default=None, help="default: the application's")
    for name in ("classifier_model", "lm_model", "lm_preset"):
        p.add_argument(f"--{name}", default=getattr(defaults, name))
    p.add_argument("--lm_overrides", type=json.loads, default={}, help="JSON: config.json fields over the preset's")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    args = p.parse_args(argv)
    for name, allowed in (("cases", CASES), ("methods", METHODS)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        if not chosen or set(chosen) - set(allowed):
            p.error(f"--{name} takes names from {', '.join(allowed)}")
        setattr(args, name, chosen)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k not in ("repetitions", "out")}
    text, results = run_section(args.repetitions, log=sys.stderr, **fields)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peft.md").write_text(text)
    (args.out / "peft.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    run_as_script(main, _worker_main)
