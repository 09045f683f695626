"""The memory model: bytes per GPU (and CPU bytes per node) of one candidate at one micro-batch, and the largest
micro-batch that fits. The formulas, with their sources and measurements: docs/planner-formulas.md."""

from dataclasses import dataclass, replace

from cloudtrain.parallel.stages import balanced_split
from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.strategies import PIPELINE, Candidate, Setup, Strategy

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB
FRAGMENTATION = 0.05
MAX_MICRO_BATCH = 1 << 16
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # a 4-bit weight, its 8-bit absmax per 64 and fp32 absmax per 256 blocks


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
    if strategy.nvme:  # the states go to disk; CPU memory holds DeepSpeed's pinned swap buffers per process
        offloaded = swap_buffer_bytes(m, setup) * setup.world_size
    if strategy.zero_stage == 3:
        load = 4 * m.largest_module_params * setup.num_gpus  # zero.Init partitions layer by layer
    elif strategy.fsdp:
        load = 4 * P  # cpu_ram_efficient_loading: only rank 0 reads the weights
    else:
        load = 4 * P * setup.num_gpus
    return round(offloaded * per_node), load


def reference_bytes(m: ModelFacts) -> int:
    """A task's frozen copy of the model (a DPO reference under full fine-tuning): the weights as loaded (fp32),
    whole in every process."""
    return 4 * m.num_params if m.model_copy else 0


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


def estimate(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Estimate:
    """Memory per GPU of one candidate at one micro-batch (a pipeline's: of its busiest process)."""
    if cand.pipeline:
        return max(rank_estimates(m, cand, setup, micro_batch), key=lambda e: e.total)
    full = cand.peft == "none"
    params, grads, optim = (
        model_state_bytes(m, cand.strategy, setup) if full else adapter_state_bytes(m, cand.peft, setup)
    )
    params += reference_bytes(m) if full else 0
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
    disk = nvme_bytes(m, cand.strategy, setup) if full else 0
    return Estimate(params, grads, optim, activations, overhead, offloaded, load, logits, disk)


def _activations(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> int:
    if cand.peft != "none":
        return sum(
            adapter_activation_bytes(m, cand.peft, micro_batch, setup.max_length, setup.half, cand.checkpointing)
        )
    residual = _residual_bytes(cand.strategy, setup)
    return sum(activation_bytes(m, micro_batch, setup.max_length, setup.half, cand.checkpointing, residual))


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
    per_layer, outside, working = _layer_terms(m, micro_batch, seq, setup.half)
    hidden = _residual_bytes(PIPELINE, setup) * seq * micro_batch * m.hidden_size  # one micro-batch's hidden states
    largest = replace(m, num_layers=max(len(ranges[s]) for s in ids))
    saved, working = _stacked(largest, per_layer, outside if first or last else 0, working, cand.checkpointing, hidden)
    activations = pipe.in_flight(rank) * saved + working
    kept = pipe.microbatches if pipe.schedule == "gpipe" else 1  # micro-batches whose loss awaits its backward
    logits = last * kept * logits_bytes(m, micro_batch, seq, setup.half)
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
    """The largest micro-batch that fits (0 if none); memory grows monotonically with it."""
    if not fits(estimate(m, cand, setup, 1), setup):
        return 0
    lo, hi = 1, MAX_MICRO_BATCH
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(estimate(m, cand, setup, mid), setup) else (lo, mid - 1)
    return lo
