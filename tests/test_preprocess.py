"""`cloudtrain preprocess`: a corpus tokenized once into Parquet shards with a manifest; a streaming run on the shards
trains on exactly the rows that streaming the raw corpus gives, from the stored tokens (not tokenized again)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_streaming import numbered, plan_for, take, write_jsonl
from transformers import AutoTokenizer

from cloudtrain.cli import main
from cloudtrain.data.streaming import encode_stored


@pytest.fixture(scope="module")
def lm_tokenizer(lm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(lm_tokenizer_dir)


@pytest.fixture
def corpus(tmp_path):
    """Two files of uneven documents, a few of them empty (they must keep their place in the stream)."""
    texts = numbered(70, "doc")
    for i in (3, 17, 40):
        texts[i] = ""
    (tmp_path / "raw").mkdir()
    write_jsonl(tmp_path / "raw" / "part0.jsonl", texts[:45])
    write_jsonl(tmp_path / "raw" / "part1.jsonl", texts[45:])
    return tmp_path / "raw"


def preprocess(corpus, out, tokenizer_dir) -> dict:
    argv = ["preprocess", "--train_file", f"{corpus}/*.jsonl", "--tokenizer_name_or_path", tokenizer_dir]
    assert main([*argv, "--output_dir", str(out), "--shard_documents", "20"]) in (0, None)
    return json.loads((out / "manifest.json").read_text())


def test_the_shards_stream_the_same_rows_as_the_raw_corpus(corpus, tmp_path, lm_tokenizer, lm_tokenizer_dir):
    out = tmp_path / "shards"
    manifest = preprocess(corpus, out, lm_tokenizer_dir)
    assert [s["documents"] for s in manifest["shards"]] == [20, 20, 20, 10]
    assert manifest["documents"] == 70 and manifest["empty_documents"] == 3
    expected_tokens = sum(len(lm_tokenizer(t)["input_ids"]) + 1 for t in numbered(70, "doc") if t) - sum(
        len(lm_tokenizer(numbered(70, "doc")[i])["input_ids"]) + 1 for i in (3, 17, 40)
    )
    assert manifest["tokens"] == expected_tokens  # every non-empty document with its EOS
    assert sum(manifest["length_histogram"]["counts"]) == 70 and (out / "length_histogram.png").stat().st_size > 0
    steps = 60  # past the end of the first pass: the second pass starts at the same document too
    raw = take(plan_for(tmp_path, lm_tokenizer, train_file=f"{corpus}/*.jsonl").loader(2), steps)
    shards = take(plan_for(tmp_path, lm_tokenizer, train_file=f"{out}/*.parquet").loader(2), steps)
    assert [r["input_ids"] for c in shards for r in c] == [r["input_ids"] for c in raw for r in c]
    assert [r["seq_lengths"] for c in shards for r in c] == [r["seq_lengths"] for c in raw for r in c]


def test_stored_tokens_are_read_not_tokenized_again(tmp_path, lm_tokenizer):
    pq.write_table(
        pa.table({"text": ["hello world", "not these tokens", ""], "input_ids": [[5, 6], [7, 8, 9], []]}),
        tmp_path / "shard.parquet",
    )
    shard = str(tmp_path / "shard.parquet")
    plan = plan_for(tmp_path, lm_tokenizer, train_file=shard, exhausted="stop", packing="none")
    rows = [r for chunk in plan.loader(1).chunks() for r in chunk]
    assert sorted(r["input_ids"] for r in rows) == [[5, 6], [7, 8, 9]]
    mixed = encode_stored([{"text": "hello"}, {"input_ids": [1, 2]}], lambda records: [[([42], None)] for _ in records])
    assert mixed == [[([42], None)], [([1, 2], None)]]


def test_more_than_one_source_is_one_line(corpus, tmp_path, lm_tokenizer_dir, capsys):
    argv = ["preprocess", "--train_file", f"{corpus}/part0.jsonl,{corpus}/part1.jsonl"]
    status = main([*argv, "--tokenizer_name_or_path", lm_tokenizer_dir, "--output_dir", str(tmp_path / "o")])
    assert status == 2 and "one source" in capsys.readouterr().err
