"""The data files the options name (--train_file, --validation_file, --test_file), checked with light I/O:
they exist, have a format the data sources read, and are not empty. Imports no `datasets`, so the CLI runs
these checks before the heavy imports; the data sources run them again before loading."""

from pathlib import Path
from typing import Any

from cloudtrain.config import DataConfig
from cloudtrain.errors import UserError

# pandas reads NA, N/A, null, None, nan, ... as missing: a class named NA, or the text "null", would be lost
CSV_MISSING = {"keep_default_na": False, "na_values": [""]}  # only an empty cell is missing
FILE_FORMATS: dict[str, tuple[str, dict[str, Any]]] = {  # extension -> (datasets builder, builder options)
    ".csv": ("csv", CSV_MISSING),
    ".tsv": ("csv", {"sep": "\t", **CSV_MISSING}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
    ".txt": ("text", {"encoding": "utf-8-sig"}),  # a BOM (Notepad's) was read as the first line's text (audit)
}


def split_files(cfg: DataConfig) -> dict[str, str]:
    """{split: path} of the files given; a streamed --train_file is a source list, not one of them."""
    files = {"train": cfg.train_file, "validation": cfg.validation_file, "test": cfg.test_file}
    return {split: path for split, path in files.items() if path and not (cfg.streaming and split == "train")}


def data_files(folder: Path) -> list[Path]:
    """The data files directly in `folder`; none for a save_to_disk directory (its JSON files are metadata)."""
    if is_saved_dataset(folder):
        return []
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in FILE_FORMATS)


def check_data_files(cfg: DataConfig) -> None:
    """Each file given exists, has a format we read and is not empty; held-out files come with training data."""
    files = split_files(cfg)
    if files and not (cfg.train_file or cfg.streaming):  # a stream's held-out files are its own (its sources
        raise UserError("--validation_file/--test_file need a --train_file too")  # may be --dataset_name)
    for split, path in files.items():
        p = Path(path)
        if "://" in path:  # an existing s3:// object "did not exist" (found in audit)
            raise UserError(f"--{split}_file {path}: {remote_hint(cfg, split)}")
        if not p.exists():
            raise UserError(f"--{split}_file {path} does not exist{several_files_hint(split, path)}")
        if p.is_file() and p.suffix.lower() not in FILE_FORMATS:
            raise UserError(
                f"--{split}_file {path}: unsupported format {p.suffix!r}; "
                f"use one of {', '.join(FILE_FORMATS)} or a save_to_disk directory"
            )
        if p.is_dir():
            _check_folder(f"--{split}_file", p)
        for file in [p] if p.is_file() else data_files(p):
            if file.stat().st_size == 0:  # each reader fails its own way on nothing (json: a bare StopIteration)
                raise UserError(f"--{split}_file {file} is empty; give a file with {rows_wanted(file)}")
    _check_held_out_apart(files)


def remote_hint(cfg: DataConfig, split: str) -> str:
    """What to do with a URL given as a split's file, which is read from local disk alone (a stream's sources are
    its training data)."""
    if cfg.streaming and split == "validation":
        return (
            "a stream's --validation_file is a local file or folder; copy it here, or leave it out to hold out "
            f"the first --stream_validation_docs ({cfg.stream_validation_docs}) documents of the stream"
        )
    stream = " (or stream it: --streaming true)" if split == "train" else ""
    return f"it takes a local file or folder; copy it here{stream}"


_WHAT_ROWS = {  # (else csv/tsv)
    ".txt": "a text per line",
    ".jsonl": "a JSON record per line",
    ".json": "records",
    ".parquet": "rows",
}


def rows_wanted(file: Path) -> str:
    """What a data file of this format holds, for a line about one that holds nothing."""
    return _WHAT_ROWS.get(file.suffix.lower(), "a header and rows")


def several_files_hint(split: str, path: str) -> str:
    """A comma list or a glob names one path here (the stream alone reads lists): it "did not exist" unexplained."""
    if "," not in path and not any(c in path for c in "*?["):
        return ""
    stream = " (or stream them: --streaming true)" if split == "train" else ""
    return f"; several files, or a glob, are read as one split from a folder holding them: give the folder{stream}"


def _check_held_out_apart(files: dict[str, str]) -> None:
    """A held-out file that is the training file, or inside the training folder, would be trained on as well as
    evaluated on (the same file was accepted silently; audit)."""
    if "train" not in files:
        return
    if not Path(files["train"]).is_dir():
        return
    read = {f.resolve() for f in data_files(Path(files["train"]))}
    for split in ("validation", "test"):
        if split in files and Path(files[split]).resolve() in read:
            raise UserError(
                f"--{split}_file {files[split]} is also in the --train_file folder {files['train']}, so it would be "
                "trained on: move it out of that folder"
            )


def training_file_notes(cfg: DataConfig) -> list[str]:
    """A --validation_file or --test_file that is the --train_file itself: its metrics are of rows the run trains on
    (meant for a check that a model can fit its data; else a mistake, found in audit). A note: tests and overfit
    checks do it on purpose."""
    files = split_files(cfg)
    if "train" not in files or "://" in files["train"]:
        return []
    train = Path(files["train"]).resolve()
    return [
        f"--{split}_file {files[split]} is the --train_file: its metrics are of rows the run trains on"
        for split in ("validation", "test")
        if split in files and "://" not in files[split] and Path(files[split]).resolve() == train
    ]


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by datasets.save_to_disk (a DatasetDict, or one Dataset)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _check_folder(flag: str, folder: Path) -> None:
    """A folder given as data holds data files or a save_to_disk dataset: an empty one (a SageMaker channel whose
    S3 prefix matched nothing) said it was "not one written by datasets.save_to_disk" (found in audit)."""
    if is_saved_dataset(folder) or data_files(folder):
        return
    others = sorted(f.name for f in folder.iterdir() if not f.name.startswith("."))
    held = f"holds only {', '.join(others[:4])}{' ...' if len(others) > 4 else ''}" if others else "is empty"
    raise UserError(
        f"{flag} {folder} {held}: no data files ({', '.join(FILE_FORMATS)}) directly in it, nor a "
        "datasets.save_to_disk folder; check the path (for a SageMaker channel, its S3 prefix)"
    )
