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


# ---------------------------------------------------------------- the interleaved comparison (one process)


def test_interleave_reverses_the_order_each_round_and_its_ratios_are_x_over_y():
    """Two loops of known cost (one does twice the other's work) and a twin: the ratios say 2x and about 1x,
    and the blocks ran A B C, C B A, ..."""
    from interleave import interleave

    def work(n: int):
        return lambda: sum(i * i for i in range(n))

    orders: list[list[str]] = []
    result = interleave(
        {"light": work(20_000), "heavy": work(40_000), "twin": work(20_000)},
        [("light", "heavy"), ("twin", "light")], rounds=4, block=3, warmup=1,
        on_round=lambda r, got: orders.append(list(got)),
    )  # fmt: skip
    assert orders == [["light", "heavy", "twin"], ["twin", "heavy", "light"]] * 2
    assert 1.5 < result["ratios"]["light/heavy"]["steps_per_cpu_s"]["median"] < 2.7
    assert 0.7 < result["ratios"]["twin/light"]["steps_per_cpu_s"]["median"] < 1.4
    assert len(result["per_round_ratios"]["light/heavy"]["steps_per_s"]) == 4
    spread = result["ratios"]["light/heavy"]["steps_per_s"]
    assert spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]


def test_the_interleaved_bench_steps_both_loops_and_a_twin_in_one_process(tmp_path):
    """bench/t2i_interleaved.py in its quick mode: the reference, cloudtrain and cloudtrain's twin each took
    their warm-up and their blocks; the report carries the ratios, their spread and the load."""
    import t2i_interleaved

    report = t2i_interleaved.main(["--quick", "--rounds", "2", "--block", "1", "--warmup", "1", "--out", str(tmp_path)])
    assert set(report["loops"]) == {"diffusers-loop", "cloudtrain", "cloudtrain-twin"}
    assert set(report["ratios"]) == {"cloudtrain/diffusers-loop", "cloudtrain-twin/cloudtrain"}
    for pair in report["ratios"].values():
        assert 0.2 < pair["steps_per_cpu_s"]["median"] < 5  # the same workload: within a few times
    assert all(loop["cpu_s_per_step"] > 0 for loop in report["loops"].values())
    assert len(report["loadavg_start"]) == 3
    assert json.loads((tmp_path / "t2i-interleaved.json").read_text())["settings"]["rounds"] == 2
