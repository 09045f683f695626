"""The parts every model card shares: the adapter's note and table (Jinja macros), the footer (compute used,
training curves, framework versions), the training-hyperparameters table and the escaping of a table cell.

The hyperparameter table lists what matters for the run: the core options (task, model, learning rate, batch,
steps or epochs, precision, seed, adapters) and every other option given a value other than its default. An
option a run does not use keeps its default, so a preference run's card shows no image or streaming options
without the card asking which task it is. Secrets never reach it: the values come from `Config.to_dict()`,
which leaves them out.
"""

import dataclasses
import html
import importlib.metadata
import math
from pathlib import Path

from cloudtrain.config import Config, differs_from_default
from cloudtrain.observe.cost import format_hours, format_usd
from cloudtrain.redact import mask

CURVES_FILE = "training_curves.png"
FRAMEWORKS = ("transformers", "torch", "accelerate", "datasets", "tokenizers", "huggingface_hub")
# on every card, at their default too: what anyone repeating the run must know
CORE_OPTIONS = (
    "task",
    "model_name_or_path",
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_steps",
    "mixed_precision",
    "seed",
    "peft",
)
ADAPTER_OPTIONS = {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"}  # the adapter table's

FOOTER = """{%- if compute %}

### Compute

- Training: {{ compute.device_hours }} {{ compute.device }}-hours \
({{ compute.processes }} x {{ compute.train_hours }} h)
{%- if compute.run_device_hours %} in the last launch, {{ compute.run_device_hours }} over every launch{% endif %}
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

ADAPTER_MACROS = """{% macro adapter_note(task, model_class=none) %}

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
from transformers import {{ model_class or "pipeline" }}

folder = snapshot_download("{{ repo_id }}", allow_patterns="{{ adapter.merged }}/*"\
{% if revision %}, revision="{{ revision }}"{% endif %})
{% if model_class %}merged = {{ model_class }}.from_pretrained(f"{folder}/{{ adapter.merged }}")
{%- else %}merged = pipeline("{{ task }}", model=f"{folder}/{{ adapter.merged }}"){% endif %}
```
{%- endif %}
{%- endmacro %}{% macro adapter_table() %}

### Adapter

| option | value |
|:-------|:------|
{%- for name, value in adapter.options.items() %}
| {{ name }} | {{ value }} |
{%- endfor %}
{%- endmacro %}{% macro hyperparameters_table() %}### Training hyperparameters

| option | value |
|:-------|:------|
{%- for name, value in hyperparameters.items() %}
| {{ name }} | {{ value }} |
{%- endfor %}
{%- if adapter %}{{ adapter_table() }}{% endif %}
{%- endmacro %}{% macro model_origin() %}
{%- if train.model_from_step is defined %}

The model is the run's best checkpoint, at step {{ train.model_from_step }} of {{ train.global_step }}, by its \
validation `{{ hyperparameters.metric_for_best_model | default("metric") }}` (`--load_best_model_at_end`); the \
evaluation results below are that model's.
{%- endif %}
{%- endmacro %}"""  # what both templates share (adapter note and table, hyperparameters): they start with these


def hyperparameters(cfg: Config) -> dict[str, str]:
    """The options that shaped the model, as table cells: the core ones, and the others where they differ from
    their default; without Hub, tracker and output options, nor the adapter's (an adapter's card has its own
    table, from adapter_config.json). --num_train_epochs only without --max_steps, which overrides it.

    Local paths show only their last part: the card is public, the user's directory layout is not.
    """
    sections = (cfg.hub, cfg.tracking, cfg.output)
    hidden = {f.name for section in sections for f in dataclasses.fields(section)} | {"cache_dir"} | ADAPTER_OPTIONS
    if cfg.training.max_steps is not None:
        hidden.add("num_train_epochs")
    shown = {}
    for name, value in cfg.to_dict().items():  # to_dict() leaves secrets out
        if name in hidden or value is None or value == []:
            continue
        if name not in CORE_OPTIONS and not differs_from_default(cfg, name):
            continue
        if isinstance(value, list):
            value = ",".join(map(str, value))
        elif isinstance(value, str) and Path(value).expanduser().exists():
            value = Path(value).name
        shown[name] = table_cell(mask(str(value)))  # a data URL's password, a presigned URL's signature
    return shown


def table_cell(text) -> str:
    """`text` as one cell of a markdown table, shown as written: HTML and backslashes escaped, `|` escaped,
    line breaks as <br>."""
    text = html.escape(str(text), quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return "<br>".join(text.splitlines())


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
    run_device_hours = finite(usage.get("run_device_hours"))  # a resumed run's, over every launch
    if run_device_hours is not None:
        summary["run_device_hours"] = format_hours(run_device_hours)
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
