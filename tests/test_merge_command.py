"""`cloudtrain merge` on folders it did not make: a training checkpoint, a user's merged.partial/ or merged.replaced/
(found in audit)."""

import json

import pandas as pd
import pytest
from conftest import topic_rows

from cloudtrain.errors import UserError


@pytest.fixture
def adapter_run(tiny_model_dir, tmp_path):
    """A LoRA run's output folder, after one step."""
    from cloudtrain.config import build_config
    from cloudtrain.pipeline import run_training

    csv = tmp_path / "train.csv"
    pd.DataFrame(topic_rows(4)).to_csv(csv, index=False)
    out = tmp_path / "out"
    options = {"model_name_or_path": tiny_model_dir, "train_file": str(csv), "output_dir": str(out), "peft": "lora",
               "max_steps": 1, "eval_strategy": "no", "report_to": "none", "mixed_precision": "no"}  # fmt: skip
    run_training(build_config(options))
    return out


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
    assert main(["merge", "--output_dir", str(adapter_run)]) == 0
    assert main(["merge", "--output_dir", str(adapter_run)]) == 0  # replaces its own merged/
    names = sorted(p.name for p in adapter_run.iterdir() if p.name.startswith("merged"))
    assert names == ["merged"]
    assert (adapter_run / "notes" / "notes.txt").read_text() == "mine"
