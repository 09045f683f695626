"""Pipeline parallelism on CPU: step time and peak memory per process of 1F1B vs GPipe vs no pipeline.

A small Llama (the `llama-8m` preset: 6 layers, hidden 256; random weights from the seed, the same in
every run) is pretrained through the real application on Grimm's tales (bench/lm_corpus.py; rows of
--max_length tokens, --packing wrapped, so every row is full and every mode computes the same shapes).
Each variant is its own `torchrun` launch of src/training_application.py's `cloudtrain.cli.main`:

- basic, 1 process: the reference (--training_type basic), one thread;
- basic, 1 process, 2 threads: what one process makes of both cores (not in --quick);
- DDP, 2 processes: --training_type accelerated, half the batch each (the same global batch);
- GPipe and 1F1B, 2 processes: --training_type pipeline, 2 stages (one per process), the whole batch
  cut into --microbatches micro-batches; 1F1B also at every M of --sweep, for the bubble's trend.

Every run trains the same model on the same rows in the same order at the same global batch, in fp32,
so their per-step training losses agree up to float rounding (checked, and printed).

How it is measured. torchrun starts bench/pipeline_rank.py once per rank, which hooks the trainer
class's `optimizer_step` to read, at the end of every step, the clock, the main thread's CPU time and
its run-queue wait (/proc/thread-self/schedstat: time runnable but not running, i.e. waiting for a
core), then runs the application unchanged (`cloudtrain.cli.main` with the same arguments). All the
compute of a step runs on that thread (forward, autograd backward on CPU, optimizer; one OpenMP
thread), so per step and rank:

    wall = busy (on a core) + ready (waiting for a core) + blocked (waiting for a message: the bubble,
    communication, the slower stage)

Step time is the median over the steps after --warmup, rank 0's (the ranks end each step together).
Peak memory is each process's VmHWM (resident-set high-water mark, /proc/self/status) read by the
same hook when the application returns (start-up, training, final evaluation and saving included).

    .venv/bin/python bench/pipeline_bench.py [--steps 12] [--microbatches 4] [--sweep 2,8]
    .venv/bin/python bench/pipeline_bench.py --quick      # tiny model and batch, 2 launches (the test)

Writes --out (markdown, default bench/results/pipeline.md) and the same name with .json.

This file is the command line; the variants are planned in bench/pipeline_plan.py, launched and summarised in
bench/pipeline_runs.py (each rank timed by bench/pipeline_rank.py) and written up by bench/pipeline_report.py.
"""

import argparse
import json
import os
import tempfile
from dataclasses import asdict, replace  # noqa: F401  (asdict: tests/test_bench_pipeline.py takes it from here)
from pathlib import Path

# The plan, the runs and the report live in their own modules; bench/tp_bench.py and the tests reach them here.
from pipeline_plan import BENCH, TINY_MODEL, Settings, Variant, variants  # noqa: F401
from pipeline_report import markdown
from pipeline_runs import add_ratios, app_args, launch, run, summarise  # noqa: F401


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Settings()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup, help="step intervals left out of the medians")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="M for the GPipe vs 1F1B comparison")
    p.add_argument("--sweep", default=",".join(map(str, d.sweep)), help="more M for 1F1B, comma-separated")
    p.add_argument("--batch_size", type=int, default=d.batch_size, help="global rows per step")
    p.add_argument("--max_length", type=int, default=d.max_length)
    p.add_argument("--threads", type=int, default=d.threads, help="OpenMP threads per process")
    p.add_argument("--model", default=d.model, help="a model preset or a config.json")
    p.add_argument("--interleaved", action="store_true", help="also interleaved 1F1B (2 stages per process)")
    p.add_argument(
        "--split_at",
        type=int,
        default=None,
        help="also 1F1B with the second stage from layer N (--pipeline_split_points model.layers.<N-1>)",
    )
    p.add_argument("--quick", action="store_true", help="tiny: a 4-layer hidden-64 Llama, 4 steps, 2 launches")
    p.add_argument("--tab", default=None, help="an Orange .tab corpus instead of the Grimm tales")
    p.add_argument("--out", default=str(BENCH / "results" / "pipeline.md"), help="markdown; JSON beside it")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per launch")
    p.add_argument("--from_json", default=None, help="only write the markdown again from a saved result JSON")
    args = p.parse_args(argv)
    s = replace(
        d,
        steps=args.steps,
        warmup=args.warmup,
        microbatches=args.microbatches,
        sweep=[int(x) for x in args.sweep.split(",") if x],
        batch_size=args.batch_size,
        max_length=args.max_length,
        threads=args.threads,
        model=args.model,
        interleaved=args.interleaved,
        split_at=args.split_at,
        tab=args.tab,
        timeout=args.timeout,
    )
    if args.quick:
        s = replace(
            s,
            steps=4,
            warmup=1,
            batch_size=4,
            max_length=32,
            microbatches=2,
            sweep=[],
            two_threads_reference=False,
            ddp=False,
            gpipe=False,
            vocab_size=300,
        )
    if s.batch_size % 2 or any(s.batch_size % m for m in [s.microbatches, *s.sweep]):
        p.error("--batch_size must be even and a multiple of --microbatches and of every --sweep value")
    if s.split_at is not None and s.split_at < 1:
        p.error("--split_at must be at least 1 (stage 0 holds layers 0 to N-1)")
    if s.steps < s.warmup + 2:
        p.error("--steps must leave at least 2 timed steps after --warmup")
    return s, args


def main(argv: list[str] | None = None) -> dict:
    s, args = parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        Path(args.out).write_text(markdown(result))
        print(markdown(result))
        return result
    with tempfile.TemporaryDirectory(prefix="pipeline_bench-model-") as tmp:
        if args.quick and s.model == Settings.model:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps(TINY_MODEL))
            s = replace(s, model=str(config))
        with tempfile.NamedTemporaryFile("w", prefix="pipeline_bench-", suffix=".log", delete=False) as log:
            result = run(s, log)
        os.unlink(log.name)  # reached only when every launch succeeded; a failure names the log
    if args.quick:
        result["settings"].update(model="tiny (4 layers, hidden 64)", quick=True)
    text = markdown(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(text)
    return result


if __name__ == "__main__":
    main()
