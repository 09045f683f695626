"""What a model card reads from the saved model's files, without loading any weights: a classifier's label
names, the architecture and parameter count (config.json, the safetensors headers), and of a PEFT adapter
(`--peft`) its method, base, merged copy and the adapter table (adapter_config.json and the adapter's
safetensors header).
"""

import json
import math
from pathlib import Path

from cloudtrain.config import Config
from cloudtrain.models.record import safetensors_header
from cloudtrain.publish.card_sections import table_cell
from cloudtrain.publish.saving import LABELS, MERGED, adapter_config, is_adapter_dir

ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA"}


def label_names(output_dir: Path) -> list[str]:
    """Label names in id order, from the saved config.json (an adapter's labels.json)."""

    saved = Path(output_dir) / (LABELS if is_adapter_dir(output_dir) else "config.json")
    if not saved.is_file():  # a text-writing model's adapter (--task seq2seq) has no labels
        return []
    id2label = json.loads(saved.read_text()).get("id2label", {})
    return [id2label[key] for key in sorted(id2label, key=int)]


def adapter_info(output_dir: Path, cfg: Config) -> dict | None:
    """What the card tells of the adapter in `output_dir` (None for a full model): its method, its base's
    directory name when local, the merged model's folder if any, and the adapter table."""

    if not is_adapter_dir(output_dir):
        return None
    config, method = adapter_config(output_dir), cfg.model.peft
    shapes = safetensors_shapes(output_dir / "adapter_model.safetensors") or {}  # exactly the trained weights
    return {
        "method": method,
        "name": ADAPTER_NAMES[method],
        "base": Path(config.get("base_model_name_or_path") or "").name,
        "merged": MERGED if (output_dir / MERGED).is_dir() else None,
        "options": adapter_options(config, method, shapes),
    }


def adapter_options(config: dict, method: str, shapes: dict[str, list[int]]) -> dict[str, str]:
    """The adapter table's rows, from adapter_config.json and the adapter weights' `shapes`."""
    targets = config.get("target_modules")  # all-linear is saved as the (maybe full) module names it stood for
    in_full = [
        name
        for name in dict.fromkeys(config.get("modules_to_save") or [])  # PEFT lists a head twice
        if any(f".{name}." in key for key in shapes)
    ]  # and names heads the model does not have
    trainable = sum(math.prod(shape) for shape in shapes.values())
    rows = {
        "method": method,
        "r": config.get("r"),
        "alpha": f"{config.get('lora_alpha'):g}",
        "dropout": config.get("lora_dropout"),
        "target modules": ", ".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))
        if isinstance(targets, list)
        else targets,
        "trained in full": ", ".join(in_full) or None,
        "trainable parameters": human_count(trainable) if trainable else None,
    }
    return {name: table_cell(value) for name, value in rows.items() if value is not None}


def model_summary(output_dir: Path) -> tuple[str | None, str | None]:
    """(architecture class from config.json, parameter count such as "8.1M" from the safetensors headers);
    None where the files do not tell."""
    try:
        architectures = json.loads((output_dir / "config.json").read_text()).get("architectures") or [None]
    except (OSError, ValueError, AttributeError):
        architectures = [None]
    count = 0
    for path in sorted(output_dir.glob("*.safetensors")):  # every shard; tied weights are stored once
        shapes = safetensors_shapes(path)
        if shapes is None:
            return architectures[0], None
        count += sum(math.prod(shape) for shape in shapes.values())
    return architectures[0], human_count(count) if count else None


def safetensors_shapes(path: Path) -> dict[str, list[int]] | None:
    """{tensor name: shape} from a safetensors file's header; None when it is missing or not one after all."""
    found = safetensors_header(path)
    try:
        return None if found is None else {name: t["shape"] for name, t in found[1].items()}
    except (KeyError, TypeError):
        return None


def human_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)
