"""The model card of a text classifier (`build_model_card`): summary, usage snippet (a pipeline, or
`AutoPeftModelForSequenceClassification` for an adapter), labels, training hyperparameters, training and
evaluation results, confusion matrices, then the shared footer (cloudtrain.publish.card_sections). A multi-label
classifier (`--task multi_label`) has its own metrics and a snippet that reads every label's probability; a
regression model (`--task regression`) its metrics and a snippet that reads the number; a token classifier
(`--task token_classification`) its entity-level metrics and a token-classification pipeline."""

import json
from pathlib import Path

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
REGRESSION_METRICS = (
    ("rmse", "mse", "RMSE", {"squared": False}),
    ("mae", "mae", "MAE", None),
    ("pearson", "pearsonr", "Pearson", None),
    ("spearman", "spearmanr", "Spearman", None),
)
MULTI_LABEL_METRICS = (
    ("micro_f1", "f1", "Micro F1", {"average": "micro"}),
    ("macro_f1", "f1", "Macro F1", {"average": "macro"}),
    ("subset_accuracy", "accuracy", "Subset accuracy", None),
)
TOKEN_METRICS = (
    ("f1", "f1", "F1", None),
    ("precision", "precision", "Precision", None),
    ("recall", "recall", "Recall", None),
    ("accuracy", "accuracy", "Accuracy", None),
)
ANSWER_METRICS = (("exact_match", "exact_match", "Exact match", None), ("f1", "f1", "F1", None))
SEQ2SEQ_METRICS = (
    ("rougeL", "rouge", "ROUGE-L", None),
    ("rouge1", "rouge", "ROUGE-1", None),
    ("rouge2", "rouge", "ROUGE-2", None),
    ("rougeLsum", "rouge", "ROUGE-Lsum", None),
    ("bleu", "sacrebleu", "BLEU", None),
)
METRICS = {
    "multi_label": MULTI_LABEL_METRICS,
    "regression": REGRESSION_METRICS,
    "token_classification": TOKEN_METRICS,
    "question_answering": ANSWER_METRICS,
    "seq2seq": SEQ2SEQ_METRICS,
}
# (pipeline tag, the Hub's task name, the PEFT class of an adapter) by kind; transformers 5 has no question-answering
# pipeline: that card loads the model class (MODEL_CLASSES) in its snippets
PIPELINES = {
    "token_classification": ("token-classification", "Token Classification", "AutoPeftModelForTokenClassification"),
    "question_answering": ("question-answering", "Question Answering", "AutoPeftModelForQuestionAnswering"),
    "seq2seq": ("text2text-generation", "Text2Text Generation", "AutoPeftModelForSeq2SeqLM"),
}
UNLABELLED = ("regression", "question_answering", "seq2seq")  # kinds whose head has no classes to list
# kinds without a pipeline in transformers 5: their snippets load the model class
MODEL_CLASSES = {"question_answering": "AutoModelForQuestionAnswering", "seq2seq": "AutoModelForSeq2SeqLM"}
TEXT_CLASSIFICATION = ("text-classification", "Text Classification", "AutoPeftModelForSequenceClassification")

TEMPLATE = (
    ADAPTER_MACROS
    + """{% macro number(value) %}{{ "%.4f" | format(value) if value is not none and value == value else "n/a" }}\
{% endmacro %}---
{{ card_data }}
---

# {{ model_name }}

This model is {% if base_model %}a fine-tuned version of [{{ base_model }}](https://huggingface.co/{{ base_model }})\
{% else %}a fine-tuned model{% endif %}
for {% if kind == "multi_label" %}multi-label text classification over {{ labels | length }} labels (each predicted \
where its probability is over 0.5){% elif kind == "regression" %}text regression (one number per text, \
`{{ labels[0] }}`){% elif kind == "token_classification" %}token classification (a tag per word, \
entity-level scores) with {{ labels | length }} tags{% elif kind == "question_answering" %}extractive question \
answering (the answer is a span of the context given with the question){% elif kind == "seq2seq" %}\
sequence-to-sequence generation (a target text written from a source text: summaries, translations)\
{% else %}text classification into \
{{ labels | length }} classes{% endif %}, trained on \
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
{% if kind == "question_answering" %}import torch
{% endif %}{% if adapter %}from peft import {{ peft_class }}
from transformers import AutoTokenizer
{% else %}from transformers import {{ model_class }}, AutoTokenizer
{% endif %}
{% if kind not in unlabelled %}id2label = {{ id2label }}
{% endif %}tokenizer = AutoTokenizer.from_pretrained("{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %})
model = {{ peft_class if adapter else model_class }}.from_pretrained("{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %}\
{% if kind not in unlabelled %}, num_labels={{ labels | length }}, id2label=id2label{% endif %})
{% if kind == "question_answering" %}inputs = tokenizer("{{ example_question }}", "{{ example_text }}", \
return_tensors="pt")
{%- elif kind == "seq2seq" %}inputs = tokenizer({{ source_text }}, return_tensors="pt")
{%- else %}inputs = tokenizer("{{ example_text }}", return_tensors="pt"){% endif %}
{% if kind == "question_answering" %}out = model(**inputs)
outside = torch.tensor([part != 1 for part in inputs.sequence_ids()])  # the question and special tokens
start = out.start_logits[0].masked_fill(outside, -1e4).argmax().item()
end = out.end_logits[0].masked_fill(outside, -1e4).argmax().item()
print(tokenizer.decode(inputs["input_ids"][0, start : end + 1]))
{%- elif kind == "seq2seq" %}{% if num_beams > 1 %}# beam search, as evaluated
output = model.generate(**inputs, max_new_tokens={{ max_new_tokens }}, num_beams={{ num_beams }})
{% else %}# one greedy pass, as evaluated (not any beam search the base model saved)
output = model.generate(**inputs, max_new_tokens={{ max_new_tokens }}, num_beams=1, min_length=0, \
no_repeat_ngram_size=0)
{% endif %}print(tokenizer.decode(output[0], skip_special_tokens=True))
{%- elif kind == "regression" %}print(model(**inputs).logits[0, 0].item())
{%- elif kind == "multi_label" %}probabilities = model(**inputs).logits.sigmoid()[0]
print([model.config.id2label[i] for i, p in enumerate(probabilities.tolist()) if p > 0.5])
{%- elif kind == "token_classification" %}tags = model(**inputs).logits.argmax(-1)[0].tolist()
print([model.config.id2label[i] for i in tags])  # a tag per token: the first of each word is the word's
{%- else %}print(model.config.id2label[model(**inputs).logits.argmax(-1).item()]){% endif %}
```{% if adapter %}{{ adapter_note(pipeline_tag, model_class) }}{% endif %}{% else %}```python
from transformers import pipeline

classifier = pipeline("{{ pipeline_tag }}", model="{{ repo_id }}"\
{% if revision %}, revision="{{ revision }}"{% endif %}\
{% if kind == "token_classification" %}, aggregation_strategy="first"{% endif %})
print(classifier("{{ example_text }}"{% if kind == "multi_label" %}, top_k=None\
{% elif kind == "regression" %}, function_to_apply="none"{% endif %}))
```{% endif %}

{% if kind not in unlabelled %}## Labels

| id | label |
|---:|:------|
{%- for label in labels %}
| {{ loop.index0 }} | {{ label }} |
{%- endfor %}
{% endif %}
## Training procedure

{{ hyperparameters_table() }}

### Training results

| steps | epochs | final train loss | runtime (s) | samples/s |
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


def build_model_card(output_dir: Path, cfg: Config, results: dict, kind: str = "classification") -> ModelCard:
    """The card for the model saved in `output_dir` (its config.json, or an adapter's labels.json, gives the
    label names); `kind`: classification, multi_label (any number of labels per text), regression,
    token_classification (a tag per word) or question_answering (a span of a context)."""
    output_dir = Path(output_dir)
    repo_id = cfg.hub.hub_model_id
    assert repo_id is not None  # a card is for a push, which needs --hub_model_id
    adapter = adapter_info(output_dir, cfg)
    metrics = METRICS.get(kind, CLASSIFICATION_METRICS)
    pipeline_tag, task_name, peft_class = PIPELINES.get(kind, TEXT_CLASSIFICATION)
    data = card_data(cfg, results, adapter, metrics, pipeline_tag, task_name)
    dataset_id, dataset_display = dataset_info(cfg.data)
    evaluations = [{"split": SPLITS[key], **results[key]} for key in SPLITS if key in results]
    names = label_names(output_dir)
    example_text = (
        "Oil prices rose after OPEC agreed to cut output."
        if dataset_id == REUTERS_HUB_ID
        else "Replace me by any text you'd like."
    )
    return ModelCard.from_template(
        data,
        template_str=TEMPLATE,
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        revision=cfg.hub.hub_revision,
        adapter=adapter,
        dataset_display=dataset_display,
        training_type=cfg.training.training_type,
        kind=kind,
        unlabelled=UNLABELLED,
        model_class=MODEL_CLASSES.get(kind),
        # the training's prefix and the example as one Python string (json's escapes are Python's)
        source_text=json.dumps(cfg.data.source_prefix + example_text, ensure_ascii=False),
        max_new_tokens=cfg.data.max_target_length,
        num_beams=cfg.data.generation_num_beams,
        example_question="What did OPEC agree to?" if dataset_id == REUTERS_HUB_ID else "What is this about?",
        pipeline_tag=pipeline_tag,
        peft_class=peft_class,
        metric_names=[(key, name) for key, _, name, _ in metrics],
        labels=[name.replace("|", "\\|") for name in names],
        id2label="{" + ", ".join(f"{i}: {json.dumps(name, ensure_ascii=False)}" for i, name in enumerate(names)) + "}",
        headline=evaluations[0] if evaluations else None,
        example_text=example_text,
        hyperparameters=hyperparameters(cfg),
        train=results["train"],
        evaluations=evaluations,
        max_matrix_labels=MAX_MATRIX_LABELS,
        compute=compute_summary(results),
        curves=CURVES_FILE if (output_dir / CURVES_FILE).is_file() else None,
        versions=framework_versions(cfg),
    )


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
