"""`cloudtrain preprocess`: a corpus tokenized once into Parquet shards with a manifest; a streaming run on the shards
trains on exactly the rows that streaming the raw corpus gives, from the stored tokens (not tokenized again)."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import assert_each_refused, byte_level_bpe
from test_streaming import numbered, plan_for, stream_run_args, take, write_jsonl
from transformers import AutoTokenizer

from cloudtrain import train
from cloudtrain.cli import main
from cloudtrain.data.mixture import SourceSpec
from cloudtrain.data.streaming import encode_stored
from cloudtrain.errors import UserError


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
    from cloudtrain.data.mixture import expand  # the folder names its shards, not its manifest (json beside parquet)

    assert [Path(f).name for f in expand(str(out))] == [Path(s["file"]).name for s in manifest["shards"]]
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


def test_a_text_that_is_a_number_in_a_json_record_is_kept_as_training_reads_it(tmp_path, lm_tokenizer_dir):
    """Found in an audit: one {"text": 12345} among string texts ended preprocess in a pyarrow traceback; a streamed
    run trains it as the text "12345", and so do the shards."""
    raw = tmp_path / "mixed.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["once upon a time", 12345, "the end"]))
    out = tmp_path / "shards"
    argv = ["preprocess", "--train_file", str(raw), "--tokenizer_name_or_path", lm_tokenizer_dir]
    assert main([*argv, "--output_dir", str(out)]) in (0, None)
    (shard,) = sorted(out.glob("*.parquet"))
    assert pq.read_table(shard).column("text").to_pylist() == ["once upon a time", "12345", "the end"]


def test_more_than_one_source_is_one_line(corpus, tmp_path, lm_tokenizer_dir, capsys):
    argv = ["preprocess", "--train_file", f"{corpus}/part0.jsonl,{corpus}/part1.jsonl"]
    status = main([*argv, "--tokenizer_name_or_path", lm_tokenizer_dir, "--output_dir", str(tmp_path / "o")])
    assert status == 2 and "one source" in capsys.readouterr().err


def test_a_corpus_without_the_text_column_is_one_line_and_publishes_nothing(tmp_path, lm_tokenizer_dir, capsys):
    corpus = tmp_path / "notes.csv"
    corpus.write_text("foo,bar\nsome words,more words\n")
    out = tmp_path / "o"
    status = main(["preprocess", "--train_file", str(corpus), "--tokenizer_name_or_path", lm_tokenizer_dir,
                   "--output_dir", str(out)])  # fmt: skip
    assert status == 2 and capsys.readouterr().err.strip() == (
        f"error: {corpus} gave no tokens: no record has text in column 'text' (its columns: bar, foo); "
        "pass --text_column"
    )
    assert not out.exists() or not any(out.iterdir())


def test_a_corpus_of_blank_texts_is_called_blank(tmp_path, lm_tokenizer_dir, capsys):
    """Blank lines were told "no record has text in column 'text' (its columns: text); pass --text_column"
    (left alone in an audit)."""
    for name, content in (("blank.txt", "\n\n\n"), ("blank.jsonl", '{"text": ""}\n{"text": "  ", "id": 2}\n')):
        corpus = tmp_path / name
        corpus.write_text(content)
        status = main(["preprocess", "--train_file", str(corpus), "--tokenizer_name_or_path", lm_tokenizer_dir,
                       "--output_dir", str(tmp_path / f"o-{name}")])  # fmt: skip
        assert status == 2 and capsys.readouterr().err.strip() == (
            f"error: {corpus} gave no tokens: every record's 'text' is blank; give a corpus with text"
        )


def sft_encoder(tokenizer_dir: str, limit: int = 32):
    """The SFT task's stream encoder for prompt/completion records, chatml, cut at 32 tokens (as plan_for's rows)."""
    from types import SimpleNamespace

    from cloudtrain.config.data import DataConfig
    from cloudtrain.data.chat import ChatFormat, detect_columns
    from cloudtrain.tasks.sft import SFTTask

    chat = ChatFormat.setup(AutoTokenizer.from_pretrained(tokenizer_dir), None)
    columns = detect_columns(["prompt", "completion"], None, None, None)
    return SFTTask.stream_encoder(SimpleNamespace(chat=chat), columns, DataConfig(max_length=limit))  # type: ignore[arg-type]


@pytest.fixture
def qa(tmp_path):
    rows = [{"prompt": f"What is {i} plus {i % 7}?", "completion": f"It is {i + i % 7}, of course."} for i in range(50)]
    rows[5] = {"prompt": "no answer"}  # refused: trains nothing, keeps its place
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "qa.jsonl"


def rows_of(loader, steps: int, *keys: str) -> list[tuple]:
    return [tuple(tuple(r.get(k) or ()) for k in keys) for chunk in take(loader, steps) for r in chunk]


def test_sft_shards_stream_the_examples_with_their_answer_masks(qa, tmp_path, lm_tokenizer, lm_tokenizer_dir, capsys):
    out = tmp_path / "sft-shards"
    argv = ["preprocess", "--task", "sft", "--train_file", str(qa), "--tokenizer_name_or_path", lm_tokenizer_dir]
    assert main([*argv, "--output_dir", str(out), "--shard_documents", "20", "--max_length", "32"]) in (0, None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == 50 and manifest["empty_documents"] == 1 and manifest["task"] == "sft"
    assert manifest["records_refused"] == 1  # said, not left out unsaid
    assert f"warning: left out record 5 of {qa}: no column 'completion'" in capsys.readouterr().err
    assert (manifest["max_length"], manifest["train_on_prompt"], manifest["chat_template"]) == (32, False, None)
    assert pq.read_table(out / "shard-00000.parquet").column_names == ["prompt", "completion", "input_ids", "loss_mask"]
    encode = sft_encoder(lm_tokenizer_dir)
    raw, shards = (plan_for(tmp_path, lm_tokenizer, train_file=f) for f in (str(qa), f"{out}/*.parquet"))
    raw.encode = shards.encode = encode
    keys = ("input_ids", "seq_lengths", "loss_mask")
    expected = rows_of(raw.loader(2), 30, *keys)
    assert rows_of(shards.loader(2), 30, *keys) == expected and all(any(r[2]) for r in expected)
    shards.encode = lambda records: pytest.fail("a stored example was tokenized again")  # noqa: ARG005
    assert rows_of(shards.loader(2), 30, *keys) == expected


def test_streamed_sft_examples_without_an_answer_are_counted_and_most_stop_the_run(
    tmp_path, lm_tokenizer, lm_tokenizer_dir, capsys
):
    """A stream dropped the examples that --max_length left without an answer token without a word, and went on
    cycling the few that were left, where a stored dataset stops (found in audit)."""
    long = " ".join(["the king and the frog went to the well"] * 6)
    rows = [{"prompt": f"{long if i % 4 == 0 else 'What is'} {i}?", "completion": f"It is {i}."} for i in range(40)]
    source = tmp_path / "some-long.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = plan_for(tmp_path, lm_tokenizer, train_file=str(source), packing="none")
    plan.encode = sft_encoder(lm_tokenizer_dir, 32)
    loader = plan.loader(2)
    take(loader, 4)
    said = capsys.readouterr().out
    assert said.count("note: streamed examples with no answer token within --max_length 32 are dropped") == 1
    counts, metrics = loader.consumed(4), loader.source_metrics(4)
    assert (counts["examples_dropped"], counts["examples_read"]) == (4, 16)  # the first buffer's 16 records...
    assert (metrics["data/examples_dropped"], metrics["data/examples_read"]) == (4, 16)  # ...read ahead: said so
    rows = [{"prompt": f"{long if i % 4 else 'What is'} {i}?", "completion": f"It is {i}."} for i in range(40)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = plan_for(tmp_path, lm_tokenizer, train_file=str(source), packing="none")
    plan.encode = sft_encoder(lm_tokenizer_dir, 32)
    with pytest.raises(UserError, match="^12 of the first 16 streamed examples have no answer token within --max_l"):
        take(plan.loader(2), 4)


def test_packed_sft_shards_are_the_rows_a_stream_packs_with_their_masks(qa, tmp_path, lm_tokenizer, lm_tokenizer_dir):
    out = tmp_path / "sft-packed"
    argv = ["preprocess", "--task", "sft", "--train_file", str(qa), "--tokenizer_name_or_path", lm_tokenizer_dir]
    options = ["--max_length", "128", "--packing", "bfd", "--pack_documents", "16", "--shard_documents", "32"]
    assert main([*argv, "--output_dir", str(out), *options]) in (0, None)
    columns = pq.read_table(out / "shard-00000.parquet").column_names
    assert columns == ["input_ids", "seq_lengths", "documents", "loss_mask"]
    raw = plan_for(tmp_path, lm_tokenizer, train_file=str(qa), exhausted="stop")
    raw.encode, raw.block_size = sft_encoder(lm_tokenizer_dir, 128), 128
    shards = plan_for(tmp_path, lm_tokenizer, train_file=f"{out}/*.parquet", exhausted="stop", packing="none")
    shards.block_size = 128
    keys = ("input_ids", "seq_lengths", "loss_mask")
    got = [tuple(tuple(r[k]) for k in keys) for chunk in shards.loader(1).chunks() for r in chunk]
    expected = [tuple(tuple(r[k]) for k in keys) for chunk in raw.loader(1).chunks() for r in chunk]
    assert got == expected and len(got) < 30 and all(len(ids) <= 128 for ids, _, _ in got)  # 49 examples packed


@pytest.mark.parametrize("packing", ["bfd", "wrapped"])
def test_packed_shards_are_the_rows_a_stream_of_the_raw_corpus_packs(
    packing, corpus, tmp_path, lm_tokenizer, lm_tokenizer_dir
):
    """Packed by 16 documents (the stream's buffer in plan_for), shards of 32 documents: the stream passes the
    stored rows through (documents kept apart by seq_lengths) and counts the documents per source as the raw one."""
    out = tmp_path / f"packed-{packing}"
    argv = ["preprocess", "--train_file", f"{corpus}/*.jsonl", "--tokenizer_name_or_path", lm_tokenizer_dir]
    options = ["--packing", packing, "--max_length", "32", "--pack_documents", "16", "--shard_documents", "32"]
    assert main([*argv, "--output_dir", str(out), *options]) in (0, None)
    assert pq.read_table(out / "shard-00000.parquet").column_names == ["input_ids", "seq_lengths", "documents"]
    keys = ("input_ids", "seq_lengths")
    raw = plan_for(tmp_path, lm_tokenizer, packing=packing, train_file=f"{corpus}/*.jsonl", exhausted="stop")
    shards = plan_for(tmp_path, lm_tokenizer, packing="none", train_file=f"{out}/*.parquet", exhausted="stop")
    raw_loader, shard_loader = raw.loader(1), shards.loader(1)
    expected = [tuple(tuple(r[k]) for k in keys) for chunk in raw_loader.chunks() for r in chunk]
    got = [tuple(tuple(r[k]) for k in keys) for chunk in shard_loader.chunks() for r in chunk]
    assert got == expected and all(len(ids) <= 32 for ids, _ in got)
    counts = [
        loader.consumed(len(expected))[name]
        for loader, name in ((raw_loader, f"{corpus}/*.jsonl"), (shard_loader, f"{out}/*.parquet"))
    ]
    assert counts[0] == counts[1] and counts[0]["documents"] == 67  # the 70 documents but the 3 empty ones


def test_packed_shards_train_from_the_command_line_with_a_validation_file(
    corpus, tmp_path, tiny_llama_dir, lm_tokenizer_dir, capsys
):
    out = tmp_path / "packed"
    argv = ["preprocess", "--train_file", f"{corpus}/*.jsonl", "--tokenizer_name_or_path", lm_tokenizer_dir]
    assert main([*argv, "--output_dir", str(out), "--packing", "bfd", "--max_length", "32"]) in (0, None)
    held_out = write_jsonl(tmp_path / "held-out.jsonl", numbered(5, "held-out"))
    run = tmp_path / "run"
    args = stream_run_args(tiny_llama_dir, f"{out}/*.parquet", run, "--max_steps", "3")
    options = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)}
    refused = {"no validation file": (options, "holds packed shards (cloudtrain preprocess --packing), which hold")}
    assert_each_refused(refused, capsys, run)
    results = train({**options, "validation_file": str(held_out)})
    assert results["train"]["global_step"] == 3 and results["eval"]["tokens"] > 0
    assert results["train"]["sources"][f"{out}/*.parquet"]["tokens"] > 0
    # a weight draws a packed row from shards and a document from raw text: said, as the data line marks it
    capsys.readouterr()
    mixed = {"train_file": f"{out}/*.parquet,{corpus}/*.jsonl", "output_dir": str(tmp_path / "mixed")}
    assert train({**options, "validation_file": str(held_out), **mixed})["train"]["global_step"] == 3
    said = capsys.readouterr().out
    assert f"data: streaming {out}/*.parquet (1 file(s), packed rows, weight 0.50), {corpus}/*.jsonl (" in said
    assert "\nnote: a weight draws a packed row (a whole row of tokens) from a source of packed shards" in said


def test_shards_made_otherwise_than_the_run_would_make_them_are_refused_before_training(
    corpus, qa, tmp_path, tiny_llama_dir, lm_tokenizer_dir, capsys, monkeypatch
):
    """Another tokenizer's ids, another task's encoding, rows longer than --max_length, and (no manifest to
    vouch for them) ids beyond the vocabulary: each one line, before the first step."""
    other_tokenizer = tmp_path / "tokenizer-b"
    byte_level_bpe(["zebra quantum lattice " * 40] * 3, 300, ["<eos>"], eos_token="<eos>").save_pretrained(
        other_tokenizer
    )
    lowercase = tmp_path / "tokenizer-lowercase"  # this run's vocabulary, another encoding (found in audit)
    shutil.copytree(lm_tokenizer_dir, lowercase)
    spec = json.loads((lowercase / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (lowercase / "tokenizer.json").write_text(json.dumps(spec))
    made = {
        "other-tokenizer": (f"{corpus}/*.jsonl", other_tokenizer, []),
        "lowercase": (f"{corpus}/*.jsonl", lowercase, []),
        "sft": (str(qa), lm_tokenizer_dir, ["--task", "sft", "--max_length", "32"]),
        "packed-64": (f"{corpus}/*.jsonl", lm_tokenizer_dir, ["--packing", "bfd", "--max_length", "64"]),
    }
    for name, (source, tokenizer, extra) in made.items():
        argv = ["preprocess", "--train_file", source, "--tokenizer_name_or_path", str(tokenizer), *extra]
        assert main([*argv, "--output_dir", str(tmp_path / name)]) in (0, None)
    bare = tmp_path / "bare"  # shards copied without their manifest, from a tokenizer with a larger vocabulary
    bare.mkdir()
    pq.write_table(pa.table({"text": ["a", "b"], "input_ids": [[9999, 2], [3, 4]]}), bare / "shard-00000.parquet")
    held_out = write_jsonl(tmp_path / "held-out.jsonl", numbered(5, "held-out"))
    run = tmp_path / "run"

    def options(source: str) -> dict:
        args = stream_run_args(tiny_llama_dir, source, run, "--max_steps", "2", "--validation_file", str(held_out))
        return {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)}

    assert_each_refused(
        {
            "another tokenizer": (
                options(f"{tmp_path}/other-tokenizer/*.parquet"),
                "tokenized by " + str(other_tokenizer),
            ),
            "the same vocabulary, another encoding": (
                options(f"{tmp_path}/lowercase/*.parquet"),
                "whose vocabulary is this run's but whose encoding is not",
            ),
            "another task": (
                options(f"{tmp_path}/sft/*.parquet"),
                "holds shards cloudtrain preprocess made for --task sft",
            ),
            "longer rows": (options(f"{tmp_path}/packed-64/*.parquet"), "packed to 64 tokens and --max_length 32"),
            "no manifest": (options(f"{bare}/*.parquet"), "holds token id 9999, beyond this run's tokenizer"),
        },
        capsys,
        run,
    )
    monkeypatch.chdir(tmp_path / "other-tokenizer")  # named from inside their folder, the manifest is still read
    assert_each_refused(
        {"another tokenizer, from its folder": (options("*.parquet"), "tokenized by " + str(other_tokenizer))},
        capsys,
        run,
    )
    raw_manifest = json.loads((tmp_path / "sft" / "manifest.json").read_text())
    assert raw_manifest["vocabulary"] >= 400 and len(raw_manifest["tokenizer_digest"]) == 16


@pytest.mark.parametrize(
    "options,said",
    [
        (["--packing", "bfd"], "needs --max_length"),
        (["--task", "sft"], "needs --max_length"),
        (["--task", "sft", "--packing", "wrapped", "--max_length", "32"], "--packing none or bfd"),
    ],
)
def test_packing_without_a_row_length_is_one_line(options, said, corpus, tmp_path, lm_tokenizer_dir, capsys):
    argv = ["preprocess", "--train_file", f"{corpus}/*.jsonl", "--tokenizer_name_or_path", lm_tokenizer_dir]
    assert main([*argv, "--output_dir", str(tmp_path / "o"), *options]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") <= 1 and not (tmp_path / "o").exists()


def test_the_tasks_offered_are_those_that_stream_with_the_options_their_encoders_read(tmp_path, capsys):
    """--task takes what registry_table.STREAMING names (the tasks whose classes stream), and each one's encoder
    options are preprocess options and DataConfig fields, so a new streaming task needs no change here."""
    import argparse
    import dataclasses

    from cloudtrain.config.data import DataConfig
    from cloudtrain.data.preprocess import add_arguments
    from cloudtrain.registry import TASKS

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    task = next(a for a in parser._actions if a.dest == "task")
    assert task.choices == tuple(name for name, cls in TASKS._loaded().items() if cls.streams_data)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    for name in task.choices:
        assert set(TASKS[name].stream_options) <= {a.dest for a in parser._actions} & fields, name
    argv = ["preprocess", "--train_file", "a", "--tokenizer_name_or_path", "t", "--output_dir", str(tmp_path / "o")]
    assert main([*argv, "--task", "dpo"]) == 2
    assert "invalid choice: 'dpo' (choose from 'causal_lm', 'sft')" in capsys.readouterr().err


def run_preprocess(corpus, out, tokenizer_dir, *options: str) -> int | None:
    argv = ["preprocess", "--train_file", f"{corpus}/*.jsonl", "--tokenizer_name_or_path", tokenizer_dir]
    return main([*argv, "--output_dir", str(out), *options])


def globbed(out) -> tuple[list[str], int]:
    """What the documented `--train_file 'shards/*.parquet'` reads: the files, and their rows together."""
    import glob
    import os

    files = sorted(glob.glob(f"{out}/*.parquet"))
    return [os.path.basename(f) for f in files], sum(pq.read_metadata(f).num_rows for f in files)


def snapshot(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_second_preprocess_into_the_same_folder_is_refused_and_overwrite_replaces_the_whole_set(
    corpus, tmp_path, lm_tokenizer_dir, capsys
):
    """Shards of 10 documents, then 50: without --overwrite_output_dir the first set stays as it was (a glob
    reads it alone); with it, the glob reads exactly the second set (no shard of the first one left beside)."""
    out = tmp_path / "shards"
    assert run_preprocess(corpus, out, lm_tokenizer_dir, "--shard_documents", "10") in (0, None)
    first, first_said = snapshot(out), capsys.readouterr().out
    assert globbed(out) == ([f"shard-{i:05d}.parquet" for i in range(7)], 70) and "70 rows in 7 shard(s)" in first_said

    assert run_preprocess(corpus, out, lm_tokenizer_dir, "--shard_documents", "50") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds shards from an earlier preprocess (kept)" in err
    assert f"--output_dir {tmp_path / 'shards-2'}" in err and "--overwrite_output_dir true" in err
    assert snapshot(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["raw", "shards"]

    options = ("--shard_documents", "50", "--packing", "bfd", "--max_length", "32", "--overwrite_output_dir", "true")
    assert run_preprocess(corpus, out, lm_tokenizer_dir, *options) in (0, None)
    said = capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    rows = sum(s["rows"] for s in manifest["shards"])
    assert f"{rows} rows in 2 shard(s)" in said and rows != 70  # packed rows of 32 tokens, not one per document
    assert globbed(out) == (["shard-00000.parquet", "shard-00001.parquet"], rows)
    assert sorted(p.name for p in out.iterdir()) == ["length_histogram.png", "manifest.json", *globbed(out)[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "shards"]  # nothing staged or set aside is left


def test_a_folder_of_the_users_files_is_refused_and_untouched(corpus, tmp_path, lm_tokenizer_dir, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    (mine / "part.parquet").write_bytes(b"not ours")
    for options in ((), ("--overwrite_output_dir", "true")):
        assert run_preprocess(corpus, mine, lm_tokenizer_dir, *options) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds notes.txt, part.parquet, which preprocess did not write" in err
        assert snapshot(mine) == {"notes.txt": b"my notes", "part.parquet": b"not ours"}
    out = tmp_path / "shards"  # an earlier preprocess's folder the user added a file to: not replaced with it
    assert run_preprocess(corpus, out, lm_tokenizer_dir) in (0, None)
    (out / "README.md").write_text("where these came from")
    before = snapshot(out)
    assert run_preprocess(corpus, out, lm_tokenizer_dir, "--overwrite_output_dir") == 2
    assert "holds README.md beside an earlier preprocess's shards" in capsys.readouterr().err
    assert snapshot(out) == before
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert run_preprocess(corpus, tmp_path / "empty", lm_tokenizer_dir) in (0, None)
    assert globbed(tmp_path / "empty")[1] == 70
    # shards without the manifest written last: what a killed preprocess to an object store leaves (audit: told
    # "which preprocess did not write"; and training read the part set without a word)
    (tmp_path / "empty" / "manifest.json").unlink()
    before = snapshot(tmp_path / "empty")
    assert run_preprocess(corpus, tmp_path / "empty", lm_tokenizer_dir) == 2
    assert "and no manifest.json: the shards of a preprocess that did not finish" in capsys.readouterr().err
    assert snapshot(tmp_path / "empty") == before
    from cloudtrain.data.shards import check_shards

    spec = SourceSpec("part", [str(tmp_path / "empty" / name) for name in globbed(tmp_path / "empty")[0]], "parquet")
    check_shards([spec], {"vocabulary": 10**6}, 32)
    assert "preprocess shard(s) but no manifest.json, which preprocess writes last" in capsys.readouterr().out


@pytest.mark.slow  # 6-8 s of fresh processes: the full suite runs it
@pytest.mark.parametrize("kill_at", ["preprocess.shard:3", "preprocess.staged"])
def test_a_killed_overwrite_leaves_the_earlier_set(kill_at, corpus, tmp_path, lm_tokenizer_dir):
    """Killed while writing the new shards, or with all of them written but not yet swapped in: the folder holds
    the earlier set, byte for byte; the next run clears what the killed one staged and replaces the set."""
    import os
    import subprocess
    import sys

    from conftest import ENTRY, REPO, child_pythonpath

    out = tmp_path / "shards"
    assert run_preprocess(corpus, out, lm_tokenizer_dir, "--shard_documents", "10") in (0, None)
    first = snapshot(out)
    argv = [sys.executable, str(ENTRY), "preprocess", "--train_file", f"{corpus}/*.jsonl", "--output_dir", str(out)]
    argv += ["--tokenizer_name_or_path", lm_tokenizer_dir, "--shard_documents", "20", "--overwrite_output_dir", "true"]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "CLOUDTRAIN_TEST_KILL_AT": kill_at}
    killed = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert snapshot(out) == first and globbed(out)[1] == 70
    assert run_preprocess(corpus, out, lm_tokenizer_dir, "--shard_documents", "20", "--overwrite_output_dir") in (
        0,
        None,
    )
    assert globbed(out) == ([f"shard-{i:05d}.parquet" for i in range(4)], 70)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "shards"]


def test_a_swap_killed_between_its_renames_is_finished_by_the_next_run(tmp_path):
    """Where folders cannot be exchanged in one step: the old set aside, the complete new one not yet in place."""
    from cloudtrain.data.preprocess import recover

    out = tmp_path / "shards"
    for suffix, shards in ((".preprocess-old", 5), (".preprocess-new", 2)):
        folder = tmp_path / f".shards{suffix}"
        folder.mkdir()
        for i in range(shards):
            (folder / f"shard-{i:05d}.parquet").write_bytes(suffix.encode())
        (folder / "manifest.json").write_text("{}")
    recover(out)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.parquet", "shard-00001.parquet"]
    assert (out / "shard-00000.parquet").read_bytes() == b".preprocess-new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_train_on_prompt_takes_true_as_training_does(qa, tmp_path, lm_tokenizer_dir):
    out = tmp_path / "sft-shards"
    argv = ["preprocess", "--task", "sft", "--train_file", str(qa), "--tokenizer_name_or_path", lm_tokenizer_dir]
    masks = {}
    for given in ("false", "true"):
        folder = out / given
        assert main([*argv, "--output_dir", str(folder), "--max_length", "32", "--train_on_prompt", given]) in (0, None)
        assert json.loads((folder / "manifest.json").read_text())["train_on_prompt"] is (given == "true")
        rows = pq.read_table(folder / "shard-00000.parquet").column("loss_mask").to_pylist()
        masks[given] = [flag for row in rows for piece in row for flag in piece]  # a row: its pieces' masks
    assert all(masks["true"])  # the prompt's tokens are trained on too
    assert 0 < sum(masks["false"]) < len(masks["false"])  # by default the answers alone


def test_a_stored_id_beyond_the_vocabulary_mid_stream_is_one_line_naming_its_source(tmp_path, lm_tokenizer):
    """Past the first record (what the check before training reads), a shard's id beyond the tokenizer stops the
    stream with the source named, not with the embedding's IndexError inside the model."""
    ids = [[5, 6, 7]] * 40 + [[8, 99999, 9]] + [[5, 6, 7]] * 40
    pq.write_table(pa.table({"text": ["t"] * len(ids), "input_ids": ids}), tmp_path / "shard-00000.parquet")
    plan = plan_for(tmp_path, lm_tokenizer, train_file=f"{tmp_path}/*.parquet", exhausted="stop")
    plan.vocabulary = len(lm_tokenizer)
    batches = iter(plan.loader(2))
    assert int(next(batches)["input_ids"].max()) == 7
    with pytest.raises(UserError, match=r"\*.parquet holds token id 99999, beyond this run's tokenizer \(4\d\d tokens"):
        list(batches)


LOCK_HOLDER = (
    "import sys; from cloudtrain.publish.output_dir import lock_file; lock_file(sys.argv[1], 'x'); "
    "print('held', flush=True); input()"
)


def test_a_second_preprocess_while_one_writes_the_folder_is_refused_and_a_set_missing_shards_is_not_trained_on(
    corpus, tmp_path, lm_tokenizer_dir, capsys
):
    """Two preprocess runs into one folder: the second's start removed the first's staged shards, and the first
    published a manifest listing shards that were gone; training read the rest without a word (found in audit)."""
    import subprocess
    import sys

    from cloudtrain.data.shards import _check_complete

    out = tmp_path / "shards"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(tmp_path / ".shards.preprocess-lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        assert run_preprocess(corpus, out, lm_tokenizer_dir, "--shard_documents", "20") == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --output_dir {out} is being written by another preprocess (pid {holder.pid} on " + (
            err.split(" on ", 1)[1]
        ) and err.endswith("; wait for it to end")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    manifest = preprocess(corpus, out, lm_tokenizer_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "shards"]  # no lock file left beside it
    _check_complete(str(out), manifest)
    (out / "shard-00001.parquet").unlink()
    (out / "shard-00003.parquet").unlink()
    with pytest.raises(UserError) as refused:
        _check_complete(str(out), manifest)
    assert str(refused.value) == (
        f"{out}/manifest.json lists 4 shards and 2 of them are not there (shard-00001.parquet, shard-00003.parquet): "
        "a copy that did not finish, or shards deleted since; copy them again, or run cloudtrain preprocess again"
    )


def test_a_mistyped_tokenizer_folder_and_an_unreadable_corpus_are_lines_that_say_so(tmp_path, lm_tokenizer_dir, capsys):
    """A missing ./tokenizer folder was huggingface_hub's "Repo id must use alphanumeric chars"; a Latin-1 CSV was
    "no record has text in column 'text' (its columns: none); pass --text_column" (found in audit)."""
    latin = tmp_path / "latin.csv"
    latin.write_bytes("text\ncaf\xe9\n".encode("latin-1"))
    argv = ["preprocess", "--train_file", str(latin), "--output_dir", str(tmp_path / "out")]
    assert main([*argv, "--tokenizer_name_or_path", "./no-such-tokenizer"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --tokenizer_name_or_path ./no-such-tokenizer does not exist; give a model directory or a Hub id like "
        "<org>/<name>"
    )
    assert main([*argv, "--tokenizer_name_or_path", lm_tokenizer_dir]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {latin} gave no tokens: no record could be read (see the warnings above); give UTF-8 files of its "
        "format (csv)"
    )
    assert not (tmp_path / "out").exists()


def test_sft_shards_compare_the_chat_templates_text_not_its_path(tmp_path, lm_tokenizer_dir):
    """A copy of the template at another path was refused by the path (--chat_template a.jinja vs b.jinja), and an
    edited template was blamed on 'another tokenizer' (found in audit): the text is what the ids follow."""
    from cloudtrain.config.data import DataConfig
    from cloudtrain.data.chat import TEMPLATES, ChatFormat
    from cloudtrain.data.shards import _compare, made_with
    from cloudtrain.tasks.sft import SFTTask

    text = TEMPLATES["zephyr"][0]
    files = {"made": text, "copy": text, "edited": text.replace("'\\n' }}{% endfor %}", "'\\n\\n' }}{% endfor %}")}
    for name, content in files.items():
        (tmp_path / f"{name}.jinja").write_text(content)

    def made(name: str) -> dict:
        template = str(tmp_path / f"{name}.jinja")
        tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
        ChatFormat.setup(tokenizer, template)
        return made_with(SFTTask, tokenizer, DataConfig(chat_template=template, max_length=32))

    shards = made("made")
    _compare("shards", shards, made("copy"), 32)  # the same text at another path
    with pytest.raises(UserError, match="^shards holds shards made with another chat template than this run's"):
        _compare("shards", shards, made("edited"), 32)
