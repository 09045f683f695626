"""Stage 2, data processing: labels to ids, tokenization, splits, collation, data loaders.

- Labels may be strings or integers; their names are kept (sorted) and become the model's id2label.
  Validation or test labels that the training data never saw are an error. A `LabelScheme` says how a
  task reads its label column: one class per row here, any number per row in cloudtrain.data.multi_labels.
- Tokenization is a batched `map` with a fast tokenizer, truncating at --max_length and padding
  nothing: the collator pads each batch to its own longest row (dynamic padding).
- The tokenized splits are cached under --cache_dir, keyed by the source data, the tokenizer and the
  options, so a second run with the same inputs reads them back instead of tokenizing again.
- With no validation split, one is carved from train (stratified by label when every class allows).
  The carve and the sample limits choose rows before tokenizing: a quick run on a large file tokenizes only
  the rows it keeps.
- Rows without a label (empty, or -1 in a ClassLabel column): none are allowed in train; a validation or
  test split with no labels at all (a GLUE-style test split, or no label column) is kept for
  predictions only (`<split>_predictions.jsonl`; validation is then carved from train); a split with
  some unlabelled rows is an error naming the count.
- Training order is a function of seed + epoch (exact resume); --group_by_length sorts each
  shuffled chunk of 50 batches by length, so batches hold similar lengths and carry less padding.
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from datasets import ClassLabel, Dataset, DatasetDict
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase
from transformers.data.data_collator import pad_without_fast_tokenizer_warning

from cloudtrain.config import DataConfig
from cloudtrain.errors import UserError


@dataclass
class ProcessedData:
    """Tokenized splits, ready for data loaders; what a task's `process` returns."""

    train: Any  # a Dataset of rows, or a streaming run's StreamPlan (cloudtrain.data.streaming)
    validation: Dataset
    test: Dataset | None  # None when the source has no labelled test split
    collator: Callable[[list[dict]], dict]
    label_names: list[str] = field(default_factory=list)  # classification: names by id
    prompts: list[str] = field(default_factory=list)  # causal LM: sampled at each evaluation
    references: list[str] = field(default_factory=list)  # SFT: the expected answer to each prompt, if known
    # Splits without labels (a GLUE-style test split): tokenized for predictions, with their texts in order
    unlabelled: dict[str, Dataset] = field(default_factory=dict)
    unlabelled_texts: dict[str, list] = field(default_factory=dict)  # token classification: each row's words
    unlabelled_pairs: dict[str, list] = field(default_factory=dict)  # sentence pairs: each row's second text
    extras: dict[str, Any] = field(default_factory=dict)  # what a task keeps beside the rows (answer windows)


class RightPadded(DataCollatorWithPadding):
    """transformers' padding collator, padding on the right whatever the tokenizer's side: a model of absolute
    positions (GPT-2) read a left-padded row at shifted positions, so its results depended on the batch."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = pad_without_fast_tokenizer_warning(
            self.tokenizer,
            features,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            padding_side="right",
            return_tensors=self.return_tensors,
        )
        for name in ("label", "label_ids"):  # the names the model's forward takes, as the parent class renames
            if name in batch:
                batch["labels"] = batch.pop(name)
        return batch


def default_cache_dir() -> Path:
    return Path(os.environ.get("CLOUDTRAIN_CACHE", Path.home() / ".cache" / "cloudtrain")) / "processed"


def with_named_columns(cfg: DataConfig, columns: list[str], names: dict[str, str]) -> DataConfig:
    """`cfg` reading a dataset family's column names (`names`: option -> column, as CoNLL's or SQuAD's) for the
    options left at their defaults, where the data (`columns`) has no column of the default's name and has the
    family's."""
    defaults = DataConfig()
    chosen: dict[str, Any] = {}
    for option, name in names.items():
        given = getattr(cfg, option)
        if given == getattr(defaults, option) and given not in columns and name in columns:
            chosen[option] = name
    return dataclasses.replace(cfg, **chosen)


def find_label_names(raw: DatasetDict, column: str, order: list[str] | None = None) -> tuple[list[str], dict]:
    """(label names, {raw label value: id}) from the training split; other splits must be a subset.

    `order` (the label names of a checkpoint's classification head) sets the ids when it holds exactly
    the data's label names; otherwise ids follow the sorted names.
    """
    names, mapping = _label_names(raw, column)
    order = [str(name).strip() for name in order] if order is not None else None  # a head saved with " sports"
    if order is not None and sorted(order) == sorted(names) and order != names:
        position = {name: i for i, name in enumerate(order)}
        return list(order), {value: position[names[i]] for value, i in mapping.items()}
    return names, mapping


def _label_names(raw: DatasetDict, column: str) -> tuple[list[str], dict]:
    train = raw["train"]
    feature = train.features[column]
    check_label_kind(train, column)
    missing = sum(is_missing(value, feature) for value in train[column])
    if missing:
        raise UserError(
            f"{missing} of {len(train)} training rows have no {column!r} value (empty, or -1 for a "
            "class label); label them or drop those rows"
        )
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        return names, {i: i for i in range(len(names))}
    values = sorted(set(train[column]))
    if not all(isinstance(v, str) for v in values):  # ids: in numeric order; 1.0 (a float column) is "1"
        names = [str(int(v)) if isinstance(v, float) and v.is_integer() else str(v) for v in values]
        return names, {value: i for i, value in enumerate(values)}
    names = sorted_names({v.strip() for v in values})  # "sports " is "sports": a stray space makes no new class
    ids = {name: i for i, name in enumerate(names)}
    return names, {value: ids[value.strip()] for value in values}


def sorted_names(found: set[str]) -> list[str]:
    """Label names in one order on every run: numbers written as text by value (a JSON file's "2" before "10", as
    the same labels read as numbers from a csv), other names as text."""
    if found and all(name.lstrip("-").isdecimal() for name in found):  # ("²" is a digit int() cannot read)
        return sorted(found, key=lambda name: (int(name), name))  # 01 and 1: one order on every run
    return sorted(found)


def holds_scalars(train: Dataset, column: str) -> bool:
    """Whether the column's first 1000 values that are there are numbers or text (datasets reads a JSON column
    mixing them as a Json feature), not lists or records."""
    values = [v for v in train[column][:1000] if v is not None]
    return bool(values) and all(isinstance(v, (str, int, float)) for v in values)


def check_label_kind(train: Dataset, column: str) -> None:
    """One class per row: lists (multi-label) and fractional numbers (regression) would otherwise become a class
    per distinct value, or fail deep in datasets."""
    feature = train.features[column]
    if not isinstance(feature, (ClassLabel, datasets.Value)) and holds_scalars(train, column):
        raise UserError(  # datasets reads a JSON column of numbers and text as a Json feature
            f'the {column!r} column mixes numbers and text (7 and "sports", say): write every label as text, or '
            "every one as a number"
        )
    if not isinstance(feature, (ClassLabel, datasets.Value)):
        raise UserError(
            f"the {column!r} column holds lists or records, not one label per row: --task multi_label trains "
            "any number of labels per text; for --task classification give each row one class name or id"
        )
    if feature.dtype.startswith("float"):
        fractional = [v for v in train[column] if v is not None and not math.isnan(v) and not float(v).is_integer()]
        if fractional:
            shown = ", ".join(f"{v:g}" for v in fractional[:3]) + (", ..." if len(fractional) > 3 else "")
            raise UserError(
                f"the {column!r} column holds fractional numbers ({shown}): --task regression learns numbers; "
                "classification needs class names or whole-number class ids"
            )


def check_texts(train: Dataset, column: str) -> None:
    """Training needs some text: a column of empty strings tokenizes to special tokens alone and trains on
    nothing; a column of lists or records would be trained on as their Python text (`['the', 'team']`)."""
    feature = train.features.get(column)
    # (a JSON column of numbers and text is a Json feature of scalars: text, as it was read before)
    typed = feature is None or isinstance(feature, (datasets.Value, ClassLabel))
    if not typed and any(v is not None for v in train[column][:1000]) and not holds_scalars(train, column):
        raise UserError(
            f"the {column!r} column holds lists or records, not text; give a column of text with --text_column "
            "(word lists are --task token_classification's input)"
        )
    if not any(text is not None and str(text).strip() for text in train[column]):
        raise UserError(
            f"the training data has no text in column {column!r} (every row is empty); "
            "give data with text, or pass --text_column <name>"
        )


def is_missing(value, feature) -> bool:
    """No label: None, NaN, an empty string, or -1 in a ClassLabel column (the datasets convention)."""
    return (
        value is None
        or (isinstance(value, float) and math.isnan(value))
        or (isinstance(value, str) and not value.strip())
        or (isinstance(feature, ClassLabel) and value == -1)
    )


def is_labelled(ds: Dataset, split: str, column: str, label2id: dict, names: list[str] | None = None) -> bool:
    """Whether an evaluation split has labels: all of its rows (True) or none (False, predictions only).

    An integer -1 that training never saw counts as no label too (GLUE test splits written to csv).
    Some rows without labels, or labels training never saw, are errors: read by name (`names`: the training
    labels' names by id) where a split numbers its own (a ClassLabel) or training did.
    """
    if column not in ds.column_names:
        return False
    feature = ds.features[column]
    values = ds[column]
    missing = sum(is_missing(v, feature) or (v == -1 and -1 not in label2id) for v in values)
    if missing == len(values):
        return False
    if missing:
        raise UserError(
            f"{missing} of {len(values)} rows of the {split} data have no {column!r} value; label them "
            f"or drop them (a {split} split with no labels at all is used for predictions only)"
        )
    if names is None:
        refuse_unseen(split, set(values) - set(label2id))
    else:
        read = label_reader(feature, label2id, names)
        refuse_unseen(split, {_label_name(feature, v) for v in set(values) if read(v) is None})
    return True


def label_reader(feature: Any, label2id: dict, names: list[str]) -> Callable[[Any], int | None]:
    """A split's raw label -> the training id of the same name (None: a name training never saw). A ClassLabel
    column numbers its own names, in its own order: its ids mean nothing to another split's."""
    by_name = {name: i for i, name in enumerate(names)}
    if isinstance(feature, ClassLabel):
        return lambda value: by_name.get(feature.int2str(value))
    return lambda value: label2id[value] if value in label2id else by_name.get(str(value).strip())


def _label_name(feature: Any, value: Any) -> str:
    return feature.int2str(value) if isinstance(feature, ClassLabel) else str(value)


def refuse_unseen(split: str, unseen: set, noun: str = "labels") -> None:
    """A UserError naming the `unseen` labels (or tags: `noun`) of an evaluation split, if there are any."""
    if unseen:
        shown = ", ".join(map(str, sorted(unseen, key=str)[:10]))
        raise UserError(
            f"the {split} data has {noun} the training data never saw: {shown}; fix the {noun} or move those rows "
            "into the training data"
        )


@dataclass
class LabelScheme:
    """How a task reads its label column: the label names by id, and per raw value what the model trains on."""

    names: list[str]
    encoder: Callable[[Dataset], Callable[[Any], Any]]  # for a split: its raw label -> a class id, or a multi-hot row
    feature: Any  # the encoded `labels` column's datasets feature
    key: list  # what the encoding depends on beyond the rows: part of the tokenized split's cache key
    labelled: Callable[[Dataset, str], bool]  # whether an evaluation split has labels (all rows) or none
    strata: Callable[[Dataset], list[int] | None]  # a class id per training row to stratify the carve by, or None


def single_label_scheme(raw: DatasetDict, column: str, order: list[str] | None = None) -> LabelScheme:
    """One class per row (`--task classification`); `order`: see `find_label_names`."""
    names, label2id = find_label_names(raw, column, order)
    if len(names) < 2:
        raise UserError(
            f"the training data has only {len(names)} distinct label(s) in {column!r}; classification needs at least 2"
        )
    return LabelScheme(
        names=names,
        encoder=lambda ds: label_reader(ds.features[column], label2id, names),
        feature=ClassLabel(names=names),
        key=names,
        labelled=lambda ds, split: is_labelled(ds, split, column, label2id, names),
        strata=lambda train: [label2id[v] for v in train[column]],
    )


def process_data(
    raw: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    seed: int,
    label_order: list[str] | None = None,
    labels: LabelScheme | None = None,
) -> ProcessedData:
    """Tokenize and encode every split, carve validation if needed, and apply the sample limits.
    `labels`: how the label column reads (default: one class per row, ids in `label_order`'s order)."""
    check_texts(raw["train"], cfg.text_column)
    scheme = labels or single_label_scheme(raw, cfg.label_column, label_order)
    chosen, unlabelled = choose_rows(raw, scheme, cfg, seed)
    splits = {split: _encode(ds, split, tokenizer, cfg, scheme) for split, ds in chosen.items()}
    return ProcessedData(
        train=splits["train"],
        validation=splits["validation"],
        test=splits.get("test"),
        collator=RightPadded(tokenizer),
        label_names=scheme.names,
        unlabelled={split: _encode(ds, split, tokenizer, cfg, None) for split, ds in unlabelled.items()},
        unlabelled_texts={split: list(ds[cfg.text_column]) for split, ds in unlabelled.items()},
        unlabelled_pairs={
            split: ["" if t is None else str(t) for t in ds[cfg.text_pair_column]]
            for split, ds in unlabelled.items()
            if cfg.text_pair_column
        },
    )


def longest_row(ds: Dataset, column: str) -> dict:
    """The row of `ds` whose `column` holds the most items (tokens), found without a Python list of the rows."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(ds.with_format("arrow")[column])
    return ds[pc.index(lengths, pc.max(lengths)).as_py()]


def longest_pair(ds: Dataset) -> dict:
    """The pair of `ds` (rows of chosen_ids and rejected_ids) whose two sides hold the most tokens together."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")
    lengths = pc.add(pc.list_value_length(table["chosen_ids"]), pc.list_value_length(table["rejected_ids"]))
    return ds[pc.index(lengths, pc.max(lengths)).as_py()]


def choose_rows(
    raw: DatasetDict, scheme: LabelScheme, cfg: DataConfig, seed: int
) -> tuple[dict[str, Dataset], dict[str, Dataset]]:
    """The rows each split trains or evaluates on, still untokenized: ({train, validation[, test]}: labelled,
    validation carved from train where the source has no labelled one; {split: rows for predictions only}).

    The rows are chosen before tokenizing (a quick run on a large file tokenizes only what it uses); the choice
    depends on the row count, the labels and the seed alone."""
    for split, ds in raw.items():
        check_label_column_case(ds, split, cfg.label_column)
    labelled = {split: scheme.labelled(ds, split) if split != "train" else True for split, ds in raw.items()}
    train, validation = raw["train"], raw.get("validation")
    if validation is None or not labelled["validation"]:
        strata = scheme.strata(train)
        train, validation = _carve_validation(train, strata, scheme.names, cfg.validation_split_percentage, seed)
    chosen = {
        "train": _limit(train, cfg.max_train_samples, seed),
        "validation": _limit(validation, cfg.max_eval_samples, seed),
    }
    if labelled.get("test"):
        chosen["test"] = _limit(raw["test"], cfg.max_eval_samples, seed)
    unlabelled = {split: first_rows(raw[split], cfg.max_eval_samples) for split in raw if not labelled[split]}
    return chosen, unlabelled


def check_label_column_case(ds: Dataset, split: str, column: str) -> None:
    """A held-out split without the label column but with one of the same name in another case (`Label`) meant it:
    it was kept for predictions only, validation carved from train, with a note saying only "no labels" (audit)."""
    if column in ds.column_names:
        return
    near = [name for name in ds.column_names if name.casefold() == column.casefold()]
    if near:
        raise UserError(
            f"the {split} data has no {column!r} column but has {near[0]!r}: rename that column to {column!r} as the "
            f"training data names it (--label_column names it in every split), or drop it to use the {split} data "
            "for predictions only"
        )


def first_rows(ds: Dataset, n: int | None) -> Dataset:
    """The first `n` rows, in order (predictions line up with the split's rows)."""
    return ds if n is None or n >= len(ds) else ds.select(range(n))


def _encode(
    ds: Dataset,
    split: str,
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    scheme: LabelScheme | None,
) -> Dataset:
    """Tokenized rows with their encoded labels, or without labels when `scheme` is None."""
    columns = [cfg.text_column] + ([cfg.text_pair_column] if cfg.text_pair_column else [])

    encode_label = scheme.encoder(ds) if scheme is not None else None

    def encode(batch: dict) -> dict:
        texts = [["" if t is None else str(t) for t in batch[c]] for c in columns]
        encoded = tokenizer(*texts, truncation=True, max_length=cfg.max_length)
        # only what the tokenizer says the model takes: a tokenizer loaded under a generic class can emit more
        # (token_type_ids), which the features below would refuse
        out = {name: encoded[name] for name in tokenizer.model_input_names}
        if encode_label is not None:
            out["labels"] = [encode_label(v) for v in batch[cfg.label_column]]
        return out

    features = datasets.Features({name: datasets.List(datasets.Value("int32")) for name in tokenizer.model_input_names})
    if scheme is not None:
        features["labels"] = scheme.feature
    key = split_cache_key(ds, tokenizer, cfg, columns, scheme.key if scheme is not None else None)
    return cached_map(ds, encode, features, cfg, split, key, f"Tokenizing {split}")


def cached_map(
    ds: Dataset,
    encode: Callable,
    features: datasets.Features,
    cfg: DataConfig,
    prefix: str,
    key: str,
    desc: str,
    **options: Any,
) -> Dataset:
    """`ds.map(encode)` (batched, replacing every column) into <cache dir>/<prefix>-<key>.arrow: `key` hashes what
    the result depends on, so every process and every later run with the same inputs reuses the file."""
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    return ds.map(
        encode,
        batched=True,
        remove_columns=ds.column_names,
        features=features,
        cache_file_name=str(cache_dir / f"{prefix}-{key}.arrow"),
        new_fingerprint=key,
        desc=desc,
        **options,
    )


def split_cache_key(
    ds: Dataset, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, columns: list, names: list | None
) -> str:
    """Same source rows + same tokenizer + same options -> same key -> cached result reused."""
    inputs = list(tokenizer.model_input_names)  # the columns kept: two tokenizers may differ only in these
    # v2: labels read by name in every split (a split's own ClassLabel ids were taken as training's in v1)
    return cache_key(ds, tokenizer, cfg.max_length, columns, cfg.label_column, names, inputs, "v2")


def cache_key(ds: Dataset, tokenizer: PreTrainedTokenizerBase, *options) -> str:
    """A key for a tokenized split: the source rows' fingerprint, the tokenizer and the options that shape it."""
    # The serialized tokenizer minus its truncation/padding state, which changes once it has been called; the
    # sides it cuts and pads on come from the tokenizer's config (a left-truncating copy cut other tokens)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None), spec.pop("padding", None)
    sides = {"truncation_side": tokenizer.truncation_side, "padding_side": tokenizer.padding_side}
    parts = [ds._fingerprint, spec, sides, *options]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _carve_validation(
    train: Dataset, ids: list[int] | None, names: list[str], percentage: float, seed: int
) -> tuple[Dataset, Dataset]:
    """Stratified by label (`ids`, one per row) when every class has members for both sides, else (or with no
    `ids`) a plain random split. The split is drawn on the row numbers, so `train` can be untokenized."""
    n_val = math.ceil(len(train) * percentage / 100)
    stratify = False
    if ids is not None:
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=len(names))
        present = int((counts > 0).sum())
        stratify = counts[counts > 0].min() >= 2 and present <= n_val <= len(train) - present
    if n_val >= len(train):
        raise UserError(
            f"the training data has only {len(train)} rows, too few to carve a validation split; give --validation_file"
        )
    features = datasets.Features({"row": datasets.Value("int64"), "labels": ClassLabel(names=names)})
    strata = ids if ids is not None else [0] * len(train)
    rows = Dataset.from_dict({"row": list(range(len(train))), "labels": strata}, features=features)
    parts = rows.train_test_split(test_size=n_val, seed=seed, stratify_by_column="labels" if stratify else None)
    return train.select(parts["train"]["row"]), train.select(parts["test"]["row"])


def _limit(ds: Dataset, n: int | None, seed: int) -> Dataset:
    if n is None or n >= len(ds):
        return ds
    return ds.shuffle(seed=seed).select(range(n))


class EpochShuffleSampler(torch.utils.data.Sampler):
    """A fresh permutation per epoch, drawn from seed + epoch alone: the global order of the stored rows.

    Every process draws the same order and accelerate shards it by micro-batch (micro-batch b of the order
    to process b % processes, as a stream's), so a step's rows do not depend on the process count as long
    as the global batch does not change; a resumed run rebuilds any epoch's order without sampler state.
    `step_rows` (the global batch in rows) completes the epoch's last step with the epoch's first rows, so
    that accelerate never has to even out the processes' shares (which would depend on their count).
    """

    def __init__(self, num_examples: int, seed: int, step_rows: int | None = None):
        self.num_examples, self.seed, self.epoch, self.step_rows = num_examples, seed, 0, step_rows

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(self._whole_steps(torch.randperm(self.num_examples, generator=generator).tolist()))

    def __len__(self) -> int:
        short = -self.num_examples % self.step_rows if self.step_rows and self.num_examples else 0
        return self.num_examples + short

    def _whole_steps(self, order: list[int]) -> list[int]:
        return whole_steps(order, self.step_rows)


def whole_steps(order: list[int], step_rows: int | None) -> list[int]:
    """`order` completed to whole global steps of `step_rows` with its own first rows (again, for an epoch
    shorter than a step)."""
    short = -len(order) % step_rows if step_rows and order else 0
    return order + (order * (short // len(order) + 1))[:short] if short else order


class LengthGroupedSampler(EpochShuffleSampler):
    """EpochShuffleSampler's permutation, cut into chunks of `batch_size * chunk_batches` examples, each
    sorted by length (longest first) and then split into batches whose order is shuffled again.

    Still a function of seed + epoch alone, so resuming and accelerate's sharding work unchanged.
    """

    def __init__(
        self, lengths: list[int], batch_size: int, seed: int, chunk_batches: int = 50, step_rows: int | None = None
    ):
        super().__init__(len(lengths), seed, step_rows)
        self.lengths, self.batch_size, self.chunk = torch.tensor(lengths), batch_size, batch_size * chunk_batches

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_examples, generator=generator)
        chunks = [
            chunk[torch.argsort(self.lengths[chunk], descending=True, stable=True)] for chunk in order.split(self.chunk)
        ]
        batches = torch.cat(chunks).split(self.batch_size)
        # keep a short last batch last: every other batch is full, as with plain shuffling
        full, last = (batches[:-1], batches[-1:]) if len(batches[-1]) < self.batch_size else (batches, ())
        shuffled = [full[i] for i in torch.randperm(len(full), generator=generator).tolist()]
        return iter(self._whole_steps(torch.cat(shuffled + list(last)).tolist()) if batches else [])


def train_dataloader(
    data: ProcessedData, batch_size: int, seed: int, cfg: DataConfig | None = None, step_rows: int | None = None
) -> DataLoader:
    """Shuffled per epoch (EpochShuffleSampler, or LengthGroupedSampler with --group_by_length);
    call `set_epoch` before iterating. `step_rows`: the global batch (rows per optimizer step over all
    processes), which makes the order the same at any process count (see EpochShuffleSampler).
    A streaming run's rows come from its StreamPlan's loader instead."""
    from cloudtrain.data.streaming import StreamPlan

    cfg = cfg or DataConfig()
    if isinstance(data.train, StreamPlan):  # host batches, pinned as a map-style loader's: the trainer places both
        return data.train.loader(batch_size, loader_options(cfg)["pin_memory"])  # type: ignore[return-value]
    sampler: Sampler[int]
    own = getattr(data.train, "epoch_sampler", None)  # a dataset's own order (text-to-image's aspect buckets)
    order = own(seed, step_rows or batch_size) if own else None
    if order is not None:
        sampler = order
    elif cfg.group_by_length:
        lengths = [len(ids) for ids in data.train["input_ids"]]
        sampler = LengthGroupedSampler(lengths, batch_size, seed, step_rows=step_rows)
    else:
        sampler = EpochShuffleSampler(len(data.train), seed, step_rows)
    return DataLoader(
        data.train, batch_size=batch_size, sampler=sampler, collate_fn=data.collator, **loader_options(cfg)
    )


def eval_dataloader(ds: Dataset, data: ProcessedData, batch_size: int, cfg: DataConfig | None = None) -> DataLoader:
    return DataLoader(
        ds, batch_size=batch_size, shuffle=False, collate_fn=data.collator, **loader_options(cfg or DataConfig())
    )


def loader_options(cfg: DataConfig) -> dict:
    """Workers stay alive across epochs; pinning only helps (and only works) with a GPU: a non-blocking copy
    from pageable memory still makes the host wait for it. Each loader draws its workers' base seed from its
    own generator: drawn from the global one, a loader started after a resume would shift the dropout masks
    of every step that follows."""
    workers = cfg.dataloader_num_workers
    return {
        "num_workers": workers,
        "persistent_workers": workers > 0,
        "generator": torch.Generator(),
        "pin_memory": cfg.dataloader_pin_memory and torch.cuda.is_available(),
        "worker_init_fn": leave_stops_to_the_run if workers else None,
    }


def leave_stops_to_the_run(worker_id: int) -> None:
    """A loader worker leaves Ctrl-C and a stop's SIGTERM to the training process, which then saves a checkpoint
    with the workers still needed: a terminal sends Ctrl-C, torchrun's agent its SIGTERM, to the whole process
    group, SLURM to every process of the job. The worker ends when the training process ends it (multiprocessing's
    SIGTERM), or once that process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _only_thread():  # (spawned workers run BLAS threads already, which a SIGTERM could reach)
        with contextlib.suppress(OSError):  # out of the group the agent signals, at least
            os.setpgrp()
        return
    # blocked in this thread and the threads started from here on (and processes the worker starts: SIGKILL ends
    # those); taken by one thread, which knows the sender
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = multiprocessing.parent_process()  # the training process (forkserver's workers have another parent)
    run = parent.pid if parent else os.getppid()
    threading.Thread(target=_end_at_the_runs_sigterm, args=(run, os.getppid()), daemon=True).start()


def _only_thread() -> bool:
    try:
        return hasattr(signal, "sigtimedwait") and len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no /proc (macOS)
        return False


def _end_at_the_runs_sigterm(run: int, parent: int) -> None:
    """End the worker at the training process's SIGTERM, with status 0 as torch's own handler does (the training
    process does not take it for a worker's failure), or once the worker is orphaned."""
    while os.getppid() == parent:
        taken = signal.sigtimedwait({signal.SIGTERM}, 1.0)
        if taken is not None and taken.si_pid == run:
            break
    os._exit(0)
