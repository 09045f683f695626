"""Steady-state tokens/s of streaming against stored (map-style) rows, interleaved in one process.

Two training runs are built in this process with the application's own `build_run` (the same options but
`--streaming true`: the llama-8m preset, fp32, batch 8 x 256 tokens, `--packing bfd`, the same seed, so the
same initial weights) and driven step by step through the trainer's own loop (`_windows`, `_step` and the
hooks after each step, as `Trainer.fit` runs them). After `--warmup` steps of each, the paths take turns in
blocks of `--block` steps: A B, B A, A B, ... (the order flips every pair, so a load that drifts linearly
favours neither). Each pair of adjacent blocks gives one ratio, streaming's tokens/s over the stored path's,
where tokens are the real (non-padding) tokens trained on, as the trainer's train/tokens_per_s counts them;
the report is the median of the ratios and their spread (quartiles, min, max), next to the ratio of seconds
per step (the same work: both paths' batches are 8 rows padded to the longest, 256 tokens nearly always), each
path's packing fill (real tokens over row slots) and the milliseconds per step spent getting the batch (what
the input path costs, whatever the load). The load average and CPU affinity are printed so that a reader
knows the conditions; `--cpus 0` pins this process to core 0, `--threads` sets torch's threads.

A shared machine's load moves by 2x within minutes; adjacent blocks of a few seconds see nearly the same load,
which is what makes the median ratio meaningful where separate runs' tokens/s are not.

    python bench/streaming_throughput.py --pairs 12 --block 6 --warmup 4    # the docs' figures
    python bench/streaming_throughput.py --pairs 2 --block 2 --warmup 1     # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

from interleave import spread  # noqa: E402  (how far the pairs scatter)
from streaming_bench import make_corpus, make_tokenizer  # noqa: E402


def build(name: str, options: dict, out: Path):
    """A run of the application (trainer, model, data) for one path, ready to step: (trainer, loop, hooks,
    windows)."""
    from cloudtrain.config.parse import resolve_options
    from cloudtrain.pipeline import build_run
    from cloudtrain.training.preemption import PreemptionSignal

    cfg = resolve_options(None, {**options, "output_dir": str(out / name), "cache_dir": str(out / f"cache-{name}")})
    trainer = build_run(cfg).trainer
    loop = trainer._start(None, None)
    hooks = trainer.hooks(None, PreemptionSignal())
    for hook in hooks:
        hook.on_train_start(loop)
    return trainer, loop, hooks, trainer._windows(loop)


def step(path: tuple) -> dict:
    """One optimizer step of a built run, as `Trainer.fit` takes it: seconds getting the batch, seconds in
    all, real tokens and row slots (rows x padded width) of its micro-batches."""
    trainer, loop, hooks, windows = path
    usage, start, cpu = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
    window = next(windows)
    fetched = time.perf_counter()
    trainer._step(window, loop)
    trainer._after_step(hooks, loop)
    trainer.clock.start_step()
    end, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return {
        "waits": after.ru_nvcsw - usage.ru_nvcsw,  # voluntary context switches: the step slept or waited
        "preempted": after.ru_nivcsw - usage.ru_nivcsw,  # involuntary ones: another process took the core
        "data_s": fetched - start,
        "step_s": end - start,
        "cpu_s": time.process_time() - cpu,
        "tokens": int(sum(int(b["attention_mask"].sum()) for b in window)),
        "slots": int(sum(b["attention_mask"].numel() for b in window)),
    }


def block(path: tuple, steps: int) -> dict:
    """`steps` steps of one path: real tokens per second (of wall time, and of this process's CPU time),
    seconds per step, fill, data ms per step."""
    taken = [step(path) for _ in range(steps)]
    seconds = sum(s["step_s"] for s in taken)
    tokens = sum(s["tokens"] for s in taken)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / sum(s["cpu_s"] for s in taken),
        "s_per_step": seconds / steps,
        "cpu_s_per_step": sum(s["cpu_s"] for s in taken) / steps,
        "steps_per_s": steps / seconds,
        "fill": tokens / sum(s["slots"] for s in taken),
        "data_ms_per_step": 1e3 * sum(s["data_s"] for s in taken) / steps,
        "waits_per_step": sum(s["waits"] for s in taken) / steps,
        "preempted_per_step": sum(s["preempted"] for s in taken) / steps,
        "load": os.getloadavg()[0],
    }


def options(corpus: Path, tokenizer: Path, steps: int) -> dict:
    """The options both runs share (the bench's workload: llama-8m, fp32, batch 8 x 256, bfd packing)."""
    return {
        "task": "causal_lm",
        "model_config": "llama-8m",
        "tokenizer_name_or_path": str(tokenizer),
        "train_file": str(corpus),
        "max_steps": steps,
        "max_length": 256,
        "per_device_train_batch_size": 8,
        "packing": "bfd",
        "mixed_precision": "no",
        "eval_strategy": "no",
        "num_sample_prompts": 0,
        "logging_steps": 1,  # as bench/streaming_bench.py logs: every step (a stream's per-source counts too)
        "report_to": "none",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=12, help="pairs of adjacent blocks (one ratio each)")
    parser.add_argument("--block", type=int, default=6, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=4, help="steps of each path before measuring")
    parser.add_argument("--corpus_mb", type=float, default=5, help="generated corpus (stored: tokenized whole)")
    parser.add_argument("--workers", type=int, default=0, help="streaming's --dataloader_num_workers")
    parser.add_argument("--cpus", type=str, default="", help="pin to these cores, e.g. 0 or 0,1 (default: as is)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the cores allowed)")
    parser.add_argument("--loader_batches", type=int, default=200, help="batches per input-path measurement")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N of the streamed input")
    parser.add_argument("--control", action="store_true", help="both runs stored: the bench's own bias (A/A)")
    opts = parser.parse_args()
    if opts.cpus:
        os.sched_setaffinity(0, {int(c) for c in opts.cpus.split(",")})
    cores = sorted(os.sched_getaffinity(0))
    import torch

    torch.set_num_threads(opts.threads or len(cores))
    folder = BENCH.parent / "data" / "streaming-bench"
    corpus = make_corpus(folder / f"corpus-{opts.corpus_mb:g}mb.jsonl", opts.corpus_mb)
    conditions = {"cores": cores, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
    print(json.dumps({"start": {**conditions, "loadavg": os.getloadavg()}}), flush=True)
    with tempfile.TemporaryDirectory() as tmp, quiet(Path(tmp) / "runs.log"):
        tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
        total = opts.warmup + opts.pairs * opts.block
        shared = options(corpus, tokenizer, total + 1)
        streaming = {**shared, "streaming": True, "dataloader_num_workers": opts.workers}
        if opts.control:  # both "paths" stored: what the bench itself gives two equal runs (should be 1)
            streaming = shared
        paths = {"streaming": build("streaming", streaming, Path(tmp)), "stored": build("stored", shared, Path(tmp))}
        report = interleave(paths, opts)
        report["input_path"] = loader_costs(paths, opts.loader_batches, opts.profile)  # after: it restarts them
        stored_cpu_ms = 1e3 * report["stored"]["cpu_s_per_step"]
        extra = report["input_path"]["streaming"]["cpu_ms"] - report["input_path"]["stored"]["cpu_ms"]
        report["input_path"]["streaming_extra_share_of_step_cpu"] = round(extra / stored_cpu_ms, 5)
    report.update(
        pairs=opts.pairs,
        block_steps=opts.block,
        warmup_steps=opts.warmup,
        corpus_mb=opts.corpus_mb,
        workers=opts.workers,
        **conditions,
        loadavg_end=os.getloadavg(),
    )
    print(json.dumps(report, indent=2))


def interleave(paths: dict, opts: argparse.Namespace) -> dict:
    """Warm both paths up, then pairs of adjacent blocks (AB, BA, ...): each pair's ratios, their spread."""
    for path in paths.values():
        block(path, opts.warmup)
    ratios: dict[str, list[float]] = {"tokens_per_s": [], "tokens_per_cpu_s": [], "steps_per_s": []}
    blocks: dict[str, list[dict]] = {"streaming": [], "stored": []}
    for pair in range(opts.pairs):
        order = ("streaming", "stored") if pair % 2 == 0 else ("stored", "streaming")
        got = {name: block(paths[name], opts.block) for name in order}
        for name, result in got.items():
            blocks[name].append(result)
        for key, values in ratios.items():
            values.append(got["streaming"][key] / got["stored"][key])
        line = {"pair": pair, "order": order, **_rounded(got), "ratio": round(ratios["tokens_per_s"][-1], 4)}
        print(json.dumps(line), file=sys.__stdout__, flush=True)
    return {
        **{f"streaming_over_stored_{key}": spread(values) for key, values in ratios.items()},
        **{name: _summary(results) for name, results in blocks.items()},
        "loadavg_during": spread([b["load"] for bs in blocks.values() for b in bs]),
    }


def loader_costs(paths: dict, batches: int, profile: int) -> dict:
    """Each path's input path alone, no model: CPU and wall milliseconds per batch over `batches` batches
    from a fresh iterator (the stream's reading, tokenizing, packing and collating; the stored rows' gather
    and collating), taken in turn four times; the medians. `profile` > 0: cProfile's top functions of the
    streamed input path, by own CPU time, to the real stderr."""
    times: dict[str, dict[str, list[float]]] = {name: {"cpu_ms": [], "wall_ms": []} for name in paths}
    for _ in range(4):
        for name, (trainer, *_) in paths.items():
            if hasattr(trainer.train_dl, "set_epoch"):
                trainer.train_dl.set_epoch(0)
            batch_iter = iter(trainer.train_dl)
            next(batch_iter)  # the first buffer's reading and the loader's start-up: not the steady cost
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(batches):
                next(batch_iter)
            times[name]["cpu_ms"].append(1e3 * (time.process_time() - cpu) / batches)
            times[name]["wall_ms"].append(1e3 * (time.perf_counter() - wall) / batches)
    if profile:
        _profile(paths["streaming"][0].train_dl, batches, profile)
    return {name: {k: round(statistics.median(v), 3) for k, v in kinds.items()} for name, kinds in times.items()}


def _profile(loader, batches: int, top: int) -> None:
    import cProfile
    import pstats

    batch_iter = iter(loader)
    profiler = cProfile.Profile(time.process_time)  # CPU time: another process's use of the core is not ours
    profiler.enable()
    for _ in range(batches):
        next(batch_iter)
    profiler.disable()
    pstats.Stats(profiler, stream=sys.__stderr__).sort_stats("tottime").print_stats(top)


@contextlib.contextmanager
def quiet(log: Path):
    """The runs' own output (banner, progress bar, logged steps) into `log`, not into the report."""
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def _rounded(got: dict) -> dict:
    return {name: {k: round(v, 4) for k, v in result.items()} for name, result in got.items()}


def _summary(results: list[dict]) -> dict:
    """A path's blocks: the medians of tokens/s (wall, CPU), seconds per step (wall, CPU), fill, data ms."""
    return {key: round(statistics.median(r[key] for r in results), 4) for key in results[0]}


if __name__ == "__main__":
    main()
