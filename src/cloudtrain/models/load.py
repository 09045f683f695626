"""Model loading, one path for every task: the tokenizer, then the task's model (its transformers Auto
class) from --model_config, a local directory or a Hub id. Remote code runs only with --trust_remote_code.

The task answers what differs (cloudtrain.tasks.base): the config to build (`build_config`: a classifier's
labels, a language model's vocabulary), whether the checkpoint's head is replaced by a new one
(`replaces_head`: a classifier whose head has other labels keeps only the body's weights, said in one line),
and what the loaded model still needs (`fit_model`: SFT's embeddings grown for its chat tokens). Decoders
get EOS as their pad token when they have none (sequence classification needs it to find the last token).

Every load passes `trust_remote_code` explicitly (so transformers never asks on standard input), and every
failure a user's files can cause becomes one line (`load_failure`): a checkpoint that needs its own code names
--trust_remote_code true; damaged weights or tokenizer files name the file. `check_checkpoint` and `check_sizes`
run before any data or weights are loaded: weights present and readable, the tokenizer within the model's
vocabulary, --max_length within its positions.
"""

import json
import logging
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import huggingface_hub
import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_utils import load_state_dict
from transformers.models.auto.auto_factory import _get_model_class
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from cloudtrain.config import Config, ModelConfig
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError, first_line
from cloudtrain.models import adapters
from cloudtrain.models.positions import positions
from cloudtrain.parallel import tensor as tensor_parallel
from cloudtrain.parallel.distributed import launched_processes
from cloudtrain.paths import resolve_model_path
from cloudtrain.publish.saving import MERGED, is_adapter_dir

if TYPE_CHECKING:
    from cloudtrain.tasks.base import Task


def load_tokenizer(cfg: ModelConfig, **options: Any) -> transformers.PreTrainedTokenizerBase:
    """--tokenizer_name_or_path, else the model's own tokenizer (`options`: for its from_pretrained); a missing pad
    token becomes EOS (no new token)."""
    path = (
        resolve_model_path(cfg, cfg.tokenizer_name_or_path) if cfg.tokenizer_name_or_path else resolve_model_path(cfg)
    )
    tokenizer = read_tokenizer(path, cfg.trust_remote_code, **options)
    if not tokenizer.is_fast:
        raise UserError(f"{path} has no fast tokenizer (tokenizer.json); cloudtrain needs one")
    if tokenizer.pad_token is None:  # decoders: pad with EOS, the usual choice for classification
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pad_as_batches(config: transformers.PretrainedConfig, tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """The config's pad id as the batches' (the tokenizer's), where the config has none or the tokenizer pads with
    EOS: a decoder classifier reads each row at its last token that is not config.pad_token_id, so a checkpoint's
    own pad id beside a tokenizer padding with EOS read the padding, and every score hung on the batch's widths."""
    pad = tokenizer.pad_token_id
    if pad is not None and (config.pad_token_id is None or pad == tokenizer.eos_token_id):
        config.pad_token_id = pad


# what a folder holds when it holds a tokenizer (its config, or a vocabulary in one of the libraries' formats)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "*.model", "*.tiktoken")


def read_tokenizer(path: str | Path, trust_remote_code: bool, **options: Any) -> transformers.PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained(path), its failures as one line. The tokenizers library reports a damaged
    tokenizer.json as a bare Exception, and only the user's files are read here, so any failure is theirs."""
    folder = Path(path)
    if folder.is_dir() and not any(any(folder.glob(name)) for name in TOKENIZER_FILES):
        # transformers builds an empty tokenizer of a BERT's or GPT-2's config: every word its unknown token
        raise UserError(
            f"{path} holds no tokenizer (tokenizer.json, tokenizer_config.json or vocabulary files); copy the "
            "tokenizer files of the model it came from into it (a training run can also name them with "
            "--tokenizer_name_or_path)"
        )
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **options)
    except Exception as err:  # noqa: BLE001 (see above)
        if "backend tokenizer" in str(err) and folder.is_dir() and not (folder / "tokenizer.json").is_file():
            raise _without_tokenizer_json(folder) from None  # its message runs over lines: the first was cut off
        raise load_failure(err, f"the tokenizer in {path}", path) from None


def _without_tokenizer_json(folder: Path) -> UserError:
    """A tokenizer folder whose other files need the tokenizer.json it lacks (no slow tokenizer to convert)."""
    held = sorted(f.name for name in TOKENIZER_FILES for f in folder.glob(name))
    return UserError(
        f"{folder} holds {', '.join(held)} but not tokenizer.json, which its tokenizer is built from; copy "
        "tokenizer.json from the model it came from into it"
    )


# what reading a model's config.json raises for a bad one: StrictDataclassError, transformers 5's checks of its
# numbers ("hidden size (100) is not a multiple of the number of attention heads"), derives from Exception alone
CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, StrictDataclassError)


def config_reason(err: BaseException) -> BaseException:
    """The error that says why a config was refused: a StrictDataclassError's cause (the check's own ValueError;
    its message wraps it in the validator's name), else `err`."""
    return err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ is not None else err


def load_failure(err: BaseException, what: str, path: str | Path) -> UserError:
    """One line for a library error raised while loading `what` from `path` (a folder or a Hub id)."""
    err = config_reason(err)
    if "trust_remote_code" in str(err):  # transformers' refusal when trust_remote_code is False
        return remote_code_refusal(path)
    damaged = next((f for f in sorted(Path(path).glob("*.json")) if not _is_json(f)), None)
    if damaged is not None:  # the libraries' JSON errors name a line and column, not the file
        return UserError(f"could not load {what}: {damaged} is not valid JSON; save or download it again")
    detail = first_line(err)
    if isinstance(err, KeyError) or " " not in detail:  # KeyError('added_tokens'): an entry the file lacks
        detail = f"{type(err).__name__} {detail}: its files are damaged or incomplete"
    return UserError(f"could not load {what}: {detail}")


def _is_json(file: Path) -> bool:
    try:
        json.loads(file.read_text(encoding="utf-8"))
        return True
    except (ValueError, OSError):  # UnicodeDecodeError is a ValueError
        return False


def remote_code_refusal(path: str | Path) -> UserError:
    """The refusal of a checkpoint whose config names its own code (auto_map) that must run to load it."""
    folder = Path(path)
    code = sorted(f.name for f in folder.glob("*.py")) if folder.is_dir() else []
    named = f" ({', '.join(code)})" if code else ""
    return UserError(
        f"{path} needs its own Python code{named} to load, which cloudtrain runs only with "
        "--trust_remote_code true: read that code first"
    )


WEIGHT_NAMES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def check_checkpoint(path: str | Path, flag: str) -> None:
    """A local model folder (`flag` names it) holds a config and weights that can be read; cheap: only the
    safetensors headers and the .bin archives' directories are read. A Hub id is checked by from_pretrained."""
    folder = Path(path)
    if not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        if is_adapter_dir(folder):  # a --peft run's output: the adapter alone, its base named inside
            merged = folder / MERGED
            raise UserError(
                f"{flag} {path} holds an adapter, not a model: give "
                + (f"{merged}, its merge" if (merged / "config.json").is_file() else
                   f"its merge with the base (cloudtrain merge --model_dir {path} writes {merged})")
            )  # fmt: skip
        raise UserError(f"{flag} {path} has no config.json; give a folder written by save_pretrained")
    files = sorted({f for pattern in WEIGHT_NAMES for f in folder.glob(pattern)})
    if not files:
        raise UserError(
            f"{flag} {path} holds no weights (no model.safetensors or pytorch_model.bin), so the model would "
            "start from random weights; give a folder saved with its weights"
        )
    for file in files:
        try:
            if file.name.endswith(".safetensors"):
                with safe_open(str(file), "pt"):  # parses the header and checks the file covers every tensor
                    pass
            elif file.suffix == ".bin":
                zipfile.ZipFile(file).close()  # a truncated archive has no central directory
        except (SafetensorError, zipfile.BadZipFile, OSError) as err:
            raise UserError(f"{file} is damaged ({first_line(err)}); save or download the model again") from None


def check_sizes(
    config: transformers.PretrainedConfig,
    tokenizer: transformers.PreTrainedTokenizerBase,
    max_length: int,
    added_tokens: int = 0,
) -> None:
    """The tokenizer fits the model's vocabulary (but for `added_tokens` the task adds itself), and --max_length
    its positions: past either, training stops mid-run on an IndexError."""
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None)
    if vocab and len(tokenizer) - added_tokens > vocab:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}; "
            "use the model's own tokenizer (only a chat template's new tokens grow the embeddings)"
        )
    check_positions(config, max_length)


def check_positions(config: transformers.PretrainedConfig, max_length: int) -> None:
    """--max_length fits the model's position table (checked from its config, before any data is read)."""
    context = context_length(config)
    if context and max_length > context:
        raise UserError(
            f"--max_length {max_length} is longer than the model's context ({context} positions); "
            f"pass --max_length {context} or less"
        )


def context_length(config: transformers.PretrainedConfig) -> int | None:
    """The most tokens a row may hold: the rows of its position table; None where positions are relative."""
    return positions(config.get_text_config(decoder=True))


def read_config(cfg: ModelConfig, **options) -> transformers.PretrainedConfig:
    """The checkpoint's config (AutoConfig with `options`), its failures as one line."""
    return load_config(resolve_model_path(cfg), cfg.trust_remote_code, **options)


def trained_config(cfg: ModelConfig, **options) -> transformers.PretrainedConfig:
    """The config of the model a run trains, before loading it: --model_config's preset or file (pretraining
    from scratch), else the checkpoint's (AutoConfig with `options`)."""
    if cfg.model_config:
        from cloudtrain.tasks.causal_lm import model_config_file

        return load_config(model_config_file(cfg.model_config), cfg.trust_remote_code, **options)
    return read_config(cfg, **options)


def load_config(path: str | Path, trust_remote_code: bool, **options) -> transformers.PretrainedConfig:
    """AutoConfig.from_pretrained(path), its failures as one line."""
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **options)
    except CONFIG_ERRORS as err:
        raise load_failure(err, f"the model config in {path}", path) from None


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


def is_seq2seq_lm(config: transformers.PretrainedConfig) -> bool:
    """An encoder-decoder that AutoModelForSeq2SeqLM builds with its language-modelling head (T5's, BART's); not
    one saved with a classification head, nor an encoder alone."""
    other_heads = ("ForSequenceClassification", "ForQuestionAnswering", "ForTokenClassification", "EncoderModel")
    return config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and not any(
        name.endswith(other_heads) for name in config.architectures or []
    )


CLASSIFIER_HEADS = ("ForSequenceClassification", "ForTokenClassification")  # both name their layer `classifier`


def other_classifier(cfg: ModelConfig, head: str) -> str | None:
    """The checkpoint's architecture where it has the other kind of classifier head than `head` (a sentence
    classifier's for token classification): its layer has the same name and another shape, or another meaning."""
    names = read_config(cfg).architectures or []
    return next((n for n in names if n.endswith(CLASSIFIER_HEADS) and not n.endswith(head)), None)


def head_labels(cfg: ModelConfig, head: str = "ForSequenceClassification") -> list[str] | None:
    """The label names, by id, of the checkpoint's classification head (`head`: how its architecture's name ends;
    a token classifier's is ForTokenClassification); None when it has none."""
    config = read_config(cfg)
    if not any(name.endswith(head) for name in config.architectures or []):
        return None
    id2label: dict = config.id2label or {}  # transformers fills it for every config
    return [str(id2label[i]) for i in range(len(id2label))]


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
    # --tensor_parallel_size: sharded as it loads
    options.update(tensor_parallel.load_options(cfg, launched_processes()))
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
    except (OSError, ValueError, ImportError, SafetensorError) as err:
        if "trust_remote_code" in str(err):
            raise remote_code_refusal(source) from None
        raise UserError(f"{task.load_error} from {source}: {first_line(err)}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    keep_used_conversions(model)
    if announce and m.model_config:
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(
            f"built {type(model).__name__} from {m.model_config} with random weights (seed "
            f"{cfg.training.seed}): {params / 1e6:.1f}M parameters",
            flush=True,
        )
    task.fit_model(model, tokenizer, cfg, announce)
    return model


def save_tokenizer_files(tokenizer: transformers.PreTrainedTokenizerBase, folder: Path | str) -> None:
    """`tokenizer.save_pretrained(folder)`, padding on the side its config says: a call that padded on the left
    (batched generation) leaves the fast backend padding left, which transformers writes into tokenizer.json and
    reads back as the tokenizer's side (every SFT output's tokenizer came back padding on the left)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.padding is not None:
        backend.no_padding()
    tokenizer.save_pretrained(folder)


def keep_used_conversions(model: PreTrainedModel) -> None:
    """Only the key renamings the checkpoint's names needed. transformers' ZeRO-3 load path records every one it
    knows for the class, used or not, and saving reverts them all: a BERT trained under ZeRO-3 was saved with
    its LayerNorms under the legacy names `gamma`/`beta`, which readers of safetensors files do not know."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if c.was_used()]  # type: ignore[assignment]


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


class _MeanResizingNotice(logging.Filter):
    """transformers' notice, at every resize that adds rows, that it draws them around the old rows' mean."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("The new ") and "multivariate normal distribution" in message)


def grow_embeddings(model: PreTrainedModel, rows: int, pad_to_multiple_of: int | None = None) -> None:
    """`model.resize_token_embeddings(rows)`: the new input and output rows drawn around the old rows' mean and
    covariance (transformers' mean resizing), so a new token starts as an average one, with an average logit,
    rather than at zero; said here, so transformers' notice about that choice is left off the console."""
    logger, notice = logging.getLogger("transformers.modeling_utils"), _MeanResizingNotice()
    logger.addFilter(notice)
    try:
        model.resize_token_embeddings(rows, pad_to_multiple_of=pad_to_multiple_of, mean_resizing=True)
    finally:
        logger.removeFilter(notice)
