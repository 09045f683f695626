"""Stage 6, saving: what lands in <output_dir>, and the guard that keeps a user's earlier model safe.

<output_dir>/
  model.safetensors, config.json     the model, with id2label/label2id
    or adapter_model.safetensors,    with --peft: the adapter (PEFT's layout), labels.json for a classifier,
    adapter_config.json, merged/     and with --merge_adapters the merged full model
  tokenizer.json, tokenizer_config.json, ...
  args.json                          the resolved arguments, secrets left out
  train_results.json, eval_results.json, test_results.json (when a labelled test split exists)
  <split>_predictions.jsonl          predictions for a validation/test split that has no labels
  metrics.jsonl                      every logging event (written during training)
"""

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudtrain.config import Config
from cloudtrain.errors import UserError
from cloudtrain.redact import mask_value

if TYPE_CHECKING:  # importing torch here would make the commands' checks of a model directory slow to answer
    import torch

ADAPTER_CONFIG = "adapter_config.json"
LABELS = "labels.json"  # an adapter classifier's label names (the base model knows none)
MERGED = "merged"  # --merge_adapters / the merge command: the merged full model
GENERATIVE = ("CAUSAL_LM", "SEQ_2_SEQ_LM")  # PEFT task types of text-writing models: no labels, a generation config
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", ADAPTER_CONFIG)
# --task text_to_image: a diffusers pipeline's index and its components' folders (its tokenizers' are tokenizer*),
# or the LoRA weights diffusers' load_lora_weights reads
PIPELINE_PATTERNS = (
    *("model_index.json", "pytorch_lora_weights.safetensors", "unet", "transformer", "vae", "text_encoder*"),
    *("scheduler", "feature_extractor", "image_encoder", "safety_checker"),
)
# what a saved model is made of: replaced as a whole, so an adapter never lands next to an older full model
MODEL_PATTERNS = (
    *MODEL_FILES,
    "model-*-of-*.safetensors",
    "adapter_model.safetensors",
    "generation_config.json",
    LABELS,
    MERGED,
    *PIPELINE_PATTERNS,
)


def check_not_checkpoint(flag: str, folder: Path) -> None:
    """A training checkpoint given where a saved model belongs is refused in words that say so."""
    if (Path(folder) / "trainer_state.json").is_file():
        raise UserError(
            f"{flag} {folder} is a training checkpoint (weights, optimizer state and progress), not a saved model: "
            f"give the run's --output_dir, or go on training from it with --resume_from_checkpoint {folder}"
        )


def holds_model(output_dir: Path) -> bool:
    return any((Path(output_dir) / name).exists() for name in MODEL_FILES)


def final_save_bytes(cfg: Config, model: "torch.nn.Module") -> int:
    """About what the final save writes: the weights saved (the adapter's alone with --peft), plus the
    merged full model with --merge_adapters. ZeRO-3 keeps a parameter's full size in `ds_numel`."""

    def size(trainable_only: bool) -> int:
        params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)

    adapter = cfg.model.peft != "none"
    return size(trainable_only=adapter) + (size(trainable_only=False) if cfg.output.merge_adapters else 0)


def write_arguments(cfg: Config, path: Path) -> None:
    """The resolved arguments as JSON: secret options left out, token-shaped values masked; a local model or
    tokenizer folder as an absolute path (a relative one, read from another folder by `push`, looked like a Hub
    id and went into the card and the adapter's config as one)."""
    write_json(path, recorded_form(cfg))


def recorded_form(cfg: Config) -> dict:
    """The options as args.json holds them (what a later run compares its own with)."""
    values = cfg.to_dict()
    for name in ("model_name_or_path", "tokenizer_name_or_path"):
        if values.get(name) and Path(values[name]).expanduser().is_dir():
            values[name] = str(Path(values[name]).expanduser().resolve())
    return json.loads(json.dumps(finite(mask_value(values))))


def read_arguments(model_dir: Path | str) -> dict:
    """The args.json a run saved with its model ({} for a model from elsewhere, or an unreadable file)."""
    try:
        recorded = json.loads((Path(model_dir) / "args.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def check_not_diffusion(flag: str, path: Path) -> None:
    """A text_to_image run's output given to a command for text models: one line saying what it is."""
    if (Path(path) / "model_index.json").is_file():
        what = "a diffusers pipeline"
    elif (Path(path) / "pytorch_lora_weights.safetensors").is_file():
        what = "a diffusers LoRA"
    else:
        return
    raise UserError(
        f"{flag} {path} holds {what} from --task text_to_image, not a text model; render images with diffusers as "
        "the run's last line (use it: ...) shows"
    )


def adapter_config(path: Path) -> dict:
    return read_json(Path(path) / ADAPTER_CONFIG)


def read_json(path: Path) -> dict:
    """A JSON object a user may have edited by hand (adapter_config.json's base path), its mistakes in one line."""
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}: {err.msg}"
        raise UserError(f"{path} is not valid JSON ({where}); fix it") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; fix it") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a {type(value).__name__}, not a JSON object; fix it")
    return value


def write_json(path: Path, data: dict) -> None:
    """Strict JSON: a number that is not finite (a correlation of constant values) is written as null."""
    path.write_text(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line (predictions), strict as write_json."""
    path.write_text("".join(json.dumps(finite(row), ensure_ascii=False, allow_nan=False) + "\n" for row in rows))


def finite(value: Any) -> Any:
    """`value` with every float that is nan or infinite replaced by None (JSON's null), in dicts and lists too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_results(output_dir: Path, results: dict[str, dict]) -> None:
    """One `<name>_results.json` per entry, e.g. {"train": ..., "eval": ..., "test": ...}."""
    for name, values in results.items():
        write_json(Path(output_dir) / f"{name}_results.json", values)
