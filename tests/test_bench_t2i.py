"""bench/t2i_bench.py in its quick mode: cloudtrain's --task text_to_image and the loop written to match diffusers'
example script, each in a fresh process as `make t2i-bench` runs them, a few steps on a tiny pipeline. Checks the
report, not the speed (figures belong to the bench): both trained the same steps with the same LoRA, the ratios
are the two runs' own, and the losses are of one problem. About a minute on a loaded 2-core machine."""

import json
import math

import pytest
import t2i_bench

pytestmark = pytest.mark.slow
RUNNERS = ["diffusers-loop", "cloudtrain"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("t2i-bench")
    return t2i_bench.main(["--quick", "--runners", ",".join(RUNNERS), "--out", str(out)]), out


def test_both_runners_trained_the_same_steps_with_the_same_adapter(bench):
    results, _ = bench
    steps = t2i_bench.QUICK["warmup_steps"] + t2i_bench.QUICK["steps"]
    runners = results["runners"]
    assert list(runners) == RUNNERS
    for name, m in runners.items():
        assert m["steps"] == steps and len(m["losses"]) == steps, name
        assert all(math.isfinite(loss) and loss > 0 for loss in m["losses"]), name
        assert m["median_step_s"] > 0 and m["median_cpu_step_s"] > 0, name
        assert m["peak_rss_mb"] > 100 and m["num_threads"] == 1, name
    reference, ours = runners["diffusers-loop"], runners["cloudtrain"]
    assert ours["trainable_parameters"] == reference["trainable_parameters"] > 0  # rank and targets match
    # one problem: a random denoiser's noise-prediction loss starts near 1 for both
    assert 0.5 < ours["first_losses_mean"] / reference["first_losses_mean"] < 2


def test_the_ratios_are_of_this_run_and_the_report_names_the_reference_honestly(bench):
    results, out = bench
    ours, ref = results["runners"]["cloudtrain"], results["runners"]["diffusers-loop"]
    ratios = results["vs_reference"]["cloudtrain"]
    assert ratios["steps_per_s"] == pytest.approx(ours["steps_per_s"] / ref["steps_per_s"])
    assert ratios["peak_rss_mb"] == pytest.approx(ours["peak_rss_mb"] / ref["peak_rss_mb"])
    assert ratios["cpu_steps_per_s"] == pytest.approx(ref["median_cpu_step_s"] / ours["median_cpu_step_s"])
    text = (out / "t2i.md").read_text()
    assert "the script itself is not shipped in the package" in text and "nan" not in text.lower()
    row = next(line for line in text.splitlines() if line.startswith("| cloudtrain |"))
    assert f"| {ratios['steps_per_s']:.2f}x |" in row and f"| {ratios['peak_rss_mb']:.2f}x |" in row
    saved = json.loads((out / "t2i.json").read_text())
    assert saved["settings"]["steps"] == t2i_bench.QUICK["steps"] and len(saved["runs"]["cloudtrain"]) == 1
