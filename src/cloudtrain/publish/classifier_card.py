"""The model card of an encoder task's model (`build_model_card`): summary, usage snippet (a pipeline, the model
class, or the PEFT auto class for an adapter), labels, training hyperparameters, training and evaluation results,
confusion matrices, then the shared footer (cloudtrain.publish.card_sections). What one task's card says that
another's does not (its purpose, metrics, pipeline and snippet) is the task's `CardKind`, in its own module."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import ModelCard, ModelCardData

from cloudtrain.config import Config
from cloudtrain.publish.card_metadata import REUTERS_HUB_ID, SPLITS, dataset_info, task_card_data
from cloudtrain.publish.card_model_files import adapter_info, label_names
from cloudtrain.publish.card_sections import (
    ADAPTER_MACROS,
    CURVES_FILE,
    FOOTER,
    compute_summary,
    framework_versions,
    hyperparameters,
)

MAX_MATRIX_LABELS = 20  # larger confusion matrices are unreadable as markdown tables
# (results key, model-index metric type, its display name, its args)
CLASSIFICATION_METRICS = (
    ("accuracy", "accuracy", "Accuracy", None),
    ("macro_f1", "f1", "Macro F1", {"average": "macro"}),
)
TEXT_CLASSIFICATION = ("text-classification", "Text Classification", "AutoPeftModelForSequenceClassification")


@dataclass(frozen=True)
class CardKind:
    """What a task's card says that another encoder task's does not. The strings are Jinja, rendered with the
    card's variables (labels, example_text, example_question, source_text, num_beams, max_new_tokens)."""

    purpose: str = "text classification into {{ labels | length }} classes"  # "This model is ... for <purpose>"
    metrics: tuple = CLASSIFICATION_METRICS  # (results key, model-index metric type, display name, its args)
    pipeline: tuple[str, str, str] = TEXT_CLASSIFICATION  # (pipeline tag, the Hub's task name, the PEFT class)
    labelled: bool = True  # whether its head has classes to list (and a snippet passes id2label)
    model_class: str | None = None  # without a transformers pipeline: the class its snippet loads
    imports: str = ""  # lines a model-class snippet imports first
    inputs: str = 'inputs = tokenizer("{{ example_text }}", return_tensors="pt")'
    output: str = "print(model.config.id2label[model(**inputs).logits.argmax(-1).item()])"
    pipeline_options: str = ""  # more arguments of pipeline(...)
    call_options: str = ""  # more arguments of the pipeline's call
    adapter_options: str = ""  # more arguments of an adapter snippet's from_pretrained: the head PEFT rebuilds


CLASSIFICATION = CardKind()

TEMPLATE = (
    ADAPTER_MACROS
    + """{% macro number(value) %}{{ "%.4f" | format(value) if value is not none and value == value else "n/a" }}\
{% endmacro %}---
{{ card_data }}
---

# {{ model_name }}

This model is {% if base_model %}a fine-tuned version of [{{ base_model }}](https://huggingface.co/{{ base_model }})\
{% else %}a fine-tuned model{% endif %}
for {{ kind.purpose }}, trained on \
{% if datasets %}[{{ dataset_display }}](https://huggingface.co/datasets/{{ datasets[0] }})\
{% else %}{{ dataset_display }}{% endif %}
with cloudtrain ({{ training_type }} trainer).
{%- if headline %}

It achieves the following results on the {{ headline.split }} set:
{% for key, name in metric_names %}
- {{ name }}: {{ number(headline[key]) }}
{%- endfor %}
- Loss: {{ "%.4f" | format(headline.loss) }}
{%- endif %}

## Usage

{% if adapter or model_class %}```python
{{ kind.imports }}{% if adapter %}from peft import {{ peft_class }}
from transformers import AutoTokenizer
{% else %}from transformers import {{ model_class }}, AutoTokenizer
{% endif %}
{% if kind.labelled %}id2label = {{ id2label }}
{% endif %}tokenizer = AutoTokenizer.from_pretrained("{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %})
model = {{ peft_class if adapter else model_class }}.from_pretrained("{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %}\
{% if kind.labelled %}, num_labels={{ labels | length }}, id2label=id2label{% endif %}\
{% if adapter %}{{ kind.adapter_options }}{% endif %})
{{ kind.inputs }}
{{ kind.output }}
```{% if adapter %}{{ adapter_note(pipeline_tag, model_class) }}{% endif %}{% else %}```python
from transformers import pipeline

classifier = pipeline("{{ pipeline_tag }}", model="{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %}\
{{ kind.pipeline_options }})
print(classifier("{{ example_text }}"{{ kind.call_options }}))
```{% endif %}

{% if kind.labelled %}## Labels

| id | label |
|---:|:------|
{%- for label in labels %}
| {{ loop.index0 }} | {{ label }} |
{%- endfor %}
{% endif %}
## Training procedure

{{ hyperparameters_table() }}

### Training results

| steps | epochs | mean train loss (the run's) | runtime (s) | samples/s |
|---:|---:|---:|---:|---:|
| {{ train.global_step }} | {{ train.epoch }} | {{ "%.4f" | format(train.train_loss) }} | \
{{ train.train_runtime_s }} | {{ train.train_samples_per_s }} |
{{ model_origin() }}

### Evaluation results

| split | examples |{% for _, name in metric_names %} {{ name }} |{% endfor %} loss |
|:------|---:|{% for _ in metric_names %}---:|{% endfor %}---:|
{%- for row in evaluations %}
| {{ row.split }} | {{ row.samples }} |{% for key, _ in metric_names %} {{ number(row[key]) }} |{% endfor %} \
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


def build_model_card(output_dir: Path, cfg: Config, results: dict, kind: CardKind = CLASSIFICATION) -> ModelCard:
    """The card for the model saved in `output_dir` (its config.json, or an adapter's labels.json, gives the
    label names), as the task's `kind` describes it."""
    output_dir = Path(output_dir)
    repo_id = cfg.hub.hub_model_id
    assert repo_id is not None  # a card is for a push, which needs --hub_model_id
    adapter = adapter_info(output_dir, cfg)
    pipeline_tag, task_name, peft_class = kind.pipeline
    data = card_data(cfg, results, adapter, kind.metrics, pipeline_tag, task_name)
    dataset_id, dataset_display = dataset_info(cfg.data)
    evaluations = [{"split": SPLITS[key], **results[key]} for key in SPLITS if key in results]
    names = label_names(output_dir)
    reuters = dataset_id == REUTERS_HUB_ID
    example_text = (
        "Oil prices rose after OPEC agreed to cut output." if reuters else "Replace me by any text you'd like."
    )
    examples: dict[str, Any] = {
        "labels": [name.replace("|", "\\|") for name in names],
        "example_text": example_text,
        "example_question": "What did OPEC agree to?" if reuters else "What is this about?",
        # the training's prefix and the example as one Python string (json's escapes are Python's)
        "source_text": json.dumps(cfg.data.source_prefix + example_text, ensure_ascii=False),
        "max_new_tokens": cfg.data.max_target_length,
        "num_beams": cfg.data.generation_num_beams,
    }
    return ModelCard.from_template(
        data,
        template_str=TEMPLATE,
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        revision=cfg.hub.hub_revision,
        adapter=adapter,
        dataset_display=dataset_display,
        training_type=cfg.training.training_type,
        kind=rendered(kind, examples),
        model_class=kind.model_class,
        pipeline_tag=pipeline_tag,
        peft_class=peft_class,
        metric_names=[(key, name) for key, _, name, _ in kind.metrics],
        id2label="{" + ", ".join(f"{i}: {json.dumps(name, ensure_ascii=False)}" for i, name in enumerate(names)) + "}",
        headline=evaluations[0] if evaluations else None,
        hyperparameters=hyperparameters(cfg),
        train=results["train"],
        evaluations=evaluations,
        max_matrix_labels=MAX_MATRIX_LABELS,
        compute=compute_summary(results),
        curves=CURVES_FILE if (output_dir / CURVES_FILE).is_file() else None,
        versions=framework_versions(cfg),
        **examples,
    )


def rendered(kind: CardKind, examples: dict) -> dict:
    """`kind` with its Jinja strings rendered with the card's `examples` (its labels and example texts)."""
    fields = dataclasses.asdict(kind)
    for name, value in fields.items():
        if isinstance(value, str):  # a trailing newline is part of the text (imports end in one)
            fields[name] = jinja2.Template(value, keep_trailing_newline=True).render(**examples)
    return fields


def card_data(
    cfg: Config,
    results: dict,
    adapter: dict | None = None,
    metrics: tuple = CLASSIFICATION_METRICS,
    pipeline_tag: str = TEXT_CLASSIFICATION[0],
    task_name: str = TEXT_CLASSIFICATION[1],
) -> ModelCardData:
    """The YAML metadata of a classifier: what the Hub indexes, filters and shows as evaluation results."""
    return task_card_data(
        cfg,
        results,
        pipeline_tag=pipeline_tag,
        task_name=task_name,
        metric_ids=sorted({metric_id for _, metric_id, _, _ in metrics}),
        metrics=metrics,
        adapter=adapter,
    )
