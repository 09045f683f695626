"""--mixed_precision auto: bf16 where the device computes it natively, else fp32; the launcher's choice wins."""

import json

import pytest
import torch

from cloudtrain import hardware
from cloudtrain.config import build_config
from cloudtrain.trainers import BasicTrainer


@pytest.mark.parametrize("explicit", ["no", "fp16", "bf16"])
def test_explicit_precision_is_kept(explicit, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert hardware.resolve_precision(explicit) == explicit


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_hardware(native, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(hardware, "native_bf16", lambda device_type: native)
    assert hardware.resolve_precision("auto") == ("bf16" if native else "no")


def test_auto_takes_the_launchers_precision(monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16", lambda device_type: False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert hardware.resolve_precision("auto") == "bf16"


def test_native_bf16_on_this_cpu_matches_onednn():
    assert hardware.native_bf16("cpu") == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert hardware.native_bf16("cuda") == (torch.cuda.is_available() and torch.cuda.is_bf16_supported(False))


def test_unresolved_auto_is_refused_by_the_trainer(tiny_model_dir):
    """A caller that skips resolution gets an error, not a silent fp32 run."""
    with pytest.raises(ValueError, match="resolve"):
        BasicTrainer(build_config({"model_name_or_path": tiny_model_dir}), None, None, None)


def test_a_default_run_records_and_prints_the_resolved_precision(tiny_model_dir, topic_csvs, tmp_path):
    from conftest import run_cli

    out = tmp_path / "run"
    proc = run_cli("--model_name_or_path", tiny_model_dir, "--train_file", str(topic_csvs["train"]),
                   "--validation_file", str(topic_csvs["validation"]), "--max_steps", "2",
                   "--output_dir", str(out), "--report_to", "none")
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = hardware.resolve_precision("auto")
    assert json.loads((out / "args.json").read_text())["mixed_precision"] == expected
    assert f"precision {expected})" in proc.stdout
