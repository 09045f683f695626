"""The output folder is safe by construction: never over the run's inputs, never over a user's file, and the
final files land whole (publish.atomic) or not at all."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HOLDER, another_run_holding, topic_run_args

from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.paths import check_local_paths
from cloudtrain.publish import atomic
from cloudtrain.publish.output_dir import (
    LOCK,
    MANIFEST,
    RUN_PATTERNS,
    check_location,
    claim,
    hold,
    is_run_name,
    record,
    release,
    users_files,
    written,
)

QUICK = ["--num_train_epochs", "1", "--per_device_train_batch_size", "8", "--mixed_precision", "no"]


def tree(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def train(model_dir, csvs, out, *extra) -> int:
    return main([*topic_run_args(model_dir, csvs, out), *QUICK, *extra])


@pytest.mark.parametrize(
    "where, message",
    [
        ("model", "is the input model's folder"),
        ("inside model", "is inside the input model's folder"),
        ("data folder", "holds the data"),
        ("checkpoint", "is the checkpoint being resumed"),
        ("checkpoints inside model", "is inside the input model's folder"),
        ("checkpoints over data", "holds the data"),
    ],
)
def test_an_output_folder_over_the_runs_inputs_is_refused_even_with_overwrite(
    where, message, tiny_model_dir, topic_csvs, tmp_path, capsys
):
    """--output_dir, and --checkpoint_dir (a run from m1 with --checkpoint_dir m1/checkpoints wrote into, and rotated
    away, the input run's own checkpoints)."""
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    folder = {
        "model": Path(tiny_model_dir),
        "inside model": Path(tiny_model_dir) / "sub",
        "data folder": topic_csvs["train"].parent,
        "checkpoint": checkpoint,
        "checkpoints inside model": Path(tiny_model_dir) / "checkpoints",
        "checkpoints over data": topic_csvs["train"].parent,
    }[where]
    flag = "--checkpoint_dir" if where.startswith("checkpoints") else "--output_dir"
    out = tmp_path / "out" if flag == "--checkpoint_dir" else folder
    before = {folder: tree(folder) for folder in (Path(tiny_model_dir), topic_csvs["train"].parent)}
    extra = ["--resume_from_checkpoint", str(checkpoint)] if where == "checkpoint" else []
    if flag == "--checkpoint_dir":
        extra = ["--checkpoint_dir", str(folder), "--checkpointing_steps", "1"]
    assert train(tiny_model_dir, topic_csvs, out, "--overwrite_output_dir", "true", *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {folder} {message}" in err[0], err
    assert f"choose a folder apart from it, e.g. {flag}" in err[0], err
    assert {folder: tree(folder) for folder in before} == before


def test_the_built_in_data_and_image_folders_are_inputs_too(tiny_model_dir, tmp_path, monkeypatch, capsys):
    builtin = tmp_path / "data" / "reuters-r8"
    builtin.mkdir(parents=True)
    for name in ("reuters-r8-train.tab", "reuters-r8-test.tab"):
        (builtin / name).write_text("label\ttext\n")
    monkeypatch.setenv("CLOUDTRAIN_DATA_DIR", str(tmp_path / "data"))
    images = tmp_path / "images"
    images.mkdir()
    cases = [
        (["--output_dir", str(builtin / "run")], f"is inside the built-in data {builtin}"),
        (["--output_dir", str(tmp_path / "data")], f"holds the built-in data {builtin}"),
    ]
    for argv, message in cases:  # refused before the data or the model is read
        assert main(["--model_name_or_path", tiny_model_dir, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    cfg = build_config({"task": "text_to_image", "train_data_dir": str(images)})
    with pytest.raises(UserError, match=f"--output_dir {images / 'run'} is inside the images {images}"):
        check_location(cfg, images / "run", [], None)
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        "data", "images", "reuters-r8", "reuters-r8-test.tab", "reuters-r8-train.tab"
    ]  # fmt: skip


def test_a_users_files_are_never_replaced_and_the_run_says_which(tiny_model_dir, topic_csvs, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "args.json").write_text("my own notes")
    (out / "metrics.jsonl").write_text("my own metrics")
    before = tree(out)
    assert train(tiny_model_dir, topic_csvs, out, "--overwrite_output_dir", "true") == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --output_dir {out} holds args.json, metrics.jsonl, which cloudtrain did not write and a run "
        f"would replace; move them elsewhere, or choose a new folder, e.g. --output_dir {out}-2"
    )
    assert tree(out) == before


def test_a_run_writes_only_its_own_names_keeps_other_files_and_replaces_a_model_whole(
    tiny_model_dir, topic_csvs, tmp_path
):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file beside the run")
    assert train(tiny_model_dir, topic_csvs, out, "--report_to", "tensorboard") == 0
    names = {p.name for p in out.iterdir()} - {"notes.txt", MANIFEST, LOCK}
    assert names and all(is_run_name(name) for name in names), sorted(n for n in names if not is_run_name(n))
    assert names <= written(out)
    assert "model.safetensors" in names and not (out / atomic.STAGING).exists()
    # an adapter replaces the full model as a whole: no full weights are left beside the adapter
    assert train(tiny_model_dir, topic_csvs, out, "--overwrite_output_dir", "true", "--peft", "lora") == 0
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert (out / "notes.txt").read_text() == "a user's file beside the run"
    assert not (out / atomic.PREVIOUS).exists()


def test_an_earlier_model_is_refused_early_and_by_the_pipeline_in_the_same_words(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    out = tmp_path / "out"
    steps = ["--max_steps", "2", "--checkpointing_steps", "2", "--eval_strategy", "no"]
    assert train(tiny_model_dir, topic_csvs, out, *steps) == 0
    capsys.readouterr()
    before = tree(out)
    refused = (
        f"error: --output_dir {out} already holds a model from an earlier run (kept); choose a new folder, e.g. "
        f"--output_dir {out}-2, or pass --overwrite_output_dir true to replace it"
    )
    assert train(tiny_model_dir, topic_csvs, out) == 2  # before the heavy imports (paths.check_earlier_model)
    assert capsys.readouterr().err.strip() == refused
    # `latest` where no checkpoint is: only the pipeline learns the run starts fresh, and it refuses alike
    no_checkpoints = ["--resume_from_checkpoint", "latest", "--checkpoint_dir", str(tmp_path / "none")]
    assert train(tiny_model_dir, topic_csvs, out, *no_checkpoints) == 2
    said = capsys.readouterr()
    assert "starting fresh" in said.out and said.err.strip() == refused
    assert tree(out) == before
    # the run resumed into its own folder is no earlier run's: it goes on
    assert (
        train(tiny_model_dir, topic_csvs, out, *steps[2:], "--max_steps", "4", "--resume_from_checkpoint", "latest")
        == 0
    )
    assert json.loads((out / "train_results.json").read_text())["global_step"] == 4


def test_the_early_check_leaves_overwriting_resumed_and_restarted_runs_to_the_pipeline(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("weights")
    record(out, ["model.safetensors"])
    with pytest.raises(UserError, match="already holds a model from an earlier run"):
        check_local_paths(build_config({"output_dir": str(out)}))
    (out / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    for extra in ({"overwrite_output_dir": True}, {"resume_from_checkpoint": "latest"},
                  {"resume_from_checkpoint": str(out / "checkpoints" / "checkpoint-2")}):  # fmt: skip
        check_local_paths(build_config({"output_dir": str(out), **extra}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted worker resumes from the latest checkpoint
    check_local_paths(build_config({"output_dir": str(out)}))


def test_a_missing_checkpoint_or_token_file_is_refused_before_the_heavy_imports(tmp_path, monkeypatch):
    """They were refused only after 12-16 s of imports (found in audit); a launch's processes still agree on a
    missing checkpoint in the run, which names the node that lacks it."""
    missing = str(tmp_path / "nope")
    with pytest.raises(UserError, match=f"--resume_from_checkpoint {missing} does not exist; give a checkpoint"):
        check_local_paths(build_config({"resume_from_checkpoint": missing}))
    with pytest.raises(UserError, match=f"--hub_token_file {missing} cannot be read"):
        check_local_paths(build_config({"push_to_hub": True, "hub_model_id": "a/b", "hub_token_file": missing}))
    check_local_paths(build_config({"resume_from_checkpoint": missing}), nodes=2)  # each node's own (review)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted worker resumes from the latest (review)
    check_local_paths(build_config({"resume_from_checkpoint": missing}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launch's processes: they agree in the run; only rank 0 reads the token
    check_local_paths(build_config({"resume_from_checkpoint": missing}))
    check_local_paths(build_config({"push_to_hub": True, "hub_model_id": "a/b", "hub_token_file": missing,
                                    "report_to": "none"}))  # fmt: skip


def test_a_users_file_in_merged_under_a_name_a_run_writes_is_theirs(tmp_path):
    """merge deleted merged/README.md and merged/my_predictions.jsonl of the user's with the merged/ it replaced
    (their names match what a run writes at the top, not what a merge writes; found in audit)."""
    merged = tmp_path / "merged"
    merged.mkdir()
    for name in ("model.safetensors", "args.json", "README.md", "my_predictions.jsonl", "notes.txt"):
        (merged / name).write_text(name)
    record(tmp_path, ["merged"])
    assert users_files(tmp_path) == ["merged/notes.txt"]  # a merge before its own record: by the names a run writes
    record(merged, ["model.safetensors", "args.json"])  # what the merge wrote (models/adapters.py)
    assert users_files(tmp_path) == ["merged/README.md", "merged/my_predictions.jsonl", "merged/notes.txt"]


def test_a_users_diffusers_files_are_theirs_and_a_pipeline_saved_there_is_an_earlier_model(tmp_path):
    """--task text_to_image writes a diffusers pipeline (its index and components' folders) or its LoRA weights,
    and validation images: found in a folder without a manifest, they are the user's (claim refuses them); listed,
    they are an earlier run's model."""
    out = tmp_path / "out"
    for folder in ("unet", "text_encoder_2", "validation"):
        (out / folder).mkdir(parents=True)
    for name in ("pytorch_lora_weights.safetensors", "model_index.json", "notes.txt"):
        (out / name).write_text("mine")
    found = ["model_index.json", "pytorch_lora_weights.safetensors", "text_encoder_2", "unet", "validation"]
    assert users_files(out) == found
    with pytest.raises(UserError, match="holds model_index.json, pytorch_lora_weights.safetensors, text_encoder_2"):
        claim(out)  # the pipeline's check, with or without --overwrite_output_dir
    record(out, ["pytorch_lora_weights.safetensors", "validation"])  # a LoRA run of ours
    with pytest.raises(UserError, match="already holds a model from an earlier run"):
        check_local_paths(build_config({"output_dir": str(out)}))


def test_run_patterns_name_no_users_usual_files():
    for name in ("notes.txt", "data.csv", "train.jsonl", "my_model.pt", "results.csv"):
        assert not is_run_name(name, RUN_PATTERNS), name


def stage(out: Path, files: dict[str, str]) -> None:
    staging = atomic.start_staging(out)
    for name, text in files.items():
        (staging / name).write_text(text)


def test_a_sealed_publish_interrupted_anywhere_is_finished_by_recover(tmp_path):
    """The publish's steps run one by one, and after each `recover` gives the new set whole."""
    new = {"config.json": "new config", "model.safetensors": "new weights", "args.json": "new args"}
    for stop_after in range(5):
        out = tmp_path / f"out{stop_after}"
        out.mkdir()
        for name, text in {"config.json": "old", "model.safetensors": "old", "old_only.json": "old"}.items():
            (out / name).write_text(text)
        stage(out, new)
        atomic.seal(out, remove=["old_only.json"])
        plan = json.loads((atomic.staging_dir(out) / atomic.SEALED).read_text())
        previous = out / atomic.PREVIOUS
        previous.mkdir()
        steps = [("aside", n) for n in ["old_only.json", *plan["names"]]] + [("in", n) for n in plan["names"]]
        for kind, name in steps[:stop_after]:  # what a kill after `stop_after` renames leaves
            if kind == "aside" and (out / name).exists():
                (out / name).replace(previous / name)
            elif kind == "in":
                (atomic.staging_dir(out) / name).replace(out / name)
        atomic.recover(out)
        assert {p.name: p.read_text() for p in out.iterdir()} == new, stop_after


def test_an_unsealed_staging_folder_is_dropped_and_the_previous_model_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    stage(out, {"model.safetensors": "half of the new"})
    atomic.recover(out)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"model.safetensors": "old"}


def test_a_save_that_cannot_fit_is_refused_with_the_space_it_needs(tmp_path):
    with pytest.raises(UserError, match=r"the final model needs about .* free in .* and .* is free; free some space"):
        atomic.check_free_space(tmp_path, 2**60, "the final model")
    atomic.check_free_space(tmp_path, 1, "the final model")  # fits


def test_a_folder_an_earlier_version_wrote_is_recognised_by_its_arguments(tmp_path):
    out = tmp_path / "old-version"
    out.mkdir()
    (out / "model.safetensors").write_text("weights")
    (out / "args.json").write_text(json.dumps({"task": "classification", "training_type": "basic", "output_dir": "x"}))
    assert {"model.safetensors", "args.json"} <= written(out)
    (out / "args.json").write_text(json.dumps({"my": "notes"}))  # a user's own args.json
    assert written(out) == set()


def test_a_second_run_in_a_folder_in_use_is_refused_in_one_line_and_the_first_runs_files_are_kept(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    """Two runs in one folder would write over each other's checkpoints, log and model: the second is refused
    before it reads any data, naming the first; the lock goes with the first run's process, even when killed."""
    out = tmp_path / "out"
    holder = another_run_holding(out)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    record(out, ["metrics.jsonl"])
    before = tree(out)
    for extra in ([], ["--overwrite_output_dir", "true"], ["--resume_from_checkpoint", "latest"]):
        assert train(tiny_model_dir, topic_csvs, out, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --output_dir {out} is in use by another run (pid {holder.pid} on "), err
        assert err.endswith(f"wait for it to end, or choose another folder, e.g. --output_dir {out}-2"), err
        assert "\n" not in err and "Traceback" not in err
    assert tree(out) == before
    holder.kill()
    holder.wait()
    hold(out)  # a killed run's lock file is not held
    hold(out)  # nor is this process's own, for its next run (the Python API)
    release(out)
    assert LOCK in before and tree(out) == {k: v for k, v in before.items() if k != LOCK}  # it went with the lock


def test_a_checkpoint_folder_outside_the_output_folder_is_held_too(tiny_model_dir, topic_csvs, tmp_path, capsys):
    shared = tmp_path / "checkpoints"
    holder = another_run_holding(shared)
    try:
        assert train(tiny_model_dir, topic_csvs, tmp_path / "out", "--checkpoint_dir", str(shared)) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --checkpoint_dir {shared} is in use by another run (pid {holder.pid} on ")
        assert err.endswith(f"or choose another folder, e.g. --checkpoint_dir {shared}-2") and "\n" not in err
        assert not (tmp_path / "out").exists()  # held first, then let go whole: the refused run left nothing
    finally:
        holder.kill()
        holder.wait()


def test_a_checkpoint_folder_inside_another_runs_output_folder_is_refused(tiny_model_dir, topic_csvs, tmp_path, capsys):
    """Run B given run A's <output_dir>/checkpoints as its --checkpoint_dir deleted A's live checkpoints (with
    --overwrite_output_dir) and wrote its own among them: that folder was never held (found in audit)."""
    a = tmp_path / "a"
    holder = another_run_holding(a)
    try:
        for made in (False, True):  # before A's first checkpoint, and after (A holds its own folder then too)
            if made:
                (a / "checkpoints").mkdir()
            args = ("--checkpoint_dir", str(a / "checkpoints"), "--overwrite_output_dir", "true")
            assert train(tiny_model_dir, topic_csvs, tmp_path / "b", *args) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"error: --checkpoint_dir {a / 'checkpoints'} lies in {a}, which another run holds "
                                  f"(pid {holder.pid} on "), err  # fmt: skip
            assert err.endswith("wait for it to end, or choose another folder") and not (tmp_path / "b").exists()
    finally:
        holder.kill()
        holder.wait()
    checkpoints = a / "checkpoints"
    holder = another_run_holding(checkpoints)  # B, holding it first: A may not resume into it
    try:
        assert train(tiny_model_dir, topic_csvs, a, "--resume_from_checkpoint", "latest") == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --checkpoint_dir {checkpoints} is in use by another run (pid {holder.pid} on ")
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_released_at_the_end_of_a_run(tmp_path):
    out = tmp_path / "out"
    hold(out)
    held = subprocess.run([sys.executable, "-c", HOLDER, str(out)], input=b"", capture_output=True)
    assert held.returncode == 1 and b"is in use by another run (pid %d on " % os.getpid() in held.stderr
    release(out)
    assert subprocess.run([sys.executable, "-c", HOLDER, str(out)], input=b"", capture_output=True).stdout == b"held\n"


FORKING_HOLDER = """
import os, sys, time
from cloudtrain.publish.output_dir import hold
hold(sys.argv[1])
if os.fork() == 0:  # a loader worker, say, that outlives its run; it says its pid once its at-fork hooks ran
    print(os.getpid(), flush=True)
    time.sleep(120)
    os._exit(0)
input()
"""


def test_a_forked_child_outliving_a_killed_run_does_not_keep_its_folder(tmp_path):
    out = tmp_path / "out"
    run = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert run.stdout is not None
    child = int(run.stdout.readline())
    try:
        with pytest.raises(UserError, match="is in use by another run"):
            hold(out)
        run.kill()
        run.wait()
        os.kill(child, 0)  # still alive
        hold(out)
        release(out)
    finally:
        os.kill(child, 9)


@pytest.mark.parametrize(
    "args, overwrites",
    [("", True), ("--output_dir runs/a", False), ("--output_dir=runs/a --seed 1", False), ("--config a.yaml", False)],
)
def test_make_train_overwrites_its_own_default_folder_only(args, overwrites):
    """`make train ARGS="--output_dir X"` replaced an earlier model in X without being asked (found in audit)."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["make", "-n", "train", f"ARGS={args}"], cwd=root, capture_output=True, text=True)
    command = next(line for line in shown.stdout.splitlines() if "training_application.py" in line)
    assert ("--overwrite_output_dir true" in command) == overwrites and command.rstrip().endswith(args)


def test_make_dpo_keeps_its_options_from_the_sft_run_it_starts(tmp_path):
    """`make dpo ARGS="--beta 0.3"` passed --beta to the `make sft` it runs first (left alone earlier)."""
    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(
        ["make", "-n", "dpo", "ARGS=--beta 0.3", f"SFT_MODEL={tmp_path / 'missing'}", f"DPO_DATA={root / 'Makefile'}"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    commands = [line for line in shown.stdout.splitlines() if "training_application.py" in line]
    sft, dpo = (next(c for c in commands if name in c) for name in ("sft_r8", "dpo_r8"))
    assert "--beta" not in sft and dpo.rstrip().endswith("--beta 0.3")


def test_another_node_s_folder_of_its_checkpoints_passes_the_early_check(tmp_path):
    """Node 1 of a node-local launch keeps its checkpoints in its own folder, which only the main process's manifest
    lists: the check before the imports refused node 1's restart, and node 0 waited for it (review)."""
    from cloudtrain.paths import check_users_files

    (tmp_path / "out" / "checkpoints" / "checkpoint-7").mkdir(parents=True)
    check_users_files(tmp_path / "out")
    (tmp_path / "out" / "args.json").write_text("{}")
    with pytest.raises(UserError, match="holds args.json, which cloudtrain did not write"):
        check_users_files(tmp_path / "out")


def test_a_command_reading_a_folder_leaves_the_final_save_a_live_run_is_writing(tmp_path):
    """`predict`, `generate` and `merge` took a live run's half-written final save for one a kill left and removed
    it: the run then failed and lost what it trained (found in audit). While a run holds the folder its staging
    folder stays; once no run holds it, a staging folder left by a kill goes."""
    from cloudtrain.commands import existing_run_dir
    from cloudtrain.publish.atomic import staging_dir

    out = tmp_path / "out"
    (staging_dir(out) / "model.safetensors").parent.mkdir(parents=True)
    (staging_dir(out) / "model.safetensors").write_bytes(b"half written")
    holder = another_run_holding(out)
    try:
        assert existing_run_dir("--model_dir", str(out)) == out
        assert (staging_dir(out) / "model.safetensors").read_bytes() == b"half written"
    finally:
        holder.kill()
        holder.wait()
    existing_run_dir("--model_dir", str(out))
    assert not staging_dir(out).exists() and not (out / ".cloudtrain-lock").exists()


def test_a_file_or_an_empty_value_as_the_checkpoint_to_resume_says_what_it_is(tmp_path):
    """A weights file was said not to exist, and an empty value was read as the working folder (found in audit)."""
    from cloudtrain.config import resolve_options
    from cloudtrain.resume import choose_resume, local_view

    weights = tmp_path / "checkpoint-4" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"x")
    cfg = build_config({"resume_from_checkpoint": str(weights)})
    with pytest.raises(UserError) as refused:
        choose_resume(cfg, tmp_path, [local_view(cfg, tmp_path)])
    assert str(refused.value) == (
        f"--resume_from_checkpoint {weights} is a file, not a checkpoint directory; give the folder that holds it "
        f"({weights.parent}), or latest"
    )
    with pytest.raises(UserError, match="^--resume_from_checkpoint is empty: give a checkpoint directory, latest, or"):
        resolve_options({"resume_from_checkpoint": " "}, {})
