"""`--per_device_train_batch_size auto` and `--global_batch_size` (cloudtrain.batch_size).

The search is driven with injected out-of-memory errors: in one process against a fake probe, and in two
real processes (gloo) probing the real model, one rank failing alone. The CPU path (the planner's
estimate, no probing), the accumulation that keeps the global batch, the choice stored in checkpoints
and the refusals run through the real application.
"""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, assert_each_refused, topic_run_args
from test_distributed import launch, torchrun
from test_training import run_tiny

from cloudtrain.batch_size import check, largest_divisor, probe_on_device, search
from cloudtrain.checkpointing import complete_checkpoints, read_state
from cloudtrain.config import build_config, resolve_options
from cloudtrain.errors import UserError
from cloudtrain.parallel.distributed import Sharding, sharding


def fake_probe(fits_up_to: int, probed: list[int]):
    def probe(size: int) -> None:
        probed.append(size)
        if size > fits_up_to:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} rows")

    return probe


class OneProcess:
    index, count, is_main = 0, 1, True

    @staticmethod
    def agree(flags: list[bool]) -> list[bool]:
        return flags


@pytest.mark.parametrize(
    "fits_up_to, start, cap, expected_probes",
    [
        (13, 2, 64, [2, 4, 8, 16, 12, 14, 13]),  # doubling from the estimate, then bisecting
        (13, 40, 64, [40, 20, 10, 15, 12, 13, 14]),  # the estimate fails: halving, then bisecting
        (100, 3, 20, [3, 6, 12, 20]),  # never beyond what each process needs per step
        (1, 8, 64, [8, 4, 2, 1]),
        (0, 8, 64, [8, 4, 2, 1]),  # nothing fits
    ],
)
def test_search_finds_the_largest_that_fits(fits_up_to, start, cap, expected_probes):
    probed, said = [], []
    found = search(fake_probe(fits_up_to, probed), start, cap, OneProcess.agree, said.append)
    assert found == min(fits_up_to, cap)
    assert probed == expected_probes
    assert len(said) == len(probed) and all(line.startswith("batch size: micro-batch ") for line in said)
    assert said[-1].endswith("out of memory" if probed[-1] > fits_up_to else "fits")


def test_search_out_of_memory_in_the_message_counts_and_other_errors_stop_it():
    def cublas(size: int) -> None:
        if size > 4:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    assert search(cublas, 4, 64, OneProcess.agree, lambda text: None) == 4

    def broken(size: int) -> None:
        raise KeyError("input_ids")

    with pytest.raises(UserError, match="batch-size search failed"):
        search(broken, 4, 64, OneProcess.agree, lambda text: None)


def test_a_failure_on_any_process_fails_the_probe_for_all():
    probed, other_rank_fits_up_to = [], 5  # the other process, as `agree` reports it
    current = {}

    def probe(size: int) -> None:
        current["size"] = size
        fake_probe(40, probed)(size)

    def agree(flags: list[bool]) -> list[bool]:
        return [flags[0] or current["size"] > other_rank_fits_up_to, flags[1]]

    assert search(probe, 2, 64, agree, lambda text: None) == 5


@pytest.mark.parametrize(
    "error, message",
    [
        (torch.OutOfMemoryError("CUDA out of memory"), "the model and its optimizer states do not fit on the GPU"),
        (
            RuntimeError("CUDA error: an illegal memory access"),
            "placing the model on the GPU for the batch-size search",
        ),
    ],
)
def test_a_model_that_cannot_be_placed_stops_before_the_first_probe(error, message):
    class Unplaceable(torch.nn.Linear):
        def to(self, *args, **kwargs):
            raise error

    probed = []
    with pytest.raises(UserError, match=message):
        probe_on_device(Unplaceable(2, 2), probed.append, torch.device("cpu"), 1, 2, 8, OneProcess(), print)
    assert probed == []


def test_largest_divisor():
    assert [largest_divisor(48, n) for n in (100, 48, 47, 20, 7, 1, 0)] == [48, 48, 24, 16, 6, 1, 1]


@pytest.mark.slow
def test_two_processes_agree_on_the_smallest(tiny_model_dir, topic_csvs, tmp_path):
    """Two real processes (gloo) probe the real model: rank 1 runs out of memory alone above 4, and then (a
    second search in the same launch) a real bug on rank 1 stops both ranks instead of leaving one waiting."""
    options = {
        "model_name_or_path": tiny_model_dir,
        "train_file": str(topic_csvs["train"]),
        "validation_file": str(topic_csvs["validation"]),
        "output_dir": str(tmp_path / "out"),
    }
    scenarios = [{"0": 32, "1": 4}, {"0": 32, "1": "error"}]
    script = str(REPO / "tests" / "dist_batch_size.py")
    launch(torchrun(2), script, json.dumps(options), json.dumps(scenarios), str(tmp_path), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for alone, bug in ranks:
        assert alone["found"] == 4 and alone["probed"] == [2, 4, 8, 6, 5]  # 8, 6, 5 failed on rank 1 only
        assert "batch-size search failed" in bug["error"] and bug["probed"] == [2, 4]


def test_auto_on_cpu_uses_the_planner_keeps_the_global_batch_and_stores_the_choice(
    tiny_model_dir, topic_csvs, tmp_path, capsys
):
    out = tmp_path / "run"
    results = run_tiny(
        tiny_model_dir,
        topic_csvs,
        out,
        per_device_train_batch_size="auto",
        global_batch_size=12,
        max_steps=2,
        checkpointing_steps="1",
    )
    printed = capsys.readouterr().out
    assert "batch size: the planner fits micro-batch" in printed
    assert "no probing (out-of-memory cannot be caught on cpu)" in printed
    assert "batch size: 12 per device x 1 process(es) x 1 accumulation = global batch 12" in printed
    args = json.loads((out / "args.json").read_text())
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (12, 1)
    assert results["train"]["train_samples"] == 2 * 12 and results["output_dir"] == str(out)
    checkpoint = complete_checkpoints(out / "checkpoints")[-1][1]
    stored = read_state(checkpoint)["batch"]
    assert stored == {"per_device_train_batch_size": 12, "gradient_accumulation_steps": 1, "group_by_length": False}

    # a resume takes the stored choice instead of searching again
    state = read_state(checkpoint)
    state["batch"] = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3}  # as a GPU search left it
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    run_tiny(
        tiny_model_dir,
        topic_csvs,
        out,
        per_device_train_batch_size="auto",
        global_batch_size=12,
        max_steps=3,
        resume_from_checkpoint="latest",
    )
    printed = capsys.readouterr().out
    assert "batch size: 4 per device, as stored in the checkpoint (no new search)" in printed
    assert "planner" not in printed
    assert "effective batch 12 (4 per device x 1 x 3 accumulation)" in printed


def test_global_batch_size_sets_the_accumulation(tiny_model_dir, topic_csvs, tmp_path, capsys):
    results = run_tiny(
        tiny_model_dir, topic_csvs, tmp_path / "run", per_device_train_batch_size=4, global_batch_size=16, max_steps=2
    )
    assert "effective batch 16 (4 per device x 1 x 4 accumulation)" in capsys.readouterr().out
    assert results["train"]["train_samples"] == 2 * 16
    again = resolve_options(str(tmp_path / "run" / "args.json"), {})  # the run's arguments work as a config file
    check(again, 1)
    assert (again.training.global_batch_size, again.training.gradient_accumulation_steps) == (16, 4)


def test_what_shards_is_read_from_flags_deepspeed_json_and_the_launcher(tmp_path, monkeypatch):
    """`auto` probes only a whole model on one device: ZeRO and FSDP are recognised wherever they are asked for."""
    assert sharding(build_config({})) == Sharding()
    assert sharding(build_config({"zero_stage": 2, "offload_optimizer": "cpu"})) == Sharding(2, True, False)
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    assert sharding(build_config({"deepspeed_config": str(ds_json)})) == Sharding(3, False, True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert sharding(build_config({})).zero_stage == 3
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert sharding(build_config({})) == Sharding(fsdp=True)


def test_refusals_are_one_line(tmp_path, capsys):
    """Through the command line in this process (conftest.assert_each_refused): exit 2, one `error:` line, no
    traceback, no output folder."""
    out = tmp_path / "out"
    auto_with_steps = {
        "per_device_train_batch_size": "auto",
        "global_batch_size": "16",
        "gradient_accumulation_steps": "2",
    }
    cases = {
        "not a multiple": ({"global_batch_size": "10", "per_device_train_batch_size": "4"}, "not a multiple of"),
        "disagree": ({"global_batch_size": "16", "gradient_accumulation_steps": "2"}, "disagree"),
        "auto with steps": (auto_with_steps, "leave out --gradient_accumulation_steps"),
        "not a number": ({"per_device_train_batch_size": "many"}, "expected a number or auto, got 'many'"),
        "zero": ({"global_batch_size": "0"}, "--global_batch_size must be at least 1"),
    }
    assert_each_refused(
        {name: ({**options, "output_dir": str(out)}, said) for name, (options, said) in cases.items()}, capsys, out
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_probes_the_gpu(tiny_model_dir, topic_csvs, tmp_path):
    command = [
        sys.executable,
        "-c",
        "import sys, cloudtrain.cli; sys.exit(cloudtrain.cli.main())",
        *topic_run_args(tiny_model_dir, topic_csvs, tmp_path / "out"),
        "--per_device_train_batch_size",
        "auto",
        "--global_batch_size",
        "64",
        "--max_steps",
        "2",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    probes = [line for line in result.stdout.splitlines() if line.startswith("batch size: micro-batch")]
    assert probes and all(line.endswith(("fits", "out of memory")) for line in probes)
    assert "global batch 64" in result.stdout


@pytest.mark.slow
def test_pair_tasks_probe_their_longest_pair(tiny_model_dir, tiny_llama_dir, tmp_path):
    """reward and dpo rows hold chosen_ids and rejected_ids, not input_ids: auto failed with a KeyError traceback
    (found in audit). The probe row is the pair with the most tokens, and a probe of it trains."""
    from test_reward import write_pairs

    from cloudtrain.batch_size import worst_case_probe
    from cloudtrain.pipeline import build_run

    pairs = write_pairs(tmp_path / "pairs.jsonl", margin=False)
    common = {"train_file": pairs, "validation_file": pairs, "mixed_precision": "no", "report_to": "none",
              "max_length": 64, "max_steps": 1}  # fmt: skip
    for task, model in (("reward", tiny_model_dir), ("dpo", tiny_llama_dir)):
        cfg = build_config({**common, "task": task, "model_name_or_path": model, "output_dir": str(tmp_path / task)})
        run = build_run(cfg)
        rows = run.data.train
        longest = max(len(c) + len(r) for c, r in zip(rows["chosen_ids"], rows["rejected_ids"], strict=True))
        row = run.task.probe_row(rows)
        assert len(row["chosen_ids"]) + len(row["rejected_ids"]) == longest
        probe, tokens = worst_case_probe(run.trainer.model, run.data, run.task, "no", torch.device("cpu"))
        assert tokens == max(len(row["chosen_ids"]), len(row["rejected_ids"]))
        probe(3)  # forward and backward of three copies of it
