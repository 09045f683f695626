"""Pushing to the Hub, against a local Hub API server (tests/hub_server.py) and the real client.

The application runs in a subprocess with HF_ENDPOINT pointing at the server, because
huggingface_hub reads it at import time: the production code path is the one users run.
In-process tests point the already imported client at the server through its constants.
"""

import json
import os
import shlex
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest
from conftest import ENTRY, REPO, another_run_holding, child_pythonpath, topic_rows
from hub_server import HubServer, User
from huggingface_hub import ModelCard, constants, hf_hub_download, metadata_load

from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.publish import hub as cloudhub
from cloudtrain.publish.classifier_card import build_model_card
from cloudtrain.publish.hub import write_card
from cloudtrain.publish.output_dir import claim, edited, record, record_run_files, written
from cloudtrain.publish.saving import MERGED, holds_model

TOKEN = "hf_alice_0a1b2c3d4e5f6a7b8c9d"  # distinctive, so a leak anywhere is found by a plain search
BOB_TOKEN = "hf_bob_99887766554433221100"
READ_TOKEN = "hf_carol_read_only_123456789"
MODEL_FILES = {
    "README.md",
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "args.json",
    "train_results.json",
    "eval_results.json",
    "test_results.json",
    "compute_results.json",  # device-hours (and a SageMaker job's cost estimate), also in the card
}


@pytest.fixture(scope="module")
def hub():
    server = HubServer(
        {TOKEN: User("alice", orgs=["alice-lab"]), BOB_TOKEN: User("bob"), READ_TOKEN: User("carol", role="read")}
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    import pandas as pd

    folder = tmp_path_factory.mktemp("topics")
    for split, n, offset in (("train", 20, 0), ("validation", 4, 1), ("test", 4, 2)):
        pd.DataFrame(topic_rows(n, offset)).to_csv(folder / f"{split}.csv", index=False)
    return folder


def hub_env(hub: HubServer, token_file, token: str | None = None) -> dict:
    """The environment of a user whose HF_ENDPOINT is the local server and whose stored login is `token_file`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HUB_OFFLINE="0",
        HF_TOKEN_PATH=str(token_file),
        PYTHONUNBUFFERED="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    if token:
        env["HF_TOKEN"] = token
    return env


def run_app(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "src/training_application.py", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )


def train_args(model_dir: str, data_files, out, *extra: str) -> list[str]:
    return [
        "--model_name_or_path",
        model_dir,
        "--train_file",
        str(data_files / "train.csv"),
        "--validation_file",
        str(data_files / "validation.csv"),
        "--test_file",
        str(data_files / "test.csv"),
        "--max_steps",
        "4",
        "--logging_steps",
        "2",
        "--max_length",
        "32",
        "--output_dir",
        str(out),
        *extra,
    ]


@pytest.fixture
def in_process(hub, monkeypatch, tmp_path):
    """The client already imported in this process talks to the local server, with no stored login."""
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    return hub


def hub_config(repo_id: str, token: str | None = TOKEN, **options):
    return build_config({"push_to_hub": True, "hub_model_id": repo_id, "hub_token": token, **options})


# ---------------------------------------------------------------- a training run that pushes at the end


@pytest.fixture(scope="module")
def pushed(hub, tiny_model_dir, data_files, tmp_path_factory):
    """One short training run with --push_to_hub, the token given as a flag (the riskiest place for it)."""
    out = tmp_path_factory.mktemp("pushed") / "model"
    result = run_app(
        hub_env(hub, out.parent / "no-stored-token"),
        *train_args(
            tiny_model_dir,
            data_files,
            out,
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "alice/topics",
            "--hub_private_repo",
            "true",
            "--hub_token",
            TOKEN,
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.slow
def test_push_creates_the_repo_and_commits_exactly_the_model_files(pushed, hub):
    out, result = pushed
    repo = hub.repos["alice/topics"]
    assert repo.private
    initial, upload = hub.history("alice/topics")
    assert initial.summary == "initial commit"
    expected = MODEL_FILES | ({"training_curves.png"} if (out / "training_curves.png").exists() else set())
    assert set(upload.added) == expected and not upload.deleted
    assert upload.added["model.safetensors"] == (out / "model.safetensors").read_bytes()  # byte-identical weights
    for name in expected - {"args.json"}:
        assert upload.added[name] == (out / name).read_bytes(), name
    # args.json goes up with each absolute path as its last part, as the card shows them (found in audit)
    assert json.loads((out / "args.json").read_text())["output_dir"] == str(out)
    assert json.loads(upload.added["args.json"])["output_dir"] == out.name and b'"/' not in upload.added["args.json"]
    assert (out / "metrics.jsonl").exists() and "metrics.jsonl" not in upload.added
    assert "eval accuracy" in upload.summary
    assert f"to {hub.url}/alice/topics (commit {upload.oid[:8]})" in result.stdout


@pytest.mark.slow
def test_the_uploaded_card_parses_and_carries_the_eval_metrics(pushed, in_process, tmp_path):
    out, _ = pushed
    readme = hf_hub_download("alice/topics", "README.md", token=TOKEN, cache_dir=tmp_path)  # through resolve
    metadata = metadata_load(readme)
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-classification"
    assert {"text-classification", "cloudtrain"} <= set(metadata["tags"])
    assert metadata["model-index"][0]["name"] == "topics"
    card = ModelCard.load(readme)
    for split, name in (("validation", "eval"), ("test", "test")):
        run = json.loads((out / f"{name}_results.json").read_text())
        on_card = {r.metric_type: r.metric_value for r in card.data.eval_results if r.dataset_split == split}
        assert on_card == {"accuracy": round(run["accuracy"], 4), "f1": round(run["macro_f1"], 4)}, split
        assert f"| {split} | {run['samples']} | {run['accuracy']:.4f} |" in card.text
    assert 'pipeline("text-classification", model="alice/topics")' in card.text
    assert "| learning_rate | 0.0001 |" in card.text and "| max_steps | 4 |" in card.text
    assert "| 0 | finance |" in card.text  # label names from config.json
    assert "- transformers " in card.text


@pytest.mark.slow
def test_the_token_is_in_no_file_and_no_output_line(pushed):
    out, result = pushed
    files = [path for path in out.rglob("*") if path.is_file()]
    assert files
    for path in files:
        assert TOKEN.encode() not in path.read_bytes(), path
    assert TOKEN not in result.stdout and TOKEN not in result.stderr
    assert "hub_token" not in json.loads((out / "args.json").read_text())


# ---------------------------------------------------------------- failures


@pytest.mark.slow
def test_a_bad_token_fails_before_training(hub, tiny_model_dir, data_files, tmp_path):
    out = tmp_path / "model"
    bad = "hf_not_a_valid_token_42"
    before = len(hub.requests)
    result = run_app(
        hub_env(hub, tmp_path / "no-stored-token", token=bad),
        *train_args(tiny_model_dir, data_files, out, "--push_to_hub", "true", "--hub_model_id", "alice/never"),
    )
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: checking Hub access failed: the Hub rejected the token (401"), error
    assert "HF_TOKEN" in error and "--hub_token" in error  # how to fix it
    assert not out.exists() and "data:" not in result.stdout  # nothing was loaded or trained
    assert hub.requests[before:] == [("GET", "/api/whoami-v2")] and "alice/never" not in hub.repos
    assert bad not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_failed_push_keeps_the_run_and_the_retry_command_pushes_it(hub, tiny_model_dir, data_files, tmp_path):
    out = tmp_path / "model"
    hub.refuse_commits = "storage quota exceeded"
    try:
        result = run_app(
            hub_env(hub, tmp_path / "no-stored-token", token=TOKEN),
            *train_args(
                tiny_model_dir,
                data_files,
                out,
                "--push_to_hub",
                "true",
                "--hub_model_id",
                "alice/retry",
                "--hub_revision",
                "dev",
            ),
        )
    finally:
        hub.refuse_commits = None
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "pushing to alice/retry failed" in error and "storage quota exceeded" in error
    assert "trained 4 steps" in result.stdout  # the failure came after training
    assert holds_model(out) and (out / "eval_results.json").exists() and (out / "tokenizer.json").exists()
    assert len(hub.history("alice/retry", "dev")) == 1  # only the initial commit: nothing landed
    command = error.split("retry with: ")[1]
    assert command.endswith(  # after this interpreter, named as it runs from here (cloudtrain.invocation)
        f" src/training_application.py push --output_dir {out.resolve()} --hub_model_id alice/retry --hub_revision dev"
    )

    # The retry, as the user would run it, now with the token from the stored login (`hf auth login`).
    stored = tmp_path / "stored-token"
    stored.write_text(TOKEN)
    argv = shlex.split(command)
    holder = another_run_holding(out)  # a run writing the folder again: its model is not pushed half-written
    try:
        held = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=hub_env(hub, stored), cwd=REPO)
    finally:
        holder.kill()
        holder.wait()
    assert held.returncode == 2 and "is in use by another run" in held.stderr.strip().splitlines()[-1]
    assert len(hub.history("alice/retry", "dev")) == 1
    retry = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=hub_env(hub, stored), cwd=REPO)
    assert retry.returncode == 0, retry.stderr[-3000:]
    upload = hub.history("alice/retry", "dev")[-1]
    assert set(upload.added) >= MODEL_FILES
    assert upload.added["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert len(hub.history("alice/retry", "main")) == 1  # the branch got the push, main did not
    assert 'revision="dev"' in upload.added["README.md"].decode()
    assert TOKEN not in result.stdout + result.stderr + retry.stdout + retry.stderr
    assert "README.md" in written(out)  # the card is cloudtrain's: a later run with --overwrite_output_dir takes it


def test_the_card_is_written_whole_and_a_users_own_readme_is_kept_and_pushed_as_it_is(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("# my own card")
    write_card(out, lambda path: path.write_text("generated"))
    assert (out / "README.md").read_text() == "# my own card" and "README.md" not in written(out)
    assert "is not one cloudtrain wrote: it is kept, and pushed as the model card" in capsys.readouterr().out
    (out / "README.md").unlink()
    write_card(out, lambda path: path.write_text("generated"))
    assert (out / "README.md").read_text() == "generated" and "README.md" in written(out)
    write_card(out, lambda path: path.write_text("generated again"))  # its own card is replaced
    assert (out / "README.md").read_text() == "generated again" and sorted(p.name for p in out.iterdir()) == [
        ".cloudtrain-manifest.json",
        "README.md",
    ]


def test_a_card_the_user_edited_after_the_run_is_kept_by_a_push_and_by_an_overwriting_run(tmp_path, capsys):
    out = tmp_path / "run"
    write_card(out_made(out), lambda path: path.write_text("generated"))
    record(out, ["config.json"])  # other names recorded later keep the card's digest
    assert "README.md" in written(out)
    (out / "README.md").write_text("generated\n\n## Limitations\nmy own words")
    assert "README.md" not in written(out) and edited(out) == {"README.md"}
    write_card(out, lambda path: path.write_text("generated again"))
    assert (out / "README.md").read_text().endswith("my own words")
    assert "was edited since cloudtrain wrote it: it is kept, and pushed as the model card" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"holds README.md, which cloudtrain did not write \(README.md edited since\)"):
        claim(out)  # a run with --overwrite_output_dir would replace it: refused before anything is written
    (out / "README.md").unlink()  # gone: nothing of the user's is left to keep
    write_card(out, lambda path: path.write_text("generated"))
    assert "README.md" in written(out) and not edited(out)


def test_a_card_cloudtrain_writes_again_is_its_own_and_an_edit_stays_the_users(tmp_path):
    out, staging = out_made(tmp_path / "run"), out_made(tmp_path / "staging")
    write_card(out, lambda path: path.write_text("generated"))
    (staging / "README.md").write_text("a blank card a PEFT save writes")
    record(out, ["README.md"], source=staging)  # recorded before the publish moves it in, as save_final does
    os.replace(staging / "README.md", out / "README.md")
    assert "README.md" in written(out) and not edited(out)
    (out / "README.md").write_text("edited while a run went on")
    record_run_files(out)  # the end of that run: the edit is not taken for the run's
    record(out, ["merged"])  # nor by a later record of other names
    assert edited(out) == {"README.md"} and "README.md" not in written(out) and "merged" in written(out)


def out_made(out: Path) -> Path:
    out.mkdir(parents=True)
    return out


@pytest.mark.parametrize("repo_id, existing", [("bob/new-model", False), ("bob/his-model", True)])
def test_a_repo_of_another_user_is_refused_before_training(in_process, repo_id, existing):
    if existing:
        cloudhub.check_access(hub_config(repo_id, token=BOB_TOKEN).hub)
    with pytest.raises(UserError) as caught:
        cloudhub.check_access(hub_config(repo_id).hub)
    message = str(caught.value)
    assert f"user alice may not write to {repo_id} (403 Forbidden" in message
    assert "--hub_model_id alice/<name>" in message and TOKEN not in message
    assert (repo_id in in_process.repos) == existing


def test_a_private_push_into_an_existing_public_repo_is_refused_before_training(in_process):
    """--hub_private_repo true pushed into an existing public repository without a word (found in audit)."""
    cloudhub.check_access(hub_config("alice/open").hub)  # made public
    with pytest.raises(UserError, match="--hub_private_repo true, but alice/open already exists and is public"):
        cloudhub.check_access(hub_config("alice/open", hub_private_repo=True).hub)
    assert not in_process.repos["alice/open"].private
    cloudhub.check_access(hub_config("alice/closed", hub_private_repo=True).hub)
    cloudhub.check_access(hub_config("alice/closed", hub_private_repo=True).hub)  # private already: goes on
    assert in_process.repos["alice/closed"].private


def test_a_read_only_token_and_a_missing_token_are_refused(in_process):
    with pytest.raises(UserError, match="the token of user carol is read-only; .*write access"):
        cloudhub.check_access(hub_config("carol/model", token=READ_TOKEN).hub)
    with pytest.raises(
        UserError, match="pushing to the Hub needs a token with write access: set HF_TOKEN, pass --hub_token"
    ):
        cloudhub.check_access(hub_config("alice/model", token=None).hub)


def test_push_takes_the_token_from_the_environment_once_the_runs_token_file_is_gone(tmp_path):
    """args.json names the training run's --hub_token_file; once it was gone `push` refused, though HF_TOKEN was
    set (found in audit)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train_results.json").write_text('{"global_step": 1}')
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    (tmp_path / "args.json").write_text(json.dumps({"hub_token_file": str(token_file)}))
    assert cloudhub.load_output_dir(tmp_path)[0].hub.hub_token_file == str(token_file)  # still there: used
    token_file.unlink()
    assert cloudhub.load_output_dir(tmp_path)[0].hub.hub_token_file is None


def test_push_takes_hf_token_before_the_runs_token_file(tmp_path, monkeypatch):
    """--help says HF_TOKEN comes first; a revoked token left in the run's --hub_token_file won (found in audit)."""
    import argparse

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train_results.json").write_text('{"global_step": 1}')
    (tmp_path / "token").write_text("hf_revoked_0000000000000000")
    (tmp_path / "args.json").write_text(json.dumps({"hub_token_file": str(tmp_path / "token")}))
    used = []
    monkeypatch.setattr(cloudhub, "check_access", lambda hub: used.append(hub.hub_token_file))
    monkeypatch.setattr(cloudhub, "push_output_dir", lambda *args: None)
    options = dict.fromkeys(("hub_token", "hub_token_file", "hub_private_repo", "hub_revision"))
    args = argparse.Namespace(output_dir=str(tmp_path), hub_model_id="alice/x", **options)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    cloudhub.run(args)
    monkeypatch.delenv("HF_TOKEN")
    cloudhub.run(args)
    assert used == [None, str(tmp_path / "token")]  # without HF_TOKEN the run's file, as before


def test_push_command_needs_a_finished_run(tmp_path, capsys):
    assert main(["push", "--output_dir", str(tmp_path), "--hub_model_id", "alice/x"]) == 2
    assert "holds no finished run" in capsys.readouterr().err
    assert main(["push", "--output_dir", str(tmp_path / "typo"), "--hub_model_id", "alice/x"]) == 2
    assert f"--output_dir {tmp_path / 'typo'} does not exist; give a directory" in capsys.readouterr().err
    (tmp_path / "args.json").write_text("{}")
    assert main(["push", "--output_dir", str(tmp_path / "args.json"), "--hub_model_id", "alice/x"]) == 2
    assert "args.json is a file; give the directory the training application wrote" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")  # a finished run whose results a user broke: one line each
    for results in ('{"global_step": 1', "[1, 2]"):
        (tmp_path / "train_results.json").write_text(results)
        assert main(["push", "--output_dir", str(tmp_path), "--hub_model_id", "alice/x"]) == 2
        assert f"error: {tmp_path / 'train_results.json'} " in capsys.readouterr().err
    (tmp_path / "train_results.json").write_text('{"global_step": 1}')
    assert main(["push", "--output_dir", str(tmp_path), "--hub_model_id", ""]) == 2
    assert "error: --hub_model_id is empty: give <user or organization>/<name>" in capsys.readouterr().err


def test_a_push_leaves_out_the_users_files_that_share_a_model_files_name(tmp_path, capsys):
    """`push` uploaded tokenizer_corpus.txt and vocab.backup, a user's files beside the run's (their names match
    the upload patterns); the model card, the user's own included, still goes up (found in audit)."""
    out = tmp_path / "run"
    (out / MERGED).mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "README.md", "tokenizer_corpus.txt", "vocab.backup",
                 f"{MERGED}/model.safetensors", f"{MERGED}/vocab.old"):  # fmt: skip
        (out / name).write_text(name)
    record(out, ["model.safetensors", "tokenizer.json", MERGED])
    record(out / MERGED, ["model.safetensors"])
    ours, theirs = cloudhub.written_by_cloudtrain(out, cloudhub.model_files(out))
    assert [str(p.relative_to(out)) for p in ours] == [
        "README.md", "merged/model.safetensors", "model.safetensors", "tokenizer.json"
    ]  # fmt: skip
    assert [str(p.relative_to(out)) for p in theirs] == ["merged/vocab.old", "tokenizer_corpus.txt", "vocab.backup"]
    (out / MERGED / ".cloudtrain-manifest.json").unlink()  # a merge from before it recorded its files: by name
    ours, _ = cloudhub.written_by_cloudtrain(out, cloudhub.model_files(out))
    assert "merged/model.safetensors" in [str(p.relative_to(out)) for p in ours]  # (it was left out and deleted)


def test_a_push_of_a_runs_merged_folder_points_to_its_run(tmp_path, capsys):
    """`push --output_dir run/merged` said the run did not finish (found in audit)."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 4}))
    (tmp_path / MERGED).mkdir()
    assert main(["push", "--output_dir", str(tmp_path / MERGED), "--hub_model_id", "alice/x"]) == 2
    assert f"is the merged model of the run in {tmp_path}: push that folder" in capsys.readouterr().err


# ---------------------------------------------------------------- pushes during training


def folder_of(folder: Path, *names: str) -> Path:
    """`folder` made, holding a file of each name, its text a JSON object naming it."""
    folder.mkdir()
    for name in names:
        (folder / name).write_text(json.dumps({"name": name}))
    return folder


def make_save(folder, step: int):
    """What a save during training writes: model files and, in a checkpoint, optimizer state."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(2048))
    (folder / "config.json").write_text(json.dumps({"step": step}))
    (folder / "optimizer.pt").write_bytes(os.urandom(512))
    (folder / f"rng_state_{step}.pth").write_bytes(os.urandom(64))
    return folder


def test_background_uploader_makes_one_commit_per_upload_in_order(in_process, tmp_path):
    cfg = hub_config("alice/in-progress")
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    saves = [make_save(tmp_path / f"checkpoint-{step}", step) for step in (2, 4, 6)]
    in_process.commits_open.clear()  # the Hub is slow: upload() must not wait for it
    try:
        for step, folder in zip((2, 4, 6), saves, strict=True):
            uploader.upload(folder, f"Training in progress, step {step}")
            uploader.upload(folder, f"Checkpoint at step {step}", path_in_repo="last-checkpoint")
        assert len(in_process.history("alice/in-progress")) == 1  # queued, none committed yet
    finally:
        in_process.commits_open.set()
    uploader.wait()

    commits = in_process.history("alice/in-progress")[1:]
    assert [c.summary for c in commits] == [
        message
        for step in (2, 4, 6)
        for message in (f"Training in progress, step {step}", f"Checkpoint at step {step}")
    ]
    for (model, checkpoint), folder in zip(zip(commits[::2], commits[1::2], strict=True), saves, strict=True):
        assert model.added == {name: (folder / name).read_bytes() for name in ("model.safetensors", "config.json")}
        assert checkpoint.added == {f"last-checkpoint/{p.name}": p.read_bytes() for p in folder.iterdir()}
    final = commits[-1].files
    assert final["model.safetensors"] == (saves[-1] / "model.safetensors").read_bytes()
    assert sorted(p for p in final if p.startswith("last-checkpoint/")) == sorted(  # older checkpoints replaced
        f"last-checkpoint/{p.name}" for p in saves[-1].iterdir()
    )


def test_args_json_goes_up_with_path_options_reduced_and_prompts_as_written(tmp_path):
    """A prompt that starts with "/" (Qwen3's "/no_think") was cut as a path, and merged/args.json went up whole
    (found in review)."""
    arguments = {"train_file": "/home/alice/secret/train.txt", "system_prompt": "/no_think Answer yes/no briefly.",
                 "output_dir": "/tmp/run", "datasets": [{"path": "/data/web/*.jsonl", "weight": 2}],
                 "model_name_or_path": "/models/llama", "sample_prompts": ["/imagine a castle"], "seed": 3}  # fmt: skip
    (tmp_path / "merged").mkdir()
    for folder in (tmp_path, tmp_path / "merged"):
        (folder / "args.json").write_text(json.dumps(arguments))
        sent = json.loads(cloudhub.hub_copy(folder / "args.json", None))
        assert sent == {**arguments, "train_file": "train.txt", "output_dir": "run", "model_name_or_path": "llama",
                        "datasets": [{"path": "*.jsonl", "weight": 2}]}  # fmt: skip


def test_a_checkpoint_goes_up_in_one_commit_however_many_files_it_holds(in_process, tmp_path):
    """upload_folder committed a large folder in parts: a kill between them left last-checkpoint/ with one
    checkpoint's weights beside another's state (found in audit). One commit holds it all, stale files deleted."""
    cfg = hub_config("alice/big-checkpoint")
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    older = make_save(tmp_path / "checkpoint-2", 2)
    (older / "only-in-2.json").write_text("{}")
    uploader.upload(older, "Checkpoint at step 2", path_in_repo="last-checkpoint")
    newer = make_save(tmp_path / "checkpoint-4", 4)
    for k in range(300):  # more files than one of upload_folder's commits takes (256)
        (newer / "shards" / f"{k:03d}.bin").parent.mkdir(exist_ok=True)
        (newer / "shards" / f"{k:03d}.bin").write_bytes(os.urandom(16))
    uploader.upload(newer, "Checkpoint at step 4", path_in_repo="last-checkpoint")
    uploader.wait()
    commits = in_process.history("alice/big-checkpoint")[1:]
    assert [c.summary for c in commits] == ["Checkpoint at step 2", "Checkpoint at step 4"]
    expected = {f"last-checkpoint/{p.relative_to(newer).as_posix()}" for p in newer.rglob("*") if p.is_file()}
    assert set(commits[-1].files) - {".gitattributes"} == expected  # only-in-2.json is gone


def test_a_save_during_training_deletes_an_earlier_runs_card_and_results(in_process, tmp_path):
    """--hub_strategy every_save over a repo an earlier run pushed: its card, arguments and results stayed beside
    the new run's weights, describing other ones (found in audit). The final push writes this run's."""
    cfg = hub_config("alice/card-gone")
    cloudhub.check_access(cfg.hub)
    api = cloudhub.hub_api(cfg.hub)
    earlier = folder_of(
        tmp_path / "earlier", "README.md", "args.json", "eval_results.json", "training_curves.png", "notes.txt"
    )
    api.upload_folder(repo_id="alice/card-gone", folder_path=earlier, commit_message="earlier run")
    uploader = cloudhub.HubUploader(cfg)
    uploader.upload(make_save(tmp_path / "checkpoint-2", 2), "Training in progress, step 2")
    uploader.wait()
    files = set(in_process.history("alice/card-gone")[-1].files)
    assert {"model.safetensors", "config.json", "notes.txt"} <= files  # a file of the user's own stays
    assert not files & {"README.md", "args.json", "eval_results.json", "training_curves.png"}


def test_a_push_replaces_an_earlier_runs_model_files_and_keeps_the_users_others(in_process, tmp_path):
    """A full model pushed over an adapter run: the old adapter_config.json made transformers apply the old
    adapter to the new model, and an old test_results.json outlived a run without a test split."""
    cfg = hub_config("alice/swap")
    cloudhub.check_access(cfg.hub)
    api = cloudhub.hub_api(cfg.hub)
    adapter, full = tmp_path / "adapter", tmp_path / "full"
    for folder, names in ((adapter, ["adapter_config.json", "adapter_model.safetensors", "test_results.json"]),
                          (full, ["config.json", "model.safetensors"])):  # fmt: skip
        folder.mkdir()
        for name in [*names, "README.md", "args.json"]:
            (folder / name).write_text(json.dumps({"from": folder.name}))
    (adapter / "merged").mkdir()
    (adapter / "merged" / "model.safetensors").write_text("merged")
    commit = partial(cloudhub.commit_model_files, api, cfg.hub, message="push", base_model=None)
    commit(folder=adapter, files=cloudhub.model_files(adapter))
    api.upload_file(path_or_fileobj=b"mine", path_in_repo="notes.md", repo_id="alice/swap")  # the user's own
    commit(folder=full, files=cloudhub.model_files(full))  # the final push
    final = in_process.history("alice/swap")[-1].files
    assert sorted(final) == [".gitattributes", "README.md", "args.json", "config.json", "model.safetensors",
                             "notes.md"]  # fmt: skip
    assert json.loads(final["args.json"]) == {"from": "full"}


def test_a_local_base_model_is_never_named_as_a_hub_id_wherever_push_runs(tmp_path, monkeypatch):
    """args.json kept `tiny-bert` as given: `push` from another folder (or machine) took it for a Hub id, named it
    the card's base_model and wrote it into the adapter's config (found in audit)."""
    from cloudtrain.config import ModelConfig
    from cloudtrain.publish.card_metadata import base_model_info
    from cloudtrain.publish.saving import write_arguments

    (tmp_path / "tiny-bert").mkdir()
    monkeypatch.chdir(tmp_path)
    write_arguments(build_config({"model_name_or_path": "tiny-bert"}), tmp_path / "args.json")
    recorded = json.loads((tmp_path / "args.json").read_text())["model_name_or_path"]
    assert recorded == str(tmp_path / "tiny-bert")
    monkeypatch.chdir("/")
    assert base_model_info(ModelConfig(model_name_or_path=recorded))[0] is None  # here: a local folder
    assert base_model_info(ModelConfig(model_name_or_path="/opt/ml/input/data/model"))[0] is None  # elsewhere
    assert base_model_info(ModelConfig(model_name_or_path="org/model"))[0] == "org/model"


def test_background_upload_failure_is_reported_by_wait(in_process, tmp_path):
    cfg = hub_config("alice/refused")
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    in_process.refuse_commits = "storage quota exceeded"
    try:
        uploader.upload(make_save(tmp_path / "checkpoint-1", 1), "Training in progress, step 1")
        with pytest.raises(UserError, match="1 of 1 background Hub uploads failed.*storage quota exceeded"):
            uploader.wait()
    finally:
        in_process.refuse_commits = None


@pytest.mark.slow  # imports the pipeline
def test_a_failed_background_upload_before_rotation_warns_and_training_goes_on(in_process, tmp_path, capsys):
    """Rotation waits for the uploads before it deletes a checkpoint: a failed one stopped the run half-way."""
    from types import SimpleNamespace

    from cloudtrain.pipeline import hub_hooks

    cfg = hub_config("alice/rotated")
    cfg.hub.hub_strategy = "every_save"
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    hooks = hub_hooks(cfg, SimpleNamespace(), SimpleNamespace(), None, uploader, is_main=True)
    in_process.refuse_commits = "storage quota exceeded"
    try:
        hooks["on_saved"](2, make_save(tmp_path / "checkpoint-2" / "model", 2).parent)
        hooks["before_delete"]()  # returns: the run goes on
    finally:
        in_process.refuse_commits = None
    said = capsys.readouterr().out
    assert "warning: 1 of 1 background Hub uploads failed" in said and "training goes on" in said


# ---------------------------------------------------------------- the card for the built-in defaults


def test_card_for_the_builtin_model_and_data_names_them_and_holds_no_secret(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "acq", "1": "earn"}}))
    cfg = hub_config("alice/minilm-r8")
    results = {
        "train": {
            "global_step": 10,
            "epoch": 1.0,
            "train_loss": 0.5,
            "train_runtime_s": 3.0,
            "train_samples_per_s": 50.0,
        },
        "eval": {
            "accuracy": 0.91234,
            "macro_f1": 0.85678,
            "loss": 0.3,
            "samples": 20,
            "confusion_matrix": [[9, 1], [1, 9]],
        },
    }
    card = build_model_card(tmp_path, cfg, results)
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert card.data.license == "apache-2.0" and card.data.datasets == ["reuters21578"]
    assert [(r.metric_type, r.metric_value) for r in card.data.eval_results] == [("accuracy", 0.9123), ("f1", 0.8568)]
    assert "| **earn** | 1 | 9 |" in card.text and "training_curves.png" not in card.text
    assert TOKEN not in str(card)


# ---------------------------------------------------------------- saves during training


@pytest.mark.slow
def test_every_save_and_checkpoint_strategies_push_each_checkpoint_in_order(hub, tiny_model_dir, data_files, tmp_path):
    out = tmp_path / "model"
    result = run_app(
        hub_env(hub, tmp_path / "no-stored-token", TOKEN),
        *train_args(
            tiny_model_dir,
            data_files,
            out,
            "--max_steps",
            "6",
            "--checkpointing_steps",
            "2",
            "--save_total_limit",
            "1",
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "alice/saves",
            "--hub_strategy",
            "checkpoint",
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    commits = [c.summary for c in hub.history("alice/saves")]
    assert commits[0] == "initial commit"
    assert commits[1:-1] == [
        message
        for step in (2, 4, 6)
        for message in (f"Training in progress, step {step}", f"Checkpoint at step {step}")
    ]
    root_upload, checkpoint_upload = hub.history("alice/saves")[1:3]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(root_upload.added)
    assert "last-checkpoint/trainer_state.json" in checkpoint_upload.added
    assert "last-checkpoint/model.safetensors" in checkpoint_upload.added


# ---------------------------------------------------------------- several processes


def torchrun_app(env: dict, *args: str) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**env, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            port,
            str(ENTRY),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )


@pytest.mark.slow
def test_only_the_main_process_talks_to_the_hub(hub, tiny_model_dir, data_files, tmp_path):
    """2 processes: one access check (whoami, create, preupload dry run) and one push, not one per process;
    a bad token stops both processes with the main process's single error line."""
    before = len(hub.requests)
    bad = torchrun_app(
        hub_env(hub, tmp_path / "no-stored-token", token="hf_not_a_valid_token_43"),
        *train_args(
            tiny_model_dir, data_files, tmp_path / "bad", "--push_to_hub", "true", "--hub_model_id", "alice/never2"
        ),
    )
    assert bad.returncode != 0 and "data:" not in bad.stdout
    assert hub.requests[before:] == [("GET", "/api/whoami-v2")]
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the Hub rejected the token (401" in errors[0], bad.stderr[-3000:]

    before = len(hub.requests)
    good = torchrun_app(
        hub_env(hub, tmp_path / "no-stored-token", token=TOKEN),
        *train_args(
            tiny_model_dir,
            data_files,
            tmp_path / "good",
            "--push_to_hub",
            "true",
            "--hub_model_id",
            "alice/ddp",
            "--max_steps",
            "2",
            "--eval_strategy",
            "no",
        ),
    )
    assert good.returncode == 0, good.stderr[-3000:]
    calls = [path for _, path in hub.requests[before:]]
    assert calls.count("/api/whoami-v2") == 1 and calls.count("/api/repos/create") == 2  # check, then push
    assert len(hub.history("alice/ddp")) == 2  # the initial commit and one upload


# ---------------------------------------------------------------- a Hub that does not answer, or is busy


@pytest.fixture
def impatient(in_process, monkeypatch):
    """The in-process client with a short request timeout and no wait before a call is made again; the server's
    silences and failures are undone after the test (held requests then end)."""
    monkeypatch.setenv("CLOUDTRAIN_HUB_TIMEOUT", "2")
    monkeypatch.setenv("CLOUDTRAIN_HUB_RETRY_WAIT", "0")
    yield in_process
    in_process.silent.clear()
    in_process.fail_next.clear()
    in_process.commits_open.set()


def finished_run(out: Path) -> tuple:
    """A finished classifier run in `out`, as push_output_dir reads it: its configuration and results."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"id2label": {"0": "acq", "1": "earn"}}))
    (out / "model.safetensors").write_bytes(os.urandom(256))
    train = {"global_step": 4, "epoch": 1.0, "train_loss": 0.5, "train_runtime_s": 3.0, "train_samples_per_s": 50.0}
    return hub_config("alice/unanswered"), {"train": train}


def test_a_hub_that_does_not_answer_ends_the_access_check_in_one_line(impatient):
    """huggingface_hub sends its requests with no timeout: a Hub that stopped answering held the run forever,
    saying nothing (found in audit)."""
    impatient.silent.add("whoami")
    with pytest.raises(UserError) as caught:
        cloudhub.check_access(hub_config("alice/unanswered").hub)
    message = str(caught.value)
    assert message.startswith(f"checking Hub access: cannot reach {impatient.url} (timed out); check the network")
    assert "\n" not in message and caught.value.transient


def test_a_final_push_the_hub_does_not_answer_ends_in_one_line_with_the_retry_command(impatient, tmp_path):
    out = tmp_path / "run"
    cfg, results = finished_run(out)
    cloudhub.check_access(cfg.hub)
    impatient.silent.add("commit")
    with pytest.raises(UserError) as caught:
        cloudhub.push_output_dir(out, cfg, results)
    message = str(caught.value)
    assert message.startswith(f"pushing to alice/unanswered: cannot reach {impatient.url} (timed out)"), message
    assert message.endswith(f" push --output_dir {out.resolve()} --hub_model_id alice/unanswered")
    assert "\n" not in message and caught.value.transient
    assert len(impatient.history("alice/unanswered")) == 1  # nothing landed


def test_a_background_upload_the_hub_does_not_answer_is_a_warning_and_training_goes_on(impatient, tmp_path, capsys):
    cfg = hub_config("alice/unanswered-saves")
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    impatient.silent.add("commit")
    uploader.upload(make_save(tmp_path / "checkpoint-2", 2), "Training in progress, step 2")
    uploader.settle()  # returns: the run goes on
    said = capsys.readouterr().out
    assert said.startswith("warning: 1 of 1 background Hub uploads failed; first: background upload 'Training in ")
    assert f"cannot reach {impatient.url} (timed out)" in said and "training goes on" in said


def test_a_wait_for_background_uploads_is_bounded_and_gives_up_those_not_begun(
    impatient, tmp_path, capsys, monkeypatch
):
    """HubUploader.wait waited on each upload with no bound: rotation waits for it before it deletes a checkpoint,
    so an upload that never ended stopped training for good (found in audit)."""
    cfg = hub_config("alice/held-saves")
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    monkeypatch.setenv("CLOUDTRAIN_HUB_TIMEOUT", "120")  # each request may take long: the wait's own bound ends it
    monkeypatch.setenv("CLOUDTRAIN_HUB_WAIT", "0.5")
    impatient.commits_open.clear()  # the Hub takes the commit and holds it
    commit = ("POST", "/api/models/alice/held-saves/commit/main")
    uploader.upload(make_save(tmp_path / "checkpoint-2", 2), "Training in progress, step 2")
    for _ in range(600):  # until the first upload is in its commit
        if commit in impatient.requests:
            break
        threading.Event().wait(0.05)
    uploader.upload(make_save(tmp_path / "checkpoint-4", 4), "Training in progress, step 4")
    uploader.settle()  # returns: the run goes on
    said = capsys.readouterr().out
    assert said.startswith("warning: 2 of 2 background Hub uploads failed; first: background upload 'Training in ")
    assert "not done in 0.5 s (CLOUDTRAIN_HUB_WAIT)" in said and "training goes on" in said
    impatient.commits_open.set()
    monkeypatch.setenv("CLOUDTRAIN_HUB_WAIT", "120")
    uploader.wait()  # the upload that began ends, and lands; the one not begun never does
    assert [c.summary for c in impatient.history("alice/held-saves")[1:]] == ["Training in progress, step 2"]
    assert impatient.requests.count(commit) == 1


def test_a_busy_hub_is_asked_again_and_one_still_busy_fails_as_transient(impatient, tmp_path):
    """A 429 or 503 failed the push at once, and as the user's mistake (found in audit)."""
    cfg = hub_config("alice/busy")
    before = len(impatient.requests)
    impatient.fail_next.update(whoami=[429], create_repo=[502], commit=[503])
    cloudhub.check_access(cfg.hub)
    uploader = cloudhub.HubUploader(cfg)
    uploader.upload(make_save(tmp_path / "checkpoint-2", 2), "Training in progress, step 2")
    uploader.wait()
    assert [c.summary for c in impatient.history("alice/busy")[1:]] == ["Training in progress, step 2"]
    paths = [path for _, path in impatient.requests[before:]]
    assert paths.count("/api/whoami-v2") == 2 and paths.count("/api/models/alice/busy/commit/main") == 2

    out = tmp_path / "run"
    cfg, results = finished_run(out)
    cfg.hub.hub_model_id = "alice/busy"
    impatient.fail_next["commit"] = [503] * (cloudhub.RETRIES + 1)
    before = len(impatient.requests)
    with pytest.raises(UserError) as caught:
        cloudhub.push_output_dir(out, cfg, results)
    message = str(caught.value)
    assert message.startswith("pushing to alice/busy failed: 503 the test Hub answers 503 this time (the Hub is busy")
    assert " push --output_dir " in message and caught.value.transient
    tried = [path for _, path in impatient.requests[before:]].count("/api/models/alice/busy/commit/main")
    assert tried == cloudhub.RETRIES + 1
    with pytest.raises(UserError) as refused:  # a mistake is not asked again, and stays the user's
        cloudhub.check_access(hub_config("bob/not-alices").hub)
    assert "403 Forbidden" in str(refused.value) and not refused.value.transient


def test_a_bad_hub_setting_is_one_line(impatient, monkeypatch):
    monkeypatch.setenv("CLOUDTRAIN_HUB_TIMEOUT", "soon")
    with pytest.raises(UserError, match=r"CLOUDTRAIN_HUB_TIMEOUT='soon' must be a number of seconds, more than 0"):
        cloudhub.hub_api(hub_config("alice/x").hub)


# ---------------------------------------------------------------- a model with its own code


def test_a_remote_code_models_modules_go_up_with_it_and_no_other_py(in_process, tmp_path):
    """--trust_remote_code: config.json's auto_map names configuration_x.py and modeling_x.py, which were not
    pushed, so the repo could not be loaded (found in audit). The modules the auto_maps name go up; no other."""
    cfg = hub_config("alice/own-code")
    cloudhub.check_access(cfg.hub)
    out = tmp_path / "run"
    (out / MERGED).mkdir(parents=True)
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (out / "config.json").write_text(json.dumps({"auto_map": auto_map}))
    tokenizer_map = {"AutoTokenizer": ["tokenization_x.XTok", None]}
    (out / "tokenizer_config.json").write_text(json.dumps({"auto_map": tokenizer_map}))
    (out / MERGED / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "org/base--modeling_m.M"}}))
    for name in ("configuration_x.py", "modeling_x.py", "tokenization_x.py", "train_helper.py", "model.safetensors",
                 f"{MERGED}/modeling_m.py", f"{MERGED}/modeling_x.py"):  # fmt: skip
        (out / name).write_text(name)
    files = cloudhub.model_files(out)
    cloudhub.commit_model_files(cloudhub.hub_api(cfg.hub), cfg.hub, out, files, "push", None)
    pushed = set(in_process.history("alice/own-code")[-1].files) - {".gitattributes"}
    code = {"configuration_x.py", "modeling_x.py", "tokenization_x.py", f"{MERGED}/modeling_m.py"}
    assert pushed == {"config.json", "tokenizer_config.json", "model.safetensors", f"{MERGED}/config.json", *code}


def test_a_push_keeps_the_users_own_files_named_like_model_files(in_process, tmp_path):
    """The next push deleted every file matching the upload patterns (tokenizer*, *_results.json, vocab.*), a file
    the push's own note told the user to upload by hand included (found in audit)."""
    cfg = hub_config("alice/mine-too")
    cloudhub.check_access(cfg.hub)
    api = cloudhub.hub_api(cfg.hub)
    run = folder_of(tmp_path / "run", "config.json", "model.safetensors", "tokenizer.json", "README.md", "args.json")
    commit = partial(cloudhub.commit_model_files, api, cfg.hub, folder=run, message="push", base_model=None)
    commit(files=cloudhub.model_files(run))
    mine = [
        "tokenizer_corpus.txt",
        "mteb_results.json",
        "all_results.json",
        "vocab.backup",
        "merged/tokenizer_notes.md",
    ]
    for name in mine:
        api.upload_file(path_or_fileobj=name.encode(), path_in_repo=name, repo_id="alice/mine-too")
    for name in ("test_results.json", "spm.model"):  # an earlier run's (a DeBERTa-v3 tokenizer's file; review)
        api.upload_file(path_or_fileobj=b"{}", path_in_repo=name, repo_id="alice/mine-too")
    commit(files=cloudhub.model_files(run))
    final = set(in_process.history("alice/mine-too")[-1].files)
    assert set(mine) <= final and not final & {"test_results.json", "spm.model"}
