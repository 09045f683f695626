"""Checks of values and combinations that need no I/O: run on every resolved `Config`."""

import os

from cloudtrain.config.root import Config
from cloudtrain.errors import UserError

MAX_LOADER_WORKERS = max(64, 4 * (os.cpu_count() or 1))  # each is a process
MAX_ROWS = 1_000_000  # rows in a batch, or micro-batches in a step: more is a typo (and overflows an index)


def validate(cfg: Config) -> None:
    """Reject invalid values and contradictory combinations before anything is loaded."""
    d, t, h, c = cfg.data, cfg.training, cfg.hub, cfg.checkpoint
    checks = [
        (
            d.dataset_name and d.train_file,
            "--dataset_name and --train_file both name the training data; give one of them",
        ),
        (
            d.text_pair_column and d.text_pair_column == d.text_column,
            "--text_pair_column must differ from --text_column",
        ),
        (d.label_column in (d.text_column, d.text_pair_column), "--label_column must differ from the text columns"),
        (not d.label_separator, "--label_separator must not be empty"),
        (d.max_length < 2, "--max_length must be at least 2"),
        (not 0 < d.validation_split_percentage < 100, "--validation_split_percentage must be between 0 and 100"),
        (d.max_train_samples is not None and d.max_train_samples < 1, "--max_train_samples must be at least 1"),
        (d.max_eval_samples is not None and d.max_eval_samples < 1, "--max_eval_samples must be at least 1"),
        (d.dataloader_num_workers < 0, "--dataloader_num_workers must not be negative"),
        (
            d.dataloader_num_workers > MAX_LOADER_WORKERS,
            f"--dataloader_num_workers {d.dataloader_num_workers} is more than {MAX_LOADER_WORKERS} (4 x this "
            "machine's CPUs, at least 64): each is a process; give fewer",
        ),
        (t.num_train_epochs <= 0 and t.max_steps is None, "--num_train_epochs must be positive (or set --max_steps)"),
        (t.max_steps is not None and t.max_steps < 1, "--max_steps must be at least 1"),
        (
            isinstance(t.per_device_train_batch_size, int) and t.per_device_train_batch_size < 1,
            "--per_device_train_batch_size must be at least 1 (or auto)",
        ),
        (t.global_batch_size is not None and t.global_batch_size < 1, "--global_batch_size must be at least 1"),
        (t.per_device_eval_batch_size < 1, "--per_device_eval_batch_size must be at least 1"),
        (t.gradient_accumulation_steps < 1, "--gradient_accumulation_steps must be at least 1"),
        (
            max(
                t.gradient_accumulation_steps,
                t.per_device_eval_batch_size,
                t.global_batch_size or 0,
                t.per_device_train_batch_size if isinstance(t.per_device_train_batch_size, int) else 0,
            )
            > MAX_ROWS,
            f"--per_device_train_batch_size, --per_device_eval_batch_size, --global_batch_size and "
            f"--gradient_accumulation_steps take at most {MAX_ROWS:,}",
        ),  # fmt: skip
        (t.learning_rate <= 0, "--learning_rate must be positive"),
        (t.weight_decay < 0, "--weight_decay must not be negative"),
        (t.max_grad_norm < 0, "--max_grad_norm must not be negative (0 disables clipping)"),
        (not 0 <= t.warmup_ratio < 1, "--warmup_ratio must be in [0, 1)"),
        (t.logging_steps < 1, "--logging_steps must be at least 1"),
        (not 0 <= t.seed < 2**32, "--seed must be between 0 and 4294967295 (2**32 - 1), as numpy's generator takes"),
        (
            t.eval_strategy == "steps" and not t.eval_steps,
            "--eval_strategy steps needs --eval_steps N (or use --eval_strategy epoch)",
        ),
        (t.eval_steps is not None and t.eval_steps < 1, "--eval_steps must be at least 1"),
        (
            t.early_stopping_patience is not None and t.early_stopping_patience < 1,
            "--early_stopping_patience must be at least 1",
        ),
        (t.early_stopping_threshold < 0, "--early_stopping_threshold must not be negative"),
        (t.neftune_noise_alpha < 0, "--neftune_noise_alpha must not be negative (0: off)"),
        (not 0 <= t.label_smoothing < 1, "--label_smoothing must be in [0, 1) (0: off; 0.1 is usual)"),
        (
            t.neftune_noise_alpha > 0
            and (cfg.distributed.tensor_parallel_size > 1 or cfg.distributed.context_parallel_size > 1),
            "--neftune_noise_alpha does not run under --tensor_parallel_size or --context_parallel_size (each "
            "process holds part of the embeddings or of the row, and the noise's scale needs the whole); drop one",
        ),
        (
            t.early_stopping_patience and t.eval_strategy == "no",
            "--early_stopping_patience counts evaluations: set --eval_strategy steps (with --eval_steps N) or epoch",
        ),
        (t.sample_max_new_tokens < 1, "--sample_max_new_tokens must be at least 1"),
        (d.num_sample_prompts < 0, "--num_sample_prompts must not be negative (0: no sample generations)"),
        (
            cfg.model.model_config and cfg.model.model_name_or_path,
            "--model_config builds a model from scratch and --model_name_or_path loads one; give one of them",
        ),
        (
            cfg.model.model_config and not cfg.model.tokenizer_name_or_path,
            "--model_config needs --tokenizer_name_or_path (a model built from scratch comes with no tokenizer)",
        ),
        (
            "none" in cfg.tracking.report_to and len(cfg.tracking.report_to) > 1,
            "--report_to none cannot be combined with other trackers",
        ),
        (cfg.distributed.pipeline_parallel_size < 1, "--pipeline_parallel_size must be at least 1"),
        (cfg.distributed.pipeline_microbatches < 1, "--pipeline_microbatches must be at least 1"),
        (cfg.distributed.pipeline_stages_per_rank < 1, "--pipeline_stages_per_rank must be at least 1"),
        (cfg.distributed.collective_timeout <= 0, "--collective_timeout must be positive (seconds)"),
        (cfg.monitoring.loss_spike_threshold < 0, "--loss_spike_threshold must not be negative (0: off)"),
        (cfg.monitoring.grad_norm_spike_threshold < 0, "--grad_norm_spike_threshold must not be negative (0: off)"),
        (
            not 0 <= cfg.monitoring.throughput_drop_ratio < 1,
            "--throughput_drop_ratio must be in [0, 1) (a share of the running median; 0: off)",
        ),
        (
            cfg.monitoring.straggler_ratio != 0 and cfg.monitoring.straggler_ratio <= 1,
            "--straggler_ratio must be above 1 (times the median process; 0: off)",
        ),
        (cfg.model.lora_r < 1, "--lora_r must be at least 1"),
        (cfg.model.lora_alpha <= 0, "--lora_alpha must be positive"),
        (not 0 <= cfg.model.lora_dropout < 1, "--lora_dropout must be in [0, 1)"),
        (not cfg.model.lora_target_modules, "--lora_target_modules needs all-linear or module names"),
        (
            cfg.output.merge_adapters and cfg.model.peft == "none",
            "--merge_adapters true needs adapters: set --peft lora, dora or qlora",
        ),
        (h.push_to_hub and not h.hub_model_id, "--push_to_hub true needs --hub_model_id <user>/<name>"),
        (
            c.checkpointing_steps is not None
            and c.checkpointing_steps != "epoch"
            and not (c.checkpointing_steps.isdigit() and int(c.checkpointing_steps) > 0),
            "--checkpointing_steps takes a number of steps or epoch",
        ),
        (c.save_total_limit is not None and c.save_total_limit < 1, "--save_total_limit must be at least 1"),
        (
            h.push_to_hub and h.hub_strategy != "end" and not c.checkpointing_steps,
            f"--hub_strategy {h.hub_strategy} uploads checkpoints: set --checkpointing_steps N or epoch",
        ),
    ]
    for failed, message in checks:
        if failed:
            raise UserError(message)
    if c.load_best_model_at_end:
        check_best_model_schedule(cfg)
    for section in cfg.sections():  # the checks a section owns about its own options
        if hasattr(section, "check"):
            section.check()


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
