"""The strategy search: which candidates exist for a model and set-up, the table's rows, the choice (full
fine-tuning first, then LoRA, then QLoRA; the fastest at the same global batch among those whose micro-batch keeps
each GPU as busy as the one asked for, at the largest micro-batch up to it), why, and what would fit when nothing
does; and the micro-batch a training run's `auto` gets."""

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
    GIB,
    Estimate,
    estimate,
    fits,
    max_micro_batch,
    rank_estimates,
    reference_bytes,
)
from cloudtrain.planning.strategies import (
    CONTEXT_FSDP,
    PEFT_LABELS,
    PIPELINE,
    SCHEDULE_LABELS,
    STRATEGIES,
    TENSOR_FSDP,
    TENSOR_PARALLEL,
    Candidate,
    Pipeline,
    Setup,
    Strategy,
)
from cloudtrain.registry import TASKS, TRAINERS

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
    for pp in (d for d in range(2, world + 1) if world % d == 0):
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
    up to its square root: a global batch of 10^8 took minutes counted down one by one)."""
    divisors = {d for k in range(1, math.isqrt(per_gpu_per_step) + 1) if per_gpu_per_step % k == 0
                for d in (k, per_gpu_per_step // k)}  # fmt: skip
    return sorted((b for b in divisors if b <= requested), reverse=True)


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
                fitting = [
                    b
                    for b in allowed
                    if b <= rows[i].max_micro_batch
                    and accumulation(c, per_gpu, b)
                    and fits(
                        estimate(m, c, setup, b), setup
                    )  # a step of one micro-batch holds no gradients: not monotonic
                ]
                if fitting:
                    b = fitting[0]
                    taken.add(i)
                    ranked.append(Choice(c, b, accumulation(c, per_gpu, b), estimate(m, c, setup, b)))
    return ranked


def _fits_anything(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> bool:
    return any(fits(estimate(m, c, setup, 1), setup) for c in cands)


def _fits_without_copy(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> bool:
    """Whether full fine-tuning without the task's frozen copy fits one of `cands` whose strategy the run allows
    without it (--precompute_reference true: not under ZeRO-3 or FSDP)."""
    free = [c for c in cands if c.peft == "none" and c.strategy.key in m.copy_free]
    return m.model_copy and _fits_anything(replace(m, model_copy=False), setup, free)


def _copy_reason(m: ModelFacts, c: Candidate, setup: Setup) -> str:
    """Where the frozen reference copy lives in this row, and what would free it."""
    held = reference_bytes(m, c.strategy, setup) / GIB
    if not c.strategy.fsdp:
        where = f"whole in every process ({held:.1f} GiB, in the parameters)"
    elif c.strategy.offload_param:
        where = "sharded as the policy's parameters, in CPU memory (offloaded)"
    else:
        degree = c.strategy.shard_degree(setup)
        where = f"sharded as the policy's parameters over {degree} process(es) ({held:.1f} GiB, in the parameters)"
    free = (
        "--precompute_reference true or --peft lora would free it"
        if c.strategy.key in m.copy_free
        else "--peft lora would free it (--precompute_reference true runs under DDP or ZeRO-1/2 only)"
    )
    return f"The reference is a frozen fp32 copy of the model {where}; {free}."


def _fewest_nodes(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> int | None:
    """The fewest nodes, up to 64 times this many, on which something fits, by halving the gap (more nodes shard
    more; one by one took minutes on a plan of 64 nodes)."""
    low, high = setup.num_nodes, setup.num_nodes * 64
    if not _fits_anything(m, replace(setup, num_nodes=high), cands):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if _fits_anything(m, replace(setup, num_nodes=middle), cands) else (middle, high)
    return high


def suggestions(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> list[str]:
    """What would make the smallest of `cands` (at micro-batch 1) fit."""
    leanest = min(cands, key=lambda c: estimate(m, c, setup, 1).total)
    smallest = estimate(m, leanest, setup, 1)
    ideas = [
        f"GPUs with at least {math.ceil(smallest.total / GIB)} GiB (the leanest option, {leanest.name}, needs "
        f"{smallest.total / GIB:.1f} GiB per GPU at micro-batch 1)"
    ]
    if nodes := _fewest_nodes(m, setup, cands):
        ideas.append(f"{nodes * setup.num_gpus} GPUs: --num_nodes {nodes} with {setup.num_gpus} GPUs each")
    lengths = [s for s in (2**k for k in range(20)) if 2 <= s < setup.max_length]
    shorter = [s for s in lengths if _fits_anything(m, replace(setup, max_length=s), cands)]
    if shorter:
        ideas.append(f"a shorter sequence: --max_length {max(shorter)}")
    if m.encoder is not None and setup.target_length:  # an encoder-decoder's target: the decoder and the logits
        targets = [s for s in lengths if s < setup.target_length]
        fitting = [s for s in targets if _fits_anything(m, replace(setup, target_length=s), cands)]
        if fitting:
            ideas.append(f"a shorter target: --max_target_length {max(fitting)}")
    if not setup.half and _fits_anything(m, replace(setup, mixed_precision="bf16"), cands):
        ideas.append("--mixed_precision bf16 (halves the activations and, with DeepSpeed, the weights)")
    if setup.cpu_memory_bytes is not None and _fits_anything(m, replace(setup, cpu_memory_bytes=None), cands):
        ideas.append("more CPU memory per node for offloading (see the CPU/node column)")
    if _fits_without_copy(m, setup, cands):
        ideas.append(
            "--precompute_reference true (the reference's log-probabilities once, before training: no copy; "
            "DDP or ZeRO-1/2)"
        )
    disk = nvme_needed(m, setup, cands)
    if disk:
        ideas.append(
            f"a local NVMe disk of {math.ceil(disk / GIB)} GiB per node for ZeRO-Infinity's swap files "
            f"(--nvme_gb {math.ceil(disk / GIB)})"
        )
    return ideas


def nvme_needed(m: ModelFacts, setup: Setup, cands: list[Candidate]) -> int:
    """The NVMe disk per node that would make an NVMe row fit where none was given or it is too small (0: none
    would)."""
    unlimited = replace(setup, nvme_memory_bytes=2**62)
    rows = [c for c in cands if c.strategy.nvme and fits(estimate(m, c, unlimited, 1), unlimited)]
    if not rows:
        return 0
    need = min(estimate(m, c, unlimited, 1).nvme_per_node for c in rows)
    return need if setup.nvme_memory_bytes is None or need > setup.nvme_memory_bytes else 0


# ---------------------------------------------------------------- why


def reasons(
    m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup, requested: int, global_batch: int
) -> list[str]:
    """A few lines on why this candidate, this micro-batch and this accumulation."""
    c, gib, b = choice.candidate, setup.gpu_memory_bytes / GIB, choice.micro_batch
    lines = _adapter_reasons(m, rows, c, setup) + _faster_reason(m, rows, choice, setup, requested, global_batch)
    e = choice.estimate
    logits = f", logits {e.logits / GIB:.1f}" if e.logits else ""
    lines.append(
        f"{c.name} needs {e.total / GIB:.1f} of {gib:g} GiB per GPU at micro-batch {b} (model states "
        f"{e.model_states / GIB:.1f}, activations {e.activations / GIB:.1f}{logits} GiB); the largest "
        f"micro-batch it fits is {next(r.max_micro_batch for r in rows if r.candidate == c)}."
    )
    mp = c.model_parallel  # a TP/CP group: its processes' rows together
    largest = micro_batch_options(requested * mp, global_batch // setup.world_size * mp)[0]
    if b < largest and busy_enough(c, setup, b, largest):
        lines.append(_busy_reason(m, rows, choice, setup, requested, global_batch))
    else:
        lines += _micro_batch_reason(requested * mp, b, global_batch // setup.world_size * mp)
    if c.pipeline:
        lines += _pipeline_reasons(m, choice, setup, global_batch)
    elif c.model_parallel > 1:
        lines += _split_reasons(m, rows, choice, setup, global_batch)
    else:
        lines.append(
            f"{b} per GPU x {setup.world_size} GPUs x {choice.accumulation} accumulation step(s) = "
            f"global batch {global_batch}."
        )
    lines.append(_traffic_line(m, choice, setup))
    return lines + _cost_reasons(m, rows, choice, setup)


def _faster_reason(
    m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup, requested: int, global_batch: int
) -> list[str]:
    """Why not a faster candidate: over budget at the requested micro-batch, or (when it fits nothing) even at 1."""
    c, b = choice.candidate, choice.micro_batch
    faster = sorted(
        (r.candidate for r in rows if r.candidate.peft == c.peft and r.candidate.speed < c.speed), key=lambda f: f.speed
    )
    if not faster:
        return []
    at = b if b == micro_batch_options(requested, global_batch // setup.world_size)[0] else 1
    shown = ", ".join(f"{f.name} {estimate(m, f, setup, at * f.model_parallel).total / GIB:.1f}" for f in faster[:4])
    more = " (and more)" if len(faster) > 4 else ""
    gib = setup.gpu_memory_bytes / GIB
    return [f"Faster options need more than {gib:g} GiB per GPU at micro-batch {at}: {shown} GiB{more}."]


def _cost_reasons(m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup) -> list[str]:
    """What the choice costs beyond its memory: a context-parallel fallback not taken, recomputation, the frozen
    copy, offloading."""
    c, b, e = choice.candidate, choice.micro_batch, choice.estimate
    lines = []
    quicker = [  # context parallelism that fits, but fewer rows per group than asked: a fallback, named here
        r
        for r in rows
        if r.candidate.context_parallel > 1 and r.max_micro_batch and r.candidate.speed < c.speed and c.peft == "none"
    ]
    if quicker and c.context_parallel == 1:
        best = min(quicker, key=lambda r: r.candidate.speed)
        lines.append(
            f"{best.candidate.name} would fit with a relative step time of {best.candidate.speed:.2f}, at most "
            f"{best.max_micro_batch} row(s) per group of {best.candidate.context_parallel}; --strategy cp_fsdp "
            "chooses it."
        )
    if c.checkpointing:
        plain = estimate(m, replace(c, checkpointing=False), setup, b)
        lines.append(
            f"Gradient checkpointing recomputes each layer in the backward pass (about a third more "
            f"compute); without it activations need {plain.activations / GIB:.1f} GiB."
        )
    if m.model_copy and c.peft == "none":
        lines.append(_copy_reason(m, c, setup))
    if c.strategy.nvme:
        lines.append(
            f"ZeRO-Infinity keeps {e.nvme_per_node / GIB:.1f} GiB of swap files per node on the NVMe disk "
            f"(--nvme_path) and {e.cpu_per_node / GIB:.1f} GiB of pinned buffers in CPU memory; the AdamW step "
            "runs on the CPU, its states streamed from disk."
        )
    elif c.strategy.offload_optimizer:
        lines.append(
            f"Offloading needs {e.cpu_per_node / GIB:.1f} GiB of CPU memory per node and runs the AdamW "
            "step on the CPU."
        )
    return lines


def _busy_reason(
    m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup, requested: int, global_batch: int
) -> str:
    """Why a micro-batch below the one asked is taken: its GPUs stay busy, and at the same global batch it is
    faster than the fastest row that fits the micro-batch asked (named, when one does)."""
    c, b = choice.candidate, choice.micro_batch
    per_gpu = global_batch // setup.world_size
    unit = f"per group of {c.model_parallel}" if c.model_parallel > 1 else "per GPU"
    line = (
        f"{c.name} fits {b} row(s) {unit}, fewer than asked, but that is {gpu_tokens(c, setup, b):,} tokens per GPU "
        f"per micro-step (at least {BUSY_TOKENS:,} keep the matmuls large): at the same global batch, with gradient "
        f"accumulation, its relative step time is {c.speed:.2f}"
    )
    asked = [
        r.candidate
        for r in rows
        if r.candidate.peft == c.peft
        and r.max_micro_batch
        >= micro_batch_options(requested * r.candidate.model_parallel, per_gpu * r.candidate.model_parallel)[0]
    ]
    if not asked:
        return line + "; no option fits the micro-batch asked."
    best = min(asked, key=lambda a: a.speed)
    return line + f", against {best.speed:.2f} for the fastest that fits the micro-batch asked, {best.name}."


def _traffic_line(m: ModelFacts, choice: Choice, setup: Setup) -> str:
    """The bytes each process sends per optimizer step, by kind."""
    sent = step_traffic(m, choice.candidate, setup, choice.micro_batch, choice.accumulation)
    parts = ", ".join(f"{kind} parallel {size / GIB:.1f}" for kind, size in sent.items() if size)
    if not parts:  # one process: no gradients or shards to exchange
        return "No process sends anything to another in an optimizer step."
    return f"Each process sends about {sum(sent.values()) / GIB:.1f} GiB per optimizer step ({parts} GiB)."


def _split_reasons(m: ModelFacts, rows: list[Row], choice: Choice, setup: Setup, global_batch: int) -> list[str]:
    """What a tensor- or context-parallel group splits, why it was chosen over data parallelism alone, and the
    batch arithmetic (a group's processes take the same rows)."""
    c, b = choice.candidate, choice.micro_batch
    group, dp = c.model_parallel, setup.world_size // c.model_parallel
    # `rows` are those --strategy allows: pinned to a split, they hold no data-parallel row to compare with
    considered = [r for r in rows if r.candidate.model_parallel == 1 and not r.candidate.pipeline]
    plain = sorted(
        (r for r in considered if r.candidate.peft == "none" and r.max_micro_batch), key=lambda r: r.candidate.speed
    )
    lines = []
    if c.tensor_parallel > 1:
        lines.append(
            f"Tensor parallel {group}: each layer's q/k/v, o, gate/up and down projections (and the LM head's "
            f"vocabulary columns) are split over {group} processes, which take the same rows; attention's and the "
            "MLP's activations are divided by it, the residual stream, norms and logits are not"
            + (f"; FSDP2 shards each share over the {dp} data-parallel processes." if c.strategy.fsdp else ".")
        )
    else:
        lines.append(
            f"Context parallel {group}: each process holds 1/{group} of each row's {setup.max_length} tokens, so "
            f"activations and logits are divided by {group}; attention exchanges sequence for heads (all-to-all), "
            f"each process attending over whole rows with 1/{group} of the heads."
        )
    if plain:
        lines.append(
            f"The fastest data-parallel option that fits, {plain[0].candidate.name} (micro-batch up to "
            f"{plain[0].max_micro_batch}), has a relative step time of {plain[0].candidate.speed:.2f}; this one "
            f"{c.speed:.2f}, its collectives included ({c.split_cost:.1%} of its compute)."
        )
    elif considered:
        lines.append(
            "Data parallelism alone (DDP, ZeRO, FSDP2) fits no micro-batch here, not even 1 with checkpointing."
        )
    lines.append(
        f"{b} row(s) per group x {dp} group(s) x {choice.accumulation} accumulation step(s) = global batch "
        f"{global_batch}."
    )
    return lines


def _pipeline_reasons(m: ModelFacts, choice: Choice, setup: Setup, global_batch: int) -> list[str]:
    """The stages, the busiest process, the bubble and the batch arithmetic of a pipeline."""
    pipe, b = choice.candidate.pipeline, choice.micro_batch
    assert pipe is not None  # called for a pipeline
    layout = pipeline_layout(m, choice.candidate, setup, b)
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
    lines = []
    for earlier in PEFT_METHODS[: PEFT_METHODS.index(c.peft)]:
        tier = [r.candidate for r in rows if r.candidate.peft == earlier]
        if tier:
            leanest = min(tier, key=lambda t: _leanness(estimate(m, t, setup, 1)))
            label = PEFT_LABELS[earlier]
            lines.append(
                f"{label[0].upper() + label[1:]} does not fit: its leanest option, {leanest.name}, needs "
                f"{_over_budget(estimate(m, leanest, setup, 1), setup)} at micro-batch 1{_would_fit(m, setup, tier)}."
            )
    a = m.adapters
    assert a is not None  # adapter candidates exist only with adapter facts
    base = "4-bit NF4" if c.peft == "qlora" else setup.mixed_precision if setup.half else "fp32"
    lines.append(
        f"{PEFT_LABELS[c.peft]} trains {a.trainable(c.peft):,} parameters ({_share(m, c.peft)} of the "
        f"model: r={a.spec.r} adapters on {','.join(a.spec.target_modules)}"
        f"{' and the head' if a.head_params else ''}) on a frozen base in {base}; only they have "
        "gradients and AdamW states."
    )
    degree = c.strategy.shard_degree(setup)
    if degree > 1 and (c.strategy.fsdp or c.strategy.zero_stage == 3):
        qlora = c.peft == "qlora"
        storage = " (its 4-bit weights stored in the compute dtype: bnb_4bit_quant_storage)" if qlora else ""
        lines.append(f"{c.strategy.label} shards the frozen base over {degree} processes{storage}.")
    if c.peft == "qlora":
        lines.append("QLoRA needs CUDA GPUs and bitsandbytes.")
    return lines


def _would_fit(m: ModelFacts, setup: Setup, tier: list[Candidate]) -> str:
    """What would make a tier that does not fit fit: an NVMe disk, or no reference copy."""
    disk = nvme_needed(m, setup, tier)
    hint = f"; ZeRO-Infinity would with {math.ceil(disk / GIB)} GiB of NVMe disk per node (--nvme_gb)" if disk else ""
    if _fits_without_copy(m, setup, tier):
        hint += "; without the reference copy it would: --precompute_reference true"
    return hint


def _leanness(est: Estimate) -> tuple[int, int, int]:
    """GPU memory first; then a row that needs no NVMe disk; then the least CPU memory."""
    return est.total, est.nvme_per_node, est.cpu_per_node


def _over_budget(est: Estimate, setup: Setup) -> str:
    """What exceeds the budget: the GPU memory, or else the CPU memory per node."""
    if est.total > setup.gpu_memory_bytes:
        return f"{est.total / GIB:.1f} GiB per GPU (of {setup.gpu_memory_bytes / GIB:g})"
    if est.nvme_per_node and (setup.nvme_memory_bytes or 0) < est.nvme_per_node:
        given = f"of {setup.nvme_memory_bytes / GIB:g}" if setup.nvme_memory_bytes else "none given: --nvme_gb"
        return f"{est.nvme_per_node / GIB:.1f} GiB of NVMe disk per node ({given})"
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
