"""--task dpo and --task reward under real launches, on 2 CPU processes: DDP against one process at twice the
batch and an exact resume mid-epoch (reward sums pending at the checkpoint included); ZeRO-1 with precomputed
reference log-probabilities against the live frozen copy; ZeRO-2 with precomputed reference log-probabilities
against ZeRO-3 with the live one, both with LoRA; LoRA under FSDP2 (the base, adapters disabled, as the reference)
against one process; a reward model under DDP against one process, resumed bit-exactly mid-epoch.

Launches are few (each start of 2 processes costs more than these tiny runs): the 1-process runs that the 2-process
ones must equal run one after another in one process (`one_process`, tests/dist_runs.py), and every uninterrupted
2-process run one after another in one launch (`two_process_runs`), each built once for both of `make test`'s
workers; a resume copies its run's folder first and keeps a launch of its own."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ENTRY, built_once, lm_documents
from safetensors.torch import load_file
from test_distributed import ONE_PROCESS, in_one_launch, launch, logged_losses, torchrun
from test_fsdp import grad_norms
from test_reward import PAIRS

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


FULL = ("--max_steps", "5", "--checkpointing_steps", "3", "--logging_steps", "2")  # full fine-tuning's runs
LORA = (  # the LoRA runs'
    *("--peft", "lora", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "2e-2"),
    *("--max_steps", "4", "--logging_steps", "1"),
)
TWO, FOUR = ("--per_device_train_batch_size", "2"), ("--per_device_train_batch_size", "4")


@pytest.fixture(scope="module")
def reward_data(tmp_path_factory) -> Path:
    """12 preference pairs with margins: 3 steps of 4 pairs an epoch."""
    data = tmp_path_factory.mktemp("reward-pairs") / "pairs.jsonl"
    rows = [
        {"prompt": q, "chosen": c, "rejected": r, "margin": 0.25 * (i % 3)} for i, (q, c, r) in enumerate(PAIRS * 2)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, chat_llama_dir, tiny_model_dir, pairs, reward_data, tmp_path_factory) -> dict:
    """What the 2-process runs must equal, 1 process x 4 pairs, one after another in one process: full fine-tuning
    with the frozen reference copy ("full"), LoRA with the base as the reference ("lora"), the reward model
    ("reward"). Their output folders by name; built once for both of `make test`'s workers (their inputs are
    the same, seeded)."""

    def build(root: Path) -> None:
        runs = {
            "full": dpo_args(tiny_llama_dir, pairs, root / "full", *FULL, *FOUR),
            "lora": dpo_args(chat_llama_dir, pairs, root / "lora", *LORA, *FOUR),
            "reward": reward_args(tiny_model_dir, reward_data, root / "reward", *FOUR),
        }
        lines = {name: [str(ENTRY), *argv] for name, argv in runs.items()}
        for name, stdout in in_one_launch(ONE_PROCESS, lines, root).items():
            (root / f"{name}.out").write_text(stdout)

    root = built_once(tmp_path_factory, "preference-one-process", build)
    return {name: root / name for name in ("full", "lora", "reward")}


def reward_args(model_dir: str, data, out, *extra: str) -> list[str]:
    return [
        *("--task", "reward", "--model_name_or_path", model_dir, "--output_dir", str(out)),
        *("--train_file", str(data), "--validation_file", str(data), "--margin_column", "margin"),
        *("--max_length", "32", "--learning_rate", "1e-2", "--warmup_ratio", "0", "--mixed_precision", "no"),
        *("--eval_strategy", "no", "--logging_steps", "1", "--num_train_epochs", "2", "--checkpointing_steps", "2"),
        *extra,
    ]


PRECOMPUTED = ("--precompute_reference", "true")


@pytest.fixture(scope="module")
def two_process_runs(tiny_llama_dir, chat_llama_dir, tiny_model_dir, pairs, reward_data, tmp_path_factory) -> Path:
    """The uninterrupted runs on 2 processes x 2 pairs, one after another in one launch (a launch's start,
    DeepSpeed imported in both processes, costs more than these few-step runs), built once for both of `make
    test`'s workers: "fsdp" (full fine-tuning under FSDP2, the copy sharded), "lora-fsdp" (LoRA under FSDP2), then
    under DDP "two" (full, the frozen copy) and "reward" (the reward model), then "z1" (full, ZeRO-1, precomputed
    reference), "z2" (LoRA, ZeRO-2, precomputed), "z3" (LoRA, ZeRO-3, the live base). Each run's output folder
    and its stdout <name>.out."""

    def build(root: Path) -> None:
        runs = {
            "fsdp": dpo_args(tiny_llama_dir, pairs, root / "fsdp", *FULL, *TWO, "--fsdp", "true"),
            "lora-fsdp": dpo_args(chat_llama_dir, pairs, root / "lora-fsdp", *LORA, *TWO, "--fsdp", "true"),
            "two": dpo_args(tiny_llama_dir, pairs, root / "two", *FULL, *TWO),
            "reward": reward_args(tiny_model_dir, reward_data, root / "reward", *TWO),
            "z1": dpo_args(tiny_llama_dir, pairs, root / "z1", *FULL, *TWO, "--zero_stage", "1", *PRECOMPUTED),
            "z2": dpo_args(chat_llama_dir, pairs, root / "z2", *LORA, *TWO, "--zero_stage", "2", *PRECOMPUTED),
            "z3": dpo_args(chat_llama_dir, pairs, root / "z3", *LORA, *TWO, "--zero_stage", "3"),
        }
        lines = {name: [str(ENTRY), *argv] for name, argv in runs.items()}
        for name, stdout in in_one_launch(torchrun(2), lines, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "preference-two-process-runs", build)


def assert_same_model(
    out, reference_out, name: str = "model.safetensors", atol: float = 1e-5, skip: tuple[str, ...] = ()
) -> None:
    a, b = load_file(out / name), load_file(reference_out / name)
    assert a.keys() == b.keys()
    for key in set(a) - set(skip):
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


def test_ddp_two_processes_match_one_process_and_resume_exactly(
    tiny_llama_dir, pairs, one_process, two_process_runs, tmp_path
):
    """Full fine-tuning with a frozen reference copy: 2 processes x 2 pairs give the update of 1 process x 4 (the
    loss is normalised by the global pair count). Logging every 2 steps with a checkpoint at step 3 leaves step 3's
    reward sums pending in the checkpoint: the resumed run's log at step 4 must still cover steps 3 and 4, and its
    weights and every logged number must equal the uninterrupted run's (two_process_runs's "two", copied here:
    the resume rewrites its folder)."""
    shutil.copytree(two_process_runs / "two", tmp_path / "two")
    two = (two_process_runs / "two.out").read_text()
    assert "2 process(es) on cpu" in two and two.count("reference model: a frozen copy") == 1
    assert_same_model(tmp_path / "two", one_process["full"])
    a = load_file(tmp_path / "two" / "model.safetensors")
    numbers = logged(tmp_path / "two")
    assert len(numbers) == 3 and numbers[-1]["train/rewards/margins"] > 0  # steps 2, 4, 5; it learns
    assert_same_numbers(numbers, logged(one_process["full"]), rel=1e-4)

    checkpoint = tmp_path / "two" / "checkpoints" / "checkpoint-3"
    assert (checkpoint / "task_state.json").is_file()
    resume = ("--overwrite_output_dir", "true", "--resume_from_checkpoint", str(checkpoint))
    resumed = launch(torchrun(2), str(ENTRY), *dpo_args(tiny_llama_dir, pairs, tmp_path / "two", *FULL, *TWO, *resume))
    assert "at step 3" in resumed.stdout
    again = load_file(tmp_path / "two" / "model.safetensors")
    assert all(torch.equal(a[name], again[name]) for name in a)
    assert_same_numbers(logged(tmp_path / "two"), numbers, rel=1e-12)


def test_zero2_with_a_precomputed_reference_matches_zero3_with_the_live_one(two_process_runs):
    """LoRA on 2 processes: ZeRO-2 with the reference's log-probabilities computed before training, ZeRO-3 with
    the base (adapters disabled) as the live reference inside the sharded engine (two_process_runs's "z2" and
    "z3"). Same model, pairs and batches: the same losses and rewards at every step, and the adapters trained."""
    z2_out, z3_out = two_process_runs / "z2", two_process_runs / "z3"
    zero2, zero3 = (two_process_runs / "z2.out").read_text(), (two_process_runs / "z3.out").read_text()
    assert "ZeRO-2" in zero2 and "precomputed" in zero2
    assert "ZeRO-3" in zero3 and "exact_match" in zero3
    z2, z3 = logged(z2_out), logged(z3_out)
    assert z2[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at zero: policy = reference
    assert z2[1]["train/rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # not after a step
    assert_same_numbers(z2, z3, rel=1e-3)
    for out in (z2_out, z3_out):
        adapter = load_file(out / "adapter_model.safetensors")
        assert any(".lora_B." in name and adapter[name].abs().max() > 0 for name in adapter)


def test_zero1_with_a_precomputed_reference_matches_one_process_with_the_frozen_copy(one_process, two_process_runs):
    """Full fine-tuning under ZeRO-1 on 2 processes x 2 pairs (two_process_runs's "z1"), the reference's
    log-probabilities computed once before training (no copy kept): the same losses, rewards and weights as 1
    process x 4 pairs with the live frozen copy."""
    out = two_process_runs / "z1"
    run = (two_process_runs / "z1.out").read_text()
    assert "ZeRO-1" in run and "precomputed" in run and "frozen copy" not in run
    numbers = logged(out)
    assert len(numbers) == 3 and numbers[0]["train/rewards/margins"] != pytest.approx(0.0, abs=1e-6)
    assert_same_numbers(numbers, logged(one_process["full"]), rel=1e-4)
    assert_same_model(out, one_process["full"])


def test_full_fine_tuning_under_fsdp2_with_the_copy_sharded_matches_one_process(one_process, two_process_runs):
    """Full fine-tuning under FSDP2 on 2 processes x 2 pairs (two_process_runs's "fsdp"), the frozen reference copy
    sharded as the policy: the same losses, rewards and weights as 1 process x 4 pairs with the whole copy."""
    out = two_process_runs / "fsdp"
    run = (two_process_runs / "fsdp.out").read_text()
    assert "2 process(es) on cpu (FSDP" in run and run.count("reference model: sharded as the policy") == 1
    assert_same_numbers(logged(out), logged(one_process["full"]), rel=1e-4)
    assert_same_model(out, one_process["full"])


def test_lora_under_fsdp2_with_the_base_as_reference_matches_one_process(one_process, two_process_runs):
    """LoRA under FSDP2 on 2 processes x 2 pairs (two_process_runs's "lora-fsdp"), the reference the sharded base
    with its adapters disabled: the same losses, rewards and adapter as 1 process x 4 pairs."""
    out = two_process_runs / "lora-fsdp"
    sharded = (two_process_runs / "lora-fsdp.out").read_text()
    assert "2 process(es) on cpu (FSDP" in sharded
    two, one = logged(out), logged(one_process["lora"])
    assert two[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at zero
    assert two[-1]["train/rewards/margins"] != pytest.approx(0.0, abs=1e-4)  # the adapters moved the policy
    assert_same_numbers(two, one, rel=1e-4)
    assert_same_model(out, one_process["lora"], "adapter_model.safetensors")


def margins(folder) -> list[float]:
    """r(chosen) - r(rejected) of every PAIRS pair under the reward model saved in `folder`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = (
        AutoModelForSequenceClassification.from_pretrained(folder).eval(),
        AutoTokenizer.from_pretrained(folder),
    )
    with torch.no_grad():
        scores = [
            model(**tokenizer([q, q], [c, r], return_tensors="pt", padding=True)).logits[:, 0] for q, c, r in PAIRS
        ]
    return [float(s[0] - s[1]) for s in scores]


def test_reward_model_under_ddp_matches_one_process_and_resumes_mid_epoch_exactly(
    tiny_model_dir, reward_data, one_process, two_process_runs, tmp_path
):
    """12 pairs, 4 a step (2 processes x 2, or 1 x 4): 3 steps an epoch, 2 epochs. The 2-process run's losses and
    weights (two_process_runs's "reward", copied here: the resume rewrites its folder) are the 1-process run's;
    resumed from step 4 (one step into the second, reshuffled epoch) it logs the same losses and saves the same
    weights, bit for bit."""
    two, one = tmp_path / "two", one_process["reward"]
    shutil.copytree(two_process_runs / "reward", two)
    run = (two_process_runs / "reward.out").read_text()
    assert "2 process(es) on cpu (DDP," in run  # not the FSDP2 or ZeRO of the runs before it in the launch
    losses = logged_losses(two)
    assert len(losses) == 6 and losses[-1] < losses[0]  # it learns
    assert losses == pytest.approx(logged_losses(one), rel=1e-5)
    assert grad_norms(two) == pytest.approx(grad_norms(one), rel=1e-4)  # a wrong normalisation would show here
    # Adam divides near-zero gradients by their own size, which lifts the reduction order's rounding to a share
    # of a step: within a tenth of one step (the learning rate). The head's bias is left out: the pairwise loss
    # does not see it (its gradient is zero but for rounding), so Adam walks it by rounding alone; the rewards'
    # differences, which the loss does see, are compared instead.
    assert_same_model(two, one, atol=1e-3, skip=("classifier.bias",))
    assert margins(two) == pytest.approx(margins(one), rel=1e-4, abs=1e-5)
    saved = load_file(two / "model.safetensors")

    checkpoint = two / "checkpoints" / "checkpoint-4"
    resume = ["--overwrite_output_dir", "true", "--resume_from_checkpoint", str(checkpoint)]
    resumed = launch(torchrun(2), str(ENTRY), *reward_args(tiny_model_dir, reward_data, two, *TWO, *resume))
    assert "at step 4" in resumed.stdout
    assert logged_losses(two) == losses  # the same curve, bit for bit
    again = load_file(two / "model.safetensors")
    assert all(torch.equal(again[name], saved[name]) for name in saved)
