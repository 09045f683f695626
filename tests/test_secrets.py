"""No secret in any file or line: fake secrets passed every way a user can pass them, a run that tracks,
checkpoints and pushes, then every file it wrote (output, checkpoints, tracker folders, caches, home) and
all its output searched for them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENTRY, REPO
from test_hub import TOKEN, data_files, hub, hub_env, train_args  # noqa: F401 (fixtures: the Hub server, the data)

from cloudtrain.errors import UserError
from cloudtrain.publish.hub import token_from_file
from cloudtrain.redact import mask

ENV_SECRETS = {
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "AWS_ACCESS_KEY_ID": "AKIAFAKEFAKEFAKE1234",
    "AWS_SECRET_ACCESS_KEY": "fakeSecretAccessKey/for+tests0123456789xyz",
    "MLFLOW_TRACKING_PASSWORD": "fake-mlflow-password-123",
}


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=600, env=env, cwd=REPO
    )


def leaks(root: Path, secrets: list[str], allowed: set[Path]) -> list[str]:
    """'<file>: <secret>' for every file under `root` (but the user's own `allowed`) holding a secret."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and path not in allowed:
            data = path.read_bytes()
            found += [f"{path}: {secret[:8]}..." for secret in secrets if secret.encode() in data]
    return found


@pytest.mark.slow  # a training run in a subprocess each
@pytest.mark.parametrize("way", ["flag", "config file", "token file"])
def test_no_secret_reaches_a_file_or_a_line(way, hub, tiny_model_dir, data_files, tmp_path):  # noqa: F811
    home = tmp_path / "home"
    home.mkdir()
    env = hub_env(hub, tmp_path / "no-stored-token")
    env.update(ENV_SECRETS, HOME=str(home), HF_HOME=str(home / "hf"), WANDB_MODE="offline", WANDB_DIR=str(home))
    env["HF_DATASETS_CACHE"] = str(home / "datasets")
    out = tmp_path / "out"
    user_files = {tmp_path / "options.yaml", tmp_path / "token"}
    given = {
        "flag": ["--hub_token", TOKEN],
        "config file": ["--config", str(tmp_path / "options.yaml")],
        "token file": ["--hub_token_file", str(tmp_path / "token")],
    }[way]
    (tmp_path / "options.yaml").write_text(f"hub:\n  hub_token: {TOKEN}\n")
    (tmp_path / "token").write_text(TOKEN + "\n")
    result = run(
        env,
        *train_args(tiny_model_dir, data_files, out),
        *["--push_to_hub", "true", "--hub_model_id", f"alice/secrets-{way.replace(' ', '-')}"],
        *["--report_to", "wandb,tensorboard", "--checkpointing_steps", "2"],
        *given,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pushed" in result.stdout.lower() or "hub" in result.stdout.lower()
    secrets = [TOKEN, *ENV_SECRETS.values()]
    assert leaks(tmp_path, secrets, user_files) == []
    for stream in (result.stdout, result.stderr):
        assert not [s for s in secrets if s in stream]
    assert "hub_token" not in json.loads((out / "args.json").read_text())
    assert (way == "flag") == ("a token on the command line is visible to other users" in result.stderr)


def test_a_mistyped_option_followed_by_a_token_is_masked_in_its_error_line(tmp_path):
    result = run({"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, "--hub_tokn", TOKEN)
    assert result.returncode == 2
    assert TOKEN not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: unrecognized arguments: --hub_tokn ***")


@pytest.mark.parametrize(
    "text, shown",
    [
        (f"--hub_token {TOKEN}", "--hub_token ***"),
        (f"--hub_token={TOKEN}", "--hub_token=***"),
        ("hub_token: abc", "hub_token: ***"),
        ('{"hub_token": "abc"}', '{"hub_token": "***"}'),
        ("AWS_SECRET_ACCESS_KEY=xyz and AKIAFAKEFAKEFAKE1234", "AWS_SECRET_ACCESS_KEY=*** and ***"),
        (f"key {ENV_SECRETS['WANDB_API_KEY']}", "key ***"),
        ("max_new_tokens: 32, tokenizer_name_or_path: /a/b", "max_new_tokens: 32, tokenizer_name_or_path: /a/b"),
        ("the hub token was rejected", "the hub token was rejected"),
        # a URL's user and password, a presigned URL's signature (found in audit: both reached the card)
        (
            "data: streaming http://alice:Pw1@127.0.0.1:8/a.jsonl (1 file)",
            "data: streaming http://***@127.0.0.1:8/a.jsonl (1 file)",
        ),
        (
            "https://b.s3.amazonaws.com/k.jsonl?X-Amz-Signature=abc123",
            "https://b.s3.amazonaws.com/k.jsonl?X-Amz-Signature=***",
        ),
        (
            "hf://datasets/alice/x@main/a.jsonl or s3://bucket/k@v2 or me@example.com",
            "hf://datasets/alice/x@main/a.jsonl or s3://bucket/k@v2 or me@example.com",
        ),
    ],
)
def test_mask_hides_secret_shapes_and_names_and_nothing_else(text, shown):
    assert mask(text) == shown


def test_a_token_file_gives_its_first_line_and_a_bad_one_is_one_line(tmp_path):
    (tmp_path / "token").write_text(f"{TOKEN}\n# a comment\n")
    assert token_from_file(str(tmp_path / "token")) == TOKEN
    (tmp_path / "empty").write_text("")
    with pytest.raises(UserError, match="--hub_token_file .*empty cannot be read \\(it is empty\\)"):
        token_from_file(str(tmp_path / "empty"))
    with pytest.raises(UserError, match="--hub_token_file .*missing cannot be read \\(No such file or directory\\)"):
        token_from_file(str(tmp_path / "missing"))
