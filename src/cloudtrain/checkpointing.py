"""Checkpoints: atomic saves, rotation, finding the latest, safe loading, preemption.

    <checkpoint_dir>/checkpoint-<step>/
        trainer_state.json   step counters, data position, logging sums, evaluations, score (written last)
        ...                  what the trainer saves: model.safetensors, optimizer, scheduler, scaler, RNG states

- Atomic: a checkpoint is written to `checkpoint-<step>.partial` and renamed when complete, so a kill
  during a save leaves the previous checkpoint as the latest; a stale `.partial` is removed.
- Rotation (`--save_total_limit K`) deletes the oldest checkpoints but never the newest or the best
  (by `--metric_for_best_model`, as of the last evaluation before the save).
- Loading is safe: weights from safetensors, everything else through `torch.load(weights_only=True)`
  or JSON; a corrupt or foreign directory is one clear error. (DeepSpeed's own engine states are
  read by DeepSpeed's loader.)
- SIGTERM (spot reclaim, Kubernetes, SLURM preemption) sets a flag that the loop reads at its next
  logging or checkpoint step: it saves a checkpoint and exits with status 143.
"""

import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cloudtrain.config import Config
from cloudtrain.errors import UserError

STATE_FILE = "trainer_state.json"
RUN_FILES = ("metrics.jsonl", "tracker_runs.json")  # the run's log and tracker ids travel with each checkpoint
FORMAT = "cloudtrain-checkpoint/1"
PREFIX = "checkpoint-"
LOWER_IS_BETTER = ("loss", "perplexity")


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
    evaluations: list = field(default_factory=list)
    skipped_steps: int = 0  # non-finite steps skipped with --nonfinite_loss skip


def checkpoint_dir(cfg: Config, output_dir: Path) -> Path:
    return Path(cfg.checkpoint.checkpoint_dir) if cfg.checkpoint.checkpoint_dir else Path(output_dir) / "checkpoints"


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `folder`, oldest first."""
    found = []
    for path in Path(folder).glob(f"{PREFIX}*"):
        step = path.name[len(PREFIX) :]
        if step.isdigit() and (path / STATE_FILE).is_file():
            found.append((int(step), path))
    return sorted(found)


def find_resume_checkpoint(cfg: Config, folder: Path) -> Path | None:
    """The checkpoint --resume_from_checkpoint names: a directory, or the latest complete one (or None)."""
    wanted = cfg.checkpoint.resume_from_checkpoint
    if wanted is None:
        return None
    if wanted == "latest":
        found = complete_checkpoints(folder)
        if not found:
            if int(os.environ.get("RANK", "0")) == 0:  # before the process group exists: one line, not one per rank
                print(f"no complete checkpoint in {folder}: starting fresh", flush=True)
            return None
        path = found[-1][1]
    else:
        path = Path(wanted)
        if not path.is_dir():
            raise UserError(f"--resume_from_checkpoint {wanted} does not exist; give a checkpoint directory or latest")
    saved = read_state(path).get("adapters")
    if saved != adapter_settings(cfg):  # checked now, not after loading: other adapters cannot take these weights
        raise UserError(
            f"checkpoint {path} trained {_describe(saved)}, this run asks for "
            f"{_describe(adapter_settings(cfg))}; resume with the same --peft and --lora_* options"
        )
    return path


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


def restore_run_files(checkpoint: Path, output_dir: Path) -> None:
    """Put the run's log and tracker ids back from the checkpoint when the output dir lost them."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if (checkpoint / name).is_file() and not (Path(output_dir) / name).exists():
            shutil.copy2(checkpoint / name, Path(output_dir) / name)


def check_compatible(meta: dict, path: Path, trainer: str, num_processes: int) -> None:
    if meta["trainer"] != trainer or meta["num_processes"] != num_processes:
        raise UserError(
            f"checkpoint {path} was written by the {meta['trainer']} with {meta['num_processes']} "
            f"process(es); this run is the {trainer} with {num_processes}: resume it the same way"
        )


class Checkpointer:
    """Saves checkpoints atomically and rotates them; every process calls `save`, the main one renames."""

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
    ):
        """`export(folder)` (every process) adds files to a checkpoint being written; `on_saved(step,
        path)` (main) sees each complete one; `before_delete()` (main) runs before rotation deletes."""
        self.folder, self.output_dir, self.is_main, self.barrier = (
            Path(folder),
            Path(output_dir),
            is_main_process,
            barrier,
        )
        self.export, self.on_saved, self.before_delete = export, on_saved, before_delete
        c = cfg.checkpoint
        self.every = None if c.checkpointing_steps in (None, "epoch") else int(c.checkpointing_steps)
        self.at_epoch_end = c.checkpointing_steps == "epoch"
        self.limit, self.metric = c.save_total_limit, c.metric_for_best_model
        self.adapters = adapter_settings(cfg)
        t = cfg.training  # what --per_device_train_batch_size auto chose: a resume takes it instead of searching
        self.batch = {
            "per_device_train_batch_size": t.per_device_train_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps,
        }

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.folder)
        return found[-1][1] if found else None

    def due(self, step: int, end_of_epoch: bool) -> bool:
        return bool((self.every and step % self.every == 0) or (self.at_epoch_end and end_of_epoch))

    def save(
        self, step: int, write: Callable[[Path], None], trainer: str, num_processes: int, state: TrainerState
    ) -> Path:
        final, partial = self.folder / f"{PREFIX}{step}", self.folder / f"{PREFIX}{step}.partial"
        start = time.perf_counter()
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            partial.mkdir(parents=True)
        self.barrier()
        write(partial)  # every process writes its part
        if self.export:
            self.export(partial)
        self.barrier()
        if self.is_main:
            meta = {
                "format": FORMAT,
                "trainer": trainer,
                "num_processes": num_processes,
                "adapters": self.adapters,
                "batch": self.batch,
                "metric": self.metric,
                "score": self._score(state),
                "state": asdict(state),
            }
            for name in RUN_FILES:  # a spot restart may come back with an empty output dir
                if (self.output_dir / name).is_file():
                    shutil.copy2(self.output_dir / name, partial / name)
            _write_synced(partial / STATE_FILE, json.dumps(meta, indent=2))
            if final.exists():  # the same step saved again after a resume
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.folder)
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            print(
                f"checkpoint saved to {final} ({size / 2**20:.0f} MiB, {time.perf_counter() - start:.1f}s)", flush=True
            )
            if self.on_saved:
                self.on_saved(step, final)
            self.rotate()
        self.barrier()
        return final

    def _score(self, state: TrainerState) -> float | None:
        """The metric of the last evaluation before this save, oriented so that higher is better."""
        if not state.evaluations:
            return None
        value = state.evaluations[-1][self.metric]
        return -value if self.metric in LOWER_IS_BETTER else value

    def rotate(self) -> list[Path]:
        """Delete the oldest checkpoints beyond the limit, never the newest or the best; returns the deleted."""
        found = complete_checkpoints(self.folder)
        if not self.limit or len(found) <= self.limit:
            return []
        scores = {path: json.loads((path / STATE_FILE).read_text()).get("score") for _, path in found}
        scored = [
            (score, step, path) for step, path in found if (score := scores[path]) is not None and not math.isnan(score)
        ]
        keep = {found[-1][1]} | ({max(scored)[2]} if scored else set())
        deleted: list[Path] = []
        for _, path in found:
            if len(found) - len(deleted) <= max(self.limit, len(keep)):
                break
            if path not in keep:
                if self.before_delete and not deleted:
                    self.before_delete()
                shutil.rmtree(path)
                deleted.append(path)
        return deleted


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PreemptionSignal:
    """While active, SIGTERM only sets `received`; the training loop saves and stops when it reads it."""

    def __init__(self):
        self.received = False
        self._previous = None

    def __enter__(self) -> "PreemptionSignal":
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
