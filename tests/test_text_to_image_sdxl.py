"""--task text_to_image on an SDXL-shaped pipeline (tests/t2i_fixtures.py: two CLIP text encoders, a text_time
UNet): the conditioning matches StableDiffusionXLPipeline's, each row carries its size ids, a LoRA (with the text
encoders') trains, lowers the loss, loads into the pipeline by load_lora_weights and changes its output, and the
validation images render. The last test is the SDXL-shaped GPU run (real UNet shapes, random weights)."""

import json
import time
from pathlib import Path

import pytest
import torch
from t2i_fixtures import PROMPT, build_tiny_sdxl_pipeline, captioned_folder, options, square

from cloudtrain import train
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.models.diffusion import load_text_to_image_model
from cloudtrain.tasks.text_to_image import TextToImageTask

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny layers run faster on one

LORA_FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory) -> str:
    return str(build_tiny_sdxl_pipeline(tmp_path_factory.mktemp("t2i-xl") / "tiny-sdxl"))


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> str:
    return str(captioned_folder(tmp_path_factory.mktemp("t2i-xl-data") / "squares"))


def xl_pipeline(path: str):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe, prompt: str = PROMPT):
    kwargs = dict(num_inference_steps=2, height=16, width=16, output_type="np", guidance_scale=1.0)
    return torch.from_numpy(pipe(prompt, generator=torch.Generator().manual_seed(0), **kwargs).images)


def test_the_prompt_conditioning_is_the_sdxl_pipelines(tiny_sdxl, tmp_path):
    """Both encoders' penultimate hidden states side by side, and the second's pooled embedding: what
    StableDiffusionXLPipeline.encode_prompt gives the UNet at inference."""
    cfg = build_config(options(tiny_sdxl, tmp_path / "out"))
    task = TextToImageTask(cfg)
    tokenizer = task.load_tokenizer(cfg)
    assert task.tokenizer_2 is not None
    model = load_text_to_image_model(cfg, tiny_sdxl).eval()
    assert model.xl
    tokens = task_tokens(tokenizer, task.tokenizer_2, PROMPT)
    with torch.no_grad():
        hidden, pooled = model.encode_prompts(tokens["input_ids"][None], tokens["input_ids_2"][None])
        expected, _, expected_pooled, _ = xl_pipeline(tiny_sdxl).encode_prompt(
            PROMPT, device="cpu", do_classifier_free_guidance=False
        )
    assert hidden.shape == (1, 16, 32) and pooled is not None and pooled.shape == (1, 16)
    torch.testing.assert_close(hidden, expected)
    torch.testing.assert_close(pooled, expected_pooled)


def task_tokens(tokenizer, tokenizer_2, caption: str) -> dict:
    from cloudtrain.tasks.text_to_image import _tokens

    return _tokens(tokenizer, tokenizer_2, caption)


def test_each_row_carries_its_size_ids_and_the_unet_reads_them(tiny_sdxl, tmp_path):
    folder = tmp_path / "wide"
    folder.mkdir()
    square((200, 30, 30)).resize((40, 20)).save(folder / "0.png")  # 40 wide, 20 high
    (folder / "0.txt").write_text(PROMPT)
    cfg = build_config(options(tiny_sdxl, tmp_path / "out", train_data_dir=str(folder), center_crop=True))
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    row = data.train[0]
    # resized to 32x16, the centre crop 8 pixels from the left: (height, width, top, left, target height, width)
    assert row["time_ids"].tolist() == [20, 40, 0, 8, 16, 16]
    assert {"input_ids", "input_ids_2", "attention_mask"} <= set(row)

    model = load_text_to_image_model(cfg, tiny_sdxl).eval()
    batch = data.collator([row])
    batch.pop("row")
    fixed = {
        "noise": torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)),
        "timesteps": torch.tensor([500]),
    }
    with torch.no_grad():
        loss = model(**batch, **fixed)
        moved = model(**{**batch, "time_ids": batch["time_ids"] + 64}, **fixed)
    assert (loss - moved).abs().item() > 1e-6  # the size ids condition the prediction


def test_a_resolution_off_the_vae_factor_is_refused_in_one_line(tiny_sdxl, squares, tmp_path):
    with pytest.raises(UserError) as refused:
        train(options(tiny_sdxl, tmp_path / "out", train_data_dir=squares, resolution=15))
    assert "--resolution 15 is not divisible by 2" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def sdxl_run(tiny_sdxl, squares, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("t2i-xl-run") / "lora"
    return train(
        options(
            tiny_sdxl, out, train_data_dir=squares, peft="lora", lora_r=4, train_text_encoder=True, max_steps=30,
            learning_rate=5e-3, per_device_train_batch_size=6, eval_on_start=True, validation_steps=30,
            validation_prompts=[PROMPT, "a blue square"], validation_guidance_scale=1.0,
        )
    )  # fmt: skip


def test_an_sdxl_lora_trains_and_lowers_the_fixed_noise_loss(sdxl_run):
    out = Path(sdxl_run["output_dir"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(losses) == 2 and losses[-1] < losses[0] * 0.97, losses


def test_the_sdxl_lora_holds_both_text_encoders_and_changes_the_pipelines_output(sdxl_run, tiny_sdxl):
    from safetensors.torch import load_file

    out = Path(sdxl_run["output_dir"])
    saved = load_file(out / LORA_FILE)
    assert {name.split(".")[0] for name in saved} == {"unet", "text_encoder", "text_encoder_2"}
    pipe = xl_pipeline(tiny_sdxl)
    before = draw(pipe)
    pipe.load_lora_weights(out)
    assert (draw(pipe) - before).abs().max() > 1e-3


def test_sdxl_validation_images_render_into_grids(sdxl_run):
    out = Path(sdxl_run["output_dir"])
    assert sorted(p.name for p in (out / "validation").glob("*.png")) == [
        "eval-step-000000.png",
        "eval-step-000030.png",
    ]


# ---------------------------------------------------------------- the SDXL-shaped run on a GPU

SDXL_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]


def build_sdxl_shaped_pipeline(out: Path) -> Path:
    """SDXL base 1.0's shapes (UNet 2.6B parameters, CLIP ViT-L and OpenCLIP bigG text encoders, the 4-block
    VAE) with random weights, saved in bf16; the tokenizer is the tests' character vocabulary at 77 tokens."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from t2i_fixtures import SPECIAL, write_clip_tokenizer
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = write_clip_tokenizer(out.parent / "sdxl-vocab", max_length=77)
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL))
    special = {"bos_token_id": ids[0], "eos_token_id": ids[1], "pad_token_id": ids[1], "vocab_size": len(tokenizer)}
    clip_l = CLIPTextConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, hidden_act="quick_gelu",
        **special,
    )  # fmt: skip
    clip_g = CLIPTextConfig(
        hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20, hidden_act="gelu",
        projection_dim=1280, **special,
    )  # fmt: skip
    unet = UNet2DConditionModel(
        sample_size=128,
        block_out_channels=(320, 640, 1280),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )
    vae = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        sample_size=1024,
        scaling_factor=0.13025,
    )
    pipeline = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(clip_l),
        text_encoder_2=CLIPTextModelWithProjection(clip_g),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
    )
    pipeline.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.gpu
def test_an_sdxl_shaped_lora_run_at_1024_in_bf16_prints_its_speed_and_memory(tmp_path):
    """The seed recipe's LoRA (rank 128 on its eight targets) on SDXL's real shapes at 1024px, a few steps;
    the figures it prints are this GPU's (random weights train as fast as real ones)."""
    model = build_sdxl_shaped_pipeline(tmp_path / "sdxl-shaped")
    data = captioned_folder(tmp_path / "squares", n=4, size=1024)
    torch.cuda.reset_peak_memory_stats()
    steps = 6
    start = time.perf_counter()
    results = train(
        options(
            str(model), tmp_path / "out", train_data_dir=str(data), resolution=1024, center_crop=True,
            peft="lora", lora_r=128, lora_alpha=128, lora_target_modules=SDXL_LORA_TARGETS, mixed_precision="bf16",
            gradient_checkpointing=True, max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-4,
            lr_scheduler_type="constant_with_warmup", warmup_steps=2, eval_strategy="no",
        )
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    out = Path(results["output_dir"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["train/step_time_s"] for r in records if "train/step_time_s" in r]
    peak = torch.cuda.max_memory_allocated() / 2**30
    speed = f"{1 / (sum(step_times) / len(step_times)):.2f} steps/s" if step_times else f"{steps / elapsed:.2f} steps/s"
    print(f"SDXL-shaped LoRA r128, 1024px, bf16, batch 1: {speed} (run {elapsed:.0f} s with loading); "
          f"peak {peak:.1f} GiB on {torch.cuda.get_device_name()}")  # fmt: skip
    assert (out / LORA_FILE).is_file()
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses and all(loss == loss for loss in losses)  # no NaN in bf16


def test_the_sdxl_recipe_holds_the_seed_settings():
    from cloudtrain.config.parse import load_config_file

    cfg = build_config(load_config_file(str(Path(__file__).parents[1] / "configs" / "text_to_image_sdxl_lora.yaml")))
    m, ic = cfg.model, cfg.images
    assert (m.peft, m.lora_r, m.lora_target_modules) == ("lora", 128, SDXL_LORA_TARGETS)
    assert (ic.resolution, ic.center_crop, ic.instance_prompt) == (1024, True, "a photo of sks person")
    assert (cfg.training.lr_scheduler_type, cfg.training.mixed_precision) == ("constant_with_warmup", "fp16")
    assert ic.validation_prompts and cfg.distributed.zero_stage == 2


def test_sdxl_dreambooth_on_cached_latents_and_embeddings_trains_in_full_and_saves_a_pipeline(tiny_sdxl, tmp_path):
    """The cached path keeps the pooled embeddings and each row's size ids (the class rows' too); empty captions
    replace both encoders' states; a fully trained SDXL saves a StableDiffusionXLPipeline."""
    from t2i_fixtures import plain_folder

    inst, cls = plain_folder(tmp_path / "sks", (200, 40, 40)), plain_folder(tmp_path / "reds", (40, 200, 40))
    results = train(
        options(
            tiny_sdxl, tmp_path / "full", instance_data_dir=str(inst), instance_prompt="a sks square",
            class_data_dir=str(cls), class_prompt="a square", with_prior_preservation=True, cache_latents=True,
            pre_compute_text_embeddings=True, proportion_empty_prompts=0.5, max_steps=3,
            per_device_train_batch_size=2, learning_rate=1e-3,
        )
    )  # fmt: skip
    out = Path(results["output_dir"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in records if "train/loss" in r]
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLPipeline"
    assert draw(xl_pipeline(str(out))).shape == (1, 16, 16, 3)


def test_the_seed_recipes_targets_train_with_gradient_checkpointing(tiny_sdxl, squares, tmp_path):
    """What the GPU run below trains, on the tiny SDXL: LoRA on the eight targets, the UNet recomputing its blocks."""
    from safetensors.torch import load_file

    results = train(
        options(
            tiny_sdxl, tmp_path / "out", train_data_dir=squares, peft="lora", lora_r=4,
            lora_target_modules=SDXL_LORA_TARGETS, gradient_checkpointing=True, max_steps=3,
            lr_scheduler_type="constant_with_warmup", warmup_steps=1, learning_rate=1e-2, eval_strategy="no",
        )
    )  # fmt: skip
    out = Path(results["output_dir"])
    saved = load_file(out / LORA_FILE)
    for target in SDXL_LORA_TARGETS:
        b = [v for k, v in saved.items() if f".{target}.lora_B" in k]
        assert b and any(v.abs().max() > 0 for v in b), target  # lora_B starts at zero: trained, so gradients flowed
    # every adapter loads back into diffusers' pipeline: the attention ones were saved under diffusers' names and
    # dropped by its loader beside the others (32 of 48 lost; found in audit)
    pipe = xl_pipeline(tiny_sdxl)
    pipe.load_lora_weights(out)
    loaded = {n for n, m in pipe.unet.named_modules() if hasattr(m, "lora_A")}
    trained = {k.removeprefix("unet.").split(".lora_")[0] for k in saved if ".lora_B" in k}
    assert loaded == trained and len(loaded) == len(saved) // 2
