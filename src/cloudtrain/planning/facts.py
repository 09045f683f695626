"""Model facts: what the memory model needs from a model, read off its config and a build on the meta device
(no weights are loaded). The task is asked through the registry (cloudtrain.registry.TASKS): a decoder task
(`DecoderTask`) reads its config and fits a preset to the tokenizer as training does, and every task says which
modules train in full next to adapters."""

import contextlib
from dataclasses import dataclass, replace

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig
from transformers.activations import ACT2FN
from transformers.pytorch_utils import Conv1D
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module

from cloudtrain.config import Config, ModelConfig, TrainingConfig
from cloudtrain.errors import UserError, first_line
from cloudtrain.models.load import (
    config_reason,
    context_length,
    is_causal_lm,
    load_tokenizer,
    remote_code_refusal,
)
from cloudtrain.models.prepare import varlen_misfit
from cloudtrain.parallel.stages import family_of
from cloudtrain.paths import resolve_model_path
from cloudtrain.registry import TASKS
from cloudtrain.tasks import DecoderTask, Task

# Torch, transformers and the tasks load at the top: the `plan` command's parser already loads them (its --task
# choices come from the task registry), so its start-up does not depend on keeping them lazy here.


@dataclass(frozen=True)
class LoraSpec:
    """The adapters training would attach: --lora_r, --lora_target_modules, --lora_dropout."""

    r: int = ModelConfig.lora_r
    target_modules: tuple[str, ...] = ("all-linear",)
    dropout: float = ModelConfig.lora_dropout


@dataclass(frozen=True)
class AdapterFacts:
    """What the adapter rows need, counted on the meta-device model for one LoraSpec."""

    spec: LoraSpec
    lora_params: int  # r*(in + out) over the adapted modules
    magnitude_params: int  # DoRA: one magnitude per output feature of each adapted module
    head_params: int  # modules trained in full next to the adapters (a classifier's head): an fp32 copy
    quantized_params: int  # QLoRA: the Linear weights bitsandbytes stores in 4-bit (all but the output head)
    largest_quantized: int  # the 4-bit weight dequantised to bf16 for its matmul, one at a time
    layer_adapted: int  # adapted modules in one transformer layer
    layer_inputs: int  # their input features summed (what each adapter keeps for backward)
    layer_outputs: int  # their output features summed (DoRA keeps two output-sized tensors each)
    # their input features summed once per tensor they read (q, k and v read one): in fp32 without dropout the
    # adapters keep that tensor itself, not a copy each (layer_inputs where a meta forward could not tell)
    layer_read: int = 0
    # an encoder-decoder's decoder layer: its adapted cross-attention k and v, which read the encoder's output
    # (source tokens, not target ones): how many, and their input features summed
    cross_adapted: int = 0
    cross_inputs: int = 0

    def trainable(self, peft: str) -> int:
        return self.lora_params + self.head_params + (self.magnitude_params if peft == "dora" else 0)


@dataclass(frozen=True)
class StageFacts:
    """What the pipeline's end stages hold beyond their layers (cloudtrain.parallel.stages)."""

    embedding_params: int  # stage 0: the token (and GPT-2's position) embeddings
    head_params: int  # the last stage: the final norm and the LM head (its own copy when tied)


@dataclass(frozen=True)
class TensorPlanFacts:
    """What transformers' tensor-parallel plan splits (the config's base_model_tp_plan, the model's _tp_plan)."""

    layer_split_params: int  # one layer's parameters the plan splits (column-wise q/k/v/gate/up, row-wise o/down)
    head_split_params: int  # the LM head, split by vocabulary columns (colwise_gather_output); 0 when tied or absent
    num_kv_heads: int

    def divisor_problem(self, m: "ModelFacts", tp: int) -> str | None:
        """Why a degree `tp` cannot split this model (the application's own refusal), or None."""
        sizes = {"attention heads": m.num_heads, "KV heads": self.num_kv_heads}
        sizes["intermediate size"] = m.intermediate_size
        bad = [f"{what} ({size})" for what, size in sizes.items() if size % tp]
        return f"{tp} does not divide the model's {', '.join(bad)}" if bad else None


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs from the model, read off its config and its meta-device build."""

    name: str
    architecture: str
    num_params: int
    num_layers: int
    layer_class: str
    layer_params: int  # the largest transformer layer
    root_params: int  # everything outside the layers (embeddings, head)
    largest_module_params: int  # DeepSpeed's "largest layer": most parameters held by one module
    hidden_size: int
    num_heads: int
    kv_hidden_size: int
    intermediate_size: int
    gated_mlp: bool
    activation_saved: float  # tensors of the intermediate size the activation function saves, besides its output
    hidden_dropout: bool
    attention_dropout: bool
    attn_implementation: str
    varlen_misfit: str | None = None  # why its attention is more than causal softmax (context parallelism refuses it)
    rms_norm: bool = False  # RMSNorm-style: the weight multiplies outside the kernel, keeping the normalised input
    # T5's RMSNorm (named LayerNorm) scales its 16-bit input itself, not the fp32 copy it takes the variance of:
    # with 16-bit weights it keeps that input too
    norm_scales_input: bool = False
    attention_inputs: int = 1  # projections reading the attention block's input (q, k, v: 3; a fused qkv: 1)
    mlp_inputs: int = 1  # projections reading the MLP's input (gated: gate and up, 2)
    task: str = TrainingConfig.task  # the --task (its default: classification)
    vocab_size: int = 0  # the width of the logits (a decoder task); 0: a classification head, no logits term
    from_config: bool = False  # name is a --model_config (config.json or preset), not a checkpoint
    tokenizer: str | None = None  # --tokenizer_name_or_path, passed on to the launch command
    trust_remote_code: bool = False  # --trust_remote_code true, passed on to the launch command
    adapters: AdapterFacts | None = None  # None: no adapter rows (a --model_config has no pretrained base)
    stages: StageFacts | None = None  # None: no pipeline rows (not a decoder cloudtrain.parallel.stages can cut)
    model_copy: bool = False  # full fine-tuning keeps a frozen fp32 copy of the model (a DPO reference)
    sequences_per_row: int = 1  # what a row of the micro-batch runs through the model (a pair task: 2)
    # the strategies whose full fine-tuning runs without that copy (--precompute_reference true): what the planner
    # may suggest instead of it
    copy_free: tuple[str, ...] = ()
    task_args: tuple[str, ...] = ()  # the task's own options the estimate assumed, passed on to the launch command
    tensor_plan: TensorPlanFacts | None = None  # None: the family has no tensor-parallel plan in transformers
    attention_width: int = 0  # q's width where not hidden_size (T5-3B: 32 heads of 128 over a hidden size of 1024)
    attention_bias: bool = False  # relative positions added to the scores per head (T5): a float mask per layer
    intermediate_dropout: bool = False  # dropout inside the MLP, after its activation (T5, BART's activation_dropout)
    fp32_down_projection: bool = False  # the MLP's output projection stays fp32 (T5's wo): its input is cast to fp32
    # an encoder-decoder (T5, BART): these facts are its decoder stack's, whose layers also attend to the encoder's
    # output (cross-attention); `encoder` holds the encoder stack's, read over the source length
    encoder: "ModelFacts | None" = None
    activation_output_saved: bool = False  # the activation keeps its output (ReLU): the down projection's input
    model_type: str | None = None  # the config's model_type (llama): whether Liger Kernel has modules for it
    context: int | None = None  # the most tokens a row may hold (its position table); None: relative positions

    @property
    def decoder(self) -> bool:
        """Whether the task trains a decoder with an LM head (causal_lm, sft): the same memory, logits included."""
        return is_decoder(self.task)


# ---------------------------------------------------------------- the task


def is_decoder(task: str) -> bool:
    """Whether the registered task `task` trains a decoder language model."""
    return issubclass(TASKS[task], DecoderTask)


def decoder_tasks(conjunction: str = "or") -> str:
    """The decoder tasks' names, for messages: "causal_lm or sft"."""
    return f" {conjunction} ".join(t.name for t in TASKS if issubclass(t, DecoderTask))


def model_config_refusal(task: str) -> str:
    """Why `plan` refuses --model_config for the task `task` (not a decoder's), naming the --task to add."""
    names = [t.name for t in TASKS if issubclass(t, DecoderTask)]
    first, others = names[0], " or ".join(names[1:])
    either = f"{', '.join(names[:-1])} or {names[-1]}" if others else first
    return f"--model_config is for --task {either}, not {task}: add --task {first}" + (
        f" (or {others})" if others else ""
    )


def task_for(task: str, model: ModelConfig | None = None) -> Task:
    """The registered task `task`, for a run of `model` (only its options: a task loads nothing when built)."""
    return TASKS[task](Config(model=model or ModelConfig()))


# ---------------------------------------------------------------- reading the model


def _config_value(config, names: tuple[str, ...], default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _activation_saved(act_name) -> tuple[float, bool]:
    """(how many input-sized fp32 tensors the activation function keeps for backward besides its output, whether
    it keeps its output: ReLU), measured."""
    if not isinstance(act_name, str) or act_name not in ACT2FN:
        return 1.0, False  # an unknown or fused activation: assume it saves its input only
    x = torch.zeros(64, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ACT2FN[act_name](x * 1.0)
    output = saved.pop(out.untyped_storage().data_ptr(), None) is not None
    return sum(saved.values()) / x.untyped_storage().nbytes(), output


def _load_config(task: Task, model: ModelConfig, num_labels: int):
    """The model's config as training builds it: a decoder task reads it (a checkpoint's, a config.json or a
    preset, which takes its vocabulary from the tokenizer when one is given); another with num_labels."""
    name = model.model_config or model.model_name_or_path
    if not isinstance(task, DecoderTask):
        if model.model_config:
            raise UserError(model_config_refusal(task.name))
        path = resolve_model_path(model)
        try:
            labels = {i: f"LABEL_{i}" for i in range(num_labels)}  # num_labels= warns when the head had other labels
            return AutoConfig.from_pretrained(path, trust_remote_code=model.trust_remote_code, id2label=labels)
        except (OSError, ValueError, KeyError, StrictDataclassError) as err:  # the last: transformers 5's checks
            if "trust_remote_code" in str(err):  # transformers' refusal: the checkpoint's own code must run
                raise remote_code_refusal(path) from None
            raise UserError(f"could not read a model config from {path}: {first_line(config_reason(err))}") from None
    config = task.model_config(Config(model=model))
    if not is_causal_lm(config):
        kind = ", ".join(config.architectures or [config.model_type])
        raise UserError(
            f"{name} is not a causal language model ({kind}); --task {decoder_tasks('and')} plan for one that "
            "AutoModelForCausalLM builds"
        )
    if model.model_config and model.tokenizer_name_or_path:  # what training does to a --model_config
        task.fit_config(config, load_tokenizer(model), model.model_config)
    return config


def _meta_model(config, task: Task, trust_remote_code: bool):
    auto = task.auto_class
    assert auto is not None  # every registered task names its Auto class
    kind = auto.__name__.removeprefix("AutoModelFor")  # CausalLM, Seq2SeqLM, SequenceClassification, ...
    try:
        with torch.device("meta"):  # shapes only: a 7B model builds in a fraction of a second
            return auto.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{type(config).__name__} has no {kind} model in transformers: {first_line(err)}") from None
    except Exception as err:  # a config whose numbers build no model (hidden_size 0: ZeroDivisionError)
        raise UserError(
            f"a {kind} model cannot be built from this {type(config).__name__} ({type(err).__name__}: "
            f"{first_line(err)}); check its config.json"
        ) from None


def _layer_stack(model):
    """The transformer layers: the ModuleList holding the most parameters."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not stacks:
        raise UserError(f"{type(model).__name__} has no stack of layers to plan for")
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))


def model_facts(
    name: str,
    num_labels: int = 2,
    trust_remote_code: bool = False,
    task: str = TrainingConfig.task,
    from_config: bool = False,
    tokenizer: str | None = None,
    lora: LoraSpec = LoraSpec(),
) -> ModelFacts:
    """Read a model's config and count its parameters exactly on the meta device; loads no weights.
    A decoder task (causal_lm, sft) builds the causal LM (LM head included); from_config: name is a
    --model_config; lora: the adapters to count (none for a --model_config: adapters need pretrained weights)."""
    options = ModelConfig(
        model_name_or_path=None if from_config else name,
        model_config=name if from_config else None,
        tokenizer_name_or_path=tokenizer,
        trust_remote_code=trust_remote_code,
    )
    run_task = task_for(task, options)
    decoder = isinstance(run_task, DecoderTask)
    config = _load_config(run_task, options, num_labels)
    model = _meta_model(config, run_task, trust_remote_code)
    text = config.get_text_config()
    hidden, heads = _config_value(text, ("hidden_size",)), _config_value(text, ("num_attention_heads",))
    if not hidden or not heads:
        raise UserError(f"the config of {name} has no hidden_size/num_attention_heads; cannot estimate activations")
    layers = _layer_stack(model.get_decoder() if config.is_encoder_decoder else model)
    activation = _activation_saved(
        _config_value(text, ("hidden_act", "activation_function", "hidden_activation", "dense_act_fn"))
    )
    num_params = sum(p.numel() for p in model.parameters())
    kv_heads = _config_value(text, ("num_key_value_heads",), heads)
    head = model.get_output_embeddings() if decoder or config.is_encoder_decoder else None  # the LM head
    num_params += _untied_head(text, model, head)
    stacks, encoder = [layers], None
    if config.is_encoder_decoder:
        stacks.append(_layer_stack(model.get_encoder()))
        encoder_heads = _config_value(text, ("encoder_attention_heads",), heads)
        encoder = _stack_facts(stacks[1], text, hidden, encoder_heads, encoder_heads)
        heads = kv_heads = _config_value(text, ("decoder_attention_heads",), heads)
    dropouts = _dropouts(text, config.is_encoder_decoder)
    facts = ModelFacts(
        name=name,
        sequences_per_row=run_task.sequences_per_row,
        architecture=type(model).__name__,
        model_type=getattr(model.config, "model_type", None),
        num_params=num_params,
        **_stack_facts(layers, text, hidden, heads, kv_heads, cross=encoder is not None),
        root_params=num_params - sum(p.numel() for stack in stacks for p in stack.parameters()),
        largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        hidden_size=hidden,
        activation_saved=activation[0],
        activation_output_saved=activation[1],
        hidden_dropout=dropouts[0],
        attention_dropout=dropouts[1],
        intermediate_dropout=dropouts[2],
        attn_implementation=str(getattr(model.config, "_attn_implementation", None) or "eager"),
        varlen_misfit=varlen_misfit(model.config),
        # what the encoder-decoders measured in tests/test_planner_seq2seq.py add (MPNet's relative positions go to
        # eager attention, which keeps the scores anyway)
        attention_bias=config.is_encoder_decoder and hasattr(text, "relative_attention_num_buckets"),
        fp32_down_projection="wo" in (getattr(model, "_keep_in_fp32_modules", None) or ()),
        task=task,
        vocab_size=0 if head is None else head.weight.shape[0],
        from_config=from_config,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        adapters=None if from_config else adapter_facts(model, run_task.train_in_full(model), lora, layers[0]),
        stages=stage_facts(model) if decoder else None,
        tensor_plan=tensor_plan_facts(model, layers, kv_heads) if decoder else None,
        context=context_length(config),
    )
    if encoder is None:
        return facts
    adapters = facts.adapters and adapter_facts(model, run_task.train_in_full(model), lora, stacks[1][0])
    return replace(facts, encoder=replace(facts, **encoder, root_params=0, vocab_size=0, adapters=adapters))


def _dropouts(text, encoder_decoder: bool) -> tuple[bool, bool, bool]:
    """Whether the model applies hidden, attention and intermediate dropout (each keeps a mask for the backward),
    by the names configs give them (only an encoder-decoder's activation dropout counts: OPT names one it never
    applies)."""

    def applies(*names: str) -> bool:
        return float(_config_value(text, names, 0.0)) > 0

    return (
        applies("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout", "dropout_rate"),
        applies("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout", "dropout_rate"),
        encoder_decoder and applies("activation_dropout", "dropout_rate"),
    )


def _untied_head(text, model, head) -> int:
    """The LM head's parameters where transformers 5 builds a T5 1.1 (FLAN-T5) tied but its checkpoint holds a head
    of its own, which loading keeps apart (its config's tie_word_embeddings false, read as scale_decoder_outputs)."""
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    return head.weight.numel() if tied and getattr(text, "scale_decoder_outputs", True) is False else 0


def _widest(layer, hidden: int) -> int:
    """The widest output of a projection reading a hidden-sized input: the MLP's up projection."""
    return max(shape[1] for module in layer.modules() if (shape := _in_out(module)) and shape[0] == hidden)


def _rms_norm(module) -> bool:
    """An RMSNorm-style norm written in Python (Llama's, T5's LayerNorm without bias or mean)."""
    return "RMSNorm" in type(module).__name__ or _t5_norm(module)


def _t5_norm(module) -> bool:
    """T5's RMSNorm, named LayerNorm (and its copies in mT5, LongT5, UMT5): no bias, no mean."""
    return (
        type(module).__name__.endswith("LayerNorm")
        and not isinstance(module, nn.LayerNorm)
        and getattr(module, "bias", None) is None
        and hasattr(module, "variance_epsilon")
    )


def _stack_facts(layers, text, hidden: int, heads: int, kv_heads: int, cross: bool = False) -> dict:
    """The ModelFacts fields of one stack of layers (an encoder-decoder has two; `cross`: its decoder's, whose
    layers attend to the encoder's output too). An encoder-decoder's MLP width is read off the layer where its
    config names none (BART's encoder_ffn_dim); T5 names its attention's width (d_kv per head)."""
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    named = _config_value(text, ("intermediate_size", "n_inner", "ffn_dim", "d_ff"))
    intermediate = named or (_widest(layers[0], hidden) if text.is_encoder_decoder else 4 * hidden)
    attention = heads * _config_value(text, ("d_kv",), hidden // heads)
    mlp_shaped = [p for p in layers[0].parameters() if p.ndim == 2 and set(p.shape) == {hidden, intermediate}]
    reading = _projections(layers[0], hidden, intermediate, into_mlp=False) // (2 if cross else 1)
    return {
        "num_layers": len(layers),
        "layer_class": type(layers[0]).__name__,
        "layer_params": max(layer_sizes),
        "num_heads": heads,
        "kv_hidden_size": attention * kv_heads // heads,
        "intermediate_size": intermediate,
        "gated_mlp": len(mlp_shaped) >= 3,
        "rms_norm": any(_rms_norm(module) for module in layers[0].modules()),
        "norm_scales_input": any(_t5_norm(module) for module in layers[0].modules()),
        "attention_inputs": max(reading - (attention == hidden), 1),  # a self-attention's q, k, v (o reads hidden)
        "mlp_inputs": max(_projections(layers[0], hidden, intermediate, into_mlp=True), 1),
        "attention_width": 0 if attention == hidden else attention,
    }


def tensor_plan_facts(model, layers, kv_heads: int) -> TensorPlanFacts | None:
    """What the model's tensor-parallel plan splits, counted on the meta-device model (None: no plan). Column-wise
    modules split weight and bias, row-wise ones their weight (the bias is added once, after the all-reduce)."""
    plan = getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        return None
    split = 0  # the plan's patterns name modules of every layer ("layers.*.self_attn.q_proj"): counted in one
    for pattern, style in plan.items():
        name = pattern.split("*.", 1)[-1] if "*" in pattern else None
        module = layers[0].get_submodule(name) if name and _has(layers[0], name) else None
        if module is None:
            continue
        split += sum(p.numel() for n, p in module.named_parameters() if "colwise" in style or n.endswith("weight"))
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    head_plan = getattr(type(model), "_tp_plan", None) or {}
    head_split = sum(p.numel() for p in head.parameters()) if head is not None and head_plan and not tied else 0
    return TensorPlanFacts(split, head_split, kv_heads)


def _has(module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _projections(layer, hidden: int, intermediate: int, into_mlp: bool) -> int:
    """Linear layers of `layer` that read a hidden-sized input and write the MLP's intermediate size (into_mlp),
    or anything else (the attention's q, k, v and output projections)."""
    shapes = [_in_out(module) for module in layer.modules() if not isinstance(module, nn.Embedding)]
    return sum(1 for shape in shapes if shape and shape[0] == hidden and (shape[1] == intermediate) == into_mlp)


def stage_facts(model) -> StageFacts | None:
    """The embeddings and the head of the decoder as the pipeline trainer cuts it, or None if it cannot."""
    family = family_of(model.config.model_type)
    if family is None:
        return None
    body = getattr(model, family.root)
    embeddings = sum(p.numel() for name in family.embeddings for p in getattr(body, name).parameters())
    head = [*getattr(body, family.norm).parameters(), *model.get_output_embeddings().parameters()]
    return StageFacts(embeddings, sum(p.numel() for p in head))


# ---------------------------------------------------------------- adapters


def adapter_facts(model, heads: list[str], spec: LoraSpec, layer) -> AdapterFacts:
    """The adapters PEFT would attach to the meta-device `model` (`heads`: the modules that train in full beside
    them), and what bitsandbytes would store in 4-bit; `layer` is one transformer layer (for the activations)."""
    adapted = _adapted_shapes(model, spec.target_modules, heads)
    prefix = next(name for name, module in model.named_modules() if module is layer) + "."
    in_layer = [shape for name, shape in adapted.items() if name.startswith(prefix)]
    cross = [shape for name, shape in adapted.items() if name.startswith(prefix) and _reads_encoder(name)]
    inputs = {name: shape[0] for name, shape in adapted.items() if name.startswith(prefix)}
    quantized = _quantized_sizes(model)
    return AdapterFacts(
        spec,
        lora_params=spec.r * sum(i + o for i, o in adapted.values()),
        magnitude_params=sum(o for _, o in adapted.values()),
        head_params=sum(p.numel() for name in heads for p in model.get_submodule(name).parameters()),
        quantized_params=sum(quantized),
        largest_quantized=max(quantized, default=0),
        layer_adapted=len(in_layer),
        layer_inputs=sum(i for i, _ in in_layer),
        cross_adapted=len(cross),
        cross_inputs=sum(i for i, _ in cross),
        layer_outputs=sum(o for _, o in in_layer),
        layer_read=_read_once(model, layer, inputs),
    )


def _read_once(model, layer, inputs: dict[str, int]) -> int:
    """The input features of the modules `inputs` names ({name: in features}, in `layer`) summed once per tensor
    they read, seen in a forward pass on the meta device up to `layer`; their plain sum where it cannot run."""
    read: dict[str, torch.Tensor] = {}

    def stop(*_) -> None:
        raise _LayerDone

    hooks = [
        model.get_submodule(name).register_forward_pre_hook(lambda _, args, n=name: read.setdefault(n, args[0]))
        for name in inputs
    ] + [layer.register_forward_hook(stop)]
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    more = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    attention = getattr(model.config, "_attn_implementation", None)
    try:
        model.set_attn_implementation("eager")  # SDPA's mask reads values (.item()), which meta tensors have not
        model(input_ids=ids, **more)
    except _LayerDone:
        pass
    except Exception:  # any model-specific failure on meta tensors: count a copy per adapter, the upper bound
        read.clear()
    finally:
        for hook in hooks:
            hook.remove()
        if attention is not None:
            with contextlib.suppress(Exception):  # (one that could not be set was never changed)
                model.set_attn_implementation(attention)
    if len(read) < len(inputs):
        return sum(inputs.values())
    firsts = {id(tensor): inputs[name] for name, tensor in reversed(read.items())}  # (all alive: held in `read`)
    return sum(firsts.values())


class _LayerDone(Exception):
    """Ends _read_once's forward pass once its layer has run."""


CROSS_ATTENTION = ("encdecattention", "encoder_attn", "crossattention", "cross_attn")  # T5's, BART's, others'


def _reads_encoder(name: str) -> bool:
    """Whether the module `name` is a cross-attention's k or v projection (T5's EncDecAttention.k, BART's
    encoder_attn.v_proj): its input is the encoder's output."""
    *path, last = name.lower().split(".")
    return any(marker in part for part in path for marker in CROSS_ATTENTION) and last[:1] in ("k", "v")


def _in_out(module) -> tuple[int, int] | None:
    """(input, output) features of a module LoRA can adapt, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):  # GPT-2's linear layers store the weight as (in, out)
        return tuple(module.weight.shape)
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return None


def _adapted_shapes(model, targets: tuple[str, ...], heads: list[str]) -> dict[str, tuple[int, int]]:
    """{name: (in, out)} of the modules that get adapters, by PEFT's rules: all-linear takes every Linear and
    Conv1D but the output head (the LM head or the classifier); else the modules whose name ends with a target."""
    outside_heads = {
        name: module
        for name, module in model.named_modules()
        if not any(name == h or name.startswith(h + ".") for h in heads)
    }
    if targets == ("all-linear",):
        output = model.get_output_embeddings()
        return {
            name: shape
            for name, module in outside_heads.items()
            if (shape := _in_out(module)) and not isinstance(module, nn.Embedding) and module is not output
        }
    matched = {
        name: module
        for name, module in outside_heads.items()
        if any(name == t or name.endswith("." + t) for t in targets)
    }
    unknown = [t for t in targets if not any(name == t or name.endswith("." + t) for name in matched)]
    unfit = sorted({name.rsplit(".", 1)[-1] for name, module in matched.items() if not _in_out(module)})
    if unknown or unfit:
        linear = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in outside_heads.items()
                if _in_out(module) and not isinstance(module, nn.Embedding)
            }
        )
        raise UserError(
            f"--lora_target_modules: {', '.join(unknown + unfit)} is not a linear layer of the model; its "
            f"linear layers are {', '.join(linear)} (or use all-linear)"
        )
    return {name: shape for name, module in matched.items() if (shape := _in_out(module))}  # all: none unfit


def _quantized_sizes(model) -> list[int]:
    """Weights of the layers transformers' bitsandbytes integration replaces with 4-bit ones: every Linear and
    Conv1D but the output head and tied weights (its own rule, applied to the meta-device model)."""
    keep = get_keys_to_not_convert(model)
    return [
        module.weight.numel()
        for name, module in model.named_modules()
        if (type(module) is nn.Linear or isinstance(module, Conv1D)) and should_convert_module(name, keep)
    ]
