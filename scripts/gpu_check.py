"""`make gpu-check`: everything GPU-specific, checked in one command on a machine with a CUDA GPU.

In order: the versions and the device; the gpu tier (`pytest -m gpu` over the modules holding gpu
tests, six pytest-xdist workers; on one H100, 47 of its 49 tests ended within 240 s); bench/gpu.py on a
short budget (its `defaults` variant, 40 steps, 150 s at most: tokens/s, MFU, peak memory beside the
planner's estimate).
Then a report, printed and written to <out>/report.md and <out>/report.json: pass, fail or skip (with its
reason) per test, and the benchmark's figures. Without CUDA it refuses in one line (exit 2) before doing
anything; it exits 1 when a test failed or the benchmark did not run, else 0.

    python scripts/gpu_check.py [--out outputs/gpu-check] [--steps 40] [--bench_variants defaults] [--workers 6]
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
PACKAGES = ("torch", "transformers", "accelerate", "peft", "datasets", "bitsandbytes", "deepspeed", "flash-attn")
# Worst first: a test reported twice (a failed call and an error in teardown) keeps the worse outcome.
OUTCOMES = ("error", "failed", "skipped", "passed")
JUNIT_TAGS = {"error": "error", "failure": "failed", "skipped": "skipped"}  # a <testcase>'s child -> its outcome
# bench/gpu.py reads its tokens/s and MFU as medians over logging intervals after the first (warm-up).
BENCH_LOGGING_STEPS = 5
# Collected first, so that a worker starts it at once: bench/gpu.py's every variant on CUDA (two compiled ones) ran
# past 160 s on the H100, longer than any other gpu test.
LONGEST_FIRST = ("test_bench_gpu.py",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "outputs" / "gpu-check"), help="folder of the report and logs")
    p.add_argument("--workers", type=int, default=6, help="pytest-xdist workers for the gpu tier (0: one process)")
    p.add_argument("--test_timeout", type=int, default=300, help="seconds before one gpu test is given up")
    p.add_argument("--tier_timeout", type=int, default=0, help="seconds before the whole tier is interrupted (0: none)")
    p.add_argument("--steps", type=int, default=40, help="bench/gpu.py's timed steps per variant")
    p.add_argument(
        "--bench_variants", default="defaults", help="bench/gpu.py's --variants (defaults: the application alone)"
    )
    p.add_argument("--bench_budget_s", type=int, default=150, help="bench/gpu.py's --budget_s (its whole run)")
    args = p.parse_args(argv)
    if args.steps < 2 * BENCH_LOGGING_STEPS or args.workers < 0:
        p.error(f"--steps must be at least {2 * BENCH_LOGGING_STEPS} (two logging intervals), --workers at least 0")
    return args


def refusal() -> str | None:
    """One line saying why this machine cannot run the check, or None where it can. Imports torch but
    creates no CUDA context (what the tier and the benchmark measure is theirs alone)."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        why = f"this torch {torch.__version__} is a CPU build (install the CUDA wheel of the same version)"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU{hidden}"
    return f"error: gpu-check needs a CUDA GPU: {why}; on CPU, `make test` runs the rest of the suite"


# ---------------------------------------------------------------- versions and device
DEVICE_PROBE = """
import json, torch
print(json.dumps([{"name": p.name, "memory": p.total_memory, "capability": f"{p.major}.{p.minor}"}
                  for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]))
"""


def environment() -> dict:
    """Package versions (from their metadata, nothing imported) and the visible devices (probed in a child,
    so that this process holds no CUDA context while the tier and the benchmark run)."""
    import torch

    versions = {"python": sys.version.split()[0], "cloudtrain": _version("cloudtrain")}
    versions |= {name: _version(name) for name in PACKAGES}
    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda or "none"
    proc = subprocess.run([sys.executable, "-c", DEVICE_PROBE], capture_output=True, text=True, timeout=120)
    devices = json.loads(proc.stdout) if proc.returncode == 0 else []
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return {"versions": versions, "devices": devices, "driver": driver or "unknown"}


def describe(env: dict) -> str:
    """The versions on one line, then one line per device."""
    lines = [", ".join(f"{name} {version}" for name, version in env["versions"].items())]
    lines += [
        f"cuda:{i} {d['name']}, {d['memory'] / GIB:.1f} GiB, compute capability {d['capability']}, "
        f"driver {env['driver']}"
        for i, d in enumerate(env["devices"])
    ]
    return "\n".join(lines)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------- the gpu tier
@dataclass
class TestResult:
    test: str
    outcome: str  # one of OUTCOMES
    detail: str  # the skip reason or the failure's first line; "" when passed
    seconds: float


def gpu_test_files() -> list[str]:
    """The test modules holding gpu-marked tests: only they are collected (quicker, and a module that
    needs a package this machine lacks for its CPU tests cannot stop the tier)."""
    files = sorted((REPO / "tests").glob("test_*.py"), key=lambda f: (f.name not in LONGEST_FIRST, f.name))
    return [str(f.relative_to(REPO)) for f in files if re.search(r"\bmark\.gpu\b", f.read_text())]


def tier_command(args: argparse.Namespace, junit: Path) -> list[str]:
    command = [sys.executable, "-m", "pytest", *gpu_test_files(), "-m", "gpu", f"--junitxml={junit}"]
    command += [f"--timeout={args.test_timeout}", "--continue-on-collection-errors", "-v", "--durations=20"]
    return command + (["-n", str(args.workers), "--dist", "worksteal"] if args.workers else [])


def run_tier(command: list[str], limit: int) -> bool:
    """Runs the tier; True if it had to be interrupted. Past `limit` seconds pytest is interrupted as by Ctrl-C, so
    that it still reports what ran (its junit XML and summary) instead of losing everything to an outer timeout;
    a minute later its whole session (the xdist workers and what they started) is killed."""
    tier = subprocess.Popen(command, cwd=REPO, start_new_session=True)

    def stop(signum: int, frame: object) -> None:  # an outer timeout: the tier's own session would hold the GPU on
        with contextlib.suppress(OSError):
            os.killpg(tier.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        try:
            tier.wait(timeout=limit or None)
            return False
        except subprocess.TimeoutExpired:
            print(f"the gpu tier was interrupted after {limit} s (--tier_timeout)", flush=True)
            tier.send_signal(signal.SIGINT)
        try:
            tier.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(tier.pid, signal.SIGKILL)
            tier.wait()
        return True
    finally:
        signal.signal(signal.SIGTERM, previous)


def parse_junit(path: Path) -> list[TestResult]:
    """Each test of a pytest junit XML file, once, with its worst outcome and every message (a failed call
    and an error in its teardown are two <testcase> entries)."""
    results: dict[str, TestResult] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # pytest-xdist writes one <testcase/> with no test at times (seen on the H100)
            continue
        test = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        outcome, detail = "passed", ""
        for tag, meaning in JUNIT_TAGS.items():
            found = case.find(tag)
            if found is not None:
                outcome, detail = meaning, _first_line(found.get("message") or found.text or "")
                break
        seconds = float(case.get("time") or 0)
        earlier = results.get(test)
        if earlier is not None:  # the same test again: its worse outcome, both messages
            outcome = min(outcome, earlier.outcome, key=OUTCOMES.index)
            detail = "; ".join(d for d in (earlier.detail, detail) if d)
            seconds += earlier.seconds
        results[test] = TestResult(test, outcome, detail, seconds)
    return list(results.values())


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


# ---------------------------------------------------------------- bench/gpu.py
def bench_command(args: argparse.Namespace, out: Path) -> list[str]:
    command = [sys.executable, str(REPO / "bench" / "gpu.py"), "--steps", str(args.steps)]
    command += ["--logging_steps", str(BENCH_LOGGING_STEPS), "--variants", args.bench_variants]
    command += ["--budget_s", str(args.bench_budget_s)]
    return command + ["--out", str(out)]


def bench_rows(bench: dict) -> list[dict]:
    """One row per run (variant) of bench/gpu.py's JSON: tokens/s, MFU, peak memory and the planner's
    estimate for its options (its total, and without its overhead term: what the allocator's peak is compared with);
    {name, error} for a run that was refused, failed or skipped."""
    plan = bench.get("planner") or {}
    rows = []
    for run in bench.get("runs", []):
        name = run.get("variant") or run.get("attention") or "?"
        status = run.get("status") or ("error" if "error" in run else "ok")
        if status != "ok":
            error = run.get("error") or ""
            rows.append({"name": name, "error": error if error.startswith(status) else f"{status}: {error}"})
            continue
        peak, own = run.get("peak_memory") or {}, run.get("planner") or plan  # its own options' estimate
        row = {
            "name": name,
            "tokens_per_s": run.get("tokens_per_s"),
            "mfu": run.get("mfu"),
            "peak_allocated": peak.get("allocated"),
            "peak_reserved": peak.get("reserved"),
            "planner_total": own.get("total"),
            "planner_without_overhead": own.get("without_overhead"),
        }
        if row["peak_allocated"] and row["planner_without_overhead"]:
            row["allocated_vs_planner"] = row["peak_allocated"] / row["planner_without_overhead"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the report
def verdict(tests: list[TestResult] | None, bench: dict | None, interrupted: int = 0) -> list[str]:
    """Why the check failed (empty: it passed). Skips are listed in the report, not failures: a GPU without
    bf16 or a machine with one GPU skips some tests for a reason the report gives. `interrupted`: the tier's
    limit in seconds where it was cut there (the tests that had not finished are in no result)."""
    problems = [f"the gpu tier was interrupted after {interrupted} s (--tier_timeout)"] if interrupted else []
    if tests is None:
        problems.append("the gpu tier did not run to its end (no junit XML)")
    else:
        bad = [t for t in tests if t.outcome in ("failed", "error")]
        problems += [f"{len(bad)} gpu test(s) failed"] if bad else []
        problems += [] if tests else ["no test is marked gpu"]
    rows = bench_rows(bench) if bench else []
    if not any("error" not in r for r in rows):
        problems.append("bench/gpu.py produced no result")
    return problems


def render(report: dict) -> str:
    env, tests, bench = report["environment"], report["tests"], report["bench"]
    status = "FAIL: " + "; ".join(report["problems"]) if report["problems"] else "PASS"
    lines = [f"# gpu-check: {status}", "", f"{report['date']}, {report['seconds']:.0f} s in all", ""]
    lines += ["| package | version |", "|---|---|"]
    lines += [f"| {name} | {version} |" for name, version in env["versions"].items()]
    lines += [""] + [f"- {line}" for line in describe(env).splitlines()[1:]]
    lines += ["", "## The gpu tier (`pytest -m gpu`)", ""]
    if tests is None:
        lines.append("No result: pytest ended before writing its junit XML (its output is above).")
    else:
        counts = {o: sum(t["outcome"] == o for t in tests) for o in reversed(OUTCOMES)}
        lines += [", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no tests", ""]
        lines += ["| test | result | reason / message | s |", "|---|---|---|---|"]
        order = sorted(tests, key=lambda t: (OUTCOMES.index(t["outcome"]), t["test"]))
        lines += [
            f"| {t['test']} | {t['outcome']} | {t['detail'].replace('|', '/')} | {t['seconds']:.0f} |" for t in order
        ]
    lines += ["", "## bench/gpu.py", ""]
    if not bench:
        lines.append("No result (its output is above).")
    else:
        s = bench.get("settings", {})
        lines += [
            f"{s.get('preset')}, {s.get('steps')} steps of {s.get('batch_size')} x {s.get('max_length')} tokens, "
            f"precision {s.get('mixed_precision')}, packing {s.get('packing')}, on {bench.get('device')}",
            "",
            "| run | tokens/s | MFU | peak allocated GiB | planner GiB (without overhead / total) | "
            "allocated / planner |",
            "|---|---|---|---|---|---|",
        ]
        for r in bench_rows(bench):
            if "error" in r:
                lines.append(f"| {r['name']} | {r['error'].replace('|', '/')} | | | | |")
                continue
            mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
            ratio = r.get("allocated_vs_planner")
            lines.append(
                f"| {r['name']} | {_number(r['tokens_per_s'])} | {mfu} | {_gib(r['peak_allocated'])} | "
                f"{_gib(r['planner_without_overhead'])} / {_gib(r['planner_total'])} | "
                f"{'n/a' if ratio is None else f'{ratio:.0%}'} |"
            )
        if "error" in (bench.get("planner") or {}):
            lines.append(f"\nplanner estimate: n/a ({bench['planner']['error']})")
    return "\n".join(lines) + "\n"


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def _number(n: float | None) -> str:
    return "n/a" if n is None else f"{n:,.0f}"


def write_report(
    out: Path,
    environment: dict,
    tests: list[TestResult] | None,
    bench: dict | None,
    seconds: float,
    interrupted: int = 0,
) -> dict:
    """report.json and report.md in `out`; returns the report (its "problems" empty when the check passed)."""
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": seconds,
        "problems": verdict(tests, bench, interrupted),
        "environment": environment,
        "tests": None if tests is None else [asdict(t) for t in tests],
        "bench": bench,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render(report))
    return report


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = refusal()
    if refused:
        print(refused, file=sys.stderr)
        return 2
    start, out = time.monotonic(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    print(describe(env), flush=True)
    junit, bench_json = out / "gpu-tier.xml", out / "bench.json"
    for stale in (junit, bench_json):
        stale.unlink(missing_ok=True)

    print(f"\n[{time.strftime('%H:%M:%S')}] the gpu tier: {' '.join(tier_command(args, junit)[1:])}", flush=True)
    interrupted = args.tier_timeout if run_tier(tier_command(args, junit), args.tier_timeout) else 0
    tests = parse_junit(junit) if junit.is_file() else None
    write_report(out, env, tests, None, time.monotonic() - start, interrupted)  # kept, were the rest cut short

    print(f"\n[{time.strftime('%H:%M:%S')}] {' '.join(bench_command(args, bench_json)[1:])}", flush=True)
    limit = args.bench_budget_s + 120  # its own budget holds the corpus set-up and the planner: a margin
    try:
        subprocess.run(bench_command(args, bench_json), cwd=REPO, timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"bench/gpu.py was stopped after {limit} s", flush=True)
    bench = json.loads(bench_json.read_text()) if bench_json.is_file() else None

    report = write_report(out, env, tests, bench, time.monotonic() - start, interrupted)
    print("\n" + render(report))
    print(f"report in {out / 'report.md'} (and report.json)")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
