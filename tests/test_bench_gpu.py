"""bench/gpu.py: its variants (data-driven, a missing option refused in one line), the report it renders, its
budget, its refusal without CUDA, and its --dry_run on CPU: the same code path as on a GPU, tiny."""

import json
import subprocess
import sys
from pathlib import Path

import gpu
import gpu_report
import pytest
from conftest import write_tab

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
GIB = 2**30


@pytest.fixture(scope="module")
def tab(tmp_path_factory) -> Path:
    return write_tab(tmp_path_factory.mktemp("corpus") / "tales.tab")


def test_refuses_politely_without_cuda():
    # Children of tests not marked gpu see no GPU (conftest), so this holds on every machine.
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--steps", "5"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in proc.stderr


def test_every_kernel_option_is_a_variant_between_the_defaults_and_the_floors():
    runs = gpu.variants(gpu.parse_args([]))
    assert [r["variant"] for r in runs] == ["defaults", *gpu.OPTIONS, "plain", "hf_trainer"]
    assert all(r["runner"] == "cloudtrain" for r in runs[: 1 + len(gpu.OPTIONS)])
    assert [r["options"] for r in runs[1 : 1 + len(gpu.OPTIONS)]] == list(gpu.OPTIONS.values())
    # --attention names the application's kernels: one run each, in place of the defaults and attention options
    named = gpu.variants(gpu.parse_args(["--attention", "sdpa,eager"]))
    cloudtrain = [r for r in named if r["runner"] == "cloudtrain"]
    assert [r["options"].get("attn_implementation") for r in cloudtrain][:2] == ["sdpa", "eager"]
    assert all("attn_implementation" not in r["options"] for r in cloudtrain[2:])
    assert [r["variant"] for r in gpu.variants(gpu.parse_args(["--variants", "plain,defaults"]))] == [
        "plain",
        "defaults",
    ]
    with pytest.raises(SystemExit, match="--variants takes"):
        gpu.variants(gpu.parse_args(["--variants", "plain,fastest"]))


def test_an_option_the_application_does_not_have_is_refused_in_one_line(tmp_path):
    spec = {"variant": "x", "runner": "cloudtrain", "options": {"no_such_kernel_option": True}}
    spec |= {"preset": "llama-8m", "tokenizer": "t", "train_file": "a", "validation_file": "b", "packing": "bfd"}
    spec |= {"max_length": 64, "batch_size": 2, "steps": 3, "profile_steps": 1, "logging_steps": 1}
    spec |= {"learning_rate": 1e-3, "mixed_precision": "no", "gradient_checkpointing": False}
    result = gpu.outcome(spec | {"output_dir": str(tmp_path)})
    assert result["status"] == "refused" and result["variant"] == "x"
    assert result["error"].startswith("refused: unknown option 'no_such_kernel_option'") and "\n" not in result["error"]


def fake_run(variant: str, runner: str, tokens_per_s: float, allocated: float) -> dict:
    profile = {"steps": 3, "ms_per_step": 250.0, "device_busy": 0.9, "data_wait": 0.01, "top": []}
    profile["shares"] = {"attention": 0.2, "matmul": 0.6, "optimizer": 0.05, "copy": 0.01, "other": 0.14}
    return {
        "variant": variant,
        "runner": runner,
        "options": {},
        "status": "ok",
        "tokens_per_s": tokens_per_s,
        "mfu": 0.3,
        "peak_memory": {"allocated": allocated * GIB, "reserved": (allocated + 1) * GIB},
        "loss_at_steps": 7.0,
        "eval_loss": 7.1,
        "profile": profile,
    }


def test_the_report_compares_with_the_plain_loop_and_the_planner():
    settings = {"preset": "llama-600m", "mixed_precision": "bf16", "packing": "bfd", "batch_size": 8}
    settings |= {"max_length": 2048, "steps": 50, "gradient_checkpointing": "false"}
    report = {"settings": settings, "device": "NVIDIA H100 80GB HBM3", "peak_flops": 989e12, "peak_note": None}
    report["corpus"] = {"train_documents": 957, "vocab_size": 7509}
    report["runs"] = [
        fake_run("defaults", "cloudtrain", 60000.0, 30),
        {"variant": "fused_cross_entropy", "runner": "cloudtrain", "options": {}, "status": "refused"}
        | {"error": "refused: unknown option 'fused_cross_entropy'"},
        fake_run("plain", "plain", 75000.0, 24),
        {"variant": "hf_trainer", "runner": "hf_trainer", "options": {}, "status": "skipped"}
        | {"error": "skipped: --budget_s 450"},
    ]
    report["planner"] = {"error": "unrecognized arguments: --task causal_lm"}
    gpu.compare(report)
    defaults, plain = report["runs"][0], report["runs"][2]
    assert defaults["vs_plain"] == pytest.approx(0.8) and plain["vs_plain"] == 1.0
    assert plain["memory_vs_defaults"] == pytest.approx(0.8) and defaults["memory_vs_defaults"] == 1.0
    text = gpu.render(report)
    assert "0.80x" in text and "60,000" in text and "989 TFLOP/s" in text and "30.0%" in text
    assert "fused_cross_entropy: refused: unknown option" in text and "hf_trainer: skipped" in text
    assert "planner estimate: n/a (unrecognized arguments" in text
    assert "profile defaults: 3 steps, 250 ms/step: attention 20% | matmul 60%" in text
    report["planner"] = {"total": 40 * GIB, "overhead": 4 * GIB, "without_overhead": 36 * GIB}
    report["planner"]["parts"] = {"parameters": 2 * GIB, "overhead": 4 * GIB}
    assert "defaults: measured peak allocated 30.00 GiB = 83% of the estimate without overhead" in gpu.render(report)


def test_each_variant_is_planned_with_its_own_options():
    runs = {r["variant"]: r for r in gpu.variants(gpu.parse_args([]))}
    planned = {name: gpu_report.planner_options(run) for name, run in runs.items()}
    assert planned["defaults"] == {} and planned["flex_attention"] == {"attn_implementation": "flex_attention"}
    assert planned["no_liger_kernels"] == planned["compile_layers"] == {"liger_kernels": "false"}  # auto: off compiled
    assert planned["plain"] == {
        "attn_implementation": "varlen",
        "fused_cross_entropy": "false",
        "liger_kernels": "false",
    }
    assert planned["hf_trainer"]["attn_implementation"] == "sdpa"
    ok = [fake_run(name, runs[name]["runner"], 5e4, 30) | {"options": runs[name]["options"]} for name in runs]
    estimates = {
        json.dumps(options, sort_keys=True): {"options": options, "without_overhead": (30 + len(options)) * GIB}
        for options in planned.values()
    }
    report = {"runs": ok}
    gpu_report.attach_planner(report, estimates)
    assert report["planner"]["options"] == {}  # the defaults' estimate heads the report
    mine = {r["variant"]: r["planner"]["without_overhead"] / GIB for r in report["runs"]}
    assert mine["defaults"] == 30 and mine["no_liger_kernels"] == 31 and mine["plain"] == 33
    report["planner"] |= {"total": 31 * GIB, "overhead": GIB, "parts": {}}
    lines = gpu_report._planner_lines({"gradient_checkpointing": "false"}, report["planner"], report["runs"])
    assert (
        "  no_liger_kernels: measured peak allocated 30.00 GiB = 97% of the estimate without overhead (31.00 GiB, "
        "planned with --liger_kernels false)" in lines
    )


def test_a_spent_budget_skips_the_variants_and_says_so(tab, tmp_path):
    out = tmp_path / "gpu.json"
    code = gpu.main(["--dry_run", "--tab", str(tab), "--out", str(out), "--budget_s", "1"])
    report = json.loads(out.read_text())
    assert code == 1 and report["runs"] and all(r["status"] == "skipped" for r in report["runs"])
    assert report["planner"] == {"error": "no variant ran"}
    assert "plain: skipped: --budget_s 1" in out.with_suffix(".md").read_text()


# The dry run's kernel-option variants take the defaults' code path (run_cloudtrain with one option more): the
# fresh-process run below takes the three runners and the planner, and these two go through that code in this
# process (a fresh interpreter each costs ~10 s of imports, more than the run).
OPTION_VARIANTS = ("varlen", "fused_cross_entropy")


@pytest.fixture
def on_cpu(monkeypatch):
    """This process sees no GPU, as a --device cpu variant's process does (gpu.run_one hides it)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.slow  # 4 fresh processes through the application (3 variants and the planner)
def test_dry_run_runs_every_variant_through_the_same_code_path_on_cpu(tab, tmp_path, on_cpu):
    out = tmp_path / "gpu.json"
    assert gpu.parse_args(["--dry_run"]).variants.split(",") == ["defaults", *OPTION_VARIANTS, "plain", "hf_trainer"]
    fresh = "defaults,plain,hf_trainer"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--dry_run", "--tab", str(tab), "--out", str(out)]
        + ["--variants", fresh],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert list(runs) == fresh.split(",")
    assert report["device"] == "cpu" and report["peak_flops"] is None
    for name in ("defaults", "plain", "hf_trainer"):
        run = runs[name]
        assert run["status"] == "ok", run
        assert run["tokens_per_s"] > 0 and run["mfu"] is None and run["peak_memory"] is None
        assert run["wall_s"] > run["fit_s"] > 0 and run["wall_s"] > run["startup_s"] > 0
        assert "error" in run["planner"] or run["planner"]["without_overhead"] > 0
        assert run["steps"] == 3 + 1 + 1 and run["eval_loss"] > 0 and run["flops_per_token"] > 0
        assert run["profile"]["steps"] == 1 and run["profile"]["shares"]["matmul"] > 0
        assert sum(run["profile"]["shares"].values()) == pytest.approx(1.0)
    # the floor's attention spans rows, the others' only documents
    assert runs["plain"]["flops_per_token"] > runs["defaults"]["flops_per_token"]
    assert runs["plain"]["vs_plain"] == 1.0 and runs["defaults"]["vs_plain"] > 0
    assert runs["defaults"]["row_fill"] > 0.8  # bfd fills its rows
    plan = report["planner"]
    assert "error" in plan or plan["total"] > plan["without_overhead"] > 0
    assert "vs plain" in proc.stdout and "profile defaults:" in proc.stdout
    assert out.with_suffix(".md").read_text().startswith("# bench/gpu.py")
    for run in option_runs(tab, tmp_path):  # each either runs or says why not in one line
        assert run["status"] == "ok" or run["error"].startswith("refused: "), run
        if run["status"] == "ok":
            assert run["steps"] == 3 + 1 + 1 and run["eval_loss"] > 0 and run["profile"]["steps"] == 1, run


def option_runs(tab: Path, tmp_path: Path) -> list[dict]:
    """The dry run's kernel-option variants through gpu.outcome (what each one's process runs), with the spec
    gpu.main gives it."""
    import lm_corpus
    from accelerate.state import AcceleratorState, GradientState

    args = gpu.parse_args(["--dry_run", "--tab", str(tab), "--variants", ",".join(OPTION_VARIANTS)])
    corpus = lm_corpus.prepare(args.vocab_size, tab)  # the one the fresh-process run prepared
    shared = gpu.shared_spec(args, corpus)
    runs = []
    for run in gpu.variants(args):
        AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per run, as in a process
        GradientState._reset_state()
        runs.append(gpu.outcome(run | shared | {"output_dir": str(tmp_path / run["variant"])}))
    assert [r["variant"] for r in runs] == list(OPTION_VARIANTS)
    return runs


# The variants in two runs that xdist's workers take at once: the compiled ones take longest (a tier's limit).
CUDA_GROUPS = {
    "floors": "defaults,plain,hf_trainer,varlen,fused_cross_entropy,no_liger_kernels,flash_attention_2",
    "compiled": "compile_layers,flex_attention",
}


def test_the_cuda_runs_take_every_variant_once():
    assert sorted(",".join(CUDA_GROUPS.values()).split(",")) == sorted(gpu.VARIANTS)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("group", list(CUDA_GROUPS))
def test_on_cuda_every_variant_reports_speed_mfu_memory_and_a_kernel_profile(group, tab, tmp_path):
    """The real path on a GPU, small: llama-8m, 20 steps of 4 x 256 tokens, bf16, bfd."""
    out = tmp_path / "gpu.json"
    command = [sys.executable, str(BENCH / "gpu.py"), "--preset", "llama-8m", "--steps", "20", "--batch_size", "4"]
    command += ["--max_length", "256", "--logging_steps", "5", "--vocab_size", "512", "--tab", str(tab)]
    command += ["--variants", CUDA_GROUPS[group]]
    proc = subprocess.run(command + ["--out", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {r["variant"]: r for r in report["runs"]}
    assert report["device"] != "cpu" and list(runs) == CUDA_GROUPS[group].split(",")
    for name, run in runs.items():
        assert run["status"] == "ok" or (run["status"] == "refused" and name not in ("defaults", "plain")), run
        if run["status"] != "ok":
            continue
        assert run["peak_memory"]["reserved"] >= run["peak_memory"]["allocated"] > 0
        assert run["profile"]["shares"]["matmul"] > 0 and 0 < run["profile"]["device_busy"] <= 1.05
        assert "error" not in run["planner"], run["planner"]
        if report["peak_flops"]:
            assert 0 < run["mfu"] < 1
    if group == "floors":
        assert all(runs[name]["status"] == "ok" for name in ("defaults", "plain", "hf_trainer")), runs
