"""Checkpoints: atomic saves, rotation, finding the latest, safe loading, preemption.

    <checkpoint_dir>/checkpoint-<step>/
        trainer_state.json   step counters, data position, logging sums, evaluations, score (written last)
        ...                  what the trainer saves: model.safetensors, optimizer, scheduler, scaler, RNG states

- Atomic: a checkpoint is written to `checkpoint-<step>.partial` and renamed when complete, so a kill
  during a save leaves the previous checkpoint as the latest; a stale `.partial` is removed.
- Many nodes: at start the processes find out how they share --checkpoint_dir (`probe_storage`): one
  folder for all (a shared filesystem: the main process finalises), or one per node (node-local disks,
  SageMaker's /opt/ml/checkpoints: each node's first process finalises its own, and every node writes
  every file it needs to resume). `latest` is the newest step complete on every node, agreed before
  anything loads (cloudtrain.resume); rotation deletes the same steps everywhere. Files from all nodes
  can be merged into one folder (SageMaker restores one S3 prefix to every instance): they carry the
  same names with the same contents, or names of their own (per-process files).
- Rotation (`--save_total_limit K`) deletes the oldest checkpoints but never the newest or the best
  (by `--metric_for_best_model`, as of the last evaluation before the save).
- Loading is safe: weights from safetensors, everything else through `torch.load(weights_only=True)`
  or JSON; a corrupt or foreign directory is one clear error. (DeepSpeed's own engine states are
  read by DeepSpeed's loader.)
- SIGTERM (spot reclaim, Kubernetes, SLURM preemption) sets a flag (training/preemption.py) that the loop reads
  at its next logging or checkpoint step: it saves a checkpoint and exits with status 143.
"""

import contextlib
import json
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cloudtrain.async_save import BackgroundSave, ThreadCollectives
from cloudtrain.checkpoint_layout import DCP_STATES as DCP_STATES  # (where they were; the layout is its own module)
from cloudtrain.checkpoint_layout import check_compatible as check_compatible
from cloudtrain.config import Config
from cloudtrain.errors import UserError, first_difference, first_line
from cloudtrain.faults import kill_point
from cloudtrain.models.record import model_record
from cloudtrain.observe import console
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.publish.atomic import fsync, fsync_tree, is_no_space
from cloudtrain.sagemaker_env import fresh_start

STATE_FILE = "trainer_state.json"
DATA_STATE_FILE = "data_state.json"  # a stream's cursor (cloudtrain.data.streaming), written by the trainer
MARKS = "written-by"  # <checkpoint>/written-by/<process index>: that process's files are complete
RUN_FILES = ("metrics.jsonl", "tracker_runs.json")  # the run's log and tracker ids travel with each checkpoint
FORMAT = "cloudtrain-checkpoint/1"
PREFIX = "checkpoint-"
LOWER_IS_BETTER = ("loss", "perplexity", "rmse", "mae")  # the metrics an improvement lowers


def score(metric: str | None, value: float) -> float:
    """`value` of `metric` oriented so that higher is better (a checkpoint's score)."""
    return -value if metric in LOWER_IS_BETTER else value


@dataclass
class TrainerState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    global_step: int = 0
    runtime_s: float = 0.0  # training time of all earlier sessions
    samples: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0  # what loss_sum sums over: rows or target tokens (0 in checkpoints from before it)
    interval: list = field(default_factory=lambda: [0.0] * 5)  # logging sums not yet logged (Meter)
    interval_s: float = 0.0  # the seconds those sums took: a resume's first rates divide by them too
    evaluations: list = field(default_factory=list)
    skipped_steps: int = 0  # non-finite steps skipped with --nonfinite_loss skip
    device_s: float | None = None  # training time x processes of all earlier sessions (None: from before it)
    job: str | None = None  # the SageMaker job that wrote it; its wall time over its sessions so far (cost.job_wall)
    job_wall_s: float = 0.0
    total_steps: int | None = None  # the steps its learning-rate schedule was built for (None: from before it)
    schedule: str | None = None  # that schedule and its warmup ("cosine, 100 warmup steps"; None: from before it)

    def earlier_device_s(self, processes: int) -> float:
        """The earlier sessions' device-seconds; a checkpoint from before they were kept counts `processes`."""
        return self.device_s if self.device_s is not None else self.runtime_s * processes


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete cloudtrain checkpoint in `folder`, oldest first. Another trainer's
    `checkpoint-N` folders (the Hugging Face Trainer's hold a trainer_state.json too) are not ours to resume
    or rotate away."""
    found = []
    try:
        paths = list(Path(folder).glob(f"{PREFIX}*"))
    except FileNotFoundError:  # removed while listed: a run's storage probe removes the folder it made
        return []
    for path in paths:
        step = path.name[len(PREFIX) :]
        if step.isdigit() and written_by_cloudtrain(path / STATE_FILE):
            found.append((int(step), path))
    return sorted(found)


def finish_replacement(folder: Path) -> None:
    """A kill between the two renames of a checkpoint saved again at its step (`_finalise`) left no
    checkpoint-N, the old one as checkpoint-N.replaced and the new one sealed or not in checkpoint-N.partial:
    the new one takes the name when it is complete, else the old one gets it back."""
    for aside in Path(folder).glob(f"{PREFIX}*.replaced"):
        final = aside.with_name(aside.name.removesuffix(".replaced"))
        partial = final.with_name(f"{final.name}.partial")
        with contextlib.suppress(OSError):  # another node on the same storage finished it first
            if not final.exists():
                os.replace(partial if written_by_cloudtrain(partial / STATE_FILE) else aside, final)
            shutil.rmtree(aside)


def written_by_cloudtrain(state_file: Path) -> bool:
    return state_format(state_file) == FORMAT


def state_format(state_file: Path) -> str | None:
    """The format a readable state file names ("" where it names none: another trainer's), None if unreadable."""
    try:
        data = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return None
    return str(data.get("format", "")) if isinstance(data, dict) else None


def check_resumable(cfg: Config, path: Path) -> None:
    """A readable cloudtrain checkpoint of the model and adapters this run trains (checked before loading
    anything)."""
    meta = read_state(path)
    saved = meta.get("adapters")
    if saved != adapter_settings(cfg):  # other adapters cannot take these weights
        raise UserError(
            f"checkpoint {path} trained {_describe(saved)}, this run asks for "
            f"{_describe(adapter_settings(cfg))}; resume with the same --peft and --lora_* options"
        )
    saved, now_optimizer = meta.get("optimizer"), optimizer_record(cfg)
    if saved is not None and saved != now_optimizer:  # its state holds that optimizer's moments, not this one's
        raise UserError(
            f"checkpoint {path} was trained with {_optimizer_name(saved)}, this run asks for "
            f"{_optimizer_name(now_optimizer)}: resume with {_optimizer_name(saved)}, or {fresh_start(path)}"
        )
    written_for, now = meta.get("model") or {}, model_record(cfg)
    differ = [k for k, v in written_for.get("shape", {}).items() if k in now["shape"] and now["shape"][k] != v]
    if differ:  # checkpoints before the record hold none: loading them tells
        field = differ[0]
        raise UserError(
            f"checkpoint {path} was written for another model ({written_for['source']}, {field} "
            f"{written_for['shape'][field]}; {now['source']} has {now['shape'][field]}): resume with the model that "
            f"wrote it, or {fresh_start(path)}"
        )
    base, now_base = written_for.get("base_weights"), now.get("base_weights")
    if base and now_base and base != now_base:
        raise UserError(
            f"checkpoint {path} trained adapters over other base weights ({written_for['source']}) than this run "
            f"loads ({now['source']}, the same shape): resume over the base it was trained on, or {fresh_start(path)}"
        )


def check_labels(state: dict, labels: list[str], path: Path) -> None:
    """A checkpoint's outputs mean the labels this run's data names, in the same order (a renamed label sorts
    elsewhere and silently swaps two outputs); checkpoints written before the record hold none."""
    saved = state.get("labels")
    if saved is None or [str(name).strip() for name in saved] == list(labels):  # (before names were stripped)
        return
    i, there, here = first_difference([repr(name) for name in saved], [repr(name) for name in labels], "missing")
    raise UserError(
        f"checkpoint {path} was trained on {len(saved)} labels and this run's data names {len(labels)}: label {i} is "
        f"{there} there and {here} here, so the model's outputs would mean other labels; resume with the data it was "
        f"trained on, or {fresh_start(path)}"
    )


def node_name(view: dict) -> str:
    return f"node {view['node']}" + (f" ({view['host']})" if view.get("host") else "")


@dataclass(frozen=True)
class Storage:
    """How the launch's processes share --checkpoint_dir (`probe_storage`)."""

    owner: bool = True  # this process creates, finalises and rotates the folder it sees
    per_node: bool = False  # one folder per node: each node writes every file it needs to resume


def probe_storage(folder: Path, runtime: Any) -> Storage:
    """Find out, with a file per process, whether the processes see one folder or one per node.

    Every process creates `<folder>/.probe-<token>/<rank>` and then looks for every other process's file
    by name (a lookup, not a listing, so a shared NFS mount's directory cache cannot hide them)."""
    if runtime.count == 1:
        return Storage()
    existed = Path(folder).exists()  # looked at before any process creates it (share below is a collective)
    token = runtime.share(uuid.uuid4().hex if runtime.is_main else None)
    probe = Path(folder) / f".probe-{token}"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / str(runtime.index)).touch()
    runtime.barrier()
    seen = [rank for rank in range(runtime.count) if (probe / str(rank)).exists()]
    views = runtime.gather_objects({"node": runtime.node, "host": runtime.host, "seen": seen, "existed": existed})
    if runtime.index == seen[0]:  # every process has looked: the gather above waited for all
        shutil.rmtree(probe, ignore_errors=True)
        if not any(views[rank]["existed"] for rank in seen):
            with contextlib.suppress(OSError):  # a run that saves no checkpoint leaves no empty folder
                Path(folder).rmdir()
    try:
        return storage_from(views, runtime.index)
    except UserError as err:  # the same on every process: printed once
        raise UserError(str(err), quiet=not runtime.is_main) from None


def storage_from(views: list[dict], index: int) -> Storage:
    """The layout that each process's `seen` ranks describe, for process `index`: one folder for all, or
    one per node; anything else cannot be made consistent and is refused."""
    everyone = list(range(len(views)))
    if all(v["seen"] == everyone for v in views):
        return Storage(owner=index == 0)
    for rank, view in enumerate(views):
        same_node = [r for r, v in enumerate(views) if v["node"] == view["node"]]
        if view["seen"] != same_node:
            raise UserError(
                f"--checkpoint_dir is neither one folder shared by every node nor one per node: process {rank} "
                f"on {node_name(view)} sees the files of processes {view['seen']}; give every node its own disk, "
                "or every node the same shared folder"
            )
    return Storage(owner=index == views[index]["seen"][0], per_node=True)


def adapter_settings(cfg: Config) -> dict | None:
    """What an adapter checkpoint's weights depend on (None: full fine-tuning)."""
    m = cfg.model
    if m.peft == "none":
        return None
    return {
        "peft": m.peft,
        "lora_r": m.lora_r,
        "lora_alpha": m.lora_alpha,
        "lora_dropout": m.lora_dropout,
        "lora_target_modules": list(m.lora_target_modules),
    }


def _describe(settings: dict | None) -> str:
    if settings is None:
        return "every weight"
    return " ".join(f"--{k} {','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in settings.items())


def read_state(path: Path) -> dict:
    """The checkpoint's trainer_state.json, checked: a corrupt or foreign directory is a UserError."""
    file = Path(path) / STATE_FILE
    try:
        data = json.loads(file.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        TrainerState(**data["state"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(
            f"{path} is not a usable cloudtrain checkpoint ({type(err).__name__}: {err}); "
            "pass another --resume_from_checkpoint, or latest"
        ) from None
    return data


def read_data_state(path: Path) -> dict:
    """A streaming checkpoint's cursor; a checkpoint without one was written by a run with stored rows."""
    file = Path(path) / DATA_STATE_FILE
    if not file.is_file():
        raise UserError(
            f"checkpoint {path} holds no stream position ({DATA_STATE_FILE}): it was written by a run without "
            "--streaming true; resume it the same way"
        )
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            f"checkpoint {path}: {DATA_STATE_FILE} is damaged ({first_line(err)}); resume another"
        ) from None


def restore_run_files(checkpoint: Path, output_dir: Path, replace: bool = False) -> None:
    """Put the run's log and tracker ids back from the checkpoint when the output dir lost them (`replace`: also
    over those of another run, when the checkpoint is another folder's)."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if (checkpoint / name).is_file() and (replace or not (Path(output_dir) / name).exists()):
            shutil.copy2(checkpoint / name, Path(output_dir) / name)


def optimizer_record(cfg: Config) -> str:
    """The optimizer whose state a checkpoint holds: --optim, or "deepspeed" where the DeepSpeed JSON has its own."""
    from cloudtrain.parallel.distributed import deepspeed_sections

    return "deepspeed" if "optimizer" in deepspeed_sections(cfg) else cfg.training.optim


def _optimizer_name(record: str) -> str:
    return "the optimizer of its DeepSpeed JSON" if record == "deepspeed" else f"--optim {record}"


def sharding_engine(cfg: Config) -> str:
    """What holds the model and optimizer states: ZeRO-n, FSDP2, or neither (each process the whole)."""
    from cloudtrain.parallel.distributed import sharding  # (it imports the trainers' configs)

    shards = sharding(cfg)
    return f"ZeRO-{shards.zero_stage}" if shards.zero_stage is not None else "FSDP2" if shards.fsdp else "none"


class Checkpointer:
    """Saves checkpoints atomically and rotates them; every process calls `save`, each folder's owner
    (`Storage`) creates and renames it, the main process decides what rotation deletes."""

    def __init__(
        self,
        cfg: Config,
        folder: Path,
        output_dir: Path,
        is_main_process: bool,
        barrier: Callable[[], None],
        export: Callable[[Path], None] | None = None,
        on_saved: Callable[[int, Path], None] | None = None,
        before_delete: Callable[[], None] | None = None,
        storage: Storage | None = None,
        share: Callable[[Any], Any] = lambda value: value,
        index: int = 0,
        labels: Sequence[str] = (),
        data: dict | None = None,
    ):
        """`export(folder)` (every process) adds files to a checkpoint being written; `on_saved(step,
        path)` (main) sees each complete one; `before_delete()` (main) runs before rotation deletes;
        `share(value)` hands the main process's value to every process (a collective); `labels`: a classifier's,
        by output (`check_labels`); `data`: the training rows' record (cloudtrain.data.fingerprint)."""
        self.folder, self.output_dir, self.is_main, self.barrier = (
            Path(folder),
            Path(output_dir),
            is_main_process,
            barrier,
        )
        self.export, self.on_saved, self.before_delete = export, on_saved, before_delete
        self.storage = storage or Storage(owner=is_main_process)
        self.background = BackgroundSave(cfg.distributed.collective_timeout)  # in flight: --async_checkpointing
        self.thread_collectives: ThreadCollectives | None = None  # its barrier and broadcast (several processes)
        self._published: list[tuple[int, Path]] = []  # complete, renamed and not yet taken (`take_published`)
        self._lock = threading.Lock()
        self.owner, self.share, self.index = self.storage.owner, share, index
        c = cfg.checkpoint
        self.every = None if c.checkpointing_steps in (None, "epoch") else int(c.checkpointing_steps)
        self.at_epoch_end = c.checkpointing_steps == "epoch"
        self.limit, self.metric = c.save_total_limit, c.metric_for_best_model
        self.asynchronous = c.async_checkpointing  # saves publish from a background thread
        self.adapters = adapter_settings(cfg)
        self.model = model_record(cfg)
        self.labels = list(labels)  # what each output of a classifier means: a resume on renamed labels is refused
        self.data = data or {}  # the rows trained on: a resume on other rows is told so
        t = cfg.training  # what --per_device_train_batch_size auto chose: a resume takes it instead of searching
        self.batch = {
            "per_device_train_batch_size": t.per_device_train_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps,
            "group_by_length": cfg.data.group_by_length,  # with the seed, the stored rows' order
        }
        self.seed = t.seed  # the stored rows' order: a resume's step is a position in it
        self.engine = sharding_engine(cfg)  # ZeRO and FSDP both shard over the same mesh: the states differ
        self.optimizer = optimizer_record(cfg)  # another optimizer cannot take its state

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1][1] if found else None

    def due(self, step: int, end_of_epoch: bool) -> bool:
        return bool((self.every and step % self.every == 0) or (self.at_epoch_end and end_of_epoch))

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        trainer: str,
        mesh: Mesh,
        state: TrainerState,
        start: float | None = None,
    ) -> Path:
        """Write checkpoint-<step> now (every process); `start`: when the loop stopped for it (perf_counter)."""
        self.background.wait()  # a background save in flight finishes (and rotates) first
        start = time.perf_counter() if start is None else start
        partial = self._open(step)
        return self._save_now(step, partial, write, trainer, mesh, state, start, blocked_s=None)

    def take_published(self, agreed: Callable[[int], int] | None = None) -> list[tuple[int, Path]]:
        """The (step, path) of each checkpoint complete and renamed (on every process) since the last call:
        a synchronous save's at once, a background save's once its thread has published it. `agreed(count)`
        (a collective: the smallest count on any process) keeps the processes in step: each process's thread
        publishes on its own after the last barrier, so one may see a checkpoint a step before another."""
        with self._lock:
            ready = len(self._published)
        count = agreed(ready) if agreed else ready
        with self._lock:
            published, self._published = self._published[:count], self._published[count:]
        return published

    def save_async(
        self, step: int, write: Callable[[Path], None], trainer: str, mesh: Mesh, state: TrainerState, start: float
    ) -> float:
        """Start writing checkpoint-<step> in the background (every process; cloudtrain.async_save): `write`
        writes this process's part from a CPU snapshot and `state` is the caller's own copy, so the loop may go
        on. The hub export reads the live model, so it runs here, before the thread. Returns the seconds the
        loop was blocked since `start`."""
        self.background.wait()
        if self.thread_collectives is None and ThreadCollectives.needed():
            self.thread_collectives = ThreadCollectives(self.background.timeout)  # every process is here, now
        partial = self._open(step)
        self._copy_run_files(partial)  # now: the loop logs on while the thread writes
        if self.export:
            self.export(partial)
        blocked = time.perf_counter() - start

        meet = self.thread_collectives

        def work() -> None:
            collectives = (meet.barrier, meet.share) if meet else (lambda: None, lambda value: value)
            self._save_now(step, partial, write, trainer, mesh, state, start, blocked, True, collectives)

        self.background.start(work, name=f"{PREFIX}{step}")
        return blocked

    def _open(self, step: int) -> Path:
        """The empty `.partial` folder of checkpoint-<step>, on every process."""
        partial = self.folder / f"{PREFIX}{step}.partial"
        if self.owner:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            (partial / MARKS).mkdir(parents=True)
        self.barrier()
        return partial

    def _save_now(
        self,
        step: int,
        partial: Path,
        write: Callable[[Path], None],
        trainer: str,
        mesh: Mesh,
        state: TrainerState,
        start: float,
        blocked_s: float | None,
        early: bool = False,
        collectives: tuple[Callable[[], None], Callable[[Any], Any]] | None = None,
    ) -> Path:
        """Every process writes its part into `partial`; the owner seals and renames it; then rotation.
        `blocked_s`: how long the loop waited for a background save (None: the whole save); `early`: the
        export and the run files are in `partial` already (`save_async`); `collectives`: the barrier and
        share a background thread meets the other processes' threads with (default: the launch's)."""
        barrier, share = collectives or (self.barrier, self.share)
        final = self.folder / f"{PREFIX}{step}"
        try:
            write(partial)  # every process writes its part
            kill_point("checkpoint.written")
            if self.export and not early:
                self.export(partial)
            (partial / MARKS / str(self.index)).touch()
            barrier()  # every process's part is complete before the folder is sealed
            if self.owner:
                self._finalise(partial, final, trainer, mesh, state, copy_run_files=not early)
        except Exception as err:
            if not is_no_space(err):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            raise UserError(
                f"the disk of {self.folder} filled up while checkpoint-{step} was written ({first_line(err)}); "
                "the earlier checkpoints are intact: free some space (or lower --save_total_limit) and resume "
                "with --resume_from_checkpoint latest"
            ) from None
        barrier()  # complete on every node before anything is announced or deleted
        if self.is_main:
            self._announce(step, final, time.perf_counter() - start, blocked_s)
        doomed = share(self.doomed(step) if self.is_main else None)
        if self.owner:
            self.delete(doomed)
        barrier()
        with self._lock:
            self._published.append((step, final))
        return final

    def _announce(self, step: int, final: Path, took: float, blocked_s: float | None) -> None:
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        blocked = took if blocked_s is None else blocked_s
        how = "" if blocked_s is None else ", in the background"
        console.say(  # through the training bar, else the line would continue the bar's
            f"checkpoint saved to {final} ({size / 2**20:.0f} MiB, {took:.1f}s{how}; "
            f"the training loop was blocked {blocked:.2f}s)"
        )
        if self.on_saved:
            self.on_saved(step, final)

    def _copy_run_files(self, partial: Path) -> None:
        if self.owner:
            for name in RUN_FILES:  # a spot restart may come back with an empty output dir
                if (self.output_dir / name).is_file():
                    shutil.copy2(self.output_dir / name, partial / name)

    def _finalise(
        self, partial: Path, final: Path, trainer: str, mesh: Mesh, state: TrainerState, copy_run_files: bool = True
    ) -> None:
        """trainer_state.json written last and synced, then the atomic rename."""
        meta = {
            "format": FORMAT,
            "trainer": trainer,
            "num_processes": mesh.world,
            "mesh": mesh.degrees(),
            "adapters": self.adapters,
            "model": self.model,
            "batch": self.batch,
            "seed": self.seed,
            "engine": self.engine,
            "optimizer": self.optimizer,
            "labels": self.labels,
            "data": self.data,
            "metric": self.metric,
            "score": self._score(state),
            "state": asdict(state),
        }
        if copy_run_files:
            self._copy_run_files(partial)
        fsync_tree(partial)  # its weights and states on disk before the state file marks it complete
        _write_synced(partial / STATE_FILE, json.dumps(meta, indent=2))
        kill_point("checkpoint.sealed")
        aside = final.with_name(f"{final.name}.replaced")
        if final.exists():  # the same step saved again after a resume: renamed away whole, never half-deleted
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            kill_point("checkpoint.replaced")  # finish_replacement finishes what a kill here leaves
        os.replace(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
        fsync(self.folder)

    def _score(self, state: TrainerState) -> float | None:
        """The metric of the last evaluation before this save, oriented so that higher is better."""
        return score(self.metric, state.evaluations[-1][self.metric]) if state.evaluations else None

    def _stored_score(self, meta: dict) -> float | None:
        """A checkpoint's score by this run's metric: one saved while another --metric_for_best_model was set is
        scored again from its evaluations (its stored score, say accuracy, beside this run's -loss won every time)."""
        if meta.get("metric", self.metric) == self.metric:
            return meta.get("score")
        evaluations = (meta.get("state") or {}).get("evaluations") or []
        value = evaluations[-1].get(self.metric) if evaluations else None
        return None if value is None else score(self.metric, value)

    def doomed(self, saved: int) -> list[int]:
        """The oldest steps beyond the limit, never the one just `saved` or the best; judged from this folder."""
        found = complete_checkpoints(self.folder)
        if not self.limit or len(found) <= self.limit:
            return []
        scores = {path: self._stored_score(json.loads((path / STATE_FILE).read_text())) for _, path in found}
        scored = [
            (score, step, path) for step, path in found if (score := scores[path]) is not None and not math.isnan(score)
        ]
        # on a tie the earliest: checkpoints saved after the same evaluation share its score, and the first of them
        # is the model it evaluated (the one --load_best_model_at_end loads)
        best = max(scored, key=lambda entry: (entry[0], -entry[1]))[2] if scored else None
        keep = {self.folder / f"{PREFIX}{saved}"} | ({best} if best else set())
        doomed: list[int] = []
        for step, path in found:
            if len(found) - len(doomed) <= max(self.limit, len(keep)):
                break
            if path not in keep:
                doomed.append(step)
        return doomed

    def delete(self, steps: list[int]) -> list[Path]:
        paths = [self.folder / f"{PREFIX}{step}" for step in steps]
        if paths and self.before_delete:
            self.before_delete()
        for path in paths:
            # renamed first: a kill mid-delete leaves a hidden folder, not a checkpoint-N without its state file
            # (which would read as another trainer's, resume.foreign_checkpoints)
            hidden = path.with_name(f".{path.name}.deleted-{uuid.uuid4().hex[:8]}")
            try:
                os.replace(path, hidden)
            except OSError:  # another process on the same storage took it first, or it is gone
                continue
            shutil.rmtree(hidden, ignore_errors=True)
        return paths


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
