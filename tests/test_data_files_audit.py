"""Data files as the options name them: a BOM, the same file given twice, several files where one is read
(found in audit)."""

from pathlib import Path

import pytest

from cloudtrain.config import DataConfig
from cloudtrain.data.files import check_data_files
from cloudtrain.data.sources import connect_data
from cloudtrain.errors import UserError


def test_a_bom_at_the_start_of_a_txt_file_is_not_read_as_text(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_bytes(b"\xef\xbb\xbfonce upon a time\nthe end\n")
    raw = connect_data(DataConfig(train_file=str(path)), {})
    assert raw["train"]["text"] == ["once upon a time", "the end"]


@pytest.mark.parametrize("split", ["validation", "test"])
def test_a_held_out_file_that_is_the_training_file_is_noted(tmp_path: Path, split: str, capsys) -> None:
    path = tmp_path / "train.csv"
    path.write_text("text,label\na,x\nb,y\n")
    other = tmp_path / "sub" / ".." / "train.csv"  # the same file by another path
    (tmp_path / "sub").mkdir()
    connect_data(DataConfig(train_file=str(path), **{f"{split}_file": str(other)}), {})
    said = capsys.readouterr().out
    assert f"note: --{split}_file {other} is the --train_file: its metrics are of rows the run trains on" in said


@pytest.mark.parametrize("given", ["a.csv,b.csv", "*.csv"])
def test_several_files_in_one_option_say_a_folder_takes_them(tmp_path: Path, given: str) -> None:
    for name in ("a.csv", "b.csv"):
        (tmp_path / name).write_text("text,label\na,x\n")
    given = ",".join(str(tmp_path / name) for name in given.split(","))
    with pytest.raises(UserError, match="does not exist.*folder.*--streaming true"):
        check_data_files(DataConfig(train_file=given))


@pytest.mark.parametrize("streaming", [True, False])
def test_a_remote_held_out_file_is_said_to_take_a_local_one_not_to_be_missing(tmp_path: Path, streaming: bool) -> None:
    """An s3:// --validation_file that exists was said not to exist (found in audit)."""
    (tmp_path / "train.csv").write_text("text,label\na,x\n")
    cfg = DataConfig(train_file=str(tmp_path / "train.csv"), validation_file="s3://bucket/v.jsonl", streaming=streaming)
    with pytest.raises(UserError) as refused:
        check_data_files(cfg)
    if streaming:
        assert str(refused.value) == (
            "--validation_file s3://bucket/v.jsonl: a stream's --validation_file is a local file or folder; copy it "
            "here, or leave it out to hold out the first --stream_validation_docs (64) documents of the stream"
        )
    else:
        assert (
            str(refused.value) == "--validation_file s3://bucket/v.jsonl: it takes a local file or folder; copy it here"
        )
