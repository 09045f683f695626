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
from pathlib import Path

MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json")


def holds_model(output_dir: Path) -> bool:
    return any((Path(output_dir) / name).exists() for name in MODEL_FILES)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line (predictions)."""
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_results(output_dir: Path, results: dict[str, dict]) -> None:
    """One `<name>_results.json` per entry, e.g. {"train": ..., "eval": ..., "test": ...}."""
    for name, values in results.items():
        write_json(Path(output_dir) / f"{name}_results.json", values)
