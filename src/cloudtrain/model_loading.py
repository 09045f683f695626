"""Stage 3, model loading: tokenizer and sequence-classification model from a local dir or a Hub id.

Works for encoders (BERT-like) and decoders (GPT-like: a missing pad token is set to EOS, which
sequence classification needs to find the last real token). The classification head is sized to
the labels and carries their names (id2label/label2id). Remote code runs only with
--trust_remote_code true.

A checkpoint that already has a classification head (a fine-tuned sentiment or NLI model, say) keeps
it when its label names are the data's, in any order: the data's label ids follow the head's order
(`head_labels` is passed to data processing). Otherwise the whole head is replaced by a freshly
initialised one for the data's labels, and one line says so.
"""

import contextlib
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from cloudtrain.assets import default_model_dir
from cloudtrain.config import ModelConfig
from cloudtrain.errors import UserError, first_line


def resolve_model_path(cfg: ModelConfig) -> str:
    """The path or Hub id to load; a path that looks local must exist."""
    name = cfg.model_name_or_path or default_model_dir()
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(f"--model_name_or_path {name} does not exist; give a model directory or a Hub id "
                        "like <org>/<name>")
    return str(Path(name).expanduser()) if looks_local else name


def load_tokenizer(cfg: ModelConfig) -> transformers.PreTrainedTokenizerBase:
    path = resolve_model_path(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load a tokenizer from {path}: {first_line(err)}") from None
    if not tokenizer.is_fast:
        raise UserError(f"{path} has no fast tokenizer (tokenizer.json); cloudtrain needs one")
    if tokenizer.pad_token is None:  # decoders: pad with EOS, the usual choice for classification
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def head_labels(cfg: ModelConfig) -> list[str] | None:
    """The label names, by id, of the checkpoint's sequence-classification head; None when it has none."""
    path = resolve_model_path(cfg)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"could not read the model config in {path}: {first_line(err)}") from None
    if not any(name.endswith("ForSequenceClassification") for name in config.architectures or []):
        return None
    return [str(config.id2label[i]) for i in range(config.num_labels)]


def load_model(cfg: ModelConfig, label_names: list[str], tokenizer: transformers.PreTrainedTokenizerBase,
               announce: bool = False) -> PreTrainedModel:
    """The pretrained body with a classification head for `label_names`: the checkpoint's own head when it
    has exactly these labels in this order, else a new one (said in one line when `announce`)."""
    path = resolve_model_path(cfg)
    existing = head_labels(cfg)
    replace_head = existing is not None and existing != label_names
    if replace_head and announce:
        print(f"replacing the {len(existing)}-label head of {cfg.model_name_or_path or path} with a new "
              f"{len(label_names)}-label head (its labels: {', '.join(existing)})", flush=True)
    id2label = dict(enumerate(label_names))
    try:
        config = AutoConfig.from_pretrained(
            path, num_labels=len(label_names), id2label=id2label, label2id={n: i for i, n in id2label.items()},
            trust_remote_code=cfg.trust_remote_code)
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the "newly initialized head" report is expected here
        try:
            # fp32 master weights whatever the checkpoint's dtype; mixed precision is autocast's job
            model = AutoModelForSequenceClassification.from_pretrained(
                path, config=config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                ignore_mismatched_sizes=replace_head)
        finally:
            transformers.logging.set_verbosity(verbosity)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load a sequence-classification model from {path}: {first_line(err)}") from None
    if replace_head:
        reinitialize_head(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def head_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The task head: every top-level module outside the pretrained body (classifier, score, pre_classifier)."""
    return [module for name, module in model.named_children()
            if name != model.base_model_prefix and any(True for _ in module.parameters())]


@torch.no_grad()
def reinitialize_head(model: PreTrainedModel) -> None:
    """Fresh head weights from the current seed (same on every process), as for a model without a head.

    transformers re-initialises only the layers whose shapes changed; an old task's other head layers,
    or a head of the same size with other labels, would otherwise carry over. Under ZeRO-3 the
    partitioned parameters are gathered, initialised on rank 0 and scattered back.
    """
    modules = head_modules(model)
    params = [p for module in modules for p in module.parameters()]
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    std = getattr(model.config, "initializer_range", 0.02)
    with gathered:
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.normal_(mean=0.0, std=std)
                    if layer.bias is not None:
                        layer.bias.zero_()
                elif hasattr(layer, "reset_parameters"):  # norms and the like
                    layer.reset_parameters()
