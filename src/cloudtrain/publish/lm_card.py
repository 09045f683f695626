"""The model card of a causal language model (`build_lm_model_card`): what was trained (continued pretraining of
a base model, pretraining from scratch from a --model_config, supervised fine-tuning of a chat model, or how the
caller says it was tuned), a usage snippet (text generation, or chat through `apply_chat_template`), training
hyperparameters, training results with tokens/s, loss and perplexity of each evaluated split, and the sample
generations (or answers) of the final validation evaluation; then the shared footer
(cloudtrain.publish.card_sections)."""

import json
from pathlib import Path

from huggingface_hub import ModelCard

from cloudtrain.config import Config
from cloudtrain.config.inert import reads
from cloudtrain.publish.card_metadata import SPLITS, dataset_info, task_card_data
from cloudtrain.publish.card_model_files import adapter_info, model_summary
from cloudtrain.publish.card_sections import (
    ADAPTER_MACROS,
    CURVES_FILE,
    FOOTER,
    compute_summary,
    finite,
    framework_versions,
    hyperparameters,
    table_cell,
)

LM_METRICS = (("perplexity", "perplexity", "Perplexity", None), ("loss", "loss", "Loss", None))
LM_EXAMPLE_PROMPT = "Once upon a time"
SUPERVISED = "fine-tuned (supervised, on its answers only) from"  # how a chat model was tuned, unless told
PRETRAINED = "trained by continued pretraining of"

LM_TEMPLATE = (
    ADAPTER_MACROS
    + """---
{{ card_data }}
---

# {{ model_name }}

This model is a {% if chat %}chat model, a causal language model{% else %}causal language model{% endif %}\
{% if architecture %} (`{{ architecture }}`{% if parameters %}, {{ parameters }} parameters{% endif %}){% endif %}
{% if from_scratch %}trained from scratch from the {{ from_scratch }} configuration\
{% else %}{{ tuning }} \
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

{{ hyperparameters_table() }}

### Training results

| steps | epochs | mean train loss (the run's) | runtime (s) | tokens/s |
|---:|---:|---:|---:|---:|
| {{ train.global_step }} | {{ train.epoch | default("streamed") }} | {{ "%.4f" | format(train.train_loss) }} | \
{{ train.train_runtime_s }} | {{ train.train_tokens_per_s }} |
{{ model_origin() }}
{%- if evaluations %}

### Evaluation results

| split | tokens | loss | perplexity |
|:------|---:|---:|---:|
{%- for row in evaluations %}
| {{ row.split }} | {{ row.tokens }} | {{ "%.4f" | format(row.loss) }} | {{ "%.2f" | format(row.perplexity) }} |
{%- endfor %}
{%- endif %}
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
{%- if sections %}

{{ sections }}
{%- endif %}
"""
    + FOOTER
)


def build_lm_model_card(
    output_dir: Path,
    cfg: Config,
    results: dict,
    chat: bool = False,
    tuning: str | None = None,
    perplexity: bool = True,
    sections: str = "",
) -> ModelCard:
    """The card for the causal language model saved in `output_dir` (`results`: train, eval and maybe test
    metrics of a `--task causal_lm` run, or with `chat` of a `--task sft` run: chat usage, sample answers).

    `tuning`: how the model was trained from its base, the words before the base's name (default: supervised
    fine-tuning for a chat model, continued pretraining otherwise). `perplexity=False` leaves out the
    evaluation (metadata, headline, table and sample generations) of a run that measures no perplexity: its
    caller adds its own as `sections`, markdown put after the training results and before the footer.
    """
    output_dir = Path(output_dir)
    repo_id = cfg.hub.hub_model_id
    assert repo_id is not None  # a card is for a push, which needs --hub_model_id
    adapter = adapter_info(output_dir, cfg)
    evaluated = results if perplexity else {key: value for key, value in results.items() if key not in SPLITS}
    data = task_card_data(
        cfg,
        evaluated,
        pipeline_tag="text-generation",
        task_name="Text Generation",
        metric_ids=["perplexity"] if perplexity else None,
        metrics=LM_METRICS,
        adapter=adapter,
    )
    _, dataset_display = dataset_info(cfg.data)
    evaluations = [{"split": SPLITS[key], **evaluated[key]} for key in SPLITS if key in evaluated]
    generations = results.get("eval", {}).get("generations") or []  # the first one's prompt is the example's
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
        tuning=tuning or (SUPERVISED if chat else PRETRAINED),
        dataset_display=dataset_display,
        training_type=cfg.training.training_type,
        headline=evaluations[0] if evaluations else None,
        example_prompt=json.dumps(
            generations[0].get("question" if chat else "prompt", LM_EXAMPLE_PROMPT)
            if generations
            else LM_EXAMPLE_PROMPT,
            ensure_ascii=False,
        ),
        chat=chat,
        exact_match=finite(evaluated.get("eval", {}).get("exact_match")),
        system_prompt=json.dumps(cfg.data.system_prompt, ensure_ascii=False)
        if chat and cfg.data.system_prompt and reads(cfg.training.task, "system_prompt")  # dpo: unused
        else None,
        max_new_tokens=cfg.training.sample_max_new_tokens,
        hyperparameters=hyperparameters(cfg),
        train=results["train"],
        evaluations=evaluations,
        generations=[{key: table_cell(value) for key, value in g.items()} for g in generations if perplexity],
        compute=compute_summary(results),
        sections=sections.strip(),
        curves=CURVES_FILE if (output_dir / CURVES_FILE).is_file() else None,
        versions=framework_versions(cfg),
    )
