"""The `plan` command: estimate per-GPU memory of a training run and pick the distributed strategy.

    python src/training_application.py plan --model_name_or_path DIR_OR_HUB_ID --num_gpus 8 \\
        --gpu_memory_gb 24 --per_device_train_batch_size 8 --max_length 512 --mixed_precision bf16
    python src/training_application.py plan --task causal_lm --model_config llama-600m \\
        --tokenizer_name_or_path TOKENIZER --num_gpus 8 --gpu_memory_gb 24 --max_length 2048 ...
    python src/training_application.py plan --task sft --model_name_or_path meta-llama/Llama-3.1-8B \\
        --gpu_memory_gb 24 --cpu_memory_gb 64 --mixed_precision bf16 --lora_r 16 ...   # may pick QLoRA

It reads only the model's config (no weights) and counts parameters exactly by building the model on
the meta device: the sequence-classification model, or for --task causal_lm the causal LM with its
LM head (tied to the input embeddings or not), from a checkpoint (--model_name_or_path) or from a
config.json or shipped preset (--model_config; a preset takes the vocabulary size of
--tokenizer_name_or_path, as training does, else its config's). For 8 strategies (DDP; ZeRO-1, 2,
3; FSDP full shard; ZeRO-2 and ZeRO-3 with optimizer offload; ZeRO-3 with parameter offload too),
each with and without gradient checkpointing, it prints the memory per GPU and recommends the
fastest that fits, with the micro-batch and gradient accumulation that reach the global batch. After
them come adapter rows (LoRA and QLoRA, DoRA with --peft dora; under DDP, with and without
checkpointing), recommended only when no full fine-tuning fits: adapters train a different model.
It writes the accelerate config (and DeepSpeed JSON) that `accelerate launch --config_file` takes
unchanged, and the launch command (with --peft and the LoRA flags for an adapter row).

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

Adapters (DDP; cloudtrain.adapters: PEFT on a frozen base). T trainable parameters: r*(in + out) per
adapted module (PEFT's all-linear: every Linear/Conv1D but the output head, LM head or classifier;
else the modules whose names end with --lora_target_modules), DoRA's magnitudes (out per module),
and what trains in full beside them (a classifier's head: a trainable copy next to the frozen
original). Each costs 16 bytes: parameters base + 4T, gradients 4T (+ 2T for autocast's 16-bit
copies under fp16/bf16), optimizer 8T. The frozen base:
- LoRA, DoRA: every weight in the compute dtype: 2P under fp16/bf16, else 4P.
- QLoRA: the Q Linear weights bitsandbytes quantises (all but the output head) in 4-bit NF4 with
  double quantisation, 0.5 + 1/64 + 4/(64*256) = 0.516 bytes each (4 bits, an 8-bit absmax per
  64-weight block and an fp32 one per 256 blocks); the rest in fp32, since
  prepare_model_for_kbit_training upcasts every 16-bit weight left (embeddings, norms, the head:
  4(P - Q)); and one weight dequantised to bf16 for its matmul, 2 x the largest. CUDA GPUs only.
DDP's buckets hold the trainable gradients only (4T); each process loads its base as it keeps it.

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

With adapters the frozen projections keep no inputs for backward, but each adapter keeps its own copy of
its input (cast by autocast, or dropped out; q, k and v no longer share one) and its r-wide middle:
    per layer  A' = s*b*[c_h*(2h + I*(k_act + 2g)) + c*(2h + 2h_kv) + c*(X + n*r) + d*X + 2c*Y*dora + 2h*m_h]
                    + s*b*H*s*e
      X, Y, n:    input and output features summed over the n adapted modules of one layer
                  (all-linear Llama: X = 6h + I);
      d:          1 with --lora_dropout > 0 (a 1-byte mask per input on GPUs; the CPU keeps a c-byte one);
      dora:       1 for DoRA, which keeps the base's and the adapter's outputs for its magnitudes;
      c_h:        bytes of the hidden states: c with a 16-bit base; 4 for QLoRA, whose residual stream is
                  fp32 (prepare_model_for_kbit_training upcast the embeddings and norms).
    outside E' = s*b*h*(c_h + m_h), working space W' = c_h*s*b*(h + I), checkpointing with r = c_h.
Measured with autograd's saved-tensor hooks on CPU (tiny Llama, fp32, dropout 0.05): within 5% for LoRA and
DoRA, with and without checkpointing. In fp32 without dropout q, k and v do share their input, and the
estimate is about 17% high.

Logits (causal_lm only; shown as their own column): with vocabulary V they dominate the activations of
a small or mid-sized model, and checkpointing does not shrink them. The loss upcasts the logits
(`logits.float()`, a copy) and takes log-softmax and cross-entropy in fp32. The forward pass holds
the logits, the copy and the log-softmax (c + 4 + 4 bytes per logit); the cross-entropy's backward holds
the log-softmax, its incoming gradient and the copy's gradient (4 + 4 + 4, measured on CPU in fp32 and
under bf16 autocast). So b*s*V*max(c + 8, 12): 12 bytes per logit in every precision.

Pipeline + data parallel (--training_type pipeline; causal LMs the trainer can cut: Llama family, GPT-2; fp32
or bf16): for each pp dividing N (2 to l + 2 stages) and each schedule, pp processes per pipeline and N/pp
pipelines. S = pp*v stages (v = 2 for interleaved 1F1B, else 1), cut by cloudtrain.stages.balanced_split;
process k holds stages k, k + pp, ... The row is the process that needs the most:
- model states: DDP's rule on its stages' parameters (their layers, stage 0's embeddings, the last stage's
  norm and LM head, a copy of its own when tied): no sharding, every pipeline holds its stages whole;
- activations: its micro-batches in flight times one micro-batch's saved activations on its largest stage
  (the formula below at micro-batch b over that stage's layers, the embeddings' or final norm's on the end
  stages), plus the working space. In flight on process k with M micro-batches per step (PyTorch's
  schedules, torch.distributed.pipelining): GPipe M (every forward before any backward); 1F1B
  min(M, S - k) (its warm-up forwards, then one backward per forward); interleaved 1F1B
  min(vM, (v - 1)pp + 2(pp - 1 - k) + 1), its warm-up and the next forward, in units of one stage, so
  process 0 holds l(1 + (pp - 1)/(v*pp)) layers' worth, as Korthikanti et al. (2022, sec. 4.2.3) state;
- logits on the last stage: of every micro-batch under GPipe (the loss of each is taken in the forward pass
  and kept for its backward), of one otherwise;
- communication: each stage's receive buffers, one per micro-batch for the hidden states (not on stage 0)
  and one for their gradients (not on the last), 4 bytes (the fp32 residual stream), and with N/pp > 1 the
  flat copy of the gradients the all-reduce across pipelines takes (4 bytes per parameter).
M = pp x (examples per GPU per optimizer step) / b: all of a pipeline's examples of a step pass in one
schedule step, as Megatron-LM counts micro-batches; a smaller b keeps M and accumulates. Bubble: the idle
share of a step relative to its compute, (pp - 1)/(v*M) (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2); the row's step time is DDP's
times 1 + bubble (the sends of one hidden state per micro-batch cost less than DDP's all-reduce).

Overhead per GPU: 1 GiB for the CUDA context, cuBLAS and NCCL workspaces; communication buffers
(DDP's gradient buckets, 4P; DeepSpeed's reduce buckets, 2 x h^2 elements, and ZeRO-3's prefetch
bucket, 0.9 h^2); and 5% of everything else for caching-allocator fragmentation. The total is a
conservative sum: with gradient accumulation, the gradients of earlier micro-batches are held while
the next one's activations are.

CPU memory per node: the larger of the offloaded states and loading the weights (each process
materialises the fp32 model before placing it; ZeRO-3 initialises layer by layer, FSDP on rank 0).

Ranking, fastest first, by a rule-of-thumb relative step time: DDP 1.00, ZeRO-1 1.02, ZeRO-2 1.05,
FSDP 1.12, ZeRO-3 1.15, ZeRO-2 + optimizer offload 1.6, ZeRO-3 + optimizer offload 1.8, ZeRO-3 +
parameter offload 2.5; pipelines 1 + bubble; gradient checkpointing multiplies by 1.33 (one more forward
pass); adapters multiply DDP's by 0.75 (LoRA: no weight gradients for the base), 0.95 (DoRA) or 1.0 (QLoRA: every
4-bit weight dequantised in both passes). Full fine-tuning is chosen if any of its strategies fits,
else LoRA (DoRA), else QLoRA. Within those, the requested micro-batch is kept if any candidate fits
it; otherwise the fastest that fits a smaller one gets the largest it fits, with more accumulation
so the global batch stays the same.
Micro-batches always divide the examples each GPU takes per optimizer step, so the global batch is
exact.

Not supported: tensor parallelism, pipelines with ZeRO, --pipeline_split_points, adapters under ZeRO or FSDP
(sharding the frozen base), other frozen layers, quantised full fine-tuning, the embeddings and LM head an SFT
chat template's new tokens train in full next to adapters, mixture-of-experts routing, sequence packing, NVMe
offload; the estimate is for GPUs (on CPU, attention with dropout falls back to a kernel that stores the s*s
matrix).
"""

import argparse
import json
import math
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from cloudtrain.config import PEFT_METHODS, PIPELINE_SCHEDULES, PRECISIONS, Config, ModelConfig
from cloudtrain.errors import UserError, first_line
from cloudtrain.registry import TASKS

if TYPE_CHECKING:
    from cloudtrain.distributed import Sharding

LM_TASKS = ("causal_lm", "sft")  # decoders with an LM head: the same memory, logits included

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB
FRAGMENTATION = 0.05
CHECKPOINTING_COST = 1.33
MAX_MICRO_BATCH = 1 << 16
TRAINING_APPLICATION = "src/training_application.py"
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # a 4-bit weight, its 8-bit absmax per 64 and fp32 absmax per 256 blocks
# rules of thumb, relative to full fine-tuning: no weight gradients of the base (about a third less compute), DoRA's
# weight norm every step, and QLoRA's dequantisation of every 4-bit weight in both passes
PEFT_SPEED = {"none": 1.0, "lora": 0.75, "dora": 0.95, "qlora": 1.0}
PEFT_LABELS = {"none": "full fine-tuning", "lora": "LoRA", "dora": "DoRA", "qlora": "QLoRA"}
SCHEDULE_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}
INTERLEAVED_STAGES = 2  # stages per process of the interleaved rows: the fewest it takes, the fewest in flight


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
    Strategy(
        "zero3_offload_all",
        "ZeRO-3 + optimizer & parameter offload",
        2.5,
        zero_stage=3,
        offload_optimizer=True,
        offload_param=True,
    ),
)
PIPELINE = Strategy("pipeline", "pipeline", 1.00)  # --training_type pipeline; its bubble is the Pipeline's


@dataclass(frozen=True)
class Pipeline:
    """pp processes per pipeline running `schedule` over M micro-batches per schedule step."""

    parallel_size: int
    schedule: str  # gpipe, 1f1b, interleaved_1f1b
    microbatches: int
    rows: int  # examples each pipeline takes per optimizer step

    @property
    def stages_per_rank(self) -> int:
        return INTERLEAVED_STAGES if self.schedule == "interleaved_1f1b" else 1

    @property
    def stages(self) -> int:
        return self.parallel_size * self.stages_per_rank

    @property
    def bubble(self) -> float:
        """Idle time over compute time (Narayanan et al. 2021, sec. 2.2): (pp - 1) / (v*M)."""
        return (self.parallel_size - 1) / (self.stages_per_rank * self.microbatches)

    def stage_ids(self, rank: int) -> range:
        return range(rank, self.stages, self.parallel_size)  # PyTorch's "loop" placement, as the trainer's

    def in_flight(self, rank: int) -> int:
        """Micro-batches (interleaved: stage micro-batches) whose activations process `rank` holds at its peak:
        the warm-up forwards of PyTorch's schedules, plus the forward before the first backward (interleaved)."""
        M, pp, v = self.microbatches, self.parallel_size, self.stages_per_rank
        if self.schedule == "gpipe":
            return M
        if self.schedule == "1f1b":
            return min(M, self.stages - rank)
        return min(v * M, (v - 1) * pp + 2 * (pp - 1 - rank) + 1)


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    checkpointing: bool
    peft: str = "none"  # none: full fine-tuning; lora, dora, qlora: adapters on a frozen base
    pipeline: Pipeline | None = None  # with the PIPELINE strategy

    @property
    def speed(self) -> float:
        bubble = 1.0 + (self.pipeline.bubble if self.pipeline else 0.0)
        recompute = CHECKPOINTING_COST if self.checkpointing else 1.0
        return self.strategy.speed * PEFT_SPEED[self.peft] * recompute * bubble

    @property
    def name(self) -> str:
        adapters = "" if self.peft == "none" else PEFT_LABELS[self.peft] + " + "
        return adapters + self._strategy_label() + (" + checkpointing" if self.checkpointing else "")

    def _strategy_label(self) -> str:
        pipe = self.pipeline
        if pipe is None:
            return self.strategy.label
        v = f" v={pipe.stages_per_rank}" if pipe.stages_per_rank > 1 else ""
        return f"pipeline {SCHEDULE_LABELS[pipe.schedule]} pp={pipe.parallel_size}{v} M={pipe.microbatches}"


def candidates(adapters: tuple[str, ...] = (), pipelines: list[Candidate] | None = None) -> list[Candidate]:
    """Every full fine-tuning strategy with and without gradient checkpointing, fastest first; then the
    `pipelines` (pipeline_candidates); then each of `adapters` (lora, dora, qlora) under DDP, without and with
    checkpointing."""
    full = sorted((Candidate(s, gc) for s in STRATEGIES for gc in (False, True)), key=lambda c: c.speed)
    adapter_rows = [Candidate(STRATEGIES[0], gc, peft) for peft in adapters for gc in (False, True)]
    return full + (pipelines or []) + adapter_rows


def pipeline_candidates(m: "ModelFacts", setup: "Setup", per_gpu: int, micro_batch: int) -> list[Candidate]:
    """Pipeline + data parallel for every pp dividing the GPUs and every schedule, with and without checkpointing,
    fastest first; none for a model the trainer cannot cut or under fp16. A pipeline takes pp x `per_gpu` examples
    per optimizer step, in micro-batches of `micro_batch`."""
    from cloudtrain.training.pipeline import schedule_problem

    if m.stages is None or setup.mixed_precision == "fp16":
        return []
    world, rows = setup.world_size, []
    for pp in (d for d in range(2, world + 1) if world % d == 0):
        for schedule in PIPELINE_SCHEDULES:
            pipe = Pipeline(pp, schedule, pp * per_gpu // micro_batch, pp * per_gpu)
            runs = schedule_problem(schedule, pp, pipe.stages_per_rank, pipe.microbatches) is None  # as the trainer
            if runs and pipe.stages <= m.num_layers + 2:  # balanced_split gives every stage a layer, or an end
                rows += [Candidate(PIPELINE, gc, pipeline=pipe) for gc in (False, True)]
    return sorted(rows, key=lambda c: c.speed)


@dataclass(frozen=True)
class LoraSpec:
    """The adapters training would attach: --lora_r, --lora_target_modules, --lora_dropout."""

    r: int = 16
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

    def trainable(self, peft: str) -> int:
        return self.lora_params + self.head_params + (self.magnitude_params if peft == "dora" else 0)


@dataclass(frozen=True)
class StageFacts:
    """What the pipeline's end stages hold beyond their layers (cloudtrain.stages)."""

    embedding_params: int  # stage 0: the token (and GPT-2's position) embeddings
    head_params: int  # the last stage: the final norm and the LM head (its own copy when tied)


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
    adapters: AdapterFacts | None = None  # None: no adapter rows (a --model_config has no pretrained base)
    stages: StageFacts | None = None  # None: no pipeline rows (not a decoder cloudtrain.stages can cut)


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
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.logits + self.overhead

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


def _load_config(
    name: str,
    num_labels: int,
    trust_remote_code: bool,
    task: str = "classification",
    from_config: bool = False,
    tokenizer: str | None = None,
):
    """The model's config as training builds it: with num_labels for classification; for causal_lm from a
    checkpoint or a --model_config, a preset taking its vocabulary from the tokenizer when one is given."""
    from transformers import AutoConfig

    model = ModelConfig(
        model_name_or_path=None if from_config else name,
        model_config=name if from_config else None,
        tokenizer_name_or_path=tokenizer,
        trust_remote_code=trust_remote_code,
    )
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
        raise UserError(
            f"{name} is not a causal language model ({kind}); --task causal_lm and sft plan for one that "
            "AutoModelForCausalLM builds"
        )


def _fit_vocabulary(config, model: ModelConfig) -> None:
    """What training does to a --model_config: a preset takes the tokenizer's vocabulary size."""
    from cloudtrain.model_loading import load_tokenizer
    from cloudtrain.tasks.causal_lm import CausalLMTask

    assert model.model_config is not None  # called for a --model_config
    CausalLMTask.fit_config(config, load_tokenizer(model), model.model_config)


def _meta_model(config, trust_remote_code: bool, task: str = "classification"):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto, kind = (
        (AutoModelForCausalLM, "causal-LM")
        if task in LM_TASKS
        else (AutoModelForSequenceClassification, "sequence-classification")
    )
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


def model_facts(
    name: str,
    num_labels: int = 2,
    trust_remote_code: bool = False,
    task: str = "classification",
    from_config: bool = False,
    tokenizer: str | None = None,
    lora: LoraSpec = LoraSpec(),
) -> ModelFacts:
    """Read a model's config and count its parameters exactly on the meta device; loads no weights.
    task "causal_lm" builds the causal LM (LM head included); from_config: name is a --model_config;
    lora: the adapters to count (none for a --model_config: adapters need pretrained weights)."""
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
        name=name,
        architecture=type(model).__name__,
        num_params=num_params,
        num_layers=len(layers),
        layer_class=type(layers[0]).__name__,
        layer_params=max(layer_sizes),
        root_params=num_params - sum(layer_sizes),
        largest_module_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        hidden_size=hidden,
        num_heads=heads,
        kv_hidden_size=hidden * kv_heads // heads,
        intermediate_size=intermediate,
        gated_mlp=len(mlp_shaped) >= 3,
        activation_saved=_activation_saved(
            _config_value(text, ("hidden_act", "activation_function", "hidden_activation"))
        ),
        hidden_dropout=float(
            _config_value(text, ("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout"), 0.0)
        )
        > 0,
        attention_dropout=float(
            _config_value(text, ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout"), 0.0)
        )
        > 0,
        attn_implementation=str(getattr(model.config, "_attn_implementation", None) or "eager"),
        task=task,
        vocab_size=_vocab_size(model, task),
        from_config=from_config,
        tokenizer=tokenizer,
        adapters=None if from_config else adapter_facts(model, task, lora, layers[0]),
        stages=stage_facts(model) if task in LM_TASKS else None,
    )


def _no_pipeline(m: "ModelFacts", setup: "Setup") -> str:
    """Why pipeline_candidates has no row for this model and set-up."""
    if m.stages is None:
        return "--training_type pipeline cuts causal LMs of the Llama family and GPT-2 only"
    if setup.mixed_precision == "fp16":
        return "it trains in bf16 or fp32, not fp16"
    if setup.world_size < 2:
        return "it needs at least 2 GPUs"
    return "no pipeline size divides the GPUs with a micro-batch count its schedules accept"


def stage_facts(model) -> StageFacts | None:
    """The embeddings and the head of the decoder as the pipeline trainer cuts it, or None if it cannot."""
    from cloudtrain.stages import family_of

    family = family_of(model.config.model_type)
    if family is None:
        return None
    body = getattr(model, family.root)
    embeddings = sum(p.numel() for name in family.embeddings for p in getattr(body, name).parameters())
    head = [*getattr(body, family.norm).parameters(), *model.get_output_embeddings().parameters()]
    return StageFacts(embeddings, sum(p.numel() for p in head))


def adapter_facts(model, task: str, spec: LoraSpec, layer) -> AdapterFacts:
    """The adapters PEFT would attach to the meta-device `model`, what trains in full beside them, and what
    bitsandbytes would store in 4-bit; `layer` is one transformer layer (for the activations)."""
    heads = _trained_in_full(model, task)
    adapted = _adapted_shapes(model, spec.target_modules, heads)
    prefix = next(name for name, module in model.named_modules() if module is layer) + "."
    in_layer = [shape for name, shape in adapted.items() if name.startswith(prefix)]
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
        layer_outputs=sum(o for _, o in in_layer),
    )


def _trained_in_full(model, task: str) -> list[str]:
    """The modules training trains in full next to the adapters: a classifier's head. (An SFT chat template that
    grows the vocabulary adds the embeddings and LM head; the plan notes it.)"""
    if task in LM_TASKS:
        return []
    from cloudtrain.tasks.classification import ClassificationTask

    return ClassificationTask().train_in_full(model)


def _in_out(module) -> tuple[int, int] | None:
    """(input, output) features of a module LoRA can adapt, else None."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

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
    from torch import nn

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
    from torch import nn
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = get_keys_to_not_convert(model)
    return [
        module.weight.numel()
        for name, module in model.named_modules()
        if (type(module) is nn.Linear or isinstance(module, Conv1D)) and should_convert_module(name, keep)
    ]


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


def adapter_state_bytes(m: ModelFacts, peft: str, setup: Setup) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) per GPU with adapters under DDP: the frozen base, then 16 bytes
    per trainable parameter (fp32 weight, gradient and two moments) and autocast's 16-bit copies of them."""
    a, P = m.adapters, m.num_params
    assert a is not None  # adapter candidates exist only with adapter facts
    T = a.trainable(peft)
    if peft == "qlora":  # prepare_model_for_kbit_training upcasts every weight left out of 4-bit to fp32
        base = NF4_BYTES * a.quantized_params + 4 * (P - a.quantized_params) + 2 * a.largest_quantized
    else:
        base = (2 if setup.half else 4) * P  # the base in the compute dtype
    return round(base) + 4 * T, 4 * T + (2 * T if setup.half else 0), 8 * T


def _attention_scores(m: ModelFacts, c: int) -> int:
    """Bytes per attention score eager attention keeps (0 for SDPA/flash: no s*s matrix)."""
    if m.attn_implementation in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
        return 0
    return c + (1 + c if m.attention_dropout else 0)


def _stacked(
    m: ModelFacts, per_layer: float, outside: float, working: float, checkpointing: bool, residual: float
) -> tuple[int, int]:
    """(saved, working space) of the layer stack: every layer's activations, or with checkpointing the residual
    stream at each layer's input plus one layer recomputed in the backward pass."""
    if checkpointing:
        return round(m.num_layers * residual + outside), round(per_layer + working)
    return round(m.num_layers * per_layer + outside), round(working)


def _layer_terms(m: ModelFacts, micro_batch: int, seq: int, half: bool) -> tuple[float, int, int]:
    """(per layer A, outside the layers E, backward working space W) of full fine-tuning, in bytes."""
    c, h, inter, sb = (2 if half else 4), m.hidden_size, m.intermediate_size, seq * micro_batch
    mask = 1 if m.hidden_dropout else 0
    per_layer = sb * (
        c * (7 * h + 2 * m.kv_hidden_size)
        + c * inter * (m.activation_saved + 1 + 2 * m.gated_mlp)
        + 2 * h * mask
        + m.num_heads * seq * _attention_scores(m, c)
    )
    return per_layer, sb * h * (2 * c + mask), c * sb * (h + inter)


def activation_bytes(
    m: ModelFacts, micro_batch: int, seq: int, half: bool, checkpointing: bool, residual_bytes: int
) -> tuple[int, int]:
    """(saved for backward at the end of the forward pass, backward working space) per GPU."""
    per_layer, outside, working = _layer_terms(m, micro_batch, seq, half)
    return _stacked(m, per_layer, outside, working, checkpointing, residual_bytes * seq * micro_batch * m.hidden_size)


def adapter_activation_bytes(
    m: ModelFacts, peft: str, micro_batch: int, seq: int, half: bool, checkpointing: bool
) -> tuple[int, int]:
    """(saved for backward, backward working space) per GPU with adapters: the frozen linear layers keep no
    inputs, each adapter keeps its own copy of its input (cast to its dtype or dropped out) with the dropout
    mask, and its r-wide middle; DoRA also keeps two output-sized tensors per adapted module."""
    a, h, inter, sb = m.adapters, m.hidden_size, m.intermediate_size, seq * micro_batch
    assert a is not None  # adapter candidates exist only with adapter facts
    c = 2 if half else 4
    hidden = 4 if peft == "qlora" else c  # QLoRA's residual stream is fp32: its embeddings and norms were upcast
    mask = 1 if m.hidden_dropout else 0
    adapters = (
        c * (a.layer_inputs + a.layer_adapted * a.spec.r)
        + (a.layer_inputs if a.spec.dropout > 0 else 0)
        + (2 * c * a.layer_outputs if peft == "dora" else 0)
    )
    per_layer = sb * (
        hidden * (2 * h + inter * (m.activation_saved + 2 * m.gated_mlp))
        + c * (2 * h + 2 * m.kv_hidden_size)
        + adapters
        + 2 * h * mask
        + m.num_heads * seq * _attention_scores(m, c)
    )
    outside = sb * h * (hidden + mask)  # the final norm's input: frozen, the embeddings' output needs no copy
    return _stacked(m, per_layer, outside, hidden * sb * (h + inter), checkpointing, hidden * sb * h)


def logits_bytes(m: ModelFacts, micro_batch: int, seq: int, half: bool) -> int:
    """The logits and the loss's fp32 buffers per GPU (0 without an LM head): per logit, the forward holds
    the logits (c bytes), their fp32 copy and the log-softmax (4 + 4); the cross-entropy's backward holds
    the log-softmax, its gradient and the copy's gradient (3 x 4). Checkpointing does not shrink them."""
    c = 2 if half else 4
    return micro_batch * seq * m.vocab_size * max(c + 4 + 4, 3 * 4)


def overhead_bytes(m: ModelFacts, strategy: Strategy, setup: Setup, rest: int, trainable: int) -> int:
    """CUDA context, communication buffers and allocator fragmentation."""
    p = 2 if setup.half else 4
    if strategy.fsdp:
        buffers: float = 0  # FSDP's gathered weights are counted with the parameters
    elif strategy.zero_stage is None:
        buffers = 4 * trainable if setup.world_size > 1 else 0  # DDP gradient buckets (fp32)
    else:
        buffers = p * m.hidden_size**2 * (2 + (0.9 if strategy.zero_stage == 3 else 0))
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
    """Memory per GPU of one candidate at one micro-batch (a pipeline's: of its busiest process)."""
    if cand.pipeline:
        return max(rank_estimates(m, cand, setup, micro_batch), key=lambda e: e.total)
    full = cand.peft == "none"
    params, grads, optim = (
        model_state_bytes(m, cand.strategy, setup) if full else adapter_state_bytes(m, cand.peft, setup)
    )
    activations = _activations(m, cand, setup, micro_batch)
    logits = logits_bytes(m, micro_batch, setup.max_length, setup.half)
    if full:
        trainable = m.num_params
    else:
        assert m.adapters is not None  # adapter candidates exist only with adapter facts
        trainable = m.adapters.trainable(cand.peft)
    overhead = overhead_bytes(m, cand.strategy, setup, params + grads + optim + activations + logits, trainable)
    # with adapters each process loads its base as it will hold it (in 16 bits, or quantising as it goes)
    offloaded, load = cpu_bytes(m, cand.strategy, setup) if full else (0, params * setup.num_gpus)
    return Estimate(params, grads, optim, activations, overhead, offloaded, load, logits)


def _activations(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> int:
    if cand.peft != "none":
        return sum(
            adapter_activation_bytes(m, cand.peft, micro_batch, setup.max_length, setup.half, cand.checkpointing)
        )
    residual = _residual_bytes(cand.strategy, setup)
    return sum(activation_bytes(m, micro_batch, setup.max_length, setup.half, cand.checkpointing, residual))


def _residual_bytes(s: Strategy, setup: Setup) -> int:
    """Bytes of the residual stream: fp32 under autocast with fp32 weights (DDP, pipelines), else c."""
    return 4 if (s.zero_stage is None and not s.fsdp) or not setup.half else 2


def rank_estimates(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> list[Estimate]:
    """Memory of each process of a pipeline (candidate with a Pipeline) at micro-batch `micro_batch`."""
    assert cand.pipeline is not None  # a pipeline candidate
    return [_rank_estimate(m, cand, setup, micro_batch, rank) for rank in range(cand.pipeline.parallel_size)]


def _rank_estimate(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int, rank: int) -> Estimate:
    """Process `rank` of a pipeline: its stages' states, its micro-batches in flight, its receive buffers."""
    from cloudtrain.stages import balanced_split

    pipe, st, seq = cand.pipeline, m.stages, setup.max_length
    assert pipe is not None and st is not None  # pipeline candidates exist only with stage facts
    ranges, ids = balanced_split(m.num_layers, pipe.stages), pipe.stage_ids(rank)
    first, last = 0 in ids, pipe.stages - 1 in ids
    held = sum(len(ranges[s]) for s in ids) * m.layer_params + first * st.embedding_params + last * st.head_params
    params, grads, optim = model_state_bytes(replace(m, num_params=held), PIPELINE, setup)
    per_layer, outside, working = _layer_terms(m, micro_batch, seq, setup.half)
    hidden = _residual_bytes(PIPELINE, setup) * seq * micro_batch * m.hidden_size  # one micro-batch's hidden states
    largest = replace(m, num_layers=max(len(ranges[s]) for s in ids))
    saved, working = _stacked(largest, per_layer, outside if first or last else 0, working, cand.checkpointing, hidden)
    activations = pipe.in_flight(rank) * saved + working
    kept = pipe.microbatches if pipe.schedule == "gpipe" else 1  # micro-batches whose loss awaits its backward
    logits = last * kept * logits_bytes(m, micro_batch, seq, setup.half)
    receives = pipe.microbatches * hidden * sum((s > 0) + (s < pipe.stages - 1) for s in ids)
    flat = 4 * held if setup.world_size > pipe.parallel_size else 0  # the gradients all-reduced across pipelines
    rest = params + grads + optim + activations + logits
    overhead = round(CUDA_CONTEXT_BYTES + receives + flat + FRAGMENTATION * rest)
    offloaded, load = cpu_bytes(m, PIPELINE, setup)  # every process builds the whole fp32 model, then frees the rest
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


def run_strategy(shards: "Sharding") -> Strategy:
    """The strategy a training launch uses (ZeRO-1 with optimizer offload is estimated as ZeRO-1)."""
    if shards.fsdp:
        return next(s for s in STRATEGIES if s.fsdp)
    stage = shards.zero_stage or None
    offload = (shards.offload_optimizer, shards.offload_param)
    same_stage = [s for s in STRATEGIES if s.zero_stage == stage and not s.fsdp]
    return next((s for s in same_stage if (s.offload_optimizer, s.offload_param) == offload), same_stage[0])


def run_micro_batch(cfg: Config, num_labels: int, gpus_per_node: int, nodes: int, memory: int, seq_len: int) -> int:
    """The largest micro-batch the estimate fits into `memory` bytes per process for a training run's model,
    strategy, gradient checkpointing and adapters, at rows of `seq_len` tokens (0: none fits)."""
    from cloudtrain.distributed import sharding
    from cloudtrain.model_loading import resolve_model_path

    m = cfg.model
    lora = LoraSpec(m.lora_r, tuple(m.lora_target_modules), m.lora_dropout)
    name = m.model_config or resolve_model_path(m)
    facts = model_facts(
        name, num_labels, m.trust_remote_code, cfg.training.task, bool(m.model_config), m.tokenizer_name_or_path, lora
    )
    candidate = Candidate(run_strategy(sharding(cfg)), m.gradient_checkpointing, m.peft)
    setup = Setup(gpus_per_node, nodes, memory, None, seq_len, cfg.training.mixed_precision)
    return max_micro_batch(facts, candidate, setup)


# ---------------------------------------------------------------- the plan


@dataclass
class Row:
    candidate: Candidate
    estimate: Estimate  # at the requested micro-batch
    fits: bool  # at the requested micro-batch
    max_micro_batch: int
    pipeline: dict | None = None  # a pipeline row's layout (_pipeline_json)


@dataclass
class Choice:
    candidate: Candidate
    micro_batch: int
    accumulation: int
    estimate: Estimate


def micro_batch_options(requested: int, per_gpu_per_step: int) -> list[int]:
    """Micro-batches that divide the examples each GPU sees per optimizer step, largest first."""
    return [b for b in range(min(requested, per_gpu_per_step), 0, -1) if per_gpu_per_step % b == 0]


def accumulation(cand: Candidate, per_gpu: int, micro_batch: int) -> int:
    """Gradient accumulation steps that reach the global batch at `micro_batch` (0: it does not divide);
    a pipeline's step already passes its M micro-batches."""
    per_step = micro_batch * (cand.pipeline.microbatches if cand.pipeline else 1)
    rows = cand.pipeline.rows if cand.pipeline else per_gpu
    return rows // per_step if rows % per_step == 0 else 0


def choose(m: ModelFacts, rows: list[Row], setup: Setup, requested: int, global_batch: int) -> Choice | None:
    """Full fine-tuning if any of its candidates fits, else LoRA (DoRA), else QLoRA: adapters train a different
    model, so they are the fallback, not a speed-up. Within one, the fastest candidate at the requested
    micro-batch if any fits it; else the fastest that fits a smaller one, at the largest micro-batch it fits."""
    per_gpu = global_batch // setup.world_size
    options = micro_batch_options(requested, per_gpu)
    for peft in PEFT_METHODS:
        tier = sorted((r for r in rows if r.candidate.peft == peft), key=lambda r: r.candidate.speed)
        for allowed in (options[:1], options):
            for row in tier:
                c = row.candidate
                fitting = [b for b in allowed if b <= row.max_micro_batch and accumulation(c, per_gpu, b)]
                if fitting:
                    b = fitting[0]
                    return Choice(c, b, accumulation(c, per_gpu, b), estimate(m, c, setup, b))
    return None


def _fits_anything(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> bool:
    return any(fits(estimate(m, c, setup, 1), setup) for c in cands)


def suggestions(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> list[str]:
    """What would make the smallest of `cands` (at micro-batch 1) fit."""
    smallest = min((estimate(m, c, setup, 1) for c in cands), key=lambda e: e.total)
    ideas = [
        f"GPUs with at least {math.ceil(smallest.total / GIB)} GiB (the leanest option needs "
        f"{smallest.total / GIB:.1f} GiB per GPU at micro-batch 1)"
    ]
    for nodes in range(setup.num_nodes + 1, setup.num_nodes * 64 + 1):
        if _fits_anything(m, replace(setup, num_nodes=nodes), cands):
            ideas.append(f"{nodes * setup.num_gpus} GPUs: --num_nodes {nodes} with {setup.num_gpus} GPUs each")
            break
    lengths = [s for s in (2**k for k in range(20)) if 2 <= s < setup.max_length]
    shorter = [s for s in lengths if _fits_anything(m, replace(setup, max_length=s), cands)]
    if shorter:
        ideas.append(f"a shorter sequence: --max_length {max(shorter)}")
    if not setup.half and _fits_anything(m, replace(setup, mixed_precision="bf16"), cands):
        ideas.append("--mixed_precision bf16 (halves the activations and, with DeepSpeed, the weights)")
    if setup.cpu_memory_bytes is not None and _fits_anything(m, replace(setup, cpu_memory_bytes=None), cands):
        ideas.append("more CPU memory per node for offloading (see the CPU/node column)")
    return ideas


def _reasons(
    m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup, requested: int, global_batch: int
) -> list[str]:
    """A few lines on why this candidate, this micro-batch and this accumulation."""
    c, gib, b = choice.candidate, setup.gpu_memory_bytes / GIB, choice.micro_batch
    faster = sorted(
        (r.candidate for r in rows if r.candidate.peft == c.peft and r.candidate.speed < c.speed), key=lambda f: f.speed
    )
    reasons = _adapter_reasons(m, rows, c, setup)
    if faster:  # over budget at the requested micro-batch, or (when it fits nothing) even at 1
        at = b if b == micro_batch_options(requested, global_batch // setup.world_size)[0] else 1
        shown = ", ".join(f"{f.name} {estimate(m, f, setup, at).total / GIB:.1f}" for f in faster[:4])
        reasons.append(
            f"Faster options need more than {gib:g} GiB per GPU at micro-batch {at}: {shown} GiB"
            + (" (and more)" if len(faster) > 4 else "")
            + "."
        )
    e = choice.estimate
    logits = f", logits {e.logits / GIB:.1f}" if e.logits else ""
    reasons.append(
        f"{c.name} needs {e.total / GIB:.1f} of {gib:g} GiB per GPU at micro-batch {b} (model states "
        f"{e.model_states / GIB:.1f}, activations {e.activations / GIB:.1f}{logits} GiB); the largest "
        f"micro-batch it fits is {next(r.max_micro_batch for r in rows if r.candidate == c)}."
    )
    reasons += _micro_batch_reason(requested, b, global_batch // setup.world_size)
    if c.pipeline:
        reasons += _pipeline_reasons(m, choice, setup, global_batch)
    else:
        reasons.append(
            f"{b} per GPU x {setup.world_size} GPUs x {choice.accumulation} accumulation step(s) = "
            f"global batch {global_batch}."
        )
    if c.checkpointing:
        plain = estimate(m, replace(c, checkpointing=False), setup, b)
        reasons.append(
            f"Gradient checkpointing recomputes each layer in the backward pass (about a third more "
            f"compute); without it activations need {plain.activations / GIB:.1f} GiB."
        )
    if c.strategy.offload_optimizer:
        reasons.append(
            f"Offloading needs {e.cpu_per_node / GIB:.1f} GiB of CPU memory per node and runs the AdamW "
            "step on the CPU."
        )
    return reasons


def _pipeline_reasons(m: ModelFacts, choice: Choice, setup: Setup, global_batch: int) -> list[str]:
    """The stages, the busiest process, the bubble and the batch arithmetic of a pipeline."""
    pipe, b = choice.candidate.pipeline, choice.micro_batch
    assert pipe is not None  # called for a pipeline
    layout = _pipeline_json(m, choice.candidate, setup, b)
    assert layout is not None
    dp, k = layout["data_parallel_size"], layout["busiest_rank"]
    return [
        f"{pipe.parallel_size} processes per pipeline, {dp} pipeline(s) side by side: {pipe.stages} stages of "
        f"{', '.join(map(str, layout['layers_per_stage']))} layers (the first also the embeddings, the last the "
        "norm and LM head), each whole with its gradients and AdamW states in every pipeline; process "
        f"{k} needs the most, with {layout['in_flight']} micro-batch(es) in flight under "
        f"{SCHEDULE_LABELS[pipe.schedule]}.",
        f"Bubble {pipe.bubble:.1%}: (pp - 1) / ({'stages per process x ' if pipe.stages_per_rank > 1 else ''}"
        "micro-batches) of the compute, idle.",
        f"{pipe.microbatches} micro-batches of {b} per pipeline x {dp} pipeline(s) x {choice.accumulation} "
        f"accumulation step(s) = global batch {global_batch}.",
    ]


def _adapter_reasons(m: ModelFacts, rows: list[Row], c: Candidate, setup: Setup) -> list[str]:
    """For adapters: why not what comes before them (full fine-tuning, LoRA), and what they train."""
    if c.peft == "none":
        return []
    reasons = []
    for earlier in PEFT_METHODS[: PEFT_METHODS.index(c.peft)]:
        tier = [r.candidate for r in rows if r.candidate.peft == earlier]
        if tier:
            leanest = min(tier, key=lambda t: (estimate(m, t, setup, 1).total, estimate(m, t, setup, 1).cpu_per_node))
            label = PEFT_LABELS[earlier]
            reasons.append(
                f"{label[0].upper() + label[1:]} does not fit: its leanest option, {leanest.name}, needs "
                f"{_over_budget(estimate(m, leanest, setup, 1), setup)} at micro-batch 1."
            )
    a = m.adapters
    assert a is not None  # adapter candidates exist only with adapter facts
    base = "4-bit NF4" if c.peft == "qlora" else setup.mixed_precision if setup.half else "fp32"
    reasons.append(
        f"{PEFT_LABELS[c.peft]} trains {a.trainable(c.peft):,} parameters ({_share(m, c.peft)} of the "
        f"model: r={a.spec.r} adapters on {','.join(a.spec.target_modules)}"
        f"{' and the head' if a.head_params else ''}) on a frozen base in {base}; only they have "
        "gradients and AdamW states."
    )
    if c.peft == "qlora":
        reasons.append("QLoRA needs CUDA GPUs and bitsandbytes.")
    return reasons


def _over_budget(est: Estimate, setup: Setup) -> str:
    """What exceeds the budget: the GPU memory, or else the CPU memory per node."""
    if est.total > setup.gpu_memory_bytes:
        return f"{est.total / GIB:.1f} GiB per GPU (of {setup.gpu_memory_bytes / GIB:g})"
    assert setup.cpu_memory_bytes is not None  # over budget with GPU memory to spare: the CPU memory was checked
    return f"{est.cpu_per_node / GIB:.1f} GiB of CPU memory per node (of {setup.cpu_memory_bytes / GIB:g})"


def _share(m: ModelFacts, peft: str) -> str:
    assert m.adapters is not None  # adapter candidates exist only with adapter facts
    return f"{100 * m.adapters.trainable(peft) / m.num_params:.2f}%"


def _micro_batch_reason(requested: int, chosen: int, per_gpu: int) -> list[str]:
    largest = micro_batch_options(requested, per_gpu)[0]
    if chosen < largest:
        return [
            f"Micro-batch {largest} fits no strategy; {chosen} is the largest the fastest remaining one fits, "
            "so gradient accumulation makes up the global batch."
        ]
    if largest < requested:
        return [
            f"Micro-batch {chosen} is the largest up to {requested} that divides the {per_gpu} examples each "
            "GPU takes per optimizer step."
        ]
    return []


# ---------------------------------------------------------------- emitted configs


def deepspeed_config(strategy: Strategy) -> dict:
    """The application's own ZeRO config (batch sizes, accumulation, clipping and precision "auto", so
    they always come from its flags), with reduce buckets sized from the hidden size as estimated."""
    from cloudtrain.distributed import zero_config

    offload = {True: "cpu", False: "none"}
    assert strategy.zero_stage is not None  # a ZeRO strategy's
    config = zero_config(strategy.zero_stage, offload[strategy.offload_optimizer], offload[strategy.offload_param])
    config["zero_optimization"]["reduce_bucket_size"] = "auto"  # hidden_size**2 (DeepSpeed's default: 5e8)
    return config


def accelerate_config(m: ModelFacts, cand: Candidate, setup: Setup, ds_path: Path | None) -> dict:
    """The accelerate config file (YAML) for `accelerate launch --config_file`."""
    s = cand.strategy
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": setup.mixed_precision,
        "num_machines": setup.num_nodes,
        "num_processes": setup.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if s.zero_stage is not None:
        assert ds_path is not None  # written for a ZeRO strategy
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(ds_path.resolve()),
            "zero3_init_flag": s.zero_stage == 3,
        }
        if setup.num_nodes > 1:
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    elif s.fsdp:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": m.layer_class,
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": False,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": cand.checkpointing,
        }
    else:
        config["distributed_type"] = "MULTI_GPU" if setup.world_size > 1 else "NO"
    return config


def launch_command(m: ModelFacts, choice: Choice, setup: Setup, files: dict[str, str]) -> str:
    """accelerate launch with the written config; a pipeline: torchrun, its processes and the pipeline flags."""
    pipe = choice.candidate.pipeline
    rows = choice.micro_batch * (pipe.microbatches if pipe else 1)  # a pipeline's --per_device_train_batch_size
    args = _launcher(setup, files) + (
        [TRAINING_APPLICATION, "--training_type", "pipeline" if pipe else "accelerated"]
        + _model_args(m)
        + [
            "--per_device_train_batch_size",
            str(rows),
            "--gradient_accumulation_steps",
            str(choice.accumulation),
            "--mixed_precision",
            setup.mixed_precision,
            "--max_length",
            str(setup.max_length),
        ]
    )
    if choice.candidate.checkpointing and not choice.candidate.strategy.fsdp:  # FSDP does it in the YAML
        args += ["--gradient_checkpointing", "true"]
    if pipe:
        args += [
            "--pipeline_parallel_size",
            str(pipe.parallel_size),
            "--pipeline_schedule",
            pipe.schedule,
            "--pipeline_microbatches",
            str(pipe.microbatches),
        ]
        args += ["--pipeline_stages_per_rank", str(pipe.stages_per_rank)] if pipe.stages_per_rank > 1 else []
    if choice.candidate.peft != "none":
        assert m.adapters is not None  # adapter candidates exist only with adapter facts
        spec = m.adapters.spec
        args += [
            "--peft",
            choice.candidate.peft,
            "--lora_r",
            str(spec.r),
            "--lora_dropout",
            f"{spec.dropout:g}",
            "--lora_target_modules",
            ",".join(spec.target_modules),
        ]
    return shlex.join(args)


def _launcher(setup: Setup, files: dict[str, str]) -> list[str]:
    """accelerate launch with the written config, or torchrun (a pipeline: no config); on every node."""
    if "accelerate_config" not in files:
        args = ["torchrun", "--nproc_per_node", str(setup.num_gpus)]
        if setup.num_nodes > 1:
            args += ["--nnodes", str(setup.num_nodes), "--node_rank", "<rank of this node>"]
            args += ["--master_addr", "<node 0 address>", "--master_port", "29500"]
        return args
    args = ["accelerate", "launch", "--config_file", files["accelerate_config"]]
    if setup.num_nodes > 1:
        args += [
            "--machine_rank",
            "<rank of this node>",
            "--main_process_ip",
            "<node 0 address>",
            "--main_process_port",
            "29500",
        ]
    return args


def _model_args(m: ModelFacts) -> list[str]:
    """The launch command's task and model flags."""
    if m.task not in LM_TASKS:
        return ["--model_name_or_path", m.name]
    args = ["--task", m.task, "--model_config" if m.from_config else "--model_name_or_path", m.name]
    if m.from_config or m.tokenizer:
        args += ["--tokenizer_name_or_path", m.tokenizer or "<tokenizer dir or Hub id>"]
    return args


def write_configs(m: ModelFacts, choice: Choice, setup: Setup, output_dir: Path) -> dict[str, str]:
    """Write the accelerate YAML (and the DeepSpeed JSON it points to); returns their paths. A pipeline, launched
    by torchrun with its flags, needs none."""
    if choice.candidate.pipeline:
        return {}
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
    parser.add_argument(
        "--task",
        choices=TASKS.names(),
        default="classification",
        help="What will be trained: classification, causal_lm or sft (the same memory as causal_lm; "
        "default: classification).",
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="A model directory or Hub id; only its config is read (default: all-MiniLM-L6-v2).",
    )
    parser.add_argument(
        "--model_config",
        default=None,
        help="--task causal_lm from scratch: a config.json or a shipped preset (llama-8m, llama-600m).",
    )
    parser.add_argument(
        "--tokenizer_name_or_path",
        default=None,
        help="The tokenizer training will use; a preset takes its vocabulary size from it "
        "(default: the config's vocab_size).",
    )
    parser.add_argument("--num_labels", type=int, default=2, help="Classes of the classification head (default: 2).")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow the model's own config/model code.")
    parser.add_argument("--num_gpus", type=int, default=1, help="GPUs per node (default: 1).")
    parser.add_argument("--num_nodes", type=int, default=1, help="Nodes (default: 1).")
    parser.add_argument("--gpu_memory_gb", type=float, required=True, help="Memory of one GPU in GiB, e.g. 24 or 80.")
    parser.add_argument(
        "--cpu_memory_gb",
        type=float,
        default=None,
        help="CPU memory per node in GiB; offload plans needing more do not fit (default: unchecked).",
    )
    parser.add_argument(
        "--per_device_train_batch_size",
        type=int,
        default=16,
        help="Requested micro-batch per GPU (default: 16, as the training application).",
    )
    parser.add_argument("--max_length", type=int, default=128, help="Sequence length in tokens (default: 128).")
    parser.add_argument(
        "--mixed_precision",
        choices=PRECISIONS,
        default="no",
        help="no, fp16 or bf16 (default: no; the training application's auto trains in bf16 on GPUs from Ampere on).",
    )
    parser.add_argument(
        "--global_batch_size",
        type=int,
        default=None,
        help="Examples per optimizer step over all GPUs (default: micro-batch x GPUs).",
    )
    parser.add_argument(
        "--strategy",
        choices=["auto"] + [s.key for s in STRATEGIES] + [PIPELINE.key],
        default="auto",
        help="Emit the configs for this strategy instead of the fastest that fits; pipeline: the fastest "
        "pipeline + data parallel row (default: auto).",
    )
    parser.add_argument(
        "--gradient_checkpointing",
        choices=["auto", "true", "false"],
        default="auto",
        help="Only consider plans with (true) or without (false) checkpointing (default: auto).",
    )
    parser.add_argument(
        "--peft",
        choices=("auto",) + PEFT_METHODS,
        default="auto",
        help="auto: full fine-tuning if any strategy fits it, else LoRA, else QLoRA; none: full "
        "fine-tuning only; lora, dora or qlora: only those adapters (default: auto).",
    )
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank, as in training (default: 16).")
    parser.add_argument(
        "--lora_target_modules",
        type=_names,
        default=("all-linear",),
        help="Modules that get adapters: all-linear or comma-separated names, as in training (default: all-linear).",
    )
    parser.add_argument(
        "--lora_dropout",
        type=float,
        default=ModelConfig.lora_dropout,
        help=f"Dropout on the adapters' inputs, as in training; it stores a mask (default: "
        f"{ModelConfig.lora_dropout:g}).",
    )
    parser.add_argument("--output_dir", default="plan", help="Where the configs are written (default: ./plan).")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON instead of a table.")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _check(args: argparse.Namespace) -> None:
    world = args.num_gpus * args.num_nodes
    checks = [
        (args.num_gpus < 1, "--num_gpus must be at least 1"),
        (args.num_nodes < 1, "--num_nodes must be at least 1"),
        (args.gpu_memory_gb <= 0, "--gpu_memory_gb must be positive, e.g. 24"),
        (args.cpu_memory_gb is not None and args.cpu_memory_gb <= 0, "--cpu_memory_gb must be positive"),
        (args.num_labels < 1, "--num_labels must be at least 1"),
        (args.model_config and args.task not in LM_TASKS, "--model_config is for --task causal_lm or sft"),
        (
            args.model_config and args.model_name_or_path,
            "--model_config builds a model from scratch and --model_name_or_path loads one; give one of them",
        ),
        (
            args.task in LM_TASKS and not (args.model_config or args.model_name_or_path),
            f"--task {args.task} needs --model_name_or_path <causal LM> or --model_config <config.json or preset>",
        ),
        (args.per_device_train_batch_size < 1, "--per_device_train_batch_size must be at least 1"),
        (args.lora_r < 1, "--lora_r must be at least 1"),
        (not 0 <= args.lora_dropout < 1, "--lora_dropout must be in [0, 1)"),
        (not args.lora_target_modules, "--lora_target_modules needs all-linear or module names"),
        (
            args.model_config and args.peft not in ("auto", "none"),
            f"--peft {args.peft} trains adapters on pretrained weights, but --model_config builds a model with random "
            "weights; plan for a checkpoint with --model_name_or_path",
        ),
        (args.max_length < 2, "--max_length must be at least 2"),
        (
            args.global_batch_size is not None and args.global_batch_size % world != 0,
            f"--global_batch_size {args.global_batch_size} must be a positive multiple of the {world} GPUs",
        ),
        (
            args.global_batch_size is not None and args.global_batch_size < world,
            f"--global_batch_size must be at least the number of GPUs ({world})",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise UserError(message)


def make_plan(args: argparse.Namespace) -> dict:
    """Estimate every candidate, choose one, write its configs; returns the machine-readable plan."""
    _check(args)
    from cloudtrain.assets import default_model_dir

    m = model_facts(
        args.model_config or args.model_name_or_path or default_model_dir(),
        args.num_labels,
        args.trust_remote_code,
        args.task,
        bool(args.model_config),
        args.tokenizer_name_or_path,
        LoraSpec(args.lora_r, args.lora_target_modules, args.lora_dropout),
    )
    setup = Setup(
        args.num_gpus,
        args.num_nodes,
        round(args.gpu_memory_gb * GIB),
        None if args.cpu_memory_gb is None else round(args.cpu_memory_gb * GIB),
        args.max_length,
        args.mixed_precision,
    )
    global_batch = args.global_batch_size or args.per_device_train_batch_size * setup.world_size
    requested = min(args.per_device_train_batch_size, global_batch // setup.world_size)
    adapters = (
        () if m.adapters is None else tuple(p for p in ("lora", "dora", "qlora") if p != "dora" or args.peft == "dora")
    )  # DoRA only when asked for
    per_gpu = global_batch // setup.world_size
    pipes = pipeline_candidates(m, setup, per_gpu, micro_batch_options(requested, per_gpu)[0])
    if args.strategy == PIPELINE.key and not pipes:
        raise UserError(f"--strategy pipeline: no pipeline can run here: {_no_pipeline(m, setup)}")
    cands = candidates(adapters, pipes)
    rows = [_row(m, c, setup, requested) for c in cands]
    allowed = [
        r
        for r in rows
        if (args.strategy in ("auto", r.candidate.strategy.key))
        and args.gradient_checkpointing in ("auto", str(r.candidate.checkpointing).lower())
        and args.peft in ("auto", r.candidate.peft)
    ]
    choice = choose(m, allowed, setup, requested, global_batch)
    plan = {
        "model": asdict(m),
        "setup": {**asdict(setup), "world_size": setup.world_size},
        "requested_micro_batch": requested,
        "global_batch_size": global_batch,
        "assumptions": {
            "cuda_context_bytes": CUDA_CONTEXT_BYTES,
            "fragmentation": FRAGMENTATION,
            "checkpointing_cost": CHECKPOINTING_COST,
            "optimizer": "AdamW",
        },
        "strategies": [_row_json(r) for r in rows],
        "recommendation": None,
        "suggestions": [],
        "notes": _notes(m),
    }
    if choice is None:
        forced = args.strategy != "auto" or args.gradient_checkpointing != "auto" or args.peft != "auto"
        leanest = "full offload and checkpointing" + (", nor QLoRA with checkpointing" if "qlora" in adapters else "")
        plan["message"] = (
            f"Nothing fits, not even micro-batch 1 with {leanest}."
            if not forced or not any(r.max_micro_batch for r in rows)
            else "The requested strategy does not fit "
            "(see the table); drop --strategy/--gradient_checkpointing/--peft to let the planner "
            "choose."
        )
        plan["suggestions"] = suggestions(m, setup, cands)
        return plan
    files = write_configs(m, choice, setup, Path(args.output_dir))
    plan["recommendation"] = _recommendation_json(
        choice,
        global_batch,
        files,
        _reasons(m, allowed, choice, setup, requested, global_batch),
        launch_command(m, choice, setup, files),
    )
    return plan


def _notes(m: ModelFacts) -> list[str]:
    notes = []
    if m.from_config and not m.tokenizer:
        notes.append(
            f"vocab {m.vocab_size} is the config's; training gives a preset the tokenizer's vocabulary: "
            "pass --tokenizer_name_or_path for the exact logits"
        )
    if m.task in LM_TASKS and m.stages is None:
        notes.append(f"no pipeline rows: --training_type pipeline cannot cut a {m.architecture} into stages")
    if m.task == "sft" and m.adapters:
        notes.append(
            "adapters: a chat template that adds tokens also trains the embeddings and LM head in full "
            "(not counted here)"
        )
    return notes


def _recommendation_json(choice: Choice, global_batch: int, files: dict, reasons: list[str], command: str) -> dict:
    c = choice.candidate
    return {
        "strategy": c.strategy.key,
        "label": c.name,
        "gradient_checkpointing": c.checkpointing,
        "peft": c.peft,
        "pipeline": c.pipeline and asdict(c.pipeline),
        "micro_batch": choice.micro_batch,
        "gradient_accumulation_steps": choice.accumulation,
        "global_batch_size": global_batch,
        "estimate": _estimate_json(choice.estimate),
        "reasons": reasons,
        "files": files,
        "command": command,
    }


def _row(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Row:
    est = estimate(m, cand, setup, micro_batch)
    return Row(
        cand, est, fits(est, setup), max_micro_batch(m, cand, setup), _pipeline_json(m, cand, setup, micro_batch)
    )


def _pipeline_json(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> dict | None:
    """A pipeline row's layout: its stages' layers, the process that needs the most, its bubble."""
    from cloudtrain.stages import balanced_split

    pipe = cand.pipeline
    if pipe is None:
        return None
    totals = [e.total for e in rank_estimates(m, cand, setup, micro_batch)]
    busiest = totals.index(max(totals))
    return {
        **asdict(pipe),
        "data_parallel_size": setup.world_size // pipe.parallel_size,
        "stages_per_rank": pipe.stages_per_rank,
        "layers_per_stage": [len(r) for r in balanced_split(m.num_layers, pipe.stages)],
        "busiest_rank": busiest,
        "in_flight": pipe.in_flight(busiest),
        "bubble": round(pipe.bubble, 4),
        "rank_totals": totals,
    }


def _estimate_json(est: Estimate) -> dict:
    return {**asdict(est), "total": est.total, "cpu_per_node": est.cpu_per_node}


def _row_json(row: Row) -> dict:
    c = row.candidate
    return {
        "strategy": c.strategy.key,
        "label": c.name,
        "gradient_checkpointing": c.checkpointing,
        "peft": c.peft,
        "relative_step_time": round(c.speed, 3),
        "estimate": _estimate_json(row.estimate),
        "fits": row.fits,
        "max_micro_batch": row.max_micro_batch,
        "pipeline": row.pipeline,
    }


def _size(n: int) -> str:
    if n >= 10 * GIB:
        return f"{n / GIB:.1f}G"
    if n >= GIB:
        return f"{n / GIB:.2f}G"
    return f"{n / 2**20:.0f}M"


def render(plan: dict) -> str:
    """The human-readable plan: model, setup, the table of all candidates, the recommendation."""
    m, s = plan["model"], plan["setup"]
    lm = m["task"] in LM_TASKS
    vocab = f", vocab {m['vocab_size']}" if lm else ""
    lines = [
        f"model: {m['architecture']} ({m['name']}), {m['num_params'] / 1e6:,.1f}M parameters, "
        f"{m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, intermediate "
        f"{m['intermediate_size']}{' (gated)' if m['gated_mlp'] else ''}"
        f"{vocab}, {m['attn_implementation']} attention",
        f"setup: {s['num_nodes']} node(s) x {s['num_gpus']} GPU(s) x {s['gpu_memory_bytes'] / GIB:g} GiB, "
        f"max_length {s['max_length']}, mixed precision {s['mixed_precision']}, micro-batch "
        f"{plan['requested_micro_batch']}, global batch {plan['global_batch_size']}",
        f"memory per GPU at micro-batch {plan['requested_micro_batch']}; time: relative step time, fastest "
        "first; overhd: 1 GiB CUDA context + communication buffers + 5% fragmentation; max mb: the largest "
        "micro-batch that fits",
    ]
    if lm:
        lines.append(
            "logits: micro-batch x max_length x vocab x 12 bytes (the logits with their fp32 copy and "
            "the cross-entropy's fp32 buffers), whatever the strategy or checkpointing; a pipeline's on its last "
            "stage, of every micro-batch under GPipe"
        )
    if m["adapters"]:
        lines.append(_adapters_line(m["adapters"], m["num_params"], s["mixed_precision"]))
    lines += [f"note: {note}" for note in plan.get("notes", [])]
    return "\n".join(lines + [""] + _render_table(plan["strategies"], lm) + [""] + _render_choice(plan))


def _adapters_line(a: dict, num_params: int, precision: str) -> str:
    trainable = a["lora_params"] + a["head_params"]
    return (
        f"adapters: r={a['spec']['r']} on {','.join(a['spec']['target_modules'])}"
        f"{' + the head trained in full' if a['head_params'] else ''}: {trainable:,} trainable parameters "
        f"({100 * trainable / num_params:.2f}%; DoRA +{a['magnitude_params']:,}), the only ones with gradients and "
        f"AdamW states; the base frozen in {'fp32' if precision == 'no' else precision} (QLoRA: "
        f"{a['quantized_params'] / 1e6:,.1f}M weights in 4-bit NF4, the rest in fp32)"
    )


COLUMNS = (
    "strategy",
    "time",
    "params",
    "grads",
    "optim",
    "activ",
    "logits",
    "overhd",
    "GPU total",
    "CPU/node",
    "max mb",
    "fits",
)


def _render_table(rows: list[dict], logits: bool) -> list[str]:
    """The table of candidates under two titles, full fine-tuning and adapters; the logits column only for a
    language model."""
    shown = [i for i, name in enumerate(COLUMNS) if logits or name != "logits"]
    table = [[row[i] for i in shown] for row in [COLUMNS] + [_table_row(r) for r in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(shown))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    body = lines[1:]
    titles = (
        (lambda r: r["peft"] != "none", "adapters under DDP (recommended only if no full fine-tuning fits):"),
        (
            lambda r: r["pipeline"] is not None,
            "pipeline + data parallel (--training_type pipeline): pp processes per pipeline, v stages each, M "
            "micro-batches per step, time x (1 + bubble (pp - 1)/(v*M)); memory of the process that needs the most:",
        ),
    )
    for starts, title in titles:  # rows list data-parallel full fine-tuning first, then pipelines, then adapters
        first = next((i for i, row in enumerate(rows) if starts(row)), None)
        if first is not None:
            body.insert(first, title)
    return [lines[0], "full fine-tuning (every weight trains):"] + body


def _table_row(r: dict) -> tuple:
    e = r["estimate"]
    return (
        "  " + r["label"],
        f"{r['relative_step_time']:.2f}",
        _size(e["parameters"]),
        _size(e["gradients"]),
        _size(e["optimizer_states"]),
        _size(e["activations"]),
        _size(e["logits"]),
        _size(e["overhead"]),
        _size(e["total"]),
        _size(e["cpu_per_node"]),
        str(r["max_micro_batch"]),
        "yes" if r["fits"] else "no",
    )


def _render_choice(plan: dict) -> list[str]:
    rec = plan["recommendation"]
    if rec is None:
        return [plan["message"], "What would fit:"] + [f"  - {idea}" for idea in plan["suggestions"]]
    lines = [
        f"Recommended: {rec['label']}, micro-batch {rec['micro_batch']}, gradient accumulation "
        f"{rec['gradient_accumulation_steps']}."
    ] + [f"  {reason}" for reason in rec["reasons"]]
    wrote = "Wrote " + ", ".join(rec["files"].values()) + ". " if rec["files"] else ""
    lines += [wrote + "Launch with:", f"  {rec['command']}"]
    return lines


def run(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
