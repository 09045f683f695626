"""`cloudtrain preprocess`: tokenize (and optionally pack) a corpus once into sharded Parquet files, on local
disk or object storage, that streaming training reads as is.

Without packing, each output row is one record of the source, in the source's order (empty ones included, so
that a stream of the shards draws its buffers at the same documents as a stream of the raw corpus): the
record's task columns (the text; SFT's messages or prompt/completion), kept for the held-out validation
documents and sample prompts, and `input_ids`, the tokens as the task encodes them (causal LM: the document
with EOS; SFT: a list of examples, each with its answer mask in `loss_mask`, cut at --max_length). A streaming
run given the shards packs those stored tokens instead of tokenizing again (cloudtrain.data.streaming), so it
trains on exactly the rows the raw corpus would give, at the cost of a read.

With `--packing bfd|wrapped` the rows are the training rows themselves, of at most --max_length tokens: packed
within buffers of --pack_documents documents as a stream packs (cloudtrain.data.packing.pack_buffer),
documents kept apart by `seq_lengths`, SFT's answer masks in `loss_mask`; a stream passes them through. They
hold no text, so such a run takes its validation from --validation_file.

`manifest.json` holds the counts per shard and a length histogram, drawn in `length_histogram.png`. An
`s3://bucket/prefix` output is written through fsspec (s3fs) with the same settings and one-line failures as
an object-store source (cloudtrain.data.remote).

The output folder is the user's corpus: a glob over it (`shards/*.parquet`) must read one set of shards.
So a folder holding an earlier preprocess's output is refused unless --overwrite_output_dir true, and one
holding anything else is refused unless empty (nothing we did not write is deleted or mixed into). A local
set is written whole into `.<name>.preprocess-new` beside the folder, then swapped in at once (Linux's
renameat2 exchange; elsewhere two renames, a kill between which the next preprocess finishes), so a glob
reads the old set or the new one, never a mix or a half. An object store cannot swap a set at once:
replacing there is refused (choose a new prefix).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from cloudtrain.commands import add_switch
from cloudtrain.data.shards import MANIFEST, is_shard_name
from cloudtrain.errors import UserError
from cloudtrain.faults import kill_point
from cloudtrain.publish.atomic import fsync
from cloudtrain.publish.output_dir import free_name, lock_file, unlock_file
from cloudtrain.registry_table import EXAMPLES, STREAMING

if TYPE_CHECKING:  # tasks import torch and transformers: not while the options are parsed and checked
    from cloudtrain.config.data import DataConfig
    from cloudtrain.tasks.base import Task

TOKENS = "input_ids"  # the column a streaming run takes as stored tokens
MASK = "loss_mask"  # SFT: per example (unpacked) or per row (packed), the tokens the loss is taken on
LENGTHS = "seq_lengths"  # packed rows: the lengths of the documents (pieces) in the row; marks a row as packed
DOCUMENTS = "documents"  # packed rows: how many documents start in the row (the per-source counts)
HISTOGRAM = "length_histogram.png"
# `.<name><suffix>` beside a local output folder: the set being written, the previous set, the writer's lock
STAGED, ASIDE, LOCKED = ".preprocess-new", ".preprocess-old", ".preprocess-lock"
CHAT_OPTIONS = ("messages_column", "prompt_column", "completion_column", "system_prompt", "chat_template")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--train_file", required=True, help="The corpus: a file, folder, glob or s3:// URL (one source)."
    )
    parser.add_argument(
        "--tokenizer_name_or_path", required=True, help="The tokenizer training will use (a local folder)."
    )
    parser.add_argument(
        "--output_dir", required=True, help="Where the shards and manifest.json go (a folder or s3://)."
    )
    parser.add_argument("--task", choices=tuple(STREAMING), default="causal_lm", help="How records are encoded.")
    parser.add_argument("--text_column", default="text", help="causal_lm: the column holding each document's text.")
    parser.add_argument("--shard_documents", type=int, default=100_000, help="Records per shard (100000).")
    parser.add_argument("--format", help="The source's format when its names do not say (jsonl, parquet, ...).")
    parser.add_argument(
        "--packing",
        choices=("none", "bfd", "wrapped"),
        default="none",
        help="none: one row per record, packed at training time; bfd or wrapped: packed now into rows of "
        "--max_length tokens, as a stream packs (SFT: none or bfd).",
    )
    parser.add_argument("--max_length", type=int, help="The row length (with --packing) and SFT's cut: training's.")
    parser.add_argument("--pack_documents", type=int, default=1000, help="Documents packed together (1000).")
    for name in CHAT_OPTIONS:
        parser.add_argument(f"--{name}", help=f"SFT: as training's --{name}.")
    add_switch(parser, "--train_on_prompt", "SFT: as training's --train_on_prompt (default: false).")
    add_switch(
        parser,
        "--overwrite_output_dir",
        "Replace the shards an earlier preprocess wrote in --output_dir (false: such a folder is refused).",
    )


def _source(args: argparse.Namespace) -> Any:
    """The one source of the corpus, resolved as training resolves a --train_file."""
    from cloudtrain.data.mixture import resolve_sources

    if "," in args.train_file:
        raise UserError("preprocess takes one source (a file, folder or glob); preprocess each and mix the outputs")
    entry = {"path": args.train_file, **({"format": args.format} if args.format else {})}
    specs = resolve_sources(SimpleNamespace(datasets=[entry], train_file="", train_weights=[]))
    spec = specs[0]
    if spec.format == "txt":  # a line arrives as "text": it is the text column
        spec.columns.setdefault(args.text_column, "text")
    return spec


def _check(args: argparse.Namespace) -> None:
    """Option mistakes, before the tokenizer or the corpus is touched."""
    if args.shard_documents < 1 or args.pack_documents < 1:
        raise UserError("--shard_documents and --pack_documents must be at least 1")
    examples = _examples(args)  # cut at --max_length and packed whole
    if (args.packing != "none" or examples) and not args.max_length:
        raise UserError(
            f"--{'packing ' + args.packing if args.packing != 'none' else 'task ' + args.task} needs --max_length "
            "(the row length, or the cut of an SFT example): give the --max_length training will use"
        )
    if examples and args.packing == "wrapped":
        raise UserError(f"--task {args.task} packs whole examples: --packing none or bfd")
    if args.max_length is not None and args.max_length < 2:
        raise UserError("--max_length must be at least 2")
    from cloudtrain.config import ModelConfig
    from cloudtrain.paths import resolve_model_path

    resolve_model_path(ModelConfig(), args.tokenizer_name_or_path)  # a local folder that is not there: one line


def _examples(args: argparse.Namespace) -> bool:
    """Whether the task's records encode to several examples with answer masks (else to one document each)."""
    return STREAMING[args.task] == EXAMPLES


def _documents(spec: Any, chunk: int) -> Any:
    """The source's records, one pass, in chunks of `chunk`; corrupted records come back empty (as in training)."""
    from cloudtrain.data.mixture import MixtureStream, initial_state

    stream = MixtureStream([spec], initial_state([spec]), 0, "stop")
    try:
        while True:
            records = []
            for _ in range(chunk):
                try:
                    records.append(stream.next()[2] or {})
                except StopIteration:
                    break
            if not records:
                return
            yield records
    finally:
        stream.close()


def _data_config(args: argparse.Namespace, task: type[Task]) -> DataConfig:
    """The options the task's stream encoder reads, as training's data config holds them."""
    from cloudtrain.config.data import DataConfig

    return DataConfig(**{name: getattr(args, name) for name in task.stream_options})


def _column(values: list):
    """One kept column as arrow takes it; values of mixed types (a text that is a number in one JSON record) as the
    strings training reads them as (str()), not a pyarrow traceback."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        return pa.array([None if v is None else v if isinstance(v, str) else str(v) for v in values], pa.string())


def _table(records: list[dict], encoded: list[list[tuple]], keep: list[str], args: argparse.Namespace) -> Any:
    """One shard's table: a row per record (its columns and tokens), or the packed rows of its records."""
    import pyarrow as pa

    if args.packing != "none":
        from cloudtrain.data.packing import pack_buffer

        items = [(0, (0, 0, r), ids, mask) for r, examples in enumerate(encoded) for ids, mask in examples]
        rows = pack_buffer(items, args.max_length, args.packing)
        table = {
            TOKENS: pa.array([r[TOKENS] for r in rows], pa.list_(pa.int32())),
            LENGTHS: pa.array([r[LENGTHS] for r in rows], pa.list_(pa.int32())),
            DOCUMENTS: pa.array([len(r["starts"]) for r in rows], pa.int32()),
        }
        if any(mask is not None for _, _, _, mask in items):
            table[MASK] = pa.array([r.get(MASK) for r in rows], pa.list_(pa.int8()))
        return pa.table(table)
    columns = {name: _column([r.get(name) for r in records]) for name in keep}
    columns = {name: a.cast(pa.string()) if pa.types.is_null(a.type) else a for name, a in columns.items()}
    if _examples(args):  # per record, its examples and their answer masks
        columns[TOKENS] = pa.array([[ids for ids, _ in e] for e in encoded], pa.list_(pa.list_(pa.int32())))
        columns[MASK] = pa.array([[m for _, m in e] for e in encoded], pa.list_(pa.list_(pa.int8())))
    else:  # causal LM: the document's tokens, [] for an empty one
        columns[TOKENS] = pa.array([e[0][0] if e else [] for e in encoded], pa.list_(pa.int32()))
    return pa.table(columns)


class Output:
    """The output folder, local or object storage, written through fsspec; an object store's failures are one
    line each (cloudtrain.data.remote), local ones are the OSError as is. A folder already holding files is
    refused here, before the corpus or the tokenizer is read; a local set is staged beside it and swapped in by
    `publish`."""

    def __init__(self, url: str, overwrite: bool = False):
        import fsspec

        from cloudtrain.data.readers import storage_options

        self.url = url.rstrip("/") or url
        self.target: Path | None = None
        if "://" not in self.url:  # local: staged beside the folder, swapped in at the end
            self.target = Path(self.url).expanduser().resolve()  # a link's folder; `.`: its name, for `_beside`
            with contextlib.suppress(OSError):  # (one that cannot be made is said below)
                self.target.parent.mkdir(parents=True, exist_ok=True)
            # one writer at a time: another's recover would delete this one's staged shards
            lock_file(_beside(self.target, LOCKED), f"--output_dir {url} is being written by another preprocess")
            try:
                self._stage(url, overwrite)
            except BaseException:
                unlock_file(_beside(self.target, LOCKED))
                raise
            self.fs, self.root = fsspec.filesystem("file"), str(self.staged)
            return
        if self.url.startswith(("s3://", "s3a://")):
            from cloudtrain.data.remote import check_credentials

            check_credentials(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options(self.url))
        except ImportError:
            raise UserError(
                f"{url}: writing {url.split('://', 1)[0]}:// needs s3fs: pip install 'cloudtrain[s3]'"
            ) from None
        with self._said():
            names = self._names(self.root)
            _claim(self.url, names, lambda: self.fs.cat_file(f"{self.root}/{MANIFEST}").decode(), overwrite, True)
            self.fs.makedirs(self.root, exist_ok=True)

    def _stage(self, url: str, overwrite: bool) -> None:
        """A killed run's leftovers dealt with, the folder claimed, the staging folder beside it made."""
        assert self.target is not None
        recover(self.target)
        _claim(str(self.url), _local_names(self.target), (self.target / MANIFEST).read_text, overwrite, False)
        self.staged = _beside(self.target, STAGED)
        try:  # the set is staged beside the folder: its parent must take new entries
            self.staged.mkdir(parents=True)
        except OSError as err:
            raise UserError(
                f"--output_dir {url} cannot be written ({err.strerror} in {self.staged.parent}); choose a "
                "folder you can write to"
            ) from None

    def _names(self, root: str) -> list[str]:
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False, refresh=True))
        except FileNotFoundError:
            return []

    def write(self, name: str, data: bytes) -> None:
        with self._said(), self.fs.open(f"{self.root}/{name}", "wb") as f:
            f.write(data)

    def publish(self) -> None:
        """A local set: synced, then put in the folder's place at once (the previous set, if any, goes)."""
        if self.target is None:
            return
        target, staged, aside = self.target, self.staged, _beside(self.target, ASIDE)
        for path in (*staged.iterdir(), staged):
            fsync(path)
        kill_point("preprocess.staged")
        if _local_names(target):  # an earlier set (_claim allowed it): swapped out, then removed
            if not _exchange(staged, target):
                os.replace(target, aside)
                kill_point("preprocess.moved_aside")
                os.replace(staged, target)
        else:  # no folder, or an empty one
            os.replace(staged, target)
        fsync(target.parent)
        shutil.rmtree(staged, ignore_errors=True)  # after an exchange: the previous set
        shutil.rmtree(aside, ignore_errors=True)
        unlock_file(_beside(target, LOCKED))

    def discard(self) -> None:
        """A failed run's staged shards (a local one's; nothing in the folder was touched)."""
        if self.target is not None:
            shutil.rmtree(self.staged, ignore_errors=True)
            unlock_file(_beside(self.target, LOCKED))

    @contextlib.contextmanager
    def _said(self) -> Iterator[None]:
        from cloudtrain.data.remote import remote_failure

        try:
            yield
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 (botocore and s3fs raise many kinds; each becomes one line)
            if "://" not in self.url:
                raise
            raise remote_failure(self.url, err) from None


def _beside(target: Path, suffix: str) -> Path:
    return target.parent / f".{target.name}{suffix}"


def _local_names(target: Path) -> list[str]:
    if not target.exists():
        return []
    if not target.is_dir():
        raise UserError(f"--output_dir {target} is a file; give a folder for the shards")
    return sorted(p.name for p in target.iterdir())


def recover(target: Path) -> None:
    """Finish a swap that a kill interrupted between its two renames (the old set aside, the new one complete and
    not yet in place), or drop what a killed run staged: the folder then holds the old set, untouched."""
    staged, aside = _beside(target, STAGED), _beside(target, ASIDE)
    if aside.is_dir() and not target.exists():
        os.replace(staged if (staged / MANIFEST).is_file() else aside, target)
    shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)


def _claim(where: str, names: list[str], manifest: Callable[[], str], overwrite: bool, remote: bool) -> None:
    """Refuse a folder that holds anything unless it is an earlier preprocess's output, --overwrite_output_dir
    true is given, and the folder holds nothing the manifest does not list (replacing the folder would lose it)."""
    if not names:
        return
    free = _free_name(where, remote)
    ours = _listed(manifest) if MANIFEST in names else None
    if ours is None and all(is_shard_name(name) or name == HISTOGRAM for name in names):  # a set killed midway
        raise UserError(
            f"--output_dir {where} holds {_some(names)} and no {MANIFEST}: the shards of a preprocess that did not "
            f"finish (its manifest is written last); delete them, or choose a new prefix, e.g. --output_dir {free}"
        )
    if ours is None:
        raise UserError(
            f"--output_dir {where} holds {_some(names)}, which preprocess did not write; choose a new or empty "
            f"folder, e.g. --output_dir {free}"
        )
    if remote:
        raise UserError(
            f"--output_dir {where} already holds shards from an earlier preprocess (kept), and an object store "
            f"cannot replace a set of shards at once; choose a new prefix, e.g. --output_dir {free}"
        )
    if not overwrite:
        raise UserError(
            f"--output_dir {where} already holds shards from an earlier preprocess (kept); choose a new folder, "
            f"e.g. --output_dir {free}, or pass --overwrite_output_dir true to replace them"
        )
    foreign = [name for name in names if name not in ours]
    if foreign:
        raise UserError(
            f"--output_dir {where} holds {_some(foreign)} beside an earlier preprocess's shards, which preprocess "
            f"did not write and replacing the shards would remove; move it out or choose a new folder, e.g. "
            f"--output_dir {free}"
        )


def _listed(manifest: Callable[[], str]) -> set[str] | None:
    """The names an earlier preprocess wrote, from its manifest (None: not a manifest of ours)."""
    try:
        shards = json.loads(manifest())["shards"]
        return {str(s["file"]) for s in shards} | {MANIFEST, HISTOGRAM}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _free_name(where: str, remote: bool) -> str:
    """`<output_dir>-2`, or the first free `-N` on this disk (an object store's listing is not asked)."""
    return f"{where}-2" if remote else str(free_name(Path(where).expanduser()))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 with RENAME_EXCHANGE); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _shard(
    records: list[dict], encode: Any, keep: list[str], args: argparse.Namespace, first: int
) -> tuple[Any, list[int], int]:
    """A shard's table, encoded (and packed) by buffers of --pack_documents records, each record's tokens, and
    how many records the task refused (each said, by its number in the source: the shard's starts at `first`)."""
    import pyarrow as pa

    from cloudtrain.data.streaming import Refused

    tables, lengths, refused = [], [], 0
    for start in range(0, len(records), args.pack_documents):
        part = records[start : start + args.pack_documents]
        encoded = encode(part)
        for i, examples in enumerate(encoded):
            if isinstance(examples, Refused):
                refused += 1
                print(f"warning: left out record {first + start + i} of {args.train_file}: {examples.why}",
                      file=sys.stderr, flush=True)  # fmt: skip
        tables.append(_table(part, encoded, keep, args))
        lengths += [sum(len(ids) for ids, _ in examples) for examples in encoded]
    return pa.concat_tables(tables), lengths, refused


def _parquet(table: Any) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=1024)  # small row groups: a resume reads little before its row
    return sink.getvalue().to_pybytes()


def run(args: argparse.Namespace) -> None:
    _check(args)
    out = Output(args.output_dir, args.overwrite_output_dir)  # an occupied folder: refused before anything heavy
    try:
        rows, shards, manifest = _write(args, out)
        out.publish()
    except BaseException:
        out.discard()
        raise
    print(
        f"{manifest['documents']} documents, {manifest['tokens']} tokens, {rows} rows in {len(shards)} shard(s): "
        f"{out.url}"
    )


def _write(args: argparse.Namespace, out: Output) -> tuple[int, list[dict], dict]:
    """Every shard, the picture, and the manifest last (what marks a staged set complete)."""
    from cloudtrain.data.shards import made_with
    from cloudtrain.models.load import read_tokenizer  # transformers and torch: only once the options are valid
    from cloudtrain.registry import TASKS

    task = TASKS[args.task]
    cfg = _data_config(args, task)
    spec = _source(args)
    tokenizer = read_tokenizer(args.tokenizer_name_or_path, trust_remote_code=False)
    encode, keep, shards, refused = None, [args.text_column], [], 0
    lengths: list[int] = []
    columns: set[str] = set()  # every column seen: what the line says when nothing gave a token
    for n, records in enumerate(_documents(spec, args.shard_documents)):
        columns.update(name for record in records for name in record)
        if encode is None:
            encode, keep = task.preprocess_encoder(tokenizer, cfg, next((r for r in records if r), {}))
        table, doc_lengths, left_out = _shard(records, encode, keep, args, len(lengths))
        refused += left_out
        name = f"shard-{n:05d}.parquet"  # (shards.is_shard_name knows the form)
        out.write(name, _parquet(table))
        kill_point("preprocess.shard")
        shards.append({"file": name, "documents": len(records), "rows": table.num_rows, "tokens": sum(doc_lengths)})
        lengths += doc_lengths
    if not shards:
        raise UserError(f"{args.train_file} holds no document")
    if not sum(lengths):  # nothing published: the staged shards are discarded
        if not columns:  # every record was skipped as corrupted (the warnings above say why)
            raise UserError(
                f"{args.train_file} gave no tokens: no record could be read (see the warnings above); give UTF-8 "
                f"files of its format ({spec.format})"
            )
        if _examples(args):
            raise UserError(f"{args.train_file} gave no tokens: no record holds a --task {args.task} example")
        if args.text_column in columns:
            raise UserError(
                f"{args.train_file} gave no tokens: every record's {args.text_column!r} is blank; give a corpus "
                "with text"
            )
        raise UserError(
            f"{args.train_file} gave no tokens: no record has text in column {args.text_column!r} (its columns: "
            f"{', '.join(sorted(columns)[:8])}); pass --text_column"
        )
    manifest = {**_manifest(args, made_with(task, tokenizer, cfg), shards, lengths), "records_refused": refused}
    out.write(HISTOGRAM, _plot(manifest["length_histogram"]))
    out.write(MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return sum(s["rows"] for s in shards), shards, manifest


def _manifest(args: argparse.Namespace, made: dict, shards: list[dict], lengths: list[int]) -> dict:
    """The counts, and what the shards were made with (`made`: checked by each run that trains on them)."""
    import numpy as np

    counts, edges = np.histogram(lengths, bins=min(50, max(1, len(set(lengths)))))
    return {
        "source": args.train_file,
        "tokenizer": str(args.tokenizer_name_or_path),
        "text_column": args.text_column,
        "packing": args.packing,
        "max_length": args.max_length,
        **made,  # the task, its encoder's options and the tokenizer's digest
        "documents": len(lengths),
        "empty_documents": sum(1 for n in lengths if n == 0),
        "tokens": sum(lengths),
        "shards": shards,
        "length_histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
    }


def _plot(histogram: dict) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges, counts = histogram["edges"], histogram["counts"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:], strict=False)], align="edge")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
