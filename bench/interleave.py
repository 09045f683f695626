"""Comparing two (or more) training loops on a loaded, shared machine: take their steps in turns, in one process.

Separate runs minutes apart see different loads (on 2 shared cores the wall time of a step moves 2x within
minutes); blocks of a few steps taken in turn see nearly the same load, and an order that reverses every round
(A B C, C B A, A B C, ...) lets a load that drifts linearly favour none of them. Each round gives one ratio per
compared pair; the median of those ratios and their spread (quartiles, min, max) are what a reader can trust,
and an A/A pair (a loop against a second copy of itself) shows the noise floor: how far from 1 two equal loops
land under the same conditions.

A loop is a callable taking one optimizer step and returning nothing; `timed` measures it: wall and CPU
seconds (CPU time of one thread is what the step costs, whatever waits for a core), context switches (the
step waited, or another process took the core) and the load average when the block ended.

Used by bench/t2i_interleaved.py; bench/streaming_throughput.py has its own copy of `spread` and the AB/BA
order (written before this module).
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

Step = Callable[[], object]


def timed(step: Step, steps: int) -> dict:
    """`steps` calls of `step`: seconds per step (wall, CPU), context switches per step, the load after."""
    usage, wall, cpu = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "s_per_step": wall_s / steps,
        "cpu_s_per_step": cpu_s / steps,
        "steps_per_s": steps / wall_s,
        "steps_per_cpu_s": steps / cpu_s,
        "waits_per_step": (after.ru_nvcsw - usage.ru_nvcsw) / steps,  # voluntary: the step slept or waited
        "preempted_per_step": (after.ru_nivcsw - usage.ru_nivcsw) / steps,  # another process took the core
        "load": os.getloadavg()[0],
    }


def spread(values: list[float]) -> dict:
    """Median, quartiles, min and max (rounded): how far the rounds scatter."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": round(statistics.median(values), 4),
        "q1": round(q[0], 4),
        "q3": round(q[2], 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def interleave(
    loops: dict[str, Step],
    pairs: list[tuple[str, str]],
    rounds: int,
    block: int,
    warmup: int,
    keys: tuple[str, ...] = ("steps_per_s", "steps_per_cpu_s"),
    on_round: Callable[[int, dict], None] | None = None,
) -> dict:
    """Warm every loop up (`warmup` steps each), then `rounds` rounds of one `block`-step block per loop, the
    order reversed every round. Per pair (x, y): x's figure over y's, one ratio per round and key, and their
    spread; per loop: the medians of its blocks; the load average over all blocks."""
    for loop in loops.values():
        timed(loop, warmup)
    names = list(loops)
    blocks: dict[str, list[dict]] = {name: [] for name in names}
    ratios: dict[str, dict[str, list[float]]] = {f"{x}/{y}": {k: [] for k in keys} for x, y in pairs}
    for r in range(rounds):
        got = {name: timed(loops[name], block) for name in (names if r % 2 == 0 else names[::-1])}
        for name, result in got.items():
            blocks[name].append(result)
        for x, y in pairs:
            for key in keys:
                ratios[f"{x}/{y}"][key].append(got[x][key] / got[y][key])
        if on_round:
            on_round(r, got)
    return {
        "ratios": {pair: {k: spread(v) for k, v in by_key.items()} for pair, by_key in ratios.items()},
        "per_round_ratios": {pair: {k: [round(x, 4) for x in v] for k, v in d.items()} for pair, d in ratios.items()},
        "loops": {name: medians(results) for name, results in blocks.items()},
        "loadavg_during": spread([b["load"] for bs in blocks.values() for b in bs]),
    }


def medians(results: list[dict]) -> dict:
    """A loop's blocks: the median of each figure."""
    return {key: round(statistics.median(r[key] for r in results), 5) for key in results[0]}


@contextlib.contextmanager
def quiet(log: Path) -> Iterator[None]:
    """The loops' own output (banners, progress bars, logged steps) into `log`, not into the report; the real
    stdout stays at sys.__stdout__."""
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def say(line: str) -> None:
    """A progress line to the real stderr, whatever is redirected."""
    print(line, file=sys.__stderr__, flush=True)
