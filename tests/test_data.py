"""Stages 1 and 2: data connecting (every source) and processing (labels, tokens, splits, cache)."""

import json
import os

import pandas as pd
import pytest
import torch
from conftest import topic_rows
from datasets import ClassLabel, Dataset, DatasetDict
from transformers import AutoTokenizer

from cloudtrain.config import DataConfig, build_config
from cloudtrain.data.processing import find_label_names, process_data, train_dataloader
from cloudtrain.data.sources import connect_data
from cloudtrain.errors import UserError
from cloudtrain.tasks.classification import ClassificationTask


def connect(cfg: DataConfig) -> DatasetDict:
    """The raw splits, with the columns classification needs checked (as the pipeline does)."""
    return connect_data(cfg, ClassificationTask().columns(cfg))


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    return AutoTokenizer.from_pretrained(minilm_dir)


def write(df: pd.DataFrame, path, fmt: str):
    {
        "csv": lambda: df.to_csv(path, index=False),
        "tsv": lambda: df.to_csv(path, sep="\t", index=False),
        "json": lambda: path.write_text(json.dumps(df.to_dict("records"))),
        "jsonl": lambda: df.to_json(path, orient="records", lines=True),
        "parquet": lambda: df.to_parquet(path),
    }[fmt]()


@pytest.mark.parametrize("fmt", ["csv", "tsv", "json", "jsonl", "parquet"])
def test_local_files_every_format(tmp_path, fmt):
    df = pd.DataFrame(topic_rows(3))
    paths = {}
    for split in ("train", "validation"):
        paths[split] = tmp_path / f"{split}.{fmt}"
        write(df, paths[split], fmt)
    raw = connect(DataConfig(train_file=str(paths["train"]), validation_file=str(paths["validation"])))
    assert set(raw) == {"train", "validation"}
    assert raw["train"]["text"] == df["text"].tolist() and raw["train"]["label"] == df["label"].tolist()


@pytest.mark.parametrize("hashed_bytes", [2**20, 0])  # small data by its contents, large by its sizes and times
def test_a_file_rewritten_under_its_old_modification_time_is_read_anew(tmp_path, monkeypatch, hashed_bytes):
    """datasets knows a local file by its path and modification time: a file rewritten and given its old time back
    (rsync -t, tar, reproducible builds) was read from the cache as it had been, labels and all."""
    from cloudtrain.data import sources

    monkeypatch.setattr(sources, "HASHED_BYTES", hashed_bytes)
    path = tmp_path / "train.csv"
    pd.DataFrame(topic_rows(2)).to_csv(path, index=False)
    os.utime(path, ns=(10**18, 10**18))
    assert sorted(set(connect(DataConfig(train_file=str(path)))["train"]["label"])) == ["finance", "sports", "weather"]
    renamed = [{**row, "label": row["label"].upper()} for row in topic_rows(2)]
    pd.DataFrame(renamed).to_csv(path, index=False)
    os.utime(path, ns=(10**18, 10**18))
    assert sorted(set(connect(DataConfig(train_file=str(path)))["train"]["label"])) == ["FINANCE", "SPORTS", "WEATHER"]


def test_a_csv_column_of_numbers_that_turns_to_text_past_its_first_rows_reads_whole(tmp_path):
    """pandas reads a csv in chunks of 10,000 rows and datasets casts each to the first one's types: labels 1-3 that
    turn into `other` past row 10,000 failed to load ("Failed to parse string"); pandas reads the file (audit)."""
    rows = [f"row {i},{'other' if i > 10_200 else i % 3 + 1},{i / 2}" for i in range(10_400)]
    path = tmp_path / "long.csv"
    path.write_text("text,label,score\n" + "\n".join(rows) + "\n")
    train = connect_data(DataConfig(train_file=str(path)))["train"]
    assert len(train) == 10_400 and train[0]["label"] == "1" and train[-1]["label"] == "other"
    assert train.features["score"].dtype == "float64" and train[-1]["score"] == 10_399 / 2  # numbers stay numbers
    # a column empty in the first chunk, and a header with a trailing comma (pandas' Unnamed: 3; review)
    rows = [f"row {i},{'x' if i > 10_200 else ''},{i}," for i in range(10_400)]
    path.write_text("text,label,n,\n" + "\n".join(rows) + "\n")
    train = connect_data(DataConfig(train_file=str(path)))["train"]
    assert train[0]["label"] is None and train[-1]["label"] == "x" and train[-1]["n"] == 10_399


def test_a_csv_column_of_texts_made_of_digits_is_read_as_written(tmp_path):
    """Texts, prompts and completions of digits alone were read as numbers: "007" trained as "7" (predict reads
    "007"), and SFT refused "column 'completion' holds int, not text" (found in audit); labels keep their numbers."""
    from cloudtrain.tasks import build_task

    path = tmp_path / "digits.csv"
    path.write_text("text,label\n007,1\n2024,2\n")
    train = connect_data(DataConfig(train_file=str(path)))["train"]
    assert train["text"] == ["007", "2024"] and train["label"] == [1, 2]
    sft = tmp_path / "sums.csv"
    sft.write_text("prompt,completion\nWhat is 2 plus 2?,4\nWhat is 0 plus 7?,07\n")
    cfg = build_config({"task": "sft", "train_file": str(sft)})
    assert build_task(cfg).connect(cfg)["train"]["completion"] == ["4", "07"]


def test_a_folder_of_json_and_jsonl_files_is_one_format(tmp_path):
    """Both are read by the JSON reader: such a folder was refused as mixing formats (found in audit)."""
    (tmp_path / "a.json").write_text(json.dumps([{"text": "one", "label": "x"}]))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "two", "label": "y"}) + "\n")
    assert sorted(connect_data(DataConfig(train_file=str(tmp_path)))["train"]["text"]) == ["one", "two"]
    (tmp_path / "c.csv").write_text("text,label\nthree,z\n")
    with pytest.raises(UserError, match=r"mixes data formats \(.csv, .json, .jsonl\)"):
        connect_data(DataConfig(train_file=str(tmp_path)))


def test_save_to_disk_directory(tmp_path):
    DatasetDict({"train": Dataset.from_list(topic_rows(3)), "dev": Dataset.from_list(topic_rows(1))}).save_to_disk(
        tmp_path / "ds"
    )
    raw = connect(DataConfig(dataset_name=str(tmp_path / "ds")))
    assert set(raw) == {"train", "validation"} and len(raw["train"]) == 9  # "dev" is read as validation
    Dataset.from_list(topic_rows(2)).save_to_disk(tmp_path / "single")
    assert len(connect(DataConfig(train_file=str(tmp_path / "single")))["train"]) == 6


def test_a_folder_with_no_data_files_says_so_and_what_to_check(tmp_path):
    """An empty folder (a SageMaker channel whose S3 prefix matched nothing) said it was "a directory but not one
    written by datasets.save_to_disk" (found in audit); one of files in no known format says which they are."""
    pd.DataFrame(topic_rows(2)).to_csv(tmp_path / "train.csv", index=False)
    empty, odd = tmp_path / "channel", tmp_path / "odd"
    empty.mkdir()
    odd.mkdir()
    for name in ("rows.xlsx", "README", ".hidden"):
        (odd / name).write_text("x")
    formats = ".csv, .tsv, .json, .jsonl, .parquet, .txt"
    for flags, folder, held in (
        ({"train_file": str(empty)}, empty, "is empty"),
        ({"train_file": str(tmp_path / "train.csv"), "validation_file": str(odd)}, odd, "holds only README, rows.xlsx"),
    ):
        with pytest.raises(UserError) as refused:
            connect(DataConfig(**flags))
        flag = "--train_file" if "validation_file" not in flags else "--validation_file"
        assert str(refused.value) == (
            f"{flag} {folder} {held}: no data files ({formats}) directly in it, nor a datasets.save_to_disk "
            "folder; check the path (for a SageMaker channel, its S3 prefix)"
        )


def test_a_dataset_name_folder_of_data_files_or_images_names_the_option_that_reads_it(tmp_path):
    """--dataset_name of a folder of csv files or of images was told only that datasets did not save it (audit)."""
    files, images = tmp_path / "files", tmp_path / "images" / "train"
    files.mkdir()
    images.mkdir(parents=True)
    pd.DataFrame(topic_rows(2)).to_csv(files / "train.csv", index=False)
    (images / "0.png").write_bytes(b"png")
    for folder, hint in ((files, "data files is read by --train_file"), (images.parent, "by --train_data_dir")):
        with pytest.raises(
            UserError, match=f"^{folder} is a directory but not one written by .*: a folder of .*{hint}$"
        ):
            connect(DataConfig(dataset_name=str(folder)))


def test_split_files_from_a_saved_dataset_dict_take_their_own_split(tmp_path):
    """--validation_file/--test_file naming a save_to_disk DatasetDict read that split (or its alias),
    never silently the training rows; a missing split is one error listing the splits it has."""
    train, dev = Dataset.from_list(topic_rows(3)), Dataset.from_list(topic_rows(1, offset=2))
    DatasetDict({"train": train, "dev": dev}).save_to_disk(tmp_path / "ds")
    ds = str(tmp_path / "ds")
    raw = connect(DataConfig(train_file=ds, validation_file=ds))
    assert raw["validation"]["text"] == dev["text"] and raw["train"]["text"] == train["text"]
    with pytest.raises(UserError, match=r"--test_file .*ds has no test split \(it has: train, dev\)"):
        connect(DataConfig(train_file=ds, test_file=ds))


def test_builtin_reuters_r8():
    raw = connect(DataConfig())
    assert (len(raw["train"]), len(raw["test"])) == (5485, 2189)
    names, _ = find_label_names(raw, "label")
    assert names == ["acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"]


def test_hub_dataset_offline_is_a_clear_error():
    with pytest.raises(UserError, match="could not load dataset 'no-such/dataset' from the Hub"):
        connect(DataConfig(dataset_name="no-such/dataset"))


def test_integer_labels_keep_their_names_and_string_labels_sort():
    raw = DatasetDict({"train": Dataset.from_dict({"text": list("abcd"), "label": [7, 3, 7, 5]})})
    assert find_label_names(raw, "label") == (["3", "5", "7"], {3: 0, 5: 1, 7: 2})
    floats = DatasetDict({"train": Dataset.from_dict({"text": list("abc"), "label": [2.0, 0.0, 1.0]})})
    assert find_label_names(floats, "label")[0] == ["0", "1", "2"]  # a float column's class ids: "0.0" before
    feature = Dataset.from_dict({"text": ["a", "b"], "label": [1, 0]}).cast_column(
        "label", ClassLabel(names=["no", "yes"])
    )
    assert find_label_names(DatasetDict({"train": feature}), "label")[0] == ["no", "yes"]


def test_numbers_written_as_text_take_the_order_of_the_same_numbers():
    """A JSON file's "10", "2" and a csv's 10, 2 are the same labels: one id order for both."""
    as_text = DatasetDict({"train": Dataset.from_dict({"text": list("abcd"), "label": ["10", "2", " 1", "2"]})})
    names, mapping = find_label_names(as_text, "label")
    assert names == ["1", "2", "10"] and mapping == {" 1": 0, "2": 1, "10": 2}
    as_numbers = DatasetDict({"train": Dataset.from_dict({"text": list("abc"), "label": [10, 2, 1]})})
    assert find_label_names(as_numbers, "label")[0] == names
    superscript = DatasetDict({"train": Dataset.from_dict({"text": list("ab"), "label": ["1", "²"]})})
    assert find_label_names(superscript, "label")[0] == ["1", "²"]  # a digit int() cannot read: text order (review)


def test_a_resumed_checkpoint_keeps_the_label_order_it_was_trained_in(tokenizer, minilm_dir):
    """Found in review: a checkpoint written when numbers written as text sorted as text ("10" before "2") was
    refused on resume as "trained on other labels" (the same data, in the new order)."""
    texts = [f"text {i}" for i in range(6)]
    raw = DatasetDict({"train": Dataset.from_dict({"text": texts, "label": ["1", "10", "2"] * 2})})
    task = ClassificationTask()
    task.resumed_labels = ["1", "10", "2"]  # the checkpoint's, by id
    cfg = build_config({"model_name_or_path": minilm_dir, "validation_split_percentage": 50})
    assert task.process(raw, tokenizer, cfg).label_names == ["1", "10", "2"]
    task.resumed_labels = None  # a fresh run: numbers by value
    assert task.process(raw, tokenizer, cfg).label_names == ["1", "2", "10"]


@pytest.mark.parametrize(
    "cfg_kwargs, rows, message",
    [
        ({"text_column": "body"}, None, "column 'body' is not in the train data"),
        ({}, [], "the train data in .* is empty"),
    ],
)
def test_bad_columns_and_empty_data(tmp_path, cfg_kwargs, rows, message):
    path = tmp_path / "train.csv"
    if rows == []:
        path.write_text("text,label\n")
    else:
        pd.DataFrame(topic_rows(2)).to_csv(path, index=False)
    with pytest.raises(UserError, match=message):
        connect(DataConfig(train_file=str(path), **cfg_kwargs))


def test_an_empty_parquet_file_is_said_to_be_empty(tmp_path):
    """It was "ArrowInvalid: BatchSize must be greater than 0, got 0" (found in audit)."""
    path = tmp_path / "train.parquet"
    pd.DataFrame({"text": pd.Series([], dtype=str), "label": pd.Series([], dtype=str)}).to_parquet(path)
    with pytest.raises(UserError, match=f"^the train data in {path} is empty; give a file with rows$"):
        connect(DataConfig(train_file=str(path)))
    folder = tmp_path / "parts"  # Spark writes empty part files beside the others: they add no rows (review)
    folder.mkdir()
    path.rename(folder / "part-0.parquet")
    pd.DataFrame({"text": ["a", "b"], "label": ["x", "y"]}).to_parquet(folder / "part-1.parquet")
    assert connect(DataConfig(train_file=str(folder)))["train"]["text"] == ["a", "b"]  # the empty part: no rows


def test_validation_labels_unseen_in_training(tmp_path, tokenizer):
    raw = DatasetDict(
        {
            "train": Dataset.from_list(topic_rows(2)),
            "validation": Dataset.from_dict({"text": ["x"], "label": ["cooking"]}),
        }
    )
    with pytest.raises(UserError, match="validation data has labels the training data never saw: cooking"):
        process_data(raw, tokenizer, DataConfig(), seed=0)


def test_spaces_around_a_label_name_make_no_new_class(tokenizer):
    """A CSV's "sports " trained a class of its own beside "sports" (found in audit)."""
    train = Dataset.from_list(
        [{"text": f"t{i}", "label": ["sports", "sports ", " finance", "finance"][i % 4]} for i in range(8)]
    )
    validation = Dataset.from_list([{"text": "v", "label": "sports  "}, {"text": "w", "label": "finance"}])
    data = process_data(DatasetDict(train=train, validation=validation), tokenizer, DataConfig(), seed=0)
    assert data.label_names == ["finance", "sports"]
    assert [data.label_names[i] for i in data.validation["labels"]] == ["sports", "finance"]
    # a head saved before the names were stripped keeps its order and ids (review: it was replaced)
    names, mapping = find_label_names(DatasetDict(train=train), "label", order=[" sports", " finance"])
    assert names == ["sports", "finance"] and mapping["sports "] == 0 and mapping[" finance"] == 1


def test_numbered_labels_are_read_by_name_in_every_split(tmp_path, tokenizer):
    """save_to_disk splits whose ClassLabel numbers the same names in another order were read by number: finance
    counted as weather in the metrics, silently; a name training never saw was a KeyError traceback (audit)."""

    def numbered(rows: list[dict], names: list[str]) -> Dataset:
        return Dataset.from_list(rows).cast_column("label", ClassLabel(names=names))

    train = numbered(topic_rows(4), ["finance", "sports", "weather"])
    rows = [{"text": "shares fell", "label": "finance"}] * 3 + [{"text": "rain", "label": "weather"}]
    for validation in (numbered(rows, ["weather", "sports", "finance"]), Dataset.from_list(rows)):  # or plain text
        data = process_data(DatasetDict(train=train, validation=validation), tokenizer, DataConfig(), seed=0)
        assert [data.label_names[i] for i in data.validation["labels"]] == ["finance"] * 3 + ["weather"]
    extra = numbered([*rows, {"text": "the vote", "label": "politics"}], ["weather", "finance", "politics"])
    with pytest.raises(UserError, match="validation data has labels the training data never saw: politics"):
        process_data(DatasetDict(train=train, validation=extra), tokenizer, DataConfig(), seed=0)


def test_processing_truncates_pads_dynamically_and_carves_validation(tokenizer):
    rows = topic_rows(40)
    rows[0]["text"] = "word " * 500  # long enough to be truncated
    raw = DatasetDict({"train": Dataset.from_list(rows)})
    data = process_data(raw, tokenizer, DataConfig(max_length=16, validation_split_percentage=25), seed=0)
    assert (len(data.train), len(data.validation)) == (90, 30)
    assert max(len(ids) for split in (data.train, data.validation) for ids in split["input_ids"]) == 16
    assert data.validation.features["labels"].names == data.label_names == ["finance", "sports", "weather"]
    # stratified: every label keeps its share in the carved validation split
    assert sorted(torch.bincount(torch.tensor(data.validation["labels"])).tolist()) == [10, 10, 10]
    batch = next(iter(train_dataloader(data, batch_size=8, seed=0)))
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())  # padded to the longest row


def test_sentence_pairs(tokenizer, tmp_path):
    raw = DatasetDict(
        {
            "train": Dataset.from_dict(
                {"a": ["is it raining", "who won"] * 5, "b": ["yes it is", "rain"] * 5, "label": [1, 0] * 5}
            )
        }
    )
    data = process_data(
        raw, tokenizer, DataConfig(text_column="a", text_pair_column="b", validation_split_percentage=20), seed=0
    )
    row = data.train[0]
    assert 1 in row["token_type_ids"]  # the second segment is there
    assert tokenizer.decode(row["input_ids"]).count("[SEP]") == 2
    # an unlabelled split keeps its second texts for the predictions file (rows sharing a premise were told apart
    # by nothing there; found in audit)
    raw["test"] = Dataset.from_dict({"a": ["who won", "who won"], "b": ["rain", "the team"]})
    data = process_data(raw, tokenizer, DataConfig(text_column="a", text_pair_column="b"), seed=0)
    ids, scores = [0, 1], [0.9, 0.6]
    ClassificationTask().write_predictions(tmp_path, data, "test", (ids, scores))
    written = [json.loads(line) for line in (tmp_path / "test_predictions.jsonl").read_text().splitlines()]
    assert [(r["text"], r["text_pair"]) for r in written] == [("who won", "rain"), ("who won", "the team")]


def test_sample_limits(tokenizer):
    raw = DatasetDict({"train": Dataset.from_list(topic_rows(20)), "test": Dataset.from_list(topic_rows(10))})
    data = process_data(raw, tokenizer, DataConfig(max_train_samples=7, max_eval_samples=5), seed=0)
    assert (len(data.train), len(data.validation), len(data.test)) == (7, 5, 5)


@pytest.mark.parametrize("stratified", [True, False])
def test_limits_tokenize_only_the_rows_they_keep_and_keep_the_rows_chosen_from_the_tokenized_split(
    tokenizer, tmp_path, monkeypatch, stratified
):
    """The reference chooses as before: tokenize everything, carve validation from the tokenized rows, then
    draw the limits from them. Choosing first must keep the same rows in the same order."""
    rows = topic_rows(200) if stratified else [*topic_rows(100), {"text": "hail all day", "label": "hail"}]
    raw = DatasetDict({"train": Dataset.from_list(rows)})
    names, label2id = find_label_names(raw, "label")
    tokenized = raw["train"].map(
        lambda b: {**tokenizer(b["text"], truncation=True, max_length=16), "labels": [label2id[v] for v in b["label"]]},
        batched=True,
        remove_columns=["text", "label"],
    )
    tokenized = tokenized.cast_column("labels", ClassLabel(names=names))
    n_val = -(-len(rows) // 10)
    parts = tokenized.train_test_split(test_size=n_val, seed=3, stratify_by_column="labels" if stratified else None)
    expected = [parts[side].shuffle(seed=3).select(range(n))["input_ids"] for side, n in (("train", 11), ("test", 6))]

    tokenized_rows = []
    call = type(tokenizer).__call__
    monkeypatch.setattr(
        type(tokenizer),
        "__call__",
        lambda self, texts, *a, **k: (tokenized_rows.append(len(texts)), call(self, texts, *a, **k))[1],
    )
    cfg = DataConfig(
        max_length=16,
        max_train_samples=11,
        max_eval_samples=6,
        validation_split_percentage=10,
        cache_dir=str(tmp_path),
    )
    data = process_data(raw, tokenizer, cfg, seed=3)
    assert [data.train["input_ids"], data.validation["input_ids"]] == expected
    assert sum(tokenized_rows) == 11 + 6  # of 600 rows
    carved = torch.bincount(torch.tensor(parts["test"]["labels"]), minlength=len(names)).tolist()
    assert (carved[:3] == [20, 20, 20]) is stratified  # the reference drew a stratified split where it could


def test_processing_is_cached_across_runs(tmp_path, tokenizer, topic_csvs):
    cfg = DataConfig(
        train_file=str(topic_csvs["train"]),
        validation_file=str(topic_csvs["validation"]),
        cache_dir=str(tmp_path / "cache"),
    )
    first = process_data(connect(cfg), tokenizer, cfg, seed=0)
    files = sorted((tmp_path / "cache").glob("*.arrow"))
    assert len(files) == 2
    stamps = {f: os.stat(f).st_mtime_ns for f in files}
    fresh_tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    second = process_data(connect(cfg), fresh_tokenizer, cfg, seed=0)  # as a second run would
    assert {f: os.stat(f).st_mtime_ns for f in files} == stamps  # read back, not written again
    assert second.train["input_ids"] == first.train["input_ids"]
    other = DataConfig(**{**cfg.__dict__, "max_length": 8})
    process_data(connect(other), tokenizer, other, seed=0)
    assert len(list((tmp_path / "cache").glob("*.arrow"))) == 4  # other options, another entry


def test_a_folder_of_data_files_is_one_split(tmp_path):
    """As a SageMaker channel delivers it: several csv parts in one folder."""
    folder = tmp_path / "train"
    folder.mkdir()
    rows = topic_rows(4)
    pd.DataFrame(rows[:5]).to_csv(folder / "part-0.csv", index=False)
    pd.DataFrame(rows[5:]).to_csv(folder / "part-1.csv", index=False)
    raw = connect(DataConfig(train_file=str(folder)))
    assert raw["train"]["text"] == [r["text"] for r in rows]
    (folder / "extra.json").write_text("[]")
    with pytest.raises(UserError, match="mixes data formats"):
        connect(DataConfig(train_file=str(folder)))


def test_na_null_and_none_in_a_csv_are_words_and_only_an_empty_cell_is_missing(tmp_path):
    """pandas' default read a class named NA as no label ("20 of 60 rows have no label") and the text null as
    nothing, silently; `predict --input_file` lost such texts from its output too (found in audit)."""
    from cloudtrain.predict import read_columns

    path = tmp_path / "train.tsv"
    path.write_text("text\tlabel\tscore\nnull\tNA\t1.5\nNone\tsports\tNA\na goal\tNA\tnan\n\tsports\t2\n")
    train = connect(DataConfig(train_file=str(path)))["train"]
    assert train["label"] == ["NA", "sports", "NA", "sports"]
    assert train["text"] == ["null", "None", "a goal", None]  # the empty cell alone is missing
    # numbers with NA or nan in some cells (R's write.csv) stay numbers with gaps, as pandas reads them (review)
    assert train["score"] == [1.5, None, None, 2.0]
    upper = tmp_path / "UPPER.TSV"  # predict took only lower-case suffixes, which training does not ask
    upper.write_text(path.read_text())
    assert read_columns(str(upper), ["text"]) == [["null", "None", "a goal", ""]]


def test_a_checkpoint_whose_labels_were_saved_with_spaces_resumes(tmp_path):
    """Its labels (" finance") are this run's stripped names (review: the resume was refused)."""
    from cloudtrain.checkpointing import check_labels

    check_labels({"labels": [" finance", " sports"]}, ["finance", "sports"], tmp_path)
    with pytest.raises(UserError, match="label 0 is ' sports' there and 'finance' here"):
        check_labels({"labels": [" sports", " finance"]}, ["finance", "sports"], tmp_path)


def test_the_cache_key_knows_which_side_the_tokenizer_cuts(bert_tokenizer_dir):
    """A copy of the tokenizer cutting on the left took the rows the right-cutting one had cached, and the run
    trained and evaluated on other tokens than `predict` reads (found in audit)."""
    from cloudtrain.data.processing import cache_key

    rows = Dataset.from_dict({"text": ["a b c"], "label": [0]})
    right = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    left = AutoTokenizer.from_pretrained(bert_tokenizer_dir, truncation_side="left")
    assert cache_key(rows, right, 6) == cache_key(rows, AutoTokenizer.from_pretrained(bert_tokenizer_dir), 6)
    assert cache_key(rows, right, 6) != cache_key(rows, left, 6)


def test_a_text_column_of_lists_or_records_is_one_line(tmp_path):
    """A word list (or a record) as --text_column trained on its Python text form, `['the', 'team']` (found in
    audit)."""
    from cloudtrain.data.processing import check_texts

    for cells in ([["the", "team"], ["won"]], [{"body": "a"}, {"body": "b"}]):
        rows = Dataset.from_dict({"tokens": cells, "label": [0, 1]})
        with pytest.raises(UserError, match="^the 'tokens' column holds lists or records, not text; give a column"):
            check_texts(rows, "tokens")
    check_texts(Dataset.from_dict({"tokens": ["the team", "won"], "label": [0, 1]}), "tokens")
    mixed = tmp_path / "mixed.jsonl"  # a JSON text column of numbers and text (a Json feature) is text (review)
    mixed.write_text('{"text": 1984, "label": "a"}\n{"text": "a text", "label": "b"}\n')
    check_texts(connect(DataConfig(train_file=str(mixed)))["train"], "text")


def test_a_tsv_cell_that_opens_with_a_quote_and_swallows_the_rows_after_it_is_one_line(tmp_path):
    """pandas read a TSV cell starting with `"` as quoted, up to the next quote: 25 rows, tabs and labels included,
    became one training text, silently (found in audit). Such a cell is refused naming its row; streamed, it is a
    bad record. A TSV that quotes its cells as csv does (pandas' to_csv) reads as before (review)."""
    from cloudtrain.data.readers import SWALLOWED, BadRecord, RecordReader

    path = tmp_path / "train.tsv"
    path.write_text('text\tlabel\n"breaking news: a storm\tweather\nthe striker scored\tsports\nthe "end\tfinance\n')
    with pytest.raises(UserError) as refused:
        connect(DataConfig(train_file=str(path)))
    assert str(refused.value) == f"row 1 of {path}, column 'text': {SWALLOWED}"
    with pytest.raises(BadRecord, match="opens with a quote ran on"):
        RecordReader(str(path), "tsv").next()
    quoted = tmp_path / "quoted.tsv"
    pd.DataFrame({"text": ['he said "hi" there', "plain"], "label": ["a", "b"]}).to_csv(quoted, sep="\t", index=False)
    assert connect(DataConfig(train_file=str(quoted)))["train"]["text"] == ['he said "hi" there', "plain"]
    assert RecordReader(str(quoted), "tsv").next()[0]["text"] == 'he said "hi" there'
    closed = tmp_path / "closed.tsv"  # the quote closed on the next row: a tab, then a line break (review)
    closed.write_text('text\tlabel\n"Hello he said\tpos\nShe replied "no" today\tneg\nplain row\tpos\n')
    with pytest.raises(UserError, match=f"^row 1 of {closed}, column 'text': "):
        connect(DataConfig(train_file=str(closed)))
    tab = tmp_path / "tab.tsv"  # a quoted cell holding a tab on its own line, as pandas writes it (found in audit)
    pd.DataFrame({"text": ["col a\tcol b", "plain"], "label": ["a", "b"]}).to_csv(tab, sep="\t", index=False)
    assert connect(DataConfig(train_file=str(tab)))["train"]["text"] == ["col a\tcol b", "plain"]
    assert RecordReader(str(tab), "tsv").next()[0]["text"] == "col a\tcol b"


def test_a_csv_cell_that_opens_a_quote_it_never_closes_is_noted(tmp_path, capsys):
    """It took in the rows after it, silently: 26 of 40 rows read, a class lost (found in audit); the tsv path refuses
    such a cell, a csv's is noted (a quoted paragraph may hold lines with commas)."""
    rows = [f"row {i} text,{('sports', 'politics')[i % 2]}" for i in range(12)]
    rows[4] = '"' + rows[4]
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "\n".join(rows) + '\nthe "end,tech\n')
    assert len(connect(DataConfig(train_file=str(path)))["train"]) < 13
    assert f"note: row 5 of {path}, column 'text', holds lines that read as rows of the file" in capsys.readouterr().out
    fine = tmp_path / "fine.csv"
    listed = "Here they are:\nParis, France\nRome, Italy\nOslo, Norway"  # a list's lines hold commas too (review)
    pd.DataFrame({"text": ["a poem,\nwith lines, and commas", listed], "label": ["a", "b"]}).to_csv(fine, index=False)
    assert len(connect(DataConfig(train_file=str(fine)))["train"]) == 2
    assert "note:" not in capsys.readouterr().out


def test_files_of_other_columns_and_a_label_column_of_numbers_and_text_say_so(tmp_path):
    """A folder whose files differ in columns was "CastError: Couldn't cast"; a JSON label column mixing 7 and
    "sports" was called lists or records, with advice to use multi_label (found in audit)."""
    from cloudtrain.data.processing import check_label_kind

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.csv").write_text("text,label\na b,x\nc d,y\n")
    (folder / "b.csv").write_text("text,label,source\ne f,x,w\ng h,y,w\n")
    with pytest.raises(UserError, match=r"^the files in .*folder do not all have the same columns: .*'source'"):
        connect(DataConfig(train_file=str(folder)))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({"text": "t", "label": label}) + "\n" for label in (7, "sports", 7, "sports")))
    with pytest.raises(UserError, match="^the 'label' column mixes numbers and text"):
        check_label_kind(connect(DataConfig(train_file=str(mixed)))["train"], "label")


def test_a_streamed_mixture_whose_unread_columns_differ_in_type_connects(tmp_path):
    """An `id` a number in one file and a text in another, a `meta` an object in one and a text in the other: the
    sources' first records met in one Arrow table, a traceback, though the task reads `text` only (found in audit).
    The column checks still see the task's column."""
    from cloudtrain.tasks.causal_lm import CausalLMTask

    first = {"id": 0, "meta": {"a": 1}, "text": "the king"}
    rows = {"ints": [first], "texts": [{"id": "x0", "meta": "m", "text": "a"}]}
    for name, records in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records * 20))
    files = f"{tmp_path / 'ints.jsonl'},{tmp_path / 'texts.jsonl'}"
    for column, refused in (("text", False), ("body", True)):
        cfg = build_config({"task": "causal_lm", "train_file": files, "streaming": True, "max_steps": 2,
                            "stream_validation_docs": 2, "text_column": column})  # fmt: skip
        connect = lambda: connect_data(cfg.data, CausalLMTask(cfg).columns(cfg.data))  # noqa: E731, B023
        if refused:  # the task's checks still run on what was kept
            with pytest.raises(UserError, match="body"):
                connect()
        else:
            raw = connect()
            assert raw["train"].column_names == ["text"] and len(raw["train"]) == 2
