"""--profile: the ProfileHook driven as the loop drives it, its trace, and the options' checks."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import record_function

from cloudtrain.config.run import MonitoringConfig, profile_window
from cloudtrain.errors import UserError
from cloudtrain.observe.profile import ProfileHook, profile_hooks


class Bar:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line)


def drive(hook: ProfileHook, steps: int, start: int = 0, stop_early: bool = False) -> SimpleNamespace:
    """What Trainer.fit does: on_train_start, then each step's work followed by on_step_end."""
    loop = SimpleNamespace(state=SimpleNamespace(global_step=start), bar=Bar())
    loop.step = start
    hook.on_train_start(loop)
    a = torch.randn(16, 16)
    for n in range(start + 1, start + steps + 1):
        with record_function(f"work_of_step_{n}"):
            (a @ a).sum()
        loop.step = n
        hook.on_step_end(loop)
    if not stop_early:
        hook.on_train_end(loop)
    hook.close()
    return loop


def traced_steps(path) -> set[int]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(name.startswith("aten::mm") for name in names)  # the steps' ops are in it
    return {int(name.rsplit("_", 1)[1]) for name in names if name.startswith("work_of_step_")}


def test_the_trace_holds_the_profiled_steps_only(tmp_path):
    hook = ProfileHook(tmp_path / "profile", 4, 6, torch.device("cpu"))
    loop = drive(hook, 10)
    assert hook.path == tmp_path / "profile" / "steps_4-6.pt.trace.json"
    assert traced_steps(hook.path) == {4, 5, 6}  # not the warm-up step 3, nor 7..10
    assert list((tmp_path / "profile").iterdir()) == [hook.path]
    (line,) = loop.bar.lines
    assert line.startswith(f"profile of steps 4-6 written to {hook.path}") and "perfetto" in line


def test_the_first_step_can_be_profiled(tmp_path):
    hook = ProfileHook(tmp_path, 1, 2, torch.device("cpu"))
    drive(hook, 4)
    assert traced_steps(hook.path) == {1, 2}


def test_a_run_that_ends_inside_the_window_writes_what_it_profiled(tmp_path):
    hook = ProfileHook(tmp_path, 3, 8, torch.device("cpu"))
    drive(hook, 5, stop_early=True)  # an error after step 5: only close() runs
    assert traced_steps(hook.path) == {3, 4, 5}


def test_a_resumed_run_counts_steps_as_the_run_log_does(tmp_path):
    hook = ProfileHook(tmp_path, 5, 8, torch.device("cpu"))
    drive(hook, 6, start=6)  # resumed after step 6: steps 7 and 8 are still to come
    assert hook.path.name == "steps_7-8.pt.trace.json" and traced_steps(hook.path) == {7, 8}
    late = ProfileHook(tmp_path / "late", 2, 3, torch.device("cpu"))
    loop = drive(late, 2, start=10)
    assert late.path is None and not (tmp_path / "late").exists()
    assert "nothing to profile" in loop.bar.lines[0]


def test_no_hook_without_profile_or_off_the_main_process(tmp_path):
    def trainer(profile: bool, main: bool = True) -> SimpleNamespace:
        cfg = MonitoringConfig(profile=profile, profile_steps="2:3")
        return SimpleNamespace(
            cfg=SimpleNamespace(monitoring=cfg), is_main_process=main, run_log=SimpleNamespace(output_dir=tmp_path)
        )

    assert profile_hooks(trainer(False), torch.device("cpu")) == []
    assert profile_hooks(trainer(True, main=False), torch.device("cpu")) == []
    (hook,) = profile_hooks(trainer(True), torch.device("cpu"))
    assert hook.folder == tmp_path / "profile" and (hook.first, hook.last) == (2, 3)


@pytest.mark.parametrize("steps, window", [("5:8", (5, 8)), ("3", (3, 3)), ("1:1", (1, 1))])
def test_profile_steps_are_read(steps, window):
    assert profile_window(steps) == window
    MonitoringConfig(profile=True, profile_steps=steps).check()


@pytest.mark.parametrize("steps", ["8:5", "0:2", "a:b", "5-8", ""])
def test_bad_profile_steps_are_one_line(steps):
    with pytest.raises(UserError, match="--profile_steps .*first:last"):
        MonitoringConfig(profile=True, profile_steps=steps).check()


def test_profile_dir_needs_profile():
    with pytest.raises(UserError, match="--profile_dir needs --profile true"):
        MonitoringConfig(profile_dir="/tmp/x").check()


@pytest.mark.gpu
def test_a_gpu_trace_holds_cuda_kernels(tmp_path):
    hook = ProfileHook(tmp_path, 2, 3, torch.device("cuda"))
    loop = SimpleNamespace(step=0, bar=Bar())
    hook.on_train_start(loop)
    a = torch.randn(256, 256, device="cuda")
    for n in range(1, 5):
        (a @ a).sum().item()
        loop.step = n
        hook.on_step_end(loop)
    hook.close()
    events = json.loads(hook.path.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
