"""Parameter-efficient fine-tuning through PEFT (`--peft lora|dora|qlora`), and the `merge` command (`run`; its options
are cloudtrain.commands.merge's).

    python src/training_application.py --peft lora [--lora_r 16 --lora_alpha 32 --lora_target_modules all-linear]
    python src/training_application.py merge --output_dir DIR      # writes DIR/merged, a plain transformers model

Supports:
- LoRA and DoRA on every task, with one process, DDP, DeepSpeed ZeRO 1-3 and FSDP2 (CPU and GPU);
- QLoRA: the base in 4-bit NF4 with double quantization and bf16 compute (bitsandbytes, CUDA only), one
  process, DDP, ZeRO 1-2, or FSDP2 (the 4-bit values then stored as bf16: bnb_4bit_quant_storage);
- the modules a task trains in full next to the adapters (`Task.train_in_full`): whatever sits outside a
  classifier's pretrained body (its head), and a language model's embeddings and head when a chat template
  added tokens.
Does not support: QLoRA on CPU or under ZeRO-3; adapters on a model built from --model_config (random
weights: no base to load the adapter onto).

At load time: the base model (frozen, in the compute dtype, or 4-bit), gradient checkpointing, then
`attach`: the adapters, in fp32 like everything else that trains. The trainer, the optimizer (over
trainable parameters only) and accelerate come after. Checkpoints hold only the trainable weights (under
FSDP, which writes each process's shards, the whole model).

The output directory holds PEFT's layout (adapter_config.json, adapter_model.safetensors), which
`AutoPeftModelFor...` loads (docs/adapters.md: loading it onto a base by hand).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GenerationConfig,
)
from transformers.utils import GENERATION_CONFIG_NAME

from cloudtrain.assets import DEFAULT_MODEL_NAME
from cloudtrain.config import Config
from cloudtrain.errors import UserError, first_line
from cloudtrain.parallel.distributed import fsdp_shards
from cloudtrain.publish.atomic import is_no_space
from cloudtrain.publish.output_dir import FINAL_PATTERNS, MANIFEST, is_run_name, record
from cloudtrain.publish.saving import GENERATIVE, LABELS, MERGED, adapter_config, read_json

AUTO_CLASSES = {
    "SEQ_CLS": AutoModelForSequenceClassification,
    "TOKEN_CLS": AutoModelForTokenClassification,
    "QUESTION_ANS": AutoModelForQuestionAnswering,
    "CAUSAL_LM": AutoModelForCausalLM,
    "SEQ_2_SEQ_LM": AutoModelForSeq2SeqLM,
}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, transformers.pytorch_utils.Conv1D)  # what LoRA adapts here


# ---------------------------------------------------------------- before anything is loaded


def check_options(cfg: Config, auto_class: type, train_in_full: Callable[[Any], list[str]] | None = None) -> None:
    """Refuse what cannot work, in one line, before the model is loaded; `auto_class` is the task's, and
    `train_in_full` its modules that train in full beside adapters (Task.train_in_full)."""
    m, d = cfg.model, cfg.distributed
    if m.peft == "none":
        return
    if m.model_config:
        raise UserError(
            f"--peft {m.peft} trains adapters on pretrained weights, but --model_config builds a model "
            "with random weights; train it in full first, then pass it as --model_name_or_path"
        )
    if m.peft == "qlora":
        if not torch.cuda.is_available():
            raise UserError(
                "--peft qlora loads the base model in 4-bit with bitsandbytes, which needs a CUDA GPU; "
                "use --peft lora (or dora) on this machine"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UserError("--peft qlora needs bitsandbytes: pip install bitsandbytes")
        if why := qlora_refusal(m.peft, d.zero_stage or 0, fsdp_shards(cfg), cfg.training.mixed_precision):
            raise UserError(why)
    check_target_modules(cfg, auto_class, train_in_full)


def qlora_refusal(peft: str, zero_stage: int, fsdp: bool, precision: str) -> str | None:
    """Why QLoRA cannot run sharded so (None: it can); the planner leaves out the rows the run refuses."""
    if peft != "qlora":
        return None
    if zero_stage == 3:
        return (
            "--peft qlora cannot shard its 4-bit base weights with ZeRO-3; use --fsdp true (which shards "
            "them), DDP, --zero_stage 1 or 2, or --peft lora"
        )
    if fsdp and precision in ("no", "fp16"):
        return (
            "--peft qlora under FSDP stores the 4-bit base in bf16 so that it can be sharded; "
            "pass --mixed_precision bf16"
        )
    return None


def check_target_modules(
    cfg: Config, auto_class: type, train_in_full: Callable[[Any], list[str]] | None = None
) -> None:
    """Each name in --lora_target_modules names layers LoRA can adapt (as PEFT matches them: the whole module
    name or its dotted tail), and not all of them train in full in this run; checked on a weightless copy of the
    model."""
    targets = cfg.model.lora_target_modules
    if targets == ["all-linear"]:
        return
    meta = meta_model(cfg, auto_class)
    modules = dict(meta.named_modules())
    adaptable = {name for name, module in modules.items() if isinstance(module, ADAPTABLE)}
    model = cfg.model.model_name_or_path or cfg.model.model_config or f"the default {DEFAULT_MODEL_NAME}"
    for target in targets:
        matches = {name for name in modules if name == target or name.endswith(f".{target}")}
        if not matches & adaptable:
            what = "is not a linear or embedding layer" if matches else "is not a module"
            raise UserError(
                f"--lora_target_modules: {target} {what} of {model}; its "
                f"linear and embedding layers are {', '.join(layer_names(meta))} (or use all-linear)"
            )
    if train_in_full is not None:
        _targets(cfg.model, train_in_full(meta), meta, announce=False)  # a run with none left is refused now


def layer_names(model: torch.nn.Module, leave_out: Iterable[str] = (), kinds: tuple = ADAPTABLE) -> list[str]:
    """The short names of the model's layers of `kinds` (those LoRA can adapt: q_proj, query, ...), less
    `leave_out`."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, kinds)}
    return sorted(names - set(leave_out))


def meta_model(cfg: Config, auto_class: type) -> transformers.PreTrainedModel:
    """The task's model built on the meta device from the checkpoint's config: names and shapes, no weights."""
    from cloudtrain.models.load import config_reason  # (cloudtrain.models.load imports this module)
    from cloudtrain.paths import resolve_model_path

    path = resolve_model_path(cfg.model)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        with torch.device("meta"):
            return auto_class.from_config(config, trust_remote_code=cfg.model.trust_remote_code)  # type: ignore[attr-defined]
    except (OSError, ValueError, StrictDataclassError) as err:  # the last: transformers 5's checks of its numbers
        raise UserError(f"could not read the model config in {path}: {first_line(config_reason(err))}") from None


def load_options(cfg: Config, auto_class: type) -> dict:
    """`from_pretrained` keywords for the base weights: fp32 master weights when everything trains; the
    compute dtype (or 4-bit) for a frozen base under adapters, which autocast would cast to anyway."""
    peft, precision = cfg.model.peft, cfg.training.mixed_precision
    if peft == "none":
        return {"dtype": torch.float32}
    if peft == "qlora":
        from transformers import BitsAndBytesConfig

        # What sits outside the pretrained body (a head, an LM head) trains in full or must stay exact: not 4-bit.
        # (transformers' own default keeps only the last parameter's module, e.g. not a BERT classifier.)
        model = meta_model(cfg, auto_class)
        keep = [name for name, child in model.named_children() if name != model.base_model_prefix]
        # Under FSDP the packed 4-bit values are stored as bf16 (the compute dtype), not uint8: FSDP shards
        # floating-point parameters only and needs one dtype across each layer's frozen weights.
        storage = torch.bfloat16 if fsdp_shards(cfg) else torch.uint8
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=storage,
            llm_int8_skip_modules=keep,
        )
        # 4-bit weights are placed while loading, on this process's GPU (accelerate set it as current)
        return {
            "dtype": torch.bfloat16,
            "quantization_config": quantization,
            "device_map": {"": torch.cuda.current_device()},
        }
    return {"dtype": COMPUTE_DTYPES.get(precision, torch.float32)}


# ---------------------------------------------------------------- at load time


def attach(model: Any, cfg: Config, task_type: str, train_in_full: list[str], announce: bool = False):
    """The model (a PreTrainedModel) with adapters (a PeftModel): base frozen, adapters and `train_in_full` modules
    trainable, fp32."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    m = cfg.model
    if m.peft == "qlora":  # what is not 4-bit to fp32 (norms, embeddings), inputs that carry gradients
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=m.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    targets = "all-linear" if m.lora_target_modules == ["all-linear"] else _targets(m, train_in_full, model, announce)
    lora = LoraConfig(
        r=m.lora_r,
        lora_alpha=m.lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int, scales by any number
        lora_dropout=m.lora_dropout,
        target_modules=targets,
        use_dora=m.peft == "dora",
        modules_to_save=train_in_full or None,
        task_type=task_type,
        ensure_weight_tying=tied and bool(train_in_full),
    )
    with warnings.catch_warnings():  # PEFT calls a transformers property deprecated for v6
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(model, lora)
    peft_config = model.peft_config["default"]
    base = peft_config.base_model_name_or_path
    if base and Path(base).is_dir():  # a local base: found from any working directory
        peft_config.base_model_name_or_path = str(Path(base).resolve())
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # what the optimizer updates is fp32, whatever the base's dtype
    return model


def _targets(m: Any, train_in_full: list[str], model: torch.nn.Module, announce: bool) -> list[str]:
    """--lora_target_modules less the layers that train in full here (a grown vocabulary's embeddings, a new head):
    PEFT cannot both adapt a layer and train it whole."""

    def whole(target: str) -> bool:
        return any(t == target or t.endswith(f".{target}") or target.endswith(f".{t}") for t in train_in_full)

    targets = [t for t in m.lora_target_modules if not whole(t)]
    if not targets:
        linear = tuple(kind for kind in ADAPTABLE if kind is not torch.nn.Embedding)  # the usual targets
        others = ",".join(layer_names(model, [t.rsplit(".", 1)[-1] for t in train_in_full], linear)[:4])
        raise UserError(
            f"--lora_target_modules {','.join(m.lora_target_modules)}: these layers train in full in this run "
            f"({', '.join(train_in_full)}: new or resized), so no adapter is left; name other layers "
            f"({others}) or all-linear"
        )
    if len(targets) < len(m.lora_target_modules) and announce:
        full = [t for t in m.lora_target_modules if whole(t)]
        print(f"note: {', '.join(full)} train(s) in full in this run (new or resized), so no adapter goes on them")
    return targets


def is_adapter(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def save(model, output_dir: Path, state_dict: dict | None = None) -> None:
    """The adapter in PEFT's layout, and a classifier's label names and problem type (labels.json: the base knows
    neither; a multi-label head is read with a sigmoid per label)."""
    card = Path(output_dir) / "README.md"
    stub = not card.exists()
    # grown embeddings are in the modules trained in full already; PEFT would add 2 more copies of each
    model.save_pretrained(output_dir, state_dict=state_dict, save_embedding_layers=False)
    if stub:  # PEFT's empty card template, naming this machine's path to the base: the card comes with `push`
        card.unlink(missing_ok=True)
    if model.peft_config["default"].task_type in GENERATIVE:  # a chat model's end-of-turn stop is not the base's
        model.generation_config.save_pretrained(output_dir)
    else:
        id2label = {str(i): name for i, name in model.config.id2label.items()}
        labels = {"id2label": id2label, "problem_type": model.config.problem_type}
        (Path(output_dir) / LABELS).write_text(json.dumps(labels, indent=2) + "\n")


# ---------------------------------------------------------------- using a saved adapter


SAFE_ADAPTER_WEIGHTS = "adapter_model.safetensors"


def load_adapter_model(model_dir: Path, dtype: torch.dtype | str = torch.float32, trust_remote_code: bool = False):
    """(the base named in the adapter's config with the adapter on top, in eval mode; its tokenizer). A base that
    needs its own code is refused unless `trust_remote_code`: transformers never asks on standard input."""
    from peft import PeftModel

    model_dir = Path(model_dir)
    config = adapter_config(model_dir)
    base, task_type = config.get("base_model_name_or_path"), config.get("task_type")
    if task_type not in AUTO_CLASSES:
        raise UserError(
            f"{model_dir} holds a {task_type or 'PEFT'} adapter; cloudtrain loads {', '.join(AUTO_CLASSES)} ones"
        )
    if not base:
        raise UserError(f"{model_dir}/adapter_config.json names no base model (base_model_name_or_path)")
    local = base.startswith(("/", ".", "~")) or base.count("/") > 1  # else a Hub id
    if local and not Path(base).expanduser().is_dir():  # moved or deleted since training
        raise UserError(
            f"the adapter in {model_dir} was trained on {base}, which is no longer there: put the base model back, "
            f"or set base_model_name_or_path in {model_dir}/adapter_config.json to a copy of it (a folder or Hub id)"
        )
    options: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if not any((model_dir / name).is_file() for name in (SAFE_ADAPTER_WEIGHTS, "adapter_model.bin")):
        raise UserError(f"{model_dir} holds adapter_config.json but not the adapter's weights ({SAFE_ADAPTER_WEIGHTS})")
    if not local and not Path(base).is_dir():  # a Hub id: one line at once when neither cached nor reachable
        from cloudtrain.hub_reach import HubId, check_hub_ids

        check_hub_ids([HubId(f"base_model_name_or_path in {model_dir}/adapter_config.json", base)])
    unlabelled = task_type in LABELLED and not (model_dir / LABELS).is_file()
    if unlabelled and (model_dir / "args.json").is_file():  # a run wrote both: the base's names would be wrong
        raise UserError(missing_labels(model_dir))
    if (model_dir / LABELS).is_file():
        id2label, problem_type = read_labels(model_dir / LABELS)
        options.update(
            id2label=id2label,  # the number of labels with it (num_labels too: a warning against the base's labels)
            label2id={n: i for i, n in id2label.items()},
            problem_type=problem_type,  # written since --task multi_label; before: single-label
            ignore_mismatched_sizes=True,
        )  # the base's own head, if any, is replaced by the adapter's
    if not config.get("peft_type"):  # PEFT's KeyError, once the base had loaded
        raise UserError(f"{model_dir}/adapter_config.json names no peft_type (LORA, ...): restore the file PEFT wrote")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the "newly initialized head" report: the adapter holds the head
    try:
        tokenizer = _adapter_tokenizer(model_dir, base, trust_remote_code)
        if task_type == "SEQ_CLS" and tokenizer.pad_token_id is not None:
            options["pad_token_id"] = tokenizer.pad_token_id  # a decoder classifier finds its last token by it
        model = AUTO_CLASSES[task_type].from_pretrained(base, **options)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # a chat template's tokens
            # their rows come from the adapter (trained in full with it): mean resizing's covariance would be waste
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        if (model_dir / GENERATION_CONFIG_NAME).is_file():
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(model, model_dir)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        if "trust_remote_code" in str(err):
            from cloudtrain.models.load import remote_code_refusal  # load imports this module

            raise remote_code_refusal(base) from None
        if unlabelled and "size mismatch" in str(err):  # the adapter's head has its labels, the base's another count
            raise UserError(missing_labels(model_dir)) from None
        raise UserError(
            f"could not load the adapter in {model_dir} onto its base model {base}: {first_line(err)}"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model.eval(), tokenizer


def _adapter_tokenizer(model_dir: Path, base: str, trust_remote_code: bool):
    """The adapter's own tokenizer, else (an adapter from the Hub holds none) its base model's, said in a note: it
    was a cut-off "Couldn't instantiate the backend tokenizer from one of:" (found in audit)."""
    from cloudtrain.models.load import TOKENIZER_FILES, read_tokenizer  # load imports this module

    if any(any(model_dir.glob(name)) for name in TOKENIZER_FILES):
        return read_tokenizer(model_dir, trust_remote_code)
    note = f"note: {model_dir} holds no tokenizer files: the tokenizer of its base model {base} is used"
    print(note, file=sys.stderr)
    return read_tokenizer(base, trust_remote_code)


LABELLED = ("SEQ_CLS", "TOKEN_CLS")  # the adapters whose head's size and names only labels.json knows
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")
LABELS_SHAPE = '{"id2label": {"0": "first label", "1": "second label", ...}, "problem_type": ...}'


def read_labels(path: Path) -> tuple[dict[int, str], str | None]:
    """(label id -> name, problem type) of an adapter classifier's labels.json (`save` writes it), or a UserError
    naming the file and what is wrong with it: a hand-edited {"x": 1} was a KeyError traceback (found in audit)."""
    labels = read_json(path)
    names, problem_type = labels.get("id2label"), labels.get("problem_type")
    if not isinstance(names, dict) or not names:
        wrong = "no id2label"
    elif sorted(names, key=lambda key: (len(key), key)) != [str(i) for i in range(len(names))]:
        wrong = f"id2label's keys are not the label ids 0 to {len(names) - 1}"
    elif not all(isinstance(name, str) and name for name in names.values()):
        wrong = "an id2label name that is not text"
    elif problem_type is not None and problem_type not in PROBLEM_TYPES:
        wrong = f"problem_type {problem_type!r}, not one of {', '.join(PROBLEM_TYPES)}"
    else:
        return {int(i): name for i, name in names.items()}, problem_type
    raise UserError(
        f"{path} holds {wrong}, where it should read {LABELS_SHAPE}; restore the labels.json the training run wrote"
    )


def missing_labels(model_dir: Path) -> str:
    return (
        f"{model_dir}/{LABELS} is missing: the adapter's classifier has its labels there (names and count); restore "
        "the labels.json the training run wrote beside adapter_config.json"
    )


def _scores(output) -> torch.Tensor:
    """A model's output scores as one float tensor: its logits, or a question-answering model's start and end."""
    if hasattr(output, "start_logits"):
        return torch.stack([output.start_logits, output.end_logits]).float()
    return output.logits.float()


@contextlib.contextmanager
def _without_zero3_init() -> Iterator[None]:
    """transformers builds a model inside DeepSpeed's partitioned init while a ZeRO-3 run's config is registered;
    a run's merge loads on the main process alone, where that init's collectives would wait for the others."""
    from transformers.integrations import deepspeed

    registered = getattr(deepspeed, "_hf_deepspeed_config_weak_ref", None)
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = registered


def merge(output_dir: Path, trust_remote_code: bool = False, lands_in: Path | None = None) -> Path:
    """Write <output_dir>/merged: the base with the adapter folded in, once its logits on a probe batch
    equal the adapter model's within float tolerance (the largest difference is printed). `lands_in`: the folder
    `output_dir`'s files are published to, when it is a run's staging folder (the path printed)."""
    output_dir = Path(output_dir)
    folder = output_dir.resolve()  # as typed, `run/merged/..` would stop resolving once merged/ is moved aside
    target, partial, replaced = folder / MERGED, folder / f"{MERGED}.partial", folder / f"{MERGED}.replaced"
    for leftover in (partial, replaced):  # before the minutes of loading: a folder of the user's stops it at once
        _check_ours(leftover)
    with _without_zero3_init():
        model, tokenizer = load_adapter_model(output_dir, dtype="auto", trust_remote_code=trust_remote_code)
    batch = probe_batch(model, tokenizer)
    with torch.no_grad():
        expected = _scores(model(**batch))
        merged = model.merge_and_unload()
        actual = _scores(merged(**batch))
    difference = (expected - actual).abs().max().item()
    dtype = next(merged.parameters()).dtype
    tolerance = (1e-4 if dtype == torch.float32 else 5e-2) * max(1.0, expected.abs().max().item())
    if not difference <= tolerance:
        raise UserError(
            f"the merged model's logits differ from the adapter model's by {difference:.3g} (more than "
            f"{tolerance:.1g}); {output_dir / MERGED} was not written"
        )
    _write_merged(merged, tokenizer, folder, partial)
    shutil.rmtree(replaced, ignore_errors=True)  # checked above: an earlier merge's, or none
    if target.exists():  # an earlier merge of ours (the merge command checked it is)
        record(target, [])  # its manifest marks merged.replaced/ as ours should a kill leave it behind
        target.rename(replaced)  # a kill from here on leaves one whole merged model, old or new
    partial.rename(target)
    shutil.rmtree(replaced, ignore_errors=True)
    base = adapter_config(folder)["base_model_name_or_path"]
    shown = (lands_in or Path(os.path.normpath(output_dir))) / MERGED  # as the user named it, less any `..`
    print(
        f"wrote {shown}: the adapter merged into a copy of {base} ({dtype}), its logits "
        f"within {difference:.2e} of the adapter model's on a probe batch",
        flush=True,
    )
    return target


def _check_ours(leftover: Path) -> None:
    """`leftover` (merged.partial/ or merged.replaced/) is absent or one a merge wrote, holding its manifest: merge
    deletes it. Any other folder of that name is the user's and stops the merge (it was deleted; found in audit)."""
    if not leftover.exists() or (leftover / MANIFEST).is_file():
        return
    # a merge before the manifest came first (it wrote it last) left a model's files alone: ours too (review)
    if not all(is_run_name(f.name, FINAL_PATTERNS) for f in leftover.iterdir()):
        raise UserError(
            f"{leftover} is not one cloudtrain wrote, and merge uses that name for its work: move it elsewhere (or "
            "rename it), then merge again"
        )


def _write_merged(merged, tokenizer, folder: Path, partial: Path) -> None:
    """The merged model, its tokenizer and the run's args.json into `partial`; a full disk leaves nothing of it,
    in one line."""
    shutil.rmtree(partial, ignore_errors=True)  # checked by merge: an interrupted merge's, or none
    try:
        record(partial, [])  # first: the manifest marks the folder as cloudtrain's while it is written
        merged.save_pretrained(partial)
        from cloudtrain.models.load import save_tokenizer_files  # load imports this module

        save_tokenizer_files(tokenizer, partial)
        if (folder / "args.json").is_file():  # predict and generate read how the model was trained (length, pairs)
            shutil.copyfile(folder / "args.json", partial / "args.json")
        record(partial, [p.name for p in partial.iterdir()])  # what else lands in merged/ is the user's
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if is_no_space(err):
            raise UserError(
                f"the disk of {folder} filled up while the merged model was written ({first_line(err)}); any earlier "
                f"{MERGED}/ is kept: free some space and run again"
            ) from None
        raise


def probe_batch(model, tokenizer, rows: int = 2, length: int = 16) -> dict:
    """Token ids drawn from a fixed seed: the same batch for the adapter and the merged model."""
    embeddings = model.get_input_embeddings()
    embeddings = getattr(embeddings, "base_layer", embeddings)  # a LoRA on the embeddings wraps the layer
    vocab = min(len(tokenizer), embeddings.num_embeddings)
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0)).to(model.device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if model.config.is_encoder_decoder:  # its decoder reads the same ids
        batch["decoder_input_ids"] = ids
    return batch


def run(args: argparse.Namespace) -> None:
    """The merge command, once cloudtrain.commands.merge checked that --output_dir holds an adapter and no
    merged/ folder of the user's."""
    merge(Path(args.output_dir), args.trust_remote_code)
    record(Path(args.output_dir), [MERGED])  # cloudtrain's now: a later merge or run may replace it
