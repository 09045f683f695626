"""Where a run may write, and what in <output_dir> is cloudtrain's to replace.

- The output folder may not be, contain or lie inside the input model's folder, a data folder, or the
  checkpoint being resumed: a run there would write over its own inputs (`check_location`).
- `.cloudtrain-manifest.json` lists the names cloudtrain wrote in the folder. A file with a name a run
  writes that the manifest does not list is the user's: the run is refused before anything is written
  (`claim`), and never replaces it. `--overwrite_output_dir` replaces the model cloudtrain saved there,
  and only that. The model card is the file people edit by hand: the manifest keeps its digest, and a card
  changed since cloudtrain wrote it is the user's.
- A run holds `.cloudtrain-lock` in the folder while it lives (`hold`): a second run there is refused, naming
  the first. The kernel drops the lock when the process ends, however it ends: a file a kill leaves is not held.
"""

import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import itertools
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from cloudtrain.assets import r8_folder
from cloudtrain.config import Config
from cloudtrain.errors import UserError
from cloudtrain.publish import atomic
from cloudtrain.publish.atomic import write_whole
from cloudtrain.publish.saving import MERGED, MODEL_PATTERNS

MANIFEST = ".cloudtrain-manifest.json"
LOCK = ".cloudtrain-lock"
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",  # sentencepiece
    "chat_template.*",
    "*.tiktoken",
    "tekken.json",
)
RESULT_PATTERNS = ("args.json", "*_results.json", "*_predictions.jsonl", "README.md")
LOG_NAMES = ("metrics.jsonl", "tracker_runs.json", "training_curves.png", "checkpoints", "validation")  # + images
TRACKER_DIRS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlruns"}
# every top-level name a run may write (tests/test_output_dir.py checks a run writes nothing else)
RUN_PATTERNS = (*MODEL_PATTERNS, *TOKENIZER_PATTERNS, *RESULT_PATTERNS, *LOG_NAMES, *TRACKER_DIRS.values())
CHECKPOINT = "the checkpoint being resumed"
FINAL_PATTERNS = (*MODEL_PATTERNS, *TOKENIZER_PATTERNS, *RESULT_PATTERNS)  # replaced as a whole at the end
DIGESTED = ("README.md",)  # edited by hand after a run: an edited one is the user's, kept


def is_run_name(name: str, patterns: tuple[str, ...] = RUN_PATTERNS) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def written(output_dir: Path) -> set[str]:
    """The names cloudtrain wrote in `output_dir`, from its manifest (or, for a folder an earlier version
    wrote, from its args.json), less a card edited since."""
    return set(_manifest(Path(output_dir))["written"]) - edited(output_dir)


def edited(output_dir: Path) -> set[str]:
    """The names cloudtrain wrote whose file has changed since (the model card, DIGESTED): the user's now."""
    digests = _manifest(Path(output_dir))["digests"]
    return {name for name, digest in digests.items() if _digest(Path(output_dir) / name) not in (digest, None)}


def _manifest(output_dir: Path) -> dict:
    try:
        manifest = json.loads((output_dir / MANIFEST).read_text())
        return {"written": list(manifest["written"]), "digests": dict(manifest.get("digests", {}))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"written": sorted(_written_before_manifests(output_dir)), "digests": {}}


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:  # gone: nothing of the user's to keep
        return None


def _written_before_manifests(output_dir: Path) -> set[str]:
    """Versions before the manifest left args.json holding cloudtrain's own options: such a folder's run names
    are cloudtrain's. A user's own args.json would not name these options."""
    try:
        args = json.loads((output_dir / "args.json").read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(args, dict) or not {"training_type", "task", "output_dir"} <= set(args):
        return set()
    return {p.name for p in output_dir.iterdir() if is_run_name(p.name)}


def record(output_dir: Path, names: set[str] | list[str], source: Path | None = None) -> None:
    """Add `names`, just written into `output_dir` (or into `source`, to be moved there: a publish's staging folder),
    to the manifest, with the digest of each that is a card (written whole, then renamed: a kill leaves the old
    manifest or the new one). A card edited since it was recorded keeps its digest: it stays the user's."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(output_dir)
    ours = set(manifest["written"]) | set(names)
    digests = {name: digest for name, digest in manifest["digests"].items() if name in ours}
    for name in set(names) & set(DIGESTED):
        digests.pop(name, None)
        if (digest := _digest((source or output_dir) / name)) is not None:
            digests[name] = digest
    manifest = {"written": sorted(ours), **({"digests": dict(sorted(digests.items()))} if digests else {})}
    write_whole(output_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def record_run_files(output_dir: Path) -> None:
    """At the end of a run: every name a run writes that is there now is this run's (claim refused the user's),
    less a card recorded as it was written (its digest stays that one: an edit made during the run is the user's)."""
    kept = set(_manifest(Path(output_dir))["digests"])
    record(output_dir, [p.name for p in Path(output_dir).iterdir() if is_run_name(p.name) and p.name not in kept])


def users_files(output_dir: Path) -> list[str]:
    """Names in `output_dir` that a run would write but cloudtrain did not: the user's."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    ours = written(output_dir)
    mine = sorted(p.name for p in output_dir.iterdir() if is_run_name(p.name) and p.name not in ours)
    merged = output_dir / MERGED  # cloudtrain's, replaced whole: what else lies in it (a GGUF export) is the user's
    if MERGED in ours and merged.is_dir():
        merges = ours_in_merged(output_dir)
        mine += sorted(f"{MERGED}/{p.name}" for p in merged.iterdir() if not merges(p.name))
    return mine


def ours_in_merged(output_dir: Path) -> Callable[[str], bool]:
    """Whether a name in <output_dir>/merged is cloudtrain's: one its merge recorded writing (and the model's own
    code, which save_pretrained copies), or, for a merge from before that record, a name a run writes."""
    merged = Path(output_dir) / MERGED
    if MERGED not in written(output_dir) or not merged.is_dir():
        return lambda name: False
    if (merged / MANIFEST).is_file():
        return {*written(merged), *remote_code(merged), MANIFEST}.__contains__
    saved = (*FINAL_PATTERNS, *remote_code(merged))
    return lambda name: is_run_name(name, saved)


def remote_code(folder: Path) -> set[str]:
    """The .py files a remote-code model's config (or tokenizer's) names in its auto_map ("custom.CustomConfig",
    "org/repo--custom.Custom"): those save_pretrained copies beside the weights."""
    files = set()
    for name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((folder / name).read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for value in auto_map.values():
            for reference in value if isinstance(value, list) else [value]:
                if isinstance(reference, str) and "." in reference:
                    files.add(reference.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return files


def holds_saved_model(output_dir: Path) -> bool:
    """Whether cloudtrain saved a model in `output_dir` earlier."""
    ours = written(output_dir)
    return any(is_run_name(name, MODEL_PATTERNS) and (Path(output_dir) / name).exists() for name in ours)


def earlier_model_refusal(output_dir: Path) -> str:
    """Why a run may not write into `output_dir`, which holds a model an earlier run saved: one message for the
    check before the heavy imports (paths.check_earlier_model) and the pipeline's (check_output_dir)."""
    return (
        f"--output_dir {output_dir} already holds a model from an earlier run (kept); choose a new folder, e.g. "
        f"--output_dir {free_name(output_dir)}, or pass --overwrite_output_dir true to replace it"
    )


def replaced_at_end(output_dir: Path, staged: list[str]) -> list[str]:
    """The previous final files of cloudtrain's that the new set does not overwrite but makes stale."""
    return sorted(
        name
        for name in written(output_dir)
        if is_run_name(name, FINAL_PATTERNS) and name not in staged and (Path(output_dir) / name).exists()
    )


def claim(output_dir: Path, ignore: tuple[str, ...] = ()) -> None:
    """Refuse a folder holding the user's files under names a run writes (but `ignore`)."""
    mine = [name for name in users_files(output_dir) if name not in ignore]
    if mine:
        changed = sorted(edited(output_dir) & set(mine))
        since = f" ({', '.join(changed)} edited since)" if changed else ""
        raise UserError(
            f"--output_dir {output_dir} holds {', '.join(mine[:4])}{' ...' if len(mine) > 4 else ''}, which "
            f"cloudtrain did not write{since} and a run would replace; move them elsewhere, or choose a new "
            f"folder, e.g. --output_dir {free_name(output_dir)}"
        )


_held: dict[Path, tuple[int, bool]] = {}  # folder -> (the open lock file this process holds it by, created it)


def hold(output_dir: Path, flag: str = "--output_dir", elsewhere: bool = True) -> None:
    """Make `output_dir` this process's until it ends or calls `release`: an exclusive lock on its lock file,
    refused in one line while another run holds it (suggesting another folder where `elsewhere`: a new run's).
    Where the filesystem has no locks, nothing is held."""
    folder = Path(output_dir).resolve()
    if folder in _held:  # the Python API's runs, one after another in one process
        return
    if (above := _held_above(folder)) is not None:  # a --checkpoint_dir inside another run's output folder
        raise UserError(
            f"{flag} {output_dir} lies in {above}, which another run holds ({_holder(above / LOCK)}); wait for it to "
            f"end, or choose another folder"
        )
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _lock(folder / LOCK)
    except BlockingIOError:
        other = f", or choose another folder, e.g. {flag} {free_name(output_dir)}" if elsewhere else ""
        raise UserError(
            f"{flag} {output_dir} is in use by another run ({_holder(folder / LOCK)}); wait for it to end{other}"
        ) from None
    except NoLocks:  # a filesystem without locks (some network mounts): the other checks still apply
        if created:  # (_lock took its file away again)
            with contextlib.suppress(OSError):
                folder.rmdir()
        return
    except OSError:  # unwritable: check_output_dir says so in its own words
        return
    _say_holder(fd)
    _held[folder] = (fd, created)


def _held_above(folder: Path) -> Path | None:
    """The nearest folder above `folder` that another process holds (its lock file locked), if any."""
    for parent in folder.parents:
        if parent in _held or not (parent / LOCK).is_file():
            continue
        try:
            fd = os.open(parent / LOCK, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken (and let go) only where no run holds it
        except BlockingIOError:
            return parent
        except OSError:  # no locks there
            pass
        finally:
            os.close(fd)
    return None


def _say_holder(fd: int) -> None:
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())


def lock_file(path: Path, what: str) -> None:
    """The lock file at `path` held by this process until `unlock_file` (a preprocess's, beside its output folder);
    UserError naming its holder while another process holds it, `what` saying what that process is doing. Where
    the filesystem has no locks, or `path` cannot be written (said later, where it is written), nothing is held."""
    try:
        fd = _lock(Path(path))
    except BlockingIOError:
        raise UserError(f"{what} ({_holder(Path(path))}); wait for it to end") from None
    except OSError:  # NoLocks too
        return
    _say_holder(fd)
    _held[Path(path)] = (fd, False)


def unlock_file(path: Path) -> None:
    fd, _ = _held.pop(Path(path), (None, False))
    if fd is not None:
        with contextlib.suppress(OSError):
            Path(path).unlink()  # while still held: a process opening it now takes a new one (_lock)
        with contextlib.suppress(OSError):
            os.close(fd)


class NoLocks(OSError):
    """flock is not supported where the folder lies."""


def _lock(path: Path) -> int:
    """The open lock file at `path`, locked; BlockingIOError while another process holds it, NoLocks where the
    filesystem has no locks (the file removed again if this call made it)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            made = True
        except FileExistsError:
            made = False
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # its holder removed it between the two opens: take the next one
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # not one its holder removed as this one opened it
                os.ftruncate(fd, 0)
                return fd
        except FileNotFoundError:  # its holder removed it as this one opened it: take the next one
            pass
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                if made:
                    with contextlib.suppress(OSError):
                        path.unlink()
                raise NoLocks(err.errno, err.strerror) from None
            raise
        os.close(fd)


def _forget_in_child() -> None:
    """A forked child (a loader or tokenizing worker) drops its copy of the lock, so that a child outliving a
    killed run does not keep the folder held; the run's own copy keeps the lock."""
    for fd, _ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _holder(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip() or "its process is starting"
    except OSError:
        return "its process is ending"


def recover_unless_in_use(output_dir: Path) -> None:
    """atomic.recover for a command that reads `output_dir` (predict, generate, merge's adapter): while a run holds
    the folder, its staging folder is the final save it is writing, not one a kill left (the previous model is
    still in place to be read)."""
    folder = Path(output_dir).resolve()
    if folder in _held:  # this process's own run
        atomic.recover(folder)
        return
    try:
        hold(folder, elsewhere=False)
    except UserError:
        return
    try:
        atomic.recover(folder)
    finally:
        release(folder)


def release(output_dir: Path) -> None:
    """The end of `hold`: the lock file goes, and the folder too if `hold` made it and nothing else was written
    there (a refused run leaves no trace)."""
    folder = Path(output_dir).resolve()
    fd, created = _held.pop(folder, (None, False))
    if fd is not None:
        _tidy(folder, created)  # while still held: a run opening the file now takes a new one (_lock)
        with contextlib.suppress(OSError):
            os.close(fd)


def _tidy(folder: Path, created: bool) -> None:
    """The lock file (this process's: it holds it, or made it) goes, and the folder if `hold` made it and it is
    empty."""
    with contextlib.suppress(OSError):
        (folder / LOCK).unlink()
    if created:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty


def record_run_start(cfg: Config, output_dir: Path) -> None:
    """Before the first log line: the names this run writes as it goes (logs, tracker folders), so that a run
    resumed after a kill knows them for its own."""
    trackers = [TRACKER_DIRS[t] for t in cfg.tracking.report_to if t in TRACKER_DIRS]
    record(output_dir, [*LOG_NAMES, *trackers])


def free_name(output_dir: Path) -> Path:
    """`<output_dir>-2`, `-3`, ...: the first that does not exist."""
    return next(p for i in itertools.count(2) if not (p := Path(f"{output_dir}-{i}")).exists())


def check_location(cfg: Config, output_dir: Path, model_dirs: list[str], resume_from: str | None) -> None:
    """Refuse an output or checkpoint folder that overlaps what the run reads, with or without
    --overwrite_output_dir."""
    inputs = _inputs(cfg, model_dirs, resume_from)
    _apart("--output_dir", output_dir, inputs)
    if cfg.checkpoint.checkpoint_dir:
        _apart("--checkpoint_dir", Path(cfg.checkpoint.checkpoint_dir), inputs)


def _apart(flag: str, folder: Path, inputs: list[tuple[str, str]]) -> None:
    """`folder` (what `flag` names) neither is, lies in, nor holds anything the run reads."""
    out = folder.expanduser().resolve()
    for path, what in inputs:
        source = Path(path).expanduser().resolve()
        if source.is_file():  # a data file: only a folder holding it would mix outputs into the data
            clash = "holds" if source.is_relative_to(out) else None
        else:
            clash = "is" if out == source else "is inside" if out.is_relative_to(source) else None
            if what != CHECKPOINT:  # the run's own checkpoints lie inside its output folder
                clash = clash or ("holds" if source.is_relative_to(out) else None)
        if clash:
            raise UserError(
                f"{flag} {folder} {clash} {what} {path}; the run would write over what it reads: "
                f"choose a folder apart from it, e.g. {flag} {free_name(Path('outputs') / out.name)}"
            )


def _inputs(cfg: Config, model_dirs: list[str], resume_from: str | None) -> list[tuple[str, str]]:
    """(local path, what it is) of everything the run reads that lies on this machine."""
    d = cfg.data
    found = [(p, "the input model's folder") for p in model_dirs]
    found += [(p, "the data") for p in (d.train_file, d.validation_file, d.test_file, d.dataset_name) if p]
    images = cfg.images
    found += [(p, "the images") for p in (images.train_data_dir, images.instance_data_dir, images.class_data_dir) if p]
    if not (d.train_file or d.dataset_name or d.streaming):
        found.append((str(r8_folder()), "the built-in data"))
    if resume_from and resume_from != "latest":
        found.append((resume_from, CHECKPOINT))
    return [(p, what) for p, what in found if Path(p).expanduser().exists()]
