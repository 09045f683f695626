"""The `plan` command: estimate per-GPU memory of a training run and pick the distributed strategy.

    python src/training_application.py plan --model_name_or_path DIR_OR_HUB_ID --num_gpus 8 \\
        --gpu_memory_gb 24 --per_device_train_batch_size 8 --max_length 512 --mixed_precision bf16
    python src/training_application.py plan --task causal_lm --model_config llama-600m \\
        --tokenizer_name_or_path TOKENIZER --num_gpus 8 --gpu_memory_gb 24 --max_length 2048 ...

It reads only the model's config (no weights) and counts parameters exactly by building the model on
the meta device: the sequence-classification model, or for --task causal_lm the causal LM with its
LM head (tied to the input embeddings or not), from a checkpoint (--model_name_or_path) or from a
config.json or shipped preset (--model_config; a preset takes the vocabulary size of
--tokenizer_name_or_path, as training does, else its config's). For 8 strategies (DDP; ZeRO-1, 2,
3; FSDP full shard; ZeRO-2 and ZeRO-3 with optimizer offload; ZeRO-3 with parameter offload too),
each with and without gradient checkpointing, it prints the memory per GPU and recommends the
fastest that fits, with the micro-batch and gradient accumulation that reach the global batch. It
writes the accelerate config (and DeepSpeed JSON) that `accelerate launch --config_file` takes
unchanged.

Units: bytes internally, GiB (2**30) on screen; --gpu_memory_gb is GiB (a "24 GB" card has 24 GiB).
Notation: P parameters, N = GPUs in total, p = bytes of a model weight inside the engine (2 under
fp16/bf16 with DeepSpeed or FSDP, else 4), c = bytes of an activation (2 under fp16/bf16, else 4).

Model states per GPU (parameters / gradients / optimizer states, AdamW):
- DDP: 4P / 4P / 8P (fp32 weights, fp32 gradients, two fp32 moments). Under fp16/bf16 autocast the
  gradients also count the 16-bit weight copies autocast keeps for the backward pass: 4P + 2P, the
  accounting of `accelerate estimate-memory`.
- ZeRO-1/2 (DeepSpeed): weights pP; gradients pP + 4P/N (ZeRO-1: full model-dtype gradients plus
  the fp32 gradient partition) or (p + 4)P/N (ZeRO-2); optimizer 12P/N (fp32 master partition,
  which ZeRO-1/2 clones even in fp32, and two moments). For p = 2 ZeRO-2 is 2P + 18P/N, as
  DeepSpeed's `estimate_zero2_model_states_mem_needs`.
- ZeRO-3: weights pP/N + pL, gradients 4P/N + pL, optimizer (4 if p == 2 else 0)P/N + 8P/N, with L
  the largest module's own parameters (DeepSpeed's `model_to_params`): 4L + 18P/N for p = 2, as
  `estimate_zero3_model_states_mem_needs`.
- Optimizer offload moves master weights, moments and fp32 gradients to CPU (16P/N per process);
  parameter offload also moves the weights (pP/N), leaving the gathered layer (2pL) on the GPU.
- FSDP full shard (FSDP2): 4P/N / 4P/N / 8P/N for the fp32 shards, plus the gathered weights in
  compute dtype: the root (everything outside the transformer layers) and two layers (the current
  one and the prefetched next), and one layer's unsharded gradients.

Activations per GPU, micro-batch b, sequence s, hidden h, key/value width h_kv, intermediate I,
H heads, l layers (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", generalised to the real intermediate size, gated MLPs, grouped KV heads and fused attention):
    per layer  A = s*b*[c*(7h + 2h_kv) + c*I*(k_act + 1 + 2g) + 2h*m_h] + s*b*H*s*e
      7h + 2h_kv: inputs of both norms, of the QKV and output projections and of the MLP, q, k, v,
                  and the attention output (a fused SDPA kernel stores no s*s matrix);
      I terms:    what the activation function saves (k_act, measured on the installed transformers:
                  1 for gelu/silu/relu, 4 for the python gelu_new), the down-projection input, and
                  for a gated MLP (g = 1) the up-projection output and the product;
      m_h:        1 when hidden dropout is on (one 1-byte mask per residual dropout, two per layer);
      e:          0 with SDPA/flash attention; with eager attention the softmax output (c), plus the
                  dropout mask and output (1 + c) when attention dropout is on.
    outside the layers  E = s*b*h*(2c + m_h)  (embedding output and its norm, final norm)
    backward working space W = c*s*b*(h + I)  (activation gradients of the layer being processed)
    without checkpointing: l*A + E + W
    with checkpointing (each layer recomputed in the backward pass): l*r*s*b*h + E + A + W, with r the
    bytes of the residual stream between layers (4 under DDP autocast, whose residual stays fp32).

Logits (causal_lm only; shown as their own column): with vocabulary V they dominate the activations of
a small or mid-sized model, and checkpointing does not shrink them. The loss upcasts the logits
(`logits.float()`, a copy) and takes log-softmax and cross-entropy in fp32. The forward pass holds
the logits, the copy and the log-softmax (c + 4 + 4 bytes per logit); the cross-entropy's backward holds
the log-softmax, its incoming gradient and the copy's gradient (4 + 4 + 4, measured on CPU in fp32 and
under bf16 autocast). So b*s*V*max(c + 8, 12): 12 bytes per logit in every precision.

Overhead per GPU: 1 GiB for the CUDA context, cuBLAS and NCCL workspaces; communication buffers
(DDP's gradient buckets, 4P; DeepSpeed's reduce buckets, 2 x h^2 elements, and ZeRO-3's prefetch
bucket, 0.9 h^2); and 5% of everything else for caching-allocator fragmentation. The total is a
conservative sum: with gradient accumulation, the gradients of earlier micro-batches are held while
the next one's activations are.

CPU memory per node: the larger of the offloaded states and loading the weights (each process
materialises the fp32 model before placing it; ZeRO-3 initialises layer by layer, FSDP on rank 0).

Ranking, fastest first, by a rule-of-thumb relative step time: DDP 1.00, ZeRO-1 1.02, ZeRO-2 1.05,
FSDP 1.12, ZeRO-3 1.15, ZeRO-2 + optimizer offload 1.6, ZeRO-3 + optimizer offload 1.8, ZeRO-3 +
parameter offload 2.5; gradient checkpointing multiplies by 1.33 (one more forward pass). The
requested micro-batch is kept if any strategy fits it; otherwise the fastest strategy that fits a
smaller one gets the largest it fits, with more accumulation so the global batch stays the same.
Micro-batches always divide the examples each GPU takes per optimizer step, so the global batch is
exact.

Not supported: tensor/pipeline parallelism, LoRA or frozen layers, quantised models, mixture-of-
experts routing, sequence packing, NVMe offload; the estimate is for GPUs (on CPU, attention with
dropout falls back to a kernel that stores the s*s matrix).
"""

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from cloudtrain.config import PRECISIONS, TASKS, ModelConfig
from cloudtrain.errors import UserError, first_line

LM_TASKS = ("causal_lm", "sft")  # decoders with an LM head: the same memory, logits included

GIB = 2 ** 30
CUDA_CONTEXT_BYTES = GIB
FRAGMENTATION = 0.05
CHECKPOINTING_COST = 1.33
MAX_MICRO_BATCH = 1 << 16
TRAINING_APPLICATION = "src/training_application.py"


# ---------------------------------------------------------------- what is planned

@dataclass(frozen=True)
class Strategy:
    key: str
    label: str
    speed: float  # relative step time without checkpointing (rule of thumb)
    zero_stage: int | None = None  # None: not DeepSpeed
    fsdp: bool = False
    offload_optimizer: bool = False
    offload_param: bool = False


STRATEGIES = (
    Strategy("ddp", "DDP", 1.00),
    Strategy("zero1", "ZeRO-1", 1.02, zero_stage=1),
    Strategy("zero2", "ZeRO-2", 1.05, zero_stage=2),
    Strategy("fsdp", "FSDP full shard", 1.12, fsdp=True),
    Strategy("zero3", "ZeRO-3", 1.15, zero_stage=3),
    Strategy("zero2_offload", "ZeRO-2 + optimizer offload", 1.6, zero_stage=2, offload_optimizer=True),
    Strategy("zero3_offload", "ZeRO-3 + optimizer offload", 1.8, zero_stage=3, offload_optimizer=True),
    Strategy("zero3_offload_all", "ZeRO-3 + optimizer & parameter offload", 2.5, zero_stage=3,
             offload_optimizer=True, offload_param=True),
)


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    checkpointing: bool

    @property
    def speed(self) -> float:
        return self.strategy.speed * (CHECKPOINTING_COST if self.checkpointing else 1.0)

    @property
    def name(self) -> str:
        return self.strategy.label + (" + checkpointing" if self.checkpointing else "")


def candidates() -> list[Candidate]:
    """Every strategy with and without gradient checkpointing, fastest first."""
    return sorted((Candidate(s, gc) for s in STRATEGIES for gc in (False, True)), key=lambda c: c.speed)


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
    activation_saved: float  # tensors of the intermediate size the activation function saves
    hidden_dropout: bool
    attention_dropout: bool
    attn_implementation: str
    task: str = "classification"
    vocab_size: int = 0  # the width of the logits (causal_lm); 0: a classification head, no logits term
    from_config: bool = False  # name is a --model_config (config.json or preset), not a checkpoint
    tokenizer: str | None = None  # --tokenizer_name_or_path, passed on to the launch command


@dataclass(frozen=True)
class Setup:
    num_gpus: int  # per node
    num_nodes: int
    gpu_memory_bytes: int
    cpu_memory_bytes: int | None  # per node; None: not checked
    max_length: int
    mixed_precision: str

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def half(self) -> bool:
        return self.mixed_precision != "no"


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU (and per node for CPU) of one candidate at one micro-batch."""
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int  # the layers' (and embeddings') activations and the backward working space
    overhead: int
    cpu_offloaded: int  # per node
    cpu_load: int  # per node
    logits: int = 0  # causal_lm: the logits and the loss's fp32 buffers

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations + self.logits
                + self.overhead)

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def cpu_per_node(self) -> int:
        return max(self.cpu_offloaded, self.cpu_load)


# ---------------------------------------------------------------- reading the model

def _config_value(config, names: tuple[str, ...], default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _activation_saved(act_name) -> float:
    """How many input-sized fp32 tensors the activation function keeps for backward, measured."""
    import torch
    from transformers.activations import ACT2FN

    if not isinstance(act_name, str) or act_name not in ACT2FN:
        return 1.0  # an unknown or fused activation: assume it saves its input only
    x = torch.zeros(64, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ACT2FN[act_name](x * 1.0)
    return sum(saved.values()) / x.untyped_storage().nbytes()


def _load_config(name: str, num_labels: int, trust_remote_code: bool, task: str = "classification",
                 from_config: bool = False, tokenizer: str | None = None):
    """The model's config as training builds it: with num_labels for classification; for causal_lm from a
    checkpoint or a --model_config, a preset taking its vocabulary from the tokenizer when one is given."""
    from transformers import AutoConfig

    model = ModelConfig(model_name_or_path=None if from_config else name, model_config=name if from_config else None,
                        tokenizer_name_or_path=tokenizer, trust_remote_code=trust_remote_code)
    path = _config_path(model)
    options = {"num_labels": num_labels} if task == "classification" else {}
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **options)
    except (OSError, ValueError) as err:
        raise UserError(f"could not read a model config from {path}: {first_line(err)}") from None
    if task in LM_TASKS:
        _check_causal_lm(config, name)
    if from_config and tokenizer:
        _fit_vocabulary(config, model)
    return config


def _config_path(model: ModelConfig) -> str:
    """Where the config is: the --model_config file (a path or preset), else the model's directory or Hub id."""
    if model.model_config:
        from cloudtrain.tasks.causal_lm import model_config_file

        return str(model_config_file(model.model_config))
    from cloudtrain.model_loading import resolve_model_path

    return resolve_model_path(model)


def _check_causal_lm(config, name: str) -> None:
    from cloudtrain.model_loading import is_causal_lm

    if not is_causal_lm(config):
        kind = ", ".join(config.architectures or [config.model_type])
        raise UserError(f"{name} is not a causal language model ({kind}); --task causal_lm and sft plan for one that "
                        "AutoModelForCausalLM builds")


def _fit_vocabulary(config, model: ModelConfig) -> None:
    """What training does to a --model_config: a preset takes the tokenizer's vocabulary size."""
    from cloudtrain.model_loading import load_tokenizer
    from cloudtrain.tasks.causal_lm import CausalLMTask

    CausalLMTask._fit_config(config, load_tokenizer(model), model.model_config)


def _meta_model(config, trust_remote_code: bool, task: str = "classification"):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto, kind = ((AutoModelForCausalLM, "causal-LM") if task in LM_TASKS
                  else (AutoModelForSequenceClassification, "sequence-classification"))
    try:
        with torch.device("meta"):  # shapes only: a 7B model builds in a fraction of a second
            return auto.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{type(config).__name__} has no {kind} model in transformers: {first_line(err)}") from None


def _vocab_size(model, task: str) -> int:
    """The width of the logits: the LM head's output features (tied to the input embeddings or not)."""
    head = model.get_output_embeddings() if task in LM_TASKS else None
    return 0 if head is None else head.weight.shape[0]


def _layer_stack(model):
    """The transformer layers: the ModuleList holding the most parameters."""
    from torch import nn

    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not stacks:
        raise UserError(f"{type(model).__name__} has no stack of layers to plan for")
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))


def model_facts(name: str, num_labels: int = 2, trust_remote_code: bool = False, task: str = "classification",
                from_config: bool = False, tokenizer: str | None = None) -> ModelFacts:
    """Read a model's config and count its parameters exactly on the meta device; loads no weights.
    task "causal_lm" builds the causal LM (LM head included); from_config: name is a --model_config."""
    config = _load_config(name, num_labels, trust_remote_code, task, from_config, tokenizer)
    model = _meta_model(config, trust_remote_code, task)
    text = config.get_text_config()
    hidden, heads = _config_value(text, ("hidden_size",)), _config_value(text, ("num_attention_heads",))
    if not hidden or not heads:
        raise UserError(f"the config of {name} has no hidden_size/num_attention_heads; cannot estimate activations")
    layers = _layer_stack(model)
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    num_params = sum(p.numel() for p in model.parameters())
    intermediate = _config_value(text, ("intermediate_size", "n_inner", "ffn_dim", "d_ff"), 4 * hidden)
    mlp_shaped = [p for p in layers[0].parameters() if p.ndim == 2 and set(p.shape) == {hidden, intermediate}]
    kv_heads = _config_value(text, ("num_key_value_heads",), heads)
    return ModelFacts(
        name=name, architecture=type(model).__name__, num_params=num_params, num_layers=len(layers),
        layer_class=type(layers[0]).__name__, layer_params=max(layer_sizes),
        root_params=num_params - sum(layer_sizes),
        largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        hidden_size=hidden, num_heads=heads, kv_hidden_size=hidden * kv_heads // heads,
        intermediate_size=intermediate, gated_mlp=len(mlp_shaped) >= 3,
        activation_saved=_activation_saved(_config_value(text, ("hidden_act", "activation_function",
                                                                "hidden_activation"))),
        hidden_dropout=float(_config_value(text, ("hidden_dropout_prob", "resid_pdrop", "hidden_dropout",
                                                  "dropout"), 0.0)) > 0,
        attention_dropout=float(_config_value(text, ("attention_probs_dropout_prob", "attn_pdrop",
                                                     "attention_dropout"), 0.0)) > 0,
        attn_implementation=str(getattr(model.config, "_attn_implementation", None) or "eager"),
        task=task, vocab_size=_vocab_size(model, task), from_config=from_config, tokenizer=tokenizer)


# ---------------------------------------------------------------- the estimate

def model_state_bytes(m: ModelFacts, strategy: Strategy, setup: Setup) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) per GPU; see the module docstring for the formulas."""
    P, n = m.num_params, setup.world_size
    if strategy.fsdp:
        c = 2 if setup.half else 4
        gathered = c * (m.root_params + 2 * m.layer_params)
        return 4 * P // n + gathered, 4 * P // n + c * m.layer_params, 8 * P // n
    if strategy.zero_stage is None:  # DDP
        return 4 * P, 4 * P + (2 * P if setup.half else 0), 8 * P
    p = 2 if setup.half else 4
    off_opt, stage, L = strategy.offload_optimizer, strategy.zero_stage, m.largest_module_params
    optimizer = 0 if off_opt else 8 * P // n + (4 * P // n if stage < 3 or setup.half else 0)
    if stage == 1:
        return p * P, p * P + 4 * P // n, optimizer
    if stage == 2:
        return p * P, 0 if off_opt else (p + 4) * P // n, optimizer
    params = p * L + (0 if strategy.offload_param else p * P // n)
    return params, p * L + (0 if off_opt else 4 * P // n), optimizer


def activation_bytes(m: ModelFacts, micro_batch: int, seq: int, half: bool, checkpointing: bool,
                     residual_bytes: int) -> tuple[int, int]:
    """(saved for backward at the end of the forward pass, backward working space) per GPU."""
    c, h, I, sb = (2 if half else 4), m.hidden_size, m.intermediate_size, seq * micro_batch
    mask = 1 if m.hidden_dropout else 0
    eager = 0 if m.attn_implementation in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention") \
        else c + (1 + c if m.attention_dropout else 0)
    per_layer = sb * (c * (7 * h + 2 * m.kv_hidden_size) + c * I * (m.activation_saved + 1 + 2 * m.gated_mlp)
                      + 2 * h * mask + m.num_heads * seq * eager)
    outside = sb * h * (2 * c + mask)
    working = c * sb * (h + I)
    if checkpointing:
        return round(m.num_layers * residual_bytes * sb * h + outside), round(per_layer + working)
    return round(m.num_layers * per_layer + outside), round(working)


def logits_bytes(m: ModelFacts, micro_batch: int, seq: int, half: bool) -> int:
    """The logits and the loss's fp32 buffers per GPU (0 without an LM head): per logit, the forward holds
    the logits (c bytes), their fp32 copy and the log-softmax (4 + 4); the cross-entropy's backward holds
    the log-softmax, its gradient and the copy's gradient (3 x 4). Checkpointing does not shrink them."""
    c = 2 if half else 4
    return micro_batch * seq * m.vocab_size * max(c + 4 + 4, 3 * 4)


def overhead_bytes(m: ModelFacts, strategy: Strategy, setup: Setup, rest: int) -> int:
    """CUDA context, communication buffers and allocator fragmentation."""
    p = 2 if setup.half else 4
    if strategy.fsdp:
        buffers = 0  # FSDP's gathered weights are counted with the parameters
    elif strategy.zero_stage is None:
        buffers = 4 * m.num_params if setup.world_size > 1 else 0  # DDP gradient buckets (fp32)
    else:
        buffers = p * m.hidden_size ** 2 * (2 + (0.9 if strategy.zero_stage == 3 else 0))
    return round(CUDA_CONTEXT_BYTES + buffers + FRAGMENTATION * rest)


def cpu_bytes(m: ModelFacts, strategy: Strategy, setup: Setup) -> tuple[int, int]:
    """(offloaded states, loading the weights) per node."""
    P, per_node = m.num_params, setup.num_gpus / setup.world_size
    p = 2 if setup.half else 4
    offloaded = (16 * P if strategy.offload_optimizer else 0) + (p * P if strategy.offload_param else 0)
    if strategy.zero_stage == 3:
        load = 4 * m.largest_module_params * setup.num_gpus  # zero.Init partitions layer by layer
    elif strategy.fsdp:
        load = 4 * P  # cpu_ram_efficient_loading: only rank 0 reads the weights
    else:
        load = 4 * P * setup.num_gpus
    return round(offloaded * per_node), load


def estimate(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Estimate:
    """Memory per GPU of one candidate at one micro-batch."""
    s = cand.strategy
    params, grads, optim = model_state_bytes(m, s, setup)
    residual = 4 if (s.zero_stage is None and not s.fsdp) or not setup.half else 2
    saved, working = activation_bytes(m, micro_batch, setup.max_length, setup.half, cand.checkpointing, residual)
    activations = saved + working
    logits = logits_bytes(m, micro_batch, setup.max_length, setup.half)
    overhead = overhead_bytes(m, s, setup, params + grads + optim + activations + logits)
    offloaded, load = cpu_bytes(m, s, setup)
    return Estimate(params, grads, optim, activations, overhead, offloaded, load, logits)


def fits(est: Estimate, setup: Setup) -> bool:
    cpu_ok = setup.cpu_memory_bytes is None or est.cpu_per_node <= setup.cpu_memory_bytes
    return est.total <= setup.gpu_memory_bytes and cpu_ok


def max_micro_batch(m: ModelFacts, cand: Candidate, setup: Setup) -> int:
    """The largest micro-batch that fits (0 if none); memory grows monotonically with it."""
    if not fits(estimate(m, cand, setup, 1), setup):
        return 0
    lo, hi = 1, MAX_MICRO_BATCH
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(estimate(m, cand, setup, mid), setup) else (lo, mid - 1)
    return lo


# ---------------------------------------------------------------- the plan

@dataclass
class Row:
    candidate: Candidate
    estimate: Estimate  # at the requested micro-batch
    fits: bool  # at the requested micro-batch
    max_micro_batch: int


@dataclass
class Choice:
    candidate: Candidate
    micro_batch: int
    accumulation: int
    estimate: Estimate


def micro_batch_options(requested: int, per_gpu_per_step: int) -> list[int]:
    """Micro-batches that divide the examples each GPU sees per optimizer step, largest first."""
    return [b for b in range(min(requested, per_gpu_per_step), 0, -1) if per_gpu_per_step % b == 0]


def choose(m: ModelFacts, rows: list[Row], setup: Setup, requested: int, global_batch: int) -> Choice | None:
    """The fastest candidate at the requested micro-batch if any fits it; else the fastest that fits a
    smaller one, at the largest micro-batch it fits."""
    per_gpu = global_batch // setup.world_size
    options = micro_batch_options(requested, per_gpu)
    for allowed in (options[:1], options):
        for row in rows:  # fastest first
            fitting = [b for b in allowed if b <= row.max_micro_batch]
            if fitting:
                return Choice(row.candidate, fitting[0], per_gpu // fitting[0],
                              estimate(m, row.candidate, setup, fitting[0]))
    return None


def _fits_anything(m: ModelFacts, setup: Setup) -> bool:
    return any(fits(estimate(m, c, setup, 1), setup) for c in candidates())


def suggestions(m: ModelFacts, setup: Setup) -> list[str]:
    """What would make the smallest configuration (micro-batch 1) fit."""
    smallest = min((estimate(m, c, setup, 1) for c in candidates()), key=lambda e: e.total)
    ideas = [f"GPUs with at least {math.ceil(smallest.total / GIB)} GiB (the leanest option needs "
             f"{smallest.total / GIB:.1f} GiB per GPU at micro-batch 1)"]
    for nodes in range(setup.num_nodes + 1, setup.num_nodes * 64 + 1):
        if _fits_anything(m, replace(setup, num_nodes=nodes)):
            ideas.append(f"{nodes * setup.num_gpus} GPUs: --num_nodes {nodes} with {setup.num_gpus} GPUs each")
            break
    lengths = [s for s in (2 ** k for k in range(20)) if 2 <= s < setup.max_length]
    shorter = [s for s in lengths if _fits_anything(m, replace(setup, max_length=s))]
    if shorter:
        ideas.append(f"a shorter sequence: --max_length {max(shorter)}")
    if not setup.half and _fits_anything(m, replace(setup, mixed_precision="bf16")):
        ideas.append("--mixed_precision bf16 (halves the activations and, with DeepSpeed, the weights)")
    if setup.cpu_memory_bytes is not None and _fits_anything(m, replace(setup, cpu_memory_bytes=None)):
        ideas.append("more CPU memory per node for offloading (see the CPU/node column)")
    return ideas


def _reasons(m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup, requested: int,
             global_batch: int) -> list[str]:
    """A few lines on why this candidate, this micro-batch and this accumulation."""
    c, gib, b = choice.candidate, setup.gpu_memory_bytes / GIB, choice.micro_batch
    faster = [r.candidate for r in rows if r.candidate.speed < c.speed]
    reasons = []
    if faster:  # over budget at the requested micro-batch, or (when it fits nothing) even at 1
        at = b if b == micro_batch_options(requested, global_batch // setup.world_size)[0] else 1
        shown = ", ".join(f"{f.name} {estimate(m, f, setup, at).total / GIB:.1f}" for f in faster[:4])
        reasons.append(f"Faster options need more than {gib:g} GiB per GPU at micro-batch {at}: {shown} GiB"
                       + (" (and more)" if len(faster) > 4 else "") + ".")
    e = choice.estimate
    logits = f", logits {e.logits / GIB:.1f}" if e.logits else ""
    reasons.append(f"{c.name} needs {e.total / GIB:.1f} of {gib:g} GiB per GPU at micro-batch {b} (model states "
                   f"{e.model_states / GIB:.1f}, activations {e.activations / GIB:.1f}{logits} GiB); the largest "
                   f"micro-batch it fits is {next(r.max_micro_batch for r in rows if r.candidate == c)}.")
    reasons += _micro_batch_reason(requested, b, global_batch // setup.world_size)
    reasons.append(f"{b} per GPU x {setup.world_size} GPUs x {choice.accumulation} accumulation step(s) = "
                   f"global batch {global_batch}.")
    if c.checkpointing:
        plain = estimate(m, Candidate(c.strategy, False), setup, b)
        reasons.append(f"Gradient checkpointing recomputes each layer in the backward pass (about a third more "
                       f"compute); without it activations need {plain.activations / GIB:.1f} GiB.")
    if c.strategy.offload_optimizer:
        reasons.append(f"Offloading needs {e.cpu_per_node / GIB:.1f} GiB of CPU memory per node and runs the AdamW "
                       "step on the CPU.")
    return reasons


def _micro_batch_reason(requested: int, chosen: int, per_gpu: int) -> list[str]:
    largest = micro_batch_options(requested, per_gpu)[0]
    if chosen < largest:
        return [f"Micro-batch {largest} fits no strategy; {chosen} is the largest the fastest remaining one fits, "
                "so gradient accumulation makes up the global batch."]
    if largest < requested:
        return [f"Micro-batch {chosen} is the largest up to {requested} that divides the {per_gpu} examples each "
                "GPU takes per optimizer step."]
    return []


# ---------------------------------------------------------------- emitted configs

def deepspeed_config(strategy: Strategy) -> dict:
    """The application's own ZeRO config (batch sizes, accumulation, clipping and precision "auto", so
    they always come from its flags), with reduce buckets sized from the hidden size as estimated."""
    from cloudtrain.distributed import zero_config

    offload = {True: "cpu", False: "none"}
    config = zero_config(strategy.zero_stage, offload[strategy.offload_optimizer], offload[strategy.offload_param])
    config["zero_optimization"]["reduce_bucket_size"] = "auto"  # hidden_size**2 (DeepSpeed's default: 5e8)
    return config


def accelerate_config(m: ModelFacts, cand: Candidate, setup: Setup, ds_path: Path | None) -> dict:
    """The accelerate config file (YAML) for `accelerate launch --config_file`."""
    s = cand.strategy
    config = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
              "main_training_function": "main", "mixed_precision": setup.mixed_precision,
              "num_machines": setup.num_nodes, "num_processes": setup.world_size, "rdzv_backend": "static",
              "same_network": True, "use_cpu": False}
    if s.zero_stage is not None:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": str(ds_path.resolve()),
                                      "zero3_init_flag": s.zero_stage == 3}
        if setup.num_nodes > 1:
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    elif s.fsdp:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": m.layer_class, "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": False, "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_checkpointing": cand.checkpointing}
    else:
        config["distributed_type"] = "MULTI_GPU" if setup.world_size > 1 else "NO"
    return config


def launch_command(m: ModelFacts, choice: Choice, setup: Setup, yaml_path: Path) -> str:
    args = ["accelerate", "launch", "--config_file", str(yaml_path)]
    if setup.num_nodes > 1:
        args += ["--machine_rank", "<this node's rank>", "--main_process_ip", "<node 0 address>",
                 "--main_process_port", "29500"]
    args += [TRAINING_APPLICATION, "--training_type", "accelerated"] + _model_args(m) + [
             "--per_device_train_batch_size", str(choice.micro_batch),
             "--gradient_accumulation_steps", str(choice.accumulation),
             "--mixed_precision", setup.mixed_precision, "--max_length", str(setup.max_length)]
    if choice.candidate.checkpointing and not choice.candidate.strategy.fsdp:  # FSDP does it in the YAML
        args += ["--gradient_checkpointing", "true"]
    return " ".join(a if " " not in a else f"'{a}'" for a in args)


def _model_args(m: ModelFacts) -> list[str]:
    """The launch command's task and model flags."""
    if m.task not in LM_TASKS:
        return ["--model_name_or_path", m.name]
    args = ["--task", m.task, "--model_config" if m.from_config else "--model_name_or_path", m.name]
    if m.from_config or m.tokenizer:
        args += ["--tokenizer_name_or_path", m.tokenizer or "<tokenizer dir or Hub id>"]
    return args


def write_configs(m: ModelFacts, choice: Choice, setup: Setup, output_dir: Path) -> dict[str, str]:
    """Write the accelerate YAML (and the DeepSpeed JSON it points to); returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    ds_path = None
    if choice.candidate.strategy.zero_stage is not None:
        ds_path = output_dir / "ds_config.json"
        ds_path.write_text(json.dumps(deepspeed_config(choice.candidate.strategy), indent=2) + "\n")
        files["deepspeed_config"] = str(ds_path)
    yaml_path = output_dir / "accelerate_config.yaml"
    yaml_path.write_text(yaml.safe_dump(accelerate_config(m, choice.candidate, setup, ds_path), sort_keys=False))
    files["accelerate_config"] = str(yaml_path)
    return files


# ---------------------------------------------------------------- the command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="classification",
                        help="What will be trained: classification, causal_lm or sft (the same memory as causal_lm; "
                             "default: classification).")
    parser.add_argument("--model_name_or_path", default=None,
                        help="A model directory or Hub id; only its config is read (default: all-MiniLM-L6-v2).")
    parser.add_argument("--model_config", default=None,
                        help="--task causal_lm from scratch: a config.json or a shipped preset (llama-8m, llama-600m).")
    parser.add_argument("--tokenizer_name_or_path", default=None,
                        help="The tokenizer training will use; a preset takes its vocabulary size from it "
                             "(default: the config's vocab_size).")
    parser.add_argument("--num_labels", type=int, default=2, help="Classes of the classification head (default: 2).")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow the model's own config/model code.")
    parser.add_argument("--num_gpus", type=int, default=1, help="GPUs per node (default: 1).")
    parser.add_argument("--num_nodes", type=int, default=1, help="Nodes (default: 1).")
    parser.add_argument("--gpu_memory_gb", type=float, required=True, help="Memory of one GPU in GiB, e.g. 24 or 80.")
    parser.add_argument("--cpu_memory_gb", type=float, default=None,
                        help="CPU memory per node in GiB; offload plans needing more do not fit (default: unchecked).")
    parser.add_argument("--per_device_train_batch_size", type=int, default=16,
                        help="Requested micro-batch per GPU (default: 16, as the training application).")
    parser.add_argument("--max_length", type=int, default=128, help="Sequence length in tokens (default: 128).")
    parser.add_argument("--mixed_precision", choices=PRECISIONS, default="no",
                        help="no, fp16 or bf16 (default: no; the training application's auto "
                             "trains in bf16 on GPUs from Ampere on).")
    parser.add_argument("--global_batch_size", type=int, default=None,
                        help="Examples per optimizer step over all GPUs (default: micro-batch x GPUs).")
    parser.add_argument("--strategy", choices=["auto"] + [s.key for s in STRATEGIES], default="auto",
                        help="Emit the configs for this strategy instead of the fastest that fits (default: auto).")
    parser.add_argument("--gradient_checkpointing", choices=["auto", "true", "false"], default="auto",
                        help="Only consider plans with (true) or without (false) checkpointing (default: auto).")
    parser.add_argument("--output_dir", default="plan", help="Where the configs are written (default: ./plan).")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON instead of a table.")


def _check(args: argparse.Namespace) -> None:
    world = args.num_gpus * args.num_nodes
    checks = [
        (args.num_gpus < 1, "--num_gpus must be at least 1"),
        (args.num_nodes < 1, "--num_nodes must be at least 1"),
        (args.gpu_memory_gb <= 0, "--gpu_memory_gb must be positive, e.g. 24"),
        (args.cpu_memory_gb is not None and args.cpu_memory_gb <= 0, "--cpu_memory_gb must be positive"),
        (args.num_labels < 1, "--num_labels must be at least 1"),
        (args.model_config and args.task not in LM_TASKS, "--model_config is for --task causal_lm or sft"),
        (args.model_config and args.model_name_or_path,
         "--model_config builds a model from scratch and --model_name_or_path loads one; give one of them"),
        (args.task in LM_TASKS and not (args.model_config or args.model_name_or_path),
         f"--task {args.task} needs --model_name_or_path <causal LM> or --model_config <config.json or preset>"),
        (args.per_device_train_batch_size < 1, "--per_device_train_batch_size must be at least 1"),
        (args.max_length < 2, "--max_length must be at least 2"),
        (args.global_batch_size is not None and args.global_batch_size % world != 0,
         f"--global_batch_size {args.global_batch_size} must be a positive multiple of the {world} GPUs"),
        (args.global_batch_size is not None and args.global_batch_size < world,
         f"--global_batch_size must be at least the number of GPUs ({world})"),
    ]
    for failed, message in checks:
        if failed:
            raise UserError(message)


def make_plan(args: argparse.Namespace) -> dict:
    """Estimate every candidate, choose one, write its configs; returns the machine-readable plan."""
    _check(args)
    from cloudtrain.assets import default_model_dir

    m = model_facts(args.model_config or args.model_name_or_path or default_model_dir(), args.num_labels,
                    args.trust_remote_code, args.task, bool(args.model_config), args.tokenizer_name_or_path)
    setup = Setup(args.num_gpus, args.num_nodes, round(args.gpu_memory_gb * GIB),
                  None if args.cpu_memory_gb is None else round(args.cpu_memory_gb * GIB),
                  args.max_length, args.mixed_precision)
    global_batch = args.global_batch_size or args.per_device_train_batch_size * setup.world_size
    requested = min(args.per_device_train_batch_size, global_batch // setup.world_size)
    rows = [_row(m, c, setup, requested) for c in candidates()]
    allowed = [r for r in rows if (args.strategy in ("auto", r.candidate.strategy.key))
               and args.gradient_checkpointing in ("auto", str(r.candidate.checkpointing).lower())]
    choice = choose(m, allowed, setup, requested, global_batch)
    plan = {"model": asdict(m), "setup": {**asdict(setup), "world_size": setup.world_size},
            "requested_micro_batch": requested, "global_batch_size": global_batch,
            "assumptions": {"cuda_context_bytes": CUDA_CONTEXT_BYTES, "fragmentation": FRAGMENTATION,
                            "checkpointing_cost": CHECKPOINTING_COST, "optimizer": "AdamW"},
            "strategies": [_row_json(r) for r in rows], "recommendation": None, "suggestions": [],
            "notes": _notes(m)}
    if choice is None:
        forced = args.strategy != "auto" or args.gradient_checkpointing != "auto"
        plan["message"] = ("The requested strategy does not fit (see the table); drop --strategy/--gradient_"
                           "checkpointing to let the planner choose." if forced and any(r.max_micro_batch for r in rows)
                           else "Nothing fits, not even micro-batch 1 with full offload and checkpointing.")
        plan["suggestions"] = suggestions(m, setup)
        return plan
    files = write_configs(m, choice, setup, Path(args.output_dir))
    plan["recommendation"] = _recommendation_json(choice, global_batch, files,
                                                  _reasons(m, allowed, choice, setup, requested, global_batch),
                                                  launch_command(m, choice, setup, Path(files["accelerate_config"])))
    return plan


def _notes(m: ModelFacts) -> list[str]:
    if m.from_config and not m.tokenizer:
        return [f"vocab {m.vocab_size} is the config's; training gives a preset the tokenizer's vocabulary: pass "
                "--tokenizer_name_or_path for the exact logits"]
    return []


def _recommendation_json(choice: Choice, global_batch: int, files: dict, reasons: list[str], command: str) -> dict:
    c = choice.candidate
    return {"strategy": c.strategy.key, "label": c.name, "gradient_checkpointing": c.checkpointing,
            "micro_batch": choice.micro_batch, "gradient_accumulation_steps": choice.accumulation,
            "global_batch_size": global_batch, "estimate": _estimate_json(choice.estimate), "reasons": reasons,
            "files": files, "command": command}


def _row(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Row:
    est = estimate(m, cand, setup, micro_batch)
    return Row(cand, est, fits(est, setup), max_micro_batch(m, cand, setup))


def _estimate_json(est: Estimate) -> dict:
    return {**asdict(est), "total": est.total, "cpu_per_node": est.cpu_per_node}


def _row_json(row: Row) -> dict:
    c = row.candidate
    return {"strategy": c.strategy.key, "label": c.name, "gradient_checkpointing": c.checkpointing,
            "relative_step_time": round(c.speed, 3), "estimate": _estimate_json(row.estimate),
            "fits": row.fits, "max_micro_batch": row.max_micro_batch}


def _size(n: int) -> str:
    if n >= 10 * GIB:
        return f"{n / GIB:.1f}G"
    if n >= GIB:
        return f"{n / GIB:.2f}G"
    return f"{n / 2 ** 20:.0f}M"


def render(plan: dict) -> str:
    """The human-readable plan: model, setup, the table of all candidates, the recommendation."""
    m, s = plan["model"], plan["setup"]
    lm = m["task"] in LM_TASKS
    vocab = f", vocab {m['vocab_size']}" if lm else ""
    lines = [f"model: {m['architecture']} ({m['name']}), {m['num_params'] / 1e6:,.1f}M parameters, "
             f"{m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, intermediate "
             f"{m['intermediate_size']}{' (gated)' if m['gated_mlp'] else ''}"
             f"{vocab}, {m['attn_implementation']} attention",
             f"setup: {s['num_nodes']} node(s) x {s['num_gpus']} GPU(s) x {s['gpu_memory_bytes'] / GIB:g} GiB, "
             f"max_length {s['max_length']}, mixed precision {s['mixed_precision']}, micro-batch "
             f"{plan['requested_micro_batch']}, global batch {plan['global_batch_size']}",
             f"memory per GPU at micro-batch {plan['requested_micro_batch']}; time: relative step time, fastest "
             "first; overhd: 1 GiB CUDA context + communication buffers + 5% fragmentation; max mb: the largest "
             "micro-batch that fits"]
    if lm:
        lines.append("logits: micro-batch x max_length x vocab x 12 bytes (the logits with their fp32 copy and "
                     "the cross-entropy's fp32 buffers), whatever the strategy or checkpointing")
    lines += [f"note: {note}" for note in plan.get("notes", [])]
    return "\n".join(lines + [""] + _render_table(plan["strategies"], lm) + [""] + _render_choice(plan))


COLUMNS = ("strategy", "time", "params", "grads", "optim", "activ", "logits", "overhd", "GPU total", "CPU/node",
           "max mb", "fits")


def _render_table(rows: list[dict], logits: bool) -> list[str]:
    """The table of candidates; the logits column only for a language model."""
    shown = [i for i, name in enumerate(COLUMNS) if logits or name != "logits"]
    table = [[row[i] for i in shown] for row in [COLUMNS] + [_table_row(r) for r in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(shown))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                      enumerate(zip(row, widths))).rstrip() for row in table]


def _table_row(r: dict) -> tuple:
    e = r["estimate"]
    return (r["label"], f"{r['relative_step_time']:.2f}", _size(e["parameters"]), _size(e["gradients"]),
            _size(e["optimizer_states"]), _size(e["activations"]), _size(e["logits"]), _size(e["overhead"]),
            _size(e["total"]), _size(e["cpu_per_node"]), str(r["max_micro_batch"]), "yes" if r["fits"] else "no")


def _render_choice(plan: dict) -> list[str]:
    rec = plan["recommendation"]
    if rec is None:
        return [plan["message"], "What would fit:"] + [f"  - {idea}" for idea in plan["suggestions"]]
    lines = [f"Recommended: {rec['label']}, micro-batch {rec['micro_batch']}, gradient accumulation "
             f"{rec['gradient_accumulation_steps']}."] + [f"  {reason}" for reason in rec["reasons"]]
    lines += ["Wrote " + ", ".join(rec["files"].values()) + ". Launch with:", f"  {rec['command']}"]
    return lines


def run(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
