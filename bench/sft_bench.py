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

This file is the command line and the loop over runners; the settings are in bench/sft_settings.py, the pairs in
bench/sft_data.py, the shared model folder in bench/sft_setup.py, one run in bench/sft_runners.py, the held-out
loss in bench/sft_heldout.py and the markdown in bench/sft_report.py.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

# The work, the runs and the report live in their own modules; tests/test_bench_sft.py, bench/run.py and
# bench/peft_bench.py reach their names here.
from fresh_process import run_as_script, run_script
from sft_data import QUESTION, R8, messages, read_r8, to_pair  # noqa: F401
from sft_report import TITLE, goals, markdown  # noqa: F401
from sft_runners import peak_rss_mb, train_once, worker_main  # noqa: F401
from sft_settings import PACKED, RUNNERS, SFTSettings
from sft_setup import TOKENIZER, prepare, worker_spec  # noqa: F401


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


def run_section(repetitions: int = 1, steps: int | None = None, log=None, **overrides) -> tuple[str, dict]:
    """The section for bench/run.py: (markdown, results). `overrides` set SFTSettings fields."""
    given: dict[str, Any] = {"steps": steps} if steps else {}
    settings = replace(SFTSettings(), **overrides, **given)
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
    run_as_script(main, worker_main)
