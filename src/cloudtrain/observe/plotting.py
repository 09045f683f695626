"""`training_curves.png`: the loss and the evaluation metrics of a run over its steps.

Drawn from the metrics.jsonl records with matplotlib's Agg canvas (no display, no pyplot state), so
it works on a headless machine and in any process. Two panels: train and validation loss; the
validation quality metrics (accuracy, macro F1, ...; a language model's perplexity, on a log scale); for a
preference run (`--task dpo`) a third: the reward margins and pair accuracy, in training and validation.
Timing, throughput and test metrics are left out: they are single values or do not share the panels' scales.
"""

import math
from pathlib import Path
from typing import TYPE_CHECKING

# eval/* entries that are not quality metrics and would not share the metrics panel's 0-1 scale
NOT_METRICS = {
    "eval/loss",
    "eval/samples",
    "eval/runtime_s",
    "eval/samples_per_s",
    "eval/tokens",
    "eval/tokens_per_s",
    "eval/validation_images",
}

# a preference run's margins and pair accuracy (train/ and eval/), on the third panel
PREFERENCE = ("/rewards/margins", "/rewards/accuracies")

NUMBER = (int, float, type(None))  # None: metrics.jsonl's null, a value that was not finite
Curves = dict[str, dict[str, tuple[list[int], list[float]]]]  # panel -> series -> (steps, values)

if TYPE_CHECKING:
    from PIL import Image


def curve_data(records: list[dict]) -> Curves:
    """The series each panel draws, in step order: {panel: {series name: (steps, values)}}."""
    panels: Curves = {"loss": {}, "evaluation metrics": {}}
    for record in sorted(records, key=lambda r: r["step"]):
        for name, value in record.items():
            if name in ("train/loss", "eval/loss"):
                panel = "loss"
            elif name.endswith(PREFERENCE):
                panel = "preference"  # a third panel, drawn only for the runs that log it
            elif "/rewards/" in name or "/logps/" in name:
                continue  # a preference run's other numbers: scales of their own, in metrics.jsonl
            elif name.endswith("_total"):
                continue  # counts (SQuAD 2.0's questions of each kind), not quality: off the metrics' scale
            elif name.startswith("eval/") and name not in NOT_METRICS and isinstance(value, NUMBER):
                panel = "evaluation metrics"
            else:
                continue
            steps, values = panels.setdefault(panel, {}).setdefault(name, ([], []))
            steps.append(record["step"])
            values.append(math.nan if value is None else float(value))  # not finite (null): a gap in its curve
    return panels


def plot_training_curves(records: list[dict], path: Path) -> Curves:
    """Write the curves of `records` as a PNG at `path`; returns the data that was drawn."""
    curves = curve_data(records)
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # here: only the main process draws, at the end
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.5 * len(curves), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    for ax, (title, series) in zip(figure.subplots(1, len(curves)), curves.items(), strict=True):
        for name, (steps, values) in series.items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if series:
            ax.legend()
            if all(name.endswith("perplexity") for name in series):  # from thousands at the start to tens
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=ax.transAxes)
    figure.savefig(path, dpi=100)
    return curves


def image_grid(images: list, captions: list[str], columns: int = 4) -> "Image.Image":
    """Images side by side (up to `columns` a row), each with its caption beneath: one picture per evaluation."""
    from PIL import Image, ImageDraw

    width, height = images[0].size
    if width < 128:  # small images (tests, demos) drawn larger: readable, with room for their captions
        width, height = 128, round(height * 128 / width)
    strip = 14  # pixels of caption text under each image (PIL's built-in font)
    columns = min(columns, len(images))
    rows = -(-len(images) // columns)
    grid = Image.new("RGB", (columns * width, rows * (height + strip)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, caption) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % columns) * width, (i // columns) * (height + strip)
        grid.paste(image.convert("RGB").resize((width, height), Image.Resampling.NEAREST), (x, y))
        draw.text((x + 2, y + height + 1), caption[: max(4, width // 6)], fill="black")
    return grid
