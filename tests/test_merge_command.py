"""`cloudtrain merge` (and the adapter loading predict and generate share) on folders it did not make: a training
checkpoint, a user's merged.partial/ or merged.replaced/, an adapter as the Hub holds one (no tokenizer files), a
tokenizer without its tokenizer.json (found in audit)."""

import json
import shutil

import pytest
from conftest import lora_run

from cloudtrain.errors import UserError


@pytest.fixture
def adapter_run(tiny_model_dir, tmp_path):
    """A LoRA run's output folder, after one step."""
    return lora_run(tiny_model_dir, tmp_path)


def test_a_checkpoint_given_to_merge_is_named_a_checkpoint(tmp_path):
    """It was "holds no adapter ... merge needs the output of a run with --peft lora", of a LoRA run's checkpoint."""
    import argparse

    from cloudtrain.commands import merge

    checkpoint = tmp_path / "checkpoints" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    (checkpoint / "model.safetensors").write_text("weights")
    with pytest.raises(UserError, match=f"--output_dir {checkpoint} is a training checkpoint .* give the run's"):
        merge.check_options(argparse.Namespace(output_dir=str(checkpoint)))


@pytest.mark.parametrize("name", ["merged.partial", "merged.replaced"])
def test_merge_never_deletes_a_users_folder_under_the_names_it_works_in(adapter_run, name, capsys):
    from cloudtrain.cli import main

    theirs = adapter_run / name
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main(["merge", "--output_dir", str(adapter_run)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"error: {theirs} is not one cloudtrain wrote, and merge uses that name for its work: move it elsewhere (or "
        "rename it), then merge again"
    )
    assert (theirs / "notes.txt").read_text() == "mine"
    assert not (adapter_run / "merged").exists()
    theirs.rename(adapter_run / "notes")
    cut = adapter_run / name  # an earlier version's merge cut by a kill: a model's files, no manifest (review)
    cut.mkdir()
    (cut / "config.json").write_text("{}")
    (cut / "model.safetensors").write_bytes(b"x")
    assert main(["merge", "--output_dir", str(adapter_run)]) == 0
    assert main(["merge", "--output_dir", str(adapter_run)]) == 0  # replaces its own merged/
    names = sorted(p.name for p in adapter_run.iterdir() if p.name.startswith("merged"))
    assert names == ["merged"]
    assert (adapter_run / "notes" / "notes.txt").read_text() == "mine"


def test_an_adapter_without_tokenizer_files_uses_its_base_models_with_a_note(adapter_run, tiny_model_dir, capsys):
    """An adapter as downloaded from the Hub (adapter_config.json and its weights alone) was a cut-off line:
    "could not load the adapter ...: Couldn't instantiate the backend tokenizer from one of: "."""
    from cloudtrain.cli import main
    from cloudtrain.models.adapters import load_adapter_model

    hub = adapter_run.parent / "from-hub"
    hub.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "labels.json"):
        shutil.copy(adapter_run / name, hub / name)
    model, tokenizer = load_adapter_model(hub)
    note = f"note: {hub} holds no tokenizer files: the tokenizer of its base model {tiny_model_dir} is used"
    assert capsys.readouterr().err.splitlines()[0] == note  # (transformers' loading bar may follow)
    assert (
        tokenizer("the striker scored")["input_ids"]
        == load_adapter_model(adapter_run)[1]("the striker scored")["input_ids"]
    )
    assert main(["merge", "--model_dir", str(hub)]) == 0
    assert (hub / "merged" / "tokenizer.json").is_file()


def test_a_tokenizer_without_its_tokenizer_json_names_the_missing_file(tiny_llama_dir, tmp_path):
    """It was "could not load the tokenizer in ...: Couldn't instantiate the backend tokenizer from one of: "."""
    from cloudtrain.models.load import read_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "tokenizer.json").unlink()
    held = sorted(p.name for p in folder.iterdir() if p.name.startswith("tokenizer") or p.suffix == ".model")
    with pytest.raises(UserError) as refused:
        read_tokenizer(folder, trust_remote_code=False)
    assert str(refused.value) == (
        f"{folder} holds {', '.join(held)} but not tokenizer.json, which its tokenizer is built from; copy "
        "tokenizer.json from the model it came from into it"
    )
