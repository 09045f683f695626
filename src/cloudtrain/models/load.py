"""Model loading, one path for every task: the tokenizer, then the task's model (its transformers Auto
class) from --model_config, a local directory or a Hub id. Remote code runs only with --trust_remote_code.

The task answers what differs (cloudtrain.tasks.base): the config to build (`build_config`: a classifier's
labels, a language model's vocabulary), whether the checkpoint's head is replaced by a new one
(`replaces_head`: a classifier whose head has other labels keeps only the body's weights, said in one line),
and what the loaded model still needs (`fit_model`: SFT's embeddings grown for its chat tokens). Decoders
get EOS as their pad token when they have none (sequence classification needs it to find the last token).
"""

from pathlib import Path
from typing import TYPE_CHECKING

import huggingface_hub
import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_utils import load_state_dict
from transformers.models.auto.auto_factory import _get_model_class
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cloudtrain.assets import default_model_dir
from cloudtrain.config import Config, ModelConfig
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError, first_line
from cloudtrain.models import adapters

if TYPE_CHECKING:
    from cloudtrain.tasks.base import Task


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
    cfg: Config,
    task: "Task",
    data: ProcessedData,
    tokenizer: transformers.PreTrainedTokenizerBase,
    announce: bool = False,
) -> PreTrainedModel:
    """The task's model (its Auto class), one path for every task: built from --model_config, loaded from the
    checkpoint, or from its body's weights when the task replaces the checkpoint's head; then fitted to the task's
    data (`Task.fit_model`). Transforms (attention, checkpointing, adapters, compile) follow (models.prepare).
    Weights load as cloudtrain.models.adapters.load_options says (fp32 master weights unless adapters train)."""
    m, auto_class = cfg.model, task.auto_class
    assert auto_class is not None  # every task names one
    source = m.model_config or resolve_model_path(m)
    config = task.build_config(cfg, data, tokenizer)
    options = dict(trust_remote_code=m.trust_remote_code, **adapters.load_options(cfg, auto_class))
    if m.attn_implementation:  # at load time: some models take it only there (models.prepare.attention checks it)
        options["attn_implementation"] = m.attn_implementation
    verbosity = transformers.logging.get_verbosity()
    if task.adds_head:  # transformers' report of a newly initialised head is expected then
        transformers.logging.set_verbosity_error()
    try:
        if m.model_config:
            model = auto_class.from_config(config, **options)
        elif task.replaces_head(cfg, data, announce):
            model_class = concrete_class(source, config, auto_class, m.trust_remote_code)
            weights = body_weights(source, model_class)
            model = model_class.from_pretrained(None, config=config, state_dict=weights, **options)
        else:
            model = auto_class.from_pretrained(source, config=config, **options)
    except (OSError, ValueError, ImportError) as err:
        raise UserError(f"{task.load_error} from {source}: {first_line(err)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    if announce and m.model_config:
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(
            f"built {type(model).__name__} from {m.model_config} with random weights (seed "
            f"{cfg.training.seed}): {params / 1e6:.1f}M parameters",
            flush=True,
        )
    task.fit_model(model, tokenizer, cfg, announce)
    return model


def concrete_class(
    path: str, config: transformers.PretrainedConfig, auto_class: type, trust_remote_code: bool
) -> type[PreTrainedModel]:
    """The class `auto_class` would build for `config` (the repository's own with --trust_remote_code)."""
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and auto_class.__name__ in auto_map:
        return get_class_from_dynamic_module(auto_map[auto_class.__name__], path)
    return _get_model_class(config, auto_class._model_mapping)  # type: ignore[attr-defined]


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
