"""cloudtrain's text_to_image against the reference loop, their steps taken in turns in one process.

    python bench/t2i_interleaved.py                       # the docs' figures (12 rounds of 4 steps)
    python bench/t2i_interleaved.py --rounds 2 --block 1 --warmup 1 --quick    # a check of the bench

The same workload as bench/t2i_bench.py (the demo's Stable Diffusion pipeline, the scikit-learn digits, rank-4
LoRA, AdamW, fp32, one thread, the same batches in the same order) but built three times in this process: the
reference loop (`diffusers-loop`, bench/t2i_bench.py's loop matching diffusers' example script), cloudtrain's run
(`build_run`, stepped through the trainer's own loop: `_windows`, `_step` and the hooks after each step, as
`Trainer.fit` runs them) and a second cloudtrain run, built alike, for the A/A control. After a warm-up, blocks of
`--block` steps of each are taken in turn, the order reversed every round (bench/interleave.py); each round gives
cloudtrain's steps/s over the reference's (wall and CPU time) and over its twin's (A/A: the noise floor). The
median ratio, its quartiles and range, the load average, and each loop's medians are printed as JSON.

Peak memory cannot be told apart in one process: `--memory` adds one fresh process per runner (bench/t2i_bench.py,
a short run) for its peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

from fresh_process import prepare_worker  # noqa: E402
from interleave import interleave, quiet, say  # noqa: E402
from t2i_bench import QUICK, build_inputs, cloudtrain_options, reference_loop  # noqa: E402

REF, CT, TWIN = "diffusers-loop", "cloudtrain", "cloudtrain-twin"


def cloudtrain_loop(spec: dict, out: Path):
    """cloudtrain's run for `spec`, built and started as `Trainer.fit` starts it: a callable taking one step."""
    from cloudtrain.config import build_config
    from cloudtrain.pipeline import build_run
    from cloudtrain.training.preemption import PreemptionSignal

    trainer = build_run(build_config(cloudtrain_options(spec, str(out)))).trainer
    loop = trainer._start(None, None)
    hooks = trainer.hooks(None, PreemptionSignal())
    for hook in hooks:
        hook.on_train_start(loop)
    windows = trainer._windows(loop)

    def step() -> None:
        trainer._step(next(windows), loop)
        trainer._after_step(hooks, loop)
        trainer.clock.start_step()

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, what in (
        ("rounds", 12, "rounds (one block of each loop, one ratio per pair)"), ("block", 4, "steps per block"),
        ("warmup", 5, "steps of each loop before measuring"), ("batch_size", 16, ""), ("images", 256, ""),
        ("width", 32, "the UNet's width"), ("resolution", 32, ""), ("rank", 4, "LoRA rank"),
        ("threads", 1, "torch threads"), ("seed", 42, ""),
    ):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default, help=what or None)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--cpus", default="", help="pin this process to these cores, e.g. 0 (default: as is)")
    p.add_argument("--cached", action="store_true", help="cloudtrain with --cache_latents and text embeddings")
    p.add_argument("--memory", action="store_true", help="also each runner's peak RSS, from a fresh process each")
    p.add_argument("--quick", action="store_true", help="a smaller model: checks the bench, measures little")
    p.add_argument("--profile", type=int, default=0, help="then cProfile N steps of each loop (top 25, to stderr)")
    p.add_argument("--out", type=Path, help="also write t2i-interleaved.json here")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update({k: v for k, v in QUICK.items() if k in ("batch_size", "images", "width", "resolution")})
    return args


def spec_of(args: argparse.Namespace, model_dir: str, data_dir: str) -> dict:
    keys = ("batch_size", "images", "width", "resolution", "rank", "threads", "seed", "learning_rate", "weight_decay")
    total = args.warmup + args.rounds * args.block + args.profile + 1
    spec = {k: getattr(args, k) for k in keys}
    runner = "cloudtrain-cached" if args.cached else "cloudtrain"
    return {**spec, "model_dir": model_dir, "data_dir": data_dir, "total_steps": total, "runner": runner}


def peak_memory(spec: dict, log) -> dict:
    """Each runner's peak resident memory from its own fresh process (bench/t2i_bench.py, 3 + 3 steps)."""
    from t2i_bench import measure

    short = {**spec, "warmup_steps": 3, "steps": 3, "total_steps": 6}
    runs = measure(short, [REF, spec["runner"]], 1, log)
    return {name: round(r[0]["peak_rss_mb"], 1) for name, r in runs.items()}


def profile(name: str, loop, steps: int) -> None:
    """`steps` steps of one loop under cProfile, on CPU time (another process's use of the core is not ours):
    the top 25 functions by own time, to the real stderr."""
    import cProfile
    import pstats

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(steps):
        loop()
    profiler.disable()
    say(f"==== {name}: {steps} steps")
    pstats.Stats(profiler, stream=sys.__stderr__).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prepare_worker()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    import torch

    torch.set_num_threads(args.threads)
    conditions = {"cores": sorted(os.sched_getaffinity(0)), "torch_threads": args.threads}
    conditions["loadavg_start"] = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_dir, data_dir = build_inputs(folder, args.images, args.width, args.seed)
        spec = spec_of(args, model_dir, data_dir)
        with quiet(folder / "runs.log"):
            loops = {REF: reference_loop(spec, str(folder / "ref"))[0]}
            loops[CT] = cloudtrain_loop(spec, folder / "ct")
            loops[TWIN] = cloudtrain_loop(spec, folder / "twin")

            def progress(r: int, got: dict) -> None:
                say(json.dumps({"round": r, **{n: round(g["cpu_s_per_step"], 4) for n, g in got.items()}}))

            result = interleave(loops, [(CT, REF), (TWIN, CT)], args.rounds, args.block, args.warmup, on_round=progress)
            for name, loop in loops.items() if args.profile else ():
                profile(name, loop, args.profile)
            memory = peak_memory(spec, open(folder / "memory.log", "w")) if args.memory else None
    report = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"cloudtrain": spec["runner"]},
        **result,
        "peak_rss_mb_fresh_process": memory,
        **conditions,
        "loadavg_end": os.getloadavg(),
    }
    print(json.dumps(report, indent=2, default=str))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "t2i-interleaved.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


if __name__ == "__main__":
    main()
