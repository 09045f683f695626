"""The `predict` entry: classify texts with a model saved by the training application.

    python src/training_application.py predict --model_dir outputs/run --text "oil prices fell" --text "..."
    python src/training_application.py predict --model_dir outputs/run --input_file texts.txt
    python src/training_application.py predict --model_dir outputs/nli --text "a man sleeps" --text_pair "he rests"

Prints one JSON line per text: {"text", "label", "score"} ("text_pair" too for a sentence-pair model); for a
multi-label model (--task multi_label) {"text", "labels", "scores"}: the labels over 0.5, every label's probability;
for a regression model (--task regression) {"text", "score"}: the predicted number; for a token classifier (--task
token_classification) {"text", "entities", "tags"}: the text's words are split at whitespace, as in training, and
each entity has its type, text, character offsets and mean probability.
--output_file
writes them to a new file in the format its name says (.csv, .tsv, .json, else JSON lines; an existing file only
with --overwrite_output_file true), whole or not at all.
Input files: .txt (one text per line), or .csv/.tsv/.json/.jsonl/.parquet with a --text_column (and
--text_pair_column).
A sentence-pair model gets (text, second text) through its tokenizer as in training: truncated longest first. A
reward model trained through a chat template gets the prompt (--text) and the answer (--text_pair) rendered through
it, as its training rendered each side; a pair whose answer keeps no token within the length scores null. One
trained on plain text (implicit-prompt pairs of strings; its tokenizer_config.json records it) scores a lone --text
whole, and --text joined to its --text_pair as they are, as training tokenized each side.
Texts are truncated at the --max_length the model was trained with (its args.json), so the predictions match the
run's evaluation; --max_length sets another, up to the model's context. More than one batch of texts gets a
progress bar on stderr where the console shows bars (cloudtrain.observe.console).
A model that needs its own code (auto_map) loads only with --trust_remote_code true; nothing asks on
standard input. The options are cloudtrain.commands.predict's; `run` is the command once they parsed.
"""

import argparse
import csv
import json
import os
import re
import stat
import sys
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from cloudtrain.commands.predict import DEFAULT_MAX_LENGTH, PLAIN_INPUT, reward_input, too_long
from cloudtrain.errors import UserError, first_line
from cloudtrain.faults import kill_point
from cloudtrain.observe import console
from cloudtrain.publish.atomic import fsync, is_no_space
from cloudtrain.publish.saving import GENERATIVE, adapter_config, is_adapter_dir, read_arguments, read_json
from cloudtrain.registry_table import PROMPT_ANSWERS, predict_input

if TYPE_CHECKING:
    from cloudtrain.data.chat import ChatFormat


def read_texts(
    path: str, column: str, blank: str = "one output row per text line", fallback: str | None = None
) -> list[str]:
    """The texts of an --input_file: a .txt file's lines (a note on stderr counts the blank ones skipped, and says
    `blank`: what that means for the output), else its `column` (`fallback`: as read_columns takes it)."""
    file = Path(path)  # there: the commands' check_input_file
    if file.suffix.lower() == ".txt":
        try:
            lines = text_lines(file.read_bytes().decode("utf-8-sig"))  # a byte-order mark is no part of a text
        except UnicodeDecodeError:
            raise UserError(f"--input_file {path} is not UTF-8 text; save it as UTF-8 and try again") from None
        texts = [line for line in lines if line.strip()]
        if len(texts) < len(lines):  # a join on line numbers would misalign without a word (found in audit)
            print(
                f"note: {len(lines) - len(texts)} blank line(s) of {path} skipped: {blank}",
                file=sys.stderr,
            )
        return texts
    return read_columns(path, [column], fallback)[0]


def text_lines(text: str) -> list[str]:
    """The lines of a text file, one per line break ("\n", or Windows' "\r\n"): str.splitlines() also splits at
    form feeds (pdftotext's page breaks), U+2028, U+0085 and lone carriage returns, which gave more rows than the
    file has lines (found in audit)."""
    lines = text.split("\n")
    if lines[-1] == "":  # the last line's own line break
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_columns(path: str, columns: list[str], fallback: str | None = None) -> list[list]:
    """Each named column of a csv/tsv/json/jsonl/parquet --input_file, as texts (a missing value: "", as in training;
    a list cell as its items: a token classifier's words). `fallback`: the column read for the first where the file
    lacks it, as training read its data family's column (`question`, `tokens`) where it had no `text`."""
    file = Path(path)
    if file.suffix.lower() == ".txt":
        raise UserError(f"--input_file {path} holds one text per line; a csv/tsv/json/jsonl/parquet file has columns")
    from cloudtrain.data.files import FILE_FORMATS
    from cloudtrain.data.sources import load_files  # only needed for tabular inputs

    if file.suffix.lower() not in FILE_FORMATS:
        tabular = ", ".join(suffix for suffix in FILE_FORMATS if suffix != ".txt")  # (.txt was listed twice; audit)
        raise UserError(
            f"--input_file {path}: unsupported format {file.suffix!r}; use .txt (one text per line) or one of {tabular}"
        )
    if file.stat().st_size == 0:
        raise UserError(f"--input_file {path} is empty")
    builder, options = FILE_FORMATS[file.suffix.lower()]
    # (the split names it in a line about it)
    ds = load_files(builder, [file], split="input", options=options, as_text=[*columns, *filter(None, [fallback])])
    if fallback and columns[0] not in ds.column_names and fallback in ds.column_names:
        columns = [fallback, *columns[1:]]
    for column, flag in zip(columns, ("--text_column", "--text_pair_column"), strict=False):
        if column not in ds.column_names:
            raise UserError(
                f"column {column!r} is not in {path} (its columns: {', '.join(ds.column_names)}); pass {flag}"
            )
    return [[_text(t) for t in ds[column]] for column in columns]


def _text(value) -> str | list[str]:
    """A cell as text ("" where missing), or a list cell as its items (a row's words, as a token classifier's data
    holds them; `predict` refuses them for other models: `check_no_lists`)."""
    if isinstance(value, list):
        return ["" if item is None else str(item) for item in value]
    return "" if value is None else str(value)


def tags_words(model_dir: Path) -> bool:
    """Whether the saved model is a token classifier (its config's architecture, or its adapter's task type): the
    one model whose input rows are lists of words."""
    if is_adapter_dir(model_dir):
        return adapter_config(model_dir).get("task_type") == "TOKEN_CLS"
    if not (model_dir / "config.json").is_file():  # no transformers model: `load` says so in its line
        return False
    architectures = read_json(model_dir / "config.json").get("architectures") or []
    return any(str(name).endswith("ForTokenClassification") for name in architectures)


def check_no_lists(texts: list) -> None:
    """Texts for a model that reads text, not words: a list cell is refused. A column-oriented JSON
    ({"text": ["oil up", "wheat down"]}) was one row classified as the text "['oil up', 'wheat down']" (audit)."""
    at = next((i for i, text in enumerate(texts) if isinstance(text, list)), None)
    if at is None:
        return
    where = "holds one record, whose text is" if len(texts) == 1 else f"holds a list where text {at + 1} belongs:"
    raise UserError(
        f"--input_file {where} a list of {len(texts[at])} items; give one record per text: JSON lines "
        '({"text": "..."} on each line) or a JSON array of records ([{"text": "..."}, ...])'
    )


@torch.no_grad()
def predict(
    model_dir: str,
    texts: list[str],
    batch_size: int = 32,
    max_length: int | None = None,
    trust_remote_code: bool = False,
    pairs: list[str] | None = None,
    allow_none: bool = False,
) -> list[dict]:
    """Label and probability of the top class for each text (with `pairs`: each text and its second text, as a
    sentence-pair model was trained); they are truncated to `max_length` tokens, a pair longest part first
    (default: the max_length in the run's args.json, else 512 or the model's context where shorter; longer than
    the context is refused). A question-answering model answers "" where that scores higher than its best span
    only with `allow_none` (--handle_impossible_answer). `model_dir` as the command checked it
    (cloudtrain.commands.predict.check_options: a saved model, any interrupted final save finished; whether the
    model reads pairs is checked there too)."""
    if pairs is not None and len(pairs) != len(texts):
        raise ValueError(f"{len(pairs)} second texts for {len(texts)} texts")
    if not tags_words(Path(model_dir)):  # before the model loads (minutes for a large one): a list cell is refused
        for given in (texts, pairs or []):
            check_no_lists(given)
    model, tokenizer = load(model_dir, trust_remote_code)
    recorded = read_arguments(model_dir)
    trained = trained_length(recorded)
    limit = truncation_length(model.config, max_length, trained)
    names = model_inputs(recorded, tokenizer)
    if type(model).__name__.endswith("ForTokenClassification"):  # a PeftModelForTokenClassification too
        return tag_words(model, tokenizer, texts, batch_size, limit, names, max_length is None and limit == trained)
    if type(model).__name__.endswith("ForQuestionAnswering"):
        assert pairs is not None  # the command checked that the model reads (question, context) pairs
        return answer_questions(model, tokenizer, texts, pairs, limit, recorded, names, allow_none)
    chat = reward_chat(recorded, tokenizer)
    plain = predict_input(recorded.get("task")) == PROMPT_ANSWERS and reward_input(model_dir) == PLAIN_INPUT
    results: list[dict] = []
    truncated, answerless = 0, []
    for i in progress(range(0, len(texts), batch_size), "predicting"):
        chunk = texts[i : i + batch_size]
        second = pairs[i : i + batch_size] if pairs is not None else None
        if plain:  # a reward model trained on plain text: each text whole, a second text its rest
            encoded, cut, lost = plain_rows(tokenizer, chunk, second, limit, model.config.pad_token_id or 0)
            truncated += cut
            answerless += [len(results) + b for b in lost]
        elif chat is not None:  # the command checked that a chat-template reward model gets (prompt, answer) pairs
            assert second is not None
            encoded, cut, lost = rendered_pairs(chat, chunk, second, limit, model.config.pad_token_id or 0)
            truncated += cut
            answerless += [len(results) + b for b in lost]
        else:  # as training encodes (cloudtrain.data.processing, the reward task): truncation longest first
            encoded = tokenizer(
                chunk, second, truncation="longest_first", max_length=limit, padding=True, padding_side="right",
                return_tensors="pt",
            )  # fmt: skip
            truncated += count_truncated(encoded)
        inputs = {name: encoded[name] for name in names if name in encoded}
        logits = model(**inputs).logits.float()
        if model.config.problem_type == "multi_label_classification":  # --task multi_label: a sigmoid per label
            labels = [model.config.id2label[i] for i in range(logits.shape[-1])]
            results += label_sets(chunk, logits.sigmoid().tolist(), labels, second)
            continue
        if model.config.problem_type == "regression":  # --task regression: the one output is the number
            results += scored(chunk, logits[:, 0].tolist(), second)
            continue
        if logits.shape[-1] == 1:  # a reward model (--task reward): its one output is the score
            scores, ids = logits[:, 0], torch.zeros(len(chunk), dtype=torch.long)
        else:
            scores, ids = logits.softmax(dim=-1).max(dim=-1)
        results += records(chunk, ids.tolist(), scores.tolist(), model.config.id2label, second)
    for row in answerless:  # training dropped such pairs: a score of the prompt alone would say nothing
        results[row]["score"] = None
    if answerless:
        print(
            f"note: {len(answerless)} of {len(texts)} pairs keep no token of their answer within {limit} tokens (the "
            "prompt fills them): their score is null; pass a larger --max_length or shorten the prompts",
            file=sys.stderr,
        )
    if truncated and max_length is None and limit == trained:  # the user chose no length: say what was cut
        what = "text pairs" if pairs is not None else "texts"
        print(
            f"note: {truncated} of {len(texts)} {what} were truncated to the {limit} tokens the model was trained "
            "with; --max_length N to change",
            file=sys.stderr,
        )
    return results


def progress(batches: range, what: str, unit: str = "batch") -> Iterable:
    """The `batches`, under a bar on stderr while they run where a person watches it (cloudtrain.observe.console: a
    terminal, or CLOUDTRAIN_PROGRESS_BARS=1) and there is more than one: a large --input_file showed nothing for
    minutes (found in audit). The bar is cleared once they are done, or one failed."""
    return console.passing_bar(batches, what, unit=unit, shown=len(batches) > 1)


def reward_chat(recorded: dict, tokenizer) -> "ChatFormat | None":
    """The chat format a cloudtrain reward model was trained through (its saved tokenizer's template), or None for
    a model that read its texts as they are."""
    if predict_input(recorded.get("task")) != PROMPT_ANSWERS or not tokenizer.chat_template:
        return None
    from cloudtrain.data.chat import ChatFormat

    return ChatFormat.setup(tokenizer, None, generates=False)


def rendered_pairs(
    chat: "ChatFormat", prompts: list[str], answers: list[str], limit: int, pad: int
) -> tuple[dict, int, list[int]]:
    """(input_ids and attention_mask, how many rows were cut at `limit`, the rows that keep no answer token) of each
    prompt as the user's turn and its answer as the assistant's, rendered and cut as the reward task encodes a side,
    right-padded with `pad`."""
    rendered = [
        chat.answer([{"role": "user", "content": p}], [{"role": "assistant", "content": a}])
        for p, a in zip(prompts, answers, strict=True)
    ]
    answerless = [b for b, (_, mask) in enumerate(rendered) if not any(mask[:limit])]
    return *cut_rows([ids for ids, _ in rendered], limit, pad), answerless


def plain_rows(
    tokenizer, texts: list[str], rest: list[str] | None, limit: int, pad: int
) -> tuple[dict, int, list[int]]:
    """As `rendered_pairs`, for a reward model trained on plain text (implicit-prompt pairs of strings): each text
    tokenized whole as a side of its pairs was (cloudtrain.data.pairs.plain_text: the tokenizer's own special tokens,
    no EOS), and with `rest` (--text_pair) the text and its rest joined as they are, the prompt and the answer of a
    side, which keeps no answer token where the prompt fills `limit`."""
    from cloudtrain.data.pairs import plain_text

    if rest is None:
        return *cut_rows([list(tokenizer(text)["input_ids"]) for text in texts], limit, pad), []
    encoded = [plain_text(tokenizer, text, answer, eos=False) for text, answer in zip(texts, rest, strict=True)]
    answerless = [b for b, (_, mask) in enumerate(encoded) if not any(mask[:limit])]
    return *cut_rows([ids for ids, _ in encoded], limit, pad), answerless


def cut_rows(rows: list[list[int]], limit: int, pad: int) -> tuple[dict, int]:
    """(input_ids and attention_mask of the rows cut at `limit` tokens, as training cut a side, and right-padded
    with `pad`; how many were cut)."""
    width = min(max(len(ids) for ids in rows), limit)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, ids in enumerate(rows):
        input_ids[b, : min(len(ids), limit)] = torch.tensor(ids[:limit], dtype=torch.long)
        attention_mask[b, : min(len(ids), limit)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}, sum(len(ids) > limit for ids in rows)


def model_inputs(recorded: dict, tokenizer) -> list[str]:
    """The inputs the model was trained with (`recorded`: its args.json): those the tokenizer names (a generic
    class can add token_type_ids that classification training leaves out), and for a cloudtrain reward model only
    input_ids and attention_mask (its loss calls the model with those two: an encoder's second segment keeps
    token type 0)."""
    names = list(tokenizer.model_input_names)
    if predict_input(recorded.get("task")) == PROMPT_ANSWERS:
        names = [name for name in names if name in ("input_ids", "attention_mask")]
    return names


def trained_length(recorded: dict) -> int | None:
    """The --max_length a run trained and evaluated at, from its args.json (`recorded`); None if it names none."""
    length = recorded.get("max_length")
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def truncation_length(config, requested: int | None, trained: int | None = None) -> int:
    """--max_length, checked against the model's positions (past them the model fails on an IndexError); by
    default the length the model was `trained` at, so predictions match the run's evaluation, else 512 or the
    context where shorter."""
    from cloudtrain.models.load import context_length

    context = context_length(config)
    if requested is None:
        if trained is not None and (not context or trained <= context):
            return trained
        return min(DEFAULT_MAX_LENGTH, context or DEFAULT_MAX_LENGTH)
    if context and requested > context:
        raise UserError(too_long(requested, context))
    return requested


def count_truncated(encoded) -> int:
    """How many rows of a batch lost tokens to truncation: a fast tokenizer keeps the cut-off tokens in each
    encoding's `overflowing` at no extra cost; a slow one keeps nothing, so 0 (no note rather than a second,
    untruncated tokenization)."""
    return sum(1 for encoding in encoded.encodings or [] if encoding.overflowing)


def load(model_dir: str, trust_remote_code: bool = False):
    """(classifier in eval mode, tokenizer) from a full model's directory or an adapter's (onto its base)."""
    from cloudtrain.models import adapters
    from cloudtrain.models.load import check_checkpoint, load_config, load_failure, read_tokenizer

    if is_adapter_dir(Path(model_dir)):
        task_type = adapter_config(Path(model_dir)).get("task_type")
        if task_type not in ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS"):
            hint = "; write texts with it through the generate command" if task_type in GENERATIVE else ""
            raise UserError(f"--model_dir {model_dir} holds a {task_type or 'PEFT'} adapter, not a classifier{hint}")
        return adapters.load_adapter_model(Path(model_dir), trust_remote_code=trust_remote_code)
    auto_class = CLASSIFIERS[classifier_kind(model_dir)]
    check_checkpoint(model_dir, "--model_dir")
    config = load_config(model_dir, trust_remote_code)  # first: a model that needs its own code stops here
    tokenizer = read_tokenizer(model_dir, trust_remote_code)
    try:
        model = auto_class.from_pretrained(model_dir, config=config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise load_failure(err, f"the model in {model_dir}", model_dir) from None
    return model.eval(), tokenizer


CLASSIFIERS = {
    "ForSequenceClassification": AutoModelForSequenceClassification,
    "ForTokenClassification": AutoModelForTokenClassification,
    "ForQuestionAnswering": AutoModelForQuestionAnswering,
}


def classifier_kind(model_dir: str) -> str:
    """How the name of the classifier config.json names ends (a key of CLASSIFIERS), or a UserError saying what the
    folder holds instead."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        own = " (its module.json: your own nn.Module; load its model.safetensors into your class)"
        raise UserError(
            f"--model_dir {model_dir} holds no config.json{own if (Path(model_dir) / 'module.json').is_file() else ''}"
            "; pass a directory written by the training application"
        )
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (ValueError, AttributeError) as err:  # not JSON, not UTF-8, or not an object
        raise UserError(f"{config} is not a valid config file ({first_line(err)}); save the model again") from None
    kind = next((kind for kind in CLASSIFIERS for name in architectures if name.endswith(kind)), None)
    if kind is None:
        hint = (
            "; write texts with it through the generate command"
            if any(name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for name in architectures)
            else ""
        )
        raise UserError(
            f"--model_dir {model_dir} holds a {', '.join(architectures) or 'model'}, not a sequence or token "
            f"classifier, nor a question-answering model{hint}"
        )
    return kind


@torch.no_grad()
def tag_words(model, tokenizer, texts: list, batch_size: int, limit: int, inputs: list[str], note: bool) -> list[dict]:
    """A token classifier's tag for each word of each text (split at whitespace, as training reads a text column; a
    list is the words themselves, as a column of word lists) and the entities they make, with character offsets into
    the text (a list's words joined by spaces). A word with no token to predict from (cut at `limit` tokens, or
    tokenized to nothing) has no tag (null); with `note`, a line on stderr counts the texts cut."""
    from cloudtrain.data.word_tags import aligned
    from cloudtrain.entities import scored_entities

    results, truncated = [], 0
    for i in progress(range(0, len(texts), batch_size), "tagging"):
        chunk, spans = zip(*(_word_spans(text) for text in texts[i : i + batch_size]), strict=True)
        words = [[text[a:b] for a, b in row] for text, row in zip(chunk, spans, strict=True)]
        encoded = tokenizer(
            words, is_split_into_words=True, truncation=True, max_length=limit, padding=True, padding_side="right",
            return_tensors="pt",
        )  # fmt: skip
        truncated += count_truncated(encoded)
        probs, best = model(**{n: encoded[n] for n in inputs if n in encoded}).logits.float().softmax(-1).max(-1)
        for row, (text, offsets) in enumerate(zip(chunk, spans, strict=True)):
            at = {w: t for t, w in enumerate(aligned(encoded.word_ids(row), list(range(len(offsets))))) if w >= 0}
            tags = [model.config.id2label[int(best[row, at[w]])] if w in at else None for w in range(len(offsets))]
            scores = [probs[row, at[w]].item() if w in at else 0.0 for w in range(len(offsets))]
            entities = [
                {"type": kind, "text": text[offsets[a][0] : offsets[b - 1][1]], "start": offsets[a][0],
                 "end": offsets[b - 1][1], "score": score}
                for kind, a, b, score in scored_entities(tags, scores)
            ]  # fmt: skip
            results.append({"text": text, "entities": entities, "tags": tags})
    if truncated and note:
        print(
            f"note: {truncated} of {len(texts)} texts were cut at the {limit} tokens the model was trained with; their "
            "last words have no tag (null); --max_length N to change",
            file=sys.stderr,
        )
    return results


def _word_spans(text: str | list[str]) -> tuple[str, list[tuple[int, int]]]:
    """(the text, each word's character span in it): a text's words are split at whitespace; a list's are its items,
    joined by single spaces."""
    if isinstance(text, str):
        return text, [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    spans, at = [], 0
    for word in text:
        spans.append((at, at + len(word)))
        at += len(word) + 1
    return " ".join(text), spans


@torch.no_grad()
def answer_questions(
    model,
    tokenizer,
    questions: list[str],
    contexts: list[str],
    limit: int,
    recorded: dict,
    inputs: list[str],
    allow_none: bool = False,
) -> list[dict]:
    """Each question's answer in its context: read in windows of `limit` tokens that overlap by the run's
    --doc_stride, the best span no longer than its --max_answer_length (as its evaluation chose), with its
    probability; with `allow_none`, "" (start -1) where no answer scores higher, as evaluation chose after
    training on questions without one."""
    from cloudtrain.answers import Window, best_answer, span_scores
    from cloudtrain.config import DataConfig
    from cloudtrain.data.answer_spans import context_offsets, context_room, windows_of

    stride = recorded.get("doc_stride", DataConfig.doc_stride)
    longest = recorded.get("max_answer_length", DataConfig.max_answer_length)
    rows = []
    for i in progress(range(len(questions)), "answering", "question"):  # a question's windows are its batch
        question, context = questions[i], contexts[i]
        room = context_room(tokenizer, question, limit)  # a shorter --max_length than training's moves by less
        if room < 2:
            raise UserError(f"question {i + 1} leaves no room for its context in --max_length {limit}; raise it")
        encoded = windows_of(tokenizer, [question], [context], limit, min(stride, room - 1))
        windows = [Window(0, np.asarray(context_offsets(encoded, w))) for w in range(len(encoded["input_ids"]))]
        batch = {n: encoded[n] for n in inputs if n in encoded}  # the offsets count from the right-padded rows' start
        batch = tokenizer.pad(batch, padding_side="right", return_tensors="pt")
        start, end = span_scores(model(**batch), batch)
        text, first, score = best_answer(windows, list(start), list(end), context, longest, allow_none)
        rows.append(
            {"answer": text, "start": first, "end": first + len(text) if text else -1, "score": round(score, 4)}
        )
    return with_pairs([{"text": q, **row} for q, row in zip(questions, rows, strict=True)], contexts)


def records(
    texts: list[str], ids: list[int], scores: list[float], id2label: dict, pairs: list[str] | None = None
) -> list[dict]:
    """One {"text", "label", "score"} per text (with "text_pair" after "text" for a pair): the predicted label's
    name and its probability."""
    rows = [
        {"text": text, "label": id2label[int(idx)], "score": round(float(score), 4)}
        for text, idx, score in zip(texts, ids, scores, strict=True)
    ]
    return with_pairs(rows, pairs)


def with_pairs(rows: list[dict], pairs: list[str] | None) -> list[dict]:
    """Each row with its second text as "text_pair", after "text" (the rows as they are without pairs)."""
    if pairs is None:
        return rows
    return [{"text": row["text"], "text_pair": pair, **row} for row, pair in zip(rows, pairs, strict=True)]


def scored(texts: list[str], values: list[float], pairs: list[str] | None = None) -> list[dict]:
    """One {"text", "score"} per text (with "text_pair" after "text" for a pair) for a regression model: the number
    to 7 significant digits (about float32's)."""
    rows = [{"text": text, "score": float(f"{value:.7g}")} for text, value in zip(texts, values, strict=True)]
    return with_pairs(rows, pairs)


def label_sets(
    texts: list[str], probabilities: list[list[float]], names: list[str], pairs: list[str] | None = None
) -> list[dict]:
    """One {"text", "labels", "scores"} per text (with "text_pair" after "text" for a pair) for a multi-label model:
    the labels whose probability is over 0.5, most probable first, and every label's probability."""
    rows = []
    for text, probs in zip(texts, probabilities, strict=True):
        ranked = sorted(range(len(names)), key=lambda i: -probs[i])
        labels = [names[i] for i in ranked if probs[i] > 0.5]
        rows.append({"text": text, "labels": labels, "scores": {names[i]: round(probs[i], 4) for i in ranked}})
    return with_pairs(rows, pairs)


def write_predictions(path: Path, rows: list[dict], overwrite: bool) -> None:
    """The rows (write_rows) written to a file beside `path` and renamed onto it once complete and on disk, so a
    crash or a full disk leaves the previous file (if any) whole. Without `overwrite` a file that appeared at `path`
    since the command checked it stays too. A symlink's target is written, the link kept; a missing folder is made."""
    target = path.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(staged, "x", encoding="utf-8", newline="") as f:
            write_rows(f, rows, path.suffix.lower())
            f.flush()
            os.fsync(f.fileno())
        if target.is_file():  # the replaced file's permissions, not the umask's
            os.chmod(staged, stat.S_IMODE(target.stat().st_mode))
        kill_point("predict.output_staged")
        _put_in_place(staged, target, overwrite, path)
    except BaseException as err:
        staged.unlink(missing_ok=True)
        if is_no_space(err):
            raise UserError(
                f"the disk of {target.parent} filled up while the predictions were written ({first_line(err)}); "
                f"{path} was not replaced: free some space and run again"
            ) from None
        raise
    fsync(target.parent)


def write_rows(f: typing.TextIO, rows: list[dict], suffix: str) -> None:
    """The rows in the format the file's name says: .csv or .tsv (a list or mapping in a cell as JSON text), .json
    (one array); JSON lines otherwise (a file named p.csv held JSON lines)."""
    if suffix in (".csv", ".tsv"):
        columns = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(f, columns, delimiter="," if suffix == ".csv" else "\t")
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v for k, v in row.items()}
            )
    elif suffix == ".json":
        json.dump(rows, f, ensure_ascii=False, indent=1)
        f.write("\n")
    else:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def _put_in_place(staged: Path, target: Path, overwrite: bool, path: Path) -> None:
    if target.exists() and not target.is_file():  # became a device or FIFO since the command checked it
        raise UserError(f"--output_file {path} is not a regular file now and is not replaced")
    if overwrite:
        os.replace(staged, target)
        return
    try:
        os.link(staged, target)  # fails on an existing target: never replaces one
    except FileExistsError:
        raise UserError(
            f"--output_file {path} appeared while the predictions were computed and is not replaced; run again "
            "with a new name or with --overwrite_output_file true"
        ) from None
    except OSError:  # a filesystem without hard links
        if target.exists():
            raise UserError(
                f"--output_file {path} appeared while the predictions were computed and is not replaced"
            ) from None
        os.replace(staged, target)
        return
    staged.unlink()


def run(args: argparse.Namespace) -> None:
    """The command once cloudtrain.commands.predict.check_options passed (it resolved args.text_pair_column)."""
    texts, pairs = list(args.text), (list(args.text_pair) if args.text_pair else None)
    if args.input_file:
        fallback = getattr(args, "text_column_fallback", None)  # check_options: the run's data family's column
        if args.text_pair_column:
            columns = [args.text_column, args.text_pair_column]
            file_texts, file_pairs = read_columns(args.input_file, columns, fallback)
            pairs = (pairs or []) + file_pairs
        else:
            file_texts = read_texts(args.input_file, args.text_column, fallback=fallback)
        texts += file_texts
    if not texts:  # an input file of blank lines
        raise UserError(f"nothing to classify: --input_file {args.input_file} holds no text")
    rows = predict(
        args.model_dir,
        texts,
        args.batch_size,
        args.max_length,
        args.trust_remote_code,
        pairs,
        args.handle_impossible_answer,
    )
    if args.output_file:
        write_predictions(Path(args.output_file), rows, args.overwrite_output_file)
        print(f"wrote {console.counted(len(rows), 'prediction')} to {args.output_file}")
    else:
        print("\n".join(json.dumps(row, ensure_ascii=False) for row in rows))
