"""`cloudtrain preprocess`: tokenize a corpus once into sharded Parquet files that streaming training reads as is.

Each output row is one document of the source, in the source's order (empty ones included, so that a stream of
the shards draws its buffers at the same documents as a stream of the raw corpus): the text column, kept for the
held-out validation documents and sample prompts, and `input_ids`, the document's tokens as the causal-LM task
encodes them (EOS appended). A streaming run given the shards (`--train_file out/*.parquet`) packs those stored
tokens instead of tokenizing again (cloudtrain.data.streaming), so it trains on exactly the rows the raw corpus
would give, at the cost of a read. `manifest.json` holds the counts per shard and a length histogram, drawn in
`length_histogram.png`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cloudtrain.errors import UserError

TOKENS = "input_ids"  # the column a streaming run takes as stored tokens
MANIFEST = "manifest.json"
HISTOGRAM = "length_histogram.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train_file", required=True, help="The corpus: a file, folder or glob (one source).")
    parser.add_argument(
        "--tokenizer_name_or_path", required=True, help="The tokenizer training will use (a local folder)."
    )
    parser.add_argument("--output_dir", required=True, help="Where the shards and manifest.json go.")
    parser.add_argument("--text_column", default="text", help="The column holding each document's text.")
    parser.add_argument("--shard_documents", type=int, default=100_000, help="Documents per shard (100000).")
    parser.add_argument("--format", help="The source's format when its names do not say (jsonl, parquet, ...).")


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


def _write_shard(path: Path, records: list[dict], ids: list[list[int]], text_column: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [None if r.get(text_column) is None else str(r.get(text_column)) for r in records]
    table = pa.table({text_column: pa.array(texts, pa.string()), TOKENS: pa.array(ids, pa.list_(pa.int32()))})
    pq.write_table(table, path, row_group_size=1024)  # small row groups: a resume reads little before its row


def run(args: argparse.Namespace) -> None:
    from cloudtrain.config.data import DataConfig
    from cloudtrain.models.load import read_tokenizer
    from cloudtrain.tasks.causal_lm import CausalLMTask

    if args.shard_documents < 1:
        raise UserError("--shard_documents must be at least 1")
    spec = _source(args)
    tokenizer = read_tokenizer(args.tokenizer_name_or_path, trust_remote_code=False)
    encode = CausalLMTask.stream_encoder(tokenizer, DataConfig(text_column=args.text_column))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards, lengths = [], []
    for n, records in enumerate(_documents(spec, args.shard_documents)):
        ids = [examples[0][0] if examples else [] for examples in encode(records)]
        name = f"shard-{n:05d}.parquet"
        _write_shard(out / name, records, ids, args.text_column)
        shards.append({"file": name, "documents": len(ids), "tokens": sum(map(len, ids))})
        lengths += [len(doc) for doc in ids]
    if not shards:
        raise UserError(f"{args.train_file} holds no document")
    manifest = _manifest(args, shards, lengths)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _plot(manifest["length_histogram"], out / HISTOGRAM)
    print(f"{manifest['documents']} documents, {manifest['tokens']} tokens in {len(shards)} shard(s): {out}")


def _manifest(args: argparse.Namespace, shards: list[dict], lengths: list[int]) -> dict:
    import numpy as np

    counts, edges = np.histogram(lengths, bins=min(50, max(1, len(set(lengths)))))
    return {
        "source": args.train_file,
        "tokenizer": str(args.tokenizer_name_or_path),
        "text_column": args.text_column,
        "documents": len(lengths),
        "empty_documents": sum(1 for n in lengths if n == 0),
        "tokens": sum(lengths),
        "shards": shards,
        "length_histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
    }


def _plot(histogram: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges, counts = histogram["edges"], histogram["counts"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:], strict=False)], align="edge")
    ax.set_xlabel("tokens per document")
    ax.set_ylabel("documents")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
