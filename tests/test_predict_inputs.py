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


def test_the_text_column_defaults_to_the_one_the_run_read(tmp_path):
    """A QA or token-classification run's own validation file was refused "column 'text' is not in ..." (found in
    audit): --text_column defaults to the run's recorded column, else `text` or the column its data family names."""
    import argparse

    from cloudtrain.commands.predict import NAMED_TEXT, trained_text_column
    from cloudtrain.data.answer_spans import SQUAD_COLUMNS
    from cloudtrain.data.word_tags import CONLL_COLUMNS

    assert NAMED_TEXT == {"question_answering": SQUAD_COLUMNS["text_column"], "token_classification": "tokens"}
    assert CONLL_COLUMNS["text_column"] == "tokens"
    (tmp_path / "args.json").write_text(json.dumps({"task": "token_classification", "text_column": "text"}))
    args = argparse.Namespace(model_dir=str(tmp_path), text_column=None)
    trained_text_column(args, "token_classification")
    assert (args.text_column, args.text_column_fallback) == ("text", "tokens")
    file = tmp_path / "validation.jsonl"
    file.write_text(json.dumps({"tokens": ["john", "went"], "ner_tags": ["B-PER", "O"]}) + "\n")
    assert read_texts(str(file), args.text_column, fallback=args.text_column_fallback) == [["john", "went"]]
    (tmp_path / "args.json").write_text(json.dumps({"task": "question_answering", "text_column": "q"}))
    given = argparse.Namespace(model_dir=str(tmp_path), text_column="ask")
    for args, column, fallback in (
        (argparse.Namespace(model_dir=str(tmp_path), text_column=None), "q", "text"),
        (given, "ask", None),
    ):
        trained_text_column(args, "question_answering")  # the recorded column, an explicit flag first
        assert (args.text_column, args.text_column_fallback) == (column, fallback)
    # an input file of a `text` column, which the option's old default read, reads still (found in review)
    file.write_text(json.dumps({"text": "a text"}) + "\n")
    assert read_texts(str(file), "Text", fallback="text") == ["a text"]
