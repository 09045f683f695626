"""Stage 3, model loading: tokenizer and sequence-classification model from a local dir or a Hub id.

Works for encoders (BERT-like) and decoders (GPT-like: a missing pad token is set to EOS, which
sequence classification needs to find the last real token). The classification head is sized to
the labels and carries their names (id2label/label2id). Remote code runs only with
--trust_remote_code true.
"""

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


def load_model(cfg: ModelConfig, label_names: list[str], tokenizer: transformers.PreTrainedTokenizerBase
               ) -> PreTrainedModel:
    """The pretrained body with a classification head for `label_names`."""
    path = resolve_model_path(cfg)
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
                path, config=config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
        finally:
            transformers.logging.set_verbosity(verbosity)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load a sequence-classification model from {path}: {first_line(err)}") from None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model

