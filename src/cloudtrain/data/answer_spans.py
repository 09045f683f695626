"""The data of `--task question_answering`: a question, a context, and where in the context the answer is.

Rows are SQuAD's: `question`, `context` and `answers` ({"text": [...], "answer_start": [...]}, character offsets into
the context), read without options where --text_column/--text_pair_column/--label_column are left at their defaults;
an answer may also be a plain text (a CSV column), found at its first place in the context. A row whose answers are
empty has none (SQuAD 2.0): the model then learns to point at the first token, and evaluation may answer "".

A context longer than --max_length tokens (with its question) is read in overlapping windows, --doc_stride tokens of
overlap: each window is one training row, whose targets are the answer's first and last tokens when the answer lies
in it, else the first token. Evaluation and prediction windows carry a `window` id; the windows' character offsets
and their examples' contexts and answers stay beside the rows (ProcessedData.extras), where the task's evaluation
finds them to turn the scores back into text. An evaluation split without the answer column is for predictions.
"""

from collections.abc import Callable
from typing import Any

import datasets
import numpy as np
from datasets import Dataset, DatasetDict
from transformers import PreTrainedTokenizerBase

from cloudtrain.answers import Window
from cloudtrain.config import DataConfig
from cloudtrain.data.processing import (
    LabelScheme,
    ProcessedData,
    RightPadded,
    cached_map,
    choose_rows,
    split_cache_key,
)
from cloudtrain.data.source_target import check_one_text
from cloudtrain.errors import UserError

SQUAD_COLUMNS = {"text_column": "question", "text_pair_column": "context", "label_column": "answers"}
SPLIT_IDS = 1 << 40  # window and example ids of split k start at k * SPLIT_IDS: unique over the run's splits


def process_answer_spans(
    raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, seed: int
) -> ProcessedData:
    """Training windows with their targets; evaluation windows with ids, and the windows and examples beside them."""
    for split, ds in raw.items():
        check_one_text(ds, split, cfg.text_column, "question", "give one question per row")
        check_one_text(ds, split, cfg.text_pair_column or "", "context", "give one context per row")
    answered = {split for split, ds in raw.items() if cfg.label_column in ds.column_names}
    allow_none = any(not answers for answers in read_answers(raw["train"], cfg))  # also checks every answer's place
    for split in answered - {"train"}:
        read_answers(raw[split], cfg)  # before rows are chosen: a refusal names the row of the file
    scheme = LabelScheme(
        names=["answer"],  # no classes: a span
        encoder=lambda ds: lambda value: value,  # unused: the windows' targets come from read_answers
        feature=None,
        key=["answer-spans"],
        labelled=lambda ds, split: split in answered,
        strata=lambda train: None,
    )
    for split, ds in raw.items():
        where = f"row {{}} of the {split} data".format  # question i as the file numbers it
        check_questions(ds[cfg.text_column], tokenizer, cfg.max_length, cfg.doc_stride, where)
    chosen, unlabelled = choose_rows(raw, scheme, cfg, seed)  # a split may be in both: validation carved from train
    extras: dict[str, Any] = {"windows": {}, "examples": {}, "allow_none": allow_none}
    ids = iter(range(0, (len(chosen) + len(unlabelled)) * SPLIT_IDS, SPLIT_IDS))  # each split's first id
    answers = {split: read_answers(ds, cfg) for split, ds in chosen.items()}
    splits = {
        split: _encode(ds, split, tokenizer, cfg, answers[split], next(ids), extras if split != "train" else None)
        for split, ds in chosen.items()
    }
    train = splits["train"]  # answers that lie whole in no window train as "no answer": said (describe_data)
    whole = {e for e, start in zip(train["example"], train["start_positions"], strict=True) if start > 0}
    extras["cut_answers"] = (sum(bool(a) and i not in whole for i, a in enumerate(answers["train"])), len(whole))
    splits["train"] = train.remove_columns("example")
    predicted = {split: _encode(ds, split, tokenizer, cfg, None, next(ids), extras) for split, ds in unlabelled.items()}
    return ProcessedData(
        train=splits["train"],
        validation=splits["validation"],
        test=splits.get("test"),
        collator=RightPadded(tokenizer),
        unlabelled=predicted,
        unlabelled_texts={split: [as_text(q) for q in ds[cfg.text_column]] for split, ds in unlabelled.items()},
        extras=extras,
    )


def read_answers(ds: Dataset, cfg: DataConfig) -> list[list[tuple[str, int]]]:
    """Each row's answers as (text, first character in the context); a UserError names a row whose answer is not in
    its context where it says."""
    rows = []
    for i, (value, context) in enumerate(zip(ds[cfg.label_column], ds[cfg.text_pair_column], strict=True)):
        found, context = [], as_text(context)
        answers = _answers(value, cfg.label_column)
        if not context and answers:
            raise UserError(
                f"row {i} of the {ds.split or 'given'} data has an answer but an empty {cfg.text_pair_column!r} "
                "column; give each question its context, or drop the row"
            )
        for text, start in answers:
            start = context.find(text) if start is None else start
            if start < 0 or context[start : start + len(text)] != text:
                where = "in its context" if start < 0 else f"at character {start} of its context"
                raise UserError(
                    f"row {i} of the {ds.split or 'given'} data: the answer {text[:40]!r} is not {where}; an answer is "
                    "a span of the context (SQuAD's answer_start counts characters)"
                )
            found.append((text, start))
        rows.append(found)
    return rows


def _answers(value: Any, column: str) -> list[tuple[str, int | None]]:
    """SQuAD's {"text": [...], "answer_start": [...]}, a list of such records (or of one answer each), or one
    answer's text; an empty text is no answer."""
    found: list[tuple[Any, Any]]
    if isinstance(value, dict) and "text" in value and not isinstance(value["text"], list):  # one answer's record
        value = {"text": [value["text"]], "answer_start": [value.get("answer_start")]}
    if value is None or isinstance(value, str):
        found = [(value, None)]
    elif isinstance(value, int) and not isinstance(value, bool):  # a year, 1834: a jsonl number (a float's digits
        # need not be the context's: 2.0 for "2.0" read as "2"; found in review)
        found = [(as_text(value), None)]
    elif isinstance(value, dict) and isinstance(value.get("text"), list):
        starts = value.get("answer_start")
        starts = [starts] if isinstance(starts, (int, float, str)) else starts or [None] * len(value["text"])
        if len(starts) != len(value["text"]):
            raise UserError(
                f"the {column!r} column has a row with {len(value['text'])} answer texts and {len(starts)} "
                "answer_start values; give one start per answer"
            )
        found = list(zip(value["text"], starts, strict=True))
    elif isinstance(value, list) and all(isinstance(v, dict) and "text" in v for v in value):
        found = [(v["text"], v.get("answer_start")) for v in value]
    else:
        raise UserError(
            f"the {column!r} column holds {type(value).__name__} values: --task question_answering reads SQuAD's "
            '{"text": [...], "answer_start": [...]} or an answer\'s text'
        )
    return [(as_text(t), _start(s, column)) for t, s in found if t is not None and as_text(t).strip()]


def _start(value: Any, column: str) -> int | None:
    """An answer_start as a character offset (None: find the text in the context)."""
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserError(
            f"the {column!r} column has an answer_start {value!r} that is no character offset; give the number of "
            "characters before the answer in its context"
        ) from None


def as_text(value: Any) -> str:
    """A question, context or answer as the text it is read as everywhere (windows, answers, saved predictions, and
    predict): a number read from the data as its digits, None as "". A context kept as an int was sliced as a text
    later (found in audit)."""
    return "" if value is None else str(value)


def windows_of(tokenizer: PreTrainedTokenizerBase, questions: list, contexts: list, max_length: int, stride: int):
    """Each question with its context, cut into windows of `max_length` tokens that overlap by `stride` (only the
    context is cut: `check_questions` made sure it has room); a fast tokenizer's encoding with offsets."""
    return tokenizer(
        [as_text(q).lstrip() for q in questions],  # leading spaces only shift a question's tokens
        [as_text(c) for c in contexts],
        truncation="only_second",
        max_length=max_length,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )


def context_offsets(encoded, window: int) -> list[tuple[int, int]]:
    """A window's character offsets into its context, (-1, -1) for a token outside it (question, special tokens)."""
    parts = encoded.sequence_ids(window)
    return [
        pair if part == 1 else (-1, -1) for pair, part in zip(encoded["offset_mapping"][window], parts, strict=True)
    ]


def check_questions(
    questions: list, tokenizer: PreTrainedTokenizerBase, max_length: int, stride: int, where: Callable[[int], str]
) -> None:
    """Every question leaves its context more room than `stride` in `max_length` tokens (the windows move by the
    difference; the tokenizers library panics deep inside otherwise); a UserError names the first that does not
    (`where`: question i as the user knows it)."""
    texts = [as_text(q).lstrip() for q in questions]
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        n, room = len(ids), max_length - specials - len(ids)
        if room <= stride:
            raise UserError(
                f"{where(i)}: the question is {n} tokens, which leaves {room} of --max_length {max_length} for its "
                f"context, not more than --doc_stride {stride}; raise --max_length, lower --doc_stride or shorten "
                "the question"
            )


def context_room(tokenizer: PreTrainedTokenizerBase, question: Any, max_length: int) -> int:
    """How many of `max_length` tokens a window leaves its context, after the question and the special tokens."""
    n = len(tokenizer(as_text(question).lstrip(), add_special_tokens=False)["input_ids"])
    return max_length - tokenizer.num_special_tokens_to_add(pair=True) - n


def _encode(
    ds: Dataset,
    split: str,
    tokenizer: PreTrainedTokenizerBase,
    cfg: DataConfig,
    answers: list[list[tuple[str, int]]] | None,
    first_id: int,
    extras: dict | None,
) -> Dataset:
    """The windows of `ds`: targets where `answers` are given; for evaluation (`extras`), window ids, with the
    windows and examples put in `extras`."""
    question, context = cfg.text_column, cfg.text_pair_column
    assert context is not None  # the task resolved it

    def encode(batch: dict, indices: list[int]) -> dict:
        encoded = windows_of(tokenizer, batch[question], batch[context], cfg.max_length, cfg.doc_stride)
        out = {name: encoded[name] for name in tokenizer.model_input_names}
        examples = encoded["overflow_to_sample_mapping"]
        offsets = [context_offsets(encoded, w) for w in range(len(examples))]
        if answers is not None:
            targets = [_targets(row, answers[indices[e]]) for row, e in zip(offsets, examples, strict=True)]
            out["start_positions"], out["end_positions"] = [t[0] for t in targets], [t[1] for t in targets]
        out["example"] = [indices[e] for e in examples]  # the split's row: ids are made unique after the cache
        if extras is not None:
            out["offsets"] = offsets
        return out

    features = datasets.Features({name: datasets.List(datasets.Value("int32")) for name in tokenizer.model_input_names})
    if answers is not None:
        features["start_positions"] = features["end_positions"] = datasets.Value("int32")
    features["example"] = datasets.Value("int64")
    if extras is not None:
        features["offsets"] = datasets.List(datasets.List(datasets.Value("int32")))
    key = split_cache_key(ds, tokenizer, cfg, [question, context], ["answer-spans-v2", cfg.doc_stride, extras is None])
    windows = cached_map(ds, encode, features, cfg, split, key, f"Tokenizing {split}", with_indices=True)
    if extras is None:
        return windows
    for w, (example, offsets) in enumerate(zip(windows["example"], windows["offsets"], strict=True)):
        extras["windows"][first_id + w] = Window(first_id + example, np.asarray(offsets, dtype=np.int32))
    for i, text in enumerate(ds[context]):
        extras["examples"][first_id + i] = (as_text(text), [a for a, _ in answers[i]] if answers is not None else [])
    ids = list(range(first_id, first_id + len(windows)))
    return windows.remove_columns(["example", "offsets"]).add_column("window", ids)


def _targets(offsets: list, answers: list[tuple[str, int]]) -> tuple[int, int]:
    """The first and last token of the first answer where it lies whole in this window, else (0, 0)."""
    if not answers:
        return 0, 0
    text, start = answers[0]
    end = start + len(text)
    inside = [i for i, (a, b) in enumerate(offsets) if a >= 0]
    if not inside or offsets[inside[0]][0] > start or offsets[inside[-1]][1] < end:
        return 0, 0
    first = next(i for i in inside if offsets[i][1] > start)
    last = next(i for i in reversed(inside) if offsets[i][0] < end)
    return first, last
