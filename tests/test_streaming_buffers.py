"""A stream buffer's byte cap (--stream_buffer_mb): a buffer of long documents ends before its document count, alike
in every loader worker, and a checkpoint keeps the cut it was saved with (a buffer's memory grew with
--stream_buffer x document length: a 10 MB document at --stream_buffer 256 went past 20 GB)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_streaming import data_cfg, numbered, plan_for, take, write_jsonl
from transformers import AutoTokenizer

from cloudtrain.data.streaming import BufferDataset, StreamLoader
from cloudtrain.errors import UserError

CAP_BYTES = 2048


def uneven(n: int) -> list[str]:
    """Short documents with a long one (1 KB) every fifth: a buffer of 16 reaches 2 KiB at its second long one."""
    return [f"d{i} " + " ".join(["word"] * (200 if i % 5 == 0 else 3)) for i in range(n)]


@pytest.fixture(scope="module")
def lm_tokenizer(lm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(lm_tokenizer_dir)


@pytest.fixture
def long_docs(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", uneven(60))
    return path, [len(line) for line in path.read_bytes().splitlines(keepends=True)]


def capped(tmp_path, tokenizer, train_file: str, mb: float = CAP_BYTES / 2**20, **options):
    plan = plan_for(tmp_path, tokenizer, train_file=train_file, **options)
    plan.buffer_mb = mb
    return plan


def test_a_buffer_ends_once_its_documents_reach_the_cap(tmp_path, lm_tokenizer, long_docs):
    path, sizes = long_docs
    sizes = sizes + sizes  # the pass's last buffer runs on into the next pass
    plan = capped(tmp_path, lm_tokenizer, str(path))
    buffers = []
    for item in BufferDataset(plan, plan.start, 0):
        buffers.append(item["start"]["doc"])
        if item["start"]["sources"][0]["pass"] > 0:
            break
    counts = [b - a for a, b in zip(buffers, buffers[1:], strict=False)]
    assert min(counts) < 16, "the cap never ended a buffer before --stream_buffer documents"
    for first, n in zip(buffers, counts, strict=False):
        read = sizes[first : first + n]
        assert sum(read[:-1]) < CAP_BYTES and (sum(read) >= CAP_BYTES or n == 16)
    plan.buffer_mb = 0  # no cap: 16 documents each
    uncapped = [item["start"]["doc"] for item, _ in zip(BufferDataset(plan, plan.start, 0), range(3), strict=False)]
    assert uncapped == [0, 16, 32]


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_every_loader_worker_cuts_the_same_buffers_parsing_them_or_not(tmp_path, lm_tokenizer, long_docs, source):
    """Workers step over the others' documents unparsed (parquet: without reading the rows): they count the same
    bytes, or their buffers would start at other documents than the main process's cursor says."""
    train = str(long_docs[0])
    if source == "parquet":
        train = str(tmp_path / "long.parquet")
        pq.write_table(pa.table({"text": uneven(60) + numbered(40, "s")}), train, row_group_size=10)
    one = take(capped(tmp_path, lm_tokenizer, train).loader(2), 30)
    two = take(capped(tmp_path, lm_tokenizer, train, workers=2).loader(2), 30)
    assert [r["input_ids"] for c in two for r in c] == [r["input_ids"] for c in one for r in c]
    uncapped = take(capped(tmp_path, lm_tokenizer, train, mb=0).loader(2), 30)
    assert [r["starts"] for c in uncapped for r in c] != [r["starts"] for c in one for r in c]


def test_a_checkpoint_from_before_the_cap_resumes_its_own_cut(tmp_path, lm_tokenizer, long_docs, capsys):
    """Its cursor counts rows of buffers cut by document count alone: the resume cuts so too, and reads on the rows
    the uninterrupted run read."""
    train = str(long_docs[0])
    straight = take(capped(tmp_path, lm_tokenizer, train, mb=0).loader(2), 20)
    before = capped(tmp_path, lm_tokenizer, train, mb=0).loader(2)
    take(before, 7)
    state = json.loads(json.dumps(before.state_dict(7)))
    del state["layout"]["buffer_mb"]
    resumed = capped(tmp_path, lm_tokenizer, train, mb=4).loader(2)  # the default cap
    resumed.load_state_dict(state)
    assert (
        "cut before --stream_buffer_mb existed: its buffers stay cut by --stream_buffer 16" in capsys.readouterr().out
    )
    rows = lambda chunks: [r["input_ids"] for c in chunks for r in c]  # noqa: E731
    assert rows(take(resumed, 6)) == rows(straight[7:13])
    # its checkpoints record that cut too: the next resume, by the same command, reads on (found in review: it was
    # refused, the checkpoint saying --stream_buffer_mb 0)
    again = json.loads(json.dumps(resumed.state_dict(13)))
    assert "buffer_mb" not in again["layout"]
    later = capped(tmp_path, lm_tokenizer, train, mb=4).loader(2)
    later.load_state_dict(again)
    assert rows(take(later, 7)) == rows(straight[13:])


def test_a_resume_at_another_cap_is_refused_naming_the_saved_one(tmp_path, lm_tokenizer, long_docs):
    train = str(long_docs[0])
    before = capped(tmp_path, lm_tokenizer, train, mb=16).loader(2)
    take(before, 2)
    state = before.state_dict(2)
    resumed = StreamLoader(capped(tmp_path, lm_tokenizer, train, mb=4), 2, 0, 1)
    with pytest.raises(UserError, match="cut with --stream_buffer_mb 16, this run's with --stream_buffer_mb 4: .*"
                       "resume with --stream_buffer_mb 16$"):  # fmt: skip
        resumed.load_state_dict(state)


@pytest.mark.parametrize(
    "value, said",
    [(-1, r"must be 0 \(no cap\) or more MiB"), (float("nan"), "expected a finite number"), (float("inf"), "finite")],
)
def test_a_cap_below_zero_or_not_a_number_is_refused(value, said):
    with pytest.raises(UserError, match=rf"^--stream_buffer_mb.*{said}"):
        data_cfg(stream_buffer_mb=value)
