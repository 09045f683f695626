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
    def cfg(**options):
        return build_config({"model_name_or_path": tiny_model_dir, "max_length": 256, **options})

    odd = remedies(cfg(per_device_train_batch_size=9, gradient_accumulation_steps=2), "forward")
    assert odd[0] == "--per_device_train_batch_size 3 --gradient_accumulation_steps 6 (the same global batch)"
    lean = cfg(per_device_train_batch_size=1, gradient_checkpointing=True, peft="lora")
    assert remedies(lean, "the optimizer step") == ["a shorter --max_length than 256"]
    assert remedies(cfg(per_device_eval_batch_size=64), "evaluation") == ["lower --per_device_eval_batch_size 64 to 32"]
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB")
    line = explain(cfg(), "forward and backward (the gradient all-reduce)", cuda)
    assert line.startswith("out of memory in forward and backward (asked for 2.50 GiB): ")
    assert is_out_of_memory(MemoryError()) and not is_out_of_memory(RuntimeError("shape mismatch"))


def test_a_failure_other_than_memory_keeps_its_traceback(tiny_model_dir):
    from cloudtrain.training.out_of_memory import said_in_one_line

    with pytest.raises(RuntimeError, match="shape mismatch"):
        with said_in_one_line(build_config({"model_name_or_path": tiny_model_dir}), lambda: "evaluation"):
            raise RuntimeError("shape mismatch")
