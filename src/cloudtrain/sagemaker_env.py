"""The application's side of the SageMaker training-job contract: option defaults from the job's environment.

Inside a SageMaker training job (SDK 3 `ModelTrainer`, whose container drivers set `SM_MODEL_DIR` and
the other `SM_*` variables), `sagemaker_defaults()` returns these defaults; outside one it returns {}
and nothing changes. Options from `--config` and the command line (hyperparameters arrive as flags)
override them.

    output_dir              SM_MODEL_DIR (/opt/ml/model, uploaded as model.tar.gz when the job ends)
    train_file              SM_CHANNEL_TRAIN, else SM_CHANNEL_TRAINING (with --task text_to_image, the image folder
                            of --train_data_dir)
    validation_file         SM_CHANNEL_VALIDATION, else SM_CHANNEL_VALID, SM_CHANNEL_VAL, SM_CHANNEL_DEV,
                            SM_CHANNEL_EVAL, SM_CHANNEL_EVALUATION
    test_file               SM_CHANNEL_TEST
    model_name_or_path      SM_CHANNEL_MODEL (a model folder the launcher uploaded)
    instance_data_dir       SM_CHANNEL_INSTANCE (DreamBooth's instance images, --task text_to_image)
    class_data_dir          SM_CHANNEL_CLASS (DreamBooth's class images)
    run_name                the training job's name (TRAINING_JOB_NAME, else SM_TRAINING_ENV's job_name)
    checkpoint_dir          /opt/ml/checkpoints (or $CLOUDTRAIN_CHECKPOINT_DIR), synced to S3 with a CheckpointConfig;
                            without one a folder of the instance's, never packed into model.tar.gz
    resume_from_checkpoint  latest, when that folder exists at the start (the job has a CheckpointConfig)

A channel is a directory: a `datasets.save_to_disk` folder or a folder of csv/tsv/json/jsonl/parquet
files. When the train channel is a saved DatasetDict with validation/test splits and there is no
channel of their own for them, those splits are used. SDK 3's own channels ("code", "sm_drivers")
are not data; another channel that no option names (in a flag's value) while the run has no training
data of its own is refused: the run would train on the built-in data. SM_NUM_GPUS and the hosts are
read by the SDK's torchrun driver, which starts one process per GPU on every host; the application
then sees them as torchrun's WORLD_SIZE and ranks. A job of several instances started without it (a launch
spanning fewer nodes than instances: none, or a torchrun on each instance alone) is refused: each instance
would train the whole run alone (`unjoined_hosts`).
A FastFile channel is a folder too (its objects fetched as they are read): with --streaming true its
files stream from the first step (docs/streaming.md). Not supported: Pipe mode (a FIFO, not a folder).
"""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

CHECKPOINT_DIR_ENV = "CLOUDTRAIN_CHECKPOINT_DIR"  # tests lay /opt/ml out in a temporary folder
DEFAULT_CHECKPOINT_DIR = "/opt/ml/checkpoints"
# channel name -> the option it sets; the first channel present wins for each option
CHANNEL_OPTIONS = {
    "train": "train_file",
    "training": "train_file",  # AWS's own examples' name
    "validation": "validation_file",
    "valid": "validation_file",
    "val": "validation_file",
    "dev": "validation_file",
    "eval": "validation_file",
    "evaluation": "validation_file",
    "test": "test_file",
    "model": "model_name_or_path",
    "instance": "instance_data_dir",  # DreamBooth's folders (--task text_to_image)
    "class": "class_data_dir",
}
SAVED_SPLIT_OPTIONS = {"validation": "validation_file", "test": "test_file"}
SDK_CHANNELS = ("code", "sm_drivers")  # the SDK's own: the entry script, the torchrun driver
TRAINING_DATA = ("train_file", "dataset_name", "datasets", "train_data_dir", "instance_data_dir")


def in_training_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a SageMaker training job."""
    return "SM_MODEL_DIR" in (os.environ if environ is None else environ)


def sagemaker_defaults(environ: Mapping[str, str] | None = None) -> dict:
    """Flat {option name: value} defaults from the SageMaker environment; {} outside a training job."""
    env = os.environ if environ is None else environ
    if not in_training_job(env):
        return {}
    defaults = {"output_dir": env["SM_MODEL_DIR"], **channel_options(env)}
    name = job_name(env)
    if name:
        defaults["run_name"] = name
    # checkpoints never go into /opt/ml/model (model.tar.gz): without a CheckpointConfig the folder is the
    # instance's own, gone with it, and there is nothing to resume from
    checkpoints = Path(env.get(CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR))
    defaults["checkpoint_dir"] = str(checkpoints)
    if checkpoints.is_dir():
        defaults["resume_from_checkpoint"] = "latest"
    return defaults


def channel_options(env: Mapping[str, str]) -> dict:
    """Data and model options from the SM_CHANNEL_<NAME> directories."""
    options: dict = {}
    for channel, option in CHANNEL_OPTIONS.items():
        path = env.get(f"SM_CHANNEL_{channel.upper()}")
        if path and option not in options:
            options[option] = path
    train = options.get("train_file")
    for split in saved_splits(train) if train else []:
        if split in SAVED_SPLIT_OPTIONS:
            options.setdefault(SAVED_SPLIT_OPTIONS[split], train)
    return options


def yielded_channel(defaults: Mapping, values: Mapping) -> list[str]:
    """The options the job's train channel set by default (its train_file, and the splits of a saved dataset in
    it) that the run's own options replace: datasets: or --dataset_name name the training data another way, and
    the channel's default beside them was refused as a --train_file the user never gave (found in audit)."""
    train = defaults.get("train_file")
    if not train or not (values.get("datasets") or values.get("dataset_name")):
        return []
    named = ["train_file", *(SAVED_SPLIT_OPTIONS[s] for s in saved_splits(train) if s in SAVED_SPLIT_OPTIONS)]
    # a split's default from the train channel's saved dataset, not from a channel of its own (validation's wins)
    from_train = [option for option in named if option == "train_file" or defaults.get(option) == train]
    return [option for option in from_train if option in defaults and values.get(option) is defaults[option]]


def unread_channel(values: Mapping, environ: Mapping[str, str] | None = None, read: Sequence[str] = ()) -> str | None:
    """One line when a job's data channel sets no option and no option (nor a config file `read`) names its
    folder, while the run has no training data of its own (it would train on the built-in data); else None."""
    env = os.environ if environ is None else environ
    if not in_training_job(env) or any(values.get(option) for option in TRAINING_DATA):
        return None
    named = " ".join([*(str(value) for value in values.values() if isinstance(value, str)), *map(str, read)])
    for key, path in sorted(env.items()):
        channel = key.removeprefix("SM_CHANNEL_").lower()
        if not key.startswith("SM_CHANNEL_") or channel in CHANNEL_OPTIONS or channel in SDK_CHANNELS:
            continue
        if path not in named:
            return (
                f"the job's channel {channel!r} ({path}) sets no option, and the run has no training data (it would "
                f"train on the built-in data): name the channel train, or pass --train_file {path}"
            )
    return None


def unjoined_hosts(environ: Mapping[str, str] | None = None) -> str | None:
    """One line when a job of several instances runs this process outside a launch that spans them (no torchrun,
    or a torchrun on each instance alone: fewer nodes than instances): each instance would train the whole run
    alone, at that many times the cost, every one saving checkpoints to the job's one S3 prefix; else None."""
    env = os.environ if environ is None else environ
    hosts = host_count(env)
    try:
        world = int(env.get("WORLD_SIZE") or 1)
        nodes = int(env.get("GROUP_WORLD_SIZE") or world // int(env.get("LOCAL_WORLD_SIZE") or 1) or 1)
    except ValueError:
        return None  # not ours to judge: the distributed setup names a bad WORLD_SIZE itself
    if not in_training_job(env) or hosts <= nodes:
        return None
    return (
        f"the job has {hosts} instances but this process's launch spans {nodes} (its {world} processes): "
        f"each instance would train the whole run alone, {hosts} times the cost, all saving checkpoints to one S3 "
        "prefix; launch with sagemaker/launch.py, or give the ModelTrainer distributed=Torchrun(), or use one instance"
    )


def host_count(env: Mapping[str, str]) -> int:
    """The job's instances: SM_HOST_COUNT, else the length of SM_HOSTS; 1 where neither reads."""
    try:
        return int(env["SM_HOST_COUNT"])
    except (KeyError, ValueError):
        pass
    try:
        hosts = json.loads(env.get("SM_HOSTS", "[]"))
    except ValueError:
        return 1
    return len(hosts) if isinstance(hosts, list) and hosts else 1


def fresh_start(checkpoint: Path, environ: Mapping[str, str] | None = None) -> str:
    """How a user starts over instead of resuming `checkpoint`, which does not fit: without the flag, or, for one of
    the checkpoints SageMaker restored into a job's own folder (whose `resume_from_checkpoint latest` is the job's
    default, so no flag of the user's is there to drop), with another checkpoint location."""
    env = os.environ if environ is None else environ
    restored = Path(env.get(CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR)).resolve()
    if not in_training_job(env) or not Path(checkpoint).resolve().is_relative_to(restored):
        return "start a fresh run without --resume_from_checkpoint"
    return (
        "start a fresh job with another checkpoint_s3_uri (a job resumes the checkpoints SageMaker restores from its "
        "own)"
    )


def job_notes(output_dir: str | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """Inside a job, what a run's options lose: an --output_dir outside SM_MODEL_DIR, which SageMaker does not
    upload (the launcher drops the option; a job built with the SDK directly may keep it)."""
    env = os.environ if environ is None else environ
    if not in_training_job(env) or not output_dir:
        return []
    model_dir = Path(env["SM_MODEL_DIR"]).resolve()
    if Path(output_dir).resolve().is_relative_to(model_dir):
        return []
    return [
        f"--output_dir {output_dir} is outside the job's model folder {model_dir} (SM_MODEL_DIR), the one SageMaker "
        "uploads: the model goes with the instance unless copied; leave --output_dir out for the job's"
    ]


def saved_splits(path: str) -> list[str]:
    """The split names of a DatasetDict written by save_to_disk, or [] for anything else."""
    index = Path(path) / "dataset_dict.json"
    try:
        return list(json.loads(index.read_text()).get("splits", []))
    except (OSError, ValueError, AttributeError):
        return []


def job_name(env: Mapping[str, str]) -> str | None:
    """The training job's name, from the platform's variable or the SDK's training environment."""
    if env.get("TRAINING_JOB_NAME"):
        return env["TRAINING_JOB_NAME"]
    try:
        return json.loads(env.get("SM_TRAINING_ENV", "{}")).get("job_name") or None
    except (ValueError, AttributeError):
        return None
