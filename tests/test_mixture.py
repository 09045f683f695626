"""Resolving a stream's training sources: the one-line refusals a source's files can draw (found in audit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_streaming import data_cfg

from cloudtrain.data.mixture import resolve_sources
from cloudtrain.errors import UserError


def jsonl(path: Path, n: int = 3) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{path.stem} {i}"}) + "\n" for i in range(n)))


def parquet(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": ["a", "b"]}), path)


def refusal(train_file: str) -> str:
    with pytest.raises(UserError) as refused:
        resolve_sources(data_cfg(train_file=train_file).data)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_a_mixed_format_glob_is_told_a_glob_that_matches_one_format(tmp_path, monkeypatch):
    """`../shards_a/*` over parquet shards, a json file and a file of no known format: the line listed the format
    None and suggested ../shards_a/*/*.parquet, which matched no data file."""
    work, shards = tmp_path / "work", tmp_path / "shards_a"
    work.mkdir()
    for i in range(2):
        parquet(shards / f"shard-{i:05d}.parquet")
    (shards / "manifest.json").write_text('{"task": "causal_lm"}\n')
    (shards / "NOTES").write_text("made by hand\n")
    monkeypatch.chdir(work)
    message = refusal("../shards_a/*")
    assert "None" not in message
    assert "(found json, parquet and 1 file(s) of no known format, such as NOTES)" in message
    assert "a glob such as ../shards_a/*.parquet)" in message
    (spec,) = resolve_sources(data_cfg(train_file="../shards_a/*.parquet").data)  # following it trains
    assert [os.path.basename(f) for f in spec.files] == ["shard-00000.parquet", "shard-00001.parquet"]


def test_a_mixed_folder_is_told_a_glob_that_reaches_its_sub_folders(tmp_path):
    jsonl(tmp_path / "corpus" / "top.jsonl")
    jsonl(tmp_path / "corpus" / "d1" / "a.jsonl")
    parquet(tmp_path / "corpus" / "d2" / "b.parquet")
    message = refusal(str(tmp_path / "corpus"))
    assert f"(found jsonl, parquet); name the files of one kind (a glob such as {tmp_path}/corpus/**/*.jsonl)" in (
        message
    )
    (spec,) = resolve_sources(data_cfg(train_file=f"{tmp_path}/corpus/**/*.jsonl").data)
    assert len(spec.files) == 2


def test_the_same_file_named_two_ways_is_refused_as_named_twice(tmp_path, monkeypatch):
    """`../corp/a40.jsonl,./../corp/a40.jsonl` trained it at double weight, while `a40.jsonl,a40.jsonl` was
    refused: names were compared, not the files."""
    work, corp = tmp_path / "work", tmp_path / "corp"
    work.mkdir()
    jsonl(corp / "a40.jsonl")
    jsonl(corp / "b.jsonl")
    monkeypatch.chdir(work)
    message = refusal("../corp/a40.jsonl,./../corp/a40.jsonl")
    assert message == (
        "training sources ../corp/a40.jsonl and ./../corp/a40.jsonl both read ./../corp/a40.jsonl, which would train "
        "at the weight of both; name each file in one source"
    )
    assert "both read ../corp/a40.jsonl" in refusal("../corp/*.jsonl,../corp/a40.jsonl")  # a glob and a file in it
    (corp / "link.jsonl").symlink_to(corp / "b.jsonl")
    assert "both read ../corp/link.jsonl" in refusal("../corp/b.jsonl,../corp/link.jsonl")
    assert len(resolve_sources(data_cfg(train_file="../corp/a40.jsonl,../corp/b.jsonl").data)) == 2


def test_a_saved_dataset_is_not_streamed_as_its_metadata(tmp_path, monkeypatch):
    """A save_to_disk folder as a source (a SageMaker channel of one under --streaming too): its dataset_dict.json,
    state.json and dataset_info.json were read as training records (found in audit)."""
    from datasets import Dataset, DatasetDict

    from cloudtrain.config import resolve_options

    rows = Dataset.from_dict({"text": ["a", "b"]})
    DatasetDict({"train": rows}).save_to_disk(tmp_path / "saved")
    rows.save_to_disk(tmp_path / "one")
    for folder in ("saved", "saved/train", "one"):
        assert refusal(str(tmp_path / folder)) == (
            f"training source {tmp_path / folder} is a saved dataset (datasets.save_to_disk), which is not streamed: "
            "drop --streaming to train on it, or give its data files (txt, jsonl, json, csv, tsv, parquet)"
        )
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "saved"))
    with pytest.raises(UserError, match=f"^training source {tmp_path / 'saved'} is a saved dataset"):
        resolve_sources(resolve_options(None, {"streaming": True, "max_steps": 1}).data)


def test_a_stream_stopped_by_one_small_source_names_it_not_too_few_documents(tmp_path):
    """--mixture_exhausted stop, a small source ending the stream during the hold-out: "the training sources hold
    fewer than --stream_validation_docs" though they held many more (found in audit)."""
    from cloudtrain.data.streaming import hold_out

    jsonl(tmp_path / "small.jsonl", 2)
    jsonl(tmp_path / "big.jsonl", 200)
    cfg = data_cfg(train_file=f"{tmp_path / 'small.jsonl'},{tmp_path / 'big.jsonl'}", mixture_exhausted="stop")
    cfg.data.stream_validation_docs = 20
    with pytest.raises(UserError) as refused:
        hold_out(resolve_sources(cfg.data), cfg.data, 0)
    assert str(refused.value).startswith(f"training source {tmp_path / 'small.jsonl'} ran out after ")
    assert str(refused.value).endswith(
        "documents were held out for validation, and --mixture_exhausted stop ends the stream there, before the "
        "--stream_validation_docs 20: give --validation_file, fewer --stream_validation_docs, or --mixture_exhausted "
        "restart or drop"
    )
