"""The final files reach <output_dir> whole or not at all.

Everything the end of a run writes (model, tokenizer, arguments, results, predictions, merged model) is
written to `<output_dir>/.cloudtrain-staging` first. Only when all of it is there and synced is the staging
folder sealed (a `SEALED` file naming what to put in place and what of the previous model to take away);
then the previous files are renamed aside and the new ones renamed in. A kill or a full disk before the seal
leaves the previous model untouched (the staging folder is removed by the next command that looks); a kill
after it is finished by `recover`, which every command that reads or writes an output folder calls first.
"""

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cloudtrain.errors import UserError, first_line
from cloudtrain.faults import kill_point

STAGING = ".cloudtrain-staging"
PREVIOUS = ".cloudtrain-previous"  # the previous files, renamed aside until the new ones are in place
SEALED = "SEALED"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
MARGIN = 16 * 2**20  # what a tokenizer, results and filesystem metadata may take beyond the weights
# safetensors (Rust) reports a full disk in its own exception type, with the OS error in the text; torch.save's
# zip writer as a failed stream ("unexpected pos", from an "iostream error") with no OS error at all
NO_SPACE_TEXT = (
    "No space left on device",
    "File too large",
    "Disk quota exceeded",
    "os error 28",
    "os error 27",
    "unexpected pos",
    "iostream error",
    "failed writing file",
)


def staging_dir(output_dir: Path) -> Path:
    return Path(output_dir) / STAGING


def start_staging(output_dir: Path) -> Path:
    """A fresh, empty staging folder (a previous unsealed one is a killed save's: removed)."""
    recover(output_dir)
    staging = staging_dir(output_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def check_free_space(folder: Path, needed_bytes: int, what: str) -> None:
    """Refuse, in one line, a save that cannot fit: the previous model stays until the new one is complete,
    so both must fit at once."""
    folder = Path(folder)
    probe = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    needed = needed_bytes + MARGIN
    if free < needed:
        raise UserError(
            f"{what} needs about {_size(needed)} free in {folder} and {_size(free)} is free; "
            "free some space or choose an --output_dir on a larger disk"
        )


@contextmanager
def no_space_is_a_user_error(output_dir: Path, what: str) -> Iterator[None]:
    """A full disk while staging: the staging folder goes, the previous model stays, one line says so."""
    try:
        yield
    except Exception as err:
        if not is_no_space(err):
            raise
        shutil.rmtree(staging_dir(output_dir), ignore_errors=True)
        raise UserError(
            f"the disk of {output_dir} filled up while {what} was written ({first_line(err)}); "
            "the previous model there was not replaced: free some space and run again (checkpoints, if any, are kept)"
        ) from None


def is_no_space(err: BaseException | None) -> bool:
    """A write that failed for want of space (or a file-size limit), as any library in the chain reports it."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in NO_SPACE:
            return True
        if any(text in str(err) for text in NO_SPACE_TEXT):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def check_writable(output_dir: Path, flag: str = "--output_dir") -> None:
    """A folder the run cannot write to is refused before it trains (root ignores permission bits, not a
    read-only filesystem: so try)."""
    folder = Path(output_dir)
    probe_in = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    try:
        probe = probe_in / f".cloudtrain-write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"{flag} {output_dir} cannot be written ({err.strerror}); choose a folder you can write to"
        ) from None


def seal(output_dir: Path, remove: list[str]) -> list[str]:
    """Mark the staged files complete; `remove`: previous files the new set does not replace (an earlier
    full model's weights when an adapter is saved). Returns the staged names."""
    staging = staging_dir(output_dir)
    names = sorted(p.name for p in staging.iterdir() if p.name != SEALED)
    mode = _new_file_mode(staging)
    for path in staging.rglob("*"):
        if path.is_file():
            if path.stat().st_mode & 0o777 != mode:  # safetensors writes its files 0600, unlike every other
                path.chmod(mode)  # file of the model: a model shared with a team or a server is readable as a whole
            fsync(path)
    tmp = staging / f"{SEALED}.tmp"
    tmp.write_text(json.dumps({"names": names, "remove": sorted(set(remove) - set(names))}) + "\n")
    fsync(tmp)
    os.replace(tmp, staging / SEALED)
    fsync(staging)
    kill_point("publish.sealed")
    return names


def _new_file_mode(folder: Path) -> int:
    """The permissions a file created in `folder` gets (the umask applied), read off a probe file."""
    probe = folder / f".cloudtrain-mode-probe-{os.getpid()}"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


def publish(output_dir: Path) -> None:
    """Put the sealed files in place (also what `recover` finishes)."""
    output_dir, staging = Path(output_dir), staging_dir(output_dir)
    plan = json.loads((staging / SEALED).read_text())
    previous = Path(output_dir) / PREVIOUS
    previous.mkdir(exist_ok=True)
    for name in plan["remove"] + plan["names"]:  # aside first, so no new file ever sits beside an old one
        if (output_dir / name).exists() and (staging / name).exists() or name in plan["remove"]:
            _move(output_dir / name, previous / name)
    kill_point("publish.moved_aside")
    for name in plan["names"]:
        if (staging / name).exists():
            os.replace(staging / name, output_dir / name)
            kill_point("publish.one_in_place")
    fsync(output_dir)
    shutil.rmtree(staging)
    shutil.rmtree(previous, ignore_errors=True)


def recover(output_dir: Path) -> None:
    """Finish a sealed publish that a kill interrupted, or drop an unsealed staging folder."""
    output_dir = Path(output_dir)
    staging = staging_dir(output_dir)
    if (staging / SEALED).is_file():
        publish(output_dir)
    elif staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(output_dir / PREVIOUS, ignore_errors=True)


def _move(source: Path, target: Path) -> None:
    if not source.exists() and not source.is_symlink():
        return
    if target.exists():
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.replace(source, target)


def write_whole(path: Path, data: str | bytes, sync: bool = False) -> None:
    """`data` into `path` whole or not at all: written beside it, then renamed over it (a kill leaves the old
    file or the new one); `sync`: on disk before the rename, for a power cut too."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_tree(folder: Path) -> None:
    """Every file and folder under `folder`, and itself, on disk (a checkpoint's files before it is sealed)."""
    for path in sorted(folder.rglob("*"), key=lambda p: -len(p.parts)):  # the deepest first, folders after files
        fsync(path)
    fsync(folder)


def fsync(path: Path) -> None:
    """A file's or a folder's data and entries on disk before anything counts on them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
