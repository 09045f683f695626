"""Compute used and estimated cost (`cloudtrain.observe.cost`), and the Compute section of the model cards.

The SageMaker job is simulated by its environment variables (and a resourceconfig.json in a temporary folder);
prices are read from the shipped table in each test, never written down here. Cards are built as in
test_lm_card.py (its output dir, config and results), with no training and no Hub.
"""

import json
import math
from datetime import date
from pathlib import Path

import pytest
from test_lm_card import lm_config, lm_output_dir, lm_results  # noqa: F401 (lm_output_dir is a fixture)

from cloudtrain.config import build_config
from cloudtrain.observe.cost import (
    PRICE_TABLE,
    compute_used,
    describe,
    earlier_job_seconds,
    job_wall,
    sagemaker_instances,
    session_seconds,
)
from cloudtrain.publish.classifier_card import build_model_card
from cloudtrain.publish.lm_card import build_lm_model_card

SM_ENV = {"SM_MODEL_DIR": "/opt/ml/model"}  # what marks a SageMaker training job
COST_FIELDS = {"price_per_instance_hour", "estimated_cost_usd", "price_table_date"}


def table_price(instance_type: str) -> float:
    return json.loads(PRICE_TABLE.read_text())["instances"][instance_type]["price_per_hour"]


# ---------------------------------------------------------------- device-hours


def test_device_hours_are_training_time_times_processes():
    usage = compute_used(train_seconds=1800, wall_seconds=2000, processes=4, device_type="cuda", environ={})
    assert usage["device_hours"] == 2.0 and usage["train_hours"] == 0.5 and usage["processes"] == 4
    assert usage["wall_hours"] == 0.5556  # rounded to 4 significant digits
    assert usage["device"] == "GPU"
    assert not {"instance_type", "instance_count", "instance_hours", "price_note"} & set(usage)  # not SageMaker
    assert json.loads(json.dumps(usage)) == usage  # goes to results["compute"] as it is


def test_a_cpu_run_counts_cpu_processes_and_short_runs_keep_four_significant_digits():
    usage = compute_used(train_seconds=7, wall_seconds=9, processes=2, device_type="cpu", environ={})
    assert usage["device"] == "CPU process"
    assert usage["device_hours"] == 0.003889  # four significant digits


def test_sagemaker_variables_without_sm_model_dir_are_not_a_job():
    env = {"SM_CURRENT_INSTANCE_TYPE": "ml.g5.xlarge", "SM_HOSTS": '["algo-1"]'}  # e.g. left over in a shell
    assert "instance_type" not in compute_used(3600, 3600, 1, "cuda", environ=env)


# ---------------------------------------------------------------- inside a SageMaker job


def test_instance_type_from_sm_current_instance_type_and_count_from_sm_hosts():
    env = SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.g5.xlarge", "SM_HOSTS": '["algo-1"]'}
    usage = compute_used(train_seconds=3000, wall_seconds=3960, processes=1, device_type="cuda", environ=env)
    price = table_price("ml.g5.xlarge")
    assert usage["instance_type"] == "ml.g5.xlarge" and usage["instance_count"] == 1
    assert usage["instance_hours"] == 1.1
    assert usage["price_per_instance_hour"] == price
    assert usage["estimated_cost_usd"] == round(1.1 * price, 2)
    assert usage["price_table_date"] == json.loads(PRICE_TABLE.read_text())["date"]


def test_resource_config_with_two_hosts_doubles_the_instance_hours_and_the_cost():
    config = {"current_host": "algo-2", "current_instance_type": "ml.g5.12xlarge", "hosts": ["algo-1", "algo-2"]}
    env = SM_ENV | {"SM_RESOURCE_CONFIG": json.dumps(config)}  # no SM_CURRENT_INSTANCE_TYPE, no SM_HOSTS
    usage = compute_used(train_seconds=4800, wall_seconds=5400, processes=8, device_type="cuda", environ=env)
    price = table_price("ml.g5.12xlarge")
    assert usage["instance_type"] == "ml.g5.12xlarge" and usage["instance_count"] == 2
    assert usage["instance_hours"] == 3.0  # 1.5 h of wall time on each of 2 instances
    assert usage["estimated_cost_usd"] == round(1.5 * 2 * price, 2)
    assert usage["device_hours"] == 10.6667  # four decimals above an hour  # 8 GPUs over the two hosts


def test_sm_hosts_counts_before_the_resource_config():
    config = {"current_instance_type": "ml.g6.xlarge", "hosts": ["algo-1"]}
    env = SM_ENV | {"SM_RESOURCE_CONFIG": json.dumps(config), "SM_HOSTS": '["algo-1", "algo-2", "algo-3"]'}
    assert sagemaker_instances(env) == ("ml.g6.xlarge", 3)


def test_the_resource_config_file_is_the_last_resort(tmp_path):
    config_file = tmp_path / "resourceconfig.json"
    config_file.write_text(json.dumps({"current_instance_type": "ml.p4d.24xlarge", "hosts": ["algo-1", "algo-2"]}))
    assert sagemaker_instances(SM_ENV, resource_config_file=config_file) == ("ml.p4d.24xlarge", 2)
    assert sagemaker_instances(SM_ENV, resource_config_file=tmp_path / "missing.json") == (None, 1)
    config_file.write_text("{not json")
    assert sagemaker_instances(SM_ENV | {"SM_HOSTS": "[broken"}, resource_config_file=config_file) == (None, 1)


def test_an_unknown_instance_type_gets_a_note_and_no_cost():
    env = SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.x99.48xlarge", "SM_HOSTS": '["algo-1", "algo-2"]'}
    usage = compute_used(3600, 7200, 16, "cuda", environ=env)
    assert usage["instance_type"] == "ml.x99.48xlarge" and usage["instance_hours"] == 4.0
    assert not COST_FIELDS & set(usage)
    assert usage["price_note"] == "ml.x99.48xlarge is not in cloudtrain/prices.json: cost not estimated"


@pytest.mark.parametrize("content", [None, "{not json", '{"date": "2026-01-01"}', "[1, 2]"])
def test_a_missing_or_broken_price_table_does_not_fail_the_run(tmp_path, content):
    table = tmp_path / "prices.json"
    if content is not None:
        table.write_text(content)
    env = SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.g5.xlarge"}
    usage = compute_used(60, 120, 1, "cuda", environ=env, table=table)
    assert usage["instance_type"] == "ml.g5.xlarge" and usage["instance_count"] == 1
    assert not COST_FIELDS & set(usage)
    assert usage["price_note"].startswith(f"{table} could not be read")
    assert "SageMaker 1 x ml.g5.xlarge" in describe(usage) and "$" not in describe(usage)


def test_an_entry_without_a_positive_price_is_not_priced(tmp_path):
    table = tmp_path / "prices.json"
    table.write_text(json.dumps({"date": "2026-01-01", "instances": {"ml.g5.xlarge": {"price_per_hour": 0}}}))
    usage = compute_used(60, 120, 1, "cuda", environ=SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.g5.xlarge"}, table=table)
    assert "estimated_cost_usd" not in usage and "is not in" in usage["price_note"]


# ---------------------------------------------------------------- the line at the end of a run


def test_describe_names_the_device_hours_instances_and_cost():
    env = SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.g5.12xlarge", "SM_HOSTS": '["algo-1", "algo-2"]'}
    usage = compute_used(train_seconds=972, wall_seconds=1116, processes=2, device_type="cuda", environ=env)
    line = describe(usage)
    cost = round(1116 * 2 / 3600 * table_price("ml.g5.12xlarge"), 2)
    assert line.startswith("compute: 0.54 GPU-hours (2 processes x 0.27 h); SageMaker 2 x ml.g5.12xlarge for 0.31 h")
    assert f"about ${cost:.2f} at on-demand prices of {usage['price_table_date']}" in line
    assert "spot costs less" in line


def test_a_resumed_launch_counts_its_own_hours_and_adds_the_runs_over_every_launch():
    usage = compute_used(1800, 2000, processes=4, device_type="cuda", environ={}, earlier_device_seconds=3 * 3600)
    assert (usage["device_hours"], usage["train_hours"], usage["run_device_hours"]) == (2.0, 0.5, 5.0)
    assert describe(usage) == (
        "compute: 2.00 GPU-hours (4 processes x 0.5 h) in this launch, 5.00 with the launches before it"
    )
    assert "run_device_hours" not in compute_used(1800, 2000, 4, "cuda", environ={})  # a fresh run: one launch


def test_a_job_s_wall_time_adds_its_earlier_sessions_and_not_another_job_s():
    """A managed-spot restart resumes the same job (billed for every session); a new job from a checkpoint does not."""
    env = SM_ENV | {"TRAINING_JOB_NAME": "spot-job"}
    assert earlier_job_seconds("spot-job", 900.0, env) == 900.0
    assert earlier_job_seconds("other-job", 900.0, env) == 0.0  # another job's checkpoint
    assert earlier_job_seconds(None, 0.0, env) == 0.0  # a checkpoint from outside a job
    assert earlier_job_seconds("spot-job", 900.0, {"TRAINING_JOB_NAME": "spot-job"}) == 0.0  # not in a job now
    name, seconds = job_wall("spot-job", 900.0, env)  # what a checkpoint written now keeps
    assert name == "spot-job" and 900.0 < seconds <= 900.0 + session_seconds()
    assert job_wall("spot-job", 900.0, {}) == (None, 0.0)


def test_a_short_run_s_line_multiplies_out():
    """Each figure is rounded alone: 2 processes x 0.9 s read 0.0005 h = 2 x 0.0003 h when rounded to decimals."""
    line = describe(compute_used(train_seconds=0.9, wall_seconds=2, processes=2, device_type="cpu", environ={}))
    assert line == "compute: 0.0005 CPU-process-hours (2 processes x 0.00025 h)"
    long = compute_used(
        train_seconds=3600 * 12345.6, wall_seconds=3600 * 12345.6, processes=1, device_type="cuda", environ={}
    )
    assert long["device_hours"] == 12345.6  # four decimals above an hour: significant digits lost 4.6 h (review)


def test_describe_outside_sagemaker_is_only_the_device_hours():
    line = describe(compute_used(train_seconds=15, wall_seconds=20, processes=1, device_type="cpu", environ={}))
    assert line == "compute: 0.0042 CPU-process-hours (1 process x 0.0042 h)"


# ---------------------------------------------------------------- the price table


def test_the_price_table_is_dated_and_every_entry_has_a_positive_price():
    prices = json.loads(PRICE_TABLE.read_text())
    assert date.fromisoformat(prices["date"]) <= date.today()
    assert prices["currency"] == "USD" and prices["region"] and prices["source"] and prices["note"]
    instances = prices["instances"]
    assert {"ml.g5.xlarge", "ml.g5.12xlarge", "ml.p4d.24xlarge", "ml.p5.48xlarge", "ml.m5.xlarge"} <= set(instances)
    for name, entry in instances.items():
        assert name.startswith("ml."), name
        price = entry["price_per_hour"]
        assert isinstance(price, float | int) and math.isfinite(price) and price > 0, name
        assert isinstance(entry["gpus"], int) and entry["gpus"] >= 0, name
        assert (entry["gpus"] > 0) == bool(entry["gpu"]), name


def test_within_a_family_more_gpus_cost_more():
    """A sanity check that catches a mistyped price: the 4- and 8-GPU sizes of a family cost more than its
    1-GPU xlarge, and the 8-GPU size more than the 4-GPU one."""
    instances = json.loads(PRICE_TABLE.read_text())["instances"]
    for family in ("g4dn", "g5", "g6", "g6e", "p3"):
        sizes = sorted(
            (entry["gpus"], entry["price_per_hour"])
            for name, entry in instances.items()
            if name.startswith(f"ml.{family}.") and entry["gpus"] in (1, 4, 8)
        )
        cheapest_by_gpus = {}
        for gpus, price in sizes:
            cheapest_by_gpus.setdefault(gpus, price)
        counts = sorted(cheapest_by_gpus)
        assert all(cheapest_by_gpus[a] < cheapest_by_gpus[b] for a, b in zip(counts, counts[1:], strict=False)), family


# ---------------------------------------------------------------- the model cards


def sagemaker_compute() -> dict:
    env = SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.g5.12xlarge", "SM_HOSTS": '["algo-1", "algo-2"]'}
    return compute_used(train_seconds=972, wall_seconds=1116, processes=8, device_type="cuda", environ=env)


def classifier_card(tmp_path: Path, results_extra: dict):
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "acq", "1": "earn"}}))
    cfg = build_config({"push_to_hub": True, "hub_model_id": "alice/minilm-r8"})
    results = {
        "train": {"global_step": 10, "epoch": 1.0, "train_loss": 0.5, "train_runtime_s": 3.0, "train_samples_per_s": 5},
        "eval": {"accuracy": 0.9, "macro_f1": 0.8, "loss": 0.3, "samples": 20, "confusion_matrix": [[9, 1], [1, 9]]},
        **results_extra,
    }
    return build_model_card(tmp_path, cfg, results)


def compute_section(text: str) -> str:
    start = text.index("### Compute")
    return text[start : text.index("## Framework versions", start)]


def test_a_classifier_card_shows_the_compute_and_the_estimated_cost(tmp_path):
    usage = sagemaker_compute()
    section = compute_section(classifier_card(tmp_path, {"compute": usage}).text)
    assert "- Training: 2.16 GPU-hours (8 x 0.27 h)" in section
    assert "- SageMaker training job: 2 x `ml.g5.12xlarge` for 0.62 instance-hours" in section
    price = table_price("ml.g5.12xlarge")
    assert f"about ${usage['estimated_cost_usd']:.2f} (${price:g} per instance-hour" in section
    assert f"on-demand list price in us-east-1 of {usage['price_table_date']}" in section
    assert "An estimate, not the bill" in section


def test_a_card_without_compute_results_has_no_compute_section(tmp_path):
    assert "### Compute" not in classifier_card(tmp_path, {}).text  # results of runs from before this change


def test_a_language_model_card_shows_the_compute(lm_output_dir, tmp_path):  # noqa: F811 (the fixture)
    results = lm_results() | {"compute": compute_used(15, 20, 2, "cpu", environ={})}
    text = build_lm_model_card(lm_output_dir, lm_config(tmp_path), results).text
    section = compute_section(text)
    assert "- Training: 0.0083 CPU-process-hours (2 x 0.0042 h)" in section
    assert "SageMaker" not in section and "$" not in section
    resumed = results | {"compute": compute_used(15, 20, 2, "cpu", environ={}, earlier_device_seconds=90)}
    text = build_lm_model_card(lm_output_dir, lm_config(tmp_path), resumed).text
    assert "(2 x 0.0042 h) in the last launch, 0.033 over every launch\n" in compute_section(text)
    assert "### Compute" not in build_lm_model_card(lm_output_dir, lm_config(tmp_path), lm_results()).text


def test_a_card_shows_why_a_sagemaker_run_has_no_cost(tmp_path):
    env = SM_ENV | {"SM_CURRENT_INSTANCE_TYPE": "ml.x99.48xlarge"}
    section = compute_section(classifier_card(tmp_path, {"compute": compute_used(60, 3600, 1, "cuda", env)}).text)
    assert "1 x `ml.x99.48xlarge` for 1.00 instance-hours" in section
    assert "- ml.x99.48xlarge is not in cloudtrain/prices.json: cost not estimated" in section
    assert "Estimated cost" not in section
