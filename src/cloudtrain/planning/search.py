"""The strategy search: which candidates exist for a model and set-up, the table's rows, the choice (full
fine-tuning first, then LoRA, then QLoRA; the fastest at the same global batch among those whose micro-batch keeps
each GPU as busy as the one asked for, at the largest micro-batch up to it); and the micro-batch a training run's
`auto` gets. Why, and what would fit when nothing does: cloudtrain.planning.reasons."""

import functools
import math
from dataclasses import asdict, dataclass, replace

from cloudtrain.config import PEFT_METHODS, PIPELINE_SCHEDULES, Config
from cloudtrain.hardware import resolve_precision
from cloudtrain.models.kernels import liger_auto_off, liger_available
from cloudtrain.parallel.distributed import Sharding, sharding
from cloudtrain.parallel.stages import balanced_split
from cloudtrain.paths import resolve_model_path
from cloudtrain.planning.communication import context_cost, step_traffic, tensor_cost
from cloudtrain.planning.facts import LoraSpec, ModelFacts, model_facts
from cloudtrain.planning.kernels import planned_kernels
from cloudtrain.planning.memory import (
    Estimate,
    estimate,
    fits,
    max_micro_batch,
    rank_estimates,
)
from cloudtrain.planning.strategies import (
    CONTEXT_FSDP,
    PIPELINE,
    STRATEGIES,
    TENSOR_FSDP,
    TENSOR_PARALLEL,
    Candidate,
    Pipeline,
    Setup,
    Strategy,
)
from cloudtrain.registry import TASKS, TRAINERS
from cloudtrain.tasks.base import Task

# Tokens each GPU computes per micro-step from which a smaller micro-batch than asked costs the step little: at a
# Llama-sized width (h = 4096) a matmul over 4096 tokens does about 4096/3 FLOPs per byte it reads, well above the
# ~300 at which an H100 stops waiting for memory, and FSDP's per-micro-batch gathers hide behind it. So a candidate
# that fits 1 row of 32k tokens per group of 8 (4096 tokens per GPU) is compared by its step time with those that
# fit the micro-batch asked, not ranked after them. A rule of thumb, as the relative step times are.
BUSY_TOKENS = 4096


@dataclass
class Row:
    candidate: Candidate
    estimate: Estimate  # at the requested micro-batch
    fits: bool  # at the requested micro-batch
    max_micro_batch: int
    pipeline: dict | None = None  # a pipeline row's layout (pipeline_layout)
    traffic: dict[str, int] | None = None  # bytes one process sends per optimizer step, by kind (step_traffic)


@dataclass
class Choice:
    candidate: Candidate
    micro_batch: int
    accumulation: int
    estimate: Estimate


# ---------------------------------------------------------------- the candidates and their rows


def pipeline_candidates(m: ModelFacts, setup: Setup, per_gpu: int, micro_batch: int) -> list[Candidate]:
    """Pipeline + data parallel for every pp dividing the GPUs and every schedule, with and without checkpointing,
    fastest first; none for a model the trainer cannot cut or under fp16. A pipeline takes pp x `per_gpu` examples
    per optimizer step, in micro-batches of `micro_batch`."""
    if m.stages is None or setup.mixed_precision == "fp16":
        return []
    world, rows = setup.world_size, []
    most = min(world, m.num_layers + 2)  # every stage holds a layer or an end: no more processes than that
    for pp in (d for d in range(2, most + 1) if world % d == 0):
        for schedule in PIPELINE_SCHEDULES:
            pipe = Pipeline(pp, schedule, pp * per_gpu // micro_batch, pp * per_gpu)
            problem = TRAINERS[PIPELINE.trainer].schedule_problem  # the pipeline trainer's own rule
            runs = problem(schedule, pp, pipe.stages_per_rank, pipe.microbatches) is None
            if runs and pipe.stages <= m.num_layers + 2:  # balanced_split gives every stage a layer, or an end
                rows += [Candidate(PIPELINE, gc, pipeline=pipe) for gc in (False, True)]
    return sorted(rows, key=lambda c: c.speed)


def no_pipeline(m: ModelFacts, setup: Setup) -> str:
    """Why pipeline_candidates has no row for this model and set-up."""
    if m.stages is None:
        return "--training_type pipeline cuts causal LMs of the Llama family and GPT-2 only"
    if setup.mixed_precision == "fp16":
        return "it trains in bf16 or fp32, not fp16"
    if setup.world_size < 2:
        return "it needs at least 2 GPUs"
    return "no pipeline size divides the GPUs with a micro-batch count its schedules accept"


def degrees(setup: Setup) -> list[int]:
    """Tensor- or context-parallel degrees planned: those above 1 that divide a node's GPUs (their collectives
    run on every layer, so they stay on one node's links)."""
    return [d for d in range(2, setup.num_gpus + 1) if setup.num_gpus % d == 0]


def tensor_candidates(m: ModelFacts, setup: Setup) -> list[Candidate]:
    """TP groups replicated and TP x FSDP2 for every degree the model divides, with and without checkpointing;
    none without a plan or under what the application refuses beside --tensor_parallel_size."""
    plan = m.tensor_plan
    if plan is None or not m.decoder or no_tensor_parallel(m, setup):
        return []
    rows = [
        Candidate(strategy, gc, tensor_parallel=t, split_cost=tensor_cost(m, setup, t))
        for t in degrees(setup)
        if plan.divisor_problem(m, t) is None
        for strategy in (TENSOR_PARALLEL, TENSOR_FSDP)
        if not strategy.fsdp or setup.world_size > t  # FSDP2 over one process is the replicated row
        for gc in (False, True)
    ]
    return sorted(rows, key=lambda c: c.speed)


def no_tensor_parallel(m: ModelFacts, setup: Setup) -> str | None:
    """Why there are no tensor-parallel rows (the application's refusals that the plan can know), or None."""
    from cloudtrain.parallel.tensor import supported_tasks

    if not m.decoder:
        return None  # a classifier: tensor parallelism is for decoders, nothing to say
    if m.tensor_plan is None:
        return f"the {m.architecture} family has no tensor-parallel plan in transformers"
    if not TASKS[m.task].tensor_parallel:
        return f"--tensor_parallel_size runs --task {', '.join(supported_tasks())} only"
    if setup.mixed_precision == "fp16":
        return "--tensor_parallel_size needs bf16 or fp32, not fp16"
    if setup.fused_loss_asked:
        return "--tensor_parallel_size refuses --fused_cross_entropy true (its LM head is split)"
    if setup.liger_asked:
        return "--tensor_parallel_size refuses --liger_kernels true (its kernels are not tested on DTensors)"
    if m.from_config:
        return (
            "--tensor_parallel_size loads a saved model sharded, not one built from --model_config: save the model "
            "built from the config first and plan for its folder"
        )
    if setup.num_gpus < 2:
        return "tensor parallelism needs at least 2 GPUs on a node"
    problems = [m.tensor_plan.divisor_problem(m, t) for t in degrees(setup)]
    if all(problems):
        return "no degree dividing the GPUs per node splits the model: " + "; ".join(p for p in problems if p)
    return None


def context_candidates(m: ModelFacts, setup: Setup) -> list[Candidate]:
    """CP x FSDP2 (all-to-all attention, cloudtrain.parallel.sequence) for every degree that divides the model's
    heads and KV heads (each process attends with 1/cp of them), with and without checkpointing (a causal LM's, on
    GPUs). The rows' length need not divide: the run pads each row to a multiple of the degree."""
    if not m.decoder or setup.num_gpus < 2 or not TASKS[m.task].context_parallel or m.varlen_misfit:
        return []  # the run's own rules: the task decides (DPO's pair loss does not), and the varlen kernels' reach
    kv_heads = m.num_heads * m.kv_hidden_size // m.hidden_size
    rows = [
        Candidate(CONTEXT_FSDP, gc, context_parallel=c, split_cost=context_cost(m, setup, c))
        for c in degrees(setup)
        if m.num_heads % c == 0 and kv_heads % c == 0
        for gc in (False, True)
    ]
    return sorted(rows, key=lambda c: c.speed)


def row(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> Row:
    est = estimate(m, cand, setup, micro_batch)
    rows = (setup.step_rows or micro_batch) * cand.model_parallel  # a step's rows per data-parallel process
    steps = 1 if cand.pipeline else max(rows // micro_batch, 1)
    return Row(
        cand,
        est,
        fits(est, setup),
        max_micro_batch(m, cand, setup),
        pipeline_layout(m, cand, setup, micro_batch),
        step_traffic(m, cand, setup, micro_batch, steps),
    )


def pipeline_layout(m: ModelFacts, cand: Candidate, setup: Setup, micro_batch: int) -> dict | None:
    """A pipeline row's layout: its stages' layers, the process that needs the most, its bubble."""
    pipe = cand.pipeline
    if pipe is None:
        return None
    totals = [e.total for e in rank_estimates(m, cand, setup, micro_batch)]
    busiest = totals.index(max(totals))
    return {
        **asdict(pipe),
        "data_parallel_size": cand.mesh(setup).data_parallel,
        "stages_per_rank": pipe.stages_per_rank,
        "layers_per_stage": [len(r) for r in balanced_split(m.num_layers, pipe.stages)],
        "busiest_rank": busiest,
        "in_flight": pipe.in_flight(busiest),
        "bubble": round(pipe.bubble, 4),
        "rank_totals": totals,
    }


# ---------------------------------------------------------------- the choice


def micro_batch_options(requested: int, per_gpu_per_step: int) -> list[int]:
    """Micro-batches that divide the examples each GPU sees per optimizer step, largest first (its divisors, found
    up to its square root: a global batch of 10^8 took minutes counted down one by one; once per pair of numbers,
    as every row asks again)."""
    return list(_divisors_up_to(requested, per_gpu_per_step))


@functools.lru_cache(maxsize=1024)
def _divisors_up_to(requested: int, n: int) -> tuple[int, ...]:
    divisors = {d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k)}
    return tuple(sorted((b for b in divisors if b <= requested), reverse=True))


def gpu_tokens(cand: Candidate, setup: Setup, micro_batch: int) -> int:
    """Tokens of work each GPU does per micro-step: a TP/CP group's rows are shared by its processes (CP: 1/c of
    each row's tokens; TP: 1/t of each token's matmuls)."""
    return micro_batch * setup.max_length // cand.model_parallel


def busy_enough(cand: Candidate, setup: Setup, micro_batch: int, asked: int) -> bool:
    """Whether `micro_batch` keeps each GPU about as busy as `asked` (the largest micro-batch up to the one asked
    for, a group's rows for TP/CP): as many tokens per GPU per micro-step, or at least BUSY_TOKENS."""
    return gpu_tokens(cand, setup, micro_batch) >= min(gpu_tokens(cand, setup, asked), BUSY_TOKENS)


def accumulation(cand: Candidate, per_gpu: int, micro_batch: int) -> int:
    """Gradient accumulation steps that reach the global batch at `micro_batch` (0: it does not divide);
    a pipeline's step already passes its M micro-batches."""
    per_step = micro_batch * (cand.pipeline.microbatches if cand.pipeline else 1)
    rows = cand.pipeline.rows if cand.pipeline else per_gpu * cand.model_parallel  # a TP/CP group's rows together
    return rows // per_step if rows % per_step == 0 else 0


def fitting_micro_batches(m: ModelFacts, r: Row, setup: Setup, options: list[int], per_gpu: int) -> list[int]:
    """The micro-batches of `options` a row fits with an accumulation that reaches the global batch."""
    c = r.candidate
    return [
        b
        for b in options
        if b <= r.max_micro_batch
        and accumulation(c, per_gpu, b)
        and fits(estimate(m, c, setup, b), setup)  # a step of one micro-batch holds no gradients: not monotonic
    ]


def choose(m: ModelFacts, rows: list[Row], setup: Setup, requested: int, global_batch: int) -> Choice | None:
    """The first of `ranked_choices`, None when nothing fits."""
    ranked = ranked_choices(m, rows, setup, requested, global_batch)
    return ranked[0] if ranked else None


def ranked_choices(m: ModelFacts, rows: list[Row], setup: Setup, requested: int, global_batch: int) -> list[Choice]:
    """Every candidate that fits, best first: full fine-tuning before LoRA (DoRA) before QLoRA (adapters train a
    different model, so they are the fallback, not a speed-up); within one, the candidates that fit a micro-batch
    keeping each GPU as busy as the requested one (`busy_enough`), fastest first, then the rest, fastest first,
    each at the largest micro-batch it fits. Every candidate takes the same global batch (accumulation makes it
    up), so its relative step time compares them: a CP group fitting 1 row of 32k tokens (4k per GPU) without
    checkpointing beats ZeRO-3 with offload and checkpointing fitting 1 row per GPU. The first is the choice; the
    next are the fallbacks the plan lists."""
    per_gpu = global_batch // setup.world_size
    ranked: list[Choice] = []
    taken: set[int] = set()  # rows already ranked, by position
    for peft in PEFT_METHODS:
        tier = sorted(
            (i for i, r in enumerate(rows) if r.candidate.peft == peft), key=lambda i: rows[i].candidate.speed
        )
        for first_only in (True, False):
            for i in (i for i in tier if i not in taken):
                c = rows[i].candidate
                # a TP/CP group's processes share their rows: the micro-batch asked of each GPU, times the group
                options = micro_batch_options(requested * c.model_parallel, per_gpu * c.model_parallel)
                allowed = [b for b in options if busy_enough(c, setup, b, options[0])] if first_only else options
                fitting = fitting_micro_batches(m, rows[i], setup, allowed, per_gpu)
                if fitting:
                    b = fitting[0]
                    taken.add(i)
                    ranked.append(Choice(c, b, accumulation(c, per_gpu, b), estimate(m, c, setup, b)))
    return ranked


# ---------------------------------------------------------------- a training run's micro-batch


def run_strategy(shards: Sharding, cfg: Config | None = None) -> Strategy:
    """The strategy a training launch uses (ZeRO-1 with optimizer offload is estimated as ZeRO-1); FSDP2 by the
    launch's --fsdp_sharding_strategy, --fsdp_cpu_offload and --fsdp_reshard_after_forward."""
    if shards.fsdp:  # (no_shard, and hybrid_shard with one process per node: DDP, as the run trains them)
        return fsdp_strategy(cfg)
    stage = shards.zero_stage or None
    offload = (shards.offload_optimizer, shards.offload_param)
    same_stage = [s for s in STRATEGIES if s.zero_stage == stage and not s.fsdp]
    return next((s for s in same_stage if (s.offload_optimizer, s.offload_param) == offload), same_stage[0])


def fsdp_strategy(cfg: Config | None) -> Strategy:
    """The FSDP2 row of the options (the full-shard row without them), with their reshard_after_forward."""
    d = (cfg or Config()).distributed
    offload = d.fsdp_cpu_offload
    sharded = "full_shard" if offload else d.fsdp_sharding_strategy  # the offload row shards fully
    row = next(s for s in STRATEGIES if s.fsdp and s.offload_param == offload and s.fsdp_sharding == sharded)
    reshard = d.fsdp_reshard_after_forward
    return row if reshard is None else replace(row, reshard_after_forward=reshard)


def run_attention(attention: str | None, packing: str, task: str, precision: str) -> str | None:
    """The attention a run computes with: --attn_implementation, else the application's default for packed bfd
    rows of a decoder task in 16 bits on a GPU (varlen: no dense mask; cloudtrain.models.prepare), else None (the
    model's own: sdpa, with a dense mask for packed or padded decoder rows)."""
    if attention:
        return attention
    rows = packing if packing != "auto" else TASKS[task].default_packing
    return "varlen" if rows == "bfd" and TASKS[task].packed_attention and precision != "no" else None


def run_facts(m: ModelFacts, task: Task, cfg: Config, attention: str | None) -> ModelFacts:
    """The model's facts as a run trains it: with the attention it computes with (`run_attention`; the meta
    model's is sdpa, and eager keeps every layer's scores) and the frozen copy its task keeps (a DPO reference
    under full fine-tuning). `plan` and the pre-training check both take them from here: apart, the check had
    missed both (found in audit)."""
    return replace(m, model_copy=task.keeps_model_copy(cfg), attn_implementation=attention or m.attn_implementation)


def run_micro_batch(cfg: Config, num_labels: int, gpus_per_node: int, nodes: int, memory: int, seq_len: int) -> int:
    """The largest micro-batch the estimate fits into `memory` bytes per process for a training run's model,
    strategy, gradient checkpointing and adapters, at rows of `seq_len` tokens (0: none fits)."""
    m = cfg.model
    lora = LoraSpec(m.lora_r, tuple(m.lora_target_modules), m.lora_dropout)
    name = m.model_config or resolve_model_path(m)
    facts = model_facts(
        name, num_labels, m.trust_remote_code, cfg.training.task, bool(m.model_config), m.tokenizer_name_or_path, lora
    )
    candidate = Candidate(run_strategy(sharding(cfg), cfg), m.gradient_checkpointing, m.peft)
    precision = resolve_precision(cfg.training.mixed_precision)
    attention = run_attention(m.attn_implementation, cfg.data.packing, cfg.training.task, precision)
    task = TASKS[cfg.training.task](cfg)
    facts = run_facts(facts, task, cfg, attention)
    loss, modules = planned_kernels(
        m.fused_cross_entropy, m.liger_kernels, facts.model_type, task, liger_available(), liger_auto_off(cfg)
    )
    setup = Setup(
        gpus_per_node,
        nodes,
        memory,
        None,
        seq_len,
        cfg.training.mixed_precision,
        dense_mask=(attention or "sdpa") == "sdpa",
        fused_loss=loss,
        fused_modules=modules,
        target_length=task.target_length(cfg) if facts.encoder else None,  # (the source's length sized the decoder)
    )
    return max_micro_batch(facts, candidate, setup)
