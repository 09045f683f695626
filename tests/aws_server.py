"""A local AWS for the SageMaker tests: moto's server on 127.0.0.1, plus what SageMaker does that moto does not.

moto answers the real SDK (S3, CloudWatch Logs, CreateTrainingJob, DescribeTrainingJob), marks every
training job Completed at once and runs nothing. `FakeSageMaker` adds, for each CreateTrainingJob:
- the request exactly as it arrived on the wire (moto drops fields such as Environment);
- the container's visible traces: log lines in /aws/sagemaker/TrainingJobs/<job>/algo-N-<id>, and,
  when `model_dir` is set, that folder as model.tar.gz where the job's ModelArtifacts point.

`container_environment` and `run_torchrun_driver` play one instance of a job on this machine:
the job's channels downloaded from S3 into a folder laid out like /opt/ml, the SM_* variables the SDK's
container drivers set (pointing into that folder), and the SDK's own torchrun driver, uploaded with
the job, starting the entry script.
"""

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.sagemaker.responses import SageMakerResponse
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
BUCKET = "cloudtrain-test-bucket"
ROLE_ARN = "arn:aws:iam::123456789012:role/cloudtrain-sagemaker-test"
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
# SDK defaults: no telemetry calls, and a default bucket, so that the SDK needs no STS call (the SDK
# sends STS to its regional endpoint, not to AWS_ENDPOINT_URL).
SDK_CONFIG = f"""SchemaVersion: '1.0'
SageMaker:
  PythonSDK:
    Modules:
      TelemetryOptOut: true
      Session:
        DefaultS3Bucket: {BUCKET}
"""


class FakeSageMaker:
    """moto's server, with every CreateTrainingJob recorded and its container's output faked."""

    def __init__(self):
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.url = ""
        self.requests: list[dict] = []
        self.model_dir: Path | None = None  # packed as each job's model.tar.gz when set
        self.log_lines = [
            "Starting training script",
            "Running Torchrun Driver",
            "Training Container Execution Completed",
        ]

    def client(self, service: str):
        return boto3.client(service, endpoint_url=self.url, region_name=REGION)

    def on_create_training_job(self, request: dict) -> None:
        self.requests.append(request)
        job = request["TrainingJobName"]
        for host in range(1, request["ResourceConfig"]["InstanceCount"] + 1):
            self._write_logs(
                f"{job}/algo-{host}-{int(time.time())}", [f"algo-{host}: {line}" for line in self.log_lines]
            )
        if self.model_dir is not None:
            uri = f"{request['OutputDataConfig']['S3OutputPath'].rstrip('/')}/{job}/output/model.tar.gz"
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            self.client("s3").put_object(Bucket=bucket, Key=key, Body=pack(self.model_dir))

    def _write_logs(self, stream: str, lines: list[str]) -> None:
        logs = self.client("logs")
        with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
            logs.create_log_group(logGroupName=LOG_GROUP)
        logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
        now = int(time.time() * 1000)
        logs.put_log_events(
            logGroupName=LOG_GROUP,
            logStreamName=stream,
            logEvents=[{"timestamp": now + i, "message": line} for i, line in enumerate(lines)],
        )

    def request_for(self, job_name: str) -> dict:
        return next(r for r in self.requests if r["TrainingJobName"] == job_name)


def pack(folder: Path) -> bytes:
    """A folder as SageMaker packs /opt/ml/model: model.tar.gz with the files at its top level."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(Path(folder).rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()


@contextlib.contextmanager
def local_aws(tmp_dir: Path) -> Iterator[FakeSageMaker]:
    """Start the fake; while it runs, AWS clients in this process and its children reach it."""
    fake = FakeSageMaker()
    original = SageMakerResponse.create_training_job

    def create_training_job(response: SageMakerResponse) -> str:
        result = original(response)
        fake.on_create_training_job(json.loads(response.body))
        return result

    config = Path(tmp_dir) / "sagemaker-sdk-config.yaml"
    config.write_text(SDK_CONFIG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SageMakerResponse, "create_training_job", create_training_job)
        fake.server.start()
        host, port = fake.server.get_host_and_port()
        fake.url = f"http://{host}:{port}"
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ENDPOINT_URL", fake.url)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.setenv("AWS_CONFIG_FILE", str(Path(tmp_dir) / "no-aws-config"))  # never a developer's profile
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(Path(tmp_dir) / "no-aws-credentials"))
        mp.setenv("SAGEMAKER_USER_CONFIG_OVERRIDE", str(config))
        mp.setenv("SAGEMAKER_VALIDATE_ROLE", "false")  # moto has no iam:SimulatePrincipalPolicy
        mp.setenv("SAGEMAKER_ROLE", ROLE_ARN)
        # moto's request log, and its tracebacks for the iam:SimulatePrincipalPolicy the SDK tries
        mp.setattr(logging.getLogger("werkzeug"), "level", logging.CRITICAL)
        fake.client("s3").create_bucket(Bucket=BUCKET)  # the user's bucket
        try:
            yield fake
        finally:
            fake.server.stop()


# ---------------------------------------------------------------- one instance of a job, on this machine


def download_prefix(s3, uri: str, dest: Path) -> None:
    """What SageMaker does for an S3Prefix channel in File mode: every object under the prefix into `dest`."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    dest.mkdir(parents=True, exist_ok=True)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            relative = item["Key"][len(prefix) :].lstrip("/") or Path(item["Key"]).name
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, item["Key"], str(target))


def _deserialize(value: str):
    """The SDK container's reading of a hyperparameter: JSON when it parses, else the string."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def container_environment(request: dict, s3, root: Path) -> dict[str, str]:
    """Lay out `root` like /opt/ml for `request` and return the SM_* variables SDK 3's drivers would set.

    Mirrors sagemaker/train/container_drivers/scripts/environment.py, with /opt/ml replaced by `root`.
    """
    data = root / "input" / "data"
    channels = [channel["ChannelName"] for channel in request["InputDataConfig"]]
    for channel in request["InputDataConfig"]:
        download_prefix(s3, channel["DataSource"]["S3DataSource"]["S3Uri"], data / channel["ChannelName"])
    for folder in ("model", "output/data", "input/config"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    if request.get("CheckpointConfig"):  # SageMaker creates (and syncs) the folder only then
        (root / "checkpoints").mkdir(exist_ok=True)
    resources = request["ResourceConfig"]
    hosts = [f"algo-{i}" for i in range(1, resources["InstanceCount"] + 1)]
    resource_config = {
        "current_host": "algo-1",
        "current_instance_type": resources["InstanceType"],
        "hosts": hosts,
        "network_interface_name": "eth0",
    }
    input_config = {name: {"TrainingInputMode": "File"} for name in channels}
    hps = {key: _deserialize(value) for key, value in request["HyperParameters"].items()}
    for name, content in (
        ("resourceconfig", resource_config),
        ("inputdataconfig", input_config),
        ("hyperparameters", request["HyperParameters"]),
    ):
        (root / "input" / "config" / f"{name}.json").write_text(json.dumps(content))
    drivers = data / "sm_drivers"
    source = json.loads((drivers / "sourcecode.json").read_text())
    env = {
        "SM_MODEL_DIR": root / "model",
        "SM_INPUT_DIR": root / "input",
        "SM_INPUT_DATA_DIR": data,
        "SM_INPUT_CONFIG_DIR": root / "input" / "config",
        "SM_OUTPUT_DIR": root / "output",
        "SM_OUTPUT_DATA_DIR": root / "output" / "data",
        "SM_MASTER_ADDR": "algo-1",
        "SM_MASTER_PORT": 7777,
        "SM_SOURCE_DIR": data / "code",
        "SM_ENTRY_SCRIPT": source["entry_script"],
        "SM_DISTRIBUTED_DRIVER_DIR": drivers / "distributed_drivers",
        "SM_DISTRIBUTED_CONFIG": (drivers / "distributed.json").read_text(),
        **{f"SM_CHANNEL_{name.upper()}": data / name for name in channels},
        "SM_CHANNELS": json.dumps(channels),
        **{f"SM_HP_{key.replace('-', '_').upper()}": value for key, value in request["HyperParameters"].items()},
        "SM_HPS": json.dumps(hps),
        "SM_CURRENT_HOST": "algo-1",
        "SM_CURRENT_INSTANCE_TYPE": resources["InstanceType"],
        "SM_HOSTS": json.dumps(hosts),
        "SM_NETWORK_INTERFACE_NAME": "eth0",
        "SM_HOST_COUNT": len(hosts),
        "SM_CURRENT_HOST_RANK": 0,
        "SM_NUM_CPUS": os.cpu_count(),
        "SM_NUM_GPUS": 0,
        "SM_NUM_NEURONS": 0,
        "SM_RESOURCE_CONFIG": json.dumps(resource_config),
        "SM_INPUT_DATA_CONFIG": json.dumps(input_config),
        "TRAINING_JOB_NAME": request["TrainingJobName"],
        **request.get("Environment", {}),
    }
    env["SM_TRAINING_ENV"] = json.dumps(
        {
            "channel_input_dirs": {name: str(data / name) for name in channels},
            "current_host": "algo-1",
            "hosts": hosts,
            "hyperparameters": hps,
            "job_name": request["TrainingJobName"],
            "model_dir": str(root / "model"),
            "num_gpus": 0,
            "output_data_dir": str(root / "output" / "data"),
        }
    )
    return {key: str(value) for key, value in env.items()}


def run_torchrun_driver(
    sm_env: dict[str, str], root: Path, checkpoint_dir: Path, timeout: int = 300
) -> subprocess.CompletedProcess:
    """The SDK's torchrun driver (as uploaded with the job) in the code folder, as sm_train.sh runs it."""
    data = root / "input" / "data"
    env = {
        **os.environ,
        **sm_env,
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # torchrun
        "CLOUDTRAIN_CHECKPOINT_DIR": str(checkpoint_dir),
    }
    driver = data / "sm_drivers" / "distributed_drivers" / "torchrun_driver.py"
    return subprocess.run(
        [sys.executable, str(driver)], cwd=data / "code", env=env, capture_output=True, text=True, timeout=timeout
    )
