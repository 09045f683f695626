"""Weighted mixtures of streamed sources: which source gives the k-th document, and where each source stands.

The global document sequence is a function of the seed alone: document k comes from the source that a
counter-based draw (splitmix64 of seed and k: no generator state to store) picks among the active sources
by weight. A source is read file after file (sorted) and record after record; its position is
(pass, file, offset). When a source runs out (`--mixture_exhausted`): restart begins its next pass (past its
documents held out for validation, `held_out`: only the first pass reads them); drop takes it out and
renormalises the others' weights; stop ends the stream. The whole state is a small JSON-able dict
(`MixtureStream.state`), which is what a checkpoint stores and a resume seeks to.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloudtrain.data.readers import (
    FORMATS,
    BadFile,
    BadRecord,
    RecordReader,
    file_format,
    folder_data_files,
    is_glob,
    is_remote,
)
from cloudtrain.errors import UserError

MASK64 = (1 << 64) - 1


@dataclass
class SourceSpec:
    """One training source as the user named it."""

    name: str
    files: list[str]
    format: str
    weight: float = 1.0
    columns: dict[str, str] = field(default_factory=dict)  # the task's column name -> this source's
    packed: bool = False  # holds rows packed by cloudtrain preprocess: a draw takes a row, not a document


ENTRY_KEYS = ("path", "weight", "format", "columns")  # what a `datasets:` entry may say


def _entries(data: Any) -> list[dict]:
    """--datasets items (a config file's mappings, or paths) or --train_file's comma list."""
    if data.datasets and data.train_file:  # the file was left out without a word (found in audit)
        raise UserError(
            f"training sources come from datasets: or from --train_file, not both: add {data.train_file} to "
            "datasets: as an entry (its weight too), or drop datasets:"
        )
    entries = []
    for item in data.datasets:
        value = item if isinstance(item, dict) else {"path": item}
        if not isinstance(value, dict) or "path" not in value:
            raise UserError(f"--datasets: each item needs a path (got {item!r})")
        unknown = sorted(set(value) - set(ENTRY_KEYS))
        if unknown:  # a misspelt `wieght` was ignored: the source trained at the default weight
            raise UserError(
                f"--datasets: the entry of {value['path']} has {', '.join(map(repr, unknown))}, which is not one "
                f"of its keys ({', '.join(ENTRY_KEYS)})"
            )
        entries.append(value)
    if not entries and data.train_file:
        entries = [{"path": part.strip()} for part in data.train_file.split(",") if part.strip()]
    if not entries and getattr(data, "dataset_name", None):  # --dataset_name X --streaming true: the Hub dataset X
        from cloudtrain.data.remote import hub_dataset_source

        entries = [{"path": hub_dataset_source(data.dataset_name, getattr(data, "dataset_config", None))}]
    if not entries:
        raise UserError(
            "--streaming true needs training sources: --train_file (one or more), datasets: or a Hub --dataset_name"
        )
    weights = data.train_weights
    if weights and len(weights) != len(entries):
        raise UserError(f"--train_weights gives {len(weights)} weight(s) for {len(entries)} source(s); give one each")
    for entry, weight in zip(entries, weights, strict=False):
        entry["weight"] = weight
    return entries


def _weight(value: Any, name: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise UserError(f"the weight of source {name} is not a number: {value!r}") from None
    if not weight >= 0 or weight == float("inf"):
        raise UserError(f"the weight of source {name} is {value}; weights must be finite and not negative")
    return weight


def expand(path: str, fmt: str | None = None) -> list[str]:
    """The data files a source names: a file, a folder's data files (folder_data_files; `fmt`: the source's
    format, for names that say none), or a glob (sorted)."""
    if is_remote(path):
        from cloudtrain.data.remote import expand_remote

        return expand_remote(path, fmt)
    if is_glob(path):
        return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    p = Path(path)
    if p.is_dir():
        # not in hidden folders: `.<name>.preprocess-new` is a killed preprocess's half-written set
        return folder_data_files(
            sorted(
                str(f)
                for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            ),
            fmt,
        )
    return [path] if p.is_file() else []


def resolve_sources(data: Any) -> list[SourceSpec]:
    """The sources of a DataConfig, every file found and every weight checked; one line for each mistake."""
    specs = []
    for entry in _entries(data):
        name = str(entry["path"])
        _check_not_saved(name)
        files = expand(name, entry.get("format"))
        if not files:
            raise UserError(f"training source {name} matches no data file (check the path or glob)")
        formats = {entry.get("format") or file_format(f) for f in files}
        if None in formats or len(formats) > 1:
            raise _mixed_formats(name, files)
        columns = entry.get("columns") or {}
        if not isinstance(columns, dict):
            raise UserError(f"training source {name}: columns must map the task's column names to the source's")
        specs.append(SourceSpec(name, files, str(formats.pop()), _weight(entry.get("weight", 1.0), name), columns))
    if len({s.name for s in specs}) < len(specs):
        raise UserError("the same training source is named twice; name each once")
    _check_files_apart(specs)
    if sum(s.weight for s in specs) <= 0:
        raise UserError("the training sources' weights are all zero; give at least one a positive weight")
    return specs


def _check_not_saved(name: str) -> None:
    """A datasets.save_to_disk folder (a SageMaker channel of one under --streaming too): its arrow files are no
    format a stream reads, and its metadata JSON (dataset_dict.json, state.json, dataset_info.json) was read as
    training records (found in audit)."""
    from cloudtrain.data.files import is_saved_dataset

    if not is_remote(name) and not is_glob(name) and Path(name).is_dir() and is_saved_dataset(Path(name)):
        raise UserError(
            f"training source {name} is a saved dataset (datasets.save_to_disk), which is not streamed: drop "
            f"--streaming to train on it, or give its data files ({', '.join(FORMATS)})"
        )


def _mixed_formats(name: str, files: list[str]) -> UserError:
    """A source of several formats (or of files no name gives a format): the formats found, and a glob of the
    most common one's files built from the source's folder part (`d/*` suggested `d/*/*.parquet`, which matched
    nothing, and listed the unknown files' format as None)."""
    by_format: dict[str, list[str]] = {}
    for f in files:
        by_format.setdefault(file_format(f) or "", []).append(f)
    unknown = by_format.pop("", [])
    found = ", ".join(sorted(by_format))
    if unknown:
        what = f"{len(unknown)} file(s) of no known format, such as {unknown[0].rsplit('/', 1)[-1]}"
        found = f"{found} and {what}" if found else what
    suggestion = ""
    if by_format:
        fmt, named = max(sorted(by_format.items()), key=lambda item: len(item[1]))
        base = named[0].rsplit("/", 1)[-1]
        suffix = base[base.lower().rindex("." + fmt) :]  # its compression too: x.jsonl.gz is *.jsonl.gz
        suggestion = f"name the files of one kind (a glob such as {_glob_of(name, files)}*{suffix}), or "
    return UserError(
        f"training source {name}: one known format per source (found {found}); {suggestion}give a --datasets "
        "entry its format: in a config file"
    )


def _glob_of(name: str, files: list[str]) -> str:
    """The start of a glob for files like the source's: its folder part (with ** when the source reaches into
    sub-folders), ending in / or empty."""
    if is_glob(name):
        folder, _, last = name.rpartition("/")
        if "**" in last:  # `d/**` reaches every depth: keep that
            return f"{name}/"
        return f"{folder}/" if folder or name.startswith("/") else ""
    folder = name.rstrip("/")
    nested = any("/" in _relative(f, folder) for f in files)  # a folder is read to every depth
    return f"{folder}/**/" if nested else f"{folder}/"


def _check_files_apart(specs: list[SourceSpec]) -> None:
    """A file two sources read (the same file named two ways, `a.jsonl` and `./a.jsonl`, or a file and a glob over
    its folder; an object as s3:// and s3a://, or by a prefix and a glob) would train at twice its weight: one line
    naming it."""
    read_by: dict[str, str] = {}
    for spec in specs:
        for f in spec.files:
            real = _object_key(f) if is_remote(f) else os.path.realpath(f)
            if (other := read_by.setdefault(real, spec.name)) != spec.name:
                raise UserError(
                    f"training sources {other} and {spec.name} both read {f}, which would train at the weight of "
                    "both; name each file in one source"
                )


S3_PROTOCOLS = ("s3", "s3a", "s3n")  # one store: names of Hadoop's connectors that s3fs reads as s3


def _object_key(url: str) -> str:
    """An object's URL as one string per object: the protocol (s3a and s3n are s3), bucket and key, with no empty
    part of a path (`s3://b//k` and `s3://b/k/` name s3://b/k)."""
    protocol, _, rest = url.partition("://")
    protocol = "s3" if protocol.lower() in S3_PROTOCOLS else protocol.lower()
    return f"{protocol}://{'/'.join(part for part in rest.split('/') if part)}"


def relative_names(spec: SourceSpec) -> list[str]:
    """Each file of a source by its path under the source's root (the folder it names, a glob's folder part, a
    file's folder), a Hub file by its path in the dataset (its revision left out: the same files at another commit
    are the same layout). What a checkpoint records of a source's files, since its cursor names a file by its place:
    base names alone read the same for sub-folders' files (d1/data.jsonl, d2/data.jsonl; preprocess outputs'
    shard-00000.parquet in each), so a folder that lost one and gained another resumed into other files."""
    root = _root(spec.name, spec.files)
    return [_relative(f, root) for f in spec.files]


def _root(name: str, files: list[str]) -> str:
    if is_glob(name):
        head = name[: min(name.index(ch) for ch in "*?[" if ch in name)]
        return head.rsplit("/", 1)[0] if "/" in head else ""
    if files == [name]:  # a file: its folder
        return name.rsplit("/", 1)[0] if "/" in name else ""
    return name  # a folder


def _relative(path: str, root: str) -> str:
    if path.startswith("hf://") and "@" in path:  # hf://datasets/<repo>@<commit>/<file>
        return path.split("@", 1)[1].partition("/")[2]
    if not is_remote(path):
        return os.path.relpath(path, root or ".").replace(os.sep, "/")
    root = root.rstrip("/") + "/"
    return path[len(root) :] if path.startswith(root) else path.rsplit("/", 1)[-1]


def first_record(spec: SourceSpec, problems: list[str] | None = None) -> tuple[str, dict] | None:
    """(file, record) of the source's first readable record, as read (its own column names); None if it has none.
    `problems` gets why each file's first record could not be read ("<file>: not UTF-8")."""
    for path in spec.files:
        try:
            reader = RecordReader(path, spec.format)
        except (BadFile, BadRecord) as err:
            _said(problems, path, err)
            continue
        try:
            while True:
                try:
                    record, _ = reader.next()
                    return path, record or {}
                except BadRecord as err:  # the stream steps over it as --on_bad_data says; so does this look
                    _said(problems, path, err)
        except StopIteration:
            continue
        except BadFile as err:
            _said(problems, path, err)
        finally:
            reader.close()
    return None


def _said(problems: list[str] | None, path: str, err: Exception) -> None:
    if problems is not None:
        problems.append(f"{path}: {err}")


def uniform(seed: int, k: int) -> float:
    """A number in [0, 1) from (seed, k) alone: splitmix64, so any document's draw needs no earlier one."""
    z = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def initial_state(specs: list[SourceSpec]) -> dict:
    return {
        "doc": 0,
        "ended": False,
        "sources": [{"pass": 0, "file": 0, "offset": 0, "record": 0, "active": s.weight > 0} for s in specs],
    }


def skip_or_stop(what: str, why: str, on_bad: str, said: list[str] | None = None) -> None:
    """Bad data met mid-stream, as --on_bad_data says: one line that stops the run, or a warning (skipped): printed,
    or added to `said` for the caller to print (a training stream's, once per run, by the main process alone)."""
    if on_bad == "stop":
        raise UserError(f"{what}: {why} (--on_bad_data skip goes on)")
    line = f"warning: skipped {what}: {why}"
    if said is None:
        print(line, file=sys.stderr, flush=True)
    else:
        said.append(line)


class MixtureStream:
    """The global document sequence from a state: `next(parse)` gives (source index, key, record or None).

    `key` = (source, pass, record index within the pass) names a document uniquely. Bad records come back as
    empty records (counted in `bad`); a bad file ends that file (counted too), or with on_bad "stop" raises
    UserError naming it.
    """

    def __init__(self, specs: list[SourceSpec], state: dict, seed: int, exhausted: str, on_bad: str = "skip"):
        self.specs, self.seed, self.exhausted, self.on_bad = specs, seed, exhausted, on_bad
        self.state = {**state, "sources": [dict(s) for s in state["sources"]]}
        self.readers: list[RecordReader | None] = [None] * len(specs)
        self.bad = {"records": 0, "files": 0}
        self.size = 0  # the last document's bytes in its file, the same whether parsed or stepped over
        # the skip warnings, when the caller prints them (else printed as met): every process of a launch reads the
        # whole stream, each pass again, so printed as met the same line came processes x passes times
        self.warnings: list[str] | None = None
        self.ran_out: int | None = None  # the source whose end ended the stream (--mixture_exhausted stop)

    def close(self) -> None:
        for reader in self.readers:
            if reader is not None:
                reader.close()

    def _choose(self, k: int) -> int:
        active = [i for i, s in enumerate(self.state["sources"]) if s["active"]]
        total = sum(self.specs[i].weight for i in active)
        u, cumulative = uniform(self.seed, k) * total, 0.0
        for i in active:
            cumulative += self.specs[i].weight
            if u < cumulative:
                return i
        return active[-1]

    def next(self, parse: bool = True) -> tuple[int, tuple[int, int, int], dict | None]:
        """The next document; StopIteration once the stream has ended."""
        while not self.state["ended"]:
            if not any(s["active"] for s in self.state["sources"]):
                self.state["ended"] = True
                break
            i = self._choose(self.state["doc"])
            got = self._read(i, parse)
            if got is None:  # source i ran out: restart, drop or stop, then draw again for the same document
                self._exhausted(i)
                continue
            position = self.state["sources"][i]
            key = (i, position["pass"], position["record"])
            position["record"] += 1
            if position["pass"] > 0 and key[2] < position.get("held_out", 0):
                continue  # validation's: read on the first pass only, never trained on (the draw is the same again)
            self.state["doc"] += 1
            return i, key, got[0]
        raise StopIteration

    def _exhausted(self, i: int) -> None:
        position = self.state["sources"][i]
        if self.exhausted == "stop":
            self.state["ended"] = True
            self.ran_out = i
        elif self.exhausted == "drop" or position["record"] <= position.get("held_out", 0):  # else: loops forever
            position["active"] = False
        else:
            position.update({"pass": position["pass"] + 1, "file": 0, "offset": 0, "record": 0})

    def holds_more(self, i: int) -> bool:
        """Whether source i has a record after its position (reads it unparsed: the position moves past it)."""
        return self._read(i, parse=False) is not None

    def _read(self, i: int, parse: bool) -> tuple[dict | None] | None:
        """(record,) from source i, moving to its next file at each end; None when the source has no more."""
        spec, position = self.specs[i], self.state["sources"][i]
        while position["file"] < len(spec.files):
            try:
                reader = self._reader(i)
                record, position["offset"] = reader.next(parse)
                self.size = reader.size
                return (self._columns(record, spec) if record is not None else None,)
            except StopIteration:
                self._next_file(i)
            except BadRecord as err:
                position["offset"] = self.readers[i].position  # type: ignore[union-attr]
                self.size = self.readers[i].size  # type: ignore[union-attr]
                where = f"corrupted data in {spec.files[position['file']]} at position {position['offset']}"
                self._bad(where, str(err), "records", parse)
                return ({},)  # an empty document: nothing trains on it, the count stays in step
            except BadFile as err:
                self._bad(f"corrupted data in {spec.files[position['file']]} at position {position['offset']}",
                          str(err), "files", parse)  # fmt: skip
                self._next_file(i)
        return None

    def _reader(self, i: int) -> RecordReader:
        spec, position = self.specs[i], self.state["sources"][i]
        reader = self.readers[i]
        path = spec.files[position["file"]]
        if reader is None or reader.path != path or reader.position != position["offset"]:
            if reader is not None:
                reader.close()
            self.readers[i] = None
            reader = self.readers[i] = RecordReader(path, spec.format, position["offset"])
        return reader

    def _next_file(self, i: int) -> None:
        position = self.state["sources"][i]
        position.update({"file": position["file"] + 1, "offset": 0})
        if self.readers[i] is not None:
            self.readers[i].close()  # type: ignore[union-attr]
            self.readers[i] = None

    def refused(self, i: int, key: tuple[int, int, int], why: str) -> None:
        """A record of source i that the task's encoder refused (cloudtrain.data.streaming.Refused): a bad record."""
        self._bad(f"record {key[2]} of {self.specs[i].name}", why, "records", True)

    def _bad(self, what: str, why: str, kind: str, reported: bool) -> None:
        """Counted and said by the one worker that parses this document (the others only step over it)."""
        if reported:
            skip_or_stop(what, why, self.on_bad, self.warnings)
            self.bad[kind] += 1

    @staticmethod
    def _columns(record: dict, spec: SourceSpec) -> dict:
        """The record under the task's column names (a source's own names mapped by its columns:)."""
        if not spec.columns:
            return record
        renamed = dict(record)
        for task_name, source_name in spec.columns.items():
            if source_name in record:
                renamed[task_name] = record[source_name]
        return renamed
