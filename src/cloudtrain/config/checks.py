"""Checks of values and combinations that need no I/O: run on every resolved `Config`."""

from cloudtrain.config.root import Config
from cloudtrain.errors import UserError, refuse_first


def validate(cfg: Config) -> None:
    """Reject invalid values and contradictory combinations before anything is loaded: each section's own (its
    `check`), then those across sections."""
    for section in cfg.sections():
        if hasattr(section, "check"):
            section.check()
    t, h, c, d = cfg.training, cfg.hub, cfg.checkpoint, cfg.distributed
    refuse_first(
        [
            (
                t.neftune_noise_alpha > 0 and (d.tensor_parallel_size > 1 or d.context_parallel_size > 1),
                "--neftune_noise_alpha does not run under --tensor_parallel_size or --context_parallel_size (each "
                "process holds part of the embeddings or of the row, and the noise's scale needs the whole); drop "
                "one",
            ),
            (
                cfg.output.merge_adapters and cfg.model.peft == "none",
                "--merge_adapters true needs adapters: set --peft lora, dora or qlora",
            ),
            (
                h.push_to_hub and h.hub_strategy != "end" and not c.checkpointing_steps,
                f"--hub_strategy {h.hub_strategy} uploads checkpoints: set --checkpointing_steps N or epoch",
            ),
        ]
    )
    refuse_first(parallel_task_refusals(cfg))
    written = {"--output_dir": cfg.output.output_dir, **written_folders(cfg)}
    refuse_first(
        [
            (
                "://" in str(folder),
                f"{flag} {folder} must be a local folder (a run writes there as it goes, and this one would "
                "make a folder named like the URL): copy it up once the run ends, or on SageMaker leave it to the "
                "job, which uploads its model folder and /opt/ml/checkpoints",
            )
            for flag, folder in written.items()
            if folder
        ]
    )
    # the options alone ask for DeepSpeed or FSDP here; check_distributed asks again with the launcher's variables
    refuse_first(engine_conflicts(cfg, d.zero_stage is not None or bool(d.deepspeed_config), d.fsdp))
    if c.load_best_model_at_end:
        check_best_model_schedule(cfg)


def written_folders(cfg: Config) -> dict[str, str | None]:
    """The folders besides --output_dir that a run writes into as it goes, by flag (unset: None)."""
    return {
        "--checkpoint_dir": cfg.checkpoint.checkpoint_dir,
        "--profile_dir": cfg.monitoring.profile_dir,
        "--cache_dir": cfg.data.cache_dir,
    }


def parallel_task_refusals(cfg: Config) -> list[tuple[bool, str]]:
    """--tensor_parallel_size or --context_parallel_size for a task that does not take it (its registry row says,
    read without importing the task): refused before `cloudtrain launch` starts any process."""
    from cloudtrain.registry import TASKS

    d, task, rows = cfg.distributed, cfg.training.task, TASKS.rows()
    sizes = (("tensor_parallel", d.tensor_parallel_size), ("context_parallel", d.context_parallel_size))
    return [
        (
            size > 1 and task in rows and not getattr(rows[task], kind),
            f"--{kind}_size {size} is supported for --task "
            f"{', '.join(name for name, row in rows.items() if getattr(row, kind))} only (this run is {task})",
        )
        for kind, size in sizes
    ]


def engine_conflicts(cfg: Config, deepspeed: bool, fsdp: bool) -> list[tuple[bool, str]]:
    """The refusals of the sharding engine's options, given whether DeepSpeed and FSDP were asked for."""
    d = cfg.distributed
    return [
        (
            cfg.training.optim == "muon" and (deepspeed or fsdp),
            "--optim muon orthogonalises whole weight matrices, which DeepSpeed ZeRO and FSDP split into flat "
            "shards; use plain multi-process (DDP) training for it",
        ),
        (
            cfg.training.optim == "adafactor" and (fsdp or d.tensor_parallel_size > 1),
            "--optim adafactor (transformers') cannot step the DTensor weights of FSDP2 and tensor parallelism "
            "(a mixed torch.Tensor and DTensor error at the first step); use --optim adamw",
        ),
        (deepspeed and fsdp, "DeepSpeed and FSDP were both requested; choose one"),
        (
            (d.offload_optimizer != "none" or d.offload_param != "none") and d.zero_stage is None,
            "--offload_optimizer/--offload_param need DeepSpeed: add --zero_stage 2 or 3",
        ),
        (d.offload_param != "none" and d.zero_stage != 3, "--offload_param needs --zero_stage 3"),
    ]


def check_best_model_schedule(cfg: Config) -> None:
    """--load_best_model_at_end picks a checkpoint by its score: the last evaluation before it, which must be its own
    model's, so every checkpoint has to fall on an evaluation step."""
    t, every = cfg.training, cfg.checkpoint.checkpointing_steps
    if not every:
        raise UserError(
            "--load_best_model_at_end true picks among checkpoints: set --checkpointing_steps (a multiple of "
            "--eval_steps, or epoch with --eval_strategy epoch)"
        )
    if every == "epoch" and t.eval_strategy == "epoch":
        return
    if every.isdigit() and t.eval_strategy == "steps" and t.eval_steps and int(every) % t.eval_steps == 0:
        return
    evaluates = {"steps": f"every {t.eval_steps} steps", "epoch": "at each epoch's end", "no": "never"}
    fix = "epoch" if t.eval_strategy == "epoch" else f"a multiple of --eval_steps {t.eval_steps}"
    if t.eval_strategy == "no":
        fix = "N with --eval_strategy steps --eval_steps N (or epoch for both)"
    checkpoints = "at each epoch's end" if every == "epoch" else f"every {every} steps"
    raise UserError(
        f"--load_best_model_at_end true needs each checkpoint at an evaluation step (its score is its own model's), "
        f"but the run evaluates {evaluates[t.eval_strategy]} and checkpoints {checkpoints}; set --checkpointing_steps "
        f"{fix}"
    )


def process_count_refusals(cfg: Config, processes: int, launcher: str) -> list[tuple[bool, str]]:
    """The parallel sizes against a launch's process count: `cloudtrain launch` knows the count before any process
    starts (each would import torch before saying so); `launcher`, the command the remedy names."""
    d = cfg.distributed
    sizes = [("--tensor_parallel_size", d.tensor_parallel_size), ("--context_parallel_size", d.context_parallel_size)]
    if cfg.training.training_type == "pipeline":
        sizes.append(("--training_type pipeline with --pipeline_parallel_size", d.pipeline_parallel_size))
    return [
        (
            processes % size != 0,
            f"{flag} {size} needs a multiple of {size} processes, and this launch has {processes}: launch with "
            f"{launcher} --nproc_per_node {size} (or {2 * size}, ...)",
        )
        for flag, size in sizes
        if size > 1
    ]
