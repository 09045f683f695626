"""bench/pipeline_bench.py's report: the markdown tables and what the figures say, from a run's result."""

import json
from pathlib import Path

from pipeline_plan import PRESETS


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
