"""The benchmark's markdown table and bar chart, from the results dict that bench/run.py writes as JSON."""

from pathlib import Path

import matplotlib
from lm_bench import markdown as lm_markdown

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

NAMES = {
    "basic": "cloudtrain BasicTrainer",
    "accelerated": "cloudtrain AcceleratedTrainer",
    "reference": "reference PyTorch loop",
    "hf_trainer": "transformers.Trainer",
}


def _median(entry: dict, metric: str) -> float:
    return entry["summary"][metric]["median"]


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def write_markdown(results: dict, path: Path) -> None:
    s, m = results["settings"], results["machine"]
    lines = [
        "# Benchmark results",
        "",
        f"{Path(s['model']).name}, R8, max_length {s['max_length']}, batch {s['batch_size']}, "
        f"precision {s['mixed_precision']}, threads {s['threads'] or m['cpu_threads']}, {s['steps']} steps, "
        f"eval on {s['eval_samples']} test examples; medians of {s['repetitions']} repetitions, each a fresh "
        f"process. Machine: {m['cuda'] or m['processor'] or m['platform']}, torch {m['torch']}. "
        f"Wall time: {results['phases']['comparison_s']:.0f}s for tokenization and the comparison, "
        f"{results['phases']['ablations_s']:.0f}s for the optimizations"
        + (f", {results['phases']['lm_s']:.0f}s for the causal-LM comparison." if "lm_s" in results["phases"] else "."),
        "",
        "Train rates are the batch size over the median step time, first step left out (see time to first step); "
        "every runner takes the same batches in the same order. Tokens are real, non-padding ones.",
        "",
        "| runner | train samples/s | train tokens/s | vs reference | eval samples/s | peak RSS MiB "
        "| time to first step s | accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["runners"].items():
        lines.append(
            f"| {NAMES[name]} | {_median(entry, 'train_samples_per_s'):.2f} | "
            f"{_median(entry, 'train_tokens_per_s'):.0f} | {_ratio(entry['vs_reference'])} | "
            f"{_median(entry, 'eval_samples_per_s'):.1f} | {_median(entry, 'peak_rss_mb'):.0f} | "
            f"{_median(entry, 'time_to_first_step_s'):.1f} | {_median(entry, 'accuracy'):.4f} |"
        )
    data = results["data_processing"]
    if data:
        lines += [
            "",
            f"Tokenization of R8 train ({data['rows']} rows): first run {data['first_rows_per_s']:.0f} "
            f"rows/s, cached run {data['cached_rows_per_s']:.0f} rows/s.",
        ]
    if results["ablations"]:
        reps = s["ablation_repetitions"]
        lines += [
            "",
            f"## Optimizations (BasicTrainer, one change each against its row above; median of {reps} repetition(s))",
            "",
            "| change | train samples/s | train tokens/s | vs default | time to first step s | accuracy |",
            "|---|---|---|---|---|---|",
        ]
        for name, entry in results["ablations"].items():
            if entry["summary"] is None:
                lines.append(f"| {name} | did not finish within {s['ablation_timeout']:.0f}s | | | | |")
                continue
            lines.append(
                f"| {name} | {_median(entry, 'train_samples_per_s'):.2f} | "
                f"{_median(entry, 'train_tokens_per_s'):.0f} | {_ratio(entry['vs_baseline'])} | "
                f"{_median(entry, 'time_to_first_step_s'):.1f} | {_median(entry, 'accuracy'):.4f} |"
            )
    lm = results.get("lm")
    if lm and "skipped" in lm:
        lines += ["", "## Causal LM: sequence packing", "", f"Skipped: {lm['skipped']}"]
    elif lm:
        lines += [""] + lm_markdown(lm)
    path.write_text("\n".join(lines) + "\n")


def _bars(ax, entries: dict, labels: list[str], title: str) -> None:
    kept = [
        (label, e["summary"]["train_samples_per_s"])
        for label, e in zip(labels, entries.values(), strict=True)
        if e["summary"]
    ]  # an ablation that timed out has no summary
    labels, rates = [label for label, _ in kept], [rate for _, rate in kept]
    medians = [rate["median"] for rate in rates]
    low = [m - rate["min"] for m, rate in zip(medians, rates, strict=True)]
    high = [rate["max"] - m for m, rate in zip(medians, rates, strict=True)]
    ax.barh(labels, medians, xerr=[low, high], color="tab:blue", capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("training samples/s (median, min-max)")
    ax.set_title(title)


def write_chart(results: dict, path: Path) -> None:
    panels = [(results["runners"], [NAMES[n] for n in results["runners"]], "Trainers on the same work")]
    if results["ablations"]:
        ablations = (
            {"BasicTrainer default": results["runners"]["basic"], **results["ablations"]}
            if "basic" in results["runners"]
            else results["ablations"]
        )
        panels.append((ablations, list(ablations), "Optimizations (BasicTrainer)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2 + 0.45 * sum(len(p[1]) for p in panels)), squeeze=False)
    for ax, (entries, labels, title) in zip(axes[:, 0], panels, strict=True):
        _bars(ax, entries, labels, title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
