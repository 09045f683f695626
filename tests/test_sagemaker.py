"""SageMaker: the launcher with the real SDK 3, the job side on this machine, the notebook, the Dockerfile.

Nothing reaches AWS. tests/aws_server.py serves the AWS APIs from moto on 127.0.0.1 (the SDK finds it
through AWS_ENDPOINT_URL), records each CreateTrainingJob as it arrived, and fakes what a job leaves
behind (log lines, model.tar.gz). The job side downloads what the launcher uploaded (code, SDK drivers,
data and model channels) into a folder laid out like /opt/ml and runs the SDK's own torchrun driver on it.
"""

import contextlib
import importlib.util
import json
import logging
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from aws_server import BUCKET, REGION, container_environment, local_aws, run_torchrun_driver
from conftest import REPO, TOPICS, topic_rows
from datasets import Dataset, DatasetDict

from cloudtrain import errors
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.sagemaker_env import CHECKPOINT_DIR_ENV, sagemaker_defaults

SECRETS = {"WANDB_API_KEY": "wandb-0f1e2d3c4b5a69788796a5b4c3d2e1f0", "HF_TOKEN": "hf_sagemaker_7e6d5c4b3a2918"}
HF_IMAGE_PREFIX = (
    f"763104351884.dkr.ecr.{REGION}.amazonaws.com/huggingface-pytorch-training:2.9.0-transformers5.3.0-gpu"
)
LABELS = sorted(TOPICS)


@pytest.fixture(scope="session")
def launcher():
    """sagemaker/launch.py, loaded by path: the folder is no package, so it never shadows the SDK."""
    spec = importlib.util.spec_from_file_location("cloudtrain_sagemaker_launch", REPO / "sagemaker" / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    with local_aws(tmp_path_factory.mktemp("aws")) as fake:
        yield fake


@pytest.fixture
def secrets(monkeypatch) -> dict:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_PROJECT", "cloudtrain-on-sagemaker")
    return SECRETS


@pytest.fixture(scope="module")
def topic_data(tmp_path_factory) -> dict[str, Path]:
    """Channels as users bring them: train a save_to_disk folder, validation a folder of csv files."""
    import pandas as pd

    root = tmp_path_factory.mktemp("topic-data")
    DatasetDict({"train": Dataset.from_list(topic_rows(20))}).save_to_disk(str(root / "train"))
    (root / "validation").mkdir()
    pd.DataFrame(topic_rows(3, 1)).to_csv(root / "validation" / "part-0.csv", index=False)
    pd.DataFrame(topic_rows(2, 3)).to_csv(root / "validation" / "part-1.csv", index=False)
    return {"train": root / "train", "validation": root / "validation"}


@pytest.fixture(scope="module")
def trained_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A sequence-classification model folder, as a job leaves it in /opt/ml/model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path_factory.mktemp("job-model")
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def s3_keys(aws, prefix: str) -> list[str]:
    pages = aws.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def s3_text(aws, uri: str) -> str:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return aws.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def channel_uris(request: dict) -> dict[str, str]:
    return {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}


def assert_no_secret(text: str) -> None:
    for name, value in SECRETS.items():
        assert value not in text, f"the value of {name} was printed"


# ---------------------------------------------------------------- the in-job contract


def test_the_repo_folder_never_shadows_the_sdk():
    assert not (REPO / "sagemaker" / "__init__.py").exists()
    for cwd in (REPO, REPO / "src", REPO / "sagemaker"):
        found = subprocess.run(
            [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('sagemaker').origin)"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert "site-packages" in found and found.endswith("__init__.py"), (cwd, found)


def test_outside_a_job_the_defaults_are_empty():
    assert sagemaker_defaults({"TRAINING_JOB_NAME": "x", "SM_CHANNEL_TRAIN": "/data", "HOME": "/root"}) == {}
    assert sagemaker_defaults({}) == {}


def test_inside_a_job_the_defaults_follow_the_contract(tmp_path):
    data = tmp_path / "input" / "data"
    rows = Dataset.from_list(topic_rows(2))
    DatasetDict({"train": rows, "validation": rows, "test": rows}).save_to_disk(str(data / "train"))
    for channel in ("test", "model", "code", "sm_drivers", "dev"):
        (data / channel).mkdir(parents=True)
    env = {
        "SM_MODEL_DIR": str(tmp_path / "model"),
        "SM_CHANNELS": '["train", "test", "model", "code", "sm_drivers"]',
        **{f"SM_CHANNEL_{c.upper()}": str(data / c) for c in ("train", "test", "model", "code", "sm_drivers")},
        "SM_TRAINING_ENV": json.dumps({"job_name": "cloudtrain-20261122101010"}),
        CHECKPOINT_DIR_ENV: str(tmp_path / "checkpoints"),
    }

    defaults = sagemaker_defaults(env)
    assert defaults == {
        "output_dir": str(tmp_path / "model"),
        "train_file": str(data / "train"),
        "validation_file": str(data / "train"),  # the saved DatasetDict's own split
        "test_file": str(data / "test"),  # a channel of its own wins over the saved split
        "model_name_or_path": str(data / "model"),
        "run_name": "cloudtrain-20261122101010",
        # an on-demand job's checkpoints: the instance's, never packed into model.tar.gz (they were; audit)
        "checkpoint_dir": str(tmp_path / "checkpoints"),
    }

    (tmp_path / "checkpoints").mkdir()  # SageMaker makes it when the job has a CheckpointConfig
    env.update(TRAINING_JOB_NAME="cloudtrain-spot-1", SM_CHANNEL_DEV=str(data / "dev"))
    defaults = sagemaker_defaults(env)
    assert defaults["validation_file"] == str(data / "dev")
    assert defaults["run_name"] == "cloudtrain-spot-1"
    assert (defaults["checkpoint_dir"], defaults["resume_from_checkpoint"]) == (str(tmp_path / "checkpoints"), "latest")
    cfg = build_config(defaults)  # every default is an option of the application
    assert cfg.output.output_dir == str(tmp_path / "model")


def test_a_channel_named_training_is_the_train_file_and_an_unread_one_is_refused(tmp_path, monkeypatch):
    """A channel named `training` (AWS's examples) was ignored and the job trained on the built-in R8 data without
    a word (found in audit)."""
    from cloudtrain.config import resolve_options

    (tmp_path / "training").mkdir()
    (tmp_path / "tokenizer").mkdir()
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_CHANNEL_TRAINING", str(tmp_path / "training"))
    assert sagemaker_defaults()["train_file"] == str(tmp_path / "training")
    monkeypatch.delenv("SM_CHANNEL_TRAINING")
    monkeypatch.setenv("SM_CHANNEL_MYDATA", str(tmp_path / "training"))
    with pytest.raises(UserError) as refused:
        resolve_options(None, {"max_steps": 1})
    assert str(refused.value) == (
        f"the job's channel 'mydata' ({tmp_path / 'training'}) sets no option, and the run has no training data (it "
        f"would train on the built-in data): name the channel train, or pass --train_file {tmp_path / 'training'}"
    )
    cfg = resolve_options(None, {"train_file": str(tmp_path / "training") + "/x.csv"})  # named: the user's choice
    assert cfg.data.train_file.endswith("x.csv")
    config = tmp_path / "training" / "run.yaml"  # a channel that holds the run's config file is read (review)
    config.write_text("max_steps: 1\n")
    assert resolve_options(str(config), {}).training.max_steps == 1
    monkeypatch.delenv("SM_CHANNEL_MYDATA")
    monkeypatch.setenv("SM_CHANNEL_TOKENIZER", str(tmp_path / "tokenizer"))  # named in an option: read
    assert resolve_options(None, {"tokenizer_name_or_path": str(tmp_path / "tokenizer")})


def test_a_job_of_two_instances_started_without_torchrun_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Found in audit: SM_HOST_COUNT=2 with no WORLD_SIZE trained the whole run on each instance, silently: twice
    the cost, both saving checkpoints to one S3 prefix."""
    from cloudtrain.cli import main
    from cloudtrain.config import resolve_options

    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_HOSTS", json.dumps(["algo-1", "algo-2"]))
    monkeypatch.setenv("SM_HOST_COUNT", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    refusal = (
        "the job has 2 instances but this process's launch spans 1 (its 1 processes): each instance would train the "
        "whole run alone, 2 times the cost, all saving checkpoints to one S3 prefix; launch with sagemaker/launch.py, "
        "or give the ModelTrainer distributed=Torchrun(), or use one instance"
    )
    assert main(["--max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {refusal}"] and not (tmp_path / "model").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a lone process, as a plain python start sees itself
    with pytest.raises(UserError, match="^the job has 2 instances but this process's launch spans 1 "):
        resolve_options(None, {"max_steps": 1})
    # a torchrun of 8 processes on each instance alone (found in review: 8 processes passed for 2 instances)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UserError, match=r"^the job has 2 instances but this process's launch spans 1 \(its 8 "):
        resolve_options(None, {"max_steps": 1})
    # torchrun across the hosts (its agents' count, or processes over those per node), or one instance
    for hosts, world, local in (("2", "2", "1"), ("2", "16", "8"), ("1", "1", "1")):
        monkeypatch.setenv("SM_HOST_COUNT", hosts)
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert resolve_options(None, {"max_steps": 1}).training.max_steps == 1
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("SM_HOST_COUNT", "2")
    assert resolve_options(None, {"max_steps": 1}).training.max_steps == 1
    monkeypatch.delenv("GROUP_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("SM_HOST_COUNT")  # SM_HOSTS alone says it too
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UserError, match="^the job has 2 instances"):
        resolve_options(None, {"max_steps": 1})


def test_a_config_object_in_a_job_keeps_the_jobs_channels_and_model_folder(tmp_path, monkeypatch):
    """train(Config()) inside a job: its untouched defaults replaced the job's, so it trained on the built-in data
    and saved where SageMaker never uploads from (keyword arguments and dicts were right)."""
    from cloudtrain.config import Config, resolve_options

    (tmp_path / "train").mkdir()
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_CHANNELS", '["train"]')
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "train"))
    cfg = Config()
    cfg.training.max_steps = 1
    resolved = resolve_options(cfg, {})
    assert (resolved.output.output_dir, resolved.data.train_file) == (str(tmp_path / "model"), str(tmp_path / "train"))
    assert resolved.training.max_steps == 1
    cfg.output.output_dir = str(tmp_path / "mine")  # what the object sets still wins over the job's
    assert resolve_options(cfg, {}).output.output_dir == str(tmp_path / "mine")


def test_datasets_or_a_dataset_name_in_a_job_with_a_train_channel_are_not_refused_for_it(tmp_path, monkeypatch):
    """The train channel's --train_file default beside datasets: or --dataset_name was refused, blaming a
    --train_file the user never gave (found in audit): their own data wins; the validation channel still applies,
    and a --train_file they give beside them is still refused."""
    from cloudtrain.config import resolve_options

    for channel in ("train", "validation"):
        (tmp_path / channel).mkdir()
    (tmp_path / "train" / "a.jsonl").write_text('{"text": "x"}\n')
    DatasetDict({"validation": Dataset.from_dict({"text": ["y"]})}).save_to_disk(tmp_path / "saved")
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "train"))
    stream = {"streaming": True, "max_steps": 1}
    mixture = resolve_options({"datasets": [{"path": str(tmp_path / "train" / "a.jsonl"), "weight": 2}]}, stream)
    assert mixture.data.train_file is None and len(mixture.data.datasets) == 1
    hub = resolve_options(None, {"dataset_name": "owner/corpus", **stream})
    assert (hub.data.dataset_name, hub.data.train_file) == ("owner/corpus", None)
    with pytest.raises(UserError, match="--dataset_name and --train_file both name the training data"):
        resolve_options(None, {"dataset_name": "owner/corpus", "train_file": str(tmp_path / "train")})
    monkeypatch.setenv("SM_CHANNEL_VALIDATION", str(tmp_path / "validation"))
    named = resolve_options(None, {"dataset_name": "owner/corpus", "max_steps": 1})
    assert (named.data.train_file, named.data.validation_file) == (None, str(tmp_path / "validation"))
    monkeypatch.delenv("SM_CHANNEL_VALIDATION")
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tmp_path / "saved"))  # a saved dataset's splits go with it
    assert sagemaker_defaults()["validation_file"] == str(tmp_path / "saved")
    named = resolve_options(None, {"dataset_name": "owner/corpus", "max_steps": 1})
    assert (named.data.train_file, named.data.validation_file) == (None, None)
    monkeypatch.setenv("SM_CHANNEL_VALIDATION", str(tmp_path / "validation"))  # its own channel wins, and stays
    named = resolve_options(None, {"dataset_name": "owner/corpus", "max_steps": 1})  # (it was dropped: review)
    assert (named.data.train_file, named.data.validation_file) == (None, str(tmp_path / "validation"))


# ---------------------------------------------------------------- the launcher, real SDK against moto


@pytest.mark.slow
def test_launch_sends_the_job_and_hides_secrets(
    aws, launcher, secrets, topic_data, tiny_model_dir, trained_model_dir, tmp_path, capsys, caplog
):
    """A local run's YAML, a spot job on two 4-GPU instances: what the SDK actually sent to CreateTrainingJob."""
    import boto3
    from transformers import AutoModelForSequenceClassification

    config = tmp_path / "local-run.yaml"
    config.write_text(f"""
data:
  train_file: {topic_data["train"]}
  validation_file: {topic_data["validation"]}
  max_length: 64
model:
  model_name_or_path: {tiny_model_dir}
training:
  num_train_epochs: 2
  learning_rate: 3.0e-5
  mixed_precision: "no"
tracking:
  report_to: [wandb, tensorboard]
output:
  output_dir: outputs/local-run
  overwrite_output_dir: true
""")
    spec = launcher.JobSpec(
        instance_type="ml.g5.12xlarge",
        instance_count=2,
        config=str(config),
        spot=True,
        max_run=3600,
        volume_size=200,
        base_job_name="cloudtrain-api",
        hyperparameters={
            "num_train_epochs": 3,
            "trust_remote_code": False,
            "checkpointing_steps": 50,
            "run_name": None,
        },
    )
    sent = []
    boto_session = boto3.Session()
    boto_session.events.register(
        "provide-client-params.sagemaker.CreateTrainingJob",
        lambda params, **_: sent.append(json.loads(json.dumps(params))),
    )
    session = launcher.Session(boto_session=boto_session)
    aws.model_dir = trained_model_dir
    caplog.set_level(logging.DEBUG)  # the SDK and botocore log whole requests at DEBUG

    name = launcher.launch(spec, session)

    request = sent[-1]
    assert request["TrainingJobName"] == name and name.startswith("cloudtrain-api-")
    assert request["AlgorithmSpecification"]["TrainingImage"].startswith(HF_IMAGE_PREFIX)
    assert request["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200}
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
    assert request["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
    assert request["CheckpointConfig"]["S3Uri"].startswith(f"s3://{BUCKET}/cloudtrain-api/{name}")
    assert request["HyperParameters"] == {  # the SDK's JSON for numbers and booleans; no local paths
        "max_length": "64",
        "num_train_epochs": "3",
        "learning_rate": "3e-05",
        "mixed_precision": "no",
        "report_to": "wandb,tensorboard",
        "overwrite_output_dir": "true",
        "trust_remote_code": "false",
        "checkpointing_steps": "50",
    }
    assert request["Environment"] == {**SECRETS, "WANDB_PROJECT": "cloudtrain-on-sagemaker"}
    assert aws.request_for(name)["Environment"] == request["Environment"]  # also what reached the server

    # The code, the SDK's drivers and the local data and model went to S3 first.
    uris = channel_uris(request)
    assert set(uris) == {"train", "validation", "model", "code", "sm_drivers"}
    code = uris["code"].removeprefix(f"s3://{BUCKET}/")
    code_files = {key.removeprefix(code).lstrip("/") for key in s3_keys(aws, code)}
    assert {
        "training_application.py",
        "requirements-sagemaker.txt",
        "cloudtrain/config/parse.py",
        "cloudtrain/sagemaker_env.py",
    } <= code_files
    assert not any("__pycache__" in key for key in code_files)
    for channel, marker in (("train", "dataset_dict.json"), ("validation", "part-1.csv"), ("model", "config.json")):
        assert any(key.endswith(marker) for key in s3_keys(aws, uris[channel].removeprefix(f"s3://{BUCKET}/")))
    distributed = json.loads(s3_text(aws, f"{uris['sm_drivers']}/distributed.json"))
    assert distributed["process_count_per_node"] is None  # torchrun, one process per GPU
    train_script = s3_text(aws, f"{uris['sm_drivers']}/sm_train.sh")
    assert "distributed_drivers/torchrun_driver.py" in train_script
    assert "install_requirements.py requirements-sagemaker.txt" in train_script
    source = json.loads(s3_text(aws, f"{uris['sm_drivers']}/sourcecode.json"))
    assert source["entry_script"] == "training_application.py"

    # Attach, logs and download: one call each.
    job = launcher.attach(name, session)
    assert job.training_job_status == "Completed"
    assert launcher.stream_logs(name, session, poll=0) == "Completed"
    model_dir = launcher.download_model(name, tmp_path / "fetched", session)
    assert AutoModelForSequenceClassification.from_pretrained(model_dir).config.id2label == dict(enumerate(LABELS))

    out = capsys.readouterr()
    printed = out.out + out.err
    assert f"launched {name}: 2 x ml.g5.12xlarge (spot)" in printed
    assert "2 x ml.g5.12xlarge spot" in printed  # attach's summary
    assert "[algo-2] algo-2: Training Container Execution Completed" in printed
    assert "environment passed to the job: WANDB_API_KEY, WANDB_PROJECT, HF_TOKEN (values hidden)" in printed
    assert "output_dir ignored" in printed
    assert "Input request" in caplog.text and launcher.MASK in caplog.text  # the SDK did log the request
    assert_no_secret(printed + caplog.text)


@pytest.mark.slow
def test_command_line_launch_logs_and_download(aws, launcher, secrets, topic_data, trained_model_dir, tmp_path, capsys):
    """The launch as a user types it, in a fresh interpreter with the SDK logging at DEBUG; then the
    commands that follow the job."""
    s3 = aws.client("s3")
    for file in sorted(Path(topic_data["validation"]).iterdir()):  # data already in S3
        s3.upload_file(str(file), BUCKET, f"datasets/topics/train/{file.name}")
    config = tmp_path / "job.yaml"
    config.write_text("max_length: 32\nreport_to: wandb\nmodel_name_or_path: prajjwal1/bert-tiny\n")
    aws.model_dir = trained_model_dir
    image = "111122223333.dkr.ecr.us-east-1.amazonaws.com/cloudtrain:latest"

    def cli(*args: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, "sagemaker/launch.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert_no_secret(result.stdout + result.stderr)
        return result

    launched = cli(
        "--config",
        str(config),
        "--instance_type",
        "ml.g5.xlarge",
        "--instance_count",
        "1",
        "--train",
        f"s3://{BUCKET}/datasets/topics/train",
        "--image_uri",
        image,
        "--hp",
        "num_train_epochs=1",
        "--hp",
        "push_to_hub=true",
        "--hp",
        "hub_model_id=alice/topics",
        "--base_job_name",
        "cloudtrain-cli",
        "--log_level",
        "DEBUG",
    )
    name = re.search(r"launched (\S+):", launched.stdout).group(1)
    assert "******" in launched.stderr  # DEBUG request logs were there, masked
    request = aws.request_for(name)
    assert request["AlgorithmSpecification"]["TrainingImage"] == image
    assert request["ResourceConfig"]["InstanceCount"] == 1 and not request.get("EnableManagedSpotTraining")
    assert "CheckpointConfig" not in request
    assert request["HyperParameters"] == {
        "max_length": "32",
        "report_to": "wandb",
        "num_train_epochs": "1",
        "model_name_or_path": "prajjwal1/bert-tiny",
        "push_to_hub": "true",
        "hub_model_id": "alice/topics",
    }
    assert channel_uris(request)["train"] == f"s3://{BUCKET}/datasets/topics/train"
    assert set(request["Environment"]) == {"WANDB_API_KEY", "WANDB_PROJECT", "HF_TOKEN"}

    assert launcher.main(["attach", name]) == 0
    assert launcher.main(["logs", name, "--poll", "0"]) == 0
    assert launcher.main(["download", name, "--dest", str(tmp_path / "model")]) == 0
    printed = capsys.readouterr().out
    assert f"{name}: Completed (Completed), 1 x ml.g5.xlarge" in printed
    assert "[algo-1] algo-1: Running Torchrun Driver" in printed
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "model" / "model.safetensors").is_file()
    assert launcher.main(["download", "no-such-job"]) == 2  # one error line, no traceback
    assert "error: training job no-such-job" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hyperparameters": {"hub_token": "hf_x"}}, "hub_token must not be a hyperparameter"),
        ({"train": None}, "the job has no training data"),
        ({"instance_type": "ml.m5.xlarge"}, "no Hugging Face training image for ml.m5.xlarge"),
        ({"hyperparameters": {"learning_rat": 0.1}}, "did you mean learning_rate"),
        ({"hyperparameters": {"push_to_hub": True, "hub_model_id": "alice/x"}}, "push_to_hub true needs HF_TOKEN"),
        ({"max_wait": 7200}, "--max_wait applies to spot capacity only"),
        ({"hyperparameters": {"deepspeed_config": "configs/deepspeed/zero2.json"}}, "use the zero_stage"),
        ({"hyperparameters": {"hub_token_file": "/etc/hostname"}}, "is a file of this machine, which the job cannot"),
        ({"hyperparameters": {"tokenizer_name_or_path": "data/grimm/tokenizer"}}, "is a local path the job cannot"),
        ({"hyperparameters": {"test_file": "no/such/test.csv"}}, "test_file no/such/test.csv does not exist here"),
        ({"train": "no/such/train.csv"}, "train data no/such/train.csv does not exist; give an S3 URI or a local"),
    ],
)
def test_mistakes_fail_before_anything_is_uploaded(aws, launcher, topic_data, monkeypatch, change, message):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    spec = launcher.JobSpec(
        **{
            "instance_type": "ml.g5.xlarge",
            "train": str(topic_data["train"]),
            "base_job_name": "cloudtrain-mistake",
            **change,
        }
    )
    jobs_before = len(aws.requests)
    with pytest.raises(UserError, match=re.escape(message)):
        launcher.launch(spec)
    assert len(aws.requests) == jobs_before
    assert s3_keys(aws, "cloudtrain-mistake") == []


def test_without_aws_credentials_each_command_says_so_in_one_line(launcher, topic_data, tmp_path, monkeypatch, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing is sent: signing fails first
    launch = ["--instance_type", "ml.g5.xlarge", "--train", str(topic_data["train"])]
    for argv in (launch, ["logs", "some-job"], ["download", "some-job", "--dest", str(tmp_path / "model")]):
        assert launcher.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: no AWS credentials: run `aws configure`"), err
    assert launcher.main(["--instance_type", "ml.g5.xlarge", "--train", "no/such.csv"]) == 2  # before credentials
    assert capsys.readouterr().err.startswith("error: train data no/such.csv does not exist")


# ---------------------------------------------------------------- text-to-image folders as channels


@pytest.fixture(scope="module")
def t2i_data(tmp_path_factory) -> dict[str, Path]:
    from t2i_fixtures import build_tiny_pipeline, captioned_folder, plain_folder

    root = tmp_path_factory.mktemp("t2i-data")
    return {
        "pipe": build_tiny_pipeline(root / "pipe"),
        "captioned": captioned_folder(root / "captioned", n=4),
        "instance": plain_folder(root / "instance", (220, 30, 30), n=3),
        "class": plain_folder(root / "class", (30, 30, 220), n=2),
    }


def t2i_options(t2i_data: dict[str, Path], **folders) -> dict:
    options = {"task": "text_to_image", "model_name_or_path": str(t2i_data["pipe"]), "resolution": 16}
    return {**options, **{name: str(value) for name, value in folders.items()}}


DREAMBOOTH = {"instance_prompt": "a photo of sks square", "class_prompt": "a square", "with_prior_preservation": True}


@pytest.mark.slow
def test_image_folders_go_up_as_channels_and_the_job_reads_them(aws, launcher, t2i_data, tmp_path):
    """train_data_dir -> the train channel, instance/class_data_dir -> their own; the options sent are the folders'
    paths in the job, and there (this machine playing /opt/ml) the task reads the uploaded images."""
    from cloudtrain.registry import TASKS

    captioned = t2i_options(t2i_data, train_data_dir=t2i_data["captioned"])
    dreambooth = {**t2i_options(t2i_data, instance_data_dir=t2i_data["instance"], class_data_dir=t2i_data["class"])}
    runs = {"captioned": (captioned, {"train"}), "dreambooth": ({**dreambooth, **DREAMBOOTH}, {"instance", "class"})}
    for label, (options, expected) in runs.items():
        spec = launcher.JobSpec(instance_type="ml.g5.xlarge", base_job_name=f"t2i-{label}", hyperparameters=options)
        name = launcher.launch(spec, launcher.make_session())
        request = aws.request_for(name)
        uris = channel_uris(request)
        assert set(uris) == expected | {"model", "code", "sm_drivers"}
        sent = request["HyperParameters"]
        for channel, option in (
            ("train", "train_data_dir"),
            ("instance", "instance_data_dir"),
            ("class", "class_data_dir"),
        ):
            if channel in expected:
                assert sent[option] == f"/opt/ml/input/data/{channel}"  # no path of this machine
                keys = s3_keys(aws, uris[channel].removeprefix(f"s3://{BUCKET}/"))
                local = sorted(p.name for p in Path(options[option]).iterdir())
                assert sorted(key.rsplit("/", 1)[-1] for key in keys) == local
            else:
                assert option not in sent
        root = tmp_path / label
        env = container_environment(request, aws.client("s3"), root)
        in_job = {key: json.loads(value) if value in ("true", "false") else value for key, value in sent.items()}
        in_job = {k: v.replace("/opt/ml", str(root)) if isinstance(v, str) else v for k, v in in_job.items()}
        cfg = build_config({**sagemaker_defaults(env), **in_job})
        task = TASKS["text_to_image"](cfg)
        cfg = task.resolve_options(cfg)
        task.check_data(cfg)  # reads the downloaded folders' names and captions
        folder = cfg.images.train_data_dir or cfg.images.instance_data_dir
        assert folder == str(root / "input" / "data" / ("train" if label == "captioned" else "instance"))
        if label == "dreambooth":
            assert cfg.images.class_data_dir == str(root / "input" / "data" / "class")


@pytest.mark.parametrize(
    "folders, message",
    [
        ({"train_data_dir": "no/such/images"}, "train_data_dir no/such/images is not a folder here"),
        ({"instance_data_dir": "no/such/instance"}, "instance_data_dir no/such/instance is not a folder here"),
        ({"train_data_dir": "captioned", "train": "captioned"}, "train_data_dir and the job's train channel"),
        ({"train_data_dir": "captioned", "train_file": "captioned"}, "train_data_dir and the job's train channel"),
    ],
)
def test_image_folder_mistakes_fail_before_anything_is_uploaded(aws, launcher, t2i_data, folders, message):
    paths = {k: str(t2i_data.get(v, v)) for k, v in folders.items()}
    train = paths.pop("train", None)
    spec = launcher.JobSpec(
        instance_type="ml.g5.xlarge",
        train=train,
        base_job_name="t2i-mistake",
        hyperparameters=t2i_options(t2i_data, **paths),
    )
    jobs_before = len(aws.requests)
    with pytest.raises(UserError, match=re.escape(message)):
        launcher.launch(spec)
    assert len(aws.requests) == jobs_before
    assert s3_keys(aws, "t2i-mistake") == []


def test_inside_a_job_dreambooth_channels_set_their_folders(tmp_path):
    env = {"SM_MODEL_DIR": str(tmp_path / "model")}
    env.update({f"SM_CHANNEL_{c.upper()}": str(tmp_path / c) for c in ("instance", "class")})
    defaults = sagemaker_defaults(env)
    assert (defaults["instance_data_dir"], defaults["class_data_dir"]) == (
        str(tmp_path / "instance"),
        str(tmp_path / "class"),
    )


# ---------------------------------------------------------------- the job side, on this machine


@dataclass
class JobRun:
    request: dict
    root: Path  # plays /opt/ml
    env: dict
    first: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def job_run(aws, launcher, topic_data, tiny_model_dir, tmp_path_factory) -> JobRun:
    """A spot job launched as a user would, then run like one instance: 2 processes under torchrun."""
    spec = launcher.JobSpec(
        instance_type="ml.g5.2xlarge",
        processes_per_host=2,
        spot=True,
        base_job_name="cloudtrain-job",
        train=str(topic_data["train"]),
        validation=str(topic_data["validation"]),
        hyperparameters={
            "model_name_or_path": tiny_model_dir,
            "max_steps": 6,
            "per_device_train_batch_size": 4,
            "max_length": 32,
            "logging_steps": 1,
            "checkpointing_steps": 2,
            "save_total_limit": 10,
            "seed": 7,
        },
    )
    name = launcher.launch(spec, launcher.make_session())
    request = aws.request_for(name)
    root = tmp_path_factory.mktemp("opt-ml")
    env = container_environment(request, aws.client("s3"), root)
    return JobRun(request, root, env, run_torchrun_driver(env, root, root / "checkpoints"))


def run_output(result: subprocess.CompletedProcess) -> str:
    return (result.stdout + result.stderr)[-6000:]


@pytest.mark.slow
def test_job_saves_a_loadable_model_in_sm_model_dir(job_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    assert job_run.first.returncode == 0, run_output(job_run.first)
    assert "--nnodes=1 --nproc_per_node=2" in job_run.first.stdout  # the SDK driver's torchrun command
    model_dir = Path(job_run.env["SM_MODEL_DIR"])
    args = json.loads((model_dir / "args.json").read_text())
    data = job_run.root / "input" / "data"
    assert args["output_dir"] == str(model_dir)
    assert args["run_name"] == job_run.request["TrainingJobName"]
    assert (args["train_file"], args["validation_file"]) == (str(data / "train"), str(data / "validation"))
    assert args["model_name_or_path"] == str(data / "model")
    assert args["checkpoint_dir"] == str(job_run.root / "checkpoints")
    assert json.loads((model_dir / "train_results.json").read_text())["global_step"] == 6
    assert json.loads((model_dir / "eval_results.json").read_text())["samples"] == 15  # both csv files

    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    assert sorted(model.config.id2label.values()) == LABELS
    classify = pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    assert classify("the striker scored twice")[0]["label"] in LABELS


def checkpoint_steps(folder: Path) -> dict[int, Path]:
    return {
        int(p.name.removeprefix("checkpoint-")): p
        for p in folder.glob("checkpoint-*")
        if p.name.removeprefix("checkpoint-").isdigit()
    }


@pytest.mark.slow
def test_job_resumes_from_its_checkpoint_after_an_interruption(job_run):
    """Spot reclaimed after step 4: a new instance gets the synced checkpoints back and an empty model dir."""
    assert job_run.first.returncode == 0, run_output(job_run.first)
    checkpoints = job_run.root / "checkpoints"
    assert sorted(checkpoint_steps(checkpoints)) == [2, 4, 6]
    shutil.rmtree(checkpoint_steps(checkpoints)[6])  # the interruption came before step 6 was saved
    # the job had run an hour when checkpoint-4 was written (its sessions' wall time, which the job is billed for)
    state_file = checkpoint_steps(checkpoints)[4] / "trainer_state.json"
    meta = json.loads(state_file.read_text())
    assert meta["state"]["job"] == job_run.request["TrainingJobName"] and meta["state"]["job_wall_s"] > 0
    meta["state"]["job_wall_s"] = 3600.0
    state_file.write_text(json.dumps(meta))
    written_before = {
        step: (path / "trainer_state.json").stat().st_mtime_ns for step, path in checkpoint_steps(checkpoints).items()
    }
    model_dir = Path(job_run.env["SM_MODEL_DIR"])
    shutil.rmtree(model_dir)
    model_dir.mkdir()

    began = time.monotonic()
    second = run_torchrun_driver(job_run.env, job_run.root, checkpoints)
    took = time.monotonic() - began

    assert second.returncode == 0, run_output(second)
    assert sorted(checkpoint_steps(checkpoints)) == [2, 4, 6]
    for step, mtime in written_before.items():  # a run that started over would have saved 2 and 4 again
        assert (checkpoint_steps(checkpoints)[step] / "trainer_state.json").stat().st_mtime_ns == mtime
    logged = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in logged if "train/loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]  # steps 1-4 came back with checkpoint-4, 5-6 were trained again
    train = json.loads((model_dir / "train_results.json").read_text())
    assert train["global_step"] == 6
    # the same job resumed: it is billed for both sessions, so its wall time adds the first one's hour
    compute = json.loads((model_dir / "compute_results.json").read_text())
    assert 3600 + train["launch_runtime_s"] - 1 <= compute["wall_hours"] * 3600 <= 3600 + took + 1  # hours rounded
    assert compute["instance_hours"] == compute["wall_hours"]  # one instance


# ---------------------------------------------------------------- the notebook


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_against_the_local_aws(aws, secrets, trained_model_dir, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    aws.model_dir = trained_model_dir
    jobs_before = len(aws.requests)
    notebook = nbformat.read(REPO / "notebooks" / "sagemaker_training.ipynb", as_version=4)
    try:
        NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}
        ).execute()
    finally:  # the notebook unpacks the model into the repository's (ignored) outputs/, as a user's would
        for request in aws.requests[jobs_before:]:
            shutil.rmtree(REPO / "outputs" / "sagemaker" / request["TrainingJobName"], ignore_errors=True)
        with contextlib.suppress(OSError):  # only when empty
            (REPO / "outputs" / "sagemaker").rmdir()

    outputs = json.dumps([cell.get("outputs", []) for cell in notebook.cells])
    assert_no_secret(outputs)
    requests = aws.requests[jobs_before:]
    assert len(requests) == 2
    single, multi = requests
    assert single["ResourceConfig"]["InstanceCount"] == 1 and not single.get("EnableManagedSpotTraining")
    assert multi["ResourceConfig"]["InstanceCount"] == 2 and multi["EnableManagedSpotTraining"] is True
    assert multi["StoppingCondition"]["MaxWaitTimeInSeconds"] >= multi["StoppingCondition"]["MaxRuntimeInSeconds"]
    assert multi["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
    for request in requests:
        assert request["AlgorithmSpecification"]["TrainingImage"].startswith(HF_IMAGE_PREFIX)
        assert {"train", "validation", "test", "code", "sm_drivers"} <= set(channel_uris(request))
        assert set(request["Environment"]) == {"WANDB_API_KEY", "WANDB_PROJECT", "HF_TOKEN"}
        assert request["HyperParameters"]["report_to"] == "wandb"
    assert single["HyperParameters"]["push_to_hub"] == "true"
    assert f"launched {single['TrainingJobName']}" in outputs
    assert "Training Container Execution Completed" in outputs  # the logs cell
    assert "predicted" in outputs  # the fetched model classified a text


# ---------------------------------------------------------------- the image and the job's requirements


def requirement_pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {re.split(r"[=<>!~\[ ]", line)[0].lower().replace("_", "-"): line for line in lines if line}


def test_the_job_installs_the_projects_pins_and_keeps_the_images_torch():
    project = requirement_pins(REPO / "requirements.txt")
    job = requirement_pins(REPO / "src" / "requirements-sagemaker.txt")
    assert "torch" not in job
    assert {"transformers", "accelerate", "datasets", "huggingface-hub", "peft"} <= set(job)  # peft: saving imports it
    for name, line in job.items():
        assert project.get(name) == line, f"{line} differs from requirements.txt"


def test_dockerfile_copies_what_exists_and_installs_the_projects_requirements():
    text = (REPO / "Dockerfile").read_text()
    instructions = [line for line in re.sub(r"\\\n", " ", text).splitlines() if line and not line.startswith("#")]
    copies = [line.split()[1:-1] for line in instructions if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    copied = {Path(s).name or s for sources in copies for s in sources}
    assert {"requirements.txt", "constraints.txt", "Makefile"} <= copied
    runs = " ".join(line for line in instructions if line.startswith("RUN "))
    assert "make setup" in runs  # the project's own set-up: requirements.txt with constraints.txt
    assert re.search(r"pip install [^&]*-c constraints\.txt[^&]* torch", runs)  # the pinned torch, first
    assert re.search(r'CMD \["make", "train"\]', text)
    assert "ENV PATH=/opt/cloudtrain/.venv/bin:$PATH" in text  # SageMaker's drivers find python3 and torchrun


def test_a_config_s_stream_sources_reach_the_job_as_they_were(launcher, tmp_path):
    """A `datasets:` list was comma-joined as Python text, which the job read as one path and died on; and the
    Hugging Face image refused such a config as having no training data (found in audit)."""
    sources = [{"path": "s3://b/a/*.jsonl", "weight": 0.7}, {"path": "hf://datasets/org/c", "weight": 0.3}]
    config = tmp_path / "mix.json"
    options = {"streaming": True, "task": "causal_lm", "max_steps": 10, "model_name_or_path": "gpt2"}
    config.write_text(json.dumps({**options, "datasets": sources}))
    sent, channels, _ = launcher.job_options(launcher.JobSpec(instance_type="ml.g5.xlarge", config=str(config)))
    assert channels == {} and build_config({"streaming": True, "datasets": sent["datasets"]}).data.datasets == sources
    config.write_text(json.dumps({**options, "datasets": [*sources, {"path": "data/local.jsonl"}]}))
    with pytest.raises(UserError, match="datasets: data/local.jsonl is not a source the job can read"):
        launcher.job_options(launcher.JobSpec(instance_type="ml.g5.xlarge", config=str(config)))
    # given as one hyperparameter, a later file, or plain paths: the same sources reach the job (review)
    more = tmp_path / "more.json"
    more.write_text(json.dumps({"datasets": ["s3://b/a/*.jsonl", "/opt/ml/input/data/train"]}))
    for spec in (
        launcher.JobSpec(instance_type="ml.g5.xlarge", config=[str(config), str(more)]),
        launcher.JobSpec(instance_type="ml.g5.xlarge", hyperparameters={**options, "datasets": "s3://b/a/*.jsonl"}),
    ):
        sent, _, cfg = launcher.job_options(spec)
        assert build_config({"streaming": True, "datasets": sent["datasets"]}).data.datasets == cfg.data.datasets


def test_list_options_reach_the_job_split_as_the_application_splits_them(launcher):
    """Prompts are split at |, so a comma-joined list of prompts with commas in them came back wrong (review)."""
    options = {"sample_prompts": ["Once upon a time, a king", "The wolf said"], "lora_target_modules": ["q", "v"]}
    sent = launcher.to_hyperparameters(options)
    assert build_config(sent).to_dict() == build_config(options).to_dict()


def test_values_reach_the_job_as_they_were_checked_through_the_sdks_own_serialization(launcher, tmp_path):
    """The launcher took max_steps 1000.0 from a YAML file and the job refused it after the instance started; the
    SDK's driver JSON-decodes every value, so hub_revision 2024.10 reached the job as 2024.1 (found in audit)."""
    from sagemaker.train.container_drivers.common.utils import hyperparameters_to_cli_args
    from sagemaker.train.utils import safe_serialize
    from test_config import parse

    config = tmp_path / "job.yaml"
    config.write_text("max_steps: 1000.0\nhub_revision: '2024.10'\nrun_name: 'true'\nlearning_rate: 2.0e-5\n"
                      "tags: ['2024.10']\nsample_prompts: ['1e3']\nproject_name: '\"x\"'\n")  # fmt: skip
    spec = launcher.JobSpec(instance_type="ml.g5.xlarge", config=str(config), train=str(tmp_path))
    sent, _, checked = launcher.job_options(spec)
    argv = hyperparameters_to_cli_args({key: safe_serialize(value) for key, value in sent.items()})
    job = parse(*argv)  # what the application inside the job parses
    assert (job.training.max_steps, job.hub.hub_revision, job.tracking.run_name) == (1000, "2024.10", "true")
    assert (job.tracking.tags, job.data.sample_prompts, job.tracking.project_name) == (["2024.10"], ["1e3"], '"x"')
    assert job.training.learning_rate == checked.training.learning_rate == 2e-5


def test_a_job_s_error_line_is_its_failure_reason(tmp_path, monkeypatch):
    """Each process of a multi-GPU job printed its line and the SDK's driver wrote torchrun's traceback as the
    FailureReason (found in audit): the first process to fail now writes its line there, and the driver keeps it."""
    from cloudtrain.cli import run_command

    failure = tmp_path / "output" / "failure"
    failure.parent.mkdir()
    monkeypatch.setenv("SM_OUTPUT_FAILURE", str(failure))
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    assert run_command(["--learning_rate", "fast"]) == 2
    assert failure.read_text() == "--learning_rate: expected a number, got 'fast'"
    assert run_command(["--seed", "x"]) == 2  # a second process's line: the first one's stays
    assert failure.read_text().startswith("--learning_rate")
    failure.unlink()
    errors.report("stopped: interrupted", 143)  # a stop (a spot interruption) is no failure
    assert not failure.exists()


def test_a_failed_job_s_model_is_downloaded_for_push_and_its_retry_line_says_so(launcher, aws, tmp_path, monkeypatch):
    """A job whose final Hub push failed said "the model is safe in /opt/ml/model; retry with push --output_dir
    /opt/ml/model", a folder gone with the instance, and `download` refused a Failed job (found in audit).
    SageMaker uploads /opt/ml/model when a job fails too: `download` fetches it, and the line names both steps."""
    from aws_server import pack

    from cloudtrain.publish import hub

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    s3 = aws.client("s3")
    s3.create_bucket(Bucket=BUCKET) if BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]] else None
    s3.put_object(Bucket=BUCKET, Key="jobs/failed-1/output/model.tar.gz", Body=pack(model))
    jobs = {
        "failed-1": {"TrainingJobStatus": "Failed", "ModelArtifacts": {"S3ModelArtifacts": f"s3://{BUCKET}/jobs/failed-1/output/model.tar.gz"}},
        "failed-2": {"TrainingJobStatus": "Stopped", "ModelArtifacts": {"S3ModelArtifacts": f"s3://{BUCKET}/jobs/none/model.tar.gz"}},
        "running-1": {"TrainingJobStatus": "InProgress"},
    }  # fmt: skip
    monkeypatch.setattr(launcher, "describe", lambda name, session: jobs[name])
    session = launcher.make_session()
    fetched = launcher.download_model("failed-1", tmp_path / "fetched", session)
    assert (fetched / "config.json").read_text() == "{}"
    with pytest.raises(UserError, match="training job failed-2 is Stopped and left no model.tar.gz"):
        launcher.download_model("failed-2", tmp_path / "none", session)
    assert not (tmp_path / "none").exists()
    with pytest.raises(UserError, match="training job running-1 is InProgress: its model.tar.gz exists once it has"):
        launcher.download_model("running-1", tmp_path / "none", session)

    monkeypatch.setenv("SM_MODEL_DIR", "/opt/ml/model")
    monkeypatch.setenv("TRAINING_JOB_NAME", "failed-1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    line = hub.retry_command(Path("/opt/ml/model"), build_config({"hub_model_id": "alice/x"}).hub)
    # from the repository's root on your machine (found in review: the container's command line, no region)
    assert line.startswith("python sagemaker/launch.py download failed-1 --region eu-west-1 && ")
    assert "&& python src/training_application.py push --output_dir outputs/sagemaker/failed-1 --hub_model_id" in line


def test_an_output_folder_outside_the_jobs_model_folder_is_said(tmp_path):
    """A job built with the SDK directly kept an --output_dir SageMaker never uploads, without a word (audit)."""
    from cloudtrain.sagemaker_env import job_notes

    env = {"SM_MODEL_DIR": str(tmp_path / "model")}
    assert job_notes(str(tmp_path / "model"), env) == job_notes(str(tmp_path / "model" / "run"), env) == []
    assert job_notes(str(tmp_path / "elsewhere"), {}) == []  # outside a job: anywhere
    (note,) = job_notes(str(tmp_path / "elsewhere"), env)
    assert note.startswith(f"--output_dir {tmp_path / 'elsewhere'} is outside the job's model folder {tmp_path}/model")
