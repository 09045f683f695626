"""--task text_to_image's image folders (cloudtrain.data.images): --max_train_samples reads only the images it
keeps, and a folder captioned by diffusers' metadata.csv trains as one with metadata.jsonl. The rest of the
folder rules: tests/test_text_to_image.py."""

from pathlib import Path

import pytest
from t2i_fixtures import build_tiny_pipeline, captioned_folder, options, square

from cloudtrain.config import build_config
from cloudtrain.data import images
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
