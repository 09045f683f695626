"""The gpu tier's own machinery, on CPU: what a test's child processes see (conftest.child_environment), why
gpu tests skip, `make gpu-check` (scripts/gpu_check.py: its refusal, its report from a real junit XML), the
stand-in for the default model where its wheel is missing, and the supported torch range.

What these cannot show on CPU (the gpu tests running under xdist on a GPU, gpu-check's figures) runs on a
GPU machine: `make test-gpu`, `make gpu-check` (docs/testing.md).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import conftest
import pytest
import torch
from conftest import CUDA_AVAILABLE, MINILM_CONFIG, REPO, child_environment, gpu_skip_reason
from packaging.specifiers import SpecifierSet
from packaging.version import Version

GPU_MACHINE_TORCH = "2.11.0"  # torch on the GPU machine the gpu tier was first run on (docs/testing.md)
SHOW_DEVICES = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- what a test's children see
def test_children_of_other_tests_see_no_gpu_and_the_parent_env_is_untouched():
    parent = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    child = child_environment(None, False, parent, "0,1")
    assert child == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}
    assert parent == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}  # a copy: the test process keeps its GPUs
    given = {"PATH": "/bin", "X": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert child_environment(given, False, parent, "0,1") == {"PATH": "/bin", "X": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert given["CUDA_VISIBLE_DEVICES"] == "0"


def test_children_of_gpu_tests_see_the_suites_gpus_even_where_a_helper_hid_them():
    parent = {"PATH": "/bin"}
    hidden_by_helper = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}  # e.g. a launcher shared with CPU tests
    assert child_environment(hidden_by_helper, True, parent, "1")["CUDA_VISIBLE_DEVICES"] == "1"
    assert child_environment(hidden_by_helper, True, parent, None) == {"PATH": "/bin"}  # unset: all GPUs
    assert child_environment(None, True, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}, "0") == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "0",
    }


def test_between_tests_a_process_gets_its_env_as_given():
    given = {"CUDA_VISIBLE_DEVICES": "3"}
    assert child_environment(given, None, {}, "0") is given and child_environment(None, None, {}, "0") is None


def child_sees(env: dict | None = None) -> str:
    return subprocess.run([sys.executable, "-c", SHOW_DEVICES], capture_output=True, text=True, env=env).stdout


def test_this_tests_children_see_no_gpu_through_subprocess():
    """The real Popen path: a child started by this (not gpu) test sees no GPU, whatever env it is given,
    and this process's own CUDA_VISIBLE_DEVICES is the one the suite started with."""
    assert conftest._RUNNING_GPU_TEST is False  # set by conftest's pytest_runtest_protocol for this test
    assert child_sees() == "''\n"
    assert child_sees({**os.environ, "CUDA_VISIBLE_DEVICES": "0"}) == "''\n"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == conftest._SUITE_VISIBLE_DEVICES
    code = "import torch; print(torch.cuda.device_count())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "0\n"


def test_a_gpu_tests_children_get_the_suites_devices_through_subprocess(monkeypatch):
    # As conftest's hook marks a gpu test's run (on CPU no gpu test runs, so this test stands in for one).
    monkeypatch.setattr(conftest, "_RUNNING_GPU_TEST", True)
    monkeypatch.setattr(conftest, "_SUITE_VISIBLE_DEVICES", "7")
    assert child_sees({**os.environ, "CUDA_VISIBLE_DEVICES": ""}) == "'7'\n"
    monkeypatch.setattr(conftest, "_SUITE_VISIBLE_DEVICES", None)
    assert child_sees({**os.environ, "CUDA_VISIBLE_DEVICES": ""}) == "None\n"


# ---------------------------------------------------------------- why gpu tests skip
def test_the_skip_reason_names_the_cause():
    assert gpu_skip_reason("13.0", True, None) is None
    reasons = [
        gpu_skip_reason(None, False, None),
        gpu_skip_reason("13.0", False, ""),
        gpu_skip_reason("13.0", False, "0"),
    ]
    assert all(r.startswith("needs a CUDA GPU (") for r in reasons) and len(set(reasons)) == 3
    assert "CPU build" in reasons[0] and "CUDA_VISIBLE_DEVICES is empty" in reasons[1]


@pytest.mark.slow
@pytest.mark.skipif(CUDA_AVAILABLE, reason="with a GPU the gpu tests run instead (make test-gpu)")
def test_on_cpu_every_gpu_test_is_collected_and_skipped_with_its_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-rs", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped in .*", summary), summary  # none ran, none failed
    reasons = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any(r.startswith("needs a CUDA GPU (") for r in reasons), reasons
    assert all(r.startswith("needs a CUDA GPU (") or "needs 2 GPUs" in r for r in reasons), reasons


# ---------------------------------------------------------------- make gpu-check
def test_gpu_check_refuses_in_one_line_without_cuda(tmp_path):
    # This test's children see no GPU (conftest), so this holds on every machine.
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: gpu-check needs a CUDA GPU: ") and not out.exists()


FAKE_TESTS = """
import pytest

@pytest.fixture
def breaks_at_teardown():
    yield
    raise RuntimeError("teardown broke")

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    assert 1 + 1 == 2

def test_fails(breaks_at_teardown):
    assert 1 + 1 == 3, "arithmetic is off"

@pytest.mark.skip(reason="a pipeline on NCCL needs 2 GPUs (one per stage)")
def test_skipped():
    pass

def test_skips_inside():
    pytest.skip("no native bf16")

def test_errors(broken):
    pass
"""


def real_junit(tmp_path: Path, source: str) -> Path:
    """pytest's own junit XML for the tests in `source`, run apart from this suite's conftest and ini."""
    (tmp_path / "test_fake.py").write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    junit = tmp_path / "junit.xml"
    command = [sys.executable, "-m", "pytest", "test_fake.py", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return junit


def fake_bench(**run) -> dict:
    """bench/gpu.py's JSON (its keys as it writes them), with the figures of issue 29's H100 run; a second
    variant the application refused."""
    return {
        "settings": {
            "preset": "llama-600m",
            "steps": 40,
            "batch_size": 8,
            "max_length": 2048,
            "mixed_precision": "bf16",
            "packing": "bfd",
        },
        "device": "NVIDIA H100 80GB HBM3",
        "runs": [
            {
                "variant": "defaults",
                "runner": "cloudtrain",
                "status": "ok",
                "attention": "sdpa",
                "tokens_per_s": 58365.2,
                "mfu": 0.227,
                "peak_memory": {"allocated": int(35.66 * 2**30), "reserved": int(37.0 * 2**30)},
                **run,
            },
            {"variant": "varlen", "runner": "cloudtrain", "status": "refused", "error": "no such kernel"},
        ],
        "planner": {"total": int(30.0 * 2**30), "without_overhead": int(27.47 * 2**30), "overhead": 1},
    }


FAKE_ENV = {
    "versions": {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0"},
    "devices": [{"name": "NVIDIA H100 80GB HBM3", "memory": 85520809984, "capability": "9.0"}],
    "driver": "580.159",
}


def test_gpu_check_reads_each_outcome_from_pytests_junit(tmp_path):
    gpu_check = load_gpu_check()
    results = {r.test.split("::")[-1]: r for r in gpu_check.parse_junit(real_junit(tmp_path, FAKE_TESTS))}
    assert {name: r.outcome for name, r in results.items()} == {
        "test_passes": "passed",
        "test_fails": "error",  # failed in its call, then errored in teardown: the worse
        "test_skipped": "skipped",
        "test_skips_inside": "skipped",
        "test_errors": "error",
    }
    assert results["test_skipped"].detail == "a pipeline on NCCL needs 2 GPUs (one per stage)"
    assert results["test_skips_inside"].detail == "no native bf16"
    assert "fixture broke" in results["test_errors"].detail and results["test_passes"].detail == ""
    assert "arithmetic is off" in results["test_fails"].detail and "teardown broke" in results["test_fails"].detail


def test_gpu_check_writes_its_report(tmp_path):
    gpu_check = load_gpu_check()
    tests = gpu_check.parse_junit(real_junit(tmp_path, FAKE_TESTS))
    out = tmp_path / "report"
    report = gpu_check.write_report(out, FAKE_ENV, tests, fake_bench(), 123.0)
    assert report["problems"] == ["2 gpu test(s) failed"]
    text = (out / "report.md").read_text()
    assert text.startswith("# gpu-check: FAIL: 2 gpu test(s) failed")
    assert "1 passed, 2 skipped, 2 error" in text
    assert "| test_fake::test_skipped | skipped | a pipeline on NCCL needs 2 GPUs (one per stage) |" in text
    assert "| defaults | 58,365 | 22.7% | 35.66 | 27.47 / 30.00 | 130% |" in text
    assert "| varlen | refused: no such kernel |" in text
    assert "| torch | 2.11.0+cu130 |" in text and "NVIDIA H100 80GB HBM3, 79.6 GiB" in text
    assert json.loads((out / "report.json").read_text())["tests"][0]["test"].startswith("test_fake::")

    passing = [t for t in tests if t.outcome in ("passed", "skipped")]
    report = gpu_check.write_report(out, FAKE_ENV, passing, fake_bench(), 1.0)
    assert report["problems"] == [] and (out / "report.md").read_text().startswith("# gpu-check: PASS")

    failed_bench = fake_bench(status="error", error="OutOfMemoryError: CUDA out of memory")
    report = gpu_check.write_report(out, FAKE_ENV, passing, failed_bench, 1.0)
    assert report["problems"] == ["bench/gpu.py produced no result"]
    assert "| defaults | error: OutOfMemoryError: CUDA out of memory |" in (out / "report.md").read_text()
    report = gpu_check.write_report(out, FAKE_ENV, None, None, 1.0)
    assert len(report["problems"]) == 2 and "No result" in (out / "report.md").read_text()


def test_gpu_check_skips_the_nameless_entry_xdist_writes(tmp_path):
    """pytest-xdist wrote one <testcase/> with no test into the H100's junit; it is no test of the report."""
    gpu_check = load_gpu_check()
    junit = real_junit(tmp_path, FAKE_TESTS)
    junit.write_text(junit.read_text().replace("</testsuite>", '<testcase time="0.001" /></testsuite>'))
    tests = gpu_check.parse_junit(junit)
    assert len(tests) == 5 and all(t.test.split("::")[-1].startswith("test_") for t in tests)


def test_gpu_check_interrupts_a_tier_past_its_time_as_ctrl_c_would(tmp_path):
    """--tier_timeout: pytest gets SIGINT (so it still writes its junit and summary), not a kill."""
    gpu_check = load_gpu_check()
    said = tmp_path / "interrupted"
    child = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGINT, lambda *_: (pathlib.Path({str(said)!r}).write_text('yes'), sys.exit(2)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    assert gpu_check.run_tier([sys.executable, "-c", child], limit=5)  # 5 s: its handler is set long before
    assert said.read_text() == "yes" and time.monotonic() - started < 30
    assert not gpu_check.run_tier([sys.executable, "-c", "pass"], limit=30)
    report = gpu_check.write_report(tmp_path / "r", FAKE_ENV, [], fake_bench(), 1.0, interrupted=5)
    # the tests cut short are in no result: the check cannot pass on the ones that finished
    assert report["problems"][0] == "the gpu tier was interrupted after 5 s (--tier_timeout)"


def test_gpu_check_passes_options_bench_gpu_accepts():
    """The command gpu-check runs bench/gpu.py with parses with bench/gpu.py's own options (another module
    owns them), to the short budget asked."""
    import gpu as bench_gpu

    gpu_check = load_gpu_check()
    args = gpu_check.parse_args(["--steps", "30", "--bench_budget_s", "200"])
    command = gpu_check.bench_command(args, Path("/tmp/b.json"))
    parsed = bench_gpu.parse_args(command[2:])
    assert (parsed.steps, parsed.budget_s, parsed.out, parsed.variants) == (30, 200, "/tmp/b.json", "defaults")
    assert parsed.steps // parsed.logging_steps >= 2  # a steady interval after the warm-up one
    assert [run["variant"] for run in bench_gpu.variants(parsed)] == ["defaults"]
    tier = gpu_check.tier_command(args, Path("j.xml"))
    assert tier[1:3] == ["-m", "pytest"] and any(tier[i : i + 2] == ["-m", "gpu"] for i in range(3, len(tier)))
    assert "tests/test_gpu.py" in tier and "tests/test_gpu_tier.py" not in tier  # the modules with gpu tests
    files = [arg for arg in tier if arg.startswith("tests/")]
    assert files[0] == "tests/test_bench_gpu.py" and files[1:] == sorted(files[1:])  # the longest test first


# ---------------------------------------------------------------- the default model's stand-in
def test_the_shipped_minilm_config_is_the_default_models(minilm_dir):
    assert json.loads(MINILM_CONFIG.read_text()) == json.loads((Path(minilm_dir) / "config.json").read_text())


def test_the_minilm_stand_in_has_the_real_models_shapes(minilm_dir, tmp_path):
    from transformers import AutoModel

    from cloudtrain import planning

    tokenizer_dir = conftest.train_bert_tokenizer(tmp_path / "tokenizer")  # as where the wheel is missing
    stand_in = conftest.minilm_stand_in(tmp_path / "stand-in", tokenizer_dir)
    shapes = [
        {k: v.shape for k, v in AutoModel.from_pretrained(d).state_dict().items()} for d in (minilm_dir, stand_in)
    ]
    assert shapes[0] == shapes[1]
    facts = [planning.model_facts(d, num_labels=3) for d in (minilm_dir, stand_in)]
    assert facts[0].num_params == facts[1].num_params


def test_the_fallback_tokenizer_tokenizes_as_bert(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(conftest.train_bert_tokenizer(tmp_path))
    config = json.loads(MINILM_CONFIG.read_text())
    assert tokenizer.pad_token_id == config["pad_token_id"] and len(tokenizer) <= config["vocab_size"]
    ids = tokenizer(" ".join(conftest.TOPICS["sports"] * 12))["input_ids"]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert len(ids) > 128 and tokenizer.unk_token_id not in ids  # the memory test's rows are full, real tokens


# ---------------------------------------------------------------- the supported torch range
def declared_torch() -> SpecifierSet:
    pyproject = (REPO / "pyproject.toml").read_text()
    (spec,) = re.findall(r'^\s*"torch([<>=!~][^"]*)"', pyproject, flags=re.M)
    return SpecifierSet(spec)


def test_the_declared_torch_range_admits_the_versions_the_suite_runs_on():
    spec = declared_torch()
    (minimum,) = [Version(s.version) for s in spec if s.operator == ">="]
    pinned = re.search(r"^torch==(\S+)", (REPO / "constraints.txt").read_text(), flags=re.M).group(1)
    installed = Version(torch.__version__).base_version
    assert minimum <= Version(GPU_MACHINE_TORCH) and all(v in spec for v in (GPU_MACHINE_TORCH, pinned, installed))
    assert f"`torch>={minimum}`" in (REPO / "docs" / "testing.md").read_text()  # the range the docs state


def test_this_torch_has_the_apis_the_lower_bound_is_chosen_for():
    from torch.distributed.fsdp import fully_shard  # noqa: F401  # FSDP2's public API (2.6)

    assert isinstance(torch.backends.cuda.matmul.fp32_precision, str)  # --tf32 (2.9)
    assert hasattr(torch.optim, "Muon")  # --optim muon (2.9)
    assert not torch.amp.GradScaler("cpu", enabled=False).is_enabled()  # the basic trainer's scaler


@pytest.mark.slow  # a minute or two: bench/gpu.py trains a tiny Llama through the application on CPU
def test_gpu_check_reads_bench_gpus_real_output(tmp_path):
    """bench/gpu.py's JSON as it writes it today (on CPU: no MFU, no peak memory) into the report."""
    from conftest import write_tab

    out = tmp_path / "gpu.json"
    command = [sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu", "--preset", "llama-8m"]
    command += ["--steps", "2", "--batch_size", "2", "--max_length", "64", "--logging_steps", "1"]
    command += ["--profile_steps", "1", "--vocab_size", "512", "--variants", "defaults"]
    command += ["--tab", str(write_tab(tmp_path / "t.tab")), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gpu_check = load_gpu_check()
    (row,) = gpu_check.bench_rows(json.loads(out.read_text()))
    assert row["name"] == "defaults" and row["tokens_per_s"] > 0 and row["mfu"] is None, row
    report = gpu_check.write_report(tmp_path / "report", FAKE_ENV, [], json.loads(out.read_text()), 1.0)
    assert report["problems"] == ["no test is marked gpu"]  # the benchmark's result was read
    assert f"| defaults | {row['tokens_per_s']:,.0f} | n/a | n/a |" in (tmp_path / "report" / "report.md").read_text()


def test_an_outer_timeout_takes_the_tiers_own_session_with_the_check(tmp_path):
    """gpu_check runs the tier in a session of its own (so that its interrupt reaches every xdist worker); the
    session script's `timeout` ended gpu_check alone and left that session holding the GPU into the next device
    call (found in review). SIGTERM to gpu_check now kills the tier's session first."""
    marker = tmp_path / "tier-pid"
    tier = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = str(REPO / "scripts" / "gpu_check.py")
    check = (
        f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('g', {script!r}); "
        "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g); "
        f"g.run_tier([sys.executable, '-c', {tier!r}], 0)"
    )
    parent = subprocess.Popen([sys.executable, "-c", check], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (marker.is_file() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = int(marker.read_text())
    parent.terminate()
    assert parent.wait(timeout=30) == 128 + 15
    for _ in range(50):  # the tier's process is gone with it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the tier's process {pid} outlived the check")
