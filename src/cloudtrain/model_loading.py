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

from pathlib import Path

import huggingface_hub
import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_utils import load_state_dict
from transformers.models.auto.auto_factory import _get_model_class
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cloudtrain.assets import default_model_dir
from cloudtrain.config import ModelConfig
from cloudtrain.errors import UserError, first_line


def resolve_model_path(cfg: ModelConfig, name: str | None = None) -> str:
    """The path or Hub id to load (`name`, else the model's); a path that looks local must exist."""
    flag = "--tokenizer_name_or_path" if name else "--model_name_or_path"
    name = name or cfg.model_name_or_path or default_model_dir()
    looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise UserError(f"{flag} {name} does not exist; give a model directory or a Hub id like <org>/<name>")
    return str(Path(name).expanduser()) if looks_local else name


def load_tokenizer(cfg: ModelConfig) -> transformers.PreTrainedTokenizerBase:
    """--tokenizer_name_or_path, else the model's own tokenizer; a missing pad token becomes EOS (no new token)."""
    path = (
        resolve_model_path(cfg, cfg.tokenizer_name_or_path) if cfg.tokenizer_name_or_path else resolve_model_path(cfg)
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load a tokenizer from {path}: {first_line(err)}") from None
    if not tokenizer.is_fast:
        raise UserError(f"{path} has no fast tokenizer (tokenizer.json); cloudtrain needs one")
    if tokenizer.pad_token is None:  # decoders: pad with EOS, the usual choice for classification
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_causal_lm(config: transformers.PretrainedConfig) -> bool:
    """A decoder that AutoModelForCausalLM builds as such; a checkpoint with another head (an encoder, a
    classifier) is not, even where its family has a causal-LM class (BERT's, say)."""
    if config.architectures:
        causal = {
            name
            for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
            for name in (value if isinstance(value, (tuple, list)) else [value])
        }
        return any(name.endswith(("ForCausalLM", "LMHeadModel")) or name in causal for name in config.architectures)
    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.is_encoder_decoder


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


def load_model(
    cfg: ModelConfig,
    label_names: list[str],
    tokenizer: transformers.PreTrainedTokenizerBase,
    announce: bool = False,
    weights: dict | None = None,
) -> PreTrainedModel:
    """The pretrained body with a classification head for `label_names`: the checkpoint's own head when it
    has exactly these labels in this order, else a new one (said in one line when `announce`). `weights`:
    how to load them (cloudtrain.adapters.load_options; default fp32)."""
    path = resolve_model_path(cfg)
    existing = head_labels(cfg)
    replace_head = existing is not None and existing != label_names
    if replace_head and announce:
        assert existing is not None
        print(
            f"replacing the {len(existing)}-label head of {cfg.model_name_or_path or path} with a new "
            f"{len(label_names)}-label head (its labels: {', '.join(existing)})",
            flush=True,
        )
    id2label = dict(enumerate(label_names))
    try:
        config = AutoConfig.from_pretrained(
            path,
            num_labels=len(label_names),
            id2label=id2label,
            label2id={n: i for i, n in id2label.items()},
            trust_remote_code=cfg.trust_remote_code,
        )
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the "newly initialized head" report is expected here
        try:
            # fp32 master weights whatever the checkpoint's dtype (mixed precision is autocast's job), or an
            # adapter's frozen base in the compute dtype or 4-bit
            options = dict(
                config=config, trust_remote_code=cfg.trust_remote_code, **(weights or {"dtype": torch.float32})
            )
            if replace_head:
                model_class = classifier_class(path, config, cfg.trust_remote_code)
                model = model_class.from_pretrained(None, state_dict=body_weights(path, model_class), **options)
            else:
                model = AutoModelForSequenceClassification.from_pretrained(path, **options)
        finally:
            transformers.logging.set_verbosity(verbosity)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load a sequence-classification model from {path}: {first_line(err)}") from None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def classifier_class(
    path: str, config: transformers.PretrainedConfig, trust_remote_code: bool
) -> type[PreTrainedModel]:
    """The class AutoModelForSequenceClassification would build for `config`."""
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForSequenceClassification" in auto_map:
        return get_class_from_dynamic_module(auto_map["AutoModelForSequenceClassification"], path)
    return _get_model_class(config, AutoModelForSequenceClassification._model_mapping)


def body_weights(path: str, model_class: type[PreTrainedModel]) -> dict:
    """The checkpoint's weights without its task head: the keys under the model's base_model_prefix.

    Loading these leaves the head to be initialised from the seed, the same way under every launcher
    (ZeRO-3's partitioned loading included, where transformers would not skip a head of another size).
    """
    folder = Path(path)
    if not folder.is_dir():  # a Hub id: the files from_pretrained would fetch, from the same cache
        folder = Path(huggingface_hub.snapshot_download(path, allow_patterns=["*.safetensors", "*.bin", "*.json"]))
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    # Under ZeRO-3 only rank 0 copies values into the partitions; the others need names and shapes.
    meta = is_deepspeed_zero3_enabled() and torch.distributed.get_rank() != 0
    prefix = f"{model_class.base_model_prefix}."
    return {
        key: value
        for file in files
        for key, value in load_state_dict(file, "meta" if meta else "cpu").items()
        if key.startswith(prefix)
    }
