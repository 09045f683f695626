"""The benchmark end to end on the tiny model, and the optimizations it measures (length-grouped batches,
the AdamW kernels, MFU only where a peak is known)."""

import json

import pytest
import torch
from datasets import Dataset

from cloudtrain.config import build_config
from cloudtrain.data.processing import LengthGroupedSampler, ProcessedData, train_dataloader
from cloudtrain.observe.flops import peak_flops
from cloudtrain.training.optim import build_optimizer

RUNNERS = ("basic", "accelerated", "reference", "hf_trainer")


@pytest.mark.slow
def test_json_holds_every_runner_with_sane_values(bench_results):
    results = json.loads((bench_results / "latest.json").read_text())
    assert set(results["runners"]) == set(RUNNERS)
    tokens = set()
    for _name, entry in results["runners"].items():
        (run,) = entry["runs"]
        assert run["steps"] == 3
        assert run["train_samples_per_s"] > 0 and run["eval_samples_per_s"] > 0
        assert run["train_tokens_per_s"] > 2 * run["train_samples_per_s"]  # [CLS] + [SEP] at least
        assert run["peak_rss_mb"] > 100 and run["time_to_first_step_s"] > 0
        assert 0 <= run["accuracy"] <= 1 and run["eval_samples"] == 32
        assert entry["summary"]["train_samples_per_s"]["median"] == run["train_samples_per_s"]
        tokens.add(run["train_tokens"])
    assert tokens and len(tokens) == 1, "all four runners must see the same batches"
    assert results["runners"]["reference"]["vs_reference"] == pytest.approx(1.0)
    data = results["data_processing"]
    assert data["rows"] == 5485 and data["first_rows_per_s"] > 0 and data["cached_rows_per_s"] > 0
    ablation = results["ablations"]["group_by_length"]
    assert ablation["spec"]["group_by_length"] and ablation["vs_baseline"] > 0


@pytest.mark.slow
def test_markdown_and_chart(bench_results):
    table = (bench_results / "latest.md").read_text()
    for row in (
        "cloudtrain BasicTrainer",
        "cloudtrain AcceleratedTrainer",
        "reference PyTorch loop",
        "transformers.Trainer",
        "| group_by_length |",
        "rows/s",
    ):
        assert row in table
    assert "## Causal LM: sequence packing" in table  # the LM section of the same run (tests/test_bench_lm.py)
    assert "nan" not in table
    assert (bench_results / "latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def lengths_data(lengths: list[int]) -> ProcessedData:
    train = Dataset.from_dict(
        {
            "input_ids": [[1] * n for n in lengths],
            "attention_mask": [[1] * n for n in lengths],
            "labels": [0] * len(lengths),
        }
    )
    return ProcessedData(train=train, validation=train, test=None, label_names=["a", "b"], collator=None)


def test_length_grouped_order_is_a_function_of_seed_and_epoch():
    lengths = [(i * 37) % 61 + 2 for i in range(300)]
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=3, chunk_batches=4)
    first = list(sampler)
    assert sorted(first) == list(range(300))
    assert list(LengthGroupedSampler(lengths, batch_size=8, seed=3, chunk_batches=4)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first

    def padded(order):  # tokens a dynamically padded batch holds
        return sum(8 * max(lengths[i] for i in order[b : b + 8]) for b in range(0, len(order), 8))

    shuffled = torch.randperm(300, generator=torch.Generator().manual_seed(3)).tolist()
    assert padded(first) < 0.8 * padded(shuffled)


def test_group_by_length_option_picks_the_sampler():
    data = lengths_data([5, 9, 3, 7] * 10)
    cfg = build_config({"group_by_length": True})
    assert isinstance(train_dataloader(data, 4, 0, cfg.data).sampler, LengthGroupedSampler)
    assert not isinstance(train_dataloader(data, 4, 0).sampler, LengthGroupedSampler)


@pytest.mark.parametrize(
    "impl,flag", [("foreach", "foreach"), ("fused", "fused"), ("for_loop", "foreach"), ("auto", "fused")]
)
def test_adamw_implementation(impl, flag):
    model = torch.nn.Linear(4, 2)
    optimizer = build_optimizer(model, build_config({"adamw_implementation": impl}))
    assert optimizer.defaults[flag] is (impl != "for_loop")
    model(torch.randn(3, 4)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()  # the kernel runs on this device
    assert not torch.equal(model.weight, before)


def test_no_mfu_on_cpu():
    assert peak_flops(torch.device("cpu")) is None
