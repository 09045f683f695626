"""The `predict` entry: classify texts with a model saved by the training application.

    python src/training_application.py predict --model_dir outputs/run --text "oil prices fell" --text "..."
    python src/training_application.py predict --model_dir outputs/run --input_file texts.txt

Prints one JSON line per text: {"text", "label", "score"}; --output_file writes them to a file.
Input files: .txt (one text per line), or .csv/.tsv/.json/.jsonl with a --text_column.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from cloudtrain.errors import UserError, first_line
from cloudtrain.publish.saving import adapter_config, holds_model, is_adapter_dir, write_jsonl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_dir", required=True, help="A directory written by the training application.")
    parser.add_argument("--text", action="append", default=[], help="A text to classify (repeatable).")
    parser.add_argument("--input_file", help="A .txt file (one text per line) or a csv/tsv/json/jsonl file.")
    parser.add_argument("--text_column", default="text", help="Column of --input_file holding the texts.")
    parser.add_argument("--output_file", help="Write the JSON lines here instead of printing them.")
    parser.add_argument("--batch_size", type=int, default=32, help="Texts per forward pass (default: 32).")
    parser.add_argument("--max_length", type=int, default=512, help="Truncate texts to this many tokens.")


def read_texts(path: str, column: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"--input_file {path} does not exist")
    if file.suffix == ".txt":
        return [line for line in file.read_text().splitlines() if line.strip()]
    import datasets  # only needed for tabular inputs

    from cloudtrain.data.sources import FILE_FORMATS

    if file.suffix not in FILE_FORMATS:
        raise UserError(f"--input_file {path}: unsupported format; use .txt or one of {', '.join(FILE_FORMATS)}")
    builder, options = FILE_FORMATS[file.suffix]
    ds = datasets.load_dataset(builder, data_files=str(file), split="train", **options)
    if column not in ds.column_names:
        raise UserError(
            f"column {column!r} is not in {path} (its columns: {', '.join(ds.column_names)}); pass --text_column"
        )
    return [str(t) for t in ds[column]]


@torch.no_grad()
def predict(model_dir: str, texts: list[str], batch_size: int = 32, max_length: int = 512) -> list[dict]:
    """Label and probability of the top class for each text."""
    if not holds_model(Path(model_dir)):
        raise UserError(f"--model_dir {model_dir} holds no saved model (no config.json/model.safetensors)")
    model, tokenizer = load(model_dir)
    results = []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        inputs = tokenizer(chunk, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        probs = model(**inputs).logits.float().softmax(dim=-1)
        scores, ids = probs.max(dim=-1)
        results += records(chunk, ids.tolist(), scores.tolist(), model.config.id2label)
    return results


def load(model_dir: str):
    """(classifier in eval mode, tokenizer) from a full model's directory or an adapter's (onto its base)."""
    from cloudtrain.models import adapters

    if is_adapter_dir(Path(model_dir)):
        task_type = adapter_config(Path(model_dir)).get("task_type")
        if task_type != "SEQ_CLS":
            hint = "; continue prompts with the generate command" if task_type == "CAUSAL_LM" else ""
            raise UserError(
                f"--model_dir {model_dir} holds a {task_type or 'PEFT'} adapter, not a sequence classifier{hint}"
            )
        return adapters.load_adapter_model(Path(model_dir))
    architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        hint = (
            "; continue prompts with the generate command"
            if any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
            else ""
        )
        raise UserError(
            f"--model_dir {model_dir} holds a {', '.join(architectures) or 'model'}, not a sequence classifier{hint}"
        )
    try:
        return (
            AutoModelForSequenceClassification.from_pretrained(model_dir).eval(),
            AutoTokenizer.from_pretrained(model_dir),
        )
    except (OSError, ValueError) as err:
        raise UserError(f"could not load the model in {model_dir}: {first_line(err)}") from None


def records(texts: list[str], ids: list[int], scores: list[float], id2label: dict) -> list[dict]:
    """One {"text", "label", "score"} per text: the predicted label's name and its probability."""
    return [
        {"text": text, "label": id2label[int(idx)], "score": round(float(score), 4)}
        for text, idx, score in zip(texts, ids, scores, strict=True)
    ]


def run(args: argparse.Namespace) -> None:
    texts = list(args.text) + (read_texts(args.input_file, args.text_column) if args.input_file else [])
    if not texts:
        raise UserError('nothing to classify: pass --text "..." or --input_file FILE')
    rows = predict(args.model_dir, texts, args.batch_size, args.max_length)
    if args.output_file:
        write_jsonl(Path(args.output_file), rows)
        print(f"wrote {len(rows)} predictions to {args.output_file}")
    else:
        print("\n".join(json.dumps(row, ensure_ascii=False) for row in rows))
