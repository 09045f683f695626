"""bench/peft_bench.py, the PEFT comparison of `make bench`: full fine-tuning vs LoRA vs DoRA on a tiny BERT (R8)
and a tiny Llama (Grimm tales), a few steps each.

The benchmark runs end to end through `main` (options, tokenizing into the cache, the table, peft.md), its six runs
through the workers' own code (`train_once`) in this process: six fresh interpreters take minutes on a loaded 2-core
machine. One run also goes through a fresh interpreter, as `make bench` runs them all.
"""

from pathlib import Path

import peft_bench
import pytest

REPO = Path(__file__).resolve().parents[1]

DATA = (REPO / "data" / "reuters-r8" / "reuters-r8-train.tab", peft_bench.GRIMM / "train.txt")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not all(f.is_file() for f in DATA), reason="data not fetched (make setup)"),
]
STEPS, WARMUP = 3, 1


def tiny_argv(tiny_model_dir: str, tiny_llama_dir: str, out: Path) -> list[str]:
    return [
        "--steps",
        str(STEPS),
        "--warmup_steps",
        str(WARMUP),
        "--threads",
        "0",
        "--classifier_model",
        tiny_model_dir,
        "--classifier_max_length",
        "32",
        "--classifier_batch_size",
        "4",
        "--lm_model",
        tiny_llama_dir,
        "--lm_max_length",
        "32",
        "--lm_batch_size",
        "4",
        "--out",
        str(out),
    ]


def in_process(spec: dict, log) -> dict:
    """One worker run in this process, with a fresh accelerate state (one Accelerator per run, as in a process)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return peft_bench.train_once(spec)


@pytest.fixture(scope="module")
def bench(tiny_model_dir, tiny_llama_dir, tmp_path_factory):
    """(results, printed table, out folder) of the benchmark on the tiny models."""
    out = tmp_path_factory.mktemp("peft-bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peft_bench, "run_worker", in_process)
        results = peft_bench.main(tiny_argv(tiny_model_dir, tiny_llama_dir, out))
    return results, peft_bench.markdown(results), out


def test_the_table_has_a_row_per_method_for_each_model_and_is_written_to_peft_md(bench):
    results, text, out = bench
    assert (out / "peft.md").read_text() == text and (out / "peft.json").is_file()
    assert text.startswith(peft_bench.TITLE) and "nan" not in text.lower()
    for case in peft_bench.CASES:
        table = text.split(f"### {case}: ")[1].split("###")[0]
        rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
        assert [row.split(" | ")[0] for row in rows] == [f"| {m}" for m in peft_bench.METHODS], case
        assert rows[0].count("1.000x") == 5, rows[0]  # full fine-tuning against itself


def test_adapters_train_and_save_far_less_than_full_fine_tuning(bench):
    results, _, _ = bench
    for case, c in results["cases"].items():
        full, lora, dora = (c["methods"][m]["summary"] for m in peft_bench.METHODS)
        assert lora["trainable_parameters"] < dora["trainable_parameters"] < full["trainable_parameters"] / 2, case
        assert full["trainable_parameters"] == full["parameters"] and full["adapter"] is None, case
        assert "dropout=" in lora["adapter"], case
        for m in (lora, dora):
            assert m["checkpoint_bytes"] < full["checkpoint_bytes"] / 2, case
            assert m["output_bytes"] < full["output_bytes"] / 2 and m["output_file"] == "adapter_model.safetensors"
        assert full["output_file"] == "model.safetensors"
        # the checkpoint holds the optimizer's moments besides the weights
        assert full["checkpoint_bytes"] > 2.5 * full["output_bytes"], case
        for name, entry in c["methods"].items():
            run = entry["runs"][0]
            assert run["steps"] == STEPS + WARMUP and run["median_step_s"] > 0 and run["peak_rss_mb"] > 0, name
            assert run["mixed_precision"] in ("no", "bf16", "fp16"), name


def test_a_run_in_a_fresh_process_reports_the_same_sizes(bench, tmp_path):
    """`make bench`'s path: the worker in its own interpreter, its peak RSS its own."""
    results, _, _ = bench
    lora = results["cases"]["causal_lm"]["methods"]["lora"]["runs"][0]
    settings = peft_bench.PEFTSettings(**{**results["settings"], "cases": ["causal_lm"], "methods": ["lora"]})
    spec = {
        "case": "causal_lm",
        "method": "lora",
        "threads": 1,
        "warmup_steps": WARMUP,
        "options": peft_bench.options(settings, "causal_lm", "lora", settings.lm_model, str(tmp_path / "cache")),
    }
    with open(tmp_path / "run.log", "w") as log:
        fresh = peft_bench.run_worker(spec, log)
    for key in ("trainable_parameters", "output_bytes", "steps"):  # the checkpoint also holds timings
        assert fresh[key] == lora[key], key
    assert fresh["num_threads"] == 1 and 100 < fresh["peak_rss_mb"] < 4000
