"""The training application, top to bottom:

    check options -> connect data -> process data -> load model -> [find the micro-batch] -> train
    -> evaluate -> save

The micro-batch is found only for --per_device_train_batch_size auto (cloudtrain.batch_size).

Every check that needs no heavy work runs first, so a mistake costs seconds, not a training run.
`build_run` does everything up to training (bench and tests call it too); `run_training` is the whole
job. What differs between tasks is the task's (cloudtrain.tasks); between launches, the runtime's
and the trainer's (cloudtrain.parallel.runtime, cloudtrain.training).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, set_seed

from cloudtrain import batch_size
from cloudtrain.assets import DEFAULT_MODEL_NAME
from cloudtrain.checkpointing import (
    Checkpointer,
    check_labels,
    probe_storage,
    read_state,
    restore_run_files,
)
from cloudtrain.config import Config
from cloudtrain.data.fingerprint import data_record, other_data_note
from cloudtrain.data.processing import ProcessedData, default_cache_dir
from cloudtrain.data.sources import not_utf8, pin_sources
from cloudtrain.errors import TrainingStopped, UserError, first_line
from cloudtrain.evaluation import scalar_metrics
from cloudtrain.faults import kill_point
from cloudtrain.hardware import keep_freed_memory, resolve_precision
from cloudtrain.models import adapters
from cloudtrain.models.prepare import check_attention_name, compile_model, prepare
from cloudtrain.observe import console, cost
from cloudtrain.observe.mlflow_tracker import check_mlflow_server
from cloudtrain.observe.tracking import RunLog, check_trackers
from cloudtrain.parallel.distributed import check_distributed, launch_environment_kept, launched_processes
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.paths import check_output_folder, checkpoint_dir, model_folders, resolve_model_path, resumes_here
from cloudtrain.publish import atomic, hub
from cloudtrain.publish import output_dir as output_dir_module
from cloudtrain.publish.output_dir import check_location, claim, earlier_model_refusal, holds_saved_model
from cloudtrain.publish.saving import final_save_bytes, write_arguments, write_results
from cloudtrain.redact import mask
from cloudtrain.registry import TASKS
from cloudtrain.resume import (
    STOPPED_MARK,
    agree_on_resume,
    drop_earlier_checkpoints,
    finish_interrupted_saves,
    restarted_defaults,
    trained_already,
)
from cloudtrain.tasks import Task, build_task
from cloudtrain.training import TRAINERS, Trainer, count_parameters, out_of_memory
from cloudtrain.training.best_model import record_final_evaluation
from cloudtrain.training.callbacks import load_callbacks
from cloudtrain.training.preemption import PreemptionSignal


def resolve_output_dir(cfg: Config, task: Task) -> Path:
    if cfg.output.output_dir:
        return Path(cfg.output.output_dir)
    name = cfg.model.model_name_or_path or cfg.model.model_config or DEFAULT_MODEL_NAME
    return Path("outputs") / f"{Path(name).stem if name.endswith('.json') else Path(name).name}-{task.data_label(cfg)}"


def resolve(cfg: Config, task: Task) -> Config:
    """`auto` precision, and the task's default best-checkpoint metric and packing, made concrete."""
    cfg = task.resolve_options(cfg)
    best = cfg.checkpoint.metric_for_best_model or task.default_best_metric
    return replace(
        cfg,
        training=replace(cfg.training, mixed_precision=resolve_precision(cfg.training.mixed_precision)),
        checkpoint=replace(cfg.checkpoint, metric_for_best_model=best),
        data=replace(
            cfg.data, packing=task.default_packing or "auto" if cfg.data.packing == "auto" else cfg.data.packing
        ),
    )


def preflight(cfg: Config, task: Task) -> Path:
    """Checks that touch files and devices but load nothing heavy; returns the output dir."""
    if cfg.data.streaming and not task.streams_data:  # it would train on one sample record per source
        streaming = " and ".join(t.name for t in TASKS if t.streams_data)
        raise UserError(f"--streaming true streams --task {streaming}, not --task {task.name}: drop --streaming")
    if cfg.training.neftune_noise_alpha and not task.embedding_noise:
        noisy = ", ".join(t.name for t in TASKS if t.embedding_noise)
        raise UserError(f"--neftune_noise_alpha applies to --task {noisy}, not --task {task.name}: drop it")
    task.check_options(cfg)
    task.check_adapters(cfg)
    check_attention_name(cfg)
    if cfg.checkpoint.metric_for_best_model not in task.metrics:
        raise UserError(
            f"--metric_for_best_model {cfg.checkpoint.metric_for_best_model} is not a metric of "
            f"--task {task.name}; use one of {', '.join(task.metrics)}"
        )
    task.check_data(cfg)
    TRAINERS[cfg.training.training_type].check_options(cfg, task)
    check_distributed(cfg)
    if not cfg.model.model_config:
        resolve_model_path(cfg.model)
    if tokenizer := cfg.model.tokenizer_name_or_path:
        resolve_model_path(cfg.model, tokenizer)
    if cfg.training.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("--mixed_precision fp16 needs a CUDA GPU; use bf16 or no on this machine")
    check_trackers(cfg.tracking)
    check_mlflow_server(cfg.tracking.report_to)
    output_dir = resolve_output_dir(cfg, task)
    check_output_folder(output_dir)
    check_location(cfg, output_dir, model_folders(cfg), cfg.checkpoint.resume_from_checkpoint)
    return output_dir


def check_output_dir(cfg: Config, output_dir: Path, resumed_here: bool, runtime: Runtime) -> None:
    """A save a kill interrupted is finished first; the user's files are never replaced; a model saved there
    earlier is replaced only when asked, or by the run resumed there (from one of its checkpoints: `resumed_here`).
    Then the folder is the run's."""

    def decide() -> tuple[str, str] | None:
        """(what, why): "finished" (a requeued job whose model is saved) or "refused"; None: the folder is ours."""
        try:
            atomic.check_writable(output_dir)
        except UserError as err:
            return "refused", str(err)
        atomic.recover(output_dir)  # a final save a kill cut short is finished first: its results are read
        if not resumed_here and (note := trained_already(cfg, output_dir)):
            return "finished", note
        if holds_saved_model(output_dir) and not cfg.output.overwrite_output_dir and not resumed_here:
            return "refused", earlier_model_refusal(output_dir)
        own = resumed_here and checkpoint_dir(cfg, output_dir).resolve() == (output_dir / "checkpoints").resolve()
        try:  # the checkpoint folder the run resumes from is cloudtrain's (copied in from another machine, say)
            claim(output_dir, ignore=("checkpoints",) if own else ())
        except UserError as err:
            return "refused", str(err)
        if holds_saved_model(output_dir) and not resumed_here:
            print(f"--overwrite_output_dir: the model saved in {output_dir} earlier is replaced at the end", flush=True)
        return None

    decided = runtime.run_on_main(decide)
    if decided and decided[0] == "finished":  # the requeued job's push, then its end
        if cfg.hub.push_to_hub and runtime.is_main:
            hub.push_output_dir(output_dir, cfg, hub.load_output_dir(output_dir)[1])
        raise TrainingStopped(decided[1], 0, quiet=not runtime.is_main)
    if decided:
        raise UserError(decided[1], quiet=not runtime.is_main)


def held_folders(cfg: Config, output_dir: Path) -> dict[Path, str]:
    """The folders a run holds while it lives: its output folder, and its checkpoint folder (one inside the output
    folder where it is there already: a run elsewhere may have been given it as its --checkpoint_dir)."""
    checkpoints = checkpoint_dir(cfg, output_dir)
    inside = checkpoints.resolve().is_relative_to(output_dir.resolve())
    held = not inside or checkpoints.is_dir()
    return {output_dir: "--output_dir", **({checkpoints: "--checkpoint_dir"} if held else {})}


def hold_folders(cfg: Config, output_dir: Path, runtime: Runtime) -> None:
    """The main process holds the run's folders (a second run in one of them is refused, on every process)."""

    def refusal() -> str | None:
        try:
            for folder, flag in held_folders(cfg, output_dir).items():
                output_dir_module.hold(folder, flag)
        except UserError as err:
            return str(err)
        return None

    message = runtime.run_on_main(refusal)
    if message:
        raise UserError(message, quiet=not runtime.is_main)


def release_folders(cfg: Config, output_dir: Path) -> None:
    for folder in held_folders(cfg, output_dir):
        output_dir_module.release(folder)


@dataclass
class Run:
    """Everything a training run is made of, built and checked, before the first step."""

    cfg: Config
    task: Task
    runtime: Runtime
    tokenizer: PreTrainedTokenizerBase
    data: ProcessedData
    model: PreTrainedModel
    trainer: Trainer
    run_log: RunLog
    output_dir: Path
    resume_from: Path | None
    trained_on: dict  # the training rows as processed (data.fingerprint), before a task adds columns of its own


def build_run(cfg: Config, task: Task | None = None, callbacks: list | None = None) -> Run:
    """Check the options, set up the launch, and build data, model, trainer and run log. The Python API may
    give a `task` object (one not chosen by --task: the user's own module) and callback objects."""
    task = task or build_task(cfg)
    cfg = task.cfg = resolve(cfg, task)  # a task object from the Python API reads the run's options too
    mesh = TRAINERS[cfg.training.training_type].mesh(cfg, launched_processes())
    cfg = batch_size.fixed(cfg, mesh.data_parallel)  # --global_batch_size: the accumulation (DeepSpeed checks it)
    output_dir = preflight(cfg, task)
    user_callbacks = load_callbacks(cfg.training.callbacks, callbacks)  # an unimportable name: one line, now
    if cfg.training.keep_freed_memory and not torch.cuda.is_available():
        keep_freed_memory()  # before the model and data take their memory
    runtime = Runtime.for_launch(cfg, mesh)  # before the model is loaded: ZeRO-3 partitions it while loading
    try:
        hold_folders(cfg, output_dir, runtime)  # before anything reads what a run still going there writes
        with out_of_memory.said_in_one_line(cfg, task, lambda: "loading the model"):
            return _build_in(output_dir, cfg, task, runtime, user_callbacks)
    except BaseException:  # refused or failed: the folder is free again (and gone, if holding it made it)
        release_folders(cfg, output_dir)
        raise


def _build_in(output_dir: Path, cfg: Config, task: Task, runtime: Runtime, user_callbacks: list) -> Run:
    """build_run's part in the held output folder: checkpoints, data, model, trainer, run log."""
    checkpoints = checkpoint_dir(cfg, output_dir)
    finish_interrupted_saves(checkpoints, runtime)
    cfg = restarted_defaults(cfg, checkpoints, runtime)
    resume_from = agree_on_resume(cfg, checkpoints, runtime)  # on every node, before loading
    here = resumes_here(resume_from, checkpoints)  # else another run's checkpoint: this folder's run starts here
    check_output_dir(cfg, output_dir, here, runtime)
    resumed = read_state(resume_from) if resume_from else None
    if cfg.hub.push_to_hub:  # a bad token fails now, not after hours of training
        hub.check_access_from_main(cfg.hub, runtime.is_main, runtime.share)
    set_seed(cfg.training.seed)  # the same on every process, so every process builds the same model

    raw = pin_sources(task.connect(cfg), runtime.share)  # a stream reads the files the main process listed
    task.resumed_labels = resumed.get("labels") if resumed else None
    tokenizer = task.load_tokenizer(cfg)
    cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    with runtime.owner_first(probe_storage(cache, runtime).owner):  # once per node, or once on shared storage
        try:
            data = task.process(raw, tokenizer, cfg)
        except UnicodeDecodeError:  # a JSON file's bytes, loaded unchecked, decoded at the first use of its text
            raise not_utf8(cfg.data) from None
    if resumed and resume_from:  # before the model loads: a resume onto renamed labels would swap the outputs
        try:
            check_labels(resumed, data.label_names, resume_from)
        except UserError as err:  # every process read the same data: one line, from the main process
            raise UserError(str(err), quiet=not runtime.is_main) from None
    # now: DPO's precomputed reference adds columns once the model loads; the task, so a resume by another task's
    # run is told that, not that the data differs (the same pairs, encoded for another task)
    trained_on = {**data_record(data.train), "task": cfg.training.task}
    if runtime.is_main:
        print(mask(task.describe_data(data)), flush=True)  # a source's URL may hold a password
        if resumed and resume_from and (note := other_data_note(resumed, trained_on, resume_from)):
            print(note, flush=True)
    model = task.load_model(cfg, data, tokenizer, announce=runtime.is_main)
    model = prepare(model, cfg, task, runtime.is_main, stop=compile_model)  # attention ... adapters, in order
    if cfg.training.per_device_train_batch_size == "auto":  # probes the prepared model, before it is compiled
        cfg = batch_size.choose(cfg, model, data, task, runtime, resumed.get("batch") if resumed else None)
        runtime.set_batch(cfg.training.micro_batch, cfg.training.gradient_accumulation_steps)
    elif runtime.is_main:
        batch_size.warn_beyond_estimate(cfg, data, task, runtime)
    model = prepare(model, cfg, task, runtime.is_main, start=compile_model)  # the last transform
    set_seed(cfg.training.seed + runtime.index)  # dropout differs per process
    if runtime.is_main:  # a run that cannot save its model is refused before it trains
        atomic.check_free_space(output_dir, final_save_bytes(cfg, model), "saving the final model")

    if runtime.is_main:
        output_dir_module.record_run_start(cfg, output_dir)
    if resume_from and runtime.is_main:  # another run's checkpoint brings its own log
        restore_run_files(resume_from, output_dir, replace=not here)
    run_log = RunLog(
        cfg,
        output_dir,
        runtime.is_main,
        resume_step=resumed["state"]["global_step"] if resumed else None,
        checkpoint=resume_from,
        run_info={
            "task": task.name,
            "training_type": cfg.training.training_type,
            "num_processes": runtime.count,
            "device": str(runtime.device),
            "num_parameters": count_parameters(model),
            "trainable_parameters": count_parameters(model, trainable=True),
            "peft": cfg.model.peft,
        },
    )
    trainer = TRAINERS[cfg.training.training_type](cfg, task, model, data, run_log, runtime)
    trainer.callbacks = user_callbacks
    if not here and cfg.output.overwrite_output_dir:  # built, checked: it starts over
        drop_earlier_checkpoints(checkpoints, runtime)
    return Run(cfg, task, runtime, tokenizer, data, model, trainer, run_log, output_dir, resume_from, trained_on)


def run_training(cfg: Config, task: Task | None = None, callbacks: list | None = None) -> dict:
    """Run the whole pipeline; returns the final results (train, eval and, if present, test) and the output dir.
    `task` and `callbacks`: objects the Python API was given (see `build_run`)."""
    with launch_environment_kept():
        run = build_run(cfg, task, callbacks)
        try:
            with out_of_memory.said_in_one_line(run.cfg, run.task, lambda: run.trainer.phase):
                return _train_evaluate_save(run)
        finally:  # also when stopped (SIGTERM, a non-finite loss) or refused
            try:
                run.runtime.close()
            finally:
                release_folders(run.cfg, run.output_dir)  # held since build_run's start


def _train_evaluate_save(run: Run) -> dict:
    cfg, runtime, trainer, output_dir = run.cfg, run.runtime, run.trainer, run.output_dir
    uploader = (
        hub.HubUploader(cfg) if runtime.is_main and cfg.hub.push_to_hub and cfg.hub.hub_strategy != "end" else None
    )
    stop = PreemptionSignal(runtime.agree, alone=runtime.count == 1)
    with stop:  # in the loop a checkpoint and a stop; after it, the evaluation skipped and the model saved
        checkpointer = _checkpointer(run, uploader)
        train_result = trainer.fit(checkpointer, run.resume_from, stop)
        results = {"train": train_result.summary(), "compute": _compute_used(train_result, runtime)}
        skipped = _evaluate(trainer, stop, train_result.global_step, results, train_result.model_step is None)
        if runtime.is_main and train_result.model_step is None and "eval" in results:
            record_final_evaluation(checkpointer, train_result.global_step, scalar_metrics(results["eval"], ""))
        predictions, cut = _predict(trainer, stop)
        if skipped or cut:  # a signal cut them short: a requeue finds the model saved and ends (trained_already)
            results["train"][STOPPED_MARK] = stop.by or "a signal to another process"
        trainer.phase = "saving the model"
        save_final(run, results, predictions)
        run.run_log.finish(results, run.data.label_names)
        if runtime.is_main:
            output_dir_module.record_run_files(output_dir)  # what the trackers added: the run's, not the user's
            _print_summary(run.task, results, output_dir)
    if stop.stopped():  # the model is saved: a stopped run, or (nothing skipped) a finished one without its push
        _after_a_signal(stop.by, skipped + cut, cfg, output_dir, quiet=not runtime.is_main)
    elif cfg.hub.push_to_hub and runtime.is_main:
        if uploader:
            uploader.settle()  # the final push below uploads everything that matters
        hub.push_output_dir(output_dir, cfg, results)
    return {**results, "output_dir": str(output_dir)}


def _checkpointer(run: Run, uploader: "hub.HubUploader | None") -> Checkpointer:
    cfg, runtime = run.cfg, run.runtime
    folder = checkpoint_dir(cfg, run.output_dir)
    return Checkpointer(
        cfg,
        folder,
        run.output_dir,
        runtime.is_main,
        runtime.barrier,
        **hub_hooks(cfg, run.task, run.trainer, run.tokenizer, uploader, runtime.is_main),
        storage=probe_storage(folder, runtime),
        share=runtime.share,
        index=runtime.index,
        labels=run.data.label_names,
        data=run.trained_on,
    )


def _compute_used(train_result, runtime: Runtime) -> dict:
    """Device-hours and their cost: a resumed launch counts its own, a job's earlier sessions are billed too."""
    launch_s = train_result.launch_runtime_s
    job_s = max(cost.session_seconds(), launch_s) + train_result.earlier_job_s
    return cost.compute_used(
        launch_s, job_s, runtime.count, runtime.device.type, earlier_device_seconds=train_result.earlier_device_s
    )


def _evaluate(trainer: Trainer, stop: PreemptionSignal, step: int, results: dict, own_step: bool = True) -> list[str]:
    """The trained model's metrics on the validation and test splits, logged into `results`; what a signal left
    undone is returned, in words. A model from an earlier step (not `own_step`: --load_best_model_at_end) is not
    logged as the last step's validation (that step's own model was, by best_model; the model's own step has its
    numbers and tables, a text-to-image grid under its step's name)."""
    trainer.phase = "evaluation"
    names = {split: name for split, name in (("validation", "eval"), ("test", "test")) if split in trainer.eval_dls}
    done, skipped = _unless_stopped(stop, list(names), lambda split: trainer.evaluate(split, stop.cut_short()))
    for split, metrics in done.items():
        results[names[split]] = metrics
        if own_step or split != "validation":
            trainer.log_evaluation(metrics, names[split], step)
    return [f"{split} evaluation" for split in skipped]


def _predict(trainer: Trainer, stop: PreemptionSignal) -> tuple[dict, list[str]]:
    """The predictions for each unlabelled split, and what a signal left undone, in words."""
    trainer.phase = "prediction"
    done, skipped = _unless_stopped(stop, list(trainer.predict_dls), lambda s: trainer.predict(s, stop.cut_short()))
    return done, [f"{split} predictions" for split in skipped]


def _unless_stopped(stop: PreemptionSignal, splits: list[str], run: Callable[[str], Any]) -> tuple[dict, list[str]]:
    """`run(split)` for each split until a signal (every process of a launch agrees before each): ({split: what it
    gave}, the splits skipped). A split a lone process cut short counts as skipped: some batches say nothing; a
    launch's processes finish theirs."""
    done, skipped = {}, []
    for split in splits:
        if not stop.stopped():
            value = run(split)
            if not (stop.alone and stop.stopped()):
                done[split] = value
                continue
        skipped.append(split)
    return done, skipped


def _after_a_signal(by: str, skipped: list[str], cfg: Config, output_dir: Path, quiet: bool) -> None:
    """A signal once the loop had ended: the model is saved. With something skipped the run ends as a stopped run
    does (a scheduler restarts it); a signal that came after the evaluation left only the push undone: a note."""
    push = f"; push it with: cloudtrain push --output_dir {output_dir}" if cfg.hub.push_to_hub else ""
    if not skipped:
        if not quiet:
            print(
                f"note: {by or 'a signal'} came after the last step with nothing left to skip (it came as the model "
                f"was saved, or a launch finished the split it was on): the model is saved and the run finished{push}",
                flush=True,
            )
        return
    raise TrainingStopped(
        f"{by or 'a signal to another process'} after the last step: the trained model is saved in "
        f"{output_dir}, without its {', '.join(skipped)}{push}",
        130 if by == "SIGINT" else 143,
        quiet,
    )


def save_final(run: Run, results: dict, predictions: dict) -> None:
    """Model, tokenizer, arguments, results, predictions (and the merged model) into a staging folder, then
    into <output_dir> at once: a kill or a full disk leaves the previous model or the new one, whole."""
    cfg, runtime, output_dir = run.cfg, run.runtime, run.output_dir
    what = "the final model"
    staging = atomic.staging_dir(output_dir)
    if runtime.is_main:
        atomic.check_free_space(output_dir, final_save_bytes(cfg, run.model), what)
        atomic.start_staging(output_dir)
    runtime.barrier()  # the folder exists before any process writes its part (a pipeline's stages write shards)
    with atomic.no_space_is_a_user_error(output_dir, what):
        run.trainer.save_model(staging)
        kill_point("save.model_written")
        runtime.barrier()
        if not runtime.is_main:
            return
        for split, predicted in predictions.items():
            run.task.write_predictions(staging, run.data, split, predicted)
        run.task.save_tokenizer(run.tokenizer, staging)
        write_arguments(cfg, staging / "args.json")
        write_results(staging, results)
        if cfg.output.merge_adapters:
            try:
                adapters.merge(staging, lands_in=output_dir)
            except Exception as err:  # the adapter is saved and pushed all the same; `merge` can be run again
                if not isinstance(err, UserError):  # a fault of ours: named, not the run's end
                    err = UserError(f"merging failed: {type(err).__name__}: {first_line(err)}")
                print(f"warning: {err}; the adapter is saved (`cloudtrain merge` merges it)", flush=True)
        staged = sorted(p.name for p in staging.iterdir())
        # before the seal: a recovered publish is the run's too; a card's digest is the staged one's
        output_dir_module.record(output_dir, staged, source=staging)
        atomic.seal(output_dir, output_dir_module.replaced_at_end(output_dir, staged))
    atomic.publish(output_dir)


def hub_hooks(cfg: Config, task: Task, trainer, tokenizer, uploader, is_main: bool) -> dict:
    """Checkpoint hooks for --hub_strategy every_save/checkpoint: export a loadable model into each
    checkpoint, upload it to the repo root (and the whole checkpoint to last-checkpoint/) in the
    background, and let pending uploads finish before rotation deletes a folder."""
    if not (cfg.hub.push_to_hub and cfg.hub.hub_strategy != "end"):
        return {}

    def export(folder: Path) -> None:
        trainer.save_model(folder / "model")  # every process: ZeRO-3 gathers here
        if is_main:
            task.save_tokenizer(tokenizer, folder / "model")

    def on_saved(step: int, folder: Path) -> None:
        uploader.upload(folder / "model", f"Training in progress, step {step}")
        if cfg.hub.hub_strategy == "checkpoint":
            uploader.upload(folder, f"Checkpoint at step {step}", path_in_repo="last-checkpoint")

    return {
        "export": export,
        "on_saved": on_saved if is_main else None,
        "before_delete": uploader.settle if is_main else None,  # a failed upload is no reason to stop training
    }


def _print_summary(task: Task, results: dict, output_dir: Path) -> None:
    print(f"{describe_training(results['train'])}, mean train loss {results['train']['train_loss']:.4f}")
    best = results["train"].get("model_from_step")  # --load_best_model_at_end chose an earlier step's model
    of_model = f" (the model of step {best}, --load_best_model_at_end)" if best is not None else ""
    for name in ("eval", "test"):
        if name in results:
            first, newline, rest = task.describe_metrics(results[name]).partition("\n")  # sample answers follow
            print(f"{name}: {first}{of_model}{newline}{rest}")
    print(cost.describe(results["compute"]))
    print(f"model saved to {output_dir.resolve()}\nuse it: {task.inference_hint(str(output_dir))}")


def describe_training(train: dict) -> str:
    """What this launch trained: a resumed one names the steps it took the run through, and its throughput is
    over its own samples and time (train_results.json's launch_*), not over the run's."""
    if "resumed_at_step" not in train:
        return (
            f"trained {console.counted(train['global_step'], 'step')} in "
            f"{train['train_runtime_s']:.0f}s "
            f"({train['train_samples_per_s']:.1f} samples/s, {train['train_tokens_per_s']:.0f} tokens/s)"
        )
    first, last, steps = train["resumed_at_step"] + 1, train["global_step"], train["launch_steps"]
    if not steps:
        return f"trained no steps this launch (resumed at step {last}: nothing was left to train)"
    which = f"step {last}" if steps == 1 else f"steps {first}-{last}"
    return (
        f"trained {which} of {last} ({steps} this launch, resumed at step {first - 1}) in "
        f"{train['launch_runtime_s']:.0f}s ({train['launch_samples_per_s']:.1f} samples/s, "
        f"{train['launch_tokens_per_s']:.0f} tokens/s)"
    )
