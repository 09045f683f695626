"""Record readers for streaming: one file at a time, from a position, without reading what lies before it.

A position is one integer per file: the byte offset in the (decompressed) text for line formats (txt, jsonl,
csv), the row index for parquet (row groups are found from the file's metadata, not its data) and the item
index for a JSON array (such a file is read whole: one file, never the corpus). `RecordReader.next(parse)`
returns the next record and the position after it; with `parse=False` the record is only stepped over
(no decoding, no JSON parsing, parquet rows not even read), which is how every loader worker walks past
the documents that other workers tokenize.

Compressed text (.gz, .zst) has no random access: seeking there decompresses from the start of the file.
A record that cannot be decoded raises `BadRecord` (the rest of the file is still readable); a file that
cannot be read on raises `BadFile` (truncated archive, damaged parquet).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMATS = ("txt", "jsonl", "json", "csv", "tsv", "parquet")
COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
SKIPPED = None  # the record of a step over (parse=False)


class BadRecord(Exception):
    """One record that cannot be decoded; the reader can go on."""


class BadFile(Exception):
    """A file that cannot be read on from here."""


# a TSV cell that opens with a quote is read as quoted up to the next quote: the rows between become part of it
RUN_ON = "\t[^\n]*\n|\n[^\n]*\t"  # a TSV cell holding a tab and a line break: it ran on into the rows after it
SWALLOWED = (
    "a cell that opens with a quote ran on into the rows after it (its tabs and line breaks with it); remove that "
    'quote, or quote the whole cell and double the quotes inside ("" as in csv)'
)


def file_format(path: str) -> str | None:
    """The format of `path` from its name (`.jsonl.gz` -> jsonl), or None."""
    name = Path(path).name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    suffix = Path(name).suffix.lstrip(".")
    return suffix if suffix in FORMATS else None


def folder_data_files(files: list[str], fmt: str | None = None) -> list[str]:
    """The data files of a folder's (or prefix's) listing: those whose name says a format, and with `fmt` (a source's
    format, for names that say none: Spark's part-00000) those with no suffix, but Hadoop's `_SUCCESS`-style markers
    and LICENSE-style documents; a `cloudtrain preprocess` folder's manifest.json is no data."""
    kept = [f for f in files if file_format(f) or (fmt and _unnamed_data(f.rstrip("/").rsplit("/", 1)[-1]))]
    if any(f.endswith(".parquet") for f in kept):
        kept = [f for f in kept if f.rsplit("/", 1)[-1] != "manifest.json"]
    return kept


def _unnamed_data(name: str) -> bool:
    return "." not in name and not name.startswith("_") and not name.isupper()


def is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def is_remote(path: str) -> bool:
    """A URL (s3://bucket/key, hf://datasets/owner/name@commit/file, any protocol fsspec knows), not a local path."""
    return "://" in path


# fsspec's 6-line warning about s3fs 0.4 (the pin: every newer s3fs needs aiobotocore) before every s3:// line
warnings.filterwarnings("ignore", message="Your installed version of s3fs is very old", category=UserWarning)


def storage_options(path: str) -> dict:
    """fsspec options for `path`: for S3, short timeouts and two attempts, so that a wrong endpoint or a dead
    network is an error within seconds instead of botocore's minutes of retries; and no cached filesystem, so
    the endpoint and credentials of this moment are the ones used (fsspec caches instances across calls).
    hf:// files keep HfFileSystem's cached instance: their URLs name a commit, whose listing never changes."""
    if not path.startswith(("s3://", "s3a://")):
        return {}
    return {"config_kwargs": dict(REMOTE_TIMEOUTS), "skip_instance_cache": True}


REMOTE_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}}


class _GzipFile(gzip.GzipFile):
    """A GzipFile that closes the file it was handed (gzip leaves a given file object open)."""

    def close(self) -> None:
        raw: Any = self.fileobj
        super().close()
        if raw is not None:
            raw.close()


def open_raw(path: str) -> Any:
    if is_remote(path):  # object storage or the Hub through fsspec: seekable, read in blocks by ranged GETs
        import fsspec

        try:
            return fsspec.open(path, "rb", **storage_options(path)).open()
        except (OSError, EOFError, ValueError):  # the file's own (missing, damaged): a bad file where it is read
            raise
        except Exception as err:  # noqa: BLE001 (botocore's and aiohttp's own kinds: an endpoint gone, a timeout)
            from cloudtrain.data.remote import remote_failure  # (it reads this module)

            raise remote_failure(path, err, "opening") from None
    return open(path, "rb")  # noqa: SIM115 (closed by RecordReader.close)


def _open_binary(path: str) -> Any:
    """The file's decompressed bytes; compression wraps the raw handle, so s3:// .gz and .zst read too."""
    raw = open_raw(path)
    if path.endswith(".gz"):
        return _GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdStream(raw))
    return raw


class _ZstdStream(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame. Damage is the OSError a damaged .gz raises, by which the
    readers skip, count or refuse a file: zstandard's own ZstdError (a traceback before; found in audit), and a file
    that ends inside a frame, which zstandard's stream reader takes for a clean end (a cut file lost its rest as
    one bad record; found in review)."""

    CHUNK = 1 << 16

    def __init__(self, raw: Any):
        super().__init__()
        self._raw, self._out, self._frame, self._fed = raw, bytearray(), self._new_frame(), False

    @staticmethod
    def _new_frame() -> Any:
        import zstandard  # only for .zst files

        return zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            chunk = self._raw.read(self.CHUNK)
            if not chunk:
                if self._fed and not self._frame.eof:
                    raise OSError("zstd data cut short (the file ends inside a frame)")
                return 0
            self._feed(chunk)
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        del self._out[:n]
        return n

    def _feed(self, data: bytes) -> None:
        import zstandard

        while data:
            if self._frame.eof:  # the next frame of a file of several
                self._frame = self._new_frame()
            self._fed = True
            try:
                self._out += self._frame.decompress(data)
            except zstandard.ZstdError as err:
                raise OSError(f"damaged zstd data ({err})") from None
            data = self._frame.unused_data if self._frame.eof else b""

    def close(self) -> None:
        self._raw.close()
        super().close()


def _seek(handle: Any, position: int, forward_only: bool) -> None:
    """Move to `position`; a zstd stream can only read its way there."""
    if not forward_only:
        handle.seek(position)
        return
    left = position
    while left > 0:
        got = handle.read(min(left, 1 << 20))
        if not got:
            break
        left -= len(got)


class RecordReader:
    """The records of one file from `position` on; `next` raises StopIteration at the end of the file."""

    def __init__(self, path: str, fmt: str, position: int = 0):
        self.path, self.format, self.position = path, fmt, position
        self._handle: Any = None
        self._rows: list | None = None  # parquet: the current row group's rows; json: the array
        self._group = (-1, 0, 0)  # parquet: (index, first row, rows) of the row group in _rows
        self._header: list[str] | None = None
        self.size = 0  # the last record's bytes, parsed or not (parquet, JSON arrays: their file's mean per record)
        try:
            self._open()
        except (OSError, EOFError, ValueError) as err:
            raise BadFile(f"{type(err).__name__}: {str(err)[:200]}") from None

    def _open(self) -> None:
        if self.format == "parquet":
            import pyarrow.parquet as pq

            self._parquet = pq.ParquetFile(_open_binary(self.path))
            meta = self._parquet.metadata
            self._groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            self._total = meta.num_rows
            self._row_bytes = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) // max(
                self._total, 1
            )  # from the metadata, as a step over reads no row
            return
        self._handle = _open_binary(self.path)
        if self.format == "json" and self._handle.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()[:1] == b"[":  # an array
            self._handle.close()
            self._handle = _open_binary(self.path)
            text = self._handle.read()
            self._rows = json.loads(text.decode("utf-8-sig"))
            self._row_bytes = len(text) // max(len(self._rows), 1)
            return
        elif self.format == "json":
            self._handle.close()
            self._handle = _open_binary(self.path)
        if self.format in ("csv", "tsv"):
            header_line = self._handle.readline()
            # utf-8-sig: a byte-order mark (Excel's UTF-8 CSV) is no part of the first column's name
            self._header = next(csv.reader([header_line.decode("utf-8-sig")], delimiter=self._delimiter))
            self.position = max(self.position, len(header_line))
            if self.path.endswith(".zst"):
                self._handle = _open_binary(self.path)  # forward only: from the start again
        _seek(self._handle, self.position, self.path.endswith(".zst"))

    @property
    def _delimiter(self) -> str:
        return "\t" if self.format == "tsv" else ","

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def next(self, parse: bool = True) -> tuple[dict | None, int]:
        """(record, position after it); the record is None when not parsed. StopIteration at the end."""
        if self.format == "parquet":
            return self._next_parquet(parse)
        if self._rows is not None:
            if self.position >= len(self._rows):
                raise StopIteration
            self.position += 1
            self.size = self._row_bytes
            return (self._record(self._rows[self.position - 1]) if parse else SKIPPED), self.position
        if self.format in ("csv", "tsv"):
            return self._next_csv()
        try:
            line = self._handle.readline()
        except (OSError, EOFError, ValueError) as err:  # a truncated or damaged archive
            raise BadFile(f"{type(err).__name__}: {str(err)[:200]}") from None
        if not line:
            raise StopIteration
        self.position += len(line)
        self.size = len(line)
        return (self._parse_line(line) if parse else SKIPPED), self.position

    def _parse_line(self, line: bytes) -> dict:
        try:
            text = line.decode("utf-8-sig" if self.position == len(line) else "utf-8")  # a first line's BOM
        except UnicodeDecodeError:
            raise BadRecord("not UTF-8") from None
        if self.format == "txt":
            return {"text": text.rstrip("\r\n")}
        if not text.strip():
            return {}
        try:
            return self._record(json.loads(text))
        except json.JSONDecodeError as err:
            at = "" if err.msg.endswith(" at") else " at"  # json's "Invalid control character at" names no place
            raise BadRecord(f"not JSON ({err.msg}{at} column {err.colno})") from None

    @staticmethod
    def _record(value: Any) -> dict:
        if not isinstance(value, dict):
            raise BadRecord(f"a {type(value).__name__}, not an object")
        return value

    def _lines(self) -> Iterator[str]:
        """Decoded lines, advancing `position` line by line (csv pulls as many as one record spans)."""
        while line := self._handle.readline():
            self.position += len(line)
            yield line.decode("utf-8")

    def _next_csv(self) -> tuple[dict | None, int]:
        assert self._header is not None
        before = self.position
        try:
            row = next(csv.reader(self._lines(), delimiter=self._delimiter))
        except UnicodeDecodeError:
            self.size = self.position - before
            raise BadRecord("not UTF-8") from None
        except csv.Error as err:
            self.size = self.position - before
            raise BadRecord(f"not CSV ({err})") from None
        except (OSError, EOFError) as err:
            raise BadFile(f"{type(err).__name__}: {str(err)[:200]}") from None
        self.size = self.position - before
        if self.format == "tsv" and any(re.search(RUN_ON, cell) for cell in row):
            raise BadRecord(SWALLOWED)
        return dict(zip(self._header, row, strict=False)), self.position

    def _next_parquet(self, parse: bool) -> tuple[dict | None, int]:
        if self.position >= self._total:
            raise StopIteration
        self.position += 1
        self.size = self._row_bytes
        if not parse:
            return SKIPPED, self.position
        index = self.position - 1
        group, first, rows = self._group
        if not first <= index < first + rows:
            group, first = 0, 0
            while first + self._groups[group] <= index:
                first += self._groups[group]
                group += 1
            try:
                self._rows = self._parquet.read_row_group(group).to_pylist()
            except Exception as err:  # noqa: BLE001 (pyarrow raises many kinds for a damaged row group)
                self._group = (group, first, 0)
                raise BadRecord(f"row group {group} unreadable ({type(err).__name__})") from None
            self._group = (group, first, self._groups[group])
        if self._group[2] == 0:  # in a row group already found unreadable
            raise BadRecord(f"row group {group} unreadable")
        assert self._rows is not None
        return self._rows[index - first], self.position
