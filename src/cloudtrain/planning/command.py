"""The `plan` command: estimate the memory per GPU of a training run and pick the distributed strategy.

    python src/training_application.py plan --model_name_or_path DIR_OR_HUB_ID --num_gpus 8 \\
        --gpu_memory_gb 24 --per_device_train_batch_size 8 --max_length 512 --mixed_precision bf16

The training options it takes (the model, the batch, the sequence length, the precision, the adapters) are the
application's own flags, with their help and defaults (cloudtrain.config.add_config_option); the rest say what
it plans for (GPUs, nodes, their memory) and narrow the search. How it estimates: docs/planner-formulas.md.
The options are cloudtrain.commands.plan's (parsed without importing the planner); `run` is the command once
they parsed.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

from cloudtrain import batch_size
from cloudtrain.assets import default_model_dir
from cloudtrain.config import (
    Config,
    TrainingConfig,
    build_config,
    differs_from_default,
)
from cloudtrain.config.inert import inert_notes, reads
from cloudtrain.errors import UserError, refuse_first
from cloudtrain.hardware import resolve_precision
from cloudtrain.hub_reach import HubId, check_hub_ids, looks_like_repo_id
from cloudtrain.models.adapters import qlora_refusal
from cloudtrain.models.diffusion import lora_targets as diffusion_lora_targets
from cloudtrain.models.diffusion import read_model_index
from cloudtrain.models.kernels import liger_installed, liger_knows
from cloudtrain.models.prepare import check_attention_name
from cloudtrain.parallel.context import ATTENTION_REFUSAL, attention_fits
from cloudtrain.parallel.distributed import Sharding
from cloudtrain.planning.accelerators import Gpu, gpu_by_name
from cloudtrain.planning.diffusion import STRATEGIES as PIPELINE_STRATEGIES
from cloudtrain.planning.diffusion import Training, is_pipeline, pipeline_facts, trainings
from cloudtrain.planning.diffusion import plan as pipeline_plan
from cloudtrain.planning.diffusion import render as render_pipeline
from cloudtrain.planning.facts import LoraSpec, ModelFacts, is_decoder, model_config_refusal, model_facts
from cloudtrain.planning.kernels import fuses_loss, planned_kernels, shards_head
from cloudtrain.planning.known_models import config_folder, known_name
from cloudtrain.planning.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, GIB
from cloudtrain.planning.reasons import reasons, suggestions
from cloudtrain.planning.report import choice_json, recommendation_json, render, row_json
from cloudtrain.planning.search import (
    context_candidates,
    degrees,
    micro_batch_options,
    no_pipeline,
    no_tensor_parallel,
    pipeline_candidates,
    ranked_choices,
    row,
    run_attention,
    run_facts,
    tensor_candidates,
)
from cloudtrain.planning.strategies import (
    ADAPTER_STRATEGIES,
    CHECKPOINTING_COST,
    PIPELINE,
    STRATEGIES,
    Candidate,
    Setup,
    candidates,
)
from cloudtrain.planning.writers import launch_command, write_configs
from cloudtrain.registry import TASKS
from cloudtrain.tasks.base import Task


def _check(args: argparse.Namespace) -> None:
    """What depends on the task, once cloudtrain.commands.plan.check_options checked the rest."""
    decoder = is_decoder(args.task)
    refuse_first(
        [
            (args.model_config and not decoder, model_config_refusal(args.task)),
            (
                decoder and not (args.model_config or args.model_name_or_path),
                f"--task {args.task} needs --model_name_or_path <causal LM> or --model_config <config.json or preset>",
            ),
            (
                args.model_config and args.peft not in ("auto", "none"),
                f"--peft {args.peft} trains adapters on pretrained weights, but --model_config builds a model with "
                "random weights; plan for a checkpoint with --model_name_or_path",
            ),
        ]
    )
    # the run's own refusal of a global batch the micro-batch does not divide, before the model is read: plan
    # lowered the micro-batch instead (32 under --global_batch_size 16), recommending flags the run refuses (audit)
    flags = ("per_device_train_batch_size", "global_batch_size")
    batch_size.check(build_config({name: getattr(args, name) for name in flags}), args.num_gpus * args.num_nodes)
    attention = args.attn_implementation
    if attention and attention != "flex_attention" and "/" not in attention:  # (flex: CUDA; a Hub kernel: theirs)
        check_attention_name(build_config({"attn_implementation": args.attn_implementation}))  # the run's own line


def _batch(args: argparse.Namespace, world: int) -> tuple[int, int]:
    """(the micro-batch asked for, the global batch). auto, as in training: the largest micro-batch that fits
    each GPU's share of the global batch (--global_batch_size, else the default micro-batch's)."""
    if args.per_device_train_batch_size == "auto":
        global_batch = args.global_batch_size or TrainingConfig().micro_batch * world  # the default micro-batch
        return global_batch // world, global_batch
    return args.per_device_train_batch_size, args.global_batch_size or args.per_device_train_batch_size * world


def task_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The task's own options given another value than their default, as launch flags: the estimate assumed them."""
    names = [n for n in ("preference_loss", "precompute_reference", "max_target_length") if reads(args.task, n)]
    cfg = build_config({name: getattr(args, name) for name in names})
    given = [(name, getattr(args, name)) for name in names if differs_from_default(cfg, name)]
    return tuple(part for name, value in given for part in (f"--{name}", str(value).lower()))


def sharding_refusal(task: Task, cfg: Config, c: Candidate) -> str | None:
    """The task's own refusal of the candidate's sharding with its adapters (what the run's check_options says)."""
    s = c.strategy
    shards = Sharding(s.zero_stage, s.offload_optimizer, s.offload_param, s.fsdp)
    adapted = replace(cfg, model=replace(cfg.model, peft=c.peft))
    return qlora_refusal(c.peft, s.zero_stage or 0, s.fsdp, cfg.training.mixed_precision) or task.sharding_refusal(
        adapted, shards
    )


def runnable(m: ModelFacts, task: Task, cfg: Config, c: Candidate) -> bool:
    """What the run would refuse: a pipeline for a task that cannot run in one, or a sharding the task refuses."""
    if c.pipeline and not task.runs_in_pipeline:
        return False
    if m.model_copy and c.peft == "none" and c.model_parallel > 1:
        return False  # the tensor- and context-parallel estimates do not count the frozen copy: no rows, not wrong ones
    return sharding_refusal(task, cfg, c) is None


def _fused_refusal(setup: Setup, c: Candidate) -> str | None:
    """The run's refusal of --fused_cross_entropy true on a row that shards the LM head (ZeRO-3, FSDP)."""
    if setup.fused_loss_asked and shards_head(c):
        return "--fused_cross_entropy true reads the LM head's weight whole, which ZeRO-3 and FSDP shard; use auto"
    return None


def _distinct(c: Candidate, setup: Setup) -> bool:
    """Whether a row differs from another one here: hybrid sharding is full sharding on one node; no_shard, and
    hybrid sharding with one GPU per node, replicate the whole model, which the run trains as DDP (its row)."""
    if c.strategy.fsdp_sharding == "no_shard":
        return False
    return c.strategy.fsdp_sharding != "hybrid_shard" or (setup.num_nodes > 1 and setup.num_gpus > 1)


def _no_row(m: ModelFacts, setup: Setup, key: str, attention: str | None = None) -> str:
    """Why a --strategy the planner knows has no row here (what the run would refuse, or what it would equal)."""
    if key in ("tp", "tp_fsdp", "cp_fsdp"):
        if setup.num_gpus < 2 or not m.decoder:
            return "tensor and context parallelism plan a decoder task (--task causal_lm) on at least 2 GPUs per node"
        if key == "cp_fsdp" and not TASKS[m.task].context_parallel:
            return f"--context_parallel_size runs --task {', '.join(t.name for t in TASKS if t.context_parallel)} only"
        if m.model_copy and key == "cp_fsdp":  # (tensor parallelism refuses the task itself: no_tensor_parallel)
            return "the planner does not estimate the frozen reference copy under CP: --strategy fsdp shards it"
        if key == "cp_fsdp" and not attention_fits(attention):  # the run's own rule
            return f"context parallelism {ATTENTION_REFUSAL}"
        if key == "cp_fsdp" and m.varlen_misfit:
            return f"context parallelism computes causal attention over varlen kernels; the model {m.varlen_misfit}"
        if key == "cp_fsdp":
            return f"no degree dividing the {setup.num_gpus} GPUs divides the model's heads and its KV heads"
        if key == "tp_fsdp" and not no_tensor_parallel(m, setup):
            return "tensor parallel groups on all the processes leave no data-parallel processes to shard over"
        return no_tensor_parallel(m, setup) or "no tensor-parallel row here"
    if key == "fsdp_no_shard" or (key == "fsdp_hybrid" and setup.num_nodes > 1):  # (one GPU per node)
        return "it replicates the whole model on every GPU, which the run trains as DDP: plan with --strategy ddp"
    return (
        f"hybrid sharding shards within a node and replicates across nodes; on {setup.num_nodes} node it is "
        "fsdp (full shard): plan with --num_nodes 2 or more, or --strategy fsdp"
    )


def make_plan(args: argparse.Namespace) -> dict:
    """Estimate every candidate, choose one, write its configs; returns the machine-readable plan."""
    _check(args)
    gpu = gpu_by_name(args.gpu) if args.gpu else None
    name = args.model_config or args.model_name_or_path or default_model_dir()
    if not args.model_config and (is_pipeline(name) or TASKS[args.task].plans_pipeline):
        return _pipeline_plan(args, name, gpu)  # a folder that is no pipeline: the run's own one line
    m, run_task, task_cfg = _model(args, name, gpu)
    setup, requested, global_batch = _setup(args, m, run_task, task_cfg, gpu)
    rows, allowed, cands, adapters, refused = _rows(args, m, setup, run_task, task_cfg, requested, global_batch)
    ranked = ranked_choices(m, allowed, setup, requested, global_batch)
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
        "strategies": [row_json(r) for r in rows],
        "recommendation": None,
        "suggestions": [],
        "fallbacks": [choice_json(c) for c in ranked[1:4]],  # the next best, in the order the choice takes
        "notes": _unused_notes(args)
        + _notes(m, setup, args.mixed_precision, gpu)
        + _split_notes(m, setup)
        + (["no ZeRO-3 or FSDP rows: --fused_cross_entropy true refuses them"] if setup.fused_loss_asked else [])
        + _hardware_notes(name, args, gpu)
        + _attention_note(m, args)
        + refused,
    }
    if not ranked:
        return _nothing_fits(plan, args, m, setup, rows, [r.candidate for r in allowed] or cands, adapters)
    choice = ranked[0]
    files, moved = write_configs(m, choice, setup, Path(args.output_dir))
    recommendation = recommendation_json(
        choice,
        global_batch,
        files,
        reasons(m, allowed, choice, setup, requested, global_batch),
        launch_command(m, choice, setup, files),
    )
    if moved:  # an edited config in --output_dir was kept: where this plan's went instead
        recommendation["files_moved"] = moved
    plan["recommendation"] = recommendation
    return plan


def _model(args: argparse.Namespace, name: str, gpu: Gpu | None) -> tuple[ModelFacts, Task, Config]:
    """(the model's facts with the task's answers about memory and sharding, the task, the task's options)."""
    local = (not args.model_config and config_folder(name)) or name  # a well-known model: its shipped config
    if not args.model_config and looks_like_repo_id(local) and not Path(local).exists():  # as training says it
        check_hub_ids([HubId("--model_name_or_path", local, "model")])
    try:
        m = model_facts(
            local,
            args.num_labels,
            args.trust_remote_code,
            args.task,
            bool(args.model_config),
            args.tokenizer_name_or_path,
            LoraSpec(args.lora_r, tuple(args.lora_target_modules), args.lora_dropout),
        )
    except UserError as err:  # a well-known model's refusal names the name typed, not the cache folder read
        if local == name:
            raise
        raise UserError(str(err).replace(local, name), err.quiet, err.transient) from None
    if not args.model_config and known_name(name):
        m = replace(m, name=name)
    task_cfg = build_config(
        {n: getattr(args, n) for n in ("task", "preference_loss", "precompute_reference", "max_target_length")}
        | {"mixed_precision": planned_precision(args.mixed_precision, gpu)}  # (QLoRA under FSDP needs bf16)
    )
    run_task = TASKS[args.task](task_cfg)  # the task's own answers about memory and sharding
    no_copy = replace(task_cfg, preference=replace(task_cfg.preference, precompute_reference=True))
    precision = planned_precision(args.mixed_precision, gpu)
    attention = run_attention(args.attn_implementation, args.packing, args.task, precision)
    passed = (
        (("--attn_implementation", args.attn_implementation) if args.attn_implementation else ())
        + (("--packing", args.packing) if args.packing != "auto" else ())
        + (("--fused_cross_entropy", args.fused_cross_entropy) if args.fused_cross_entropy != "auto" else ())
        + (("--liger_kernels", str(args.liger_kernels).lower()) if args.liger_kernels != "auto" else ())
    )
    m = replace(
        run_facts(m, run_task, task_cfg, attention),
        copy_free=tuple(
            s.key for s in STRATEGIES if not run_task.sharding_refusal(no_copy, Sharding(s.zero_stage, fsdp=s.fsdp))
        ),
        task_args=task_args(args) + passed,
    )
    return m, run_task, task_cfg


def _setup(
    args: argparse.Namespace, m: ModelFacts, run_task: Task, task_cfg: Config, gpu: Gpu | None
) -> tuple[Setup, int, int]:
    """(the machines and the run's batch, kernels and lengths; the micro-batch asked for; the global batch)."""
    setup = Setup(
        args.num_gpus,
        args.num_nodes,
        round((args.gpu_memory_gb or (gpu and gpu.memory_gib) or 0) * GIB),
        None if args.cpu_memory_gb is None else round(args.cpu_memory_gb * GIB),
        args.max_length,
        planned_precision(args.mixed_precision, gpu),  # auto: as training resolves it on --gpu, or this machine
        None if args.nvme_gb is None else round(args.nvme_gb * GIB),
    )
    requested, global_batch = _batch(args, setup.world_size)
    refuse_first(  # the run's own lines, where the plan would drop the option and recommend it all the same
        [
            (
                args.fused_cross_entropy == "true" and not fuses_loss(run_task),
                f"--fused_cross_entropy true: --task {args.task} has no language-model loss; use false",
            ),
            (
                args.liger_kernels is True and liger_installed() and not liger_knows(m.model_type),  # else unknown
                f"--liger_kernels true: Liger Kernel has no fused modules for {m.model_type!r} models; use false",
            ),
        ]
    )
    # a step of one micro-batch holds no gradients; the GPU runs Liger Kernel's auto choices if it is installed
    loss, modules = planned_kernels(args.fused_cross_entropy, args.liger_kernels, m.model_type, run_task)
    setup = replace(
        setup,
        step_rows=global_batch // setup.world_size,
        fused_loss=loss,
        fused_loss_asked=args.fused_cross_entropy == "true",
        liger_asked=args.liger_kernels is True,
        fused_modules=modules,
        target_length=run_task.target_length(task_cfg) if m.encoder else None,
    )
    return setup, requested, global_batch


def _rows(
    args: argparse.Namespace,
    m: ModelFacts,
    setup: Setup,
    run_task: Task,
    task_cfg: Config,
    requested: int,
    global_batch: int,
) -> tuple[list, list, list[Candidate], tuple[str, ...], list[str]]:
    """(every row the run may take, those the pinned options allow, the candidates, the adapters planned, a note
    where the run refuses some of the rows a pinned --strategy asks for); a pinned --strategy the run refuses
    entirely or that has no row here is refused in one line."""
    adapters = (
        () if m.adapters is None else tuple(p for p in ("lora", "dora", "qlora") if p != "dora" or args.peft == "dora")
    )  # DoRA only when asked for
    per_gpu = global_batch // setup.world_size
    pipes = pipeline_candidates(m, setup, per_gpu, micro_batch_options(requested, per_gpu)[0])
    if args.strategy == PIPELINE.key and not run_task.runs_in_pipeline:  # the run's rule, before the model's
        raise UserError(
            f"--strategy pipeline: --training_type pipeline does not train --task {args.task}; drop --strategy to "
            "plan it under DDP, ZeRO or FSDP2"
        )
    if args.strategy == PIPELINE.key and not pipes:
        raise UserError(f"--strategy pipeline: no pipeline can run here: {no_pipeline(m, setup)}")
    cp = context_candidates(m, setup) if attention_fits(args.attn_implementation) else []  # (run's refusal)
    splits = tensor_candidates(m, setup) + cp
    every = [c for c in candidates(adapters, pipes, splits) if _distinct(c, setup)]
    cands = [c for c in every if runnable(m, run_task, task_cfg, c) and not _fused_refusal(setup, c)]
    asked = [c for c in every if c.strategy.key == args.strategy and args.peft in ("auto", c.peft)]
    refused = [why for c in asked if (why := _fused_refusal(setup, c) or sharding_refusal(run_task, task_cfg, c))]
    if asked and len(refused) == len(asked):  # the run refuses every row asked for: its own line
        raise UserError(f"--strategy {args.strategy}: the run refuses it: {refused[0]}")
    if not asked and any(c.strategy.key == args.strategy for c in every):  # rows, none with the adapter asked for
        raise UserError(f"--strategy {args.strategy} --peft {args.peft}: {_no_adapter_row(args.strategy)}")
    if args.strategy not in ("auto", PIPELINE.key) and not any(c.strategy.key == args.strategy for c in cands):
        raise UserError(f"--strategy {args.strategy}: {_no_row(m, setup, args.strategy, args.attn_implementation)}")
    rows = [row(m, c, setup, requested * c.model_parallel) for c in cands]  # a TP/CP group: its processes' rows
    allowed = [
        r
        for r in rows
        if (args.strategy in ("auto", r.candidate.strategy.key))
        and args.gradient_checkpointing in ("auto", str(r.candidate.checkpointing).lower())
        and args.peft in ("auto", r.candidate.peft)
    ]
    partly = [f"--strategy {args.strategy}: the run refuses some of its rows ({why}); the others are planned"
              for why in refused[:1]]  # fmt: skip
    return rows, allowed, cands, adapters, partly


def _no_adapter_row(key: str) -> str:
    """Why a pinned --strategy has rows but none with the pinned adapter."""
    if key in ("tp", "tp_fsdp"):
        from cloudtrain.parallel.tensor import PEFT_REFUSAL  # (accelerate: loaded only for this line)

        return f"tensor parallelism {PEFT_REFUSAL}"
    if key == PIPELINE.key:
        return "--training_type pipeline does not train adapters; drop --strategy to plan them under DDP, ZeRO or FSDP2"
    return (
        f"the planner estimates adapters under --strategy {', '.join(ADAPTER_STRATEGIES)} only; pin one of those, "
        "or --peft none for full fine-tuning"
    )


def _nothing_fits(
    plan: dict,
    args: argparse.Namespace,
    m: ModelFacts,
    setup: Setup,
    rows: list,
    considered: list[Candidate],
    adapters: tuple[str, ...],
) -> dict:
    """The plan without a recommendation: why, and what would make the `considered` candidates fit (a pinned
    --strategy's, not the leanest of all)."""
    forced = args.strategy != "auto" or args.gradient_checkpointing != "auto" or args.peft != "auto"
    leanest = "full offload and checkpointing" + (", nor QLoRA with checkpointing" if "qlora" in adapters else "")
    plan["message"] = (
        f"Nothing fits, not even micro-batch 1 with {leanest}."
        if not forced or not any(r.max_micro_batch for r in rows)
        else "The requested strategy does not fit "
        "(see the table); drop --strategy/--gradient_checkpointing/--peft to let the planner "
        "choose."
    )
    plan["suggestions"] = suggestions(m, setup, considered)
    return plan


def _pipeline_plan(args: argparse.Namespace, name: str, gpu: Gpu | None) -> dict:
    """A diffusers pipeline's rows (cloudtrain.planning.diffusion): one GPU's memory under DDP and ZeRO-2, less
    the rows the task refuses (its sharding_refusal, as for the other tasks)."""
    names = ["task", "lora_target_modules", "mixed_precision", "resolution", "max_sequence_length"]
    cfg = build_config({n: getattr(args, n) for n in [*names, "train_text_encoder"]})
    cfg.images.check()  # the run's own bounds (--max_sequence_length, --resolution), in its words
    # the index picks the default targets: SD3's include its text stream's projections
    targets = diffusion_lora_targets(cfg, read_model_index(name))
    facts = pipeline_facts(name, args.resolution, args.lora_r, targets, cfg.images.max_sequence_length)
    budget = round((args.gpu_memory_gb or (gpu and gpu.memory_gib) or 0) * GIB)
    precision = planned_precision(args.mixed_precision, gpu)
    task = TASKS[args.task](cfg)

    def refusal(peft: str, shards: Sharding) -> str | None:
        return task.sharding_refusal(replace(cfg, model=replace(cfg.model, peft=peft)), shards)

    if args.strategy not in ("auto", *PIPELINE_STRATEGIES):  # (found in audit: ignored, DDP recommended)
        raise UserError(f"--strategy {args.strategy}: --task text_to_image is planned under --strategy ddp or zero2")
    if args.peft == "qlora":
        raise UserError("--peft qlora: --task text_to_image trains the full model or lora/dora adapters")
    world = args.num_gpus * args.num_nodes

    def asked(t: Training) -> bool:  # --strategy and --peft pin the rows, as for the other tasks
        return args.strategy in ("auto", t.strategy) and args.peft in ("auto", t.peft)

    rows = [t for t in trainings(args.train_text_encoder, world, args.gradient_checkpointing, refusal) if asked(t)]
    requested, global_batch = _batch(args, world)  # as for the other tasks: auto, the largest that fits
    options = micro_batch_options(requested, global_batch // world)
    result = pipeline_plan(facts, precision != "no", budget, options, global_batch // world, rows)
    notes = _unused_notes(args) + _precision_note(args.mixed_precision, precision, gpu)
    notes += _hardware_notes(name, args, gpu)
    return {
        **result,
        "pipeline": True,
        "budget_bytes": budget,
        "micro_batch": options[0],
        "global_batch_size": global_batch,
        "mixed_precision": precision,
        "notes": notes,
    }


def _split_notes(m: ModelFacts, setup: Setup) -> list[str]:
    """Why a decoder has no tensor-parallel rows, or none at some degree."""
    if not m.decoder or setup.num_gpus < 2:
        return []
    why = no_tensor_parallel(m, setup)
    notes = [f"no tensor-parallel rows: {why}"] if why else []
    if not why and m.tensor_plan:
        notes += [
            f"no TP={t} rows: {problem}" for t in degrees(setup) if (problem := m.tensor_plan.divisor_problem(m, t))
        ]
    return notes


def _attention_note(m: ModelFacts, args: argparse.Namespace) -> list[str]:
    if args.attn_implementation or m.attn_implementation != "varlen":
        return []
    return [
        "attention: varlen, the default for --packing bfd on GPUs with a varlen kernel (flash-attn or torch's "
        "varlen_attn): no dense mask; --attn_implementation sdpa plans for sdpa, which keeps the mask per layer"
    ]


def planned_precision(requested: str, gpu: Gpu | None) -> str:
    """The precision the run takes: as given, or for auto what training resolves on the --gpu named (bf16 where
    it computes bf16 natively, else fp32), or without --gpu on this machine; an accelerate launch's first."""
    if requested != "auto" or gpu is None or os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no":
        return resolve_precision(requested)
    return "bf16" if gpu.bf16 else "no"


def _notes(m: ModelFacts, setup: Setup, precision: str, gpu: Gpu | None) -> list[str]:
    notes = []
    if m.from_config and not m.tokenizer:
        notes.append(
            f"vocab {m.vocab_size} is the config's; training gives a preset the tokenizer's vocabulary: "
            "pass --tokenizer_name_or_path for the exact logits"
        )
    if m.decoder and m.stages is None:
        notes.append(f"no pipeline rows: --training_type pipeline cannot cut a {m.architecture} into stages")
    if TASKS[m.task].chat_template and m.adapters:
        notes.append(
            "adapters: a chat template that adds tokens also trains the embeddings and LM head in full "
            "(not counted here)"
        )
    if TASKS[m.task].bounds_length and m.context and setup.max_length > m.context:
        notes.append(
            f"--max_length {setup.max_length} is beyond the model's {m.context} positions: the run refuses it as "
            "given; extend them in a copy of its config (max_position_embeddings, and rope_scaling for RoPE models)"
        )
    return notes + _precision_note(precision, setup.mixed_precision, gpu)


def _precision_note(requested: str, planned: str, gpu: Gpu | None) -> list[str]:
    """What --mixed_precision auto became, where it was auto."""
    if requested == planned:
        return []
    where = f"on the {gpu.name}" if gpu else "on this machine"
    return [
        f"--mixed_precision {requested} is {planned} {where}, as training resolves it where it runs (bf16 on GPUs "
        "from Ampere on); pass bf16, fp16 or no to plan for another precision"
    ]


def _unused_notes(args: argparse.Namespace) -> list[str]:
    """The training options given that the planned run would not use, as the run itself notes them."""
    from cloudtrain.commands.plan import TRAINING_OPTIONS  # (that module's package imports this one)

    # plan's --peft auto plans adapters (at --lora_r ...) where the model takes them: the run's would be lora
    peft = args.peft if args.peft != "auto" else "none" if args.model_config else "lora"
    return inert_notes(build_config({name: getattr(args, name) for name in TRAINING_OPTIONS} | {"peft": peft}))


def _hardware_notes(name: str, args: argparse.Namespace, gpu: Gpu | None) -> list[str]:
    """Where the model's shapes and the GPU's memory came from, when not from the user."""
    notes = gpu.notes() if gpu else []
    if gpu and args.gpu_memory_gb is not None:
        notes.append(f"--gpu_memory_gb {args.gpu_memory_gb:g} wins over --gpu {gpu.name}'s {gpu.memory_gib:g} GiB")
    if not args.model_config and known_name(name):
        notes.append(f"{name}: shapes from cloudtrain's table of well-known models (its published config)")
    return notes


def run(args: argparse.Namespace) -> None:
    plan = make_plan(args)
    if plan.get("pipeline") and not args.json:
        print(render_pipeline(plan, plan["budget_bytes"], plan["micro_batch"]))
        return
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    moved = (plan.get("recommendation") or {}).get("files_moved")
    if moved:  # on stderr: --json's output stays one JSON document
        print(f"note: {moved}", file=sys.stderr)
