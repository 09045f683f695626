"""A resumed stream's check that it reads the files its checkpoint's cursor counted in (found in audit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_streaming import data_cfg, plan_for, take
from transformers import AutoTokenizer

from cloudtrain.data.mixture import SourceSpec, initial_state, relative_names, resolve_sources
from cloudtrain.data.stream_layout import stamps_of
from cloudtrain.data.streaming import StreamLoader, StreamPlan, zero_stats
from cloudtrain.errors import UserError


@pytest.fixture(scope="module")
def lm_tokenizer(lm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(lm_tokenizer_dir)


def write_docs(path: Path, n: int = 3) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{path.parent.name} {i}"}) + "\n" for i in range(n)))


def loader_for(train_file: str) -> StreamLoader:
    specs = resolve_sources(data_cfg(train_file=train_file).data)
    plan = StreamPlan(
        sources=specs,
        start=initial_state(specs),
        seed=0,
        exhausted="restart",
        on_bad="skip",
        buffer_docs=8,
        block_size=32,
        packing="bfd",
        encode=lambda records: [[] for _ in records],
        budget={"max_steps": 12},
    )
    return StreamLoader(plan, micro=1, rank=0, world=1)


def cursor(layout: dict) -> dict:
    return {"stream": {}, "buffer": 0, "skip_rows": 0, "rows": 0, "step": 0, "stats": zero_stats(1), "layout": layout}


def test_a_folder_that_lost_a_sub_folder_and_gained_another_is_refused(tmp_path):
    """roll/{d1,d2,d3}/data.jsonl, then d1 deleted and d4 added: base names read data.jsonl x3 both times, so the
    resume trained on other files than the cursor meant, without a word."""
    roll = tmp_path / "roll"
    for d in ("d1", "d2", "d3"):
        write_docs(roll / d / "data.jsonl")
    saved = loader_for(str(roll)).layout()
    assert saved["files"] == [["d1/data.jsonl", "d2/data.jsonl", "d3/data.jsonl"]]
    loader_for(str(roll)).load_state_dict(cursor(saved))  # the same files: resumes
    for f in (roll / "d1").iterdir():
        f.unlink()
    (roll / "d1").rmdir()
    write_docs(roll / "d4" / "data.jsonl")
    with pytest.raises(UserError) as refused:
        loader_for(str(roll)).load_state_dict(cursor(saved))
    assert str(refused.value).startswith(
        f"training source {roll} lists d2/data.jsonl as file 1 where the checkpoint read d1/data.jsonl: its cursor"
    )
    # a glob over the same folder names the files the same way (its folder part is the root)
    assert loader_for(f"{roll}/*/data.jsonl").layout()["files"] == [["d2/data.jsonl", "d3/data.jsonl", "d4/data.jsonl"]]


def test_a_checkpoint_of_base_names_alone_still_resumes_and_still_sees_another_file(tmp_path):
    """Checkpoints written before the relative paths hold base names: compared by base name, as they were."""
    corpus = tmp_path / "corpus"
    write_docs(corpus / "a.jsonl")
    write_docs(corpus / "sub" / "c.jsonl")
    old = {k: v for k, v in loader_for(str(corpus)).layout().items() if k != "file_names"}
    old["files"] = [["a.jsonl", "c.jsonl"]]
    loader_for(str(corpus)).load_state_dict(cursor(old))
    write_docs(corpus / "b.jsonl")
    with pytest.raises(UserError, match="lists b.jsonl as file 2 where the checkpoint read c.jsonl"):
        loader_for(str(corpus)).load_state_dict(cursor(old))


def test_remote_files_are_named_under_their_source_and_a_hub_file_without_its_revision():
    hub = SourceSpec("hf://datasets/o/n", ["hf://datasets/o/n@0123abc/data/train-0.parquet"], "parquet")
    assert relative_names(hub) == ["data/train-0.parquet"]
    s3 = SourceSpec("s3://bucket/corpus/", ["s3://bucket/corpus/d1/x.jsonl", "s3://bucket/corpus/d2/x.jsonl"], "json")
    assert relative_names(s3) == ["d1/x.jsonl", "d2/x.jsonl"]
    glob = SourceSpec("s3://bucket/corpus/*/x.jsonl", s3.files, "json")
    assert relative_names(glob) == ["d1/x.jsonl", "d2/x.jsonl"]
    one = SourceSpec("s3://bucket/corpus/d1/x.jsonl", s3.files[:1], "json")
    assert relative_names(one) == ["x.jsonl"]


def test_a_file_changed_before_its_cursor_is_refused_and_a_copy_of_it_resumes(tmp_path, lm_tokenizer):
    """A line prepended to a text file after a checkpoint: its cursor, a byte offset, pointed mid-line and the resume
    trained on the tail of another line without a word (found in audit)."""
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line number {i} of the corpus\n" for i in range(200)))
    before = plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2)
    take(before, 3)
    state = json.loads(json.dumps(before.state_dict(3)))
    assert state["layout"]["stamps"][0][0]["size"] == text.stat().st_size
    plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2).load_state_dict(state)  # unchanged: resumes
    # the same bytes with another modification time (a copy; a SageMaker channel downloaded again): resumes
    os.utime(text, ns=(text.stat().st_atime_ns, text.stat().st_mtime_ns + 10**10))
    plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2).load_state_dict(state)
    original = text.read_text()
    text.write_text(original + "a line appended to a growing corpus\n")  # its offsets point where they did (review)
    plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2).load_state_dict(state)
    text.write_text("a new first line\n" + original)
    with pytest.raises(UserError) as refused:
        plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2).load_state_dict(state)
    assert str(refused.value) == (
        f"training source {text}: t.txt changed since the checkpoint read it ({text.stat().st_size} bytes where it had "
        f"{text.stat().st_size - 17}), so its cursor would point into other text; restore the file as it was, or "
        "start a fresh run without --resume_from_checkpoint"
    )
    # an edit that keeps the size is seen by its content
    text.write_text(text.read_text().replace("a new first line\n", "").replace("line number 1 ", "line number 9 "))
    with pytest.raises(UserError, match="t.txt changed since the checkpoint read it \\(modified, its content"):
        plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2).load_state_dict(state)
    # a checkpoint from before the record resumes as it did
    del state["layout"]["stamps"]
    plan_for(tmp_path, lm_tokenizer, train_file=str(text)).loader(2).load_state_dict(state)


def test_files_after_the_cursor_are_not_stamped():
    """Only what the cursor read: a file the stream has not reached may change before a resume."""
    spec = SourceSpec("corpus", ["a.jsonl", "b.jsonl", "c.jsonl"], "json")
    position = {"pass": 0, "file": 1, "offset": 0}
    assert [len(s) for s in stamps_of([spec], {"sources": [position]}, {})] == [2]
    assert [len(s) for s in stamps_of([spec], {"sources": [{**position, "pass": 1}]}, {})] == [3]
