"""Launch cloudtrain on Amazon SageMaker (Python SDK 3, `ModelTrainer`); follow, attach to and fetch its jobs.

From the repository root:

    python sagemaker/launch.py --instance_type ml.g5.xlarge --config configs/example.yaml \\
        --train data/train.csv [--validation ...] [--test ...] [--hp learning_rate=3e-5 ...] \\
        [--instance_count 2] [--spot] [--wait]
    python sagemaker/launch.py attach JOB                 # status, instances, spot savings, model location
    python sagemaker/launch.py logs JOB                   # stream the job's logs until it ends
    python sagemaker/launch.py download JOB [--dest DIR]  # fetch and unpack model.tar.gz

Notebooks use the same functions: `launch(JobSpec(...))`, `build_trainer`, `attach`, `stream_logs`,
`download_model`.

What a job gets:
- code: `src/` as the source dir; the SDK's torchrun driver runs `training_application.py` on every
  instance, one process per GPU unless `processes_per_host`; `src/requirements-sagemaker.txt` is
  installed first.
- image: the Hugging Face PyTorch training image (GPU instances only), or the user's own image URI.
- options: a YAML/JSON config file as for a local run, overridden by `hyperparameters`, sent as
  hyperparameters (None dropped, lists comma-joined, booleans arriving as true/false). Options that
  name local data or a local model (train_file, validation_file, test_file, dataset_name as a
  save_to_disk folder, model_name_or_path as a folder) become input channels; so do text-to-image
  folders (train_data_dir as the train channel, instance_data_dir and class_data_dir as the instance
  and class channels), sent as their paths inside the job; local channels are uploaded first to the
  session's default bucket. output_dir and checkpoint_dir are SageMaker's and
  dropped: src/cloudtrain/sagemaker_env.py says what the job uses instead.
- environment: WANDB_API_KEY, WANDB_PROJECT and HF_TOKEN (plus `env_names`) when set here. Their
  values are never printed, and are masked in log records while these functions run.
- spot capacity with `max_wait`; with spot (or `checkpoint_s3_uri`) /opt/ml/checkpoints is synced
  to S3 and the application resumes from it.
Not supported: local mode (needs Docker), heterogeneous clusters, Pipe or FastFile input (its channels are
File mode; the application itself reads a FastFile channel, set up with your own SDK code, as a folder:
docs/streaming.md), network isolation (the job installs its requirements and downloads Hub models), warm pools.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from sagemaker.core import image_uris
from sagemaker.core.helper.iam_role_resolver import RoleValidationError
from sagemaker.core.helper.session_helper import Session
from sagemaker.core.resources import TrainingJob
from sagemaker.core.training.configs import (
    CheckpointConfig,
    Compute,
    InputData,
    SourceCode,
    StoppingCondition,
)
from sagemaker.train import ModelTrainer
from sagemaker.train.distributed import Torchrun

from cloudtrain.config import Config, build_config, load_config_file, option_fields, validate
from cloudtrain.errors import UserError, first_line
from cloudtrain.sagemaker_env import CHANNEL_OPTIONS, DEFAULT_CHECKPOINT_DIR

SRC = Path(__file__).resolve().parents[1] / "src"  # the job's source dir
ENTRY_SCRIPT = "training_application.py"
REQUIREMENTS = "requirements-sagemaker.txt"
# The newest Hugging Face PyTorch training image the SDK knows (GPU only); requirements-sagemaker.txt
# brings the application's library versions on top of it.
HF_IMAGE = {
    "framework": "huggingface",
    "version": "5.3.0",
    "base_framework_version": "pytorch2.9.0",
    "py_version": "py312",
    "image_scope": "training",
}
HUB_DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # the Hub original of the built-in model
PASSTHROUGH = ("WANDB_API_KEY", "WANDB_PROJECT", "HF_TOKEN")
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
MASK = "******"
DATA_CHANNELS = ("train", "validation", "test")
LOCAL_PATH_OPTIONS = {
    "train_file": "train",
    "dataset_name": "train",
    "validation_file": "validation",
    "test_file": "test",
    "model_name_or_path": "model",
}
# text-to-image folders: uploaded as these channels, the option rewritten to the folder's path inside the job
IMAGE_FOLDER_OPTIONS = {"train_data_dir": "train", "instance_data_dir": "instance", "class_data_dir": "class"}
JOB_DATA_DIR = "/opt/ml/input/data"
JOB_OWNED_OPTIONS = ("output_dir", "checkpoint_dir")
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TERMINAL = ("Completed", "Failed", "Stopped")


@dataclass
class JobSpec:
    """One training job; every field is also a flag of the command line."""

    instance_type: str
    instance_count: int = 1
    config: str | list | None = None  # YAML/JSON options file(s), as for a local run; later files win
    hyperparameters: dict = field(default_factory=dict)  # application options, overriding `config`
    train: str | None = None  # S3 URI, or a local file/folder that is uploaded first
    validation: str | None = None
    test: str | None = None
    spot: bool = False
    max_run: int = 24 * 3600  # seconds of training before SageMaker stops the job
    max_wait: int | None = None  # spot: seconds of waiting for capacity plus training (default 2 x max_run)
    checkpoint_s3_uri: str | None = None  # default with spot: s3://<bucket>/<base_job_name>/<job>/checkpoints
    volume_size: int = 100  # GB of disk per instance
    processes_per_host: int | None = None  # default: one per GPU
    image_uri: str | None = None  # default: the Hugging Face PyTorch training image
    role: str | None = None  # default: $SAGEMAKER_ROLE, the SDK config's role, or the caller's own role
    base_job_name: str = "cloudtrain"
    env_names: list = field(default_factory=list)  # more variables to pass from this environment


# ---------------------------------------------------------------- secrets


def is_secret(name: str) -> bool:
    return any(marker in name.upper() for marker in SECRET_MARKERS)


def secret_values(names: tuple | list = PASSTHROUGH) -> list[str]:
    """Values of the secret variables among `names` that are set here."""
    return [os.environ[name] for name in names if is_secret(name) and os.environ.get(name)]


def mask(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


class _MaskSecrets(logging.Filter):
    """Rewrites a log record whose message holds a secret (the SDK logs whole requests at DEBUG)."""

    def __init__(self, secrets: list[str]):
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(secret in message for secret in self.secrets):
            record.msg, record.args = mask(message, self.secrets), ()
        return True


@contextlib.contextmanager
def secrets_masked(secrets: list[str]) -> Iterator[None]:
    """Mask `secrets` in every record that reaches a logging handler, until the block ends."""
    loggers = [
        logging.getLogger(),
        *(item for item in logging.root.manager.loggerDict.values() if isinstance(item, logging.Logger)),
    ]
    handlers = {handler for logger in loggers for handler in logger.handlers} | {logging.lastResort}
    handlers.discard(None)
    mask_filter = _MaskSecrets(secrets)
    for handler in handlers:
        handler.addFilter(mask_filter)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(mask_filter)


def _masking_secrets(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        spec = next((a for a in (*args, *kwargs.values()) if isinstance(a, JobSpec)), None)
        with secrets_masked(secret_values([*PASSTHROUGH, *(spec.env_names if spec else [])])):
            return func(*args, **kwargs)

    return wrapper


def passthrough_environment(extra_names: list | tuple = ()) -> dict[str, str]:
    """The job's environment: PASSTHROUGH and `extra_names`, for those set in this environment."""
    return {name: os.environ[name] for name in (*PASSTHROUGH, *extra_names) if os.environ.get(name)}


# ---------------------------------------------------------------- options


def to_hyperparameters(values: dict) -> dict:
    """Application options as the SDK sends them: None dropped (the default applies), lists joined as the option
    splits them (its separator: a comma, `|` for prompts), a list that may hold mappings (`datasets:`) as JSON.

    The SDK JSON-encodes numbers and booleans, and its container driver passes each as `--key value`,
    so booleans reach the application as true/false.
    """
    return {key: _hyperparameter(key, value) for key, value in values.items() if value is not None}


def _hyperparameter(name: str, value: object) -> object:
    field = option_fields()[name][1] if name in option_fields() else None
    if isinstance(value, (list, tuple)):
        if field is not None and field.metadata["mappings"]:
            return json.dumps(list(value))  # the job reads it back (config.parse._coerce)
        return _kept_as_text((field.metadata["separator"] if field is not None else ",").join(map(str, value)))
    if isinstance(value, str) and _takes_text(name):
        return _kept_as_text(value)
    return value


def _takes_text(name: str) -> bool:
    """Whether the option takes text (a branch, a name, a list's items), not a number or a boolean written so."""
    if name not in option_fields():
        return False
    kind = str(option_fields()[name][1].type)
    return "list" in kind or ("str" in kind and not any(other in kind for other in ("int", "float", "bool")))


def _kept_as_text(text: str) -> str:
    """`text`, quoted where the job's driver, which JSON-decodes a value and encodes it again, would pass it on
    otherwise (2024.10 becomes 2024.1, 1e3 1000.0, "x" x; 500 and true come through as they are)."""
    try:
        decoded = json.loads(text)
    except ValueError:
        return text
    return json.dumps(text) if isinstance(decoded, str) or json.dumps(decoded) != text else text


def is_data_source(value: str) -> bool:
    """An S3 URI or an existing local path (a Hub id such as org/name is neither)."""
    return value.startswith("s3://") or Path(value).exists()


def job_options(spec: JobSpec) -> tuple[dict, dict[str, str], Config]:
    """(hyperparameters, {channel: S3 URI or local path}, the options as the job will see them)."""
    values: dict = {}
    for file in [spec.config] if isinstance(spec.config, str) else spec.config or []:
        values.update(load_config_file(file))
    values.update(spec.hyperparameters)
    channels = {name: getattr(spec, name) for name in DATA_CHANNELS if getattr(spec, name)}
    for option, channel in LOCAL_PATH_OPTIONS.items():
        value = values.get(option)
        if option.endswith("_file") and value and not is_data_source(str(value)):
            raise UserError(
                f"{option} {value} does not exist here; give a local file or folder (the launcher "
                "uploads it) or an S3 URI"
            )
        if isinstance(value, str) and is_data_source(value):
            if channel in channels:
                raise UserError(
                    f"the {option} option and the {channel} channel both give the job's {channel} data; keep one"
                )
            channels[channel] = values.pop(option)
    for option, channel in IMAGE_FOLDER_OPTIONS.items():
        if values.get(option):
            channels[channel] = image_folder_channel(option, str(values[option]), channel, channels)
            values[option] = f"{JOB_DATA_DIR}/{channel}"
    for option in JOB_OWNED_OPTIONS:
        if values.pop(option, None) is not None:
            print(
                f"note: {option} ignored: inside the job SageMaker's folders are used "
                "(see src/cloudtrain/sagemaker_env.py)"
            )
    check_option_values(values)
    check_stream_sources(values)
    if spec.image_uri is None:  # the Hugging Face image has neither the built-in model nor the R8 data
        if "model" not in channels and not values.get("model_name_or_path"):
            values["model_name_or_path"] = HUB_DEFAULT_MODEL
            print(f"note: model_name_or_path {HUB_DEFAULT_MODEL} (the built-in model, from the Hub)")
        if not {"train", "instance"} & set(channels) and not values.get("dataset_name") and not values.get("datasets"):
            raise UserError(
                "the job has no training data: pass --train (an S3 URI or a local file or "
                "folder), a Hub dataset_name option or an image folder (train_data_dir, instance_data_dir); "
                "the built-in R8 data is only in an image built from the Dockerfile (--image_uri)"
            )
    in_job = {CHANNEL_OPTIONS[name]: f"{JOB_DATA_DIR}/{name}" for name in channels}
    cfg = build_config({**in_job, **values})  # the application's own checks, before anything is uploaded
    validate(cfg)
    typed = cfg.to_dict(include_secrets=True)  # a whole number given as 1000.0: the job's parser takes 1000 only
    whole = {k: typed[k] for k, v in values.items() if isinstance(v, float) and isinstance(typed.get(k), int)}
    return to_hyperparameters({**values, **whole}), channels, cfg


def check_stream_sources(values: dict) -> None:
    """A config's `datasets:` sources are read by the job itself, from where it can reach: an object store, the
    Hub or the job's own channel folders, not this machine's files (only --train's are uploaded)."""
    sources = build_config({"datasets": values["datasets"]}).data.datasets if values.get("datasets") else []
    for entry in sources:
        path = str(entry.get("path") or "") if isinstance(entry, dict) else str(entry)
        if "://" not in path and not path.startswith(f"{JOB_DATA_DIR}/"):
            raise UserError(
                f"datasets: {path or entry} is not a source the job can read (a path on this machine is not "
                f"uploaded); give s3:// URIs, hf://datasets/<id> or {JOB_DATA_DIR}/<channel>, or one local "
                "source with --train"
            )


def image_folder_channel(option: str, folder: str, channel: str, channels: dict[str, str]) -> str:
    """The source of the channel an image-folder option becomes: an S3 URI, or a local folder uploaded first."""
    if channel in channels:
        raise UserError(
            f"{option} and the job's {channel} channel ({channels[channel]}) both give its {channel} data; keep one"
        )
    if not folder.startswith("s3://") and not Path(folder).is_dir():
        raise UserError(
            f"{option} {folder} is not a folder here; give a local image folder (the launcher uploads it as the "
            f"{channel} channel) or an S3 URI"
        )
    return folder


def check_option_values(values: dict) -> None:
    if values.get("hub_token"):
        raise UserError(
            "hub_token must not be a hyperparameter: SageMaker shows hyperparameters in its "
            "console and API. Export HF_TOKEN instead; the launcher passes it to the job"
        )
    if values.get("hub_token_file"):  # the job failed at its start: the file is this machine's (found in audit)
        raise UserError(
            f"hub_token_file {values['hub_token_file']} is a file of this machine, which the job cannot read: "
            "export HF_TOKEN instead; the launcher passes it to the job"
        )
    for option, instead in (("tokenizer_name_or_path", "a Hub id"), ("chat_template", "a shipped template's name")):
        value = values.get(option)
        if value and Path(str(value)).expanduser().exists():
            raise UserError(
                f"{option} {value} is a local path the job cannot read (only data and the model are uploaded): "
                f"give {instead}, or put it in the model folder"
            )
    ds_config = values.get("deepspeed_config")
    if ds_config and ds_config != "none":
        raise UserError(
            f"deepspeed_config {ds_config} is a local file the job cannot read; use the "
            "zero_stage, offload_optimizer and offload_param options instead"
        )


def check_environment(spec: JobSpec, cfg: Config, environment: dict, hyperparameters: dict) -> None:
    if cfg.hub.push_to_hub and "HF_TOKEN" not in environment:
        raise UserError(
            "push_to_hub true needs HF_TOKEN in this environment (the launcher passes it to "
            "the job): export HF_TOKEN=hf_..."
        )
    if "wandb" in cfg.tracking.report_to and "WANDB_API_KEY" not in environment:
        print("note: WANDB_API_KEY is not set here, so the job logs to W&B offline, into model.tar.gz")
    if spec.spot and "checkpointing_steps" not in hyperparameters:
        print("note: spot without the checkpointing_steps option: an interrupted job starts over")
    for name in spec.env_names:
        if name not in environment:
            raise UserError(f"--env {name}: the variable is not set in this environment")


# ---------------------------------------------------------------- the job


def make_session(region: str | None = None, bucket: str | None = None) -> Session:
    """A SageMaker session from the usual AWS settings (AWS_PROFILE, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL...)."""
    boto_session = boto3.Session(region_name=region)
    if not boto_session.region_name:
        raise UserError("no AWS region: pass --region or set AWS_DEFAULT_REGION (or a region in ~/.aws/config)")
    return Session(boto_session=boto_session, default_bucket=bucket)


def default_image(session: Session, instance_type: str) -> str:
    """The Hugging Face PyTorch training image for this region and instance type."""
    try:
        return image_uris.retrieve(**HF_IMAGE, instance_type=instance_type, region=session.boto_region_name)
    except ValueError as err:
        raise UserError(
            f"no Hugging Face training image for {instance_type} ({first_line(err)}); use a GPU "
            "instance type such as ml.g5.xlarge, or pass --image_uri"
        ) from None


def source_code() -> SourceCode:
    return SourceCode(
        source_dir=str(SRC),
        entry_script=ENTRY_SCRIPT,
        requirements=REQUIREMENTS,
        ignore_patterns=["__pycache__", "*.pyc", ".ipynb_checkpoints", ".DS_Store", "*.egg-info"],
    )


def stopping_condition(spec: JobSpec) -> StoppingCondition:
    if spec.max_wait is not None and not spec.spot:
        raise UserError("--max_wait applies to spot capacity only: add --spot, or drop --max_wait")
    max_wait = (spec.max_wait or 2 * spec.max_run) if spec.spot else None
    if max_wait is not None and max_wait < spec.max_run:
        raise UserError(f"--max_wait {max_wait} must be at least --max_run {spec.max_run} (it includes the run)")
    return StoppingCondition(max_runtime_in_seconds=spec.max_run, max_wait_time_in_seconds=max_wait)


def checkpoint_config(spec: JobSpec) -> CheckpointConfig | None:
    """With spot, always: the application resumes from /opt/ml/checkpoints after an interruption."""
    if not (spec.spot or spec.checkpoint_s3_uri):
        return None
    return CheckpointConfig(s3_uri=spec.checkpoint_s3_uri, local_path=DEFAULT_CHECKPOINT_DIR)


def check_channels(channels: dict[str, str]) -> None:
    """Local data exists (checked before any AWS call: a typo answers without credentials or a network)."""
    for name, source in channels.items():
        if not source.startswith("s3://") and not Path(source).exists():
            raise UserError(f"{name} data {source} does not exist; give an S3 URI or a local file or folder")


def upload_channels(session: Session, channels: dict[str, str], prefix: str) -> dict[str, str]:
    """{channel: S3 URI}; local files and folders are uploaded to the session's default bucket."""
    uris = {}
    for name, source in channels.items():
        if source.startswith("s3://"):
            uris[name] = source
            continue
        uris[name] = session.upload_data(source, bucket=session.default_bucket(), key_prefix=f"{prefix}/{name}")
        print(f"uploaded {source} to {uris[name]}")
    return uris


@_masking_secrets
def build_trainer(spec: JobSpec, session: Session | None = None) -> tuple[ModelTrainer, list[InputData]]:
    """The ModelTrainer and its input channels; local data is uploaded once everything is checked."""
    hyperparameters, channels, cfg = job_options(spec)
    check_channels(channels)
    environment = passthrough_environment(spec.env_names)
    check_environment(spec, cfg, environment, hyperparameters)
    compute = Compute(
        instance_type=spec.instance_type,
        instance_count=spec.instance_count,
        volume_size_in_gb=spec.volume_size,
        enable_managed_spot_training=spec.spot,
    )
    stopping, checkpoints = stopping_condition(spec), checkpoint_config(spec)
    session = session or make_session()
    try:
        trainer = ModelTrainer(
            sagemaker_session=session,
            role=spec.role or os.environ.get("SAGEMAKER_ROLE"),
            base_job_name=spec.base_job_name,
            training_image=spec.image_uri or default_image(session, spec.instance_type),
            source_code=source_code(),
            distributed=Torchrun(process_count_per_node=spec.processes_per_host),
            compute=compute,
            stopping_condition=stopping,
            checkpoint_config=checkpoints,
            hyperparameters=hyperparameters,
            environment=environment,
        )
    except (RoleValidationError, ValueError) as err:  # the SDK's checks of the role and the configs
        hint = (
            " (pass --role or set SAGEMAKER_ROLE to an execution role's name or ARN)"
            if isinstance(err, RoleValidationError) or "role" in str(err).lower()
            else ""
        )
        raise UserError(f"SageMaker refused the job's set-up: {first_line(err)}{hint}") from None
    if environment:
        print(f"environment passed to the job: {', '.join(environment)} (values hidden)")
    uris = upload_channels(session, channels, f"{spec.base_job_name}/data/{time.strftime('%Y%m%d-%H%M%S')}")
    return trainer, [InputData(channel_name=name, data_source=uri) for name, uri in uris.items()]


@_masking_secrets
def launch(spec: JobSpec, session: Session | None = None, wait: bool = False) -> str:
    """Start the job and return its name; with `wait`, stream its logs until it ends."""
    trainer, inputs = build_trainer(spec, session)
    session = trainer.sagemaker_session
    trainer.train(input_data_config=inputs, wait=False, logs=False)
    name = trainer._latest_training_job.training_job_name  # the SDK's documented way to reach the job
    region = session.boto_region_name
    print(
        f"launched {name}: {spec.instance_count} x {spec.instance_type}{' (spot)' if spec.spot else ''}\n"
        f"  logs:     python sagemaker/launch.py logs {name}\n"
        f"  model:    python sagemaker/launch.py download {name}\n"
        f"  console:  https://{region}.console.aws.amazon.com/sagemaker/home?region={region}#/jobs/{name}"
    )
    if wait:
        stream_logs(name, session)
    return name


# ---------------------------------------------------------------- after the launch


def describe(job_name: str, session: Session) -> dict:
    try:
        return session.sagemaker_client.describe_training_job(TrainingJobName=job_name)
    except ClientError as err:
        raise UserError(f"training job {job_name} in {session.boto_region_name}: {first_line(err)}") from None


def job_summary(job: dict) -> str:
    resources = job["ResourceConfig"]
    lines = [
        f"{job['TrainingJobName']}: {job['TrainingJobStatus']} ({job.get('SecondaryStatus', '?')}), "
        f"{resources['InstanceCount']} x {resources['InstanceType']}"
        f"{' spot' if job.get('EnableManagedSpotTraining') else ''}"
    ]
    trained, billed = job.get("TrainingTimeInSeconds"), job.get("BillableTimeInSeconds")
    if trained and billed is not None:
        saving = f" (spot saving {1 - billed / trained:.0%})" if job.get("EnableManagedSpotTraining") else ""
        lines.append(f"  trained {trained} s, billed {billed} s{saving}")
    if job.get("FailureReason"):
        lines.append(f"  failure: {job['FailureReason']}")
    if job.get("ModelArtifacts", {}).get("S3ModelArtifacts"):
        lines.append(f"  model: {job['ModelArtifacts']['S3ModelArtifacts']}")
    return "\n".join(lines)


@_masking_secrets
def attach(job_name: str, session: Session | None = None) -> TrainingJob:
    """The SDK's TrainingJob for a job launched earlier (refresh, wait, stop...); prints its summary."""
    session = session or make_session()
    print(job_summary(describe(job_name, session)))
    return TrainingJob.get(training_job_name=job_name, session=session.boto_session)


@_masking_secrets
def stream_logs(job_name: str, session: Session | None = None, poll: float = 10.0) -> str:
    """Print the job's log lines, one stream per instance, until it ends; returns its final status."""
    session = session or make_session()
    logs, positions, secrets = session.boto_session.client("logs"), {}, secret_values()
    seen_running = False
    while True:
        status = describe(job_name, session)["TrainingJobStatus"]
        if status in TERMINAL and seen_running:
            time.sleep(poll)  # the last lines reach CloudWatch shortly after the job ends
        seen_running = status not in TERMINAL
        for host, message in new_log_lines(logs, job_name, positions):
            print(mask(f"[{host}] {message}", secrets), flush=True)
        if status in TERMINAL:
            print(job_summary(describe(job_name, session)), flush=True)
            return status
        time.sleep(poll)


def new_log_lines(logs, job_name: str, positions: dict) -> Iterator[tuple[str, str]]:
    """(host, message) of the events after `positions` ({stream: forward token}, updated)."""
    try:
        streams = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=f"{job_name}/")
    except logs.exceptions.ResourceNotFoundException:  # no instance has written anything yet
        return
    for stream in sorted(s["logStreamName"] for s in streams["logStreams"]):
        host = stream.split("/", 1)[1].rsplit("-", 1)[0]  # <job>/algo-1-1700000000 -> algo-1
        while True:
            token = {"nextToken": positions[stream]} if stream in positions else {}
            page = logs.get_log_events(logGroupName=LOG_GROUP, logStreamName=stream, startFromHead=True, **token)
            for event in page["events"]:
                yield host, event["message"]
            if page["nextForwardToken"] == positions.get(stream):
                break
            positions[stream] = page["nextForwardToken"]


@_masking_secrets
def download_model(job_name: str, dest: str | Path | None = None, session: Session | None = None) -> Path:
    """Fetch the job's model.tar.gz and unpack it into `dest` (default outputs/sagemaker/<job>). A job that failed
    or was stopped has one too where its /opt/ml/model held files (SageMaker uploads it either way): a model whose
    final Hub push failed is fetched so, for `push`."""
    session = session or make_session()
    job = describe(job_name, session)
    status = job["TrainingJobStatus"]
    if status not in TERMINAL:
        raise UserError(
            f"training job {job_name} is {status}: its model.tar.gz exists once it has ended "
            f"(follow it with: python sagemaker/launch.py logs {job_name})"
        )
    uri = job.get("ModelArtifacts", {}).get("S3ModelArtifacts")
    if not uri:
        raise UserError(f"training job {job_name} is {status} and left no model.tar.gz")
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    dest = Path(dest or Path("outputs") / "sagemaker" / job_name)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "model.tar.gz"
        try:
            session.boto_session.client("s3").download_file(bucket, key, str(archive))
        except ClientError as err:
            if status != "Completed" and err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise UserError(f"training job {job_name} is {status} and left no model.tar.gz ({uri})") from None
            raise UserError(f"could not download {uri}: {first_line(err)}") from None
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")  # refuses absolute paths, links out of dest, devices
    ended = "" if status == "Completed" else f" (the job is {status}: what its /opt/ml/model held when it ended)"
    print(f"model of {job_name} unpacked into {dest.resolve()}{ended}")
    return dest


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as one line (see --help) instead of usage plus error."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def _launch_parser() -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in dataclasses.fields(JobSpec)}
    parser = _Parser(
        prog="sagemaker/launch.py",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        description="Launch the cloudtrain training application as a SageMaker training job.",
        epilog="Other commands: attach JOB | logs JOB | download JOB [--dest DIR] (each takes --region).",
    )
    add = parser.add_argument
    add("--instance_type", required=True, help="e.g. ml.g5.xlarge (1 GPU), ml.g5.12xlarge (4), ml.p4d.24xlarge (8)")
    add("--instance_count", type=int, help=f"instances (default {defaults['instance_count']})")
    add(
        "--config",
        action="append",
        help="YAML/JSON file of application options, as for a local run (again: each overrides the ones before)",
    )
    add("--hp", action="append", metavar="KEY=VALUE", help="an application option, overriding --config (repeatable)")
    for name in DATA_CHANNELS:
        add(f"--{name}", help=f"{name} data: an S3 URI, or a local file or folder (uploaded first)")
    add("--spot", action="store_true", help="managed spot capacity (checkpoints are synced to S3)")
    add("--max_run", type=int, help=f"seconds of training at most (default {defaults['max_run']})")
    add("--max_wait", type=int, help="spot: seconds of waiting plus training at most (default 2 x max_run)")
    add("--checkpoint_s3_uri", help="where /opt/ml/checkpoints is synced (default with --spot: per job)")
    add("--volume_size", type=int, help=f"GB of disk per instance (default {defaults['volume_size']})")
    add("--processes_per_host", type=int, help="processes per instance (default: one per GPU)")
    add("--image_uri", help="your own training image (default: the Hugging Face PyTorch training image)")
    add("--role", help="execution role name or ARN (default: $SAGEMAKER_ROLE, the SDK config, your own role)")
    add("--base_job_name", help=f"job name prefix (default {defaults['base_job_name']})")
    add(
        "--env",
        action="append",
        dest="env_names",
        metavar="NAME",
        help=f"also pass this variable to the job (always: {', '.join(PASSTHROUGH)})",
    )
    _add_session_arguments(parser)
    add("--wait", action="store_true", help="stream the job's logs until it ends")
    add("--log_level", choices=["WARNING", "INFO", "DEBUG"], help="SDK log level (default WARNING)")
    return parser


def _add_session_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--region", default=argparse.SUPPRESS, help="AWS region (default: your AWS configuration)")
    parser.add_argument("--bucket", default=argparse.SUPPRESS, help="S3 bucket (default: the SDK's default bucket)")


def _parse_hp(items: list[str]) -> dict:
    pairs = [item.partition("=") for item in items]
    bad = [item for item, (key, sep, _) in zip(items, pairs, strict=True) if not key or not sep]
    if bad:
        raise UserError(f"--hp {bad[0]}: write KEY=VALUE, e.g. --hp learning_rate=3e-5")
    return {key: value for key, _, value in pairs}


def _session_from(args: dict) -> Session:
    return make_session(args.pop("region", None), args.pop("bucket", None))


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level)
    logging.getLogger("sagemaker.config").setLevel(level)  # the SDK sets INFO on it


def launch_main(argv: list[str]) -> int:
    args = vars(_launch_parser().parse_args(argv))
    _configure_logging(args.pop("log_level", "WARNING"))
    wait = args.pop("wait", False)
    session = _session_from(args)
    args["hyperparameters"] = _parse_hp(args.pop("hp", []))
    name = launch(JobSpec(**args), session)
    return 0 if not wait or stream_logs(name, session) == "Completed" else 1


def job_main(command: str, argv: list[str]) -> int:
    parser = _Parser(prog=f"sagemaker/launch.py {command}", allow_abbrev=False)
    parser.add_argument("job_name")
    _add_session_arguments(parser)
    if command == "download":
        parser.add_argument("--dest", help="folder to unpack into (default outputs/sagemaker/<job>)")
    if command == "logs":
        parser.add_argument("--poll", type=float, default=10.0, help="seconds between checks (default 10)")
    args = vars(parser.parse_args(argv))
    _configure_logging("WARNING")
    session, name = _session_from(args), args["job_name"]
    if command == "attach":
        attach(name, session)
    elif command == "logs":
        return 0 if stream_logs(name, session, args["poll"]) == "Completed" else 1
    else:
        download_model(name, args.get("dest"), session)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in ("attach", "logs", "download"):
            return job_main(argv[0], argv[1:])
        return launch_main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NoCredentialsError:
        print(
            "error: no AWS credentials: run `aws configure` (or `aws sso login`), set AWS_PROFILE, or set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            file=sys.stderr,
        )
        return 2
    except (BotoCoreError, ClientError) as err:  # the network, a permission, a service limit: one line
        print(f"error: AWS: {first_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted (a launched job keeps running)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
