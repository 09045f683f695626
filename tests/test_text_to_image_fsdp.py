"""--task text_to_image under FSDP2 (torch's fully_shard through accelerate, gloo on 2 CPU processes): a LoRA on
the UNet of Stable Diffusion against one process at twice the batch, validation images rendered with every process
in step; full fine-tuning of Stable Diffusion 3's transformer with its sharded checkpoint resumed exactly and a
whole StableDiffusion3Pipeline saved. Tiny pipelines (tests/t2i_fixtures.py); four launches.

The frozen VAE and text encoders are sharded with the rest (their layers and the root unit): nothing trains in
them, they are gathered when called. Each row's draws are keyed by the seed, the step and its number
(cloudtrain.tasks.text_to_image.row_draws), so FSDP2 at batch 4 on 2 processes draws what one process at batch 8
draws."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from t2i_fixtures import build_tiny_pipeline, build_tiny_sd3_pipeline, captioned_folder
from test_distributed import ONE_PROCESS, launch, logged_losses, torchrun
from test_text_to_image_dist import LORA, evaluations, t2i_args

pytestmark = pytest.mark.slow

RENDER = ["--validation_prompts", "a red square", "--validation_inference_steps", "2"]
RENDER += ["--validation_guidance_scale", "1.0"]


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory) -> str:
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("t2i-fsdp") / "tiny-sd"))


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> str:
    return str(captioned_folder(tmp_path_factory.mktemp("t2i-fsdp-data") / "squares", n=8))


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(int)


def test_an_fsdp2_lora_equals_one_process_at_twice_the_batch_renders_and_loads(tiny_sd, squares, tmp_path):
    from diffusers import StableDiffusionPipeline

    common = ["--random_flip", "true", "--noise_offset", "0.1", *RENDER]
    sharded = launch(
        torchrun(2), *t2i_args(tiny_sd, squares, tmp_path / "fsdp", *common, "--fsdp", "true",
                               "--per_device_train_batch_size", "4"),
    )  # fmt: skip
    launch(ONE_PROCESS, *t2i_args(tiny_sd, squares, tmp_path / "one", *common, "--per_device_train_batch_size", "8"))
    assert "2 process(es) on cpu (FSDP" in sharded.stdout
    fsdp, single = evaluations(tmp_path / "fsdp"), evaluations(tmp_path / "one")
    assert fsdp[-1]["eval/loss"] < fsdp[0]["eval/loss"]
    assert [e["eval/loss"] for e in fsdp] == pytest.approx([e["eval/loss"] for e in single], rel=1e-5)
    assert logged_losses(tmp_path / "fsdp") == pytest.approx(logged_losses(tmp_path / "one"), rel=1e-5)
    trained, alone = load_file(tmp_path / "fsdp" / LORA), load_file(tmp_path / "one" / LORA)
    assert trained and set(trained) == set(alone)
    for name in trained:  # gathered from the shards: the weights one process trained, up to the sums' order
        assert (trained[name] - alone[name]).norm() <= 1e-4 * trained[name].norm(), name
    # every process rendered in step; the main process's images are the ones one process renders
    grids = sorted((tmp_path / "fsdp" / "validation").glob("*.png"))
    assert [p.name for p in grids] == ["eval-step-000000.png", "eval-step-000004.png"]
    for grid in grids:
        assert np.abs(pixels(grid) - pixels(tmp_path / "one" / "validation" / grid.name)).max() <= 1

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.set_progress_bar_config(disable=True)
    draw = dict(num_inference_steps=2, height=16, width=16, output_type="np")
    before = pipe("a red square", generator=torch.Generator().manual_seed(0), **draw).images
    pipe.load_lora_weights(tmp_path / "fsdp")
    after = pipe("a red square", generator=torch.Generator().manual_seed(0), **draw).images
    assert abs(after - before).max() > 1e-3


def test_fsdp2_full_fine_tuning_of_sd3_saves_a_whole_pipeline_and_resumes_exactly(squares, tmp_path):
    """SD3's transformer (joint attention blocks, flow matching) trained in full under FSDP2: the loss falls, the
    gathered transformer is saved whole beside the frozen parts as loaded, and the sharded checkpoint resumes
    bit-identically."""
    from diffusers import StableDiffusion3Pipeline

    model, out = build_tiny_sd3_pipeline(tmp_path / "tiny-sd3"), tmp_path / "full"
    args = t2i_args(str(model), squares, out, "--fsdp", "true", "--peft", "none", "--learning_rate", "1e-3")
    args += ["--per_device_train_batch_size", "4", "--checkpointing_steps", "2", "--max_sequence_length", "12"]
    args += ["--mixed_precision", "bf16"]  # the frozen parts, loaded in bf16, were saved so beside the fp32 (review)
    full = launch(torchrun(2), *args)
    assert "(FSDP" in full.stdout and "flow_matching loss" in full.stdout
    losses = [e["eval/loss"] for e in evaluations(out)]
    assert losses[-1] < losses[0], losses
    denoiser = out / "transformer" / "diffusion_pytorch_model.safetensors"
    trained, base = load_file(denoiser), load_file(model / "transformer" / "diffusion_pytorch_model.safetensors")
    assert set(trained) == set(base) and any(not torch.equal(trained[k], base[k]) for k in base)
    vae = out / "vae" / "diffusion_pytorch_model.safetensors"  # frozen: saved as loaded
    frozen = load_file(model / "vae" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(v, frozen[k]) for k, v in load_file(vae).items())
    pipe = StableDiffusion3Pipeline.from_pretrained(out)  # a whole pipeline, whole tensors, one dtype
    assert {p.dtype for part in (pipe.transformer, pipe.vae, pipe.text_encoder) for p in part.parameters()} == {
        torch.float32
    }
    steps = logged_losses(out)

    checkpoint = out / "checkpoints" / "checkpoint-2"
    resumed = launch(torchrun(2), *args, "--overwrite_output_dir", "true", "--resume_from_checkpoint", str(checkpoint))
    assert "at step 2" in resumed.stdout
    again = load_file(denoiser)
    assert all(torch.equal(trained[k], again[k]) for k in trained)  # bit-identical
    assert logged_losses(out) == steps
