"""--task dpo under real launches, on 2 CPU processes: DDP against one process at twice the batch and an exact
resume mid-epoch (reward sums pending at the checkpoint included), then ZeRO-2 with precomputed reference
log-probabilities against ZeRO-3 with the live reference, both with LoRA."""

import json

import pytest
import torch
from conftest import ENTRY, lm_documents
from safetensors.torch import load_file
from test_distributed import launch, torchrun

pytestmark = pytest.mark.slow

REWARDS = ("train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/accuracies")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """train.jsonl (24 pairs: whole batches of 4, so no process pads a short last one) and validation.jsonl (4),
    explicit prompts with answers of uneven length (so token counts differ per pair)."""
    folder = tmp_path_factory.mktemp("dpo-pairs")
    chosen, rejected = lm_documents(28, seed=1), lm_documents(28, seed=2)
    rows = [
        json.dumps({"prompt": f"Tell me tale {i}.", "chosen": c, "rejected": r if r != c else r[::-1]}) + "\n"
        for i, (c, r) in enumerate(zip(chosen, rejected, strict=True))
    ]
    (folder / "train.jsonl").write_text("".join(rows[:24]))
    (folder / "validation.jsonl").write_text("".join(rows[24:]))
    return folder


@pytest.fixture(scope="module")
def chat_llama_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with chatml's tokens already in its tokenizer and embeddings: no run grows it (new rows are
    drawn at random, and ZeRO-3 draws them from another stream than ZeRO-2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.data.chat import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ChatFormat.setup(tokenizer, "chatml")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer))
    out = tmp_path_factory.mktemp("chat-llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def dpo_args(model_dir, pairs, out, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        *("--task", "dpo", "--model_name_or_path", model_dir, "--output_dir", str(out)),
        *("--train_file", str(pairs / "train.jsonl"), "--validation_file", str(pairs / "validation.jsonl")),
        *("--max_length", "96"),
        *("--learning_rate", "3e-3", "--warmup_ratio", "0", "--mixed_precision", "no", "--eval_strategy", "no"),
        *("--sample_max_new_tokens", "4", "--num_sample_prompts", "2"),
        *extra,
    ]


def logged(out) -> list[dict]:
    """Each logging step's loss and reward numbers."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("train/loss", *REWARDS)} for r in records if "train/loss" in r]


def assert_same_numbers(a: list[dict], b: list[dict], rel: float) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert list(x.values()) == pytest.approx(list(y.values()), rel=rel, abs=1e-7), (x, y)


def test_ddp_two_processes_match_one_process_and_resume_exactly(tiny_llama_dir, pairs, tmp_path):
    """Full fine-tuning with a frozen reference copy: 2 processes x 2 pairs give the update of 1 process x 4 (the
    loss is normalised by the global pair count). Logging every 2 steps with a checkpoint at step 3 leaves step 3's
    reward sums pending in the checkpoint: the resumed run's log at step 4 must still cover steps 3 and 4, and its
    weights and every logged number must equal the uninterrupted run's."""
    common = ["--max_steps", "5", "--checkpointing_steps", "3", "--logging_steps", "2"]
    two = launch(
        torchrun(2), *dpo_args(tiny_llama_dir, pairs, tmp_path / "two", *common, "--per_device_train_batch_size", "2")
    )
    launch(
        torchrun(1), *dpo_args(tiny_llama_dir, pairs, tmp_path / "one", *common, "--per_device_train_batch_size", "4")
    )
    assert "2 process(es) on cpu" in two.stdout and two.stdout.count("reference model: a frozen copy") == 1
    a, b = load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-5)
    numbers = logged(tmp_path / "two")
    assert len(numbers) == 3 and numbers[-1]["train/rewards/margins"] > 0  # steps 2, 4, 5; it learns
    assert_same_numbers(numbers, logged(tmp_path / "one"), rel=1e-4)

    checkpoint = tmp_path / "two" / "checkpoints" / "checkpoint-3"
    assert (checkpoint / "task_state.json").is_file()
    resumed = launch(
        torchrun(2),
        *dpo_args(
            tiny_llama_dir,
            pairs,
            tmp_path / "two",
            *common,
            "--per_device_train_batch_size",
            "2",
            "--overwrite_output_dir",
            "true",
            "--resume_from_checkpoint",
            str(checkpoint),
        ),  # fmt: skip
    )
    assert "at step 3" in resumed.stdout
    again = load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.equal(a[name], again[name]) for name in a)
    assert_same_numbers(logged(tmp_path / "two"), numbers, rel=1e-12)


def test_zero2_with_a_precomputed_reference_matches_zero3_with_the_live_one(chat_llama_dir, pairs, tmp_path):
    """LoRA on 2 processes: ZeRO-2 with the reference's log-probabilities computed before training, ZeRO-3 with
    the base (adapters disabled) as the live reference inside the sharded engine. Same model, pairs and batches:
    the same losses and rewards at every step, and the adapters trained."""
    common = [
        *("--peft", "lora", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "2e-2"),
        *("--max_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "2"),
    ]
    zero2 = launch(
        torchrun(2),
        *dpo_args(
            chat_llama_dir, pairs, tmp_path / "z2", *common, "--zero_stage", "2", "--precompute_reference", "true"
        ),
    )
    zero3 = launch(torchrun(2), *dpo_args(chat_llama_dir, pairs, tmp_path / "z3", *common, "--zero_stage", "3"))
    assert "ZeRO-2" in zero2.stdout and "precomputed" in zero2.stdout
    assert "ZeRO-3" in zero3.stdout and "exact_match" in zero3.stdout
    z2, z3 = logged(tmp_path / "z2"), logged(tmp_path / "z3")
    assert z2[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at zero: policy = reference
    assert z2[1]["train/rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # not after a step
    assert_same_numbers(z2, z3, rel=1e-3)
    for out in (tmp_path / "z2", tmp_path / "z3"):
        adapter = load_file(out / "adapter_model.safetensors")
        assert any(".lora_B." in name and adapter[name].abs().max() > 0 for name in adapter)
