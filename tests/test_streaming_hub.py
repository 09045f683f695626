"""--streaming true from the Hugging Face Hub: `hf://datasets/<owner>/<name>[@revision][/path or glob]` read with the
real client (huggingface_hub's HfFileSystem: repo info, paginated tree listings, ranged GETs of resolve URLs) from
the local Hub server on 127.0.0.1 (tests/hub_server.py), against the same files read from local disk; a resume
reopens each file at its byte offset; every refusal (no such repo, private without a token, nothing matching,
an unreachable endpoint, ...) is one line before training.

The client is pointed at the server through its constants (huggingface_hub reads HF_ENDPOINT at import), as
test_hub.py does in-process; HF_TOKEN is read by the client at each request, so it is set in the environment."""

import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ENTRY, REPO, child_pythonpath
from hub_server import HubServer, User
from huggingface_hub import constants
from test_streaming import data_cfg, numbered, plan_for, take, write_jsonl
from transformers import AutoTokenizer

from cloudtrain.data.mixture import resolve_sources
from cloudtrain.data.remote import hub_dataset_source
from cloudtrain.errors import UserError

TOKEN = "hf_alice_stream_0a1b2c3d4e5f"
BOB_TOKEN = "hf_bob_stream_99887766"
CORPUS = "alice/corpus"


def corpus_files(folder: Path) -> dict[str, bytes]:
    """A dataset laid out as on the Hub: split-named files under data/, more data elsewhere, a card."""
    write_jsonl(folder / "train-00000-of-00002.jsonl", numbered(40, "a0"))
    write_jsonl(folder / "train-00001-of-00002.jsonl.gz", numbered(30, "a1"), gzip.open)
    write_jsonl(folder / "test-00000-of-00001.jsonl", numbered(10, "t"))
    pq.write_table(pa.table({"body": numbered(50, "b")}), folder / "books.parquet", row_group_size=8)
    files = {f"data/{p.name}": p.read_bytes() for p in folder.iterdir() if "books" not in p.name}
    return {**files, "books/books.parquet": (folder / "books.parquet").read_bytes(), "README.md": b"# corpus\n"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    local = tmp_path_factory.mktemp("hub-corpus")
    server = HubServer({TOKEN: User("alice"), BOB_TOKEN: User("bob")}).start()
    server.tree_page_size = 3  # the client follows the listing's pages (the Hub's are 1000 entries)
    server.add_dataset(CORPUS, corpus_files(local))
    server.add_dataset(
        "alice/private-corpus", {"train.jsonl": (local / "train-00000-of-00002.jsonl").read_bytes()}, True
    )
    server.add_dataset("alice/card-only", {"README.md": b"# nothing yet\n"})
    server.local = local
    yield server
    server.stop()


@pytest.fixture
def on_hub(hub, monkeypatch, tmp_path):
    """The client pointed at the local server, with no token anywhere; the corpus's files on disk."""
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    return hub.local


@pytest.fixture(scope="module")
def lm_tokenizer(lm_tokenizer_dir):
    return AutoTokenizer.from_pretrained(lm_tokenizer_dir)


def rows(plan, steps: int) -> list[list[int]]:
    return [row["input_ids"] for chunk in take(plan.loader(2), steps) for row in chunk]


def head_commit(hub: HubServer, repo_id: str) -> str:
    return hub.datasets[repo_id].branches["main"]


def one_line_error(train_file: str) -> str:
    with pytest.raises(UserError) as err:
        resolve_sources(data_cfg(train_file=train_file).data)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_hub_dataset_streams_the_same_rows_as_its_files_on_disk(on_hub, hub, tmp_path, lm_tokenizer):
    books = {"weight": 1.0, "columns": {"text": "body"}}
    remote = [{"path": f"hf://datasets/{CORPUS}", "weight": 2.0}, {"path": f"hf://datasets/{CORPUS}/books/*", **books}]
    specs = resolve_sources(data_cfg(datasets=remote).data)
    sha = head_commit(hub, CORPUS)
    assert specs[0].files == [  # the repo's training split (its split-named files), pinned to the commit
        f"hf://datasets/{CORPUS}@{sha}/data/train-00000-of-00002.jsonl",
        f"hf://datasets/{CORPUS}@{sha}/data/train-00001-of-00002.jsonl.gz",
    ]
    assert specs[1].files == [f"hf://datasets/{CORPUS}@{sha}/books/books.parquet"]
    assert [s.name for s in specs] == [entry["path"] for entry in remote]  # counted under the names given
    local = [{"path": f"{on_hub}/train-*.jsonl*", "weight": 2.0}, {"path": f"{on_hub}/books.parquet", **books}]
    got = rows(plan_for(tmp_path, lm_tokenizer, datasets=remote), 30)
    assert got == rows(plan_for(tmp_path, lm_tokenizer, datasets=local), 30)
    assert rows(plan_for(tmp_path, lm_tokenizer, datasets=remote, workers=2), 30) == got  # forked loader workers
    assert {path for path, _, _ in hub.ranges} >= {
        "books/books.parquet",
        "data/train-00000-of-00002.jsonl",
    }  # ranged GETs


def test_the_cursor_reopens_each_hub_file_at_its_offset(on_hub, hub, tmp_path, lm_tokenizer):
    remote = f"hf://datasets/{CORPUS}/data/train-0000[01]*"  # a glob inside the repo
    straight = take(plan_for(tmp_path, lm_tokenizer, train_file=remote).loader(2), 40)
    first = plan_for(tmp_path, lm_tokenizer, train_file=remote).loader(2)
    take(first, 20)
    state = json.loads(json.dumps(first.state_dict(20)))
    (position,) = state["stream"]["sources"]
    assert position["file"] == 0 and position["offset"] > 0  # inside the plain jsonl file
    before = len(hub.ranges)
    again = plan_for(tmp_path, lm_tokenizer, train_file=remote).loader(2)
    again.load_state_dict(state)
    assert take(again, 20) == straight[20:]
    reads = [first for path, first, _ in hub.ranges[before:] if path == "data/train-00000-of-00002.jsonl"]
    assert reads and min(reads) == position["offset"]  # nothing before the offset is fetched again


def test_a_mixture_of_a_hub_dataset_and_a_local_file(on_hub, hub, tmp_path, lm_tokenizer):
    write_jsonl(tmp_path / "local.jsonl", numbered(60, "l"))
    config = tmp_path / "mix.yaml"
    config.write_text(
        "task: causal_lm\nstreaming: true\nmax_steps: 10\ndatasets:\n"
        f"  - {{path: 'hf://datasets/{CORPUS}/books', weight: 0.7, columns: {{text: body}}}}\n"
        f"  - {{path: {tmp_path / 'local.jsonl'}, weight: 0.3}}\n"
    )
    from cloudtrain.config import resolve_options

    specs = resolve_sources(resolve_options(str(config), {}).data)
    assert [(len(s.files), s.weight, s.columns) for s in specs] == [(1, 0.7, {"text": "body"}), (1, 0.3, {})]
    both = [
        {"path": f"hf://datasets/{CORPUS}/books", "weight": 0.7, "columns": {"text": "body"}},
        {"path": str(tmp_path / "local.jsonl"), "weight": 0.3},
    ]
    disk = [{**both[0], "path": str(on_hub / "books.parquet")}, both[1]]
    got = take(plan_for(tmp_path, lm_tokenizer, datasets=both).loader(2), 20)
    assert got == take(plan_for(tmp_path, lm_tokenizer, datasets=disk).loader(2), 20)
    started = {key[0] for chunk in got for row in chunk for key in row["starts"]}
    assert started == {0, 1}  # both sources gave documents


def test_a_revision_and_the_commit_a_listing_pins(on_hub, hub, tmp_path, lm_tokenizer):
    write_jsonl(tmp_path / "v1.jsonl", numbered(20, "v1"))
    first = hub.add_dataset("alice/moving", {"train.jsonl": (tmp_path / "v1.jsonl").read_bytes()})
    (pinned,) = resolve_sources(data_cfg(train_file="hf://datasets/alice/moving").data)
    write_jsonl(tmp_path / "v2.jsonl", numbered(20, "v2"))
    hub.add_dataset("alice/moving", {"train.jsonl": (tmp_path / "v2.jsonl").read_bytes()})
    assert pinned.files == [f"hf://datasets/alice/moving@{first.oid}/train.jsonl"]
    from cloudtrain.data.readers import RecordReader

    reader = RecordReader(pinned.files[0], "jsonl")  # main has moved on; the listed commit is still read
    assert reader.next()[0]["text"].startswith("v1 0")
    reader.close()
    (at,) = resolve_sources(data_cfg(train_file=f"hf://datasets/alice/moving@{first.oid}").data)
    assert at.files == pinned.files
    assert "no revision 'nope'" in one_line_error("hf://datasets/alice/moving@nope")


def test_every_process_reads_the_commit_the_main_process_listed(on_hub, hub, tmp_path):
    """Each process lists its sources (`task.connect`); a push between two listings gives another commit, so the
    pipeline hands every process the main process's listing (`pin_sources`, through the runtime's broadcast)."""
    from datasets import DatasetDict

    from cloudtrain.data.sources import pin_sources

    write_jsonl(tmp_path / "v1.jsonl", numbered(8, "v1"))
    first = hub.add_dataset("alice/racing", {"train.jsonl": (tmp_path / "v1.jsonl").read_bytes()})
    listings = []
    for version in ("v1", "v2"):  # the main process lists, a push lands, the other process lists
        if version == "v2":
            write_jsonl(tmp_path / "v2.jsonl", numbered(8, "v2"))
            hub.add_dataset("alice/racing", {"train.jsonl": (tmp_path / "v2.jsonl").read_bytes()})
        raw = DatasetDict()
        raw.stream_sources = resolve_sources(data_cfg(train_file="hf://datasets/alice/racing").data)
        listings.append(raw)
    main, other = listings
    assert main.stream_sources[0].files != other.stream_sources[0].files  # what each would read on its own
    broadcast = main.stream_sources  # the main process's value, as Runtime.share gives it to every process
    pinned = pin_sources(other, lambda value: broadcast)
    assert pinned.stream_sources[0].files == [f"hf://datasets/alice/racing@{first.oid}/train.jsonl"]
    stored = DatasetDict()  # stored data has no stream: nothing to share
    assert pin_sources(stored, lambda value: pytest.fail("shared")) is stored


def test_a_private_dataset_needs_a_token_that_can_read_it(on_hub, monkeypatch):
    message = one_line_error("hf://datasets/alice/private-corpus")
    assert "is not on" in message and "or is private" in message and "HF_TOKEN" in message
    monkeypatch.setenv("HF_TOKEN", BOB_TOKEN)
    assert "the token cannot read it" in one_line_error("hf://datasets/alice/private-corpus")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (spec,) = resolve_sources(data_cfg(train_file="hf://datasets/alice/private-corpus").data)
    assert spec.files[0].endswith("/train.jsonl")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token_at_all")
    assert "refused the token" in one_line_error("hf://datasets/alice/private-corpus")


def test_each_hub_refusal_is_one_line(on_hub, monkeypatch):
    assert "dataset alice/nope is not on" in one_line_error("hf://datasets/alice/nope")
    assert "matches no data file" in one_line_error(f"hf://datasets/{CORPUS}/data/*.csv")
    assert "matches no data file" in one_line_error(f"hf://datasets/{CORPUS}/no/such/folder")
    assert "matches no data file" in one_line_error("hf://datasets/alice/card-only")
    assert "only dataset repos" in one_line_error(f"hf://{CORPUS}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set" in one_line_error(f"hf://datasets/{CORPUS}")


def test_an_unreachable_hub_is_one_line_not_a_hang(on_hub, monkeypatch):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    message = one_line_error(f"hf://datasets/{CORPUS}")
    assert "cannot reach the Hub" in message and f"127.0.0.1:{port}" in message and "HF_ENDPOINT" in message


def test_dataset_name_with_streaming_is_the_hub_datasets_files(on_hub, tmp_path):
    assert hub_dataset_source(CORPUS) == f"hf://datasets/{CORPUS}"
    (spec,) = resolve_sources(data_cfg(train_file=hub_dataset_source(CORPUS)).data)
    assert [f.rsplit("/", 1)[1] for f in spec.files] == ["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl.gz"]
    with pytest.raises(UserError, match="save_to_disk"):
        hub_dataset_source(str(tmp_path))
    with pytest.raises(UserError, match="--dataset_config"):
        hub_dataset_source(CORPUS, "books")


def test_a_streaming_run_trains_on_a_hub_dataset_and_reports_it(on_hub, tiny_llama_dir, tmp_path):
    from test_streaming import stream_run_args

    from cloudtrain import train

    out = tmp_path / "run"
    source = f"hf://datasets/{CORPUS}"
    args = stream_run_args(tiny_llama_dir, source, out, "--max_steps", "4")
    results = train({k.lstrip("-"): v for k, v in zip(args[::2], args[1::2], strict=True)})
    assert results["train"]["global_step"] == 4
    sources = json.loads((out / "train_results.json").read_text())["sources"]
    assert sources[source]["documents"] > 0 and sources[source]["tokens"] > 0


@pytest.mark.slow
def test_the_entry_point_reads_hf_endpoint_and_hf_token_from_the_environment(hub, tmp_path, tiny_llama_dir):
    """As users run it: huggingface_hub takes HF_ENDPOINT at import and HF_TOKEN per request. Without a token the
    private dataset is one line naming HF_TOKEN, before any model is loaded; with alice's token it trains."""
    from test_streaming import stream_run_args

    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(
        HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_TOKEN_PATH=str(tmp_path / "no-token"), PYTHONPATH=child_pythonpath()
    )
    args = stream_run_args(tiny_llama_dir, "hf://datasets/alice/private-corpus", tmp_path / "run", "--max_steps", "2")

    def run(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(ENTRY), *args],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
            env={**env, **extra},
        )

    refused = run()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = [text for text in refused.stderr.splitlines() if text.strip()]
    assert "or is private" in line and "HF_TOKEN" in line and hub.url in line
    trained = run(HF_TOKEN=TOKEN)
    assert trained.returncode == 0, trained.stderr[-3000:]
    sources = json.loads((tmp_path / "run" / "train_results.json").read_text())["sources"]
    assert sources["hf://datasets/alice/private-corpus"]["documents"] > 0


def test_a_folder_keeps_its_plain_files_beside_files_named_for_other_splits():
    from cloudtrain.data.remote import _training_files

    root = "hf://datasets/o/n@c/"
    assert _training_files([root + "data.jsonl", root + "test.jsonl"], root) == [root + "data.jsonl"]
    named = [root + "train-0.jsonl", root + "test.jsonl", root + "notes.jsonl"]
    assert _training_files(named, root) == [root + "train-0.jsonl"]  # the Hub's split names: the training split only
