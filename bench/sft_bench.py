"""The SFT case of `make bench`: cloudtrain's `--task sft` (packing none and bfd) against transformers.Trainer and
TRL's SFTTrainer (packing off and on), on the same fine-tuning work, on CPU.

The work: Reuters R8 news (data/reuters-r8, on disk) as instruction pairs, prompt "Which topic is this article
about: acq, crude, ...?" followed by the article (cut to its first words so that every example fits in
`max_length`: articles vary from a few words to the cap, so batches padded to their longest row carry much
padding), completion the category. The same examples in the same order for every runner: the first
`train_examples` of the training file, and for the held-out loss the first `heldout_examples` of the test file.

The model: a Llama from the shipped preset src/cloudtrain/model_presets/llama-8m.json, random weights from
one seed, with the tokenizer of data/grimm/tokenizer (byte-level BPE, no chat template, no pad token) given
the chatml template and its two special tokens (ChatFormat.setup), the embeddings sized for them (a
multiple of 64). Model and tokenizer are saved once to one folder that every runner starts from, so the
weights, the template and the token ids are the same everywhere; everyone pads with EOS (there is no pad
token). fp32, sdpa attention, one thread per run.

The runners:
- ours-none / ours-bfd: the real application (`cloudtrain.pipeline.build_run`, then `trainer.fit()`, the
  AcceleratedTrainer), `--task sft --packing none|bfd`;
- hf-trainer: transformers.Trainer with the collator a user would write (pad to the longest row, labels -100
  on prompt tokens and padding, an attention mask), the token ids and loss masks from cloudtrain.data.chat.ChatFormat
  (the same tokens as ours);
- trl-none / trl-packing: TRL's SFTTrainer with completion_only_loss=True on our tokens, pre-tokenized
  (input_ids + completion_mask from ChatFormat, which TRL takes as they are). Given the conversational
  prompt/completion pairs instead, TRL tokenizes them into the same input tokens but also trains the newline
  chatml writes after <|im_end|> (ours leaves it out: the template's, never generated): one more target per
  example, which at these few steps cost TRL ~0.4 of held-out answer loss. Equal work needs equal targets, so
  TRL gets ours; every trl-none run still checks, example by example, what TRL's own tokenization would have
  trained (reported under the table); packing=True uses packing_strategy="bfd", which TRL runs
  padding-free (the rows of a batch flattened into one sequence, documents told apart by position_ids).
  SFTConfig defaults that would make the work unequal are set back: gradient_checkpointing=False (TRL's
  default is True) and bf16=False (TRL's default is True).
Every runner: AdamW fused, no weight decay, clipping at 1.0, the same learning-rate schedule (warmup then
cosine), the same steps, one micro-batch per step, and glibc's allocator told to keep freed memory (as
cloudtrain does for CPU training; bench/worker.py does the same for every runner). The Trainer-based runners
take cloudtrain's seeded sampler (EpochShuffleSampler), so ours-none, hf-trainer and trl-none see exactly the
same batches in the same order, and reach the same held-out loss (the same maths).

Equal work, and why this design: packed rows hold several examples, so at equal rows per step packed runners
would see ~k times more examples and tokens, and their loss would be lower for that reason alone. Instead
every runner takes the same steps and, on average, the same examples and real tokens per step (the lm_bench
design): `batch_size` rows of `max_length` per step for the packed runners, and for the unpacked runners as
many examples per step as our bfd rows hold on average. The optimizer then sees the same number of updates
on the same amount of text under the same schedule, so the held-out losses compare directly, and tokens/s
is the speed at which the same training is done. The examples, real tokens and answer tokens each runner
actually saw are reported beside the loss (TRL 1.16's bfd forms the very rows ours does, so ours-bfd and
trl-packing see the same batches too).

Reported per runner: real (non-padding) tokens/s = real tokens per step over the median step time (first step
left out); computed tokens/s, padding included (for TRL's padding-free rows there is no padding, but attention
runs over the whole flattened batch); the padding fraction; peak RSS of the run's process after training
(VmHWM: see `peak_rss_mb`); the held-out loss: mean cross-entropy over the answer tokens (answer and
end-of-turn) of the held-out examples, one example per row, computed by `heldout_loss` on the weights each
runner saved, the same function for all.

What TRL does differently on this work (1.16, measured here):
- its padding-free rows have no varlen kernel on CPU: sdpa attends over the whole flattened batch
  (batch_size x max_length positions) under a block-diagonal mask built from position_ids, so attention costs
  about batch_size times that of separate rows (one flattened row of 4 x 512 took ~1.5x the forward+backward
  time of the 4 rows of 512, one thread). With flash_attention_2 on a GPU this cost goes away, so the
  ours-bfd / trl-packing ratio measured here is a CPU result;
- its fused LM head projects only the positions that have a label (the answer tokens, ~2% here), while ours
  computes the logits of every position: trl-none does the same padded work as hf-trainer minus most of the
  LM head and its softmax;
- SFTConfig turns on gradient checkpointing and bf16 by default (set off here, see above).

Each run is a fresh interpreter (`python bench/sft_bench.py --worker SPEC RESULT`) on one thread; repetitions
are interleaved, in an order rotated each repetition. CPU training is deterministic here: the losses repeat
exactly across repetitions, only the times vary.

    python bench/sft_bench.py [--repetitions 1] [--steps 6] [--out DIR]      # alone
    run_section(repetitions, steps, log=...) -> (markdown, results)          # from bench/run.py
"""

import argparse
import csv
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

PROCESS_START = time.perf_counter()  # a worker's start: its setup time is counted from here
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
R8 = REPO / "data" / "reuters-r8"
TOKENIZER = REPO / "data" / "grimm" / "tokenizer"
PRESETS = REPO / "src" / "cloudtrain" / "model_presets"
QUESTION = "Which topic is this article about: acq, crude, earn, grain, interest, money-fx, ship or trade?\n\n"
RUNNERS = ("ours-none", "ours-bfd", "hf-trainer", "trl-none", "trl-packing")
PACKED = {"ours-none": False, "ours-bfd": True, "hf-trainer": False, "trl-none": False, "trl-packing": True}
IGNORE_INDEX = -100
TITLE = "## SFT: ours vs transformers.Trainer vs TRL"
GOAL_VS_HF, GOAL_VS_TRL = 1.3, 1.0


@dataclass
class SFTSettings:
    """What every runner shares."""

    max_length: int = 512  # fits 91% of the articles whole: lengths vary as they do in the news
    batch_size: int = 4  # rows of max_length per step for the packed runners; unpacked ones get as many examples
    steps: int = 6
    learning_rate: float = 1e-3
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "cosine"
    train_examples: int = 400  # the pool every runner packs or batches from (more than the steps consume)
    heldout_examples: int = 64
    eval_batch_size: int = 16
    preset: str = "llama-8m"
    model_overrides: dict = field(default_factory=dict)  # e.g. a tinier model for the tests
    threads: int = 1  # one thread: the least disturbed by other tenants of a shared machine (0: torch's default)
    seed: int = 42
    runners: list = field(default_factory=lambda: list(RUNNERS))


# ---------------------------------------------------------------- the parent: data, model, plan
def read_r8(path: Path, limit: int) -> list[tuple[str, str]]:
    """(category, text) of the first `limit` rows of an R8 .tab file (three header rows)."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for i, row in enumerate(csv.reader(f, delimiter="\t")):
            if i < 3 or len(row) != 2 or not row[1].strip():
                continue
            rows.append((row[0], row[1]))
            if len(rows) == limit:
                break
    return rows


def to_pair(category: str, text: str, chat, max_length: int) -> dict:
    """The instruction pair, the article cut to its first words so the whole example fits in `max_length`."""
    words = text.split()
    n = len(words)
    while True:
        pair = {"prompt": QUESTION + " ".join(words[:n]), "completion": category}
        length = len(chat.encode(messages(pair))[0])
        if length <= max_length or n <= 1:
            return pair
        n = max(1, min(n - 1, int(n * max_length / length)))


def messages(pair: dict) -> list[dict]:
    return [{"role": "user", "content": pair["prompt"]}, {"role": "assistant", "content": pair["completion"]}]


def model_config(s: SFTSettings, tokenizer) -> dict:
    """The preset's config.json with the vocabulary (chat tokens included) rounded up to a multiple of 64."""
    config = json.loads((PRESETS / f"{s.preset}.json").read_text())
    config.update(s.model_overrides)
    config.update(
        vocab_size=math.ceil(len(tokenizer) / 64) * 64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        max_position_embeddings=max(config.get("max_position_embeddings", 0), s.max_length),
    )
    return config


@dataclass
class Prepared:
    model_dir: str
    train_file: str
    heldout_file: str
    data: dict  # statistics for the report
    unpacked_rows: int  # examples per step for the unpacked runners


def prepare(s: SFTSettings, folder: Path) -> Prepared:
    """One model+tokenizer folder (chatml set, tokens added, random weights from the seed), the pairs as
    JSON lines, and how many examples per step hold the real tokens of `batch_size` packed rows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.data.chat import ChatFormat
    from cloudtrain.data.packing import pack_examples

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    chat = ChatFormat.setup(tokenizer, "chatml")
    model_dir = folder / "model"
    tokenizer.save_pretrained(model_dir)
    config = model_config(s, tokenizer)
    torch.manual_seed(s.seed)
    kwargs = dict(config)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(kwargs.pop("model_type"), **kwargs), dtype=torch.float32
    )
    model.save_pretrained(model_dir)
    parameters = sum(p.numel() for p in model.parameters())

    files = {}
    encoded = {}
    for split, source, limit in (
        ("train", "reuters-r8-train.tab", s.train_examples),
        ("heldout", "reuters-r8-test.tab", s.heldout_examples),
    ):
        pairs = [to_pair(c, t, chat, s.max_length) for c, t in read_r8(R8 / source, limit)]
        files[split] = folder / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(p) + "\n" for p in pairs))
        encoded[split] = [chat.encode(messages(p)) for p in pairs]
    ids = [i for i, _ in encoded["train"]]
    rows = pack_examples(ids, [m for _, m in encoded["train"]], s.max_length, "bfd")
    per_row = len(ids) / len(rows)
    lengths = sorted(len(x) for x in ids)
    data = {
        "train_examples": len(ids),
        "heldout_examples": len(encoded["heldout"]),
        "train_tokens": sum(lengths),
        "min_tokens": lengths[0],
        "median_tokens": lengths[len(lengths) // 2],
        "max_tokens": lengths[-1],
        "answer_tokens_per_example": sum(sum(m[1:]) for _, m in encoded["train"]) / len(ids),
        "bfd_rows": len(rows),
        "examples_per_bfd_row": per_row,
        "bfd_fill": sum(lengths) / (len(rows) * s.max_length),
        "vocab_size": config["vocab_size"],
        "parameters": parameters,
        "chat_template": chat.source,
        "initial_heldout_loss": heldout_loss(str(model_dir), str(model_dir), str(files["heldout"]), s.eval_batch_size)[
            "heldout_loss"
        ],
    }
    return Prepared(
        str(model_dir), str(files["train"]), str(files["heldout"]), data, max(1, round(s.batch_size * per_row))
    )


def worker_spec(s: SFTSettings, p: Prepared, runner: str, cache_dir: str) -> dict:
    return {
        "settings": asdict(s),
        "runner": runner,
        "model_dir": p.model_dir,
        "train_file": p.train_file,
        "heldout_file": p.heldout_file,
        "rows_per_step": s.batch_size if PACKED[runner] else p.unpacked_rows,
        "cache_dir": cache_dir,
    }


def run_worker(spec: dict, log, timeout: float | None = None) -> dict:
    """One run in a fresh interpreter; its output goes to `log`, its result comes back."""
    return run_script(__file__, spec, log, f"SFT benchmark run {spec['runner']}", timeout)


SUMMARY_KEYS = (
    "real_tokens_per_s",
    "computed_tokens_per_s",
    "median_step_s",
    "peak_rss_mb",
    "heldout_loss",
    "train_loss",
)


def _summary(runs: list[dict]) -> dict:
    return {
        k: {
            "median": statistics.median(r[k] for r in runs),
            "min": min(r[k] for r in runs),
            "max": max(r[k] for r in runs),
        }
        for k in SUMMARY_KEYS
    }


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def run(s: SFTSettings, repetitions: int = 1, log=None) -> dict:
    """Every runner, `repetitions` times interleaved; {"settings", "data", "runners": {name: ...}, "goals"}."""
    start = time.perf_counter()
    skipped = {}
    if not trl_available():
        skipped = {
            r: "trl is not installed (pip install -r requirements-dev.txt)" for r in s.runners if r.startswith("trl")
        }
        s = replace(s, runners=[r for r in s.runners if r not in skipped])
    own_log = log is None
    with tempfile.TemporaryDirectory() as tmp:
        log = log or tempfile.NamedTemporaryFile("w", prefix="sft_bench-", suffix=".log", delete=False)
        try:
            prepared = prepare(s, Path(tmp))
            specs = {r: worker_spec(s, prepared, r, str(Path(tmp) / "cache")) for r in s.runners}
            runs: dict[str, list] = {r: [] for r in s.runners}
            names = list(s.runners)
            for rep in range(repetitions):
                shift = rep % len(names)
                for r in names[shift:] + names[:shift]:
                    print(
                        f"[{time.strftime('%H:%M:%S')}] SFT repetition {rep + 1}/{repetitions}: {r} "
                        f"({s.steps} steps of {specs[r]['rows_per_step']} rows)",
                        file=sys.stderr,
                        flush=True,
                    )
                    runs[r].append(run_worker(specs[r], log))
        finally:
            if own_log:
                log.close()
        if own_log:  # reached only when every run succeeded
            os.unlink(log.name)
    runners = {
        r: {
            "rows_per_step": specs[r]["rows_per_step"],
            "packed": PACKED[r],
            "runs": runs[r],
            "summary": _summary(runs[r]),
        }
        for r in s.runners
    }
    return {
        "settings": asdict(s),
        "repetitions": repetitions,
        "data": prepared.data,
        "runners": runners,
        "skipped": skipped,
        "goals": goals(runners),
        "wall_s": time.perf_counter() - start,
    }


def goals(runners: dict) -> dict:
    """The issue's two targets: ours-bfd at least 1.3x hf-trainer's real tokens/s, and not slower than trl-packing."""

    def rate(name):
        return runners[name]["summary"]["real_tokens_per_s"]["median"] if name in runners else None

    def loss(name):
        return runners[name]["summary"]["heldout_loss"]["median"] if name in runners else None

    out = {}
    for key, other, target in (
        ("vs_hf_trainer", "hf-trainer", GOAL_VS_HF),
        ("vs_trl_packing", "trl-packing", GOAL_VS_TRL),
    ):
        ours, theirs = rate("ours-bfd"), rate(other)
        ratio = ours / theirs if ours and theirs else None
        out[key] = {
            "ratio": ratio,
            "target": target,
            "met": None if ratio is None else ratio >= target,
            "loss_difference": None if ratio is None else loss("ours-bfd") - loss(other),
        }
    return out


# ---------------------------------------------------------------- one run (a fresh interpreter)
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


def heldout_loss(model_dir: str, tokenizer_dir: str, heldout_file: str, batch_size: int) -> dict:
    """Mean cross-entropy over the answer tokens of the held-out pairs, one example per row, on the weights saved
    in `model_dir`; the same function for every runner."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.data.chat import ChatFormat

    chat = ChatFormat.setup(AutoTokenizer.from_pretrained(tokenizer_dir), None)
    encoded = [chat.encode(messages(json.loads(line))) for line in Path(heldout_file).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    total, count = 0.0, 0
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), chat.tokenizer.eos_token_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, (ids, mask) in enumerate(chunk):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            labels[b, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), IGNORE_INDEX)
            attention[b, : len(ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        targets = labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ).item()
        count += int((targets != IGNORE_INDEX).sum())
    return {"heldout_loss": total / max(count, 1), "heldout_answer_tokens": count}


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
    extra = {}
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
    extra = {}
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


def _worker_main(spec_json: str, result_path: str) -> None:
    start = time.perf_counter()  # this interpreter's imports of torch & co. come after
    prepare_worker()
    from cloudtrain.hardware import keep_freed_memory

    keep_freed_memory()  # the same allocator for every runner (cloudtrain sets it for CPU training)
    result = train_once(json.loads(spec_json))
    result["process_s"] = time.perf_counter() - start
    Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- the report
def markdown(sft: dict) -> str:
    """The report's section: one row per runner, the goal ratios under it."""
    s, d = sft["settings"], sft["data"]
    lines = [
        TITLE,
        "",
        f"A {d['parameters'] / 1e6:.1f}M-parameter Llama (preset {s['preset']}, random weights from seed {s['seed']}, "
        f"vocabulary {d['vocab_size']} with chatml's two tokens) fine-tuned on Reuters R8 as instruction pairs "
        f'("Which topic is this article about ...?" + the article cut to fit, answer the category): '
        f"{d['train_examples']} training examples of {d['min_tokens']}-{d['max_tokens']} tokens (median "
        f"{d['median_tokens']}, {d['answer_tokens_per_example']:.1f} answer tokens each). Every runner: the same "
        f"folder (weights, chatml template, tokens), max_length {s['max_length']}, fp32, sdpa, "
        f"{s['threads'] or 'default'} thread(s), AdamW fused, lr {s['learning_rate']:g} ({s['lr_scheduler_type']}, "
        f"warmup {s['warmup_ratio']:g}), {s['steps']} steps. Equal work: packed runners take {s['batch_size']} rows "
        f"of {s['max_length']} per step (our bfd holds {d['examples_per_bfd_row']:.2f} examples per row, "
        f"{d['bfd_fill']:.0%} full); unpacked runners take as many examples per step instead, so all see about the "
        f'same examples and tokens (columns "examples", "real tokens"), not k times fewer. ours-none, hf-trainer '
        f"and trl-none see exactly the same batches. Medians of {sft['repetitions']} interleaved repetition(s), "
        f"each a fresh process; wall time {sft['wall_s']:.0f}s.",
        "",
        "Real tokens/s: non-padding tokens per step over the median step time (first step left out); computed "
        "tokens/s counts the padding too. Held-out loss: after the steps, mean cross-entropy over the answer tokens "
        f"of {d['heldout_examples']} R8 test examples, one per row, one function on each runner's saved weights.",
        "",
        "| runner | rows/step | examples | real tokens | answer tokens | real tokens/s | vs hf-trainer | "
        "computed tokens/s | padding | peak RSS MB | held-out loss | train loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(m: dict, digits: int) -> str:
        text = f"{m['median']:.{digits}f}"
        return text if m["min"] == m["max"] else f"{text} ({m['min']:.{digits}f}-{m['max']:.{digits}f})"

    base = sft["runners"].get("hf-trainer")
    for name, r in sft["runners"].items():
        m, run = r["summary"], r["runs"][0]
        ratio = (
            f"{m['real_tokens_per_s']['median'] / base['summary']['real_tokens_per_s']['median']:.2f}x" if base else ""
        )
        lines.append(
            f"| {name} | {r['rows_per_step']} | {run['examples_seen']} | {run['real_tokens_seen']} | "
            f"{run['answer_tokens_seen']} | {spread(m['real_tokens_per_s'], 0)} | {ratio} | "
            f"{m['computed_tokens_per_s']['median']:.0f} | {run['padding_fraction']:.1%} | "
            f"{m['peak_rss_mb']['median']:.0f} | {m['heldout_loss']['median']:.4f} | "
            f"{m['train_loss']['median']:.4f} |"
        )
    lines.append("")
    for key, other in (("vs_hf_trainer", "hf-trainer"), ("vs_trl_packing", "trl-packing")):
        g = sft["goals"][key]
        if g["ratio"] is None:
            lines.append(f"- ours-bfd / {other} real tokens/s: n/a ({other} not run)")
            continue
        verdict = "met" if g["met"] else "not met"
        lines.append(
            f"- ours-bfd / {other} real tokens/s: **{g['ratio']:.2f}x** (goal at least {g['target']:.1f}x: "
            f"{verdict}); held-out loss difference {g['loss_difference']:+.4f}"
        )
    for name, why in sft.get("skipped", {}).items():
        lines.append(f"- {name}: skipped, {why}")
    trl = sft["runners"].get("trl-none", {}).get("runs", [{}])[0]
    if "inputs_differing_from_ours" in trl:
        lines.append(
            f"- TRL trains on our tokens and loss masks (pre-tokenized). Its own tokenization of the same "
            f"pairs: {trl['inputs_differing_from_ours']} of {d['train_examples']} examples with other input "
            f"tokens; it would train {trl['trained_not_by_ours']} tokens ours does not (the newline chatml "
            f"writes after <|im_end|>, which ours leaves out: the template's, never generated) and leave "
            f"{trl['not_trained_by_trl']} of ours untrained"
        )
    return "\n".join(lines) + "\n"


def run_section(repetitions: int = 1, steps: int | None = None, log=None, **overrides) -> tuple[str, dict]:
    """The section for bench/run.py: (markdown, results). `overrides` set SFTSettings fields."""
    settings = replace(SFTSettings(), **overrides, **({"steps": steps} if steps else {}))
    results = run(settings, repetitions, log=log)
    return markdown(results), results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SFTSettings()
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--out", type=Path, help="write sft.md and sft.json here")
    for name in ("steps", "batch_size", "max_length", "train_examples", "threads", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    p.add_argument("--runners", default=",".join(RUNNERS), help=f"comma-separated, from {', '.join(RUNNERS)}")
    args = p.parse_args(argv)
    runners = [r for r in args.runners.split(",") if r]
    if not runners or set(runners) - set(RUNNERS):
        p.error(f"--runners takes names from {', '.join(RUNNERS)}")
    text, results = run_section(
        args.repetitions,
        args.steps,
        log=sys.stderr,
        batch_size=args.batch_size,
        max_length=args.max_length,
        train_examples=args.train_examples,
        threads=args.threads,
        seed=args.seed,
        runners=runners,
    )
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sft.md").write_text(text)
        (args.out / "sft.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    run_as_script(main, _worker_main)
