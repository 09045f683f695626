"""`cloudtrain predict` reads its input's texts as written: numbers in a text column stay text, and a list where a
text belongs (a column-oriented JSON) is refused in one line (found in audit)."""

import json

import pytest

from cloudtrain.errors import UserError
from cloudtrain.predict import predict, read_columns, read_texts


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_a_text_column_of_numbers_is_read_as_written(tmp_path, suffix, sep):
    """ "007" was read as the number 7 (and an NA among numbers as a gap): the text changed."""
    file = tmp_path / f"in{suffix}"
    rows = [["id", "text", "other"], ["1", "2024", "a"], ["3", "007", "b"], ["4", "NA", "c"], ["5", "", "d"]]
    rows.append(["6", "1.50", "e"])
    file.write_text("".join(sep.join(row) + "\n" for row in rows))
    assert read_texts(str(file), "text") == ["2024", "007", "NA", "", "1.50"]
    assert read_columns(str(file), ["text", "id"]) == [["2024", "007", "NA", "", "1.50"], ["1", "3", "4", "5", "6"]]


def test_a_list_where_a_text_belongs_is_refused_in_one_line(classifier_dir, tmp_path, monkeypatch):
    """{"text": ["oil up", "wheat down"]} was one row classified as the text "['oil up', 'wheat down']"."""
    file = tmp_path / "columns.json"
    file.write_text(json.dumps({"text": ["oil up", "wheat down"]}))
    records = '({"text": "..."} on each line) or a JSON array of records ([{"text": "..."}, ...])'
    with pytest.raises(UserError) as refused:
        predict(classifier_dir, read_texts(str(file), "text"))
    assert str(refused.value) == (
        "--input_file holds one record, whose text is a list of 2 items; give one record per text: JSON lines "
        + records
    )
    with pytest.raises(UserError, match=r"^--input_file holds a list where text 2 belongs: a list of 3 items; "):
        predict(classifier_dir, ["oil up", ["a", "b", "c"]])  # type: ignore[list-item]
    assert [row["text"] for row in predict(classifier_dir, ["oil up", "wheat down"])] == ["oil up", "wheat down"]
    # refused before the model loads, which takes minutes for a large one (review)
    monkeypatch.setattr("cloudtrain.predict.load", lambda *args, **kwargs: pytest.fail("the model loaded first"))
    with pytest.raises(UserError, match="^--input_file holds one record, whose text is a list"):
        predict(classifier_dir, read_texts(str(file), "text"))


def test_a_txt_input_file_s_byte_order_mark_is_no_part_of_its_first_text(tmp_path):
    """The first text began with U+FEFF (found in review of an audit: training's .txt files drop it)."""
    path = tmp_path / "texts.txt"
    path.write_bytes("\ufeffoil prices rose\nwheat fell\n".encode())
    assert read_texts(str(path), "text") == ["oil prices rose", "wheat fell"]
