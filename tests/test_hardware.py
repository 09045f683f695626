"""cloudtrain.hardware: --mixed_precision auto (bf16 where the device computes it natively, else fp32;
the launcher's choice wins) and keeping freed memory in the process for CPU training."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cloudtrain import hardware
from cloudtrain.config import build_config
from cloudtrain.trainers import BasicTrainer

from conftest import REPO


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


# Training-like churn: tensors of 64 and 16 MiB allocated and freed each cycle; prints how many
# pages faulted in over five cycles once the process has warmed up.
REFAULTS = """
import resource, sys, torch
from cloudtrain.hardware import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def cycle():
    a, b = torch.ones(16 * 2**20), torch.ones(4 * 2**20)
for _ in range(3):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    cycle()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keeping_freed_memory_stops_most_page_faults_of_reused_buffers():
    def refaults(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", REFAULTS, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        applied, faults = out.stdout.split()
        return applied, int(faults)

    every_cycle = 5 * 80 * 2**20 // 4096
    applied, default_faults = refaults("default")
    assert applied == "False" and default_faults > 0.9 * every_cycle  # glibc unmapped them: every page again
    applied, kept_faults = refaults("keep")
    assert applied == "True" and kept_faults < 0.4 * every_cycle
