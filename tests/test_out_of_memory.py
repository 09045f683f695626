"""Running out of memory ends a run in one line (exit 2, no traceback) naming what ran out and the options that
need less, where torch's traceback stood before.

A real allocation failure, not a raised stand-in: the application runs in a child whose address space is capped
(RLIMIT_AS), with a Llama whose 250k-token vocabulary makes one batch's logits far larger than the cap.
"""

import resource
import subprocess
import sys

import pytest
from conftest import ENTRY, REPO, _save_tiny_lm, lm_documents

from cloudtrain.config import build_config
from cloudtrain.training.out_of_memory import explain, is_out_of_memory, remedies

CAP = 8 * 2**30  # the child's address space; the run itself needs well under it, a big batch's logits 122 GiB


@pytest.fixture(scope="module")
def wide_vocab_llama(tmp_path_factory, lm_tokenizer_dir) -> str:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=250_000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    return _save_tiny_lm(tmp_path_factory.mktemp("wide-vocab-llama"), config, lm_tokenizer_dir)


def run_capped(*args: str) -> subprocess.CompletedProcess:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    return subprocess.run(
        [sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=300, cwd=REPO, preexec_fn=cap
    )


@pytest.mark.parametrize(
    "batches, said",
    [
        (
            ["--per_device_train_batch_size", "512"],
            "error: out of memory in forward and backward (asked for 122.1 GiB): --per_device_train_batch_size 256 "
            "--gradient_accumulation_steps 2 (the same global batch); or --gradient_checkpointing true; or --peft "
            "lora (or qlora on CUDA); `cloudtrain plan` with the same options estimates the memory each choice needs",
        ),
        (
            ["--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "128"],
            "error: out of memory in evaluation (asked for ",
        ),
    ],
    ids=["training step", "evaluation"],
)
@pytest.mark.slow
def test_running_out_of_memory_is_said_in_one_line(wide_vocab_llama, tmp_path, batches, said):
    train = tmp_path / "train.txt"
    train.write_text("\n\n".join(lm_documents(3000)))
    out = tmp_path / "out"
    args = ["--task", "causal_lm", "--model_name_or_path", wide_vocab_llama, "--train_file", str(train)]
    result = run_capped(
        *args, "--max_length", "256", "--max_steps", "2", "--mixed_precision", "no", "--report_to", "none",
        "--output_dir", str(out), *batches,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(said), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    # a micro-batch of 512 needs more than the machine has: the planner said so before training; one row fits
    assert ("warning: micro-batch 512 may not fit: the planner fits at most " in result.stdout) == (batches[1] == "512")
    assert not (out / "config.json").exists()  # no model saved after the failure


def test_remedies_keep_the_global_batch_and_fit_each_place(tiny_model_dir):
    from cloudtrain.tasks import build_task

    def cfg(**options):
        return build_config({"model_name_or_path": tiny_model_dir, "max_length": 256, **options})

    text, images = build_task(cfg()), build_task(cfg(task="text_to_image"))
    odd = remedies(cfg(per_device_train_batch_size=9, gradient_accumulation_steps=2), text, "forward")
    assert odd[0] == "--per_device_train_batch_size 3 --gradient_accumulation_steps 6 (the same global batch)"
    lean = cfg(per_device_train_batch_size=1, gradient_checkpointing=True, peft="lora")
    assert remedies(lean, text, "the optimizer step") == ["a smaller --max_length than 256"]
    assert remedies(lean, images, "the optimizer step") == ["a smaller --resolution than 512"]
    assert remedies(cfg(per_device_eval_batch_size=64), text, "evaluation") == [
        "lower --per_device_eval_batch_size 64 to 32"
    ]
    assert remedies(cfg(), text, "loading the model") == [
        "--peft lora (or qlora on CUDA)",
        "--zero_stage 3 or --fsdp true over several GPUs (the weights and states sharded)",
    ]
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB")
    line = explain(cfg(), text, "forward and backward (the gradient all-reduce)", cuda)
    assert line.startswith("out of memory in forward and backward (asked for 2.50 GiB): ")
    assert is_out_of_memory(MemoryError()) and not is_out_of_memory(RuntimeError("shape mismatch"))


def test_a_failure_other_than_memory_keeps_its_traceback(tiny_model_dir):
    from cloudtrain.tasks import build_task
    from cloudtrain.training.out_of_memory import said_in_one_line

    cfg = build_config({"model_name_or_path": tiny_model_dir})
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with said_in_one_line(cfg, build_task(cfg), lambda: "evaluation"):
            raise RuntimeError("shape mismatch")


@pytest.mark.parametrize(
    "torch_said, told",
    [
        (
            "DataLoader worker (pid 4242) is killed by signal: Killed. ",
            "a data loader worker (pid 4242) was killed by signal: Killed (most often the host's out-of-memory "
            "killer):",
        ),
        (
            "DataLoader worker (pid(s) 17, 18) exited unexpectedly",
            "a data loader worker (pid 17, 18) exited unexpectedly",
        ),
    ],
)
def test_a_loader_worker_killed_under_the_run_is_one_line(torch_said, told, tiny_model_dir):
    """Found in audit: kill -9 of a streaming run's loader worker (what the OOM killer does) ended in a traceback."""
    from cloudtrain.errors import UserError
    from cloudtrain.tasks import build_task
    from cloudtrain.training.out_of_memory import said_in_one_line

    cfg = build_config({"model_name_or_path": tiny_model_dir, "dataloader_num_workers": 2, "checkpointing_steps": 5})
    with pytest.raises(UserError) as said:
        with said_in_one_line(cfg, build_task(cfg), lambda: "training step 3"):
            raise RuntimeError(torch_said)
    assert str(said.value).startswith(told)
    assert str(said.value).endswith(
        "give fewer --dataloader_num_workers than 2, or more host memory; then --resume_from_checkpoint latest "
        "continues"
    )


def test_the_micro_batch_warning_speaks_only_where_the_planner_can_tell(tiny_model_dir, capsys, monkeypatch):
    """A micro-batch far beyond the machine gets the warning; the same run says nothing for a task the planner does
    not plan (the Python API's own module), for a model split over processes, or under ZeRO-3 (whose model
    building, on the main process alone, would wait for the others)."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset

    from cloudtrain.batch_size import warn_beyond_estimate
    from cloudtrain.parallel.mesh import Mesh
    from cloudtrain.tasks import build_task
    from cloudtrain.tasks.module_task import ModuleTask

    cfg = build_config({"model_name_or_path": tiny_model_dir, "per_device_train_batch_size": 10**7})
    monkeypatch.setattr("cloudtrain.batch_size.available_bytes", lambda device, local: round(1.05 * 2**30))
    rows = Dataset.from_dict({"input_ids": [[1] * 64] * 1000})  # more than fit: the micro-batch takes 1000
    data = SimpleNamespace(train=rows, label_names=["a", "b"])
    one = SimpleNamespace(mesh=Mesh(), device=torch.device("cpu"))
    warn_beyond_estimate(cfg, data, build_task(cfg), one)
    said = capsys.readouterr().out
    assert (
        said.startswith("warning: micro-batch 10000000 may not fit: the planner fits at most ")
        and "of 64 tokens" in said
    )
    own = ModuleTask(torch.nn.Linear(2, 1), [{"x": torch.zeros(2)}], cfg=cfg)
    warn_beyond_estimate(cfg, data, own, one)
    split = SimpleNamespace(mesh=Mesh(world=2, tp=2), device=torch.device("cpu"))
    warn_beyond_estimate(cfg, data, build_task(cfg), split)
    zero3 = build_config({"model_name_or_path": tiny_model_dir, "per_device_train_batch_size": 10**7, "zero_stage": 3})
    warn_beyond_estimate(zero3, data, build_task(zero3), one)
    assert capsys.readouterr().out == ""


def test_the_micro_batch_warning_weighs_the_rows_the_training_set_holds(tiny_model_dir, capsys, monkeypatch):
    """A micro-batch beyond the whole training set takes the set: 8 samples (109 rows) at
    --per_device_train_batch_size 4096 warned "may not fit: fits at most 1199" (found in audit). About 210 rows of
    64 tokens fit the tiny model in 1.05 GiB (185 per process of two): 300 rows warn on one process, not on two."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset

    from cloudtrain.batch_size import warn_beyond_estimate
    from cloudtrain.parallel.mesh import Mesh
    from cloudtrain.tasks import build_task

    cfg = build_config({"model_name_or_path": tiny_model_dir, "per_device_train_batch_size": 4096})
    monkeypatch.setattr("cloudtrain.batch_size.available_bytes", lambda device, local: round(1.05 * 2**30))
    cpu = torch.device("cpu")
    for count, mesh, warns in ((100, Mesh(), False), (300, Mesh(), True), (300, Mesh(world=2, dp_replicate=2), False)):
        data = SimpleNamespace(train=Dataset.from_dict({"input_ids": [[1] * 64] * count}), label_names=["a", "b"])
        warn_beyond_estimate(cfg, data, build_task(cfg), SimpleNamespace(mesh=mesh, device=cpu))
        said = capsys.readouterr().out
        assert said.startswith("warning: micro-batch 4096 may not fit") == warns, (count, mesh, said)
