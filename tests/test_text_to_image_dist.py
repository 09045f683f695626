"""--task text_to_image under real launches (the default accelerated trainer, gloo on CPU): on Stable Diffusion 3
(with rows repeated within a step), 2-process DDP and 2-process ZeRO-2 against one process at twice the batch, and
DDP's exact resume; SDXL (a UNet, both text encoders trained) under ZeRO-2; SDXL with aspect-ratio buckets. Six
launches of tiny pipelines (tests/t2i_fixtures.py): SD3's DDP and ZeRO-2 runs share one.

Each row's training draws (noise, timestep, latent sample, noise offset, flip, empty caption) come from the seed,
the step, the row's number in the dataset and its repetition in the step, so a global batch draws the same
whichever process holds each row: two processes at batch 4 and one at batch 8 log the same losses and end with
the same LoRA (up to the order of the gradient sums), and a resumed run draws what the uninterrupted one drew.
The draws and the data order are the same code for every pipeline; SD3 is the one the equality runs on (its loss
draws the most: timesteps by density)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import ENTRY
from safetensors.torch import load_file
from t2i_fixtures import build_tiny_sd3_pipeline, build_tiny_sdxl_pipeline, captioned_folder
from test_distributed import ONE_PROCESS, in_one_launch, launch, logged_losses, torchrun

pytestmark = pytest.mark.slow

LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> str:
    return str(captioned_folder(tmp_path_factory.mktemp("t2i-dist-data") / "squares", n=8))


def t2i_args(model: str, data: str, out: Path, *extra: str) -> list[str]:
    options = {
        "task": "text_to_image",
        "peft": "lora",
        "model_name_or_path": model,
        "train_data_dir": data,
        "output_dir": str(out),
        "resolution": "16",
        "center_crop": "true",
        "mixed_precision": "no",
        "report_to": "none",
        "learning_rate": "5e-3",
        "max_steps": "4",
        "logging_steps": "1",
        "eval_strategy": "steps",
        "eval_steps": "4",
        "eval_on_start": "true",
    }
    return [str(ENTRY), *[part for key, value in options.items() for part in (f"--{key}", value)], *extra]


def evaluations(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [e for e in lines if "eval/loss" in e]


def test_sd3_ddp_and_zero2_match_one_process_at_twice_the_batch_and_ddp_resumes_exactly(squares, tmp_path):
    # every draw in play: a random crop (keyed by the row's place in the run, the one process reading through a
    # loader worker), a flip, empty captions, SD3's logit-normal timesteps; 6 images in steps of 8 rows: each
    # step repeats 2 rows, which draw afresh (text_to_image.row_draws) and alike on both process counts
    model = str(build_tiny_sd3_pipeline(tmp_path / "tiny-sd3"))
    squares = str(captioned_folder(tmp_path / "wide", n=8, size=16, width=32))  # 17 places for each crop
    common = ["--random_flip", "true", "--proportion_empty_prompts", "0.3", "--center_crop", "false"]
    common += ["--max_train_samples", "6", "--max_sequence_length", "12", "--per_device_train_batch_size"]
    two_args = t2i_args(model, squares, tmp_path / "two", *common, "4", "--checkpointing_steps", "2")
    runs = {"two": two_args, "z2": t2i_args(model, squares, tmp_path / "z2", *common, "4", "--zero_stage", "2")}
    outputs = in_one_launch(torchrun(2), runs, tmp_path)  # DDP, then ZeRO-2 in the same 2 processes
    launch(ONE_PROCESS, *t2i_args(model, squares, tmp_path / "one", *common, "8", "--dataloader_num_workers", "1"))
    assert "2 process(es) on cpu" in outputs["two"] and "flow_matching loss" in outputs["two"]
    assert "ZeRO-2" in outputs["z2"]
    ddp, single = evaluations(tmp_path / "two"), evaluations(tmp_path / "one")
    assert [e["eval/samples"] for e in ddp] == [6, 6] == [e["eval/samples"] for e in single]  # each image once
    assert ddp[0]["eval/loss"] == pytest.approx(single[0]["eval/loss"], rel=1e-5)  # same weights, same draws
    assert ddp[-1]["eval/loss"] < ddp[0]["eval/loss"]
    losses = logged_losses(tmp_path / "two")
    assert len(losses) == 4 and len(set(losses)) == 4  # 4 steps, each its own draws
    assert losses == pytest.approx(logged_losses(tmp_path / "one"), rel=1e-5)  # the same draws, step by step
    assert ddp[-1]["eval/loss"] == pytest.approx(single[-1]["eval/loss"], rel=1e-5)
    trained, alone = load_file(tmp_path / "two" / LORA), load_file(tmp_path / "one" / LORA)
    assert set(trained) == set(alone)
    for name in trained:  # the gradient sums differ in order only: ~1e-6 of each tensor here
        assert (trained[name] - alone[name]).norm() <= 1e-4 * trained[name].norm(), name
    moved = [name for name in trained if name.endswith("lora_B.weight") and trained[name].abs().max() > 0]
    assert moved  # B starts at 0: the comparison is of trained weights
    # ZeRO-2 (DeepSpeed, the optimizer states and gradients partitioned): the same draws, the same steps
    assert logged_losses(tmp_path / "z2") == pytest.approx(losses, rel=1e-5)
    assert [e["eval/loss"] for e in evaluations(tmp_path / "z2")] == pytest.approx([e["eval/loss"] for e in single])
    sharded = load_file(tmp_path / "z2" / LORA)
    assert set(sharded) == set(alone)  # the transformer's LoRA in the names SD3's load_lora_weights reads
    for name in sharded:
        assert (sharded[name] - alone[name]).norm() <= 1e-4 * alone[name].norm(), name

    checkpoint = tmp_path / "two" / "checkpoints" / "checkpoint-2"
    resumed = launch(
        torchrun(2), *two_args, "--overwrite_output_dir", "true", "--resume_from_checkpoint", str(checkpoint)
    )
    assert "at step 2" in resumed.stdout and "other training data" not in resumed.stdout
    again = load_file(tmp_path / "two" / LORA)
    assert all(torch.equal(trained[name], again[name]) for name in trained)  # bit-identical
    assert logged_losses(tmp_path / "two") == losses  # steps 3 and 4 drew the same noise again


def test_an_sdxl_lora_with_both_text_encoders_trains_under_zero2_in_bf16_and_renders(squares, tmp_path):
    """SDXL's extra conditioning (pooled embedding, size ids) through DeepSpeed's bf16 engine on 2 processes (it
    casts the model and runs without autocast: a UNet fed fp32 latents stopped on "Float and BFloat16"); the saved
    LoRA gathers the denoiser's and both text encoders' adapters; the main process renders the validation prompts."""
    model = str(build_tiny_sdxl_pipeline(tmp_path / "tiny-sdxl"))
    extra = ["--zero_stage", "2", "--per_device_train_batch_size", "4", "--train_text_encoder", "true"]
    extra += ["--mixed_precision", "bf16"]
    extra += ["--validation_prompts", "a red square", "--validation_inference_steps", "2"]
    extra += ["--validation_guidance_scale", "1.0"]
    result = launch(torchrun(2), *t2i_args(model, squares, tmp_path / "xl", *extra))
    assert "ZeRO-2" in result.stdout and "text encoders" in result.stdout
    losses = [e["eval/loss"] for e in evaluations(tmp_path / "xl")]
    assert losses[-1] < losses[0], losses
    saved = load_file(tmp_path / "xl" / LORA)
    assert {name.split(".")[0] for name in saved} == {"unet", "text_encoder", "text_encoder_2"}
    assert sorted(p.name for p in (tmp_path / "xl" / "validation").glob("*.png")) == [
        "eval-step-000000.png",
        "eval-step-000004.png",
    ]


def test_sdxl_aspect_ratio_buckets_train_on_two_processes_one_bucket_a_step_and_resume_exactly(tmp_path):
    """Mixed-aspect images under --aspect_ratio_bucketing on 2 DDP processes: every step's micro-batches on both
    processes come from one bucket (a mixed batch could not stack), and a resumed run ends bit-identical."""
    from test_image_buckets import mixed_folder

    model = str(build_tiny_sdxl_pipeline(tmp_path / "tiny-sdxl"))
    data = str(mixed_folder(tmp_path / "mixed"))
    extra = ["--aspect_ratio_bucketing", "true", "--resolution", "32", "--per_device_train_batch_size", "2"]
    extra += ["--checkpointing_steps", "4", "--max_steps", "8", "--eval_steps", "8"]
    args = t2i_args(model, data, tmp_path / "ar", *extra)
    result = launch(torchrun(2), *args)
    assert "3 aspect-ratio buckets near 32px squared" in result.stdout  # 2:1 (48x16), 1:2 (16x48), 1:1 (32x32)
    losses = logged_losses(tmp_path / "ar")
    assert len(losses) == 8
    fixed = [e["eval/loss"] for e in evaluations(tmp_path / "ar")]
    assert fixed[-1] < fixed[0], fixed
    trained = load_file(tmp_path / "ar" / LORA)
    checkpoint = tmp_path / "ar" / "checkpoints" / "checkpoint-4"
    resumed = launch(torchrun(2), *args, "--overwrite_output_dir", "true", "--resume_from_checkpoint", str(checkpoint))
    assert "at step 4" in resumed.stdout and "other training data" not in resumed.stdout
    again = load_file(tmp_path / "ar" / LORA)
    assert all(torch.equal(trained[name], again[name]) for name in trained)
    assert logged_losses(tmp_path / "ar") == losses
