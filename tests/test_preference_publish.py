"""Preference tuning where the other tasks go (issue 31, item 7): a DPO LoRA run pushed to the Hub, a DPO job on
SageMaker from a channel folder of pairs, a reward model pushed; `generate` (and `--chat`) on what they leave.

Against the local servers with the real clients (tests/hub_server.py, tests/aws_server.py), the application in a
subprocess (huggingface_hub reads HF_ENDPOINT at import time; the two pushes one after another in one process,
tests/dist_runs.py) or under the SDK's own torchrun driver.
"""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import test_hub
from aws_server import container_environment, local_aws, run_torchrun_driver
from conftest import REPO
from dist_runs import run_outputs
from huggingface_hub import ModelCard, snapshot_download
from test_hub import TOKEN, hub_env
from test_preference import QUESTIONS, conversational, write_jsonl
from test_sagemaker import launcher  # noqa: F401  # a fixture, taken by name

from cloudtrain.cli import main
from cloudtrain.predict import predict

hub, in_process = test_hub.hub, test_hub.in_process  # fixtures, taken by name


def pair_rows() -> list[dict]:
    return [conversational(*row) for row in QUESTIONS]


def dpo_args(model_dir: str, train_file: str, out: Path, *extra: str) -> list[str]:
    return [
        "--task",
        "dpo",
        "--model_name_or_path",
        model_dir,
        "--train_file",
        train_file,
        "--validation_file",
        train_file,
        "--output_dir",
        str(out),
        "--max_length",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "2",
        "--logging_steps",
        "1",
        "--mixed_precision",
        "no",
        "--report_to",
        "none",
        "--num_sample_prompts",
        "1",
        "--sample_max_new_tokens",
        "4",
        *extra,
    ]


def chat_and_prompt(model_dir: Path, monkeypatch, capsys) -> None:
    """`generate --chat` answers each turn through the saved chat template; `--prompt` continues a prompt."""
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("Who found the golden key?\n/exit\n"))
    assert main(["generate", "--model_dir", str(model_dir), "--chat", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 1
    assert main(["generate", "--model_dir", str(model_dir), "--prompt", "Who", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("Who")


def reward_args(model_dir: str, train_file: str, out: Path, *extra: str) -> list[str]:
    args = dpo_args(model_dir, train_file, out, *extra)
    args[args.index("dpo")] = "reward"
    cut = args.index("--num_sample_prompts")
    del args[cut : cut + 4]  # no sample answers: a reward model generates nothing
    return args


@pytest.fixture(scope="module")
def pushed(hub, tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Two runs that push, one after another in one process: a DPO LoRA adapter ("dpo", alice/tales-dpo, from
    tales-pairs.jsonl) and a reward model ("reward", alice/tales-reward, from prefs.jsonl). Output folders by name."""
    root = tmp_path_factory.mktemp("pushed")
    pairs = write_jsonl(root / "tales-pairs.jsonl", pair_rows())
    prefs = write_jsonl(root / "prefs.jsonl", pair_rows())
    lora = ("--peft", "lora", "--lora_r", "4", "--beta", "0.2")
    runs = {
        "dpo": dpo_args(tiny_llama_dir, pairs, root / "dpo", *lora, "--push_to_hub", "true", "--hub_model_id",
                        "alice/tales-dpo"),
        "reward": reward_args(tiny_llama_dir, prefs, root / "reward", "--push_to_hub", "true", "--hub_model_id",
                              "alice/tales-reward"),
    }  # fmt: skip
    (root / "runs.json").write_text(json.dumps(list(runs.values())))
    env = hub_env(hub, root / "no-stored-token", TOKEN)
    command = [sys.executable, str(REPO / "tests" / "dist_runs.py"), str(root / "runs.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    run_outputs(result.stdout, len(runs))  # both ran
    return {name: root / name for name in runs}


# ---------------------------------------------------------------- DPO with LoRA, pushed to the Hub


@pytest.fixture(scope="module")
def pushed_dpo(hub, pushed):
    return pushed["dpo"], hub.history("alice/tales-dpo")[-1]


@pytest.mark.slow
def test_a_dpo_adapter_is_pushed_with_a_card_saying_how_it_was_preference_tuned(pushed_dpo, tiny_llama_dir):
    out, upload = pushed_dpo
    files = set(upload.files)
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= files
    assert not any(f.startswith("checkpoints/") for f in files)
    card = ModelCard(upload.files["README.md"].decode())
    assert "Preference-tuned with cloudtrain (`--task dpo`)" in card.text
    assert "loss `sigmoid`, beta 0.2" in card.text and "reference: the base with adapters disabled" in card.text
    assert "`tales-pairs.jsonl`" in card.text  # the data by its name
    assert str(out.parent) not in card.text  # no local path of the machine that trained it
    assert {"dpo", "sigmoid"} <= set(card.data.tags) and not card.data.metrics
    assert "Validation: loss " in card.text and ", pair accuracy " in card.text
    # the language-model card's parts that hold for it, not those of supervised tuning nor perplexity
    assert "preference-tuned (on chosen/rejected pairs) from a local base model" in card.text
    assert "supervised" not in card.text and "erplexity" not in card.text
    assert "AutoPeftModelForCausalLM" in card.text and "apply_chat_template" in card.text
    assert "### Sample answers" in card.text and "| Who found the golden key? |" in card.text
    assert TOKEN not in json.dumps({k: v.decode(errors="replace") for k, v in upload.files.items()})


@pytest.mark.slow
def test_the_pushed_dpo_adapter_downloads_and_chats(pushed_dpo, in_process, tmp_path, monkeypatch, capsys):
    folder = Path(snapshot_download("alice/tales-dpo", token=TOKEN, cache_dir=tmp_path / "cache"))
    assert json.loads((folder / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    chat_and_prompt(folder, monkeypatch, capsys)


# ---------------------------------------------------------------- a reward model, pushed


@pytest.mark.slow
def test_a_reward_model_is_pushed_with_its_card_and_scores_through_predict(hub, pushed):
    out = pushed["reward"]
    upload = hub.history("alice/tales-reward")[-1]
    assert {"README.md", "config.json", "model.safetensors"} <= set(upload.files)
    card = ModelCard(upload.files["README.md"].decode())
    assert "Bradley-Terry" in card.text and "`prefs.jsonl`" in card.text and str(out.parent) not in card.text
    assert "reward-model" in card.data.tags
    assert len(json.loads(upload.files["config.json"])["id2label"]) == 1  # one output
    # a decoder without a chat template reads its pairs through chatml (prompt and answer were glued): as a pair
    prompts, answers = ["Who was in the snow?", "Who was in the forest?"], ["The poor boy.", "A wolf."]
    scores = predict(str(out), prompts, pairs=answers)
    assert [r["label"] for r in scores] == ["reward", "reward"]


# ---------------------------------------------------------------- DPO as a SageMaker job


@pytest.mark.slow
def test_a_sagemaker_job_runs_dpo_from_a_channel_of_pairs(launcher, tiny_llama_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    channel = tmp_path / "pairs"
    channel.mkdir()
    write_jsonl(channel / "part-0.jsonl", pair_rows()[:2])
    write_jsonl(channel / "part-1.jsonl", pair_rows()[2:])
    (tmp_path / "aws").mkdir()
    with local_aws(tmp_path / "aws") as aws:
        spec = launcher.JobSpec(
            instance_type="ml.g5.2xlarge",
            processes_per_host=1,
            base_job_name="cloudtrain-dpo",
            train=str(channel),
            hyperparameters={
                "task": "dpo",
                "model_name_or_path": tiny_llama_dir,
                "peft": "lora",
                "lora_r": 4,
                "max_steps": 2,
                "per_device_train_batch_size": 2,
                "max_length": 64,
                "logging_steps": 1,
                "mixed_precision": "no",
                "num_sample_prompts": 0,
            },
        )
        request = aws.request_for(launcher.launch(spec, launcher.make_session()))
        root = tmp_path / "opt-ml"
        env = container_environment(request, aws.client("s3"), root)
        job = run_torchrun_driver(env, root, root / "checkpoints")
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    model_dir = Path(env["SM_MODEL_DIR"])
    args = json.loads((model_dir / "args.json").read_text())
    assert (args["task"], args["train_file"]) == ("dpo", str(root / "input" / "data" / "train"))
    assert json.loads((model_dir / "train_results.json").read_text())["global_step"] == 2
    output = job.stdout + job.stderr
    # both files of the channel: 4 pairs, one carved off for validation
    assert "data: 3 train pairs" in output and "; 1 validation pairs" in output
    assert (model_dir / "adapter_model.safetensors").is_file()
    chat_and_prompt(model_dir, monkeypatch, capsys)
