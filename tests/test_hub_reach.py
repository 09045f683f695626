"""A Hub id that only the Hub can give (no local folder, nothing cached) while the Hub cannot be reached is one
line at once, before the heavy imports, not huggingface_hub's half minute of retry lines (cloudtrain.hub_reach);
with HF_HUB_OFFLINE it is "no cached copy". A cached id, and any id while the endpoint answers, pass unchanged:
checked against the local Hub server (tests/hub_server.py) and a closed port on 127.0.0.1."""

import json
import os
import socket
import subprocess
import sys

import datasets.config
import pytest
from conftest import ENTRY, REPO, child_pythonpath, topic_run_args
from hub_server import HubServer, User
from huggingface_hub import HfApi, constants

from cloudtrain.errors import UserError
from cloudtrain.hub_reach import HubId, back_online, check_hub_ids

TOKEN = "hf_alice_reach_0a1b2c3d4e5f"
HEAVY = ("torch", "transformers", "datasets", "huggingface_hub", "accelerate")
# the entry's main, then which heavy modules it had imported by the time it returned
SCRIPT = f"""
import json, sys
from cloudtrain.cli import main
code = main(sys.argv[1:])
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
sys.exit(code)
"""


def closed_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago: nothing listens there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def user_env(tmp_path, **extra: str) -> dict:
    """A user's environment with empty caches of its own and the Hub allowed (the suite sets HF_HUB_OFFLINE)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "TRANSFORMERS_OFFLINE"))}
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONPATH=child_pythonpath(),
        PYTHONUNBUFFERED="1",
    )
    return {**env, **extra}


def cli(env: dict, *args: str) -> tuple[int, list[str], list[str]]:
    """The command line in a fresh interpreter: exit code, stderr's lines, the heavy modules it imported."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    heavy = json.loads(done.stdout.splitlines()[-1]) if done.stdout.strip() else None
    return done.returncode, done.stderr.splitlines(), heavy


NO_FOLDER = "no local folder has that name either"  # an id that is a mistyped path gets that said (audit)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("Once upon a time there was a king.\nHe had three daughters.\n")
    return path


def test_an_unreachable_endpoint_is_one_line_at_once_without_retries(tmp_path, corpus):
    port = closed_port()
    url = f"http://127.0.0.1:{port}"
    env = user_env(tmp_path, HF_ENDPOINT=url)
    refused = "[Errno 111] Connection refused; check HF_ENDPOINT and the network, give a local folder"
    cases = {
        ("--task", "causal_lm", "--model_name_or_path", "gpt2", "--train_file", str(corpus)): (
            f"error: cannot reach {url} (HF_ENDPOINT) to download gpt2 (--model_name_or_path; {NO_FOLDER}): "
            f"{refused}, or set HF_HUB_OFFLINE=1 to use only what is cached"
        ),
        ("--model_name_or_path", "org/some-bert", "--tokenizer_name_or_path", "org/its-tokenizer"): (
            f"error: cannot reach {url} (HF_ENDPOINT) to download org/some-bert (--model_name_or_path; {NO_FOLDER}): "
            f"{refused}"
        ),
        ("--dataset_name", "ag_news", "--max_steps", "2"): (
            f"error: cannot reach {url} (HF_ENDPOINT) to download ag_news (--dataset_name; {NO_FOLDER}): [Errno 111] "
            "Connection refused; check HF_ENDPOINT and the network, give local files (--train_file), or set "
            "HF_HUB_OFFLINE=1"
        ),
    }
    for args, message in cases.items():
        code, err, heavy = cli(env, *args)
        assert code == 2 and len(err) == 1 and err[0].startswith(message), err  # no "Retrying in 8s" lines
        assert heavy == [], heavy


def test_an_endpoint_that_never_answers_is_refused_after_the_short_timeout(tmp_path, corpus):
    with socket.socket() as silent:  # accepts connections (the kernel does) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        code, err, heavy = cli(user_env(tmp_path, HF_ENDPOINT=url), "--model_name_or_path", "gpt2")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        f"error: cannot reach {url} (HF_ENDPOINT) to download gpt2 (--model_name_or_path; {NO_FOLDER}): "
    )
    assert "timed out" in err[0] and heavy == [], err


def test_offline_an_id_not_cached_is_refused_and_local_mistakes_come_first(tmp_path, corpus):
    env = user_env(tmp_path, HF_HUB_OFFLINE="1")
    cache = tmp_path / "hf-home" / "hub"
    code, err, heavy = cli(env, "--task", "causal_lm", "--model_name_or_path", "gpt2", "--train_file", str(corpus))
    assert (code, heavy) == (2, []) and err == [
        f"error: --model_name_or_path gpt2: no cached copy and the Hub cannot be reached (HF_HUB_OFFLINE is set; "
        f"nothing of it in {cache}); unset HF_HUB_OFFLINE to download it, or give a local folder"
    ]
    code, err, _ = cli(env, "--dataset_name", "fancyzhx/ag_news", "--max_steps", "2")
    assert code == 2 and err[0].startswith("error: --dataset_name fancyzhx/ag_news: no cached copy") and len(err) == 1
    assert "or give local files (--train_file)" in err[0]
    code, err, _ = cli(env, "--model_name_or_path", "gpt2", "--train_file", str(tmp_path / "missing.txt"))
    assert (code, err) == (2, [f"error: --train_file {tmp_path / 'missing.txt'} does not exist"])


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    """The clients imported in this process, offline, with empty caches under tmp_path."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_what_the_caches_hold_passes_offline(empty_caches):
    model, dataset = HubId("--model_name_or_path", "org/Some-Model"), HubId("--dataset_name", "org/AgNews", "dataset")
    for hub_id in (model, dataset):
        with pytest.raises(UserError, match=f"{hub_id.flag} {hub_id.repo_id}: no cached copy"):
            check_hub_ids([hub_id])
    snapshot = empty_caches / "hub" / "models--org--Some-Model" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    with pytest.raises(UserError):  # a snapshot folder with nothing in it holds nothing
        check_hub_ids([model])
    (snapshot / "config.json").write_text("{}")
    check_hub_ids([model])
    # datasets prepares a Hub dataset into <cache>/<namespace>___<snake_case name>/<config>/<version>/<hash>
    (empty_caches / "datasets" / "org___ag_news" / "default" / "0.0.0" / "f00d").mkdir(parents=True)
    check_hub_ids([dataset])
    check_hub_ids([])  # nothing named by id: nothing to check


@pytest.fixture(scope="module")
def hub():
    server = HubServer({TOKEN: User("alice")}).start()
    yield server
    server.stop()


def test_a_reachable_endpoint_passes_with_one_request(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    before = len(hub.requests)
    check_hub_ids([HubId("--model_name_or_path", "alice/nothing-here"), HubId("--tokenizer_name_or_path", "x/y")])
    assert hub.requests[before:] == [("HEAD", "/")]  # a 404 is an answer: the loader says what is missing


@pytest.mark.slow
def test_a_model_on_a_reachable_hub_trains_as_before(hub, tiny_model_dir, topic_csvs, tmp_path, monkeypatch):
    """The check lets the run through unchanged: the model downloads from the local server into the cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # for the upload, here
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("alice/tiny-bert")
    api.upload_folder(repo_id="alice/tiny-bert", folder_path=tiny_model_dir)
    env = user_env(tmp_path, HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    args = topic_run_args("alice/tiny-bert", topic_csvs, tmp_path / "out")
    args += ["--max_steps", "1", "--max_length", "16", "--mixed_precision", "no", "--report_to", "none"]
    before = len(hub.requests)
    done = subprocess.run(
        [sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=600, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert hub.requests[before] == ("HEAD", "/")  # the check asked, then the loaders went on as before
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert list((tmp_path / "hf-home" / "hub").glob("models--alice--tiny-bert/snapshots/*/config.json"))


def test_a_cached_id_goes_offline_at_once_when_the_hub_does_not_answer(empty_caches, monkeypatch, capsys):
    """Without this, each loader retries for half a minute before it falls back to the cache."""
    model = HubId("--model_name_or_path", "org/Some-Model")
    snapshot = empty_caches / "hub" / "models--org--Some-Model" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(variable, "0")  # restored after the test, as the constants are
    check_hub_ids([model], may_go_offline=False)  # a run that pushes: offline, its push would be refused
    assert capsys.readouterr().out == "" and not constants.HF_HUB_OFFLINE
    check_hub_ids([model])
    assert capsys.readouterr().out == (
        f"note: cannot reach {url} ([Errno 111] Connection refused): org/Some-Model from the local cache "
        "(HF_HUB_OFFLINE=1 for this run)\n"
    )
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"  # for the processes it starts
    back_online()  # after the run (train() from a notebook): the next one asks the Hub again
    assert not constants.HF_HUB_OFFLINE and not datasets.config.HF_HUB_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "0"
