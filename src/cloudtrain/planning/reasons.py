"""Why the plan chose what it chose, and what would fit when nothing does: the reasons under the recommendation
(why not a faster candidate, why this micro-batch and accumulation, what the choice costs) and the nothing-fits
suggestions. cloudtrain.planning.search ranks and chooses."""

import math
from dataclasses import replace

from cloudtrain.config import PEFT_METHODS
from cloudtrain.planning.communication import step_traffic
from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.memory import GIB, Estimate, estimate, fits, reference_bytes
from cloudtrain.planning.search import (
    BUSY_TOKENS,
    Choice,
    Row,
    busy_enough,
    fitting_micro_batches,
    gpu_tokens,
    micro_batch_options,
    pipeline_layout,
)
from cloudtrain.planning.strategies import PEFT_LABELS, SCHEDULE_LABELS, Candidate, Setup

# ---------------------------------------------------------------- what would fit


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
    """What would make the smallest of `cands` (at micro-batch 1) fit: bigger GPUs only where the GPU is what
    limits (the leanest row in GPU memory among those whose CPU memory and disk fit), more CPU memory only where
    it is (the least a row needs per node among those whose GPU memory and disk fit)."""
    ideas = []
    big_gpus = replace(setup, gpu_memory_bytes=2**62)
    by_gpu = [(c, e) for c in cands if fits(e := estimate(m, c, setup, 1), big_gpus)]
    if by_gpu:
        leanest, smallest = min(by_gpu, key=lambda ce: ce[1].total)
        ideas.append(
            f"GPUs with at least {math.ceil(smallest.total / GIB)} GiB (the leanest option, {leanest.name}, needs "
            f"{smallest.total / GIB:.1f} GiB per GPU at micro-batch 1)"
        )
    if setup.cpu_memory_bytes is not None:
        more_cpu = replace(setup, cpu_memory_bytes=None)
        by_cpu = [(c, e) for c in cands if fits(e := estimate(m, c, setup, 1), more_cpu)]
        if by_cpu:
            leanest, smallest = min(by_cpu, key=lambda ce: ce[1].cpu_per_node)
            need = math.ceil(smallest.cpu_per_node / GIB)
            what = "to load the model" if smallest.cpu_load >= smallest.cpu_offloaded else "for what it offloads"
            ideas.append(
                f"{need} GiB of CPU memory per node, --cpu_memory_gb {need} (the leanest option in CPU memory, "
                f"{leanest.name}, needs {smallest.cpu_per_node / GIB:.1f} GiB per node {what})"
            )
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
    """Why not a faster candidate: fitting only micro-batches that keep each GPU less busy than `busy_enough`
    asks (the choice's does not); else over the GPU's memory at the requested micro-batch (the choice fits it),
    or at 1; else over the CPU memory or the disk per node."""
    c, b = choice.candidate, choice.micro_batch
    per_gpu = global_batch // setup.world_size
    faster = sorted(
        (r for r in rows if r.candidate.peft == c.peft and r.candidate.speed < c.speed), key=lambda r: r.candidate.speed
    )
    at = b if b == micro_batch_options(requested, per_gpu)[0] else 1
    over: list[tuple[Candidate, int]] = []  # (candidate, its memory per GPU at micro-batch `at`)
    idle: list[tuple[Candidate, int]] = []  # (candidate, tokens per GPU at the largest micro-batch it fits)
    elsewhere: list[str] = []  # a candidate and what it needs beyond the CPU memory or disk per node
    for r in faster:
        f, mp = r.candidate, r.candidate.model_parallel
        options = micro_batch_options(requested * mp, per_gpu * mp)
        fitting = fitting_micro_batches(m, r, setup, options, per_gpu)
        e = estimate(m, f, setup, at * mp)
        if fitting and not busy_enough(f, setup, fitting[0], options[0]):
            idle.append((f, gpu_tokens(f, setup, fitting[0])))
        elif e.total > setup.gpu_memory_bytes and (at == b or not fitting):
            over.append((f, e.total))
        elif not fits(e, setup):  # within the GPU's memory: over the CPU memory or the disk given
            elsewhere.append(f"{f.name} {_over_budget(e, setup)}")
    lines = []
    if over:
        shown = ", ".join(f"{f.name} {need / GIB:.1f}" for f, need in over[:4])
        more = " (and more)" if len(over) > 4 else ""
        gib = setup.gpu_memory_bytes / GIB
        lines.append(f"Faster options need more than {gib:g} GiB per GPU at micro-batch {at}: {shown} GiB{more}.")
    if elsewhere:
        more = " (and more)" if len(elsewhere) > 4 else ""
        lines.append(f"Faster options fit the GPU at micro-batch {at} but need: {'; '.join(elsewhere[:4])}{more}.")
    if idle:
        largest = micro_batch_options(requested * c.model_parallel, per_gpu * c.model_parallel)[0]
        least = min(gpu_tokens(c, setup, largest), BUSY_TOKENS)
        why = "too few to keep the matmuls large" if least == BUSY_TOKENS else "fewer than the micro-batch asked"
        shown = ", ".join(f"{f.name} {tokens:,}" for f, tokens in idle[:4])
        more = " (and more)" if len(idle) > 4 else ""
        lines.append(
            f"Faster options fit only micro-batches of fewer than {least:,} tokens per GPU per micro-step, {why}: "
            f"{shown} tokens at the largest each fits{more}."
        )
    return lines


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
    # CPU memory per node holds what is offloaded while training, and before that the model as it is loaded:
    # the larger of the two is what a node needs (the CPU/node column)
    loading = (
        f"; loading the model needs more, {e.cpu_load / GIB:.1f} GiB per node, before training"
        if e.cpu_load > e.cpu_offloaded
        else ""
    )
    if c.strategy.nvme:
        lines.append(
            f"ZeRO-Infinity keeps {e.nvme_per_node / GIB:.1f} GiB of swap files per node on the NVMe disk "
            f"(--nvme_path) and {e.cpu_offloaded / GIB:.1f} GiB of pinned buffers in CPU memory; the AdamW step "
            f"runs on the CPU, its states streamed from disk{loading}."
        )
    elif c.strategy.offload_optimizer:
        lines.append(
            f"Offloading keeps {e.cpu_offloaded / GIB:.1f} GiB per node in CPU memory and runs the AdamW step on "
            f"the CPU{loading}."
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
