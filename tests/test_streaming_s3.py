"""--streaming true from object storage: s3:// sources read with the real client (s3fs, botocore) from moto's S3
server on 127.0.0.1 (tests/aws_server.py), against the same files read from local disk; a resume reopens each
object at its byte offset; an unreachable endpoint, missing credentials or a glob matching nothing is one line."""

import gzip
import json
import os
import socket
import subprocess
import sys

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aws_server import BUCKET, local_aws
from conftest import child_pythonpath
from test_streaming import data_cfg, numbered, plan_for, take, write_jsonl
from transformers import AutoTokenizer

from cloudtrain.data.mixture import resolve_sources
from cloudtrain.data.readers import RecordReader
from cloudtrain.errors import UserError


@pytest.fixture(scope="module")
def lm_tokenizer(lm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(lm_tokenizer_dir)


@pytest.fixture
def s3(tmp_path):
    """The local S3 server, with a corpus under s3://<bucket>/corpus/ and the same files in tmp_path/local."""
    local = tmp_path / "local"
    local.mkdir()
    write_jsonl(local / "a0.jsonl", numbered(40, "a0"))
    write_jsonl(local / "a1.jsonl.gz", numbered(30, "a1"), gzip.open)
    pq.write_table(pa.table({"text": numbered(50, "b")}), local / "b.parquet", row_group_size=8)
    with local_aws(tmp_path) as fake:
        client = fake.client("s3")
        for path in local.iterdir():
            client.put_object(Bucket=BUCKET, Key=f"corpus/{path.name}", Body=path.read_bytes())
        client.put_object(Bucket=BUCKET, Key="corpus/README.md", Body=b"not data")
        yield local


def rows(plan, steps: int) -> list[list[int]]:
    return [row["input_ids"] for chunk in take(plan.loader(2), steps) for row in chunk]


def test_s3_sources_stream_the_same_rows_as_the_local_files(s3, tmp_path, lm_tokenizer):
    remote = f"s3://{BUCKET}/corpus/a*.jsonl*,s3://{BUCKET}/corpus/b.parquet"
    specs = resolve_sources(data_cfg(train_file=remote).data)
    assert [len(s.files) for s in specs] == [2, 1]
    assert specs[0].files == [f"s3://{BUCKET}/corpus/a0.jsonl", f"s3://{BUCKET}/corpus/a1.jsonl.gz"]
    local = f"{s3}/a*.jsonl*,{s3}/b.parquet"
    got = rows(plan_for(tmp_path, lm_tokenizer, train_file=remote, train_weights="2,1"), 30)
    assert got == rows(plan_for(tmp_path, lm_tokenizer, train_file=local, train_weights="2,1"), 30)


def test_a_prefix_in_a_datasets_list_is_its_data_objects(s3):
    client = boto3.client("s3")  # reaches the local server through AWS_ENDPOINT_URL, like s3fs
    for key in ("nested/x.jsonl", "nested/deeper/y.jsonl.gz", "nested/README.md"):
        client.put_object(Bucket=BUCKET, Key=key, Body=gzip.compress(b"{}\n") if key.endswith(".gz") else b"{}\n")
    cfg = data_cfg(datasets=[{"path": f"s3://{BUCKET}/nested", "weight": 1.0, "columns": {"text": "body"}}])
    (spec,) = resolve_sources(cfg.data)
    assert spec.files == [f"s3://{BUCKET}/nested/deeper/y.jsonl.gz", f"s3://{BUCKET}/nested/x.jsonl"]
    assert spec.format == "jsonl" and spec.columns == {"text": "body"}
    for key in ("spark/part-00000", "spark/part-00001", "spark/_SUCCESS", "spark/part-00009/nested"):
        client.put_object(Bucket=BUCKET, Key=key, Body=b'{"text": "x"}\n')
    # a prefix gives its files, nested ones too (as a local folder); a glob its matching files, not the prefix
    # part-00009/ it also matches, and it takes the entry's format (it took none: found in review)
    wanted = {"spark": ["part-00000", "part-00001", "part-00009/nested"], "spark/part-*": ["part-00000", "part-00001"]}
    for path, names in wanted.items():
        entry = {"path": f"s3://{BUCKET}/{path}", "weight": 1.0, "format": "jsonl"}
        (spec,) = resolve_sources(data_cfg(datasets=[entry]).data)
        assert [f.removeprefix(f"s3://{BUCKET}/spark/") for f in spec.files] == names, path
    message = one_line_error(f"s3://{BUCKET}/corpus")  # jsonl and parquet under one prefix
    assert "one known format per source" in message


@pytest.mark.slow
def test_the_cursor_reopens_each_object_at_its_offset(s3, tmp_path, lm_tokenizer):
    remote = f"s3://{BUCKET}/corpus/a*.jsonl*,s3://{BUCKET}/corpus/b.parquet"
    straight = take(plan_for(tmp_path, lm_tokenizer, train_file=remote).loader(2), 45)
    first = plan_for(tmp_path, lm_tokenizer, train_file=remote).loader(2)
    take(first, 30)
    state = json.loads(json.dumps(first.state_dict(30)))
    assert any(s["offset"] > 0 for s in state["stream"]["sources"])  # a position inside an object
    again = plan_for(tmp_path, lm_tokenizer, train_file=remote).loader(2)
    again.load_state_dict(state)
    assert take(again, 15) == straight[30:]


def test_a_reader_seeks_inside_an_object(s3):
    url = f"s3://{BUCKET}/corpus/a0.jsonl"
    reader = RecordReader(url, "jsonl")
    positions = [reader.next()[1] for _ in range(10)]
    reader.close()
    again = RecordReader(url, "jsonl", positions[6])
    assert again.next()[0]["text"] == numbered(40, "a0")[7]
    again.close()


def one_line_error(train_file: str) -> str:
    with pytest.raises(UserError) as err:
        resolve_sources(data_cfg(train_file=train_file).data)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_nothing_matching_is_one_line(s3):
    assert "matches no data file" in one_line_error(f"s3://{BUCKET}/corpus/*.csv")
    # the command line's stderr: fsspec's 6 lines about the pinned s3fs came before every such line (audit)
    listing = f"from cloudtrain.data.mixture import expand; print(expand('s3://{BUCKET}/corpus/*.csv'))"
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    result = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, env=env)
    assert result.stdout.strip() == "[]" and "s3fs" not in result.stderr, result.stderr
    assert "matches no data file" in one_line_error("s3://no-such-bucket/corpus/*.jsonl")
    assert "matches no data file" in one_line_error(f"s3://{BUCKET}/no-such-prefix")


def test_a_mistyped_or_uninstalled_protocol_is_one_line():
    """`s4://` was fsspec's "Protocol not known" traceback and `gs://` was told to install s3fs (found in audit)."""
    assert one_line_error("s4://bucket/corpus/*.jsonl").endswith(
        "s4:// is not a storage protocol; did you mean s3://? give s3://, hf:// or a local path"
    )
    assert one_line_error("gs://bucket/corpus/*.jsonl").endswith("reading gs:// needs gcsfs: pip install gcsfs")


def test_no_credentials_is_one_line_naming_what_to_set(s3, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role on a test machine
    message = one_line_error(f"s3://{BUCKET}/corpus/*.jsonl")
    assert "no AWS credentials" in message and "AWS_ACCESS_KEY_ID" in message


def test_an_unreachable_endpoint_is_one_line_not_a_hang(s3, monkeypatch):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    message = one_line_error(f"s3://{BUCKET}/corpus/*.jsonl")
    assert "cannot reach the object store" in message and f"127.0.0.1:{port}" in message
    # an endpoint gone once a file is to be opened (mid-stream) was botocore's traceback (found in audit)
    from cloudtrain.data.readers import RecordReader

    with pytest.raises(UserError, match=f"cannot reach the object store at http://127.0.0.1:{port}") as gone:
        RecordReader(f"s3://{BUCKET}/corpus/part-0.jsonl", "jsonl")
    assert gone.value.transient


def test_preprocess_writes_shards_to_object_storage_that_stream_as_local_ones(
    s3, tmp_path, lm_tokenizer, lm_tokenizer_dir
):
    """`cloudtrain preprocess --output_dir s3://...` (through s3fs, to the local server): the shards, manifest and
    histogram are objects, and streaming them gives the rows of the same shards written to local disk."""
    from cloudtrain.cli import main

    argv = ["preprocess", "--train_file", f"{s3}/*.jsonl*", "--tokenizer_name_or_path", lm_tokenizer_dir]
    options = ["--packing", "bfd", "--max_length", "32", "--pack_documents", "16", "--shard_documents", "32"]
    assert main([*argv, "--output_dir", f"s3://{BUCKET}/shards", *options]) in (0, None)
    assert main([*argv, "--output_dir", str(tmp_path / "shards"), *options]) in (0, None)
    listed = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="shards/")["Contents"]
    names = sorted(o["Key"].removeprefix("shards/") for o in listed)
    assert names == sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert {"manifest.json", "length_histogram.png", "shard-00000.parquet"} <= set(names)
    remote = plan_for(tmp_path, lm_tokenizer, train_file=f"s3://{BUCKET}/shards/*.parquet", packing="none")
    local = plan_for(tmp_path, lm_tokenizer, train_file=f"{tmp_path / 'shards'}/*.parquet", packing="none")
    assert rows(remote, 20) == rows(local, 20)
    # the prefix itself, as a local folder is named: its manifest is no data (it was refused as json beside parquet)
    (spec,) = resolve_sources(data_cfg(train_file=f"s3://{BUCKET}/shards").data)
    assert [f.rsplit("/", 1)[-1] for f in spec.files] == [n for n in names if n.endswith(".parquet")]


def test_preprocess_to_an_unreachable_store_is_one_line(s3, tmp_path, lm_tokenizer_dir, monkeypatch, capsys):
    from cloudtrain.cli import main

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    argv = ["preprocess", "--train_file", f"{s3}/a0.jsonl", "--tokenizer_name_or_path", lm_tokenizer_dir]
    assert main([*argv, "--output_dir", f"s3://{BUCKET}/shards"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the object store" in err and "\n" not in err


def test_an_object_rewritten_before_a_resume_is_refused(s3):
    """An object the cursor read, written again with other bytes: refused by its size or etag (found in audit)."""
    from cloudtrain.data.remote import _filesystem
    from cloudtrain.data.stream_layout import check_stamps, stamps_of

    (spec,) = resolve_sources(data_cfg(train_file=f"s3://{BUCKET}/corpus/a0.jsonl").data)
    stamps = json.loads(json.dumps(stamps_of([spec], {"sources": [{"pass": 0, "file": 0, "offset": 9}]}, {})))
    assert stamps[0][0]["size"] == (s3 / "a0.jsonl").stat().st_size and stamps[0][0]["etag"]
    check_stamps(stamps, [spec], {})  # as it was: resumes
    body = (s3 / "a0.jsonl").read_bytes()
    for changed in (b'{"text": "new"}\n' + body, body.replace(b"a0 1", b"a0 9")):
        boto3.client("s3").put_object(Bucket=BUCKET, Key="corpus/a0.jsonl", Body=changed)
        _filesystem(spec.files[0]).invalidate_cache()  # a resumed run lists afresh
        with pytest.raises(
            UserError, match=r"^training source s3://.*/a0.jsonl: a0.jsonl changed since the checkpoint"
        ):
            check_stamps(stamps, [spec], {})


def test_one_object_named_by_two_sources_is_refused(s3):
    """An object read by two sources trained at the weight of both without a word (found in audit): compared by
    protocol, bucket and key, as local files are by their real path."""
    for train, named in (
        (f"s3://{BUCKET}/corpus/b.parquet,s3://{BUCKET}/corpus/*.parquet", f"s3://{BUCKET}/corpus/b.parquet"),
        (f"s3://{BUCKET}/corpus/a0.jsonl,s3a://{BUCKET}/corpus/a*.jsonl*", f"s3a://{BUCKET}/corpus/a0.jsonl"),
    ):
        first, second = train.split(",")
        assert one_line_error(train) == (
            f"training sources {first} and {second} both read {named}, which would train at the weight of both; "
            "name each file in one source"
        )
    # objects of the same name in other buckets or under other keys are other objects
    assert len(resolve_sources(data_cfg(train_file=f"s3://{BUCKET}/corpus/a0.jsonl,{s3}/a0.jsonl").data)) == 2
