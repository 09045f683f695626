"""`training_curves.png`: the loss and the evaluation metrics of a run over its steps.

Drawn from the metrics.jsonl records with matplotlib's Agg canvas (no display, no pyplot state), so
it works on a headless machine and in any process. One panel per scale, so that no curve is flattened by
another's range: train and validation loss; the validation metrics on a 0-1 scale (accuracy, macro F1, exact
match, ...); a language model's perplexity, on a log scale (from thousands at the start to tens); the validation
metrics on other scales (SQuAD's F1 in percent, an error in the data's units); for a preference run (`--task dpo`)
the reward margins and the pair accuracy, in training and validation. A panel is drawn only where its curves were
logged (loss and the 0-1 metrics always). Timing, throughput and test metrics are left out: they are single values
or do not share the panels' scales.
"""

import math
from pathlib import Path
from typing import TYPE_CHECKING

# eval/* entries that are not quality metrics
NOT_METRICS = {
    "eval/loss",
    "eval/samples",
    "eval/runtime_s",
    "eval/samples_per_s",
    "eval/tokens",
    "eval/tokens_per_s",
    "eval/validation_images",
}
LOSSES = ("train/loss", "eval/loss")
MARGINS, PAIR_ACCURACY = "/rewards/margins", "/rewards/accuracies"  # a preference run's, train/ and eval/

# the panels, in the order they are drawn; the first two always are
LOSS, UNIT_SCALE, PERPLEXITY = "loss", "evaluation metrics", "perplexity"
OTHER_SCALES = "evaluation metrics, other scales"
PANELS = (LOSS, UNIT_SCALE, PERPLEXITY, OTHER_SCALES, "reward margins", "pair accuracy")
COLUMNS = 3  # panels a row

NUMBER = (int, float, type(None))  # None: metrics.jsonl's null, a value that was not finite
Series = tuple[list[int], list[float]]  # (steps, values)
Curves = dict[str, dict[str, Series]]  # panel -> series -> (steps, values)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from PIL import Image


def is_curve(name: str, value: object) -> bool:
    """Whether a metrics.jsonl entry is drawn."""
    if name in LOSSES or name.endswith((MARGINS, PAIR_ACCURACY)):
        return True
    if "/rewards/" in name or "/logps/" in name:
        return False  # a preference run's other numbers: scales of their own, in metrics.jsonl
    if name.endswith("_total"):
        return False  # counts (SQuAD 2.0's questions of each kind), not quality
    return name.startswith("eval/") and name not in NOT_METRICS and isinstance(value, NUMBER)


def panel_of(name: str, values: list[float]) -> str:
    """The panel a series is drawn in: by what it is, and for the other validation metrics by their scale. An
    exact match of 0-1 beside a perplexity of 1389 was a flat line (found in audit)."""
    if name in LOSSES:
        return LOSS
    if name.endswith(MARGINS):
        return "reward margins"
    if name.endswith(PAIR_ACCURACY):
        return "pair accuracy"
    if name.endswith("perplexity"):
        return PERPLEXITY
    return UNIT_SCALE if all(abs(v) <= 1 for v in values if math.isfinite(v)) else OTHER_SCALES


def curve_data(records: list[dict]) -> Curves:
    """The series each panel draws, in step order: {panel: {series name: (steps, values)}}."""
    series: dict[str, Series] = {}
    for record in sorted(records, key=lambda r: r["step"]):
        for name, value in record.items():
            if is_curve(name, value):
                steps, values = series.setdefault(name, ([], []))
                steps.append(record["step"])
                values.append(math.nan if value is None else float(value))  # not finite (null): a gap in its curve
    by_panel: dict[str, dict[str, Series]] = {}
    for name, (steps, values) in series.items():
        by_panel.setdefault(panel_of(name, values), {})[name] = (steps, values)
    return {panel: by_panel.get(panel, {}) for panel in PANELS if panel in (LOSS, UNIT_SCALE) or panel in by_panel}


def plot_training_curves(records: list[dict], path: Path) -> Curves:
    """Write the curves of `records` as a PNG at `path`; returns the data that was drawn."""
    curves = curve_data(records)
    draw_curves(curves).savefig(path, dpi=100)
    return curves


def draw_curves(curves: Curves) -> "Figure":
    """The figure of `curves`: a panel each, up to COLUMNS a row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # here: only the main process draws, at the end
    from matplotlib.figure import Figure

    columns = min(COLUMNS, len(curves))
    rows = -(-len(curves) // columns)
    figure = Figure(figsize=(5.5 * columns, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for ax, (title, series) in zip(axes, curves.items(), strict=False):
        draw_panel(ax, title, series)
    for unused in axes[len(curves) :]:
        unused.remove()
    return figure


def draw_panel(ax: "Axes", title: str, series: dict[str, Series]) -> None:
    from matplotlib.ticker import MaxNLocator

    for name, (steps, values) in series.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: a one-point run read 1.900-2.100
    if not series:
        ax.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=ax.transAxes)
        return
    ax.legend()
    steps = [step for steps, _ in series.values() for step in steps]
    if min(steps) == max(steps):  # one step: room either side of it, where whole steps can be marked
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    if title == PERPLEXITY and any(v > 0 for _, values in series.values() for v in values if math.isfinite(v)):
        ax.set_yscale("log")  # (matplotlib refuses a log scale with nothing to draw: a run of nan evaluations)


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
