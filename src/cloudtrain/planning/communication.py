"""Communication volume per optimizer step: the bytes one process sends through its collectives, by kind (data
parallel, tensor parallel, context parallel, pipeline), with ring algorithms' volumes. The formulas and their
reasons: docs/planner-formulas.md ("Communication per step")."""

from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.memory import tensor_local
from cloudtrain.planning.strategies import Candidate, Setup

# FLOPs a GPU computes in the time one byte crosses one node's links: an H100 at about 40% of its 989 TFLOP/s
# (dense bf16) over NVLink at about 400 GB/s of all-reduce bus bandwidth. It prices the collectives that sit
# between a layer's matmuls and do not overlap with them (tensor parallelism's all-reduces, context parallelism's
# all-to-alls of q, k, v and the attention's output); a rule of thumb, not a measurement made here.
FLOPS_PER_LINK_BYTE = 1000


def layer_flops_per_token(m: ModelFacts, seq: int) -> float:
    """Training FLOPs of one token through one layer (forward and backward: 3 x 2 per weight, and causal attention's
    scores and weighted sum over half the sequence on average)."""
    return 6 * (m.layer_params + seq * m.hidden_size)


def tensor_cost(m: ModelFacts, setup: Setup, tp: int) -> float:
    """Time of tensor parallelism's all-reduces over the compute's, per GPU: per token and layer, four all-reduces of
    c x h bytes (two in the forward, two in the backward) against 1/tp of the layer's FLOPs."""
    c = 2 if setup.half else 4
    sent = 4 * all_reduce(c * m.hidden_size, tp)
    return sent * FLOPS_PER_LINK_BYTE / (layer_flops_per_token(m, setup.max_length) / tp)


def context_cost(m: ModelFacts, setup: Setup, cp: int) -> float:
    """Time of context parallelism's all-to-alls over the compute's: per token and layer, its q, k, v and the
    attention's output exchanged in the forward, their gradients in the backward, against the layer's FLOPs (each
    process computes its own tokens' projections, and the whole rows' attention for heads/cp of the heads)."""
    c = 2 if setup.half else 4
    sent = 2 * all_to_all(c * (2 * m.hidden_size + 2 * m.kv_hidden_size), cp)
    return sent * FLOPS_PER_LINK_BYTE / layer_flops_per_token(m, setup.max_length)


def all_reduce(size: float, n: int) -> float:
    """Bytes one process sends in a ring all-reduce of `size` bytes over n processes: reduce-scatter + all-gather."""
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def all_to_all(size: float, n: int) -> float:
    """Bytes one process sends in an all-to-all of its `size` bytes over n processes: all but its own 1/n."""
    return (n - 1) / n * size if n > 1 else 0.0


def all_gather(size: float, n: int) -> float:
    """Bytes one process sends in a ring all-gather (or reduce-scatter) of `size` bytes in all over n processes."""
    return (n - 1) / n * size if n > 1 else 0.0


def step_traffic(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int, accumulation: int) -> dict[str, int]:
    """{kind: bytes} one process sends per optimizer step of `accumulation` micro-batches of `micro_batch` rows."""
    k, c = max(accumulation, 1), 2 if setup.half else 4
    tokens = micro_batch * setup.max_length
    traffic = {"data": _data(m, cand, setup, k, c)}
    if cand.tensor_parallel > 1:
        t = cand.tensor_parallel
        # two all-reduces of the hidden states per layer in the forward (after o and down), two in the backward
        # (before q/k/v and gate/up), two more when checkpointing recomputes the forward; the LM head gathers its
        # vocabulary columns (colwise_gather_output)
        per_layer = (4 + 2 * cand.checkpointing) * all_reduce(c * tokens * m.hidden_size, t)
        head = all_gather(c * tokens * m.vocab_size, t) if m.tensor_plan and m.tensor_plan.head_split_params else 0
        traffic["tensor"] = k * (m.num_layers * per_layer + head)
    if cand.context_parallel > 1:
        cp = cand.context_parallel
        # each layer exchanges its tokens' q, k, v and the attention's output (all-to-all: sequence for heads and
        # back) in the forward, their gradients in the backward, the forward again when checkpointing recomputes it
        own = c * micro_batch * -(-setup.max_length // cp) * (2 * m.hidden_size + 2 * m.kv_hidden_size)  # rows widened
        traffic["context"] = k * m.num_layers * (2 + cand.checkpointing) * all_to_all(own, cp)
    if cand.pipeline:
        pipe = cand.pipeline
        # each stage boundary sends one micro-batch's hidden states forward and their gradients back (fp32)
        traffic["pipeline"] = pipe.microbatches * 2 * 4 * tokens * m.hidden_size * pipe.stages_per_rank
    return {kind: round(size) for kind, size in traffic.items()}


def _data(m: ModelFacts, cand: Candidate, setup: Setup, k: int, c: int) -> float:
    """Data-parallel traffic: DDP all-reduces the fp32 gradients once per step; ZeRO-1/2 reduce-scatter them each
    micro-batch and all-gather the updated weights; ZeRO-3 and FSDP all-gather the weights in the forward and
    the backward and reduce-scatter the gradients, every micro-batch (shard grad-op gathers once); a replicated
    tensor-parallel group all-reduces its share each micro-batch (FSDP2 of shard degree 1)."""
    s, world = cand.strategy, setup.world_size
    dp = cand.mesh(setup).data_parallel
    if cand.peft != "none":
        assert m.adapters is not None  # adapter candidates exist only with adapter facts
        trained = m.adapters.trainable(cand.peft)
        return all_reduce(4 * trained, world) if not s.shards else k * all_gather(4 * trained, world) * 2
    if cand.pipeline:
        held = m.num_params / cand.pipeline.parallel_size  # about its share of the layers
        return all_reduce(4 * held, dp)
    if cand.tensor_parallel > 1:
        held = tensor_local(m, cand.tensor_parallel).num_params
        if not s.fsdp:
            return k * all_reduce(4 * held, dp)
        return k * 3 * all_gather(4 * held, dp)  # fp32: transformers' FSDP2 without a mixed-precision policy
    P = m.num_params
    if s.fsdp:
        shard = s.shard_degree(setup)  # context parallel: FSDP2 over every process, its cp dimension included
        if shard == 1:
            return k * all_reduce(4 * P, dp)
        gathers = 1 if not s.reshard_after_forward else 2
        across = all_reduce(4 * P / shard, world // shard)  # hybrid: the shards' gradients across the nodes
        return k * ((gathers + 1) * all_gather(c * P, shard) + across)
    if s.zero_stage is None:
        return all_reduce(4 * P, world)
    p = 2 if setup.half else 4
    if s.zero_stage < 3:
        return k * all_gather(p * P, world) + all_gather(p * P, world)
    return k * 3 * all_gather(p * P, world)
