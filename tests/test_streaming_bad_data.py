"""Bad data met by a stream that every process of a launch reads whole, pass after pass: each warning said once,
by the main process, and a stop's error line said by it alone (found in audit: 2 processes x 4 passes printed the
same warning 8 times, and --on_bad_data stop's line came once per process)."""

from __future__ import annotations

import json

import pytest
from test_streaming import data_cfg, numbered, plan_for, write_jsonl
from transformers import AutoTokenizer

import cloudtrain.data.streaming as streaming
from cloudtrain.data.mixture import resolve_sources
from cloudtrain.data.streaming import StreamLoader, hold_out
from cloudtrain.errors import UserError


@pytest.fixture(scope="module")
def lm_tokenizer(lm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(lm_tokenizer_dir)


@pytest.fixture
def damaged(tmp_path):
    """10 documents with a line that is not JSON after the third."""
    path = write_jsonl(tmp_path / "a.jsonl", numbered(3, "a"))
    with open(path, "a") as f:
        f.write("{not json\n")
        f.writelines(json.dumps({"text": t}) + "\n" for t in numbered(7, "after"))
    return path


def rows_of(loader: StreamLoader, chunks: int) -> None:
    it = loader.chunks()
    for _ in range(chunks):
        next(it)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_record_read_on_every_pass_is_said_once_by_the_main_process(
    tmp_path, lm_tokenizer, damaged, capsys, workers
):
    plan = plan_for(tmp_path, lm_tokenizer, train_file=str(damaged), workers=workers)
    main = StreamLoader(plan, 1, rank=0, world=2)
    rows_of(main, 40)
    passes = main.consumed(40)["corrupted_records_skipped"]
    assert passes >= 3  # read (and counted) again on each pass
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: skipped")]
    assert len(said) == 1 and said[0].startswith(f"warning: skipped corrupted data in {damaged} at position 178: ")
    other = StreamLoader(plan, 1, rank=1, world=2)
    rows_of(other, 40)
    assert other.consumed(40)["corrupted_records_skipped"] == passes  # counted all the same
    assert "warning" not in capsys.readouterr().err


def test_on_bad_data_stop_is_said_by_the_main_process_alone(tmp_path, lm_tokenizer, damaged):
    plan = plan_for(tmp_path, lm_tokenizer, train_file=str(damaged))
    plan.on_bad = "stop"
    for rank in (0, 1):
        with pytest.raises(UserError, match=r"corrupted data in .*a.jsonl at position") as stopped:
            rows_of(StreamLoader(plan, 1, rank=rank, world=2), 40)
        assert stopped.value.quiet == (rank == 1)


def test_the_held_out_documents_bad_data_is_said_by_the_main_process_alone(damaged, monkeypatch, capsys):
    for on_bad in ("skip", "stop"):
        cfg = data_cfg(train_file=str(damaged), stream_validation_docs=6, on_bad_data=on_bad).data
        for rank in (0, 1):
            monkeypatch.setattr(streaming, "_rank_world", lambda rank=rank: (rank, 2))
            if on_bad == "stop":
                with pytest.raises(UserError, match="corrupted data in") as stopped:
                    hold_out(resolve_sources(cfg), cfg, seed=0)
                assert stopped.value.quiet == (rank == 1)
            else:
                hold_out(resolve_sources(cfg), cfg, seed=0)
                assert capsys.readouterr().err.count("warning: skipped") == (rank == 0)
