"""The compute a training run used, and inside a SageMaker training job an estimate of what it cost.

`compute_used` turns the run's times into a flat, JSON-able dict (it goes to `results["compute"]` and from
there to the model card); `describe` writes that dict as the one line printed at the end of a run.

What it does:
- device-hours: training time x the number of processes (one per GPU, or per CPU process), the compute the
  training loop held, whatever the machine; a resumed launch counts its own, and adds the run's total over
  every launch (`run_device_hours`, from the training time its checkpoint recorded);
- inside a SageMaker training job (`SM_MODEL_DIR` set): the instance type and count from the job's environment
  (SM_CURRENT_INSTANCE_TYPE, SM_HOSTS, else SM_RESOURCE_CONFIG, else /opt/ml/input/config/resourceconfig.json),
  instance-hours = the job's wall time x the count, and a cost = instance-hours x the on-demand list price per
  instance-hour from prices.json (dated, one region). The job's wall time is this session's, plus that of earlier
  sessions of the same job (a managed-spot restart or a torchrun restart resumes the job, which bills them all;
  `job_wall`, kept in each checkpoint); a new job that resumes another's checkpoint counts only its own.

What it does not:
- it is not the bill. AWS bills the whole job, from instance start to model upload, at the rate of the job's
  region, less for managed spot (billable seconds shrink) and savings plans, plus storage and data transfer;
  this run's wall time misses the job's start-up and upload, so the bill for on-demand instances is usually
  somewhat higher, and for spot instances lower;
- it asks no AWS API (no network is needed or used); prices change, and the table says when its figures are from;
- a heterogeneous cluster (instance groups of different types) is priced as if every host were this host's type.

A missing or unreadable price table, or an instance type it does not list, never fails a finished run: the
dict then has no cost, only a `price_note` saying why.
"""

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from cloudtrain.sagemaker_env import job_name

PRICE_TABLE = Path(__file__).parents[1] / "prices.json"  # cloudtrain/prices.json, shipped as package data
RESOURCE_CONFIG = Path("/opt/ml/input/config/resourceconfig.json")  # what SageMaker writes in every job
TABLE_NAME = "cloudtrain/prices.json"  # how notes name the table
DEVICE_NAMES = {"cuda": "GPU", "cpu": "CPU process"}  # torch device type -> what one process holds


def compute_used(
    train_seconds: float,
    wall_seconds: float,
    processes: int,
    device_type: str,
    environ: Mapping[str, str] | None = None,
    table: Path = PRICE_TABLE,
    earlier_device_seconds: float | None = None,
) -> dict:
    """The compute a launch used: device-hours always; instance type, count, instance-hours and an estimated cost
    inside a SageMaker training job (`environ`: os.environ unless given). `train_seconds` is this launch's training
    time, `wall_seconds` the job's wall time; `earlier_device_seconds`, for a resumed launch, the device-seconds of
    the launches before it."""
    env = os.environ if environ is None else environ
    usage: dict = {
        "device": DEVICE_NAMES.get(device_type, f"{device_type} device"),
        "processes": processes,
        "train_hours": hours(train_seconds),
        "device_hours": hours(train_seconds * processes),
        "wall_hours": hours(wall_seconds),
    }
    if earlier_device_seconds is not None:
        usage["run_device_hours"] = hours(earlier_device_seconds + train_seconds * processes)
    if "SM_MODEL_DIR" not in env:
        return usage
    instance_type, count = sagemaker_instances(env)
    if instance_type is None:
        return usage | {"price_note": "the SageMaker job's instance type is unknown: cost not estimated"}
    instance_hours = wall_seconds * count / 3600
    usage |= {"instance_type": instance_type, "instance_count": count, "instance_hours": hours(instance_hours * 3600)}
    return usage | estimated_cost(instance_type, instance_hours, table)


def hours(seconds: float) -> float:
    """`seconds` in hours: to four decimals, or below an hour to four significant digits, so a short run's
    2 x 0.00025 h stays 0.0005 h (rounding to decimals made it 2 x 0.0003 h = 0.0005 h)."""
    value = seconds / 3600
    return round(value, 4) if value >= 1 else float(f"{value:.4g}")


def session_seconds() -> float:
    """This process's wall time so far: loading, training and evaluation."""
    return time.time() - psutil.Process().create_time()


def earlier_job_seconds(job: str | None, job_wall_s: float, environ: Mapping[str, str] | None = None) -> float:
    """The wall time of earlier sessions of this SageMaker job, from a checkpoint written by `job` after `job_wall_s`
    seconds of it; 0 for a checkpoint of another job, or outside one."""
    env = os.environ if environ is None else environ
    same = "SM_MODEL_DIR" in env and job is not None and job == job_name(env)
    return job_wall_s if same else 0.0


def job_wall(job: str | None, job_wall_s: float, environ: Mapping[str, str] | None = None) -> tuple[str | None, float]:
    """What a checkpoint written now keeps (TrainerState.job, .job_wall_s): this SageMaker job's name and its wall
    time so far, over its sessions; `job` and `job_wall_s` are what the checkpoint this session resumed kept."""
    env = os.environ if environ is None else environ
    if "SM_MODEL_DIR" not in env:
        return None, 0.0
    return job_name(env), earlier_job_seconds(job, job_wall_s, env) + session_seconds()


def sagemaker_instances(env: Mapping[str, str], resource_config_file: Path = RESOURCE_CONFIG) -> tuple[str | None, int]:
    """(this host's instance type, the number of hosts) of a SageMaker training job; (None, 1) where not found."""
    instance_type = env.get("SM_CURRENT_INSTANCE_TYPE") or None
    hosts = json_list(env.get("SM_HOSTS"))
    if instance_type is None or hosts is None:
        config = resource_config(env, resource_config_file)
        instance_type = instance_type or text_or_none(config.get("current_instance_type"))
        hosts = hosts if hosts is not None else json_list(config.get("hosts"))
    return instance_type, len(hosts) if hosts else 1


def resource_config(env: Mapping[str, str], resource_config_file: Path = RESOURCE_CONFIG) -> dict:
    """The job's resource configuration: SM_RESOURCE_CONFIG, else the file SageMaker writes; {} if neither reads."""
    try:
        text = env.get("SM_RESOURCE_CONFIG") or resource_config_file.read_text()
        config = json.loads(text)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def json_list(value: object) -> list | None:
    """`value` as a list: a list as is, a JSON list decoded; None for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, list) else None


def text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def estimated_cost(instance_type: str, instance_hours: float, table: Path = PRICE_TABLE) -> dict:
    """price_per_instance_hour, estimated_cost_usd (rounded to cents) and the table's date and region; or a
    `price_note` alone when the table cannot be read or does not list the type."""
    name = TABLE_NAME if Path(table) == PRICE_TABLE else str(table)
    try:
        prices = load_prices(table)
    except (OSError, ValueError) as err:
        return {"price_note": f"{name} could not be read ({type(err).__name__}): cost not estimated"}
    price = instance_price(prices, instance_type)
    if price is None:
        return {"price_note": f"{instance_type} is not in {name}: cost not estimated"}
    return {
        "price_per_instance_hour": price,
        "estimated_cost_usd": round(instance_hours * price, 2),
        "price_table_date": prices.get("date"),
        "price_table_region": prices.get("region"),
    }


def load_prices(table: Path = PRICE_TABLE) -> dict:
    """The price table; OSError or ValueError when it is missing or not a JSON object with an "instances" object."""
    prices = json.loads(Path(table).read_text())
    if not isinstance(prices, dict) or not isinstance(prices.get("instances"), dict):
        raise ValueError(f"{table} has no 'instances' object")
    return prices


def instance_price(prices: dict, instance_type: str) -> float | None:
    """The on-demand price per hour of `instance_type`; None when not listed or not a positive number."""
    entry = prices["instances"].get(instance_type)
    price = entry.get("price_per_hour") if isinstance(entry, dict) else None
    if isinstance(price, bool) or not isinstance(price, int | float) or not math.isfinite(price) or price <= 0:
        return None
    return float(price)


def format_hours(hours: float) -> str:
    """Hours for people: two decimals, or two significant digits below one hour ("0.53", "0.0042", "12.35")."""
    return f"{hours:.2f}" if hours >= 1 or hours == 0 else f"{hours:.2g}"


def format_usd(amount: float) -> str:
    return f"${amount:,.2f}" if amount >= 0.01 else "less than $0.01"


def describe(usage: dict) -> str:
    """One line for the end of a run: device-hours, and inside SageMaker the instances and the estimated cost."""
    processes = usage["processes"]
    line = (
        f"compute: {format_hours(usage['device_hours'])} {usage['device'].replace(' ', '-')}-hours "
        f"({processes} process{'es' if processes != 1 else ''} x {format_hours(usage['train_hours'])} h)"
    )
    if "run_device_hours" in usage:
        line += f" in this launch, {format_hours(usage['run_device_hours'])} with the launches before it"
    if "instance_type" in usage:
        line += (
            f"; SageMaker {usage['instance_count']} x {usage['instance_type']} "
            f"for {format_hours(usage['wall_hours'])} h"
        )
    if "estimated_cost_usd" in usage:
        line += (
            f": about {format_usd(usage['estimated_cost_usd'])} at on-demand prices of "
            f"{usage['price_table_date']} (spot costs less)"
        )
    elif "price_note" in usage:
        line += f" ({usage['price_note']})"
    return line
