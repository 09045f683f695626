"""--profile: the ProfileHook driven as the loop drives it, its trace, and the options' checks."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import record_function

from cloudtrain.config.run import MonitoringConfig, profile_window
from cloudtrain.errors import UserError
from cloudtrain.observe.profile import (
    ProfileHook,
    category,
    profile_hooks,
    summarize,
    summary_line,
    timed_events,
)


class Bar:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line)


def drive(
    hook: ProfileHook, steps: int, start: int = 0, stop_early: bool = False, total: int | None = None
) -> SimpleNamespace:
    """What Trainer.fit does: on_train_start, then each step's work followed by on_step_end; `total`: the steps the
    run plans (default: those it trains)."""
    loop = SimpleNamespace(state=SimpleNamespace(global_step=start), bar=Bar(), total_steps=total or start + steps)
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
    steps = {int(name.rsplit("_", 1)[1]) for name in names if name.startswith("work_of_step_")}
    # torch's step markers carry the run log's step numbers (they counted from 0 where profiling began: audit);
    # a run that stops inside the window leaves the next step's marker open and empty
    markers = {int(name.split("#")[1]) for name in names if name.startswith("ProfilerStep#")}
    assert steps <= markers and markers - steps <= {max(steps) + 1}
    return steps


def test_the_trace_holds_the_profiled_steps_only(tmp_path):
    hook = ProfileHook(tmp_path / "profile", 4, 6, torch.device("cpu"))
    loop = drive(hook, 10)
    assert hook.path == tmp_path / "profile" / "steps_4-6.pt.trace.json"
    assert traced_steps(hook.path) == {4, 5, 6}  # not the warm-up step 3, nor 7..10
    assert list((tmp_path / "profile").iterdir()) == [hook.path]
    trace, summary = loop.bar.lines
    assert trace.startswith(f"profile of steps 4-6 written to {hook.path}") and "perfetto" in trace
    assert summary.strip().startswith("3 steps, ") and "matmul" in summary and "\n" not in summary


def test_the_first_step_can_be_profiled(tmp_path):
    hook = ProfileHook(tmp_path, 1, 2, torch.device("cpu"))
    drive(hook, 4)
    assert traced_steps(hook.path) == {1, 2}


def test_a_run_that_ends_inside_the_window_writes_what_it_profiled(tmp_path):
    hook = ProfileHook(tmp_path, 3, 8, torch.device("cpu"))
    drive(hook, 5, stop_early=True, total=10)  # an error after step 5: only close() runs
    assert traced_steps(hook.path) == {3, 4, 5} and hook.path.name == "steps_3-5.pt.trace.json"


def test_a_window_past_the_run_s_end_is_cut_to_it_or_said_to_be_empty(tmp_path):
    """A 6-step run with --profile_steps 4:9 named its trace steps_4-9 and halved the ms/step (6 steps counted for
    3 traced); a 3-step run with the default 5:8 wrote nothing and said nothing (found in audit)."""
    hook = ProfileHook(tmp_path, 4, 9, torch.device("cpu"))
    loop = drive(hook, 6)
    assert hook.path.name == "steps_4-6.pt.trace.json" and traced_steps(hook.path) == {4, 5, 6}
    cut, trace, summary = loop.bar.lines
    assert cut == "--profile_steps 4:9: the run ends at step 6; profiling steps 4-6"
    assert summary.strip().startswith("3 steps, ")
    beyond = ProfileHook(tmp_path / "beyond", 5, 8, torch.device("cpu"))
    loop = drive(beyond, 3)
    assert beyond.path is None and loop.bar.lines == [
        "--profile_steps 5:8: the run ends at step 3, nothing to profile; give steps within 1:3"
    ]


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


def test_the_summary_sorts_the_profiled_steps_time_by_kind():
    """Steps of a DataLoader, a linear layer, attention and AdamW: each lands in its category, the shares of op
    time add up to one, and the host's wait for data is seen."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(layer.parameters(), fused=True)
    loader = iter(DataLoader(torch.randn(64, 8, 64), batch_size=4))
    profiler = torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1))
    profiler.start()
    for _ in range(4):
        x = layer(next(loader))
        q = x.view(4, 1, 8, 64)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        optimizer.step()
        profiler.step()
    profiler.stop()
    summary = summarize(profiler, 2, cuda=False)
    assert summary["steps"] == 2 and summary["ms_per_step"] > 0
    assert sum(summary["shares"].values()) == pytest.approx(1.0)
    assert all(summary["shares"][kind] > 0 for kind in ("attention", "matmul", "optimizer"))
    assert summary["data_wait"] > 0 and 0 < summary["device_busy"] <= 1.0
    assert summary["top"][0]["share"] >= summary["top"][-1]["share"]
    assert summary_line(summary).startswith("2 steps, ")


def test_the_events_read_from_kineto_keep_torch_s_own_times_and_nesting():
    """timed_events reads the profiler's records without torch's event list: each op's self time (its time less
    the ops nested in it, on its thread) per name equals what torch's own list says, up to rounding, and so does a
    marked range's total. (torch's list also folds an op into a same-named parent: self times are unchanged.)"""
    layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    with torch.profiler.profile() as profiler:
        for _ in range(3):
            with torch.profiler.record_function("step"):
                layer(torch.randn(8, 32)).sum().backward()
    ours: dict[str, float] = {}
    for e in timed_events(profiler):
        assert not e.gpu
        ours[e.name] = ours.get(e.name, 0.0) + e.self_us
    torch_s: dict[str, list[float]] = {}
    for e in profiler.events():
        torch_s.setdefault(e.name, [0.0, 0])
        torch_s[e.name][0] += e.self_cpu_time_total
        torch_s[e.name][1] += 1
    assert set(torch_s) == set(ours) and "aten::addmm" in ours
    for name, (own, count) in torch_s.items():  # torch rounds each time to a nanosecond, in microseconds
        assert ours[name] == pytest.approx(own, abs=0.004 * count + 1e-6), name
    steps = [e for e in timed_events(profiler) if e.name == "step"]
    assert len(steps) == 3 and all(e.self_us < e.us for e in steps)  # the ops inside it are not its own time
    assert sum(e.us for e in steps) == pytest.approx(
        sum(e.cpu_time_total for e in profiler.events() if e.name == "step")
    )


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"),
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("Memcpy HtoD (Pinned -> Device)", "copy"),
        ("aten::mm", "matmul"),
        ("triton_red_fused__to_copy_mul_rsqrt_0", "other"),
    ],
)
def test_kernel_names_fall_in_their_category(name, kind):
    assert category(name) == kind


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
    summary = next(line for line in loop.bar.lines if "ms/step" in line)  # from kineto's records: GPU kernels
    assert summary.startswith("2 steps, ") and "matmul 0%" not in summary, summary


def test_a_real_run_writes_the_trace_of_its_profiled_steps(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Through Trainer.fit: the hook is added to Trainer.hooks' list here until the trainer lists it itself."""
    from test_training import tiny_setup

    import cloudtrain.training as training
    from cloudtrain.training.trainer import Trainer

    listed = Trainer.hooks

    def hooks(self, checkpointer, preemption):
        found = listed(self, checkpointer, preemption)
        if not any(isinstance(hook, ProfileHook) for hook in found):
            found += profile_hooks(self, self._device)
        return found

    monkeypatch.setattr(Trainer, "hooks", hooks)
    options = dict(max_steps=5, per_device_train_batch_size=2, logging_steps=5, eval_strategy="no")
    trainer = tiny_setup(tiny_model_dir, tmp_path, training.BasicTrainer, profile=True, profile_steps="2:3", **options)
    trainer.fit()
    trace = tmp_path / "profile" / "steps_2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert len({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}) == 2
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert f"profile of steps 2-3 written to {trace}" in capsys.readouterr().out


def test_writing_the_trace_is_left_out_of_the_intervals_rates(tmp_path):
    """The trace's export ran in the step hooks and counted as training time: the next logging interval's
    tokens/s and MFU fell (found in audit)."""
    from cloudtrain.training.trainer import Trainer

    hook, excluded = ProfileHook(tmp_path, 1, 1, torch.device("cpu")), []
    loop = SimpleNamespace(bar=Bar(), total_steps=2, step=0, meter=SimpleNamespace(exclude=excluded.append))
    hook.on_train_start(loop)
    (torch.randn(8, 8) @ torch.randn(8, 8)).sum()
    loop.step = 1
    with Trainer._timed(hook, loop):
        hook.on_step_end(loop)  # the window's last step: the trace is written here
    assert hook.path is not None and hook.path.is_file()
    assert len(excluded) == 1 and excluded[0] > 0
