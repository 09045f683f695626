"""Where a launch starts: the checkpoint every process resumes from (`agree_on_resume`: a named one, or `latest`,
the newest complete on every node), an earlier run's checkpoints that a fresh run must not mix with its own
(`start_over`, `drop_earlier_checkpoints`), the checkpoints after an older one resumed (`set_aside_newer`), the
attempt torchrun restarts (`restarted_defaults`), a save a kill cut between its renames
(`finish_interrupted_saves`), what a checkpoint must match beyond its layout (`check_engine`, `check_order`) and
a load that failed, in one line (`load_failure`). The checkpoints themselves: cloudtrain.checkpointing."""

import contextlib
import json
import os
import re
import shutil
import threading
import time
import uuid
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from cloudtrain.checkpointing import (
    DATA_STATE_FILE,
    FORMAT,
    MARKS,
    PREFIX,
    STATE_FILE,
    check_resumable,
    complete_checkpoints,
    finish_replacement,
    node_name,
    read_state,
    sharding_engine,
    state_format,
    written_by_cloudtrain,
)
from cloudtrain.config import Config
from cloudtrain.errors import UserError, first_line
from cloudtrain.models.record import safetensors_header
from cloudtrain.paths import resumes_here, torchrun_restarts
from cloudtrain.sagemaker_env import fresh_start


def first_on_node() -> bool:
    """Whether this process is its node's first (local rank 0): the one that changes a folder each node may hold."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def finish_interrupted_saves(folder: Path, runtime: Any) -> None:
    """Before any process looks at the checkpoints: a checkpoint saved again at its step, cut by a kill between
    its renames, is finished, and the `.partial` folders of saves a kill cut are removed, or renamed where sealed
    (once per node: each node may hold its own folder; they were left until a save at the same step, a full
    checkpoint each)."""
    if first_on_node():
        finish_replacement(folder)
        for partial in Path(folder).glob(f"{PREFIX}*.partial"):  # a save a kill cut
            final = partial.with_name(partial.name.removesuffix(".partial"))
            if not (final.name[len(PREFIX) :].isdigit() and (partial / MARKS).is_dir()):
                continue  # not a save of ours
            with contextlib.suppress(OSError):  # another node on the same storage took it first
                if written_by_cloudtrain(partial / STATE_FILE) and not final.exists():
                    os.replace(partial, final)  # sealed, so whole: the kill came before its rename
                else:
                    shutil.rmtree(partial)
    runtime.barrier()


def restarted_defaults(cfg: Config, folder: Path, runtime: Any) -> Config:
    """A worker that torchrun restarted (--max-restarts) resumes from the latest checkpoint once this launch has
    saved one (a restart must not go back to where the launch began, nor take an earlier run's checkpoints);
    before that it starts as the first attempt did."""
    # every process's count (after one node's worker died, c10d restarts the other nodes' with theirs unchanged)
    restarts = max(runtime.gather_objects(torchrun_restarts()))
    wanted = cfg.checkpoint.resume_from_checkpoint
    if restarts == 0 or wanted == "latest":
        return cfg
    if not runtime.agree([saved_since_launch(folder)])[0]:
        return cfg  # nothing of this launch's to go back to: the attempt starts as the first did
    if runtime.is_main:
        print(f"restart {restarts} of this launch: resuming from the latest complete checkpoint", flush=True)
    return replace(cfg, checkpoint=replace(cfg.checkpoint, resume_from_checkpoint="latest"))


def saved_since_launch(folder: Path) -> bool:
    """Whether the newest complete checkpoint in `folder` was written after this launch began (the start of the
    torchrun agent whose worker this is): only those are a restarted attempt's to resume, not an earlier run's."""
    found = complete_checkpoints(folder)
    if not found:
        return False
    try:
        started = psutil.Process(os.getppid()).create_time()
    except psutil.Error:
        return True
    return (found[-1][1] / STATE_FILE).stat().st_mtime >= started


def foreign_checkpoints(folder: Path) -> list[str]:
    """`checkpoint-N` folders in `folder` that another trainer wrote (a readable state file of another format, or
    none readable and none of the marks every process of a cloudtrain save leaves): a run must not replace them.
    One of ours whose state file is damaged is no checkpoint (resuming it says so)."""
    return sorted(path.name for _, path in _numbered(folder) if not _ours(path))


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the `checkpoint-N` folders in `folder`, whoever wrote them, oldest first."""
    found = [(path.name[len(PREFIX) :], path) for path in Path(folder).glob(f"{PREFIX}*")]
    return sorted((int(step), path) for step, path in found if step.isdigit())


def unreadable_checkpoints(folder: Path) -> list[Path]:
    """Our `checkpoint-N` folders (the marks every process of a cloudtrain save leaves) whose state file cannot be
    read (a damaged disk, a truncated copy): no checkpoint to resume, but whole weights and states, perhaps."""
    return [
        path for _, path in _numbered(folder) if (path / MARKS).is_dir() and state_format(path / STATE_FILE) is None
    ]


def _ours(path: Path) -> bool:
    found = state_format(path / STATE_FILE)
    return found == FORMAT or (found is None and (path / MARKS).is_dir())


def local_view(cfg: Config, folder: Path, index: int = 0, node: int = 0, host: str = "") -> dict:
    """What process `index` sees of the checkpoints: the steps in `folder` complete with its own files, and
    whether a named checkpoint is there."""
    wanted = cfg.checkpoint.resume_from_checkpoint
    named = wanted not in (None, "latest") and Path(wanted).is_dir()
    steps = [step for step, path in complete_checkpoints(folder) if holds_files_of(path, index)]
    damaged = _damaged_newest(folder, steps) if wanted == "latest" and first_on_node() else []
    view = {"node": node, "host": host, "steps": steps, "named": named, "foreign": foreign_checkpoints(folder)}
    return {**view, "damaged": damaged, "unreadable": [path.name for path in unreadable_checkpoints(folder)]}


def _damaged_newest(folder: Path, steps: list[int]) -> list[tuple[int, str]]:
    """(step, what is wrong) of the newest checkpoints whose files are not whole, down to the first whole one:
    `latest` passes over them (without it, the resume failed on loading the newest one)."""
    found = []
    for step in sorted(steps, reverse=True):
        if (why := cut_short(Path(folder) / f"{PREFIX}{step}")) is None:
            break
        found.append((step, why))
    return found


def holds_files_of(path: Path, index: int) -> bool:
    """Whether process `index` finished writing its part of checkpoint `path` (checkpoints written before
    these marks existed count as whole). A process beyond those that wrote it (a resume on more processes) has no
    part of its own: it holds what it needs where the checkpoint is complete on its node (a mark is there)."""
    marks = Path(path) / MARKS
    if not marks.is_dir() or (marks / str(index)).exists():
        return True
    try:
        writers = int(json.loads((Path(path) / STATE_FILE).read_text())["num_processes"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return index >= writers and any(marks.iterdir())


def agree_on_resume(cfg: Config, folder: Path, runtime: Any) -> Path | None:
    """The checkpoint every process resumes from (or None), agreed across processes before anything loads;
    a problem on any process is the same error on all (the main process prints it)."""
    try:
        views = runtime.gather_objects(local_view(cfg, folder, runtime.index, runtime.node, runtime.host))
        path = choose_resume(cfg, folder, views, announce=runtime.is_main)  # from the same views everywhere
        # the folder's checkpoints are this run's when it resumes one of them; another folder's checkpoint starts a
        # run of its own here, which the folder's earlier checkpoints must not mix into (latest, rotation, best)
        here = resumes_here(path, folder)
        start_over(cfg, folder, [{**v, "steps": [], "unreadable": []} if here else v for v in views])
    except UserError as err:
        raise UserError(str(err), quiet=not runtime.is_main) from None
    problem = None
    if path:
        try:
            check_resumable(cfg, path)
            if first_on_node() and (why := cut_short(path)):  # a named one: `latest` passed over the damaged
                raise UserError(f"checkpoint {path}: {why}; resume from an earlier checkpoint, or restore its files")
        except UserError as err:
            problem = str(err) + (f" (on node {runtime.node})" if runtime.count > 1 else "")
    problems = [p for p in runtime.gather_objects(problem) if p]
    if problems:
        raise UserError(problems[0], quiet=not runtime.is_main)
    return path


def start_over(cfg: Config, folder: Path, views: list[dict]) -> None:
    """A fresh run in a folder holding an earlier run's checkpoints is refused (resuming, rotating or choosing
    the best would mix the two runs) unless --overwrite_output_dir, whose run deletes them once it is built
    (`drop_earlier_checkpoints`). Another trainer's checkpoint-N, which a save of that step would replace, is
    refused either way."""
    foreign = sorted({name for v in views for name in v.get("foreign", [])})
    if foreign:
        raise UserError(
            f"{folder} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which cloudtrain did not "
            "write and a save of that step would replace; give the run a --checkpoint_dir of its own"
        )
    newest = max((step for v in views for step in v["steps"]), default=None)
    if newest is not None and not cfg.output.overwrite_output_dir:
        raise UserError(
            f"{folder} holds checkpoints of an earlier run (up to checkpoint-{newest}): continue it with "
            "--resume_from_checkpoint latest, or pass --overwrite_output_dir true to start over (they are deleted)"
        )
    unreadable = unreadable_names(views)
    if unreadable and not cfg.output.overwrite_output_dir:  # a save of its step would replace it, without a word
        names = ", ".join(unreadable[:3]) + (" ..." if len(unreadable) > 3 else "")
        raise UserError(
            f"{folder} holds {names} of an earlier run, whose {STATE_FILE} cannot be read (damaged or cut short): "
            "restore that file and continue with --resume_from_checkpoint latest, move the folder elsewhere, or "
            "pass --overwrite_output_dir true to start over (it is deleted)"
        )


def unreadable_names(views: list[dict]) -> list[str]:
    """The checkpoint-N folders, by step, whose state file some process's `local_view` could not read."""
    return sorted({name for v in views for name in v.get("unreadable", [])}, key=lambda n: int(n[len(PREFIX) :]))


def drop_earlier_checkpoints(folder: Path, runtime: Any) -> None:
    """--overwrite_output_dir, a fresh run built and about to train: the earlier run's checkpoints (and ours whose
    state file cannot be read) leave at once (renamed, once per node: each node may hold its own folder) and are
    deleted in the background."""
    if first_on_node():
        gone = []
        for path in [path for _, path in complete_checkpoints(folder)] + unreadable_checkpoints(folder):
            hidden = path.with_name(f".{path.name}.deleted-{uuid.uuid4().hex[:8]}")
            with contextlib.suppress(OSError):  # another node on the same storage took it first
                path.rename(hidden)
                gone.append(hidden)
        if gone:
            threading.Thread(target=_delete, args=(gone,), daemon=True).start()
            if runtime.is_main:
                print(f"--overwrite_output_dir: the earlier run's checkpoints in {folder} are deleted", flush=True)
    runtime.barrier()


def _note_damaged_after(folder: Path, step: int) -> None:
    """Newer checkpoint-N folders whose trainer_state.json cannot be read (a damaged disk, a truncated copy):
    `latest` passes over them, and says so."""
    damaged = [(s, path.name) for s, path in _numbered(folder) if s > step and state_format(path / STATE_FILE) is None]
    if damaged:
        print(
            f"note: {', '.join(name for _, name in damaged)} in {folder} cannot be read (its {STATE_FILE} is "
            f"missing or damaged): resuming from checkpoint-{step}, the newest complete one",
            flush=True,
        )


def _note_cut_short(folder: Path, damaged: dict[int, str]) -> None:
    names = ", ".join(f"checkpoint-{step} ({why})" for step, why in sorted(damaged.items(), reverse=True))
    print(f"note: {names} in {folder}: latest passes over it", flush=True)


def set_aside_newer(folder: Path, resumed: Path, runtime: Any) -> None:
    """A resume from a checkpoint older than others in this run's checkpoint folder (a step back, after a loss
    spike): the newer ones belong to the branch it leaves, and `latest`, rotation and the best model would mix the
    two. They are moved (once per node) into `abandoned-<time>/` beside them: nothing deleted, nothing mixed."""
    step = int(read_state(resumed)["state"]["global_step"])
    stamp = runtime.share(time.strftime("%Y%m%d-%H%M%S"))  # one name on every node
    if first_on_node():
        # ours past the step, complete or not: one whose state file is damaged holds whole weights and states too
        # (an interrupted copy of its state file), and a save at its step replaced and deleted it
        newer = [path for s, path in _numbered(folder) if s > step and _ours(path)]
        aside = Path(folder) / f"abandoned-{stamp}"
        for path in newer:
            with contextlib.suppress(OSError):  # another node on the same storage took it first
                aside.mkdir(exist_ok=True)
                path.rename(aside / path.name)
        if newer and runtime.is_main:
            names = ", ".join(path.name for path in newer[:3]) + (" ..." if len(newer) > 3 else "")
            print(
                f"note: {names} in {folder} came after {resumed.name}, which this run resumes from: moved to "
                f"{aside}, so that latest, rotation and the best model follow this run (delete them when done)",
                flush=True,
            )
    runtime.barrier()


def _delete(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def refuse_a_folder_of_checkpoints(wanted: str, path: Path, folder: Path) -> None:
    """--resume_from_checkpoint naming a folder of checkpoints, or a run's output folder (its checkpoints/ in it):
    one line naming the newest complete one to give."""
    for holder in (path, path / "checkpoints"):
        if held := _numbered(holder):
            whole = complete_checkpoints(holder) or held
            names = ("... " if len(held) > 3 else "") + ", ".join(p.name for _, p in held[-3:])
            same = Path(folder).resolve() == holder.resolve()
            raise UserError(
                f"--resume_from_checkpoint {wanted} is a folder of checkpoints ({names}), not one: give "
                f"{holder / whole[-1][1].name}, or latest" + ("" if same else f" with --checkpoint_dir {holder}")
            )


def choose_resume(cfg: Config, folder: Path, views: list[dict], announce: bool = True) -> Path | None:
    """The checkpoint --resume_from_checkpoint names, given each process's `local_view`: a directory every
    process sees, or `latest`, the newest step complete on every node (None: a fresh start)."""
    wanted = cfg.checkpoint.resume_from_checkpoint
    if wanted is None:
        return None
    nodes = len({v["node"] for v in views})
    if wanted != "latest":
        without = [v for v in views if not v["named"]]
        if without and Path(wanted).is_file():
            raise UserError(
                f"--resume_from_checkpoint {wanted} is a file, not a checkpoint directory; give the folder that "
                f"holds it ({Path(wanted).parent}), or latest"
            )
        if without:
            where = f" on {node_name(without[0])}" if nodes > 1 else ""
            raise UserError(
                f"--resume_from_checkpoint {wanted} does not exist{where}; give a checkpoint directory"
                + (" every node holds" if nodes > 1 else "")
                + ", or latest"
            )
        path = Path(wanted)
        if not (path / STATE_FILE).exists():  # the folder of checkpoints (or a run's, holding one), not one
            refuse_a_folder_of_checkpoints(wanted, path, folder)
    else:
        damaged = {step: why for v in views for step, why in v.get("damaged", [])}
        if damaged and announce:
            _note_cut_short(folder, damaged)
        views = [{**v, "steps": [s for s in v["steps"] if s not in damaged]} for v in views]
        common = set.intersection(*(set(v["steps"]) for v in views))
        newest = max((max(v["steps"]) for v in views if v["steps"]), default=None)
        unreadable = unreadable_names(views)
        if newest is None and unreadable and not damaged:  # (said as for a damaged one, not "starting fresh")
            damaged = {int(unreadable[-1][len(PREFIX) :]): f"its {STATE_FILE} cannot be read"}
        if newest is None and damaged and not cfg.output.overwrite_output_dir:
            raise UserError(
                f"no checkpoint in {folder} is whole (checkpoint-{max(damaged)}: {damaged[max(damaged)]}): restore "
                "its files, or pass --overwrite_output_dir true to start over (they are deleted)"
            )
        if newest is None:
            if announce:
                print(f"no complete checkpoint in {folder}: starting fresh", flush=True)
            return None
        lacking = next((v for v in views if newest not in v["steps"]), views[0])
        if not common:
            raise UserError(
                f"{node_name(lacking)} holds no complete checkpoint in {folder}, while others hold up to "
                f"checkpoint-{newest}: restore that node's folder (SageMaker restores it from S3), or clear "
                "every node's folder to start fresh"
            )
        step = max(common)
        if announce:
            _note_damaged_after(folder, step)
        if step < newest and announce:
            print(
                f"checkpoint-{newest} is not complete on {node_name(lacking)}: resuming from checkpoint-{step}, "
                "the newest that every node holds",
                flush=True,
            )
        path = Path(folder) / f"{PREFIX}{step}"
    return path


MISFIT = re.compile(r"size mismatch|Missing key|Unexpected key|shape mismatch")  # a load error: another model


def check_engine(meta: dict, path: Path, cfg: Config) -> None:
    """A checkpoint's states are those of the engine that wrote them (checkpoints before the record hold none)."""
    written, now = meta.get("engine"), sharding_engine(cfg)
    if written is not None and written != now:
        options = {"none": "neither --zero_stage nor --fsdp", "FSDP2": "--fsdp true"}.get(
            written, f"--zero_stage {written.removeprefix('ZeRO-')}"
        )
        raise UserError(
            f"checkpoint {path} holds the states of {written} and this run uses {now}: each engine reads only its "
            f"own; resume it with {options}, or {fresh_start(path)}"
        )


def check_order(meta: dict, path: Path, cfg: Config) -> None:
    """Stored rows: a checkpoint's step is a position in its order of the rows, which its seed and
    --group_by_length make (checkpoints before the record hold none); a stream's checkpoint holds a cursor."""
    seed, grouped = cfg.training.seed, cfg.data.group_by_length
    if (path / DATA_STATE_FILE).is_file():
        raise UserError(
            f"checkpoint {path} holds a stream's position ({DATA_STATE_FILE}): it was written by a run with "
            "--streaming true; resume it the same way"
        )
    saved = meta.get("seed", seed)
    if saved != seed:
        raise UserError(
            f"checkpoint {path} was trained with --seed {saved} and this run has --seed {seed}: its step is a "
            f"position in that seed's order of the rows; resume with --seed {saved}"
        )
    was = (meta.get("batch") or {}).get("group_by_length", grouped)
    if was != grouped:
        raise UserError(
            f"checkpoint {path} was trained with --group_by_length {str(was).lower()} and this run has "
            f"{str(grouped).lower()}: its step is a position in that order of the rows; resume with "
            f"--group_by_length {str(was).lower()}"
        )


def load_failure(path: Path, err: BaseException) -> UserError:
    """A checkpoint that failed to load, in one line: one that does not fit this model, or a damaged one."""
    text = str(err)
    why = next((line.strip() for line in text.splitlines() if MISFIT.search(line)), None)
    if why:
        return UserError(
            f"checkpoint {path} does not fit the model this run builds ({why[:200]}): resume with the model and "
            f"options that wrote it, or {fresh_start(path)}"
        )
    said = f": {first_line(err)[:200]}" if text.strip() else ""
    return UserError(
        f"checkpoint {path} could not be loaded ({type(err).__name__}{said}); it may be damaged: pass another "
        "--resume_from_checkpoint"
    )


STOPPED_MARK = "stopped_after_last_step"  # train_results.json: the signal that cut the run's evaluation short


def trained_already(cfg: Config, output_dir: Path) -> str | None:
    """A requeued run (`--resume_from_checkpoint latest`, no checkpoint to resume) whose output folder holds its
    own model, saved when a signal stopped it after its last step: what to say as it ends there with nothing left
    to train (None: not that case). Without it, the requeue was refused as a fresh run over an earlier model, and a
    scheduler retried it for ever."""
    from cloudtrain.publish.saving import read_arguments, recorded_form  # the heavy publishing imports

    if cfg.checkpoint.resume_from_checkpoint != "latest" or cfg.output.overwrite_output_dir:
        return None
    try:
        train = json.loads((Path(output_dir) / "train_results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    by = train.get(STOPPED_MARK) if isinstance(train, dict) else None

    now = recorded_form(cfg)
    same = [k for k, v in now.items() if v != "auto" and k not in ("resume_from_checkpoint", "overwrite_output_dir")]
    recorded = read_arguments(output_dir)  # (what a requeue may change; `auto` was recorded as what it resolved to)
    if not by or any(recorded.get(k) != now[k] for k in same):
        return None
    return (
        f"{output_dir} already holds this run's trained model (step {train.get('global_step')}), saved when {by} "
        "stopped it after its last step: nothing is left to train, so the run ends here (no checkpoint was needed); "
        "its evaluation was skipped (to train and evaluate it again, pass --overwrite_output_dir true)"
    )


WEIGHT_FILES = {".safetensors", ".bin", ".pt", ".pth", ".pkl"}  # accelerate's random states: torch.save too


def cut_short(path: Path) -> str | None:
    """The first weights or state file of checkpoint `path` that is missing or not whole (a copy interrupted, an
    S3 restore of an interrupted upload, a disk that filled, a file edited), judged from the files its trainer
    always writes (`required_files`) and each file's own header or archive index, without loading it; None: all
    whole."""
    missing = [name for name in required_files(path) if not (Path(path) / name).is_file()]
    if missing:
        return f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    for file in sorted(p for p in Path(path).rglob("*") if p.suffix in WEIGHT_FILES and p.is_file()):
        try:
            problem = _safetensors_problem(file) if file.suffix == ".safetensors" else _archive_problem(file)
        except OSError as err:
            problem = f"cannot be read ({first_line(err)})"
        if problem:
            return f"{file.relative_to(path)} {problem}"
    return None


def required_files(path: Path) -> list[str]:
    """The files the trainer that wrote checkpoint `path` (its state file says which) saves there every time: its
    weights and optimizer and scheduler states, and each process's own files where its mark says it wrote them
    (cloudtrain.checkpointing.MARKS). Engines whose files vary (ZeRO, FSDP, tensor parallelism) are judged by their
    own loaders; a state file that cannot be read requires nothing here (reading it says why)."""
    try:
        meta = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(meta, dict):
        return []
    marks = Path(path) / MARKS
    writers = sorted(int(m.name) for m in marks.iterdir() if m.name.isdigit()) if marks.is_dir() else []
    trainer, mesh = meta.get("trainer"), meta.get("mesh") or {}
    if trainer == "BasicTrainer":
        return ["model.safetensors", "training_state.pt"]
    if trainer == "PipelineTrainer":
        return ["pipeline.json"] + [f"pipeline-rank{i}{ext}" for i in writers for ext in (".safetensors", ".pt")]
    if trainer == "AcceleratedTrainer":
        whole = meta.get("engine") == "none" and mesh.get("tp", 1) == 1  # accelerate's own files of the model
        return (["model.safetensors", "optimizer.bin"] if whole else []) + ["scheduler.pt"]
    return []


def _safetensors_problem(file: Path) -> str | None:
    if (found := safetensors_header(file)) is None:
        return "has no readable header"
    length, tensors = found
    size, end = file.stat().st_size, max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
    expected = 8 + length + end
    return None if size == expected else f"is {size} bytes where its header needs {expected} (cut short or damaged)"


def _archive_problem(file: Path) -> str | None:
    """torch.save writes a zip archive, whose index sits at its end: a cut-short file has none."""
    try:
        zipfile.ZipFile(file).close()
    except zipfile.BadZipFile:
        with file.open("rb") as f:
            if f.read(2) != b"PK":  # an older torch.save's pickle (no index to check) or another format
                return None
        return "is not a whole archive (cut short or damaged)"
    return None
