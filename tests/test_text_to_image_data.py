"""--task text_to_image's image folders (cloudtrain.data.images): --max_train_samples reads only the images it
keeps, and a folder captioned by diffusers' metadata.csv trains as one with metadata.jsonl. The rest of the
folder rules: tests/test_text_to_image.py."""

import re
from pathlib import Path

import pytest
from t2i_fixtures import build_tiny_pipeline, captioned_folder, options, square

from cloudtrain.config import build_config
from cloudtrain.data import images
from cloudtrain.errors import UserError
from cloudtrain.tasks.text_to_image import TextToImageTask

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny layers run faster on one


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("t2i-data") / "tiny-sd"))


def processed(model: str, out: Path, **extra):
    cfg = build_config(options(model, out, **extra))
    task = TextToImageTask(cfg)
    return task, task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]


def test_max_train_samples_reads_only_the_images_it_keeps(tiny_sd, tmp_path, monkeypatch):
    """Found in audit: every image was opened before --max_train_samples cut the list (200 read to train on 2),
    and a too-small image past the first N refused the run. Now the first N readable images, in order, are kept
    and none after them is opened; an unreadable one among them is skipped and the next one takes its place."""
    folder = captioned_folder(tmp_path / "set", n=6)
    (folder / "0.png").write_bytes(b"not a png")  # unreadable: skipped
    square((30, 30, 220), size=8).save(folder / "4.png")  # smaller than --resolution 16, past the 2 kept
    opened: list[str] = []
    load_rgb = images.load_rgb

    def counted(source):
        opened.append(Path(source).name)
        return load_rgb(source)

    monkeypatch.setattr(images, "load_rgb", counted)
    task, data = processed(tiny_sd, tmp_path / "out", train_data_dir=str(folder), max_train_samples=2)
    assert [e.image.name for e in data.train.examples] == ["1.png", "2.png"]
    assert task.skipped == 1 and opened[:3] == ["0.png", "1.png", "2.png"] and "4.png" not in opened


def test_a_folder_captioned_by_metadata_csv_trains_as_with_metadata_jsonl(tiny_sd, tmp_path, capsys):
    """Hugging Face's imagefolder (which diffusers' scripts read) takes metadata.csv as well as metadata.jsonl;
    such a folder was refused ("has no metadata.jsonl and 6 images without a caption file", found in audit).
    The same rules hold: file_name and the caption column, a quoted caption may hold commas and new lines, an
    empty one trains without a caption, an image not listed is left out with a note."""
    folder = captioned_folder(tmp_path / "csv", n=4)
    (folder / "metadata.jsonl").unlink()
    (folder / "metadata.csv").write_text(
        'file_name,text\n0.png,a blue square\n1.png,"a red square, small"\n2.png,"two\nlines"\n\n3.png,\n',
        encoding="utf-8-sig",  # a spreadsheet's byte-order mark: no part of the header's first name
    )
    _, data = processed(tiny_sd, tmp_path / "out", train_data_dir=str(folder))
    assert [(e.image.name, e.caption) for e in data.train.examples] == [
        ("0.png", "a blue square"),
        ("1.png", "a red square, small"),
        ("2.png", "two\nlines"),
        ("3.png", ""),
    ]
    assert len(data.train) == 4 and data.train[1]["input_ids"].shape == data.train[0]["input_ids"].shape

    (folder / "metadata.csv").write_text("file_name,text\n0.png,a blue square\n")
    assert [e.image.name for e in images.captioned_examples(str(folder), "text")] == ["0.png"]
    assert f"note: 3 image(s) in {folder} are not in its metadata.csv and are left out" in capsys.readouterr().out
    for written, line in (
        ("file_name,caption\n0.png,x\n", "row 1 has no caption column 'text' (its keys: file_name, caption); pass"),
        ("file_name,text\n0.png\n", "row 1: its caption 'text' is missing, not a text; give it one"),
        ("file_name,text\n9.png,x\n", "row 1 names 9.png, which is not a file in"),
        # an unquoted comma: the caption was cut at it without a word (found in review)
        ("file_name,text\n0.png,a red dog, sitting\n", "row 1 has more cells than its header; quote captions"),
        # its header alone: an IndexError traceback after the model loaded (found in audit)
        ("file_name,text\n", "metadata.csv lists no images: give a row per image (file_name and 'text')"),
    ):
        (folder / "metadata.csv").write_text(written)
        with pytest.raises(UserError, match=re.escape(line)):
            images.captioned_examples(str(folder), "text")
    (folder / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "x"}\n')
    with pytest.raises(UserError, match="has both metadata.jsonl and metadata.csv; keep the one"):
        images.captioned_examples(str(folder), "text")
