"""Streaming training data (`--streaming true`): documents read, tokenized and packed on the fly.

The global stream, the same whatever the number of processes and loader workers:

    documents (cloudtrain.data.mixture: one seeded sequence over the weighted sources)
    -> buffers of --stream_buffer documents, buffer j holding documents [j*B, (j+1)*B) of the sequence
    -> rows: each buffer tokenized by the task and packed alone (packing.pack_buffer)
    -> global micro-batches of --per_device_train_batch_size consecutive rows; an optimizer step takes
       processes x accumulation of them, micro-batch b going to process b % processes.

Loader workers split the buffers (worker w packs buffers j = w mod workers and only steps over the
documents of the others, unparsed); torch's DataLoader hands their buffers back in turn, so in order.
Every process builds the whole row stream and keeps its own micro-batches: tokenizing is repeated on every
process, reading no less (the price of an order that does not depend on the process count).

The position is a cursor: the mixture state at the start of the buffer holding the next row, and how many
of that buffer's rows were consumed. A checkpoint stores it (`StreamLoader.state_dict`); a resume reopens
each source at its file and offset and re-reads one buffer at most, so the documents consumed after the
resume are those of the uninterrupted run, at any number of processes, as long as the global batch (rows
per step) is the same. See docs/streaming.md.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from cloudtrain.data.mixture import MixtureStream, SourceSpec, first_record
from cloudtrain.data.packing import pack_buffer
from cloudtrain.data.shards import check_shards, columns_made_with, folder_of, read_manifest
from cloudtrain.data.stream_layout import check_layout, check_stamps, layout_of, stamps_of
from cloudtrain.errors import UserError

STATE_FILE = "data_state.json"  # the stream's cursor in a checkpoint
STORED_TOKENS = "input_ids"  # the column of pre-tokenized shards (cloudtrain.data.preprocess)
STORED_MASK = "loss_mask"  # SFT shards: the answer masks
PACKED_LENGTHS = "seq_lengths"  # a shard row packed by `cloudtrain preprocess --packing`: passed through
Encoder = Callable[[list[dict]], list[list[tuple[list[int], list[int] | None]]]]


class Refused(list):
    """An encoder's answer for a record its task refuses (an unknown role, no answer): no examples, and why.
    The stream skips it with a warning and counts it, or stops, as --on_bad_data says for corrupted data."""

    def __init__(self, why: str):
        super().__init__()
        self.why = why


class Cut(list):
    """An encoder's examples of a record less those it dropped, `dropped`: SFT's examples left with no answer
    token within --max_length. The stream counts them, and stops where they are most of its examples."""

    def __init__(self, examples: list, dropped: int):
        super().__init__(examples)
        self.dropped = dropped


MOST_CUT = 0.5  # a share of examples without an answer token above which a run stops (raise --max_length)


@dataclass
class StreamPlan:
    """What the training stream is made of; picklable with the task's `encode` under fork."""

    sources: list[SourceSpec]
    start: dict  # the mixture state where training starts (after the held-out validation documents)
    seed: int
    exhausted: str
    on_bad: str
    buffer_docs: int
    block_size: int
    packing: str
    encode: Encoder  # a buffer's records -> per record, its examples (token ids, loss mask or None)
    collator: Callable[[list[dict]], dict] | None = None
    budget: dict = field(default_factory=dict)  # max_steps, max_tokens, micro, accumulation, workers
    vocabulary: int | None = None  # the tokenizer's size: a stored id at or beyond it is refused
    # a buffer ends once its documents reach this many MiB in their files (0: no cap; None: none either, for a
    # lineage of checkpoints from before the cap, whose layout holds no buffer_mb)
    buffer_mb: float | None = 0

    def __len__(self) -> int:  # rows planned: printed by the trainer as the training rows
        return self.budget.get("rows", 0)

    def loader(self, micro: int, pin_memory: bool = False) -> StreamLoader:
        rank, world = _rank_world()
        return StreamLoader(self, micro, rank, world, pin_memory)


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _identity(item: Any) -> Any:
    return item


def encode_stored(records: list[dict], encode: Encoder) -> list[list[tuple[list[int], list[int] | None]]]:
    """Per record, its examples: a pre-tokenized record (`cloudtrain preprocess` shards: an `input_ids` list, for
    SFT a list of examples with their `loss_mask`s) gives its stored tokens, read not tokenized; the others go
    through the task's encoder."""
    stored = [isinstance(r.get(STORED_TOKENS), list) for r in records]
    if not any(stored):
        return encode(records)
    fresh = iter(encode([r for r, s in zip(records, stored, strict=True) if not s]) if not all(stored) else [])
    return [_stored(r) if s else next(fresh) for r, s in zip(records, stored, strict=True)]


def _stored(record: dict) -> list[tuple[list[int], list[int] | None]]:
    ids = record[STORED_TOKENS]
    if ids and isinstance(ids[0], list):  # SFT: its examples, each with its answer mask
        return [(list(e), list(m)) for e, m in zip(ids, record[STORED_MASK], strict=True)]
    return [(list(ids), None)] if ids else []


def _packed_row(record: dict, source: int, key: tuple, block_size: int) -> dict:
    """A row packed by `cloudtrain preprocess --packing`, as pack_buffer makes them, cut to `block_size`."""
    ids, lengths, at = list(record[STORED_TOKENS][:block_size]), [], 0
    for n in record[PACKED_LENGTHS]:
        if at < len(ids):
            lengths.append(min(n, len(ids) - at))
        at += n
    row: dict[str, Any] = {"input_ids": ids, "seq_lengths": lengths}
    if record.get(STORED_MASK) is not None:
        row["loss_mask"] = list(record[STORED_MASK][: len(ids)])
    row["starts"] = [(*key, n) for n in range(record.get("documents") or 0)]
    row["tokens"] = {source: len(ids)} if ids else {}
    return row


class BufferDataset(IterableDataset):
    """The packed buffers from a mixture state on, this worker's share of them, in order."""

    def __init__(self, plan: StreamPlan, start: dict, first_buffer: int):
        self.plan, self.start, self.first_buffer = plan, start, first_buffer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        p = self.plan
        stream = MixtureStream(p.sources, self.start, p.seed, p.exhausted, p.on_bad)
        stream.warnings = []  # handed to the loader with the buffer: it says each once, on the main process
        try:
            j = self.first_buffer
            while not stream.state["ended"]:
                mine = (j - self.first_buffer) % workers == worker
                before = copy.deepcopy(stream.state)
                try:
                    docs = self._read(stream, mine)
                    if stream.state["doc"] == before["doc"]:
                        return
                    rows, cut = self._rows(docs, stream) if mine else ([], (0, 0))
                except UserError as err:  # on_bad_data stop: said once, by the main process (the loader's raise)
                    yield {"error": str(err)}
                    return
                if mine:
                    bad, said = dict(stream.bad), stream.warnings
                    yield {"index": j, "start": before, "rows": rows, "bad": bad, "cut": cut, "warnings": said}
                    stream.bad, stream.warnings = {"records": 0, "files": 0}, []
                j += 1
        finally:
            stream.close()

    def _read(self, stream: MixtureStream, parse: bool) -> list[tuple]:
        """A buffer's documents: --stream_buffer of them, fewer where they reach --stream_buffer_mb first (by their
        bytes in the files, which every worker counts alike, parsing them or not)."""
        docs, size, cap = [], 0, (self.plan.buffer_mb or 0) * 2**20 or math.inf
        for _ in range(self.plan.buffer_docs):
            if size >= cap:
                break
            try:
                source, key, record = stream.next(parse)
            except StopIteration:
                break
            size += stream.size
            if parse:
                docs.append((source, key, record))
        return docs

    def _rows(self, docs: list[tuple], stream: MixtureStream) -> tuple[list[dict], tuple[int, int]]:
        """The buffer's rows: its packed shard rows as they are, then the other documents packed; and the
        examples encoded and dropped (`Cut`)."""
        packed = [d for d in docs if is_packed(d[2])]
        rows = [_packed_row(record, source, key, self.plan.block_size) for source, key, record in packed]
        if len(packed) == len(docs):
            return rows, (0, 0)
        more, cut = self._pack([d for d in docs if not is_packed(d[2])], stream)
        return rows + more, cut

    def _pack(self, docs: list[tuple], stream: MixtureStream) -> tuple[list[dict], tuple[int, int]]:
        encoded = encode_stored([record for _, _, record in docs], self.plan.encode)
        dropped = sum(getattr(examples, "dropped", 0) for examples in encoded)
        cut = (sum(len(examples) for examples in encoded) + dropped, dropped)
        for (source, key, _), examples in zip(docs, encoded, strict=True):
            if isinstance(examples, Refused):
                stream.refused(source, key, examples.why)
        items = [
            (source, key if n == 0 else (*key, n), ids, mask)
            for (source, key, _), examples in zip(docs, encoded, strict=True)
            for n, (ids, mask) in enumerate(examples)
        ]
        return pack_buffer(items, self.plan.block_size, self.plan.packing), cut


@dataclass
class _Buffer:
    index: int
    start: dict  # mixture state at its first document
    first_row: int  # global index of its row 0
    rows: list[dict]
    skipped: int  # rows consumed before (a resume's first buffer)
    stats: dict  # cumulative counts at global row first_row + skipped


def zero_stats(n: int) -> dict:
    return {"documents": [0] * n, "tokens": [0] * n, "bad_records": 0, "bad_files": 0}


def _add_row(stats: dict, row: dict) -> None:
    for source, n in row["tokens"].items():
        stats["tokens"][source] += n
    for key in row["starts"]:
        stats["documents"][key[0]] += 1


class StreamLoader:
    """This process's micro-batches of the global row stream, with the cursor a checkpoint stores.

    Not a torch DataLoader, so accelerate passes it through `prepare` untouched (it would dispatch or re-shard
    an iterable dataset). Batches are collated here and stay on the host (in pinned memory with `pin_memory`,
    as a map-style loader's with --dataloader_pin_memory): the trainer places them as it places stored
    batches, so a stream's input path (copy stream, look-ahead, data-wait clock) is the map-style one.
    """

    def __init__(self, plan: StreamPlan, micro: int, rank: int, world: int, pin_memory: bool = False):
        self.plan, self.micro, self.rank, self.world, self.pin = plan, micro, rank, world, bool(pin_memory)
        b = plan.budget
        self.accumulation = b.get("accumulation", 1)
        self.step_rows = micro * world * self.accumulation  # the global batch, in rows
        block = plan.block_size
        self.total_steps = b.get("max_steps") or math.ceil(b["max_tokens"] / (self.step_rows * block))
        plan.budget["rows"] = self.total_steps * self.step_rows
        self.resume: dict | None = None
        self.buffers: deque[_Buffer] = deque()
        self.base = {"rows": 0, "step": 0}
        self.dropped_rows = 0
        self.stamp_cache: dict = {}  # what stamps_of found of each file read (its digest read once)

    def __len__(self) -> int:
        return self.total_steps * self.accumulation

    def set_epoch(self, epoch: int) -> None:
        """A stream has no epochs of its own: sources restart (or not) by --mixture_exhausted."""

    def load_state_dict(self, state: dict) -> None:
        if len(state["stats"]["documents"]) != len(self.plan.sources):
            raise UserError(
                f"the checkpoint's data stream has {len(state['stats']['documents'])} source(s), this run "
                f"{len(self.plan.sources)}: resume with the same training sources"
            )
        if "buffer_mb" not in state.get("layout", {}):  # a lineage from before the byte cap: cut by count alone,
            self._uncapped()  # and recorded so (no buffer_mb), so each later resume cuts as it did
        if "layout" in state:  # checkpoints before the record hold none
            check_layout(state["layout"], self.layout(), self.plan.sources)
            check_stamps(state["layout"].get("stamps"), self.plan.sources, self.stamp_cache)
        self.resume = state
        if not self.plan.budget.get("max_steps"):  # --max_tokens: the rows left of the budget, at this run's batch
            left = max(math.ceil(self.plan.budget["max_tokens"] / self.plan.block_size) - state["rows"], 0)
            self.total_steps = state["step"] + math.ceil(left / self.step_rows)
            self.plan.budget["rows"] = self.total_steps * self.step_rows

    def _uncapped(self) -> None:
        if self.plan.buffer_mb is not None and _rank_world()[0] == 0:
            print(
                "note: the checkpoint's data stream was cut before --stream_buffer_mb existed: its buffers stay cut "
                f"by --stream_buffer {self.plan.buffer_docs} documents alone, as its cursor counts them",
                flush=True,
            )
        self.plan.buffer_mb = None

    def layout(self) -> dict:
        return layout_of(self.plan)

    def __iter__(self) -> Iterator[dict]:
        """This process's collated micro-batches, on the host (pinned with `pin_memory`)."""
        assert self.plan.collator is not None
        vocabulary = self.plan.vocabulary
        for chunk in self.chunks():
            batch = self.plan.collator([{k: v for k, v in r.items() if k not in ("starts", "tokens")} for r in chunk])
            if vocabulary and int(batch["input_ids"].max()) >= vocabulary:
                self._beyond(chunk, vocabulary)
            yield {k: v.pin_memory() if self.pin else v for k, v in batch.items()}

    def _beyond(self, chunk: list[dict], vocabulary: int) -> None:
        """Stored tokens no id of this run's tokenizer reaches (shards made by another, with no manifest to say it):
        one line naming the source, not an embedding's IndexError."""
        row = next(r for r in chunk if max(r["input_ids"], default=0) >= vocabulary)
        source = self.plan.sources[row["starts"][0][0]].name if row["starts"] else "a training source"
        raise UserError(
            f"{source} holds token id {max(row['input_ids'])}, beyond this run's tokenizer ({vocabulary} tokens): "
            "its shards were made by another tokenizer; run cloudtrain preprocess again with "
            "--tokenizer_name_or_path naming this run's"
        )

    def chunks(self) -> Iterator[list[dict]]:
        """This process's micro-batches as rows (with the keys of the documents starting in each, `starts`)."""
        start = self.resume or {
            "stream": self.plan.start,
            "buffer": 0,
            "skip_rows": 0,
            "rows": 0,
            "step": 0,
            "stats": zero_stats(len(self.plan.sources)),
        }
        self.base = {"rows": start["rows"], "step": start["step"]}
        self.buffers.clear()
        rows_done = start["rows"]
        step: list[dict] = []  # the rows of the step being gathered (every process gathers all of them)
        for buffer in self._buffers(start):
            for row in buffer.rows[buffer.skipped :]:
                step.append(row)
                if len(step) < self.step_rows:
                    continue
                for b in range(self.rank, self.world * self.accumulation, self.world):
                    yield step[b * self.micro : (b + 1) * self.micro]
                # the trainer has taken this step's cursor by now: only later steps' cursors are asked for
                step, rows_done = [], rows_done + self.step_rows
                while len(self.buffers) > 1 and self.buffers[1].first_row <= rows_done:
                    self.buffers.popleft()
        self.dropped_rows = len(step)  # a last step too short for every process: not trained on
        if step and self.rank == 0:
            print(f"note: the stream ended; its last {len(step)} row(s) fill no whole step and are left out")

    def _buffers(self, start: dict) -> Iterator[_Buffer]:
        from cloudtrain.data.processing import leave_stops_to_the_run as init

        workers = self.plan.budget.get("workers", 0)
        dataset = BufferDataset(self.plan, start["stream"], start["buffer"])
        items: Any = (
            DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_identity, worker_init_fn=init)
            if workers
            else iter(dataset)
        )
        first_row, stats = start["rows"] - start["skip_rows"], copy.deepcopy(start["stats"])
        skipped = start["skip_rows"]
        productive: list[int] | None = None  # the sources' passes at the last buffer that gave rows
        barren: set[int] = set()  # sources said to have given no token in a whole pass
        warned: set[str] = set()  # skip warnings said: a bad record read again on a later pass is not said again
        for item in items:
            if "error" in item:  # every process meets it: the main one says it
                raise UserError(item["error"], quiet=self.rank != 0)
            for line in item["warnings"]:
                if line not in warned and self.rank == 0:
                    print(line, file=sys.stderr, flush=True)
                warned.add(line)
            productive = self._check_progress(item, productive)
            self._say_barren(item["start"]["sources"], stats, barren)
            stats["bad_records"] += item["bad"]["records"]
            stats["bad_files"] += item["bad"]["files"]
            self._count_cut(stats, *item["cut"])
            buffer = _Buffer(item["index"], item["start"], first_row, item["rows"], skipped, copy.deepcopy(stats))
            self.buffers.append(buffer)
            yield buffer
            for row in buffer.rows[skipped:]:
                _add_row(stats, row)
            first_row += len(buffer.rows)
            skipped = 0

    def _check_progress(self, item: dict, productive: list[int] | None) -> list[int]:
        """The passes to compare the next buffer with; a UserError once every active source has gone through a
        whole pass without a row (all texts empty, or every record bad): the stream would spin for ever."""
        sources = item["start"]["sources"]
        passes = [source["pass"] for source in sources]
        if item["rows"] or productive is None:
            return passes
        active = [i for i, source in enumerate(sources) if source["active"]]
        if active and all(passes[i] >= productive[i] + 2 for i in active):
            raise UserError(
                "the training sources gave no tokens in a whole pass (every text empty, or every record unreadable): "
                "check the files and --text_column (or the datasets: entries' columns)",
                quiet=self.rank != 0,  # every process builds the whole stream: the main one says it
            )
        return productive

    def _count_cut(self, stats: dict, examples: int, dropped: int) -> None:
        """Examples dropped for want of an answer token within --max_length: said at the first, counted, and a
        UserError once they are most of the examples so far (as a stored dataset is refused)."""
        before = stats.get("examples_dropped", 0)
        stats["examples"] = stats.get("examples", 0) + examples
        stats["examples_dropped"] = before + dropped
        if stats["examples_dropped"] > MOST_CUT * stats["examples"]:
            raise UserError(
                f"{stats['examples_dropped']} of the first {stats['examples']} streamed examples have no answer token "
                f"within --max_length {self.plan.block_size}; raise --max_length or shorten the prompts",
                quiet=self.rank != 0,  # the same count on every process: the main one says it
            )
        if dropped and not before and self.rank == 0:
            print(
                f"note: streamed examples with no answer token within --max_length {self.plan.block_size} are "
                "dropped and counted (train_results.json: sources, examples_dropped)"
            )

    def _say_barren(self, positions: list[dict], stats: dict, said: set[int]) -> None:
        """A note, once, for each source that went through a whole pass without a token: its draws (its weight's
        share of documents) train on nothing, while the others' fill the rows."""
        for i, (spec, position) in enumerate(zip(self.plan.sources, positions, strict=True)):
            done = position["pass"] > 0 or not position["active"]
            if spec.weight > 0 and done and not stats["tokens"][i] and i not in said:
                said.add(i)
                if self.rank == 0:
                    print(
                        f"note: training source {spec.name} gave no tokens in a whole pass (every text empty, or "
                        f"every record unreadable): its share of the draws trains on nothing; check its files and "
                        "columns, or leave it out"
                    )

    def state_dict(self, step: int) -> dict:
        """The cursor after optimizer step `step`: where a resume starts reading, and the counts so far."""
        cursor = self._cursor(step)
        stamps = stamps_of(self.plan.sources, cursor["stream"], self.stamp_cache)
        return {**cursor, "layout": {**self.layout(), "stamps": stamps}}

    def _cursor(self, step: int) -> dict:
        rows = self.base["rows"] + (step - self.base["step"]) * self.step_rows
        for buffer in self.buffers:
            if buffer.first_row + buffer.skipped <= rows <= buffer.first_row + len(buffer.rows):
                stats = copy.deepcopy(buffer.stats)
                for row in buffer.rows[buffer.skipped : rows - buffer.first_row]:
                    _add_row(stats, row)
                return {
                    "stream": buffer.start,
                    "buffer": buffer.index,
                    "skip_rows": rows - buffer.first_row,
                    "rows": rows,
                    "step": step,
                    "stats": stats,
                }
        raise RuntimeError(f"no buffer holds row {rows} of the stream (step {step}); the cursor was pruned")

    def consumed(self, step: int) -> dict:
        """Per source, as the user named it: documents started and tokens trained on, up to `step`."""
        if not self.buffers:
            stats = self.resume["stats"] if self.resume else zero_stats(len(self.plan.sources))
        else:
            stats = self._cursor(step)["stats"]
        result: dict[str, Any] = {
            spec.name: {"documents": stats["documents"][i], "tokens": stats["tokens"][i]}
            for i, spec in enumerate(self.plan.sources)
        }
        result["corrupted_records_skipped"] = stats["bad_records"]
        result["corrupted_files_skipped"] = stats["bad_files"]
        if stats.get("examples_dropped"):  # of the examples read so far, read-ahead included: both are said
            result["examples_dropped"] = stats["examples_dropped"]
            result["examples_read"] = stats["examples"]
        return result

    def source_metrics(self, step: int) -> dict[str, float]:
        """`consumed(step)` as flat metrics for the run log and trackers at a logging step: per source,
        `data/<source as named>/documents` and `.../tokens` so far. The same on every process (each builds the
        whole stream), so no collective."""
        counts = self.consumed(step)
        values = {
            f"data/{name}/{kind}": float(n)
            for name, per_source in counts.items()
            if isinstance(per_source, dict)
            for kind, n in per_source.items()
        }
        for name in ("corrupted_records_skipped", "corrupted_files_skipped", "examples_dropped", "examples_read"):
            if name in counts:
                values[f"data/{name}"] = float(counts[name])
        return values


def connect_stream(cfg: Any, needed: dict[str, str], validation: bool) -> tuple[list[dict], list[SourceSpec]]:
    """The sources of a DataConfig checked (files, weights, columns), and the first record of each that holds the
    task's records (packed shards hold training rows instead: they need a `validation` split given).

    `needed`: {column: its flag} of the task's columns every source's records must hold (a source's `columns:` maps
    its own names).
    Nothing is read beyond one record per source.
    """
    from cloudtrain.data.mixture import resolve_sources

    specs = resolve_sources(cfg)
    _check_held_out_apart(specs, {split: getattr(cfg, f"{split}_file", None) for split in ("validation", "test")})
    for spec in specs:
        if spec.format == "txt":  # a line arrives as "text": it is the task's text column
            spec.columns.setdefault(cfg.text_column, "text")
    first = [_first_record(spec, needed) for spec in specs]
    for spec, record in zip(specs, first, strict=True):
        spec.packed = is_packed(record)
    packed = [spec.name for spec in specs if spec.packed]
    if packed and not validation:
        raise UserError(
            f"training source {packed[0]} holds packed shards (cloudtrain preprocess --packing), which hold no text "
            "to validate on: give --validation_file"
        )
    return [record for record in first if not is_packed(record)], specs


def _check_held_out_apart(specs: list[SourceSpec], held_out: dict[str, str | None]) -> None:
    """A --validation_file or --test_file (a file or a folder) that a training source's folder or glob also
    reads would be trained on."""
    from cloudtrain.data.mixture import expand

    trained = {os.path.realpath(f): spec.name for spec in specs for f in spec.files if "://" not in f}
    for split, path in held_out.items():
        if not path or "://" in path:
            continue
        for held in expand(path):
            if (source := trained.get(os.path.realpath(held))) is not None:
                raise UserError(
                    f"--{split}_file {path} is also read by training source {source}, so it would be trained on: "
                    "move it out of that folder, or name the training files with a glob that leaves it out"
                )


def is_packed(record: dict | None) -> bool:
    """A training row packed by `cloudtrain preprocess --packing` (passed through as it is), not a record."""
    return isinstance((record or {}).get(PACKED_LENGTHS), list)


def hold_out(specs: list[SourceSpec], cfg: Any, seed: int) -> tuple[list[dict], dict]:
    """The first --stream_validation_docs documents of the mixture (validation) and the state after them,
    where training starts. Each source's state counts its documents held out, which its later passes skip, so no
    document is in both."""
    from cloudtrain.data.mixture import initial_state

    stream = MixtureStream(specs, initial_state(specs), seed, cfg.mixture_exhausted, cfg.on_bad_data)
    stream.warnings, main = [], _rank_world()[0] == 0  # every process holds the same documents out: one says it
    drawn: list[tuple] = []
    try:
        while len(drawn) < cfg.stream_validation_docs:
            drawn.append(stream.next())
        start = copy.deepcopy(stream.state)
        held = [sum(1 for i, _, _ in drawn if i == source) for source in range(len(specs))]
        spent = [i for i, n in enumerate(held) if start["sources"][i]["pass"] > 0 or (n and not stream.holds_more(i))]
    except StopIteration:
        raise _too_few(specs, cfg, stream.ran_out, len(drawn)) from None
    except UserError as err:  # --on_bad_data stop
        raise UserError(str(err), quiet=not main) from None
    finally:
        stream.close()
    for line in stream.warnings if main else []:
        print(line, file=sys.stderr, flush=True)
    if spent:
        size = sum(1 for i, (_, done, _), _ in drawn if i == spent[0] and done == 0)  # its first pass
        raise UserError(
            f"training source {specs[spent[0]].name} holds {size} documents, all held out for validation by "
            f"--stream_validation_docs {cfg.stream_validation_docs} (none would be left to train on): give "
            f"--validation_file, or --stream_validation_docs well below {size}"
        )
    for position, n in zip(start["sources"], held, strict=True):
        position["held_out"] = n
    records = [record or {} for _, _, record in drawn]
    if any(is_packed(r) for r in records):  # a source of packed shards and records both
        raise UserError(
            "the training sources include packed shards (cloudtrain preprocess --packing), which hold no text to "
            "validate on: give --validation_file"
        )
    return records, start


def _too_few(specs: list[SourceSpec], cfg: Any, ran_out: int | None, drawn: int) -> UserError:
    """The stream ended before --stream_validation_docs documents were held out: under --mixture_exhausted stop,
    at the end of one source (the others may hold many more: "the sources hold fewer" misled; found in audit)."""
    wanted = f"--stream_validation_docs {cfg.stream_validation_docs}"
    if ran_out is not None:
        return UserError(
            f"training source {specs[ran_out].name} ran out after {drawn} documents were held out for validation, "
            f"and --mixture_exhausted stop ends the stream there, before the {wanted}: give --validation_file, "
            "fewer --stream_validation_docs, or --mixture_exhausted restart or drop"
        )
    return UserError(f"the training sources hold fewer than {wanted} documents; give --validation_file or fewer")


def _first_record(spec: SourceSpec, needed: dict[str, str]) -> dict:
    problems: list[str] = []
    found = first_record(spec, problems)
    if found is None:
        why = f" ({problems[0]}{' ...' if len(problems) > 1 else ''})" if problems else " (every file is empty)"
        raise UserError(
            f"training source {spec.name} holds no readable record{why}; give UTF-8 files of its format ({spec.format})"
        )
    path, record = found[0], MixtureStream._columns(found[1], spec)
    if unmatched := [(mine, theirs) for mine, theirs in spec.columns.items() if theirs not in found[1]]:
        mine, theirs = unmatched[0]
        raise UserError(
            f"training source {spec.name}: its columns: maps {mine} to {theirs!r}, which its records do not have "
            f"(its columns: {', '.join(found[1]) or 'none'}); name one of those"
        )
    missing = [c for c in needed if c not in record]
    if is_packed(record) or not missing:
        return record
    if manifest := read_manifest(folder_of(path)):
        raise UserError(
            f"training source {spec.name} has no column {missing[0]!r}: it holds shards cloudtrain preprocess "
            f"made for --task {manifest.get('task')} with {columns_made_with(manifest)} (columns: "
            f"{', '.join(record)}); train them with the options they were made with, or preprocess the corpus "
            "again with this run's"
        )
    raise UserError(
        f"training source {spec.name} has no column {missing[0]!r} (its columns: {', '.join(record)}); "
        f"name its column with {needed[missing[0]]} (every source), or for this source alone in a config "
        f"file: datasets: - path: {spec.name}, columns: {{{missing[0]}: <its column>}}"
    )


def check_streaming(cfg: Any) -> None:
    """What a streaming run needs that no file has to be read for."""
    t = cfg.training
    if not (t.max_steps or cfg.data.max_tokens):
        raise UserError("--streaming true needs a budget: --max_steps N or --max_tokens N (a stream has no length)")
    if t.per_device_train_batch_size == "auto":
        raise UserError("--streaming true needs a fixed --per_device_train_batch_size (auto probes stored rows)")


def stream_plan(
    raw: Any, cfg: Any, encode: Encoder, collator: Callable, made: dict
) -> tuple[StreamPlan, list[dict] | None]:
    """The training stream of a streaming run, and the held-out validation records when there is no
    validation split (None otherwise). `made`: what this run would make shards with (data.shards.made_with),
    checked against each source's preprocess manifest first."""
    d, t = cfg.data, cfg.training
    specs = raw.stream_sources
    check_shards(specs, made, d.max_length)
    held_out, start = None, None
    if "validation" not in raw:
        held_out, start = hold_out(specs, d, t.seed)
    from cloudtrain.data.mixture import initial_state

    plan = StreamPlan(
        sources=specs,
        start=start or initial_state(specs),
        seed=t.seed,
        exhausted=d.mixture_exhausted,
        on_bad=d.on_bad_data,
        buffer_docs=d.stream_buffer,
        buffer_mb=d.stream_buffer_mb,
        block_size=d.max_length,
        packing=d.packing,
        encode=encode,
        collator=collator,
        budget={
            "max_steps": t.max_steps,
            "max_tokens": d.max_tokens,
            "accumulation": t.gradient_accumulation_steps,
            "workers": d.dataloader_num_workers,
        },
        vocabulary=made["vocabulary"],
    )
    return plan, held_out
