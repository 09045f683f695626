"""cloudtrain.hardware: --mixed_precision auto (bf16 where the device computes it natively, else fp32;
the launcher's choice wins) and keeping freed memory in the process for CPU training."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import child_auto_precision, child_pythonpath, run_cli

from cloudtrain import hardware
from cloudtrain.config import build_config
from cloudtrain.training import BasicTrainer


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


def cpu_flags() -> set[str] | None:
    """The CPU feature flags Linux reports for this machine (None elsewhere)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return set(line.split(":", 1)[1].split()) if line else None


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or cpu_flags() is None,
    reason="checks against the x86 CPU flags in /proc/cpuinfo",
)
def test_native_bf16_on_this_cpu_follows_its_instruction_set():
    """bf16 counts as native on a CPU with AVX512-BF16 or AMX (what the docs promise), and not on one
    without AVX-512 at all (nor AVX-NE-CONVERT): there bf16 is emulated and slower than fp32.
    (oneDNN may also count plain AVX-512 cores; that case is not asserted either way.)"""
    flags = cpu_flags()
    if flags & {"avx512_bf16", "amx_bf16"}:
        assert hardware.cpu_has_bf16()
    elif not any(flag.startswith("avx512") for flag in flags) and "avx_ne_convert" not in flags:
        assert not hardware.cpu_has_bf16(), sorted(flags)


@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_test_variable_forces_what_auto_resolves_to_on_cpu(forced, monkeypatch):
    """CLOUDTRAIN_TEST_CPU_BF16 makes this CPU answer as the other kind would; unset, the hardware answers."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setenv(hardware.FORCE_CPU_BF16, forced)
    assert hardware.native_bf16("cpu") is (forced == "1")
    if not torch.cuda.is_available():
        assert hardware.resolve_precision("auto") == ("bf16" if forced == "1" else "no")
    monkeypatch.delenv(hardware.FORCE_CPU_BF16)
    assert hardware.native_bf16("cpu") is hardware.cpu_has_bf16()
    monkeypatch.setenv(hardware.FORCE_CPU_BF16, "yes")
    with pytest.raises(ValueError, match="set it to 1"):
        hardware.native_bf16("cpu")


def test_native_bf16_on_cuda_means_a_gpu_from_ampere_on():
    expected = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    assert hardware.native_bf16("cuda") == expected


def test_unresolved_auto_is_refused_by_the_trainer(tiny_model_dir):
    """A caller that skips resolution gets an error, not a silent fp32 run."""
    with pytest.raises(ValueError, match="resolve"):
        BasicTrainer(build_config({"model_name_or_path": tiny_model_dir}), None, None, None, None, None)


@pytest.mark.slow  # a fresh interpreter per case: the full suite runs it
def test_a_default_run_records_and_prints_the_resolved_precision(tiny_model_dir, topic_csvs, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "--model_name_or_path",
        tiny_model_dir,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
        "--max_steps",
        "2",
        "--output_dir",
        str(out),
        "--report_to",
        "none",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = child_auto_precision()  # the run is a child process, which sees no GPU (conftest)
    assert json.loads((out / "args.json").read_text())["mixed_precision"] == expected
    assert f"on cpu (accelerate, precision {expected})" in proc.stdout


# Training-like churn: tensors of 64 and 16 MiB allocated and freed each cycle; prints the pages faulted
# in during each of 16 cycles. glibc's allocator takes a few cycles to settle into a steady layout (seen
# here: 4 to 6), so the checks look at the last 6 cycles, the steady state of a long training.
REFAULTS = """
import json, resource, sys, torch
from cloudtrain.hardware import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def cycle():
    a, b = torch.ones(16 * 2**20), torch.ones(4 * 2**20)
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keeping_freed_memory_stops_the_page_faults_of_reused_buffers():
    def refaults(mode: str) -> tuple[bool, list[int]]:
        out = subprocess.run(
            [sys.executable, "-c", REFAULTS, mode],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": child_pythonpath()},
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return result["applied"], result["faults"][-6:]

    big_buffer = 64 * 2**20 // 4096  # pages of the 64 MiB tensor
    applied, faults = refaults("default")
    assert applied is False and min(faults) > 0.9 * big_buffer, faults  # glibc unmapped it: every page, every cycle
    applied, faults = refaults("keep")
    assert applied is True and max(faults) < 0.05 * big_buffer, faults  # kept and reused: none faulted again
