"""One run of bench/sft_bench.py, in a fresh interpreter: train `steps` steps with one runner (ours, or
transformers.Trainer, or TRL's SFTTrainer), time every step, count what each batch held, take the held-out loss."""

import json
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from fresh_process import prepare_worker
from sft_data import messages
from sft_heldout import heldout_loss
from sft_settings import IGNORE_INDEX, SFTSettings

PROCESS_START = time.perf_counter()  # a worker's start: its setup time is counted from here


class StepMeter:
    """Step end times and what each step's batch held: computed positions, real tokens, examples, answer tokens."""

    def __init__(self):
        self.start = time.perf_counter()
        self.rss_at_start_mb = 0.0
        self.ends: list[float] = []
        self.computed = self.real = self.examples = self.answer = self.batches = 0

    def count(self, batch: dict) -> None:
        ids, mask, positions = batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
        real = mask.bool() if mask is not None else ids.new_ones(ids.shape, dtype=bool)
        self.computed += ids.numel()
        self.real += int(real.sum())
        # an example starts where the positions restart (packed rows, flattened rows), else one per row
        self.examples += int(((positions == 0) & real).sum()) if positions is not None else ids.shape[0]
        self.answer += int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
        self.batches += 1

    def begin(self) -> None:
        """Training starts: the clock, and the peak memory so far (imports, data, model)."""
        self.start = time.perf_counter()
        self.rss_at_start_mb = peak_rss_mb()

    def step_done(self) -> None:
        self.ends.append(time.perf_counter())

    def result(self) -> dict:
        times = [b - a for a, b in pairwise([self.start, *self.ends])]
        step_s = statistics.median(times[1:] if len(times) > 1 else times)
        n = max(len(self.ends), 1)
        return {
            "steps": len(self.ends),
            "batches": self.batches,
            "examples_seen": self.examples,
            "real_tokens_seen": self.real,
            "answer_tokens_seen": self.answer,
            "computed_positions": self.computed,
            "padding_fraction": 1 - self.real / max(self.computed, 1),
            "median_step_s": step_s,
            "time_to_first_step_s": times[0] if times else None,
            "train_s": self.ends[-1] - self.start,
            "rss_before_training_mb": self.rss_at_start_mb,
            "setup_s": self.start - PROCESS_START,
            "real_tokens_per_s": self.real / n / step_s,
            "computed_tokens_per_s": self.computed / n / step_s,
        }


def _ours(spec: dict, s: SFTSettings, out: str, saved: str) -> tuple[StepMeter, float]:
    from cloudtrain.config import build_config
    from cloudtrain.pipeline import build_run

    cfg = build_config(
        {
            "task": "sft",
            "model_name_or_path": spec["model_dir"],
            "train_file": spec["train_file"],
            "validation_file": spec["heldout_file"],
            "packing": spec["runner"].split("-")[1],
            "max_length": s.max_length,
            "per_device_train_batch_size": spec["rows_per_step"],
            "per_device_eval_batch_size": s.eval_batch_size,
            "max_steps": s.steps,
            "logging_steps": s.steps,
            "learning_rate": s.learning_rate,
            "warmup_ratio": s.warmup_ratio,
            "lr_scheduler_type": s.lr_scheduler_type,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "adamw_implementation": "fused",
            "mixed_precision": "no",
            "seed": s.seed,
            "eval_strategy": "no",
            "report_to": ["none"],
            "num_sample_prompts": 0,
            "attn_implementation": "sdpa",
            "output_dir": out,
            "cache_dir": spec["cache_dir"],
            "training_type": "accelerated",
        }
    )
    run = build_run(cfg)
    trainer = run.trainer
    step, backward = trainer.optimizer_step, trainer.backward_window
    meter = StepMeter()

    def timed_step() -> None:
        step()
        meter.step_done()

    def counted_backward(window, scale):
        for batch in window:
            meter.count(batch)
        return backward(window, scale)

    trainer.optimizer_step, trainer.backward_window = timed_step, counted_backward
    meter.begin()
    result = trainer.fit()
    trainer.save_model(Path(saved))
    return meter, result.train_loss


def _trainer_args(spec: dict, s: SFTSettings, out: str) -> dict:
    """transformers.TrainingArguments (and SFTConfig) options for the same optimisation as ours."""
    return dict(
        output_dir=out,
        max_steps=s.steps,
        per_device_train_batch_size=spec["rows_per_step"],
        learning_rate=s.learning_rate,
        lr_scheduler_type=s.lr_scheduler_type,
        warmup_steps=round(s.warmup_ratio * s.steps),
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        seed=s.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=s.steps,
        report_to="none",
        disable_tqdm=True,
    )


def _hf_family(spec: dict, s: SFTSettings, out: str, saved: str) -> tuple[StepMeter, float, dict]:
    """hf-trainer, trl-none and trl-packing: the same model folder, cloudtrain's sampler, timed by a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from cloudtrain.data.chat import ChatFormat
    from cloudtrain.data.processing import EpochShuffleSampler

    meter = StepMeter()
    extra: dict = {}
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    chat = ChatFormat.setup(tokenizer, None)  # the folder's own template, as ours uses it
    pairs = [json.loads(line) for line in Path(spec["train_file"]).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            meter.step_done()

    def same_order(base):
        class SameOrder(base):
            """cloudtrain's seeded order of the rows, so the unpacked runners see exactly the same batches."""

            def _get_train_sampler(self, train_dataset=None):
                return EpochShuffleSampler(len(train_dataset or self.train_dataset), s.seed)

            def training_step(self, model, inputs, *args, **kwargs):
                meter.count(inputs)
                return super().training_step(model, inputs, *args, **kwargs)

        return SameOrder

    if spec["runner"] == "hf-trainer":

        def row(pair):
            ids, mask = chat.encode(messages(pair))
            return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]}

        pad = tokenizer.eos_token_id

        def collate(features):  # what a user writes: pad to the longest row, mask prompt and padding
            width = max(len(f["input_ids"]) for f in features)
            return {
                "input_ids": torch.tensor([f["input_ids"] + [pad] * (width - len(f["input_ids"])) for f in features]),
                "labels": torch.tensor([f["labels"] + [IGNORE_INDEX] * (width - len(f["labels"])) for f in features]),
                "attention_mask": torch.tensor(
                    [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
                ),
            }

        trainer = same_order(Trainer)(
            model=model,
            args=TrainingArguments(**_trainer_args(spec, s, out)),
            train_dataset=Dataset.from_list([row(p) for p in pairs]),
            data_collator=collate,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
    else:
        from trl import SFTConfig, SFTTrainer

        packing = spec["runner"] == "trl-packing"
        config = SFTConfig(
            **_trainer_args(spec, s, out),
            max_length=s.max_length,
            packing=packing,
            packing_strategy="bfd",
            completion_only_loss=True,
            gradient_checkpointing=False,
        )
        # The same tokens and loss mask as ours, pre-tokenized (TRL takes input_ids + completion_mask as they are).
        encoded = [chat.encode(messages(p)) for p in pairs]
        tokens = Dataset.from_list([{"input_ids": ids, "completion_mask": mask} for ids, mask in encoded])
        trainer = same_order(SFTTrainer)(
            model=model, args=config, train_dataset=tokens, processing_class=tokenizer, callbacks=[Clock()]
        )
        extra["padding_free"] = bool(trainer.padding_free)
        extra["train_rows"] = len(trainer.train_dataset)
        if not packing:  # what TRL's own tokenization of the conversational pairs would have trained instead
            conversations = Dataset.from_list(
                [{"prompt": messages(p)[:1], "completion": messages(p)[1:]} for p in pairs]
            )
            own = trainer._prepare_dataset(conversations, tokenizer, config, False, None, "conversations")
            extra.update(inputs_differing_from_ours=0, trained_not_by_ours=0, not_trained_by_trl=0)
            for (ids, mask), example in zip(encoded, own, strict=True):
                if example["input_ids"] != ids:
                    extra["inputs_differing_from_ours"] += 1
                    continue
                trained = [label != IGNORE_INDEX for label in example["labels"]]
                extra["trained_not_by_ours"] += sum(t and not m for t, m in zip(trained, mask, strict=True))
                extra["not_trained_by_trl"] += sum(m and not t for t, m in zip(trained, mask, strict=True))
    trainer.train()
    trainer.save_model(saved)
    losses = [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry]
    return meter, losses[-1] if losses else float("nan"), extra


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM, not getrusage's ru_maxrss: a child inherits its
    parent's ru_maxrss across fork and exec, so a worker started by a parent holding 1 GB reported at least 1 GB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS: rough


def train_once(spec: dict) -> dict:
    """Train `steps` steps with one runner, save the weights, take the held-out loss on them."""
    import torch

    s = SFTSettings(**spec["settings"])
    if s.threads:
        torch.set_num_threads(s.threads)
    extra: dict = {}
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as saved:
        if spec["runner"].startswith("ours"):
            meter, train_loss = _ours(spec, s, out, saved)
        else:
            meter, train_loss, extra = _hf_family(spec, s, out, saved)
        peak = peak_rss_mb()  # before the held-out pass
        evaluated = time.perf_counter()
        heldout = heldout_loss(saved, spec["model_dir"], spec["heldout_file"], s.eval_batch_size)
        evaluated = time.perf_counter() - evaluated
    return {
        **meter.result(),
        **heldout,
        **extra,
        "rows_per_step": spec["rows_per_step"],
        "train_loss": train_loss,
        "peak_rss_mb": peak,
        "heldout_s": evaluated,
        "num_threads": torch.get_num_threads(),
    }


def worker_main(spec_json: str, result_path: str) -> None:
    start = time.perf_counter()  # this interpreter's imports of torch & co. come after
    prepare_worker()
    from cloudtrain.hardware import keep_freed_memory

    keep_freed_memory()  # the same allocator for every runner (cloudtrain sets it for CPU training)
    result = train_once(json.loads(spec_json))
    result["process_s"] = time.perf_counter() - start
    Path(result_path).write_text(json.dumps(result))
