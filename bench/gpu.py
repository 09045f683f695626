"""GPU benchmark (`make gpu-bench`): the same pretraining work run several ways in one invocation, each in a
fresh process, so that one run says how cloudtrain compares with what a user could run instead.

The work: a Llama from `--preset` (default llama-600m, random weights from the seed) pretrained on Grimm's
tales split into paragraphs (bench/lm_corpus.py; a byte-level BPE tokenizer trained on them), --packing bfd
rows of --max_length tokens, --batch_size rows per step, bf16 autocast over fp32 master weights, fused AdamW
(weight decay 0.1 off biases and norms, cosine schedule, 5% warm-up, clipping at 1.0), no checkpointing.
Every variant trains `--steps` timed steps, then one profiler warm-up step and `--profile_steps` profiled
steps, on the same rows (same tokens, so the losses after the same tokens compare):

- `defaults`: the application (`build_run` + `fit`) at its defaults;
- one variant per kernel option in OPTIONS (the application with that option changed from its default); a
  variant whose option does not exist yet, or that the application refuses here, is reported "refused: <its line>";
- `plain`: the floor, a plain PyTorch loop on the same HF model class, precision and optimizer, fed the same
  rows as full causal rows with no document mask (the cheapest attention: documents see each other);
- `hf_trainer`: transformers.Trainer on the same model and rows, given position_ids (documents kept apart
  the way transformers does it) and no attention_mask.

Timed: tokens/s is the median over logging intervals after the first (warm-up), real tokens only. MFU is
tokens/s x FLOPs per token / the device's dense peak (cloudtrain.observe.flops; docs/benchmarks.md), with
attention counted per document where documents are kept apart and per row for `plain`, whose attention
spans rows. Peak memory is torch.cuda's over training. The profile summary comes from torch.profiler over
the profiled steps. Each variant's peak is compared with the planner's estimate for its options (`plan`, run as a
user runs it: bench/gpu_report.py). Each variant's wall time, its start-up and its training loop are reported.

    python bench/gpu.py [--steps 50] [--budget_s 450] [--variants defaults,plain,...] [--out report.json]
    python bench/gpu.py --dry_run      # the same code path, tiny, on CPU

The report is printed, and written to --out (JSON) and beside it as markdown after every variant; its
fields: docs/benchmarks.md#one-gpu.
Without CUDA (and without --dry_run / --device cpu) it prints one line and exits with status 2.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_report import GIB, attach_planner, compare, planner_estimates, render, write

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
STARTED = time.monotonic()  # a variant's process: its start-up is the time to its training loop
# Kernel options of the application, one variant each: name -> options on top of the defaults (which on CUDA with
# liger-kernel installed are varlen, Liger's fused loss and modules). A new option is one line here; one the
# installed application does not have yet is reported as refused, not an error.
OPTIONS = {
    "varlen": {"attn_implementation": "varlen"},
    "flash_attention_2": {"attn_implementation": "flash_attention_2"},
    "flex_attention": {"attn_implementation": "flex_attention"},
    "fused_cross_entropy": {"fused_cross_entropy": "true"},  # values as on the command line
    "no_liger_kernels": {"liger_kernels": "false"},  # the model's own RMSNorm, SwiGLU and RoPE
    "compile_layers": {"torch_compile": "true", "compile_layers": "true"},
}
VARIANTS = ("defaults", *OPTIONS, "plain", "hf_trainer")
PLANNER_RESERVE_S = 60  # kept from --budget_s for the planner
DRY_RUN = {"device": "cpu", "preset": "llama-8m", "steps": 3, "batch_size": 2, "max_length": 64}
DRY_RUN |= {"logging_steps": 1, "profile_steps": 1, "vocab_size": 512, "budget_s": 3600}
DRY_RUN |= {"variants": "defaults,varlen,fused_cross_entropy,plain,hf_trainer"}  # flex_attention: minutes on CPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-600m", help="a model preset or config.json (--model_config)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per variant (the same for all)")
    p.add_argument("--profile_steps", type=int, default=3, help="steps profiled after the timed ones (0: none)")
    p.add_argument("--batch_size", type=int, default=8, help="rows per step (one GPU, no accumulation)")
    p.add_argument("--max_length", type=int, default=2048, help="tokens per row")
    p.add_argument("--packing", default="bfd", choices=("bfd", "wrapped", "none"))
    p.add_argument("--variants", default="all", help=f"comma-separated, or all: {', '.join(VARIANTS)}")
    attention = "auto: the application's default; or kernels, comma-separated: one application run each"
    p.add_argument("--attention", default="auto", help=attention)
    p.add_argument("--vocab_size", type=int, default=32000, help="BPE vocabulary requested (an upper bound)")
    p.add_argument("--learning_rate", type=float, default=3e-4)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--mixed_precision", default="bf16", choices=("bf16", "fp16", "no"))
    p.add_argument("--gradient_checkpointing", default="false", choices=("true", "false"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: only to test this script")
    p.add_argument("--dry_run", action="store_true", help=f"the same code path, tiny, on CPU: {DRY_RUN}")
    p.add_argument("--tab", default=None, help="an Orange .tab corpus instead of the Grimm tales (tests)")
    p.add_argument("--out", default=str(BENCH / "results" / "gpu.json"), help="the JSON report (and .md beside)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before one variant's run is given up")
    p.add_argument("--budget_s", type=float, default=450, help="seconds for the whole run; variants past it skip")
    args = p.parse_args(argv)
    if args.dry_run:  # its values become the defaults: an option given still wins (--budget_s, --variants)
        p.set_defaults(**DRY_RUN)
        args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.logging_steps) < 1 or args.max_length < 2 or args.profile_steps < 0:
        p.error("--steps, --batch_size and --logging_steps must be at least 1, --max_length at least 2")
    return args


def variants(args: argparse.Namespace) -> list[dict]:
    """The runs, in order: [{variant, runner, options}]; --attention other than auto names the application's."""
    names = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown or not names:
        raise SystemExit(f"error: --variants takes all or names from {', '.join(VARIANTS)}")
    runs = []
    for name in names:
        if name in ("plain", "hf_trainer"):
            runs.append({"variant": name, "runner": name, "options": {}})
        elif args.attention == "auto" or (name != "defaults" and "attn_implementation" not in OPTIONS[name]):
            runs.append({"variant": name, "runner": "cloudtrain", "options": dict(OPTIONS.get(name, {}))})
        elif name == "defaults":
            for kernel in (k for k in args.attention.split(",") if k):
                runs.append({"variant": kernel, "runner": "cloudtrain", "options": {"attn_implementation": kernel}})
    return runs


# ---------------------------------------------------------------- in the child process
FIXED = {"task": "causal_lm", "warmup_ratio": 0.05, "lr_scheduler_type": "cosine", "weight_decay": 0.1}
FIXED |= {"max_grad_norm": 1.0, "eval_strategy": "no", "report_to": ["none"], "sample_max_new_tokens": 1}
FIXED |= {"sample_prompts": ["Once upon a time"], "overwrite_output_dir": True, "training_type": "accelerated"}
FIXED |= {"seed": 42}
FROM_SPEC = ("train_file", "validation_file", "packing", "max_length", "logging_steps", "learning_rate")
FROM_SPEC += ("mixed_precision", "gradient_checkpointing", "output_dir")


def app_options(spec: dict) -> dict:
    """The application's options for this work (what each runner reproduces)."""
    batch, profiled = spec["batch_size"], 1 + spec["profile_steps"] if spec["profile_steps"] else 0
    return (
        FIXED
        | {k: spec[k] for k in FROM_SPEC}
        | {
            "model_config": spec["preset"],
            "tokenizer_name_or_path": spec["tokenizer"],
            "per_device_train_batch_size": batch,
            "per_device_eval_batch_size": batch,
            "max_steps": spec["steps"] + profiled,
        }
    )


class StepProfiler:
    """torch.profiler over `active` steps after `skip` (and one warm-up step); `step()` after each step."""

    def __init__(self, skip: int, active: int, cuda: bool):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.cuda, self.active = cuda, active
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        plan = schedule(wait=skip, warmup=1, active=active, repeat=1) if active else None  # 0: no profile
        self.prof = profile(activities=activities, schedule=plan) if plan else None
        self.done = False

    # the application's callback events, and the plain loop's calls
    def on_train_begin(self, state=None) -> None:
        if self.prof:
            self.prof.start()

    def on_step_end(self, *args, **kwargs) -> None:
        if self.prof and not self.done:
            self.prof.step()

    def on_train_end(self, *args, **kwargs) -> None:
        if self.prof and not self.done:
            self.prof.stop()
            self.done = True

    def summary(self) -> dict | None:
        from cloudtrain.observe.profile import summarize

        return summarize(self.prof, self.active, self.cuda) if self.prof and self.done else None


def flops_per_token(model, rows, per_document: bool) -> float:
    """Training FLOPs per real token over the training rows: attention per document, or per row."""
    from cloudtrain.observe.flops import ModelFlops

    lengths = list(rows["seq_lengths"])
    tokens = sum(sum(row) for row in lengths)
    squares = sum(n * n for row in lengths for n in row) if per_document else sum(sum(row) ** 2 for row in lengths)
    return ModelFlops.from_model(model).training_flops(tokens, squares) / max(tokens, 1)


def measured(model, rows, spec: dict, per_document: bool, intervals: list[dict]) -> dict:
    """tokens/s (median of the timed intervals after the first), MFU, and the loss of the last timed one."""
    import torch

    from cloudtrain.observe.flops import matmul_precision, no_peak_reason, peak_flops

    timed = [i for i in intervals if i["step"] <= spec["steps"]]
    steady = timed[1:] or timed
    tokens_per_s = statistics.median(i["tokens_per_s"] for i in steady)
    per_token = flops_per_token(model, rows, per_document)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = matmul_precision(spec["mixed_precision"])
    peak = peak_flops(device, precision)
    cuda = device.type == "cuda"
    facts = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "device_memory": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "peak_flops": peak,
        "peak_note": no_peak_reason(device, precision),
    }
    return {
        "device_facts": facts,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": per_token,
        "mfu": tokens_per_s * per_token / peak if peak else None,
        "loss_at_steps": timed[-1]["loss"] if timed else None,
    }


def _memory(reset: bool = False) -> dict | None:
    """The allocator's peaks since the last reset (None on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def run_cloudtrain(spec: dict) -> dict:
    """build_run + fit through the application; its metrics.jsonl gives the intervals."""
    import torch

    from cloudtrain.config import build_config
    from cloudtrain.observe.tracking import read_metrics
    from cloudtrain.pipeline import build_run

    cfg = build_config({**app_options(spec), **spec["options"]})
    profiler = StepProfiler(spec["steps"], spec["profile_steps"], torch.cuda.is_available())
    run = build_run(cfg, callbacks=[profiler])
    _memory(reset=True)
    start = time.perf_counter()
    startup_s = time.monotonic() - STARTED
    result = run.trainer.fit()
    fit_s, peak = time.perf_counter() - start, _memory()
    logged = [r for r in read_metrics(run.run_log.path) if "train/tokens_per_s" in r]
    intervals = [{"step": r["step"], "tokens_per_s": r["train/tokens_per_s"], "loss": r["train/loss"]} for r in logged]
    steady = [r for r in logged if r["step"] <= spec["steps"]][1:]
    mfu_logged = [r["train/mfu"] for r in steady if "train/mfu" in r]
    data = [r["train/data_time_share"] for r in steady if "train/data_time_share" in r]
    rows = run.data.train
    return {
        **measured(run.model, rows, spec, True, intervals),
        "attention": getattr(run.model.config, "_attn_implementation", None),
        "steps": result.global_step,
        "train_tokens": result.train_tokens,
        "mfu_logged": statistics.median(mfu_logged) if mfu_logged else None,
        "data_share_logged": statistics.median(data) if data else None,
        "peak_memory": peak,
        "eval_loss": run.trainer.evaluate("validation")["loss"],
        "fit_s": fit_s,
        "startup_s": startup_s,
        "profile": profiler.summary(),
        **_shape(run.model, rows, spec),
    }


def _shape(model, rows, spec: dict) -> dict:
    fill = sum(sum(n) for n in rows["seq_lengths"]) / (len(rows) * spec["max_length"])
    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "vocab_size": model.config.vocab_size, "row_fill": fill}


def _same_work(spec: dict):
    """The application's data and model for this work, built as build_run builds them, without its trainer."""
    from transformers import set_seed

    from cloudtrain.config import build_config
    from cloudtrain.pipeline import resolve
    from cloudtrain.tasks import build_task

    cfg = build_config(app_options(spec))
    task = build_task(cfg)
    cfg = resolve(cfg, task)
    set_seed(cfg.training.seed)
    tokenizer = task.load_tokenizer(cfg)
    data = task.process(task.connect(cfg), tokenizer, cfg)
    model = task.load_model(cfg, data, tokenizer, announce=False).float()
    model.config.use_cache = False  # a cache mixes packed documents (docs/language-models.md)
    return cfg, data, model


class Intervals:
    """Per-batch token counts (in the order the batches are made, which is the order they are trained) and,
    every logging_steps steps, one sync: the interval's tokens/s and mean loss."""

    def __init__(self, every: int):
        self.every, self.tokens, self.intervals = every, [], []
        self.last, self.loss_sum, self.steps = time.perf_counter(), 0.0, 0

    def batch(self, batch: dict) -> dict:
        self.tokens.append(int(batch["attention_mask"].sum()))
        return batch

    def step_done(self, step: int, loss) -> None:
        import torch

        self.loss_sum, self.steps = self.loss_sum + loss, self.steps + 1
        if step % self.every:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        tokens = sum(self.tokens[step - self.steps : step])
        loss_mean = float(self.loss_sum) / self.steps
        self.intervals.append({"step": step, "tokens_per_s": tokens / (now - self.last), "loss": loss_mean})
        self.last, self.loss_sum, self.steps = now, 0.0, 0


def _eval_loss(model, data, spec: dict) -> float:
    """Mean loss per predicted token on the validation rows, documents kept apart (position_ids, no cache)."""
    import torch

    device = next(model.parameters()).device
    model.eval()
    total = count = 0.0
    rows = list(data.validation)
    with torch.no_grad(), _autocast(spec, device):
        for i in range(0, len(rows), spec["batch_size"]):
            batch = data.collator(rows[i : i + spec["batch_size"]])
            n = float((batch["labels"][:, 1:] != -100).sum())
            ids, pos, labels = (batch[k].to(device) for k in ("input_ids", "position_ids", "labels"))
            total += float(model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss) * n
            count += n
    return total / max(count, 1.0)


def _autocast(spec: dict, device):
    import contextlib

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["mixed_precision"])
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def run_plain(spec: dict) -> dict:
    """The floor: the loop anyone would write. Same rows, as full causal rows (no position_ids, no mask)."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    cfg, data, model = _same_work(spec)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device).train()
    t, clock = cfg.training, Intervals(spec["logging_steps"])
    decay = [p for p in model.parameters() if p.ndim >= 2]  # no decay on biases and norms, as the application
    groups = [{"params": decay, "weight_decay": t.weight_decay}]
    groups.append({"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, lr=t.learning_rate, fused=True)
    scheduler = get_scheduler("cosine", optimizer, round(t.warmup_ratio * t.max_steps), t.max_steps)
    loader = DataLoader(
        data.train,
        batch_size=spec["batch_size"],
        shuffle=True,
        drop_last=True,
        collate_fn=lambda rows: clock.batch(data.collator(rows)),
        generator=torch.Generator().manual_seed(t.seed),
        pin_memory=cuda,
    )
    scaler = torch.amp.GradScaler(device.type, enabled=spec["mixed_precision"] == "fp16")
    profiler = StepProfiler(spec["steps"], spec["profile_steps"], cuda)
    _memory(reset=True)
    start, step, startup_s = time.perf_counter(), 0, time.monotonic() - STARTED
    profiler.on_train_begin()
    while step < t.max_steps:
        for batch in loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with _autocast(spec, device):
                loss = model(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            clock.step_done(step, loss.detach())
            profiler.on_step_end()
            if step == t.max_steps:
                break
    profiler.on_train_end()
    fit_s, peak = time.perf_counter() - start, _memory()
    return _floor_result(spec, model, data, clock, profiler, (startup_s, fit_s), peak, per_document=False)


def _floor_result(spec, model, data, clock, profiler, times: tuple[float, float], peak, per_document: bool) -> dict:
    return {
        **measured(model, data.train, spec, per_document, clock.intervals),
        "attention": getattr(model.config, "_attn_implementation", None),
        "steps": app_options(spec)["max_steps"],
        "train_tokens": sum(clock.tokens),
        "peak_memory": peak,
        "eval_loss": _eval_loss(model, data, spec),
        "startup_s": times[0],
        "fit_s": times[1],
        "profile": profiler.summary(),
        **_shape(model, data.train, spec),
    }


HF_FIXED = {"lr_scheduler_type": "cosine", "optim": "adamw_torch_fused", "save_strategy": "no", "report_to": []}
HF_FIXED |= {"dataloader_drop_last": True, "remove_unused_columns": False, "disable_tqdm": True}


def run_hf_trainer(spec: dict) -> dict:
    """transformers.Trainer on the same model and rows: position_ids given, no attention_mask, as a user would
    (with a mask, transformers lets packed documents attend to each other)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg, data, model = _same_work(spec)
    cuda = torch.cuda.is_available()
    t, clock = cfg.training, Intervals(spec["logging_steps"])
    profiler = StepProfiler(spec["steps"], spec["profile_steps"], cuda)

    def collate(rows: list[dict]) -> dict:
        batch = clock.batch(data.collator(rows))
        return {k: batch[k] for k in ("input_ids", "position_ids", "labels")}

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            profiler.on_train_begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_done(state.global_step, 0.0)
            profiler.on_step_end()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and clock.intervals:
                clock.intervals[-1]["loss"] = logs["loss"]  # Trainer's own interval loss, read where it syncs

    precision = {"bf16": spec["mixed_precision"] == "bf16", "fp16": spec["mixed_precision"] == "fp16"}
    args = TrainingArguments(
        **HF_FIXED,
        **precision,
        output_dir=spec["output_dir"],
        max_steps=t.max_steps,
        per_device_train_batch_size=spec["batch_size"],
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=round(t.warmup_ratio * t.max_steps),
        max_grad_norm=t.max_grad_norm,
        logging_steps=spec["logging_steps"],
        seed=t.seed,
        dataloader_pin_memory=cuda,
        use_cpu=not cuda,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data.train, data_collator=collate, callbacks=[Timing()])
    _memory(reset=True)
    start, startup_s = time.perf_counter(), time.monotonic() - STARTED
    trainer.train()
    profiler.on_train_end()
    fit_s, peak = time.perf_counter() - start, _memory()
    return _floor_result(spec, model, data, clock, profiler, (startup_s, fit_s), peak, per_document=True)


RUNNERS = {"cloudtrain": run_cloudtrain, "plain": run_plain, "hf_trainer": run_hf_trainer}


def outcome(spec: dict) -> dict:
    """One variant's result; an option the application does not have or refuses: status refused, its line."""
    from cloudtrain.errors import UserError

    head = {"variant": spec["variant"], "runner": spec["runner"], "options": spec["options"]}
    try:
        return {**head, "status": "ok", **RUNNERS[spec["runner"]](spec)}
    except UserError as err:
        return {**head, "status": "refused", "error": f"refused: {_first_line(str(err))}"}


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def _one_main(spec_json: str, result_path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(spec_json)
    try:
        result = outcome(spec)
    except BaseException as err:  # its one line goes to the report; the traceback to the log
        line = f"{type(err).__name__}: {_first_line(str(err))}"
        Path(result_path).with_suffix(".err").write_text(line)
        raise
    Path(result_path).write_text(json.dumps(result))


def run_one(spec: dict, timeout: float) -> dict:
    """One variant in a fresh interpreter; a failure is reported, not raised (the other variants still run)."""
    head = {"variant": spec["variant"], "runner": spec["runner"], "options": spec["options"]}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--_one", json.dumps(spec), str(result)],
                cwd=REPO,
                # --device cpu: the variant's process sees no GPU (this one keeps its own: a test may call main())
                env={**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if spec["device"] == "cpu" else {})},
                timeout=timeout,
                stdout=sys.stderr,
                stderr=subprocess.STDOUT,
            )
        except subprocess.TimeoutExpired:
            return {**head, "status": "error", "error": f"gave up after {timeout:.0f}s"}
        if proc.returncode != 0 or not result.is_file():
            error = result.with_suffix(".err")
            reason = error.read_text().strip() if error.is_file() else f"exit {proc.returncode}"
            return {**head, "status": "error", "error": reason}
        return json.loads(result.read_text()) | {"wall_s": time.monotonic() - started}


def shared_spec(args: argparse.Namespace, corpus) -> dict:
    """What every variant's spec holds besides its own {variant, runner, options} and output_dir."""
    shared = {k: getattr(args, k) for k in ("preset", "packing", "max_length", "batch_size", "steps", "device")}
    shared |= {k: getattr(args, k) for k in ("logging_steps", "learning_rate", "mixed_precision", "profile_steps")}
    shared |= {"tokenizer": str(corpus.tokenizer_dir), "train_file": str(corpus.train_file)}
    shared |= {"validation_file": str(corpus.validation_file)}
    shared["gradient_checkpointing"] = args.gradient_checkpointing == "true"
    return shared


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu.py needs a CUDA GPU and none is visible here; on CPU, `--dry_run` runs the same code path tiny",
            file=sys.stderr,
        )
        return 2
    import lm_corpus

    plan_runs = variants(args)
    corpus = lm_corpus.prepare(args.vocab_size, Path(args.tab) if args.tab else None)
    report = {"device": args.device, "device_memory": None, "peak_flops": None, "peak_note": None}
    report["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "timeout")}
    report["corpus"] = {"train_documents": corpus.train_documents, "vocab_size": corpus.vocab_size}
    report |= {"runs": [], "planner": {"error": "not run yet"}}
    out = Path(args.out)
    shared = shared_spec(args, corpus)
    with tempfile.TemporaryDirectory() as tmp:
        longest = 0.0  # the longest variant so far: one started with less time left would be cut, its time lost
        for run in plan_runs:
            left = args.budget_s - (time.monotonic() - started) - PLANNER_RESERVE_S
            if left < max(10.0, longest):
                report["runs"].append({**run, "status": "skipped", "error": f"skipped: --budget_s {args.budget_s:g}"})
                continue
            begun = time.monotonic()
            print(f"[{time.strftime('%H:%M:%S')}] {run['variant']}: {args.steps} steps", flush=True)
            spec = run | shared | {"output_dir": str(Path(tmp) / run["variant"])}
            report["runs"].append(run_one(spec, min(args.timeout, left)))
            longest = max(longest, time.monotonic() - begun)
            report |= report["runs"][-1].pop("device_facts", None) or {}  # the device as the runs saw it
            compare(report)
            report["seconds"] = time.monotonic() - started
            write(report, out)  # after every variant: a run cut short still leaves what it measured
    done = [r for r in report["runs"] if r.get("status") == "ok"]
    memory = report.get("device_memory") or 80 * GIB
    if done:
        attach_planner(report, planner_estimates(args, done, corpus.tokenizer_dir, memory / GIB))
    else:
        report["planner"] = {"error": "no variant ran"}
    report["seconds"] = time.monotonic() - started
    write(report, out)
    print(render(report))
    print(f"results in {out} and {out.with_suffix('.md')}")
    return 0 if done else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_one":
        _one_main(*sys.argv[2:4])
    else:
        sys.exit(main())
