"""The stored (map-style) path resumed at another process count: its order is global (micro-batch b of an
epoch's order to process b % processes, through accelerate's own sharding), so with the same global batch a
step trains the same rows on 1 or 2 processes, the epoch's last step included, and a checkpoint of one layout
resumes under the other with the weights of the uninterrupted run within reduction tolerance.

The fast tests shard the sampler exactly as accelerate's prepared loader does (its BatchSamplerShard); the
slow one launches the application (2 processes x 1 accumulation against 1 x 2, a checkpoint of each resumed
under the other). It needs the lead's wiring of this issue (trainer passes the global batch to
train_dataloader; check_compatible accepts a replicated checkpoint with the same global batch)."""

import json
from pathlib import Path

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from conftest import ENTRY, lm_documents
from safetensors.torch import load_file
from test_streaming import run_entry
from torch.utils.data import BatchSampler

from cloudtrain.data.processing import EpochShuffleSampler, LengthGroupedSampler


def steps_of(sampler, micro: int, processes: int, accumulation: int) -> list[list[int]]:
    """Each optimizer step's rows, over all processes, as the prepared loaders of `processes` hand them out."""
    batches = BatchSampler(sampler, micro, drop_last=False)
    shards = [
        list(BatchSamplerShard(batches, processes, rank) if processes > 1 else batches) for rank in range(processes)
    ]
    assert len({len(s) for s in shards}) == 1  # every process takes as many micro-batches (else a collective hangs)
    per_process = len(shards[0])
    return [
        sorted(row for shard in shards for batch in shard[s : s + accumulation] for row in batch)
        for s in range(0, per_process, accumulation)
    ]


@pytest.mark.parametrize("rows", [23, 24, 3])
@pytest.mark.parametrize("grouped", [False, True])
def test_each_step_trains_the_same_rows_at_any_process_count(rows, grouped):
    """8 rows per step: 2 processes x 2 rows x 2 micro-batches, 1 x 2 x 4, 4 x 2 x 1; with 23 rows the epoch's
    last step is completed with its first rows, the same ones whatever the count (accelerate would otherwise
    complete each process's share from its own first rows); an epoch shorter than a step is repeated."""

    def sampler():
        if grouped:
            return LengthGroupedSampler([(i * 7) % 11 for i in range(rows)], 2, seed=5, chunk_batches=2, step_rows=8)
        return EpochShuffleSampler(rows, seed=5, step_rows=8)

    layouts = [(1, 4), (2, 2), (4, 1)]
    for epoch in (0, 1):
        orders = []
        for processes, accumulation in layouts:
            s = sampler()
            s.set_epoch(epoch)
            orders.append(steps_of(s, 2, processes, accumulation))
        assert orders[0] == orders[1] == orders[2]
        assert all(len(step) == 8 for step in orders[0]) and len(orders[0]) == -(-rows // 8)
        assert set().union(*orders[0]) == set(range(rows))  # every row of the epoch, once but for the completion


def test_without_the_global_batch_the_order_is_as_before():
    """No step_rows (the default): the plain permutation, nothing completed."""
    assert len(EpochShuffleSampler(23, seed=5)) == 23
    assert sorted(EpochShuffleSampler(23, seed=5)) == list(range(23))


def test_a_replicated_checkpoint_resumes_at_another_count_only_with_its_global_batch(tmp_path):
    """check_compatible (with the lead's wiring): 2 processes x 2 rows x 1 = 4 rows a step resume on 1 process at
    4 rows a step; at 2 they are refused in one line naming the product to give; a stream resumes at any batch;
    a ZeRO checkpoint stays at its layout."""
    from cloudtrain.checkpointing import check_compatible
    from cloudtrain.errors import UserError
    from cloudtrain.parallel.mesh import Mesh

    batch = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    meta = {
        "trainer": "AcceleratedTrainer",
        "num_processes": 2,
        "mesh": {"world": 2, "dp_replicate": 2},
        "batch": batch,
    }
    one = Mesh(world=1, dp_replicate=1)
    check_compatible(meta, tmp_path, "AcceleratedTrainer", one, global_rows=4)
    check_compatible(meta, tmp_path, "AcceleratedTrainer", one, global_rows=None)  # a stream
    with pytest.raises(UserError, match="took 4 rows per step .* this run takes 2: .* whose product is 4$"):
        check_compatible(meta, tmp_path, "AcceleratedTrainer", one, global_rows=2)
    zero = {**meta, "mesh": {"world": 2, "dp_shard": 2}}
    with pytest.raises(UserError, match="resume it the same way .*a ZeRO checkpoint cannot change"):
        check_compatible(zero, tmp_path, "AcceleratedTrainer", one, global_rows=4)


def test_an_fsdp_checkpoint_resumes_at_another_count_under_fsdp_only(tmp_path):
    """FSDP's sharded states (torch.distributed.checkpoint folders) are re-cut for any process count, so an FSDP
    run (`reshards`) reads them at another count with the same global batch; a run that is not FSDP, and a
    sharded checkpoint without those folders (ZeRO), are refused in one line."""
    from cloudtrain.checkpointing import DCP_STATES, check_compatible
    from cloudtrain.errors import UserError
    from cloudtrain.parallel.mesh import Mesh

    batch = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    meta = {"trainer": "AcceleratedTrainer", "num_processes": 2, "mesh": {"world": 2, "dp_shard": 2}, "batch": batch}
    one, four = Mesh(world=1), Mesh(world=4, dp_shard=4)
    with pytest.raises(UserError, match="a ZeRO checkpoint cannot change its process count"):
        check_compatible(meta, tmp_path, "AcceleratedTrainer", one, global_rows=4, reshards=True)
    for name in DCP_STATES:
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").touch()
    check_compatible(meta, tmp_path, "AcceleratedTrainer", one, global_rows=4, reshards=True)
    check_compatible(meta, tmp_path, "AcceleratedTrainer", four, global_rows=4, reshards=True)
    with pytest.raises(UserError, match="whose product is 1$"):
        check_compatible(meta, tmp_path, "AcceleratedTrainer", four, global_rows=8, reshards=True)
    with pytest.raises(UserError, match="resume it the same way .*under --fsdp true only"):  # this run is not FSDP
        check_compatible(meta, tmp_path, "AcceleratedTrainer", one, global_rows=4)
    single = {**meta, "num_processes": 1, "mesh": {"world": 1}}  # one FSDP process: read by FSDP runs only
    check_compatible(single, tmp_path, "AcceleratedTrainer", Mesh(world=2, dp_shard=2), global_rows=2, reshards=True)
    with pytest.raises(UserError, match="resume it the same way"):
        check_compatible(single, tmp_path, "AcceleratedTrainer", Mesh(world=2, dp_replicate=2), global_rows=2)


# ------------------------------------------------------------------ real launches (slow)
def lm_run_args(model_dir: str, train: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--task", "causal_lm", "--model_name_or_path", model_dir, "--train_file", str(train),
        "--output_dir", str(out), "--max_length", "32", "--per_device_train_batch_size", "2",
        "--learning_rate", "3e-3", "--logging_steps", "1", "--mixed_precision", "no", "--eval_strategy", "no",
        "--sample_max_new_tokens", "2", "--num_sample_prompts", "1", "--packing", "none",
        "--validation_split_percentage", "10", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_stored_rows_resume_at_another_process_count(tiny_llama_dir, tmp_path):
    """2 epochs of the stored rows at 8 rows per step (the epoch's last step completed): a checkpoint at step 3
    (mid-epoch) of 2 processes x 1 resumes on 1 process x 2 and the other way round; weights equal the
    uninterrupted run's within tolerance, and the same layout resumes bit-exactly. An FSDP checkpoint of 2
    processes resumes on 1 FSDP process likewise."""
    from test_distributed import ONE_PROCESS, in_one_launch, torchrun

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": t}) + "\n" for t in lm_documents(30, 3)))
    common = ["--num_train_epochs", "2", "--checkpointing_steps", "3", "--gradient_accumulation_steps"]
    # the uninterrupted 2-process runs in one launch
    straight = {name: ["2", *extra] for name, extra in (("two", []), ("fsdp_two", ["--fsdp", "true"]))}
    entry = [str(ENTRY)]  # in_one_launch's command lines start with the entry script
    commands = {
        name: entry + lm_run_args(tiny_llama_dir, train, tmp_path / name, *common, *e) for name, e in straight.items()
    }
    in_one_launch(torchrun(2), commands, tmp_path)

    def command(name: str, accumulation: str, resume_from: str | None = None, *extra: str) -> list[str]:
        """A run's command line; `resume_from`: the run whose mid-epoch checkpoint (step 3) it resumes."""
        checkpoint = tmp_path / str(resume_from) / "checkpoints" / "checkpoint-3"
        resume = ["--resume_from_checkpoint", str(checkpoint)] if resume_from else []
        return [*entry, *lm_run_args(tiny_llama_dir, train, tmp_path / name, *common, accumulation, *extra, *resume)]

    # each layout's resumes in a launch of their own, after a fresh run (a resume restores every state it uses)
    in_one_launch(ONE_PROCESS, {"one": command("one", "4"), "two_to_one": command("two_to_one", "4", "two")}, tmp_path)
    two = {"one_to_two": command("one_to_two", "2", "one"), "two_to_two": command("two_to_two", "2", "two")}
    in_one_launch(torchrun(2), two, tmp_path)
    fsdp = run_entry(torchrun(1), command("fsdp_two_to_one", "4", "fsdp_two", "--fsdp", "true")[1:])
    assert fsdp.returncode == 0, (fsdp.stdout[-2000:], fsdp.stderr[-3000:])  # FSDP's states, re-cut for one
    runs = ["one", "two_to_one", *two, "fsdp_two_to_one"]
    names = [*straight, *runs]
    steps = {name: json.loads((tmp_path / name / "train_results.json").read_text())["global_step"] for name in names}
    assert len(set(steps.values())) == 1 and steps["two"] > 4, steps  # step 3 is mid-epoch: 2 epochs of 3+ steps
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in names}
    pairs = [
        ("two_to_one", "one"),
        ("one_to_two", "two"),
        ("one", "two"),
        ("fsdp_two", "two"),
        ("fsdp_two_to_one", "one"),
    ]
    for resumed, straight in pairs:
        for key in weights[straight]:
            torch.testing.assert_close(weights[resumed][key], weights[straight][key], rtol=1e-4, atol=1e-5)
    assert all(torch.equal(weights["two_to_two"][k], weights["two"][k]) for k in weights["two"])
    # another batch per process: every process finds it, the main one says it (found in audit: a line each)
    refused = run_entry(torchrun(2), command("refused", "2", "two", "--per_device_train_batch_size", "1")[1:])
    lines = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and len(lines) == 1, (refused.stdout[-2000:], refused.stderr[-2000:])


def test_latest_counts_a_checkpoint_of_fewer_processes_as_held_by_the_extra_ones(tmp_path):
    """A 1-process checkpoint resumed with `latest` on 2 processes: process 1 wrote no part of it (no mark of its
    own), which made `latest` refuse the node as one that lost its files (found in audit); a process that did write
    a part and lacks its mark still lacks it."""
    from cloudtrain.checkpointing import MARKS, STATE_FILE
    from cloudtrain.resume import holds_files_of

    def checkpoint(name: str, writers: int, marks: list[int]) -> Path:
        path = tmp_path / name
        (path / MARKS).mkdir(parents=True)
        (path / STATE_FILE).write_text(json.dumps({"num_processes": writers}))
        for index in marks:
            (path / MARKS / str(index)).touch()
        return path

    one = checkpoint("checkpoint-10", 1, [0])
    assert holds_files_of(one, 0) and holds_files_of(one, 1) and holds_files_of(one, 3)
    two = checkpoint("checkpoint-20", 2, [0])  # process 1's part was never finished
    assert holds_files_of(two, 0) and not holds_files_of(two, 1)
    assert holds_files_of(two, 2)  # a third process: none of its own, and the node's part is complete


def test_a_checkpoint_of_another_sharding_engine_or_a_bare_load_error_is_one_line(tmp_path):
    """Found in audit: ZeRO and FSDP record the same mesh, so a ZeRO-2 checkpoint resumed under FSDP (or ZeRO-3)
    ended in a 200-line traceback; DeepSpeed's bare AssertionError (no message) broke the error's own wording;
    torch.distributed.checkpoint's CheckpointException is a BaseException that `except Exception` let through."""
    from torch.distributed.checkpoint.api import CheckpointException

    from cloudtrain.checkpointing import sharding_engine
    from cloudtrain.config import build_config
    from cloudtrain.errors import UserError
    from cloudtrain.resume import check_engine, load_failure

    fsdp, zero3 = build_config({"fsdp": "true"}), build_config({"zero_stage": "3"})
    assert (sharding_engine(fsdp), sharding_engine(zero3), sharding_engine(build_config({}))) == (
        "FSDP2",
        "ZeRO-3",
        "none",
    )
    check_engine({"engine": "FSDP2"}, tmp_path, fsdp)
    check_engine({}, tmp_path, fsdp)  # a checkpoint from before the record
    with pytest.raises(UserError, match=r"holds the states of ZeRO-2 and this run uses FSDP2: .* with --zero_stage 2,"):
        check_engine({"engine": "ZeRO-2"}, tmp_path, fsdp)
    with pytest.raises(UserError, match="holds the states of FSDP2 and this run uses ZeRO-3: .* with --fsdp true,"):
        check_engine({"engine": "FSDP2"}, tmp_path, zero3)
    assert str(load_failure(tmp_path, AssertionError())) == (
        f"checkpoint {tmp_path} could not be loaded (AssertionError); it may be damaged: pass another "
        "--resume_from_checkpoint"
    )
    assert not issubclass(CheckpointException, Exception)  # why Trainer.resume names it beside Exception
