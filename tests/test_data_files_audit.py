"""Data files as the options name them: a BOM, the same file given twice, several files where one is read
(found in audit)."""

from pathlib import Path

from cloudtrain.config import DataConfig
from cloudtrain.data.sources import connect_data


def test_a_bom_at_the_start_of_a_txt_file_is_not_read_as_text(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_bytes(b"\xef\xbb\xbfonce upon a time\nthe end\n")
    raw = connect_data(DataConfig(train_file=str(path)), {})
    assert raw["train"]["text"] == ["once upon a time", "the end"]
