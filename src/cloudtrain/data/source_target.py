"""The rows of `--task seq2seq`: a source text and the target text an encoder-decoder learns to write from it.

- Columns: --text_column (the source) and --label_column (the target). A dataset family's names are read without
  options where the defaults are absent: XSum's `document`/`summary`, CNN/DailyMail's `article`/`highlights`, or
  `source`/`target`. WMT's `translation` column of {language: text} records is read into one column per language
  (named by its key), --source_lang and --target_lang saying which.
- Sources get --source_prefix in front (T5's "summarize: ") and are cut at --max_length tokens; targets are cut at
  --max_target_length and end with the tokenizer's EOS (added where the tokenizer adds none), so the model learns
  where to stop.
- A target is one text per row, or a list of references (JSON `"target": ["ref a", "ref b"]`), each a non-empty
  text. Training takes every reference as its own pair, the source repeated (after the validation carve, so a
  carved row's references never train); evaluation rows keep them all (`ProcessedData.extras["references"]`, by
  the `row` id the collator passes on) to be scored against, and their loss is the first reference's.
- Every training row needs a target. An evaluation split with no target at all (or no target column) is for
  predictions only (`<split>_predictions.jsonl`); one with some rows missing is an error naming the count.
- The collator pads sources with the pad token and targets with -100 (ignored by the loss), to each batch's longest.
"""

import datasets
import torch
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import (
    LabelScheme,
    ProcessedData,
    cached_map,
    check_texts,
    choose_rows,
    is_missing,
    split_cache_key,
)
from cloudtrain.errors import UserError

LISTS = (datasets.List, datasets.LargeList, datasets.Sequence, list)  # a column of several references per row
SPLIT_IDS = 1 << 40  # the row ids of evaluation split k start at k * SPLIT_IDS: unique over the run's splits
REFERENCE_FIX = "give each row one target text, or a list of non-empty reference texts"
IGNORED = -100  # a padded target position: cross-entropy skips it
# (--text_column, --label_column) of the dataset families read without options, in the order they are tried
FAMILIES = (("document", "summary"), ("article", "highlights"), ("source", "target"))
TRANSLATION = "translation"  # WMT's column: one {language: text} record per row


def family_columns(columns: list[str]) -> dict[str, str]:
    """{option: column} of the first family whose two columns the data has (none: {})."""
    for source, target in FAMILIES:
        if source in columns and target in columns:
            return {"text_column": source, "label_column": target}
    return {}


def check_family(columns: list[str], cfg: DataConfig) -> None:
    """One column of a family without its partner, whose option is left at a default the data lacks: the refusal
    names the partner and its option (data of `source` alone was told "column 'text' is not in the train data ...;
    pass --text_column", of the column it has; found in audit)."""
    if family_columns(columns):  # a whole family is read (a metadata column named `source` beside it; review)
        return
    defaults = DataConfig()
    for source, target in FAMILIES:
        for have, missing, option, what in ((source, target, "label_column", "target"), (target, source,
                                            "text_column", "source")):  # fmt: skip
            default = getattr(defaults, option)
            unread = getattr(cfg, option) == default and default not in columns  # the option would find nothing
            if have in columns and missing not in columns and unread:
                raise UserError(
                    f"the training data has a {have!r} column but no {missing!r} beside it (its columns: "
                    f"{', '.join(columns)}); add the {what} column {missing!r}, or name it with --{option} <name>"
                )


def check_translations(train: Dataset, cfg: DataConfig) -> None:
    """--source_lang and --target_lang against the training data's `translation` column, or that column named
    where the run reads no other (each mistake one line, before anything is tokenized)."""
    columns, source, target = train.column_names, cfg.source_lang, cfg.target_lang
    if not (source or target):
        if TRANSLATION in columns and cfg.text_column not in columns and not family_columns(columns):
            raise UserError(
                f"the training data holds {TRANSLATION!r} records of {', '.join(_languages(train))}: pass "
                "--source_lang and --target_lang (or name text columns with --text_column and --label_column)"
            )
        return
    if TRANSLATION not in columns:
        raise UserError(
            f"--source_lang and --target_lang read a {TRANSLATION!r} column of {{language: text}} records, which the "
            f"training data has not (its columns: {', '.join(columns)}); name the source and target columns with "
            "--text_column and --label_column instead"
        )
    defaults = DataConfig()
    given = [f"--{name}" for name in ("text_column", "label_column") if getattr(cfg, name) != getattr(defaults, name)]
    if given:
        raise UserError(f"--source_lang and --target_lang name the source and the target: drop {' and '.join(given)}")
    languages = _languages(train)
    for flag, language in (("--source_lang", source), ("--target_lang", target)):
        if language not in languages:
            named = f" {language}" if language else ""
            raise UserError(
                f"{flag}{named}: the {TRANSLATION!r} column holds {', '.join(languages)}; pass {flag} <one of them>"
            )
    if source == target:
        raise UserError(f"--source_lang and --target_lang are both {source}: a translation needs two languages")


def with_translations(raw: DatasetDict, cfg: DataConfig) -> DatasetDict:
    """The splits with their `translation` records read into one text column per language (named by its key), for
    --source_lang and --target_lang (checked by `check_translations`); as they are without those options."""
    source, target = cfg.source_lang, cfg.target_lang
    if not (source and target):
        return raw

    def split_languages(batch: dict) -> dict:
        return {lang: [(record or {}).get(lang) for record in batch[TRANSLATION]] for lang in (source, target)}

    return DatasetDict(
        {
            split: ds.map(split_languages, batched=True, remove_columns=[TRANSLATION], desc=f"Reading {split} pairs")
            if TRANSLATION in ds.column_names
            else ds
            for split, ds in raw.items()
        }
    )


def _languages(train: Dataset) -> list[str]:
    """The language keys of the `translation` column: a datasets Translation feature's, or a struct's fields."""
    feature = train.features[TRANSLATION]
    if isinstance(feature, datasets.Translation):
        return list(feature.languages)
    if isinstance(feature, dict):  # JSON objects: one field per key met in the file
        return sorted(feature)
    raise UserError(
        f"the {TRANSLATION!r} column holds {feature}, not {{language: text}} records; give those, or name the "
        "source and target columns with --text_column and --label_column"
    )


def target_scheme(column: str) -> LabelScheme:
    """The target column as the row chooser reads it: a text per row; no classes to stratify the carve by."""

    def labelled(ds: Dataset, split: str) -> bool:
        if column not in ds.column_names:
            return False
        missing = count_missing(ds, column)
        if missing == len(ds):
            return False
        if missing:
            raise UserError(
                f"{missing} of {len(ds)} rows of the {split} data have no {column!r} text; give each a target or "
                f"drop those rows (a {split} split with no targets at all is used for predictions only)"
            )
        return True

    return LabelScheme(
        names=[column],
        encoder=lambda ds: str,
        feature=datasets.Value("string"),
        key=[column, "seq2seq"],
        labelled=labelled,
        strata=lambda train: None,
    )


def count_missing(ds: Dataset, column: str) -> int:
    return sum(is_missing(value, None) for value in ds[column])


def process_source_target(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, seed: int
) -> ProcessedData:
    """Tokenized (source, target) rows for every split; unlabelled splits keep their sources for predictions."""
    check_texts(raw["train"], cfg.text_column)
    for split, ds in raw.items():
        check_one_text(ds, split, cfg.text_column, "source")
        check_references(ds, split, cfg.label_column)
    missing = count_missing(raw["train"], cfg.label_column)
    if missing:
        raise UserError(
            f"{missing} of {len(raw['train'])} training rows have no {cfg.label_column!r} text; give each a target "
            "or drop those rows"
        )
    chosen, unlabelled = choose_rows(raw, target_scheme(cfg.label_column), cfg, seed)
    extras: dict = {"references": {}}  # evaluation rows with several references: {row id: their texts}
    if holds_lists(chosen["train"], cfg.label_column):
        extras["training_rows"] = len(chosen["train"])  # before one pair per reference, for the data line
    evaluated = {
        split: _with_references(_encode(ds, split, tokenizer, cfg, True), ds, k, tokenizer, cfg, extras)
        for k, (split, ds) in enumerate(chosen.items(), start=1)
        if split != "train"
    }
    return ProcessedData(
        train=_encode(one_per_reference(chosen["train"], cfg.label_column), "train", tokenizer, cfg, True),
        validation=evaluated["validation"],
        test=evaluated.get("test"),
        collator=SourceTargetCollator(int(tokenizer.pad_token_id)),
        unlabelled={split: _encode(ds, split, tokenizer, cfg, False) for split, ds in unlabelled.items()},
        unlabelled_texts={split: [_text(t) for t in ds[cfg.text_column]] for split, ds in unlabelled.items()},
        extras=extras,
    )


def holds_lists(ds: Dataset, column: str) -> bool:
    """Whether a split's target column holds a list of references per row."""
    return isinstance(ds.features.get(column), LISTS)


def check_references(ds: Dataset, split: str, column: str) -> None:
    """A target is one text per row, or a non-empty list of non-empty texts (a missing target, None, is counted
    apart); the first row that is neither is named, before anything is tokenized or loaded."""
    if not holds_lists(ds, column):
        feature = ds.features.get(column)  # none: an unlabelled split, for predictions
        values = ds[column] if feature is not None and not isinstance(feature, datasets.Value) else []
        if any(isinstance(v, list) for v in values) and all(
            isinstance(v, (str, list)) for v in values if v is not None
        ):
            raise UserError(  # a JSON column of both: datasets reads it as a Json feature
                f"the {split} data's {column!r} column mixes single target texts and lists of references; write "
                'every row\'s target as a list (["text"] for one reference), or every one as a single text'
            )
        check_one_text(ds, split, column, "target", REFERENCE_FIX)  # a record: refused as before
        return
    for i, value in enumerate(ds[column]):
        if value is not None and (problem := _reference_problem(value)):
            raise UserError(
                f"row {i + 1} of {len(ds)} of the {split} data's {column!r} column holds {problem}; {REFERENCE_FIX}"
            )


def _reference_problem(references: list) -> str:
    """What is wrong with one row's list of references ("" for nothing)."""
    shown = str(references)[:60]
    if not references:
        return "an empty list of references"
    if not all(isinstance(text, str) for text in references):
        kinds = sorted({type(text).__name__ for text in references if not isinstance(text, str)})
        return f"a list of {', '.join(kinds)} ({shown}), not of texts"
    if any(not text.strip() for text in references):
        return f"an empty reference text ({shown})"
    return ""


def one_per_reference(ds: Dataset, column: str) -> Dataset:
    """Each row once per reference, that reference its target (the common practice: every reference is a way to
    write the target the model learns from); a split of one text per row as it is."""
    if not holds_lists(ds, column):
        return ds

    def spread(batch: dict) -> dict:
        counts = [len(references) for references in batch[column]]
        out = {
            name: [value for value, k in zip(values, counts, strict=True) for _ in range(k)]
            for name, values in batch.items()
            if name != column
        }
        return {**out, column: [text for references in batch[column] for text in references]}

    features = datasets.Features({**ds.features, column: datasets.Value("string")})
    return ds.map(spread, batched=True, remove_columns=ds.column_names, features=features, desc="Pairs per reference")


def _with_references(
    encoded: Dataset, ds: Dataset, k: int, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, extras: dict
) -> Dataset:
    """An evaluation split of several references per row: its rows numbered (`row`, unique over the splits) and
    every row's references kept in `extras`, as tokenized and decoded, so cut where a single target is; else as
    it is."""
    if not holds_lists(ds, cfg.label_column):
        return encoded
    rows = ds[cfg.label_column]
    flat = [text for references in rows for text in references]
    ids = tokenizer(text_target=flat, truncation=True, max_length=_room(tokenizer, cfg))["input_ids"]
    texts = iter(text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True))
    first = k * SPLIT_IDS
    for i, references in enumerate(rows):
        extras["references"][first + i] = [next(texts) for _ in references]
    return encoded.add_column("row", list(range(first, first + len(rows))))


def check_one_text(
    ds: Dataset,
    split: str,
    column: str,
    what: str,
    fix: str = "give one text per row",
) -> None:
    """A source (a question, a context; a target not of references) is one text (or a number) per row: a list or a
    record would be read as its Python spelling, "['a', 'b']", and trained and scored so (`check_references` reads
    a target's list as its references)."""
    feature = ds.features.get(column)
    if feature is None or isinstance(feature, datasets.Value):
        return
    first = next((v for v in ds[column] if v is not None), None)
    kind = "lists" if isinstance(first, (list, tuple)) else "records"
    raise UserError(
        f"the {split} data's {column!r} column holds {kind} ({str(first)[:60]}), not one {what} text per row; {fix}"
    )


def _text(value) -> str:
    return "" if value is None else str(value)


def _first(value) -> str:
    """A target's text: its first reference where it has several (the loss is computed against that one)."""
    return _text(value[0] if isinstance(value, list) else value)


def _room(tokenizer: PreTrainedTokenizerBase, cfg: DataConfig) -> int:
    """The tokens a target's text may take: --max_target_length, less EOS where the task adds it."""
    return cfg.max_target_length - (0 if adds_eos(tokenizer) else 1)


def adds_eos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer ends an encoded text with EOS itself (T5's and BART's do; a generic one may not)."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[-1] == tokenizer.eos_token_id


def _encode(ds: Dataset, split: str, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, targets: bool) -> Dataset:
    """input_ids and attention_mask of the prefixed sources; with `targets`, labels: the target's ids, EOS last."""
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token, so a target could not end; give a tokenizer with one")
    own_eos, room = adds_eos(tokenizer), _room(tokenizer, cfg)

    def encode(batch: dict) -> dict:
        sources = [cfg.source_prefix + _text(t) for t in batch[cfg.text_column]]
        encoded = tokenizer(sources, truncation=True, max_length=cfg.max_length)
        out = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if targets:
            texts = [_first(t) for t in batch[cfg.label_column]]
            labels = tokenizer(text_target=texts, truncation=True, max_length=room)["input_ids"]
            out["labels"] = labels if own_eos else [ids + [tokenizer.eos_token_id] for ids in labels]
        return out

    columns = ["input_ids", "attention_mask"] + (["labels"] if targets else [])
    features = datasets.Features({name: datasets.List(datasets.Value("int32")) for name in columns})
    options = [cfg.max_target_length, cfg.source_prefix, targets, tokenizer.eos_token_id, "seq2seq-v1"]
    key = split_cache_key(ds, tokenizer, cfg, [cfg.text_column], options)
    return cached_map(ds, encode, features, cfg, split, key, f"Tokenizing {split}")


class SourceTargetCollator:
    """A batch of rows padded to its longest source (pad token, mask 0) and longest target (-100)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = {
            "input_ids": _pad([row["input_ids"] for row in rows], self.pad_token_id),
            "attention_mask": _pad([row["attention_mask"] for row in rows], 0),
        }
        if "labels" in rows[0]:
            batch["labels"] = _pad([row["labels"] for row in rows], IGNORED)
        if "row" in rows[0]:  # an evaluation row of several references: evaluation looks them up by it
            batch["row"] = torch.tensor([row["row"] for row in rows], dtype=torch.long)
        return batch


def _pad(rows: list, value: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def shift_right(labels: torch.Tensor, start_id: int, pad_id: int) -> torch.Tensor:
    """The decoder's inputs for `labels`: the start token, then each target token but the last (-100 as pad)."""
    inputs = torch.full_like(labels, pad_id)
    inputs[:, 0] = start_id
    inputs[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == IGNORED, pad_id)
    return inputs
