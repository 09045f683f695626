"""bench/pipeline_bench.py: 1F1B vs GPipe vs no pipeline, each a torchrun launch of the application.

The fast tests check the plan of launches, the bubble's theory and the report from a made-up result; the
slow one runs the bench in its smallest form (--quick: a tiny Llama, a synthetic corpus, 2 launches) and
checks that the pipelines train exactly what one process trains.
"""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pipeline_bench
import pytest
from conftest import write_tab

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def test_the_plan_runs_the_reference_ddp_and_both_schedules_at_the_same_global_batch():
    s = pipeline_bench.Settings()
    plan = {v.name: v for v in pipeline_bench.variants(s)}
    names = list(plan)
    assert names[0] == "basic, 1 process (reference)"
    assert "DDP, 2 processes" in plan and "GPipe, 2 processes, M=4" in plan and "1F1B, 2 processes, M=4" in plan
    assert {"1F1B, 2 processes, M=2", "1F1B, 2 processes, M=8"} <= set(plan)
    ddp = plan["DDP, 2 processes"]
    assert ddp.args[ddp.args.index("--per_device_train_batch_size") + 1] == str(s.batch_size // 2)
    assert all(v.processes == 2 and v.stages == 2 for v in plan.values() if v.schedule)
    quick = pipeline_bench.variants(pipeline_bench.parse_args(["--quick"])[0])
    assert [v.name for v in quick] == ["basic, 1 process (reference)", "1F1B, 2 processes, M=2"]
    interleaved = pipeline_bench.variants(replace(s, interleaved=True))[-1]
    assert interleaved.schedule == "interleaved_1f1b" and interleaved.stages == 4


def test_bad_batch_and_microbatch_combinations_are_refused(capsys):
    with pytest.raises(SystemExit):
        pipeline_bench.parse_args(["--batch_size", "12", "--microbatches", "8"])
    assert "multiple of --microbatches" in capsys.readouterr().err


def fake_run(step_s: float, losses: list[float], busy: float, processes: int) -> dict:
    steps = [{"wall": step_s, "busy": busy * step_s, "ready": 0.05 * step_s}] * 5
    rank = {"steps": steps, "peak_rss_mb": 700.0, "peak_rss_training_mb": 650.0}
    return {
        "launch_s": 20.0,
        "ranks": [{**rank, "rank": r} for r in range(processes)],
        "losses": losses,
        "eval_loss": losses[-1],
    }


def test_the_report_compares_the_measured_bubble_with_the_schedules_theory():
    s = replace(pipeline_bench.Settings(), sweep=[], two_threads_reference=False)
    plan = pipeline_bench.variants(s)
    assert [v.name for v in plan][-1] == "1F1B, 2 processes, M=4"
    losses = [8.0, 7.5, 7.0]
    results = {}
    for v in plan:
        run = fake_run(1.0 if v.processes == 1 else 0.625, losses, 0.95 if v.processes == 1 else 0.75, v.processes)
        results[v.name] = pipeline_bench.summarise(v, run, warmup=1)
    one_f = results["1F1B, 2 processes, M=4"]
    assert one_f["theory_bubble"] == {"over_busy": 0.25, "of_step": 0.2}
    assert one_f["ranks"][0]["blocked"] == pytest.approx(0.2)
    result = {
        "settings": {**pipeline_bench.asdict(s)},
        "corpus": {"name": "Grimm", "vocab_size": 4096, "train_documents": 957},
        "machine": {"cpus": 2, "torch": "2", "load_average_before": 1.0, "load_average_after": 2.0},
        "variants": results,
        "wall_s": 100.0,
    }
    pipeline_bench.add_ratios(result)
    text = pipeline_bench.markdown(result)
    assert "| 1F1B, 2 processes, M=4 | 625 | 0.62x | 1.60x | 700 / 700 | 75% / 5% / 20% ; 75% / 5% / 20% |" in text
    # busy 0.75 x 625 ms = 469 ms per rank; predicted 469 x (M + S - 1) / M = 586 ms; both ranks' busy 0.99x
    # reference busy 950 ms / predicted 586 ms = 1.62x without contention
    assert "| 1F1B, 2 processes, M=4 | 20% | 20% / 20% | 469 / 469 | 586 | 625 | 0.99x | +25% | 1.62x |" in text
    assert "**Measured, 1F1B at M=4.** The theory says 20% idle per stage." in text
    assert "**No pipeline (DDP).**" in text and "## Reading the figures" in text
    assert not re.search(r"\bnan\b", text.lower())


@pytest.mark.slow  # 2 torchrun launches (1 + 2 processes); each spends most of its time importing
def test_quick_bench_reports_every_row_and_pipelines_train_what_one_process_trains(tmp_path):
    tab = write_tab(tmp_path / "tales.tab")
    out = tmp_path / "results" / "pipeline.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "pipeline_bench.py"), "--quick", "--tab", str(tab), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    variants = result["variants"]
    reference = variants["basic, 1 process (reference)"]
    assert list(variants) == ["basic, 1 process (reference)", "1F1B, 2 processes, M=2"]
    for name, v in variants.items():
        assert len(v["ranks"]) == v["processes"], name
        assert v["median_step_s"] > 0 and v["speedup"] > 0, name
        for rank in v["ranks"]:
            # busy is a share of the wall time: a thread's CPU clock cannot run faster than the wall's
            # (the margin is for the two clocks being read a few microseconds apart)
            assert rank["peak_rss_mb"] > 100 and rank["steps_timed"] >= 2 and 0 < rank["busy"] <= 1.05, (name, rank)
        assert len(v["losses"]) == result["settings"]["steps"] and all(math.isfinite(x) for x in v["losses"])
        # fp32, the same rows in the same order at the same global batch: the same training, up to rounding
        assert v["losses"] == pytest.approx(reference["losses"], rel=1e-4), name
        assert v["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-4), name
        if v["schedule"]:
            assert v["theory_bubble"]["over_busy"] == pytest.approx(1 / 2)  # (S - 1) / M with S = M = 2
    text = out.read_text()
    for name in variants:
        assert f"| {name} |" in text
    assert "## The bubble" in text and not re.search(r"\bnan\b", text.lower())
    assert text in proc.stdout
