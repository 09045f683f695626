"""The training application, top to bottom:

    check options -> connect data -> process data -> load model -> train -> evaluate -> save

Every check that needs no heavy work runs first, so a mistake costs seconds, not a training run.
"""

import contextlib
from dataclasses import replace
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from transformers import set_seed

from cloudtrain.assets import DEFAULT_MODEL_NAME
from cloudtrain.checkpointing import (Checkpointer, checkpoint_dir, find_resume_checkpoint, read_state,
                                     restore_run_files)
from cloudtrain.config import Config, save_arguments
from cloudtrain.distributed import build_accelerator, check_distributed
from cloudtrain.data_connecting import check_data_sources, connect_data, dataset_label
from cloudtrain.data_processing import process_data
from cloudtrain.errors import UserError
from cloudtrain.evaluation import scalar_metrics
from cloudtrain.hardware import keep_freed_memory, resolve_precision
from cloudtrain.model_loading import head_labels, load_model, load_tokenizer, resolve_model_path
from cloudtrain.predict import records
from cloudtrain.saving import holds_model, write_jsonl, write_results
from cloudtrain import hub
from cloudtrain.tracking import RunLog, check_trackers
from cloudtrain.trainers import AcceleratedTrainer, BasicTrainer, count_parameters


def resolve_output_dir(cfg: Config) -> Path:
    if cfg.output.output_dir:
        return Path(cfg.output.output_dir)
    model_name = Path(cfg.model.model_name_or_path or DEFAULT_MODEL_NAME).name
    return Path("outputs") / f"{model_name}-{dataset_label(cfg.data)}"


def preflight(cfg: Config) -> tuple[Path, Path | None]:
    """Checks that touch files and devices but load nothing heavy; returns (output dir, checkpoint to resume)."""
    check_data_sources(cfg.data)
    check_distributed(cfg)
    resolve_model_path(cfg.model)
    if cfg.training.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("--mixed_precision fp16 needs a CUDA GPU; use bf16 or no on this machine")
    check_trackers(cfg.tracking)
    output_dir = resolve_output_dir(cfg)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file; give a directory")
    resume_from = find_resume_checkpoint(cfg, checkpoint_dir(cfg, output_dir))
    if holds_model(output_dir) and not cfg.output.overwrite_output_dir and resume_from is None:
        raise UserError(f"--output_dir {output_dir} already holds a model; pass --overwrite_output_dir true "
                        "to replace it, or choose another --output_dir")
    return output_dir, resume_from


def run_training(cfg: Config) -> dict:
    """Run the whole pipeline; returns the final results (train, eval and, if present, test)."""
    cfg = replace(cfg, training=replace(cfg.training, mixed_precision=resolve_precision(cfg.training.mixed_precision)))
    output_dir, resume_from = preflight(cfg)
    if cfg.training.keep_freed_memory and not torch.cuda.is_available():
        keep_freed_memory()  # before the model and data take their memory
    # Distributed set-up, before the model is loaded (ZeRO-3 partitions it while loading).
    accelerator = build_accelerator(cfg) if cfg.training.training_type == "accelerated" else None
    is_main = accelerator.is_main_process if accelerator else True
    main_first = accelerator.main_process_first if accelerator else contextlib.nullcontext
    if cfg.hub.push_to_hub:  # a bad token fails now, not after hours of training
        share = (lambda verdict: broadcast_object_list([verdict])[0]) if accelerator else (lambda verdict: verdict)
        hub.check_access_from_main(cfg.hub, is_main, share)
    set_seed(cfg.training.seed)  # the same on every process, so every process builds the same model

    raw = connect_data(cfg.data)
    tokenizer = load_tokenizer(cfg.model)
    with main_first():  # the main process tokenizes and caches; the others read its cache
        data = process_data(raw, tokenizer, cfg.data, cfg.training.seed, label_order=head_labels(cfg.model))
    if is_main:
        print(f"data: {len(data.train)} train / {len(data.validation)} validation"
              f"{f' / {len(data.test)} test' if data.test is not None else ''} examples, "
              f"{len(data.label_names)} labels: {', '.join(data.label_names)}", flush=True)
        for split in data.unlabelled:
            print(f"the {split} data has no labels: it is used for predictions only "
                  f"({split}_predictions.jsonl)", flush=True)
    model = load_model(cfg.model, data.label_names, tokenizer, announce=is_main)
    set_seed(cfg.training.seed + (accelerator.process_index if accelerator else 0))  # dropout differs per process

    if resume_from and is_main:
        restore_run_files(resume_from, output_dir)
    run_log = RunLog(cfg, output_dir, is_main, resume_step=read_state(resume_from)["state"]["global_step"]
                     if resume_from else None, run_info={
        "training_type": cfg.training.training_type,
        "num_processes": accelerator.num_processes if accelerator else 1,
        "device": str(accelerator.device if accelerator else BasicTrainer.pick_device()),
        "num_parameters": count_parameters(model)})
    if accelerator:
        trainer = AcceleratedTrainer(cfg, model, data, run_log, accelerator)
    else:
        trainer = BasicTrainer(cfg, model, data, run_log)
    barrier = accelerator.wait_for_everyone if accelerator else lambda: None
    uploader = hub.HubUploader(cfg) if is_main and cfg.hub.push_to_hub and cfg.hub.hub_strategy != "end" else None
    checkpointer = Checkpointer(cfg, checkpoint_dir(cfg, output_dir), output_dir, is_main, barrier,
                                **hub_hooks(cfg, trainer, tokenizer, uploader, is_main))
    train_result = trainer.fit(checkpointer, resume_from)

    results = {"train": train_result.summary()}
    for split, name in (("validation", "eval"), ("test", "test")):
        if split in trainer.eval_dls:
            results[name] = trainer.evaluate(split)
            run_log.log(scalar_metrics(results[name], f"{name}/"), step=train_result.global_step)
    predictions = {split: trainer.predict(split) for split in trainer.predict_dls}
    trainer.save_model(output_dir)
    if is_main:
        for split, (ids, scores) in predictions.items():
            write_jsonl(output_dir / f"{split}_predictions.jsonl",
                        records(data.unlabelled_texts[split], ids, scores, dict(enumerate(data.label_names))))
        tokenizer.save_pretrained(output_dir)
        save_arguments(cfg, output_dir / "args.json")
        write_results(output_dir, results)
        _print_summary(results, output_dir)
    run_log.finish(results, data.label_names)
    if cfg.hub.push_to_hub and is_main:
        if uploader:
            try:
                uploader.wait()
            except UserError as err:  # the final push below uploads everything that matters
                print(f"warning: {err}", flush=True)
        hub.push_output_dir(output_dir, cfg, results)
    return results


def hub_hooks(cfg: Config, trainer, tokenizer, uploader, is_main: bool) -> dict:
    """Checkpoint hooks for --hub_strategy every_save/checkpoint: export a loadable model into each
    checkpoint, upload it to the repo root (and the whole checkpoint to last-checkpoint/) in the
    background, and let pending uploads finish before rotation deletes a folder."""
    if not (cfg.hub.push_to_hub and cfg.hub.hub_strategy != "end"):
        return {}

    def export(folder: Path) -> None:
        trainer.save_model(folder / "model")  # every process: ZeRO-3 gathers here
        if is_main:
            tokenizer.save_pretrained(folder / "model")

    def on_saved(step: int, folder: Path) -> None:
        uploader.upload(folder / "model", f"Training in progress, step {step}")
        if cfg.hub.hub_strategy == "checkpoint":
            uploader.upload(folder, f"Checkpoint at step {step}", path_in_repo="last-checkpoint")

    return {"export": export, "on_saved": on_saved if is_main else None,
            "before_delete": uploader.wait if is_main else None}


def _print_summary(results: dict, output_dir: Path) -> None:
    train = results["train"]
    print(f"trained {train['global_step']} steps in {train['train_runtime_s']:.0f}s "
          f"({train['train_samples_per_s']:.1f} samples/s), final train loss {train['train_loss']:.4f}")
    for name in ("eval", "test"):
        if name in results:
            r = results[name]
            print(f"{name}: accuracy {r['accuracy']:.4f} | macro_f1 {r['macro_f1']:.4f} | loss {r['loss']:.4f} "
                  f"({r['samples']} examples)")
    print(f"model saved to {output_dir.resolve()}")
