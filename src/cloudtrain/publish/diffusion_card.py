"""The model card of a text-to-image run, in the layout of diffusers' LoRA training scripts: YAML metadata the
Hub reads (base_model, library_name diffusers, the text-to-image tags, DreamBooth's instance_prompt, a widget
of the validation images), the images, a usage snippet (`load_lora_weights`, or the whole pipeline after full
fine-tuning, through the base's pipeline class: StableDiffusion3Pipeline for SD3) and the training settings."""

import json
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from cloudtrain.config import Config

VALIDATION_DIR = "validation"  # where RunLog writes each evaluation's grid (cloudtrain.observe.tracking)
SETTINGS = (
    "peft",
    "resolution",
    "learning_rate",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "lr_scheduler_type",
    "mixed_precision",
    "lora_r",
    "lora_alpha",
    "snr_gamma",
    "noise_offset",
    "prior_loss_weight",
    "seed",
)
FLOW_SETTINGS = ("weighting_scheme", "precondition_outputs", "max_sequence_length")  # SD3's, in place of:
NOT_FLOW = ("snr_gamma", "noise_offset")
SD3_TAGS = ["sd3", "sd3-diffusers", "stable-diffusion-3"]


def scheduler_line(pipeline: str, prediction_type: str) -> str:
    """The line that sets what a LoRA learned to predict (the base pipeline's scheduler says its own)."""
    scheduler = f"{pipeline}.scheduler"
    return f"{scheduler} = {scheduler}.from_config({scheduler}.config, prediction_type={prediction_type!r})"


def shown_grid(output_dir: Path, results: dict) -> Path | None:
    """The validation grid of the model saved: the newest, or the best step's under --load_best_model_at_end."""
    grids = sorted((Path(output_dir) / VALIDATION_DIR).glob("*.png"))
    step = results.get("train", {}).get("model_from_step")
    if step is not None:
        grids = [g for g in grids if g.stem.endswith(f"-step-{step:06d}")] or grids
    return grids[-1] if grids else None


def base_index(base: str) -> dict:
    """The base pipeline's model_index.json; empty when it cannot be read."""
    from cloudtrain.errors import UserError
    from cloudtrain.models.diffusion import local_pipeline, read_model_index

    try:
        return read_model_index(local_pipeline(base))
    except UserError:
        return {}


def build_card(output_dir: Path, cfg: Config, results: dict) -> ModelCard:
    from cloudtrain.models.diffusion import none_arguments

    ic, lora = cfg.images, cfg.model.peft != "none"
    base = str(cfg.model.model_name_or_path)
    repo = cfg.hub.hub_model_id or Path(output_dir).name
    grid = shown_grid(output_dir, results)
    last = f"{VALIDATION_DIR}/{grid.name}" if grid else None
    # SD3's class named (its LoRA loader is StableDiffusion3Pipeline's); the others' cards keep DiffusionPipeline
    index = base_index(base)
    sd3 = index.get("_class_name") == "StableDiffusion3Pipeline"
    pipeline = "StableDiffusion3Pipeline" if sd3 else "DiffusionPipeline"
    tags = ["text-to-image", "diffusers", "diffusers-training"]
    if pipeline == "StableDiffusion3Pipeline":
        tags += SD3_TAGS
    else:
        tags += ["stable-diffusion", "stable-diffusion-diffusers"]
    tags += ["lora"] if lora else []
    tags += ["dreambooth"] if ic.dreambooth else []
    data = ModelCardData(library_name="diffusers", base_model=base if not Path(base).exists() else None, tags=tags)
    extra = data.to_dict()
    extra["inference"] = True
    if ic.instance_prompt:
        extra["instance_prompt"] = ic.instance_prompt
    if last and ic.validation_prompts:
        extra["widget"] = [{"text": " | ".join(ic.validation_prompts), "output": {"url": last}}]
    header = "---\n" + json_yaml(extra) + "---\n"
    return ModelCard(header + body(cfg, repo, base, lora, last, results, pipeline, none_arguments(index)))


def body(
    cfg: Config,
    repo: str,
    base: str,
    lora: bool,
    last: str | None,
    results: dict,
    pipeline: str = "DiffusionPipeline",
    nones: str = "",
) -> str:
    """The card's text; `nones` the parts from_pretrained must be given as None (", text_encoder_3=None, ...":
    SD3 saved without T5, which it refuses to load otherwise)."""
    ic = cfg.images
    sd3 = pipeline == "StableDiffusion3Pipeline"
    what = "LoRA adaption weights" if lora else "a fully fine-tuned pipeline"
    how = "DreamBooth" if ic.dreambooth else "text-to-image fine-tuning"
    lines = [f"# {'SD3 ' if sd3 else ''}{'LoRA ' if lora else ''}{how} - {repo}", ""]
    lines.append(f"These are {what} for {base}{' (Stable Diffusion 3)' if sd3 else ''}, trained with cloudtrain.")
    if ic.instance_prompt:
        lines.append(f"The subject is called with the prompt: `{ic.instance_prompt}`.")
    if last:
        lines += ["", f"Validation images (prompts: {', '.join(ic.validation_prompts)}):", "", f"![validation]({last})"]
    prompt = ic.instance_prompt or (ic.validation_prompts[0] if ic.validation_prompts else "a photo")
    load = (
        f'pipeline = {pipeline}.from_pretrained("{base}"{nones})\npipeline.load_lora_weights("{repo}")'
        if lora
        else f'pipeline = {pipeline}.from_pretrained("{repo}"{nones})'
    )
    if lora and ic.prediction_type:
        load += "\n" + scheduler_line("pipeline", ic.prediction_type)

    lines += [
        "",
        "## How to use",
        "",
        "```python",
        f"from diffusers import {pipeline}",
        "",
        load,
        # SD3 renders at the T5 length it trained with (diffusers' default, 256, gives other images than the grid)
        f'image = pipeline("{prompt}"{f", max_sequence_length={ic.max_sequence_length}" if sd3 else ""}).images[0]',
        "```",
        "",
        "## Training details",
        "",
    ]
    values = cfg.to_dict()
    settings = [n for n in SETTINGS if n not in NOT_FLOW] + list(FLOW_SETTINGS) if sd3 else SETTINGS
    lines += [f"- {name}: {values[name]}" for name in settings if values.get(name) is not None]
    train = results.get("train", {})
    if "train_loss" in train:
        lines.append(f"- mean training loss over the run: {train['train_loss']:.4f}, {train.get('global_step')} steps")
    if "eval" in results:
        lines.append(f"- evaluation loss (fixed noise): {results['eval']['loss']:.4f}")
    return "\n".join(lines) + "\n"


def json_yaml(values: dict) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(values)), sort_keys=False, allow_unicode=True)
