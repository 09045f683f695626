"""The memory model: bytes per GPU (and CPU bytes per node) of one candidate at one micro-batch, and the largest
micro-batch that fits. The formulas, with their sources and measurements: docs/planner-formulas.md."""

from dataclasses import dataclass, replace

from cloudtrain.parallel.stages import balanced_split
from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.kernels import logits_bytes, shards_head
from cloudtrain.planning.strategies import PIPELINE, Candidate, Setup, Strategy

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB
FRAGMENTATION = 0.05
MAX_MICRO_BATCH = 1 << 16
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # a 4-bit weight, its 8-bit absmax per 64 and fp32 absmax per 256 blocks
STRATEGY_DDP = Strategy("ddp", "DDP", 1.0)


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
    logits: int = 0  # a decoder task: the logits and the loss's fp32 buffers
    nvme_per_node: int = 0  # ZeRO-Infinity: the offloaded states' swap files on local disk

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations + self.logits + self.overhead

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def cpu_per_node(self) -> int:
        return max(self.cpu_offloaded, self.cpu_load)


def model_state_bytes(m: ModelFacts, strategy: Strategy, setup: Setup) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) per GPU; see docs/planner-formulas.md for the formulas."""
    P, n = m.num_params, setup.world_size
    if strategy.fsdp:
        return _fsdp_states(m, strategy, setup)
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


def _fsdp_states(m: ModelFacts, strategy: Strategy, setup: Setup) -> tuple[int, int, int]:
    """FSDP2: fp32 shards over S processes (S: the strategy's shard degree), the units gathered in the compute
    dtype (the root and two layers; every layer with reshard_after_forward false), one layer's unsharded
    gradients; with CPU offload the shards, their gradients and AdamW states live in CPU memory."""
    P, S, c = m.num_params, strategy.shard_degree(setup), 2 if setup.half else 4
    gathered = c * (m.root_params + _gathered_layers(m, strategy) * m.layer_params)
    if strategy.offload_param:
        return gathered, c * m.layer_params, 0
    return 4 * P // S + gathered, 4 * P // S + c * m.layer_params, 8 * P // S


def _gathered_layers(m: ModelFacts, strategy: Strategy) -> int:
    """How many layers FSDP2 holds gathered at once: the one computing and the one prefetched, or with
    reshard_after_forward false every layer (an encoder-decoder's of both stacks, each counted at the larger
    decoder layer's size) from its forward to its backward."""
    if strategy.reshard_after_forward:
        return 2
    return m.num_layers + (m.encoder.num_layers if m.encoder else 0)


def _trainable_facts(m: ModelFacts) -> ModelFacts:
    """The adapters as a model of their own, for the strategies' formulas: spread evenly over the layers, the
    head (trained in full beside them) in the root."""
    a = m.adapters
    assert a is not None  # adapter candidates exist only with adapter facts
    T = a.trainable("dora")
    per_layer = a.lora_params // max(m.num_layers, 1)
    return replace(m, num_params=T, layer_params=per_layer, root_params=a.head_params, largest_module_params=per_layer)


def adapter_state_bytes(
    m: ModelFacts, peft: str, setup: Setup, strategy: Strategy | None = None
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) per GPU with adapters: the frozen base (whole, or sharded under
    ZeRO-3 and FSDP), then the trainable parameters under the strategy's own rule (DDP: 16 bytes each, and
    autocast's 16-bit copies of them)."""
    a = m.adapters
    assert a is not None  # adapter candidates exist only with adapter facts
    s = strategy or STRATEGY_DDP
    T = a.trainable(peft)
    base = frozen_base_bytes(m, peft, s, setup)
    if s.zero_stage is None and not s.fsdp:
        return round(base) + 4 * T, 4 * T + (2 * T if setup.half else 0), 8 * T
    trainable = _trainable_facts(m)
    params, grads, optim = model_state_bytes(replace(trainable, num_params=T), s, setup)
    return round(base) + params, grads, optim


def frozen_base_bytes(m: ModelFacts, peft: str, strategy: Strategy, setup: Setup) -> float:
    """The frozen base per GPU. LoRA/DoRA: every weight in the compute dtype. QLoRA: the 4-bit weights (NF4 with
    double quantisation) and the rest in fp32 under DDP (prepare_model_for_kbit_training upcasts them), in the
    compute dtype under ZeRO and FSDP (stored with bnb_4bit_quant_storage in that dtype, so one flat shard holds
    them all), plus one weight dequantised for its matmul. ZeRO-3 and FSDP shard it and gather it unit by unit."""
    a = m.adapters
    assert a is not None  # adapter candidates exist only with adapter facts
    c, P, Q = (2 if setup.half else 4), m.num_params, a.quantized_params
    if peft != "qlora":
        whole, per_weight_rest, layer_q, dequantised = float(c * P), c, 0.0, 0
    else:
        per_weight_rest = 4 if not strategy.shards else c
        whole = NF4_BYTES * Q + per_weight_rest * (P - Q)
        layer_q, dequantised = Q / max(m.num_layers, 1), 2 * a.largest_quantized
    S = strategy.shard_degree(setup)
    if S == 1 or not (strategy.fsdp or strategy.zero_stage == 3):
        return whole + dequantised
    layer = NF4_BYTES * layer_q + per_weight_rest * (m.layer_params - layer_q)
    if strategy.fsdp:  # the root and two layers gathered
        gathered = per_weight_rest * m.root_params + _gathered_layers(m, strategy) * layer
    else:  # ZeRO-3: the largest module gathered
        gathered = layer if peft == "qlora" else c * m.largest_module_params
    return whole / S + gathered + dequantised


def _attention_scores(m: ModelFacts, c: int) -> int:
    """Bytes per attention score eager attention keeps (0 for SDPA/flash: no s*s matrix)."""
    if _fused_attention(m):
        return 0
    return c + (1 + c if m.attention_dropout else 0)


def _fused_attention(m: ModelFacts) -> bool:
    return m.attn_implementation in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "varlen")


def _attention_bytes(m: ModelFacts, seq: int, c: int, dense_mask: bool, tp: int = 1) -> float:
    """Per token and layer, what the attention kernel keeps beyond q, k, v and its output: eager's s*s scores;
    a fused kernel's fp32 log-sum-exp per head and, given a dense mask, the additive bias it converts the
    boolean [b, 1, s, s] mask into (compute dtype, one per layer, kept for its backward); T5's relative positions
    make that mask per head. Tensor parallelism divides the heads, not the mask (one [b, 1, s, s] per process)."""
    if not _fused_attention(m):
        return m.num_heads * seq * _attention_scores(m, c) / tp
    if m.attention_bias:  # T5's relative positions: a float mask per head, made and kept by every layer
        return 4 * m.num_heads / tp + c * seq * m.num_heads / tp
    return 4 * m.num_heads / tp + (c * seq if dense_mask else 0)


def _kv_width(m: ModelFacts, dense_mask: bool) -> int:
    """The width of k and v as attention keeps them: grouped-query heads are repeated to every query head by
    eager attention, and by sdpa when a mask is given (transformers passes enable_gqa only without one)."""
    repeated = m.attn_implementation == "eager" or (dense_mask and m.attn_implementation == "sdpa")
    return (m.attention_width or m.hidden_size) if repeated else m.kv_hidden_size


def _norm_bytes(m: ModelFacts, half: bool, autocast32: bool, no_autocast: bool = False, fused: bool = False) -> int:
    """Bytes per element a norm keeps for the backward pass. A LayerNorm kernel: its input as it runs it, fp32
    (autocast casts a 16-bit input up) but for the 16-bit input under DeepSpeed's bf16 engine (`no_autocast`). An
    RMSNorm: its fp32 copy of the input and its normalised input (fp32 with fp32 weights, else the 16-bit cast
    its weight multiplies), T5's also the 16-bit input it scales itself; Liger's (`fused`) only its input."""
    c = 2 if half else 4
    if fused and m.rms_norm:
        return 4 if autocast32 or not half else c
    if not m.rms_norm:
        return c if half and no_autocast else 4
    if autocast32 or not half:
        return 8
    return 4 + c + (c if m.norm_scales_input else 0)


def _mlp_saved(m: ModelFacts, fused: bool) -> float:
    """Intermediate-sized tensors the MLP keeps: the activation's input (and what else it saves), its output and,
    gated, up's output and the product; Liger's SwiGLU (`fused`) keeps gate's and up's outputs, recomputing the
    activation, and the down projection its input."""
    if fused and m.gated_mlp:
        return 3
    return m.activation_saved + 1 + 2 * m.gated_mlp


def _ungated_output(m: ModelFacts) -> bool:
    """Whether the activation keeps its output and no gate's product keeps it already."""
    return m.activation_output_saved and not m.gated_mlp


def _own_output(m: ModelFacts, autocast32: bool) -> bool:
    """Whether an ungated MLP's activation keeps an output (ReLU's) that is not the down projection's input: a
    dropout comes between them, or T5's cast of it for its fp32 wo (under autocast, cast back)."""
    copied = m.intermediate_dropout or (m.fp32_down_projection and autocast32)
    return _ungated_output(m) and copied


def _stacked(
    m: ModelFacts, per_layer: float, outside: float, working: float, checkpointing: bool, residual: float
) -> tuple[int, int]:
    """(saved, working space) of the layer stack: every layer's activations, or with checkpointing the residual
    stream at each layer's input plus one layer recomputed in the backward pass."""
    if checkpointing:
        return round(m.num_layers * residual + outside), round(per_layer + working)
    return round(m.num_layers * per_layer + outside), round(working)


def _layer_terms(
    m: ModelFacts,
    micro_batch: int,
    seq: int,
    half: bool,
    autocast32: bool = False,
    dense_mask: bool = False,
    tp: int = 1,
    no_autocast: bool = False,
    fused_modules: bool = False,
) -> tuple[float, int, int]:
    """(per layer A, outside the layers E, backward working space W) of full fine-tuning, in bytes.
    no_autocast: 16-bit weights and no autocast (DeepSpeed's bf16 engine), the norms run on the 16-bit input.
    fused_modules: Liger's RMSNorm and SwiGLU (`_norm_bytes`, `_mlp_saved`); its RoPE keeps nothing more.
    autocast32: 16-bit autocast over fp32 weights (the residual stream and norms in fp32, every projection casting
    its own copy of its input); dense_mask: a [b, 1, s, s] mask given to sdpa (packed rows); tp: the tensor-parallel
    degree, which divides what lives inside attention and the MLP (q, k, v, their heads, the intermediate size),
    not the residual stream, the norms or the projections' inputs (no sequence parallelism in transformers' plan)."""
    c, h, inter, sb = (2 if half else 4), m.hidden_size, m.intermediate_size, seq * micro_batch
    mask = 1 if m.hidden_dropout else 0
    norm = _norm_bytes(m, half, autocast32, no_autocast, fused_modules)
    inputs = m.attention_inputs + m.mlp_inputs if autocast32 else 2
    per_token = (
        2 * norm * h  # what the two norms keep: their inputs (an RMSNorm also its normalised input)
        + c * inputs * h  # the projections' inputs: one per block, or under autocast each projection's own cast
        + c * (2 * (m.attention_width or h) + 2 * _kv_width(m, dense_mask)) / tp  # q, k, v as kept; the output
        + c * inter * _mlp_saved(m, fused_modules) / tp
        + inter * m.intermediate_dropout / tp  # dropout after the activation: its mask
        + c * inter * _own_output(m, autocast32) / tp
        + 2 * h * mask
        + _attention_bytes(m, seq, c, dense_mask, tp)
    )
    outside = sb * h * (norm + c + mask)  # the final norm's input and output, the head's input
    return sb * per_token, outside, round(c * sb * (h + inter / tp))


def activation_bytes(
    m: ModelFacts,
    micro_batch: int,
    seq: int,
    half: bool,
    checkpointing: bool,
    residual_bytes: int,
    autocast32: bool = False,
    dense_mask: bool = False,
    cross: float = 0.0,
    no_autocast: bool = False,
    fused_modules: bool = False,
) -> tuple[int, int]:
    """(saved for backward at the end of the forward pass, backward working space) per GPU; cross: a decoder
    layer's cross-attention (`cross_attention_bytes`); no_autocast: DeepSpeed's bf16 engine, fused_modules:
    Liger's (`_layer_terms`)."""
    per_layer, outside, working = _layer_terms(
        m, micro_batch, seq, half, autocast32, dense_mask, no_autocast=no_autocast, fused_modules=fused_modules
    )
    per_layer += cross
    if checkpointing and dense_mask:  # the boolean mask is an input of every checkpointed layer: kept whole
        outside += micro_batch * seq * seq
    return _stacked(m, per_layer, outside, working, checkpointing, residual_bytes * seq * micro_batch * m.hidden_size)


def adapter_activation_bytes(
    m: ModelFacts,
    peft: str,
    micro_batch: int,
    seq: int,
    half: bool,
    checkpointing: bool,
    dense_mask: bool = False,
    hidden_bytes: int | None = None,
    cross: float = 0.0,
) -> tuple[int, int]:
    """(saved for backward, backward working space) per GPU with adapters: the frozen linear layers keep no
    inputs, each adapter keeps its own copy of its input (cast to its dtype or dropped out) with the dropout
    mask (in fp32 without dropout, the input itself, once for the adapters that read it), and its r-wide middle;
    DoRA also keeps two output-sized tensors per adapted module. hidden_bytes: of the residual stream (default: 4
    for QLoRA, whose embeddings and norms DDP's preparation upcast, else c)."""
    a, h, inter, sb = m.adapters, m.hidden_size, m.intermediate_size, seq * micro_batch
    assert a is not None  # adapter candidates exist only with adapter facts
    c = 2 if half else 4
    hidden = hidden_bytes or (4 if peft == "qlora" else c)
    mask = 1 if m.hidden_dropout else 0
    # a dropped-out or cast copy of its input per adapter (PEFT casts a 16-bit input to the fp32 adapter's dtype,
    # autocast back); in fp32 without dropout, the tensors they read, once (q, k and v share one)
    shared = a.spec.dropout == 0 and hidden == c == 4 and a.layer_read
    inputs = a.layer_read if shared else a.layer_inputs
    adapters = (
        c * (inputs + a.layer_adapted * a.spec.r)
        + (a.layer_inputs if a.spec.dropout > 0 else 0)
        + (2 * c * a.layer_outputs if peft == "dora" else 0)
    )
    per_layer = (
        sb
        * (
            # frozen, the down projection keeps no input: ReLU's kept output counts on its own
            hidden * (2 * h + inter * (m.activation_saved + 2 * m.gated_mlp + _ungated_output(m)))
            + inter * m.intermediate_dropout
            + c * (2 * (m.attention_width or h) + 2 * _kv_width(m, dense_mask))
            + adapters
            + 2 * h * mask
            + _attention_bytes(m, seq, c, dense_mask)
        )
        + cross
    )
    outside = sb * h * (hidden + mask)  # the final norm's input: frozen, the embeddings' output needs no copy
    return _stacked(m, per_layer, outside, hidden * sb * (h + inter), checkpointing, hidden * sb * h)


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
    if strategy.fsdp:  # FSDP2's CPU offload: the fp32 shards, their gradients and AdamW states, per shard group
        offloaded = 16 * P * setup.world_size // strategy.shard_degree(setup) if strategy.offload_param else 0
    if strategy.nvme:  # the states go to disk; CPU memory holds DeepSpeed's pinned swap buffers per process
        offloaded = swap_buffer_bytes(m, setup) * setup.world_size
    if strategy.zero_stage == 3:
        load = 4 * m.largest_module_params * setup.num_gpus  # zero.Init partitions layer by layer
    else:  # every process loads the fp32 model (FSDP too: cloudtrain turns cpu_ram_efficient_loading off)
        load = 4 * P * setup.num_gpus
    return round(offloaded * per_node), load


def reference_bytes(m: ModelFacts, strategy: Strategy, setup: Setup) -> int:
    """A task's frozen copy of the model (a DPO reference under full fine-tuning) per GPU: the weights as loaded
    (fp32), whole in every process, or under FSDP2 sharded as the policy's parameters (its shard degree; in CPU
    memory with CPU offload), with no gradients or optimizer states. Its units are gathered only for its own
    forward, which ends (resharded) before the policy's backward: the gathered units are not counted."""
    if not m.model_copy:
        return 0
    if strategy.fsdp:
        return 0 if strategy.offload_param else 4 * m.num_params // strategy.shard_degree(setup)
    return 4 * m.num_params


def reference_cpu_bytes(m: ModelFacts, strategy: Strategy, setup: Setup) -> tuple[int, int]:
    """(offloaded, loading) per node of the frozen copy: FSDP2's CPU offload keeps its fp32 shards in CPU memory;
    every process copies the model as loaded before the trainer places it (two fp32 copies at once)."""
    if not m.model_copy:
        return 0, 0
    held = strategy.fsdp and strategy.offload_param
    offloaded = 4 * m.num_params * setup.num_gpus // strategy.shard_degree(setup) if held else 0
    return offloaded, 4 * m.num_params * setup.num_gpus


def swap_buffer_bytes(m: ModelFacts, setup: Setup) -> int:
    """One process's pinned buffers for ZeRO-Infinity: 5 parameter buffers of 1e8 elements (DeepSpeed's
    offload_param defaults) and 4 fp32 optimizer swap buffers of the largest module."""
    return 5 * 10**8 * (2 if setup.half else 4) + 4 * 4 * m.largest_module_params


def nvme_bytes(m: ModelFacts, strategy: Strategy, setup: Setup) -> int:
    """Per node: the swap files of the states ZeRO-Infinity offloads (as CPU offload would hold them)."""
    if not strategy.nvme:
        return 0
    P, p = m.num_params, 2 if setup.half else 4
    return round((16 * P + p * P) * setup.num_gpus / setup.world_size)


def group_setup(cand: Candidate, setup: Setup) -> Setup:
    """The set-up as one process of the candidate sees it: a tensor- or context-parallel group takes the rows of
    its processes together, so each step passes model_parallel times the examples per GPU."""
    if cand.model_parallel == 1 or setup.step_rows is None:
        return setup
    return replace(setup, step_rows=setup.step_rows * cand.model_parallel)


def estimate(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Estimate:
    """Memory per GPU of one candidate at one micro-batch (a pipeline's: of its busiest process)."""
    if cand.model_parallel > 1:
        return _split_estimate(m, cand, group_setup(cand, setup), micro_batch)
    if cand.pipeline:
        return max(rank_estimates(m, cand, setup, micro_batch), key=lambda e: e.total)
    full = cand.peft == "none"
    params, grads, optim = (
        model_state_bytes(m, cand.strategy, setup) if full else adapter_state_bytes(m, cand.peft, setup, cand.strategy)
    )
    params += reference_bytes(m, cand.strategy, setup) if full else 0
    sequences = micro_batch * m.sequences_per_row  # a pair task's rows each run two answers
    saved, working = _activations(m, cand, setup, sequences)
    activations = saved + working
    hidden = 4 if not setup.half or not cand.strategy.shards else 2  # the final norm's output: fp32 under autocast
    logits = logits_bytes(m, sequences, target_length(m, setup), setup.half, _loss_kernel(cand, setup), hidden)
    if full and not accumulating(setup, micro_batch) and not cand.strategy.zero_stage:
        grads -= min(_released_gradients(m, cand.strategy, setup), saved + logits)
    if full:
        trainable = m.num_params
    else:
        assert m.adapters is not None  # adapter candidates exist only with adapter facts
        trainable = m.adapters.trainable(cand.peft)
    overhead = overhead_bytes(m, cand.strategy, setup, params + grads + optim + activations + logits, trainable)
    # with adapters each process loads its whole base as it will hold it (in 16 bits, or quantising as it goes)
    if full:
        offloaded, load = cpu_bytes(m, cand.strategy, setup)
        copy_offloaded, copy_load = reference_cpu_bytes(m, cand.strategy, setup)
        offloaded, load = offloaded + copy_offloaded, load + copy_load
    else:
        whole = frozen_base_bytes(m, cand.peft, cand.strategy, replace(setup, num_gpus=1, num_nodes=1))
        offloaded, load = 0, round(whole) * setup.num_gpus
    disk = nvme_bytes(m, cand.strategy, setup) if full else 0
    return Estimate(params, grads, optim, activations, overhead, offloaded, load, logits, disk)


def tensor_local(m: ModelFacts, tp: int) -> ModelFacts:
    """The model as one process of a tensor-parallel group holds it: the plan's projections (and an untied LM
    head) divided by tp; embeddings and norms whole."""
    plan = m.tensor_plan
    assert plan is not None  # tensor-parallel candidates exist only with a plan
    layer_cut = plan.layer_split_params - plan.layer_split_params // tp
    head_cut = plan.head_split_params - plan.head_split_params // tp
    layer, root = m.layer_params - layer_cut, m.root_params - head_cut
    return replace(m, num_params=m.num_layers * layer + root, layer_params=layer, root_params=root)


def _split_states(m: ModelFacts, cand: Candidate, setup: Setup) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer states) of one process of a tensor- or context-parallel candidate.
    TP (transformers' loading): fp32 weights under autocast, whose 16-bit copies of every matmul weight are held
    from forward to backward; replicated groups hold their share whole, --fsdp shards it over world/tp processes
    (FSDP2 without a mixed-precision policy: the gathered units in fp32). CP: accelerate's FSDP2 over every process."""
    if cand.context_parallel > 1:
        return _fsdp_states(m, cand.strategy, setup)
    local, half = tensor_local(m, cand.tensor_parallel), setup.half
    held, casts = local.num_params, (2 * (local.num_params - _embedding_params(m)) if half else 0)
    if not cand.strategy.fsdp:
        return 4 * held, 4 * held + casts, 8 * held
    S = setup.world_size // cand.tensor_parallel
    gathered = 4 * (local.root_params + 2 * local.layer_params)
    return 4 * held // S + gathered, 4 * held // S + 4 * local.layer_params + casts, 8 * held // S


def _embedding_params(m: ModelFacts) -> int:
    """The input embeddings: looked up, not multiplied, so autocast keeps no copy of them."""
    return m.stages.embedding_params if m.stages else 0


def _split_activations(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> tuple[int, int, int]:
    """(saved, working space, logits) of one process. TP: attention's and the MLP's tensors divided by tp
    (_layer_terms), under autocast over fp32 weights; the logits whole (the LM head gathers its output). CP: every
    per-token term at s/cp tokens, no dense mask (the varlen kernels take the documents' lengths), the logits of
    its tokens, and the extra buffers of the all-to-all (Ulysses) attention: the whole rows' q, k, v and output for
    heads/cp of the heads are as large as its own tokens' for every head (what the per-token terms count), and the
    layer being computed holds each exchange's contiguous send buffer and what it receives, in the forward and again
    (the gradients) in the backward."""
    tp, cp, b, s = cand.tensor_parallel, cand.context_parallel, micro_batch, setup.max_length
    if tp > 1:
        autocast32, dense = setup.half, _dense_mask(m, setup)
        per_layer, outside, working = _layer_terms(m, b, s, setup.half, autocast32, dense, tp)
        if cand.checkpointing and dense:
            outside += b * s * s
        residual = 4 * s * b * m.hidden_size  # fp32: autocast over fp32 weights, or fp32 itself
        saved, working = _stacked(m, per_layer, outside, working, cand.checkpointing, residual)
        return saved, working, logits_bytes(m, b, s, setup.half)
    c, tokens = (2 if setup.half else 4), -(-s // cp)  # the run pads each row to a multiple of cp
    per_layer, outside, working = _layer_terms(m, b, tokens, setup.half, False, False)
    saved, working = _stacked(m, per_layer, outside, working, cand.checkpointing, c * tokens * b * m.hidden_size)
    exchanged = 2 * c * b * tokens * (2 * m.hidden_size + 2 * m.kv_hidden_size)  # q, k, v, out: sent and received
    hidden = 2 if setup.half else 4
    return saved, working + exchanged, logits_bytes(m, b, tokens, setup.half, None, hidden)


def _split_estimate(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Estimate:
    """Memory per GPU of a tensor- or context-parallel candidate (docs/planner-formulas.md)."""
    params, grads, optim = _split_states(m, cand, setup)
    saved, working, logits = _split_activations(m, cand, setup, micro_batch)
    if not accumulating(setup, micro_batch):  # the fp32 gradients come as the activations go
        held = tensor_local(m, cand.tensor_parallel).num_params if cand.tensor_parallel > 1 else m.num_params
        shards = setup.world_size // cand.tensor_parallel if cand.strategy.fsdp else 1
        grads -= min(4 * held // shards, saved + logits)
    # replicated tensor-parallel groups: transformers' FSDP2 of shard degree 1 reduces one unit's fp32 gradients
    replicas = setup.world_size // cand.model_parallel
    local = tensor_local(m, cand.tensor_parallel) if cand.tensor_parallel > 1 else m
    buffers = 4 * local.layer_params if replicas > 1 and not cand.strategy.fsdp else 0
    rest = params + grads + optim + saved + working + logits
    overhead = round(CUDA_CONTEXT_BYTES + buffers + FRAGMENTATION * rest)
    offloaded, load = cpu_bytes(m, cand.strategy, setup)
    if cand.tensor_parallel > 1:  # transformers shards as it loads: each process reads only its share, in fp32
        load = 4 * local.num_params * setup.num_gpus
    return Estimate(params, grads, optim, saved + working, overhead, offloaded, load, logits)


def accumulating(setup: Setup, micro_batch: int) -> bool:
    """Whether a step passes several micro-batches, so that one's gradients are held while the next runs forward
    (unknown: assumed)."""
    return setup.step_rows is None or micro_batch < setup.step_rows


def _released_gradients(m: ModelFacts, strategy: Strategy, setup: Setup) -> int:
    """The fp32 gradients that do not exist when a step of one micro-batch starts its backward pass: the trainers
    set them to None after each optimizer step, and the backward allocates them layer by layer as it frees the
    activations. The step's peak is where the backward starts (activations and the loss's buffers held) or where
    it ends (every gradient held): the larger of the two, so at most the saved bytes are released."""
    if strategy.fsdp:
        return 0 if strategy.offload_param else 4 * m.num_params // strategy.shard_degree(setup)
    return 4 * m.num_params  # DDP; ZeRO keeps its gradient partitions and buckets allocated


def _loss_kernel(cand: Candidate, setup: Setup) -> str | bool | None:
    """The fused loss of this row: none where the LM head's weight is sharded (`shards_head`). A pipeline's last
    stage keeps its head whole (`_rank_estimate`)."""
    return None if shards_head(cand) else setup.fused_loss


def _dense_mask(m: ModelFacts, setup: Setup) -> bool:
    """A decoder's packed rows under sdpa: transformers builds a dense mask from the restarting position_ids."""
    return setup.dense_mask and m.decoder and m.attn_implementation == "sdpa"


def _activations(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> tuple[int, int]:
    """(saved for backward, backward working space) of the candidate. An encoder-decoder: its encoder's stack
    over the source (--max_length), its decoder's over the target (--max_target_length) with cross-attention;
    padded rows give each attention a mask."""
    if m.encoder is None:
        return _stack_activations(m, cand, setup, micro_batch, setup.max_length, _dense_mask(m, setup))
    source, target = setup.max_length, target_length(m, setup)
    encoder = _stack_activations(m.encoder, cand, setup, micro_batch, source, True)
    casts = _autocast32(cand, setup) and cand.peft == "none"  # (an adapter's frozen base is in c already)
    cross = cross_attention_bytes(m, micro_batch, target, source, setup.half, casts, _no_autocast(cand, setup))
    if cand.peft != "none":  # the cross-attention's k and v adapters: counted per target token, kept per source one
        cross += (source - target) * micro_batch * _cross_adapters(m, setup.half)
    decoder = _stack_activations(m, cand, setup, micro_batch, target, True, cross)
    kept = _checkpointed_inputs(m, cand, setup, micro_batch, target) if cand.checkpointing else 0
    return encoder[0] + decoder[0] + kept, max(encoder[1], decoder[1])


def _cross_adapters(m: ModelFacts, half: bool) -> float:
    """Per token, what a decoder layer's cross-attention k and v adapters keep (their inputs and r-wide middles)."""
    a, c = m.adapters, (2 if half else 4)
    assert a is not None  # adapter candidates exist only with adapter facts
    return c * (a.cross_inputs + a.cross_adapted * a.spec.r) + (a.cross_inputs if a.spec.dropout > 0 else 0)


def _checkpointed_inputs(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int, target: int) -> int:
    """What an encoder-decoder's checkpointed layers keep as inputs beyond the residual stream (one tensor each,
    shared by the layers): the decoder's padding mask over the source (bool), T5's fp32 position biases of the
    three attentions ([1, H, q, k]), and with adapters the encoder's output (full fine-tuning counts it already)."""
    source, h = setup.max_length, m.hidden_size
    kept = micro_batch * target * source
    if m.attention_bias:
        kept += 4 * m.num_heads * (source * source + target * target + target * source)
    if cand.peft != "none":
        kept += _adapter_hidden_bytes(cand, setup) * h * source * micro_batch
    return kept


def _stack_activations(
    m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int, seq: int, dense: bool, cross: float = 0.0
) -> tuple[int, int]:
    if cand.peft != "none":
        hidden = _adapter_hidden_bytes(cand, setup)
        return adapter_activation_bytes(
            m, cand.peft, micro_batch, seq, setup.half, cand.checkpointing, dense, hidden, cross
        )
    residual = _residual_bytes(cand.strategy, setup)
    autocast32, no_autocast = _autocast32(cand, setup), _no_autocast(cand, setup)
    return activation_bytes(
        m,
        micro_batch,
        seq,
        setup.half,
        cand.checkpointing,
        residual,
        autocast32,
        dense,
        cross,
        no_autocast,
        setup.fused_modules,
    )


def _adapter_hidden_bytes(cand: Candidate, setup: Setup) -> int:
    """Bytes of the hidden states next to adapters: QLoRA's residual stream is fp32 under DDP only
    (prepare_model_for_kbit_training); sharded, and with the other adapters, in the compute dtype."""
    return 4 if cand.peft == "qlora" and not cand.strategy.shards else (2 if setup.half else 4)


def _no_autocast(cand: Candidate, setup: Setup) -> bool:
    """16-bit weights without autocast: DeepSpeed's bf16 engine (accelerate turns autocast on for the others)."""
    return setup.half and cand.strategy.zero_stage is not None


def _autocast32(cand: Candidate, setup: Setup) -> bool:
    """16-bit autocast over fp32 weights: every process holds its weights whole (DDP, adapters' frozen base)."""
    return setup.half and not cand.strategy.shards


def target_length(m: ModelFacts, setup: Setup) -> int:
    """The tokens per row the LM head reads: an encoder-decoder's target length, else every token's."""
    return setup.target_length if m.encoder is not None and setup.target_length else setup.max_length


def cross_attention_bytes(
    m: ModelFacts, micro_batch: int, target: int, source: int, half: bool, autocast32: bool, no_autocast: bool = False
) -> float:
    """What a decoder layer's cross-attention keeps: per target token the block's norm input (and an RMSNorm's
    normalised input), q's input, q, the attention's output, the dropout mask and the attention's own over the
    source's keys (the padding mask, or T5's bias); per source token its k and v, and under autocast each
    projection's cast of the encoder's output (without, they read the one the encoder's final norm keeps).
    Measured against autograd in tests/test_planner_seq2seq.py."""
    c, h, q = (2 if half else 4), m.hidden_size, m.attention_width or m.hidden_size
    norm = _norm_bytes(m, half, autocast32, no_autocast)
    per_target = (norm + c) * h + 2 * c * q + (h if m.hidden_dropout else 0) + _attention_bytes(m, source, c, True)
    per_source = 2 * c * m.kv_hidden_size + (2 * c * h if autocast32 else 0)
    return micro_batch * (target * per_target + source * per_source)


def _residual_bytes(s: Strategy, setup: Setup) -> int:
    """Bytes of the residual stream: fp32 under autocast with fp32 weights (DDP, pipelines), else c."""
    return 4 if not s.shards or not setup.half else 2


def rank_estimates(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> list[Estimate]:
    """Memory of each process of a pipeline (candidate with a Pipeline) at micro-batch `micro_batch`."""
    assert cand.pipeline is not None  # a pipeline candidate
    return [_rank_estimate(m, cand, setup, micro_batch, rank) for rank in range(cand.pipeline.parallel_size)]


def _rank_estimate(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int, rank: int) -> Estimate:
    """Process `rank` of a pipeline: its stages' states, its micro-batches in flight, its receive buffers."""
    pipe, st, seq = cand.pipeline, m.stages, setup.max_length
    assert pipe is not None and st is not None  # pipeline candidates exist only with stage facts
    ranges, ids = balanced_split(m.num_layers, pipe.stages), pipe.stage_ids(rank)
    first, last = 0 in ids, pipe.stages - 1 in ids
    held = sum(len(ranges[s]) for s in ids) * m.layer_params + first * st.embedding_params + last * st.head_params
    params, grads, optim = model_state_bytes(replace(m, num_params=held), PIPELINE, setup)
    dense = _dense_mask(m, setup)
    per_layer, outside, working = _layer_terms(
        m, micro_batch, seq, setup.half, setup.half, dense, fused_modules=setup.fused_modules
    )
    hidden = _residual_bytes(PIPELINE, setup) * seq * micro_batch * m.hidden_size  # one micro-batch's hidden states
    largest = replace(m, num_layers=max(len(ranges[s]) for s in ids))
    saved, working = _stacked(largest, per_layer, outside if first or last else 0, working, cand.checkpointing, hidden)
    activations = pipe.in_flight(rank) * saved + working
    kept = pipe.microbatches if pipe.schedule == "gpipe" else 1  # micro-batches whose loss awaits its backward
    # its loss: the full logits, or the fused loss from the hidden states (PipelineTrainer._head_in_loss)
    residual = _residual_bytes(PIPELINE, setup)
    logits = last * kept * logits_bytes(m, micro_batch, seq, setup.half, setup.fused_loss, residual)
    receives = pipe.microbatches * hidden * sum((s > 0) + (s < pipe.stages - 1) for s in ids)
    # the gradients all-reduced across the data-parallel pipelines, as one flat copy
    flat = 4 * held if cand.mesh(setup).data_parallel > 1 else 0
    rest = params + grads + optim + activations + logits
    overhead = round(CUDA_CONTEXT_BYTES + receives + flat + FRAGMENTATION * rest)
    offloaded, load = cpu_bytes(m, PIPELINE, setup)  # every process builds the whole fp32 model, then frees the rest
    return Estimate(params, grads, optim, activations, overhead, offloaded, load, logits)


def fits(est: Estimate, setup: Setup) -> bool:
    cpu_ok = setup.cpu_memory_bytes is None or est.cpu_per_node <= setup.cpu_memory_bytes
    # an NVMe row fits only where a disk was given (--nvme_gb) and holds its swap files
    disk_ok = not est.nvme_per_node or (setup.nvme_memory_bytes or 0) >= est.nvme_per_node
    return est.total <= setup.gpu_memory_bytes and cpu_ok and disk_ok


def max_micro_batch(m: ModelFacts, cand: Candidate, setup: Setup) -> int:
    """The largest micro-batch that fits (0 if none). Memory grows monotonically with it, apart from the step of
    one micro-batch (step_rows), which holds no gradients at its peak: searched on each side of it."""
    whole = group_setup(cand, setup).step_rows  # a tensor- or context-parallel group's step takes its processes' rows
    if whole and not cand.pipeline and fits(estimate(m, cand, setup, whole), setup):
        return _largest_fitting(m, cand, setup, whole, MAX_MICRO_BATCH)
    top = MAX_MICRO_BATCH if not whole or cand.pipeline else max(whole - 1, 1)
    return _largest_fitting(m, cand, setup, 1, top) if fits(estimate(m, cand, setup, 1), setup) else 0


def _largest_fitting(m: ModelFacts, cand: Candidate, setup: Setup, lo: int, hi: int) -> int:
    """Binary search in [lo, hi] for the largest micro-batch that fits, lo known to fit."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(estimate(m, cand, setup, mid), setup) else (lo, mid - 1)
    return lo
