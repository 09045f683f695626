"""The `predict` entry: classify texts with a model saved by the training application.

    python src/training_application.py predict --model_dir outputs/run --text "oil prices fell" --text "..."
    python src/training_application.py predict --model_dir outputs/run --input_file texts.txt

Prints one JSON line per text: {"text", "label", "score"}; --output_file writes them to a file.
Input files: .txt (one text per line), or .csv/.tsv/.json/.jsonl with a --text_column.
A model that needs its own code (auto_map) loads only with --trust_remote_code true; nothing asks on
standard input. The options are cloudtrain.commands.predict's; `run` is the command once they parsed.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForSequenceClassification

from cloudtrain.commands.predict import DEFAULT_MAX_LENGTH
from cloudtrain.errors import UserError, first_line
from cloudtrain.publish.saving import adapter_config, is_adapter_dir, write_jsonl


def read_texts(path: str, column: str) -> list[str]:
    file = Path(path)  # there: the commands' check_input_file
    if file.suffix == ".txt":
        try:
            return [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError:
            raise UserError(f"--input_file {path} is not UTF-8 text; save it as UTF-8 and try again") from None
    from cloudtrain.data.files import FILE_FORMATS
    from cloudtrain.data.sources import load_files  # only needed for tabular inputs

    if file.suffix not in FILE_FORMATS:
        raise UserError(f"--input_file {path}: unsupported format; use .txt or one of {', '.join(FILE_FORMATS)}")
    if file.stat().st_size == 0:
        raise UserError(f"--input_file {path} is empty")
    builder, options = FILE_FORMATS[file.suffix]
    ds = load_files(builder, [file], options=options)
    if column not in ds.column_names:
        raise UserError(
            f"column {column!r} is not in {path} (its columns: {', '.join(ds.column_names)}); pass --text_column"
        )
    return [str(t) for t in ds[column]]


@torch.no_grad()
def predict(
    model_dir: str,
    texts: list[str],
    batch_size: int = 32,
    max_length: int | None = None,
    trust_remote_code: bool = False,
) -> list[dict]:
    """Label and probability of the top class for each text; texts are truncated to `max_length` tokens
    (default: 512, or the model's context where shorter; longer is refused). `model_dir` as the command checked
    it (cloudtrain.commands.predict.check_options: a saved model, any interrupted final save finished)."""
    model, tokenizer = load(model_dir, trust_remote_code)
    max_length = truncation_length(model.config, max_length)
    results = []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        inputs = tokenizer(chunk, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        logits = model(**inputs).logits.float()
        if logits.shape[-1] == 1:  # a reward model (--task reward): its one output is the score
            scores, ids = logits[:, 0], torch.zeros(len(chunk), dtype=torch.long)
        else:
            scores, ids = logits.softmax(dim=-1).max(dim=-1)
        results += records(chunk, ids.tolist(), scores.tolist(), model.config.id2label)
    return results


def truncation_length(config, requested: int | None) -> int:
    """--max_length, checked against the model's positions (past them the model fails on an IndexError)."""
    from cloudtrain.models.load import context_length

    context = context_length(config)
    if requested is None:
        return min(DEFAULT_MAX_LENGTH, context or DEFAULT_MAX_LENGTH)
    if context and requested > context:
        raise UserError(f"--max_length {requested} is longer than the model's context ({context} positions)")
    return requested


def load(model_dir: str, trust_remote_code: bool = False):
    """(classifier in eval mode, tokenizer) from a full model's directory or an adapter's (onto its base)."""
    from cloudtrain.models import adapters
    from cloudtrain.models.load import check_checkpoint, load_config, load_failure, read_tokenizer

    if is_adapter_dir(Path(model_dir)):
        task_type = adapter_config(Path(model_dir)).get("task_type")
        if task_type != "SEQ_CLS":
            hint = "; continue prompts with the generate command" if task_type == "CAUSAL_LM" else ""
            raise UserError(
                f"--model_dir {model_dir} holds a {task_type or 'PEFT'} adapter, not a sequence classifier{hint}"
            )
        return adapters.load_adapter_model(Path(model_dir), trust_remote_code=trust_remote_code)
    check_sequence_classifier(model_dir)
    check_checkpoint(model_dir, "--model_dir")
    config = load_config(model_dir, trust_remote_code)  # first: a model that needs its own code stops here
    tokenizer = read_tokenizer(model_dir, trust_remote_code)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, config=config, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise load_failure(err, f"the model in {model_dir}", model_dir) from None
    return model.eval(), tokenizer


def check_sequence_classifier(model_dir: str) -> None:
    """config.json names a sequence classifier, or a UserError says what it holds instead."""
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
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        hint = (
            "; continue prompts with the generate command"
            if any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
            else ""
        )
        raise UserError(
            f"--model_dir {model_dir} holds a {', '.join(architectures) or 'model'}, not a sequence classifier{hint}"
        )


def records(texts: list[str], ids: list[int], scores: list[float], id2label: dict) -> list[dict]:
    """One {"text", "label", "score"} per text: the predicted label's name and its probability."""
    return [
        {"text": text, "label": id2label[int(idx)], "score": round(float(score), 4)}
        for text, idx, score in zip(texts, ids, scores, strict=True)
    ]


def run(args: argparse.Namespace) -> None:
    texts = list(args.text) + (read_texts(args.input_file, args.text_column) if args.input_file else [])
    if not texts:  # an input file of blank lines
        raise UserError(f"nothing to classify: --input_file {args.input_file} holds no text")
    rows = predict(args.model_dir, texts, args.batch_size, args.max_length, args.trust_remote_code)
    if args.output_file:
        write_jsonl(Path(args.output_file), rows)
        print(f"wrote {len(rows)} predictions to {args.output_file}")
    else:
        print("\n".join(json.dumps(row, ensure_ascii=False) for row in rows))
