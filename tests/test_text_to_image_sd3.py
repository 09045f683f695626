"""--task text_to_image on a Stable-Diffusion-3-shaped pipeline (tests/t2i_fixtures.py: two CLIP text encoders with
projections, a T5 encoder, an SD3Transformer2DModel, a VAE with a shift factor, a flow-matching scheduler): the
conditioning is StableDiffusion3Pipeline's, the loss is the flow-matching loss of diffusers' SD3 script, a LoRA
(with the CLIP encoders') trains, lowers the loss, loads into the pipeline by load_lora_weights and changes its
output, full fine-tuning saves a pipeline that loads and resumes bit-exactly, validation images render, and the
noise-prediction options are refused. 2-process DDP against one process: tests/test_text_to_image_dist.py."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from t2i_fixtures import PROMPT, build_tiny_sd3_pipeline, captioned_folder, options

from cloudtrain import train
from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.models import sd3
from cloudtrain.models.diffusion import load_text_to_image_model
from cloudtrain.tasks.text_to_image import TextToImageTask

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny layers run faster on one

LORA_FILE = "pytorch_lora_weights.safetensors"
T5_TOKENS = 12  # the tiny T5 tokenizer's length (--max_sequence_length)


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory) -> str:
    return str(build_tiny_sd3_pipeline(tmp_path_factory.mktemp("t2i-sd3") / "tiny-sd3"))


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> str:
    return str(captioned_folder(tmp_path_factory.mktemp("t2i-sd3-data") / "squares"))


def sd3_options(model: str, out: Path, **extra) -> dict:
    return options(model, out, max_sequence_length=T5_TOKENS, validation_guidance_scale=1.0, **extra)


def config(model: str, out: Path, **extra):
    return build_config(sd3_options(model, out, **extra))


def sd3_pipeline(path: str):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw(pipe, prompt: str = PROMPT) -> torch.Tensor:
    kwargs = dict(num_inference_steps=2, height=16, width=16, output_type="np", guidance_scale=1.0)
    generator = torch.Generator().manual_seed(0)
    return torch.from_numpy(pipe(prompt, generator=generator, max_sequence_length=T5_TOKENS, **kwargs).images)


def loaded(model: str, out: Path, **extra):
    """(task, model, a collated batch of the 6 squares) as the run builds them."""
    cfg = config(model, out, **extra)
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    net = task.load_model(cfg, data, task.tokenizer, announce=False)  # type: ignore[arg-type]
    return task, net, data.collator([data.train[i] for i in range(len(data.train))])


# ---------------------------------------------------------------- the conditioning and the loss


def test_the_prompt_conditioning_is_the_sd3_pipelines(tiny_sd3, squares, tmp_path):
    """Both CLIP encoders' penultimate states side by side, padded to T5's width and followed by T5's, and both
    pooled projections: what StableDiffusion3Pipeline.encode_prompt gives the transformer."""
    task, model, _ = loaded(tiny_sd3, tmp_path / "out", train_data_dir=squares)
    assert model.flow and model.denoiser_name == "transformer" and task.tokenizer_3 is not None
    tokens = task._tokens(PROMPT)
    assert set(tokens) == {"input_ids", "input_ids_2", "input_ids_3", "attention_mask"}
    with torch.no_grad():
        hidden, pooled = model.encode_prompts(*(tokens[k][None] for k in ("input_ids", "input_ids_2", "input_ids_3")))
        expected, _, expected_pooled, _ = sd3_pipeline(tiny_sd3).encode_prompt(
            PROMPT, None, None, device="cpu", do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS
        )
    assert hidden.shape == (1, 16 + T5_TOKENS, 32) and pooled is not None and pooled.shape == (1, 32)
    torch.testing.assert_close(hidden, expected)
    torch.testing.assert_close(pooled, expected_pooled)


@pytest.mark.parametrize("precondition", [True, False])
def test_the_flow_matching_loss_is_the_sd3_scripts(tiny_sd3, squares, tmp_path, precondition):
    """noisy = (1 - sigma) x + sigma n at sigma = t / 1000; the target the clean latents (preconditioned) or the
    velocity n - x; cosmap weights it by 2 / (pi (1 - 2 sigma + 2 sigma^2))."""
    import math

    _, model, batch = loaded(
        tiny_sd3, tmp_path / "out", train_data_dir=squares, weighting_scheme="cosmap", precondition_outputs=precondition
    )
    model.eval()
    batch.pop("row"), batch.pop("repeat")
    rows = batch["pixel_values"].shape[0]
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(rows, 4, 8, 8, generator=generator)
    timesteps = model.noise_scheduler.timesteps[torch.randint(0, 1000, (rows,), generator=generator)]
    with torch.no_grad():
        losses = model(**batch, noise=noise, timesteps=timesteps)
        latents = model.encode_images(batch["pixel_values"])[0]
        hidden, pooled = model.encode_prompts(batch["input_ids"], batch["input_ids_2"], batch["input_ids_3"])
        sigma = (timesteps / 1000).view(-1, 1, 1, 1)
        noisy = (1 - sigma) * latents + sigma * noise
        out = model.transformer(noisy, hidden, pooled, timesteps).sample
    if precondition:
        predicted, target = out * -sigma + noisy, latents
    else:
        predicted, target = out, noise - latents
    weight = 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
    torch.testing.assert_close(losses, (weight * (predicted - target) ** 2).mean(dim=(1, 2, 3)))
    vae = model.vae.config  # the latents the transformer sees are shifted, then scaled
    dist = model.vae.encode(batch["pixel_values"]).latent_dist
    torch.testing.assert_close(latents, (dist.mean - vae.shift_factor) * vae.scaling_factor)


def test_timesteps_are_drawn_from_the_schedule_by_the_weighting_scheme(tiny_sd3, tmp_path):
    """logit_normal and mode favour the middle of the shifted schedule, the rest draw uniformly; every draw is a
    timestep of the training schedule, and one generator seed draws the same."""
    drawn = {}
    for scheme in ("logit_normal", "mode", "none"):
        model = load_text_to_image_model(config(tiny_sd3, tmp_path / "out", weighting_scheme=scheme), tiny_sd3)
        t = model.draw_timesteps(2000, torch.Generator().manual_seed(0))
        assert torch.isin(t, model.noise_scheduler.timesteps).all()
        assert torch.equal(t, model.draw_timesteps(2000, torch.Generator().manual_seed(0)))
        drawn[scheme] = t / 1000
    middle = {scheme: ((s > 0.3) & (s < 0.97)).float().mean().item() for scheme, s in drawn.items()}
    assert middle["logit_normal"] > middle["none"] + 0.1, middle
    assert middle["mode"] > middle["none"], middle


# ---------------------------------------------------------------- saving in diffusers' format


def test_the_lora_saved_loads_into_the_sd3_pipeline_and_computes_as_trained(tiny_sd3, tmp_path):
    """The transformer's and both CLIP encoders' adapters in one file, as StableDiffusion3Pipeline.load_lora_weights
    reads it: the pipeline's transformer and encoders then compute what the trained ones did; T5 takes none."""
    from safetensors.torch import load_file

    cfg = config(tiny_sd3, tmp_path / "out", peft="lora", lora_r=4, lora_alpha=8.0, train_text_encoder=True)
    model = TextToImageTask(cfg).attach_adapters(load_text_to_image_model(cfg, tiny_sd3), cfg).eval()
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trained and all(".lora_" in name for name in trained)
    assert any(".add_q_proj.lora_A" in name for name in trained)  # the text stream's projections too
    assert not any(name.startswith("text_encoder_3.") for name in trained)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapters do something
            param.data.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "lora")
    saved = load_file(tmp_path / "lora" / LORA_FILE)
    assert {name.split(".")[0] for name in saved} == {"transformer", "text_encoder", "text_encoder_2"}

    pipe = sd3_pipeline(tiny_sd3)
    generator = torch.Generator().manual_seed(2)
    x, states, pooled = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 5, 32), torch.randn(2, 32)
    ids = pipe.tokenizer([PROMPT], padding="max_length", max_length=16, return_tensors="pt").input_ids
    t = torch.tensor([100.0, 700.0])
    with torch.no_grad():
        base = pipe.transformer(x, states, pooled, t).sample
        pipe.load_lora_weights(tmp_path / "lora")
        after = pipe.transformer(x, states, pooled, t).sample
        ours = model.transformer(x, states, pooled, t).sample
        for encoder in ("text_encoder", "text_encoder_2"):
            torch.testing.assert_close(
                getattr(pipe, encoder)(ids).text_embeds, getattr(model, encoder)(ids).text_embeds, atol=1e-5, rtol=0
            )
    assert (after - base).abs().max() > 1e-3
    torch.testing.assert_close(after, ours, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def lora_run(tiny_sd3, squares, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("t2i-sd3-run") / "lora"
    return train(
        sd3_options(
            tiny_sd3, out, train_data_dir=squares, peft="lora", max_steps=30, learning_rate=5e-3,
            per_device_train_batch_size=6, logging_steps=10, eval_on_start=True,
            validation_prompts=[PROMPT, "a blue square"], validation_steps=30,
        )
    )  # fmt: skip


def test_sd3_lora_training_lowers_the_fixed_noise_loss_and_renders(lora_run):
    out = Path(lora_run["output_dir"])
    evaluations = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval/loss"] for r in evaluations if "eval/loss" in r]
    assert losses[-1] < losses[0] * 0.97, losses
    assert sorted(p.name for p in (out / "validation").glob("*.png")) == [
        "eval-step-000000.png",
        "eval-step-000030.png",
    ]
    assert (out / LORA_FILE).is_file()


def test_the_sd3_lora_changes_the_pipelines_images_and_the_card_says_sd3(lora_run, tiny_sd3):
    from cloudtrain.publish.diffusion_card import build_card

    out = Path(lora_run["output_dir"])
    pipe = sd3_pipeline(tiny_sd3)
    before = draw(pipe)
    pipe.load_lora_weights(out)
    assert (draw(pipe) - before).abs().max() > 1e-3
    card = build_card(out, build_config(json.loads((out / "args.json").read_text())), lora_run)
    assert "sd3" in card.data.tags and "lora" in card.data.tags and "stable-diffusion" not in card.data.tags
    assert "StableDiffusion3Pipeline.from_pretrained" in card.content and "load_lora_weights" in card.content
    # the snippet renders at the T5 length the run trained with, not diffusers' 256 (found in audit)
    trained = json.loads((out / "args.json").read_text())["max_sequence_length"]
    assert f", max_sequence_length={trained}).images[0]" in card.content
    assert "weighting_scheme: logit_normal" in card.content and "snr_gamma" not in card.content


@pytest.mark.slow
def test_full_fine_tuning_saves_an_sd3_pipeline_and_resumes_bit_exactly(tiny_sd3, squares, tmp_path):
    """The transformer and both CLIP encoders trained in full (T5 and the VAE untouched), with empty captions; the
    saved folder loads as a StableDiffusion3Pipeline; a run resumed from step 2 ends bit-identical. T5, stored in
    16 bits (as the Hub's SD3 is), is saved as stored, not doubled to fp32."""
    from transformers import T5EncoderModel

    base_dir = tmp_path / "base"
    shutil.copytree(tiny_sd3, base_dir)
    T5EncoderModel.from_pretrained(tiny_sd3, subfolder="text_encoder_3", dtype=torch.bfloat16).save_pretrained(
        base_dir / "text_encoder_3"
    )
    run = sd3_options(
        str(base_dir), tmp_path / "full", train_data_dir=squares, train_text_encoder=True, proportion_empty_prompts=0.3,
        random_flip=True, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, checkpointing_steps=2,
        logging_steps=1,
    )  # fmt: skip
    train(run)
    pipe, base = sd3_pipeline(str(tmp_path / "full")), sd3_pipeline(str(base_dir))
    assert pipe.text_encoder_3.dtype == torch.bfloat16 and pipe.transformer.dtype == torch.float32
    for part in ("transformer", "text_encoder", "text_encoder_2"):
        trained = dict(getattr(pipe, part).named_parameters())
        changed = [n for n, p in getattr(base, part).named_parameters() if not torch.equal(p, trained[n])]
        assert len(changed) > len(trained) // 2, part
    for part in ("vae", "text_encoder_3"):
        trained = dict(getattr(pipe, part).named_parameters())
        assert all(torch.equal(p, trained[n]) for n, p in getattr(base, part).named_parameters()), part
    assert draw(pipe).shape == (1, 16, 16, 3)

    weights = {n: p.clone() for n, p in pipe.transformer.named_parameters()}
    logged = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    checkpoint = tmp_path / "full" / "checkpoints" / "checkpoint-2"
    train({**run, "overwrite_output_dir": True, "resume_from_checkpoint": str(checkpoint)})
    again = sd3_pipeline(str(tmp_path / "full")).transformer
    assert all(torch.equal(weights[n], p) for n, p in again.named_parameters())
    relogged = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logged if "train/loss" in r]
    assert len(losses) == 4 and [r["train/loss"] for r in relogged if "train/loss" in r] == losses


def test_a_pipeline_without_t5_trains_with_zeros_in_its_place(tmp_path, squares):
    """SD3 may be saved without its third encoder: the pipeline then gives zeros for T5's states, and so does
    training (cached text embeddings here: the T5-less states computed once)."""
    model = str(build_tiny_sd3_pipeline(tmp_path / "no-t5", t5=False))
    task, net, batch = loaded(model, tmp_path / "out", train_data_dir=squares)
    assert net.text_encoder_3 is None and task.tokenizer_3 is None and "input_ids_3" not in batch
    with torch.no_grad():
        hidden, _ = net.encode_prompts(batch["input_ids"], batch["input_ids_2"])
    assert hidden.shape[1] == 16 + T5_TOKENS and not hidden[:, 16:].any()
    results = train(
        sd3_options(model, tmp_path / "run", train_data_dir=squares, peft="lora", max_steps=2,
                    pre_compute_text_embeddings=True)
    )  # fmt: skip
    assert results["train"]["global_step"] == 2


def snippet(card: str) -> str:
    """The model card's usage code."""
    return card.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_pipeline_without_t5_saves_renders_and_loads_as_hint_and_card_show(tmp_path, squares, capsys, monkeypatch):
    """model_index.json lists text_encoder_3 and tokenizer_3 as [null, null]: from_pretrained refuses such a folder
    unless both are given as None. Full fine-tuning saves the pipeline (found in audit: the save failed and the
    trained model was lost) and a LoRA renders its validation images (it stopped at the first); the printed
    usage and the card's snippet pass the two Nones, and each loads what the run saved."""
    from diffusers import DiffusionPipeline

    from cloudtrain.publish.diffusion_card import build_card

    model = str(build_tiny_sd3_pipeline(tmp_path / "no-t5", t5=False))
    monkeypatch.chdir(tmp_path)  # the card names the output by its folder's name: "full", "lora" here
    for name, extra in (("full", {}), ("lora", {"peft": "lora", "validation_prompts": [PROMPT]})):
        run = sd3_options(model, tmp_path / name, train_data_dir=squares, max_steps=1, per_device_train_batch_size=3,
                          **extra)  # fmt: skip
        results = train(run)
        hint = capsys.readouterr().out.split("use it: ")[-1].strip()
        assert "text_encoder_3=None, tokenizer_3=None)" in hint
        assert re.search(r'\("a prompt", max_sequence_length=\d+\)', hint)  # the card's, as trained (audit)
        if name == "full":
            assert (tmp_path / name / "transformer").is_dir()
            image = eval(hint, {"DiffusionPipeline": DiffusionPipeline})
        else:
            assert [p.name for p in (tmp_path / name / "validation").glob("*.png")] == ["eval-step-000001.png"]
            scope = {"DiffusionPipeline": DiffusionPipeline}
            exec(hint.replace('; p("a prompt"', '; image = p("a prompt"') + ".images[0]", scope)
            image = scope["image"]
        assert image.size == (16, 16)
        card = build_card(tmp_path / name, build_config(run), results).content
        scope = {}
        exec(snippet(card), scope)
        assert scope["pipeline"].text_encoder_3 is None and scope["image"].size == (16, 16)


# ---------------------------------------------------------------- refused in one line, before heavy work


def test_the_noise_prediction_options_are_refused_for_sd3_and_sd3s_for_the_others(tiny_sd3, squares, tmp_path):
    from t2i_fixtures import build_tiny_pipeline

    tiny_sd = str(build_tiny_pipeline(tmp_path / "tiny-sd"))
    data = {"train_data_dir": squares}
    cases = {
        "snr": (tiny_sd3, {"snr_gamma": 5.0}, "--snr_gamma does not apply to Stable Diffusion 3"),
        "offset": (tiny_sd3, {"noise_offset": 0.1}, "--noise_offset does not apply to Stable Diffusion 3"),
        "v": (tiny_sd3, {"prediction_type": "v_prediction"}, "--prediction_type does not apply to Stable Diffusion 3"),
        "scheme": (tiny_sd, {"weighting_scheme": "mode"}, "--weighting_scheme applies to flow-matching pipelines"),
        "precondition": (tiny_sd, {"precondition_outputs": False}, "--precondition_outputs applies to flow-matching"),
        "t5 length": (tiny_sd, {"max_sequence_length": 100}, "--max_sequence_length applies to flow-matching"),
        "logit std": (tiny_sd3, {"logit_std": 0.0}, "--logit_std must be positive"),
        "resolution": (tiny_sd3, {"resolution": 17}, "--resolution 17 is not divisible by 2"),
        "lora targets": (
            tiny_sd3,
            {"peft": "lora", "lora_target_modules": ["q_proj"]},
            "--lora_target_modules: q_proj is not a linear or convolution layer of the denoiser",
        ),
        "scheme name": (tiny_sd3, {"weighting_scheme": "snr"}, "weighting_scheme"),
    }
    for name, (model, extra, message) in cases.items():
        run = options(model, tmp_path / name, **data, **extra)
        with pytest.raises(UserError) as refused:
            train(run)
        assert message in str(refused.value), (name, str(refused.value))
        assert "\n" not in str(refused.value), name
        assert not (tmp_path / name).exists(), name


def test_sd3_defaults_are_diffusers_sd3_scripts():
    from cloudtrain.config import ImagesConfig

    ic = ImagesConfig()
    assert (ic.weighting_scheme, ic.logit_mean, ic.logit_std, ic.mode_scale) == ("logit_normal", 0.0, 1.0, 1.29)
    assert ic.precondition_outputs and ic.max_sequence_length == 77
    assert "attn.add_q_proj" in sd3.LORA_TARGETS and "attn.to_add_out" in sd3.LORA_TARGETS


def test_the_sd3_recipe_runs_its_settings_on_the_tiny_sd3(tiny_sd3, squares, tmp_path):
    """configs/text_to_image_sd3_lora.yaml's settings (SD3 LoRA targets, logit-normal, preconditioning, cached
    text embeddings, gradient checkpointing) for 2 steps on the tiny pipeline: only the model, the data, the size
    and the hardware swapped."""
    from cloudtrain.config.parse import load_config_file

    recipe = load_config_file(str(Path(__file__).parents[1] / "configs" / "text_to_image_sd3_lora.yaml"))
    cfg = build_config(recipe)
    assert (cfg.model.peft, cfg.model.lora_target_modules, cfg.images.weighting_scheme) == (
        "lora",
        ["all-linear"],  # the SD3 default targets
        "logit_normal",
    )
    swapped = dict(
        model_name_or_path=tiny_sd3, instance_data_dir=squares, output_dir=str(tmp_path / "out"), resolution=16,
        mixed_precision="no", max_steps=2, warmup_steps=0, validation_steps=None,
        validation_prompts=[], report_to=["none"], max_sequence_length=T5_TOKENS, training_type="basic",
        lora_r=4, lora_alpha=4,
    )  # fmt: skip
    recipe.pop("zero_stage")  # one CPU process: the basic trainer
    results = train({**recipe, **swapped})
    assert results["train"]["global_step"] == 2
    assert (tmp_path / "out" / LORA_FILE).is_file()


# ---------------------------------------------------------------- aspect-ratio buckets (no size conditioning)


def test_sd3_trains_on_aspect_ratio_buckets_and_the_lora_renders_a_wide_image(tmp_path, capsys):
    """Wide, tall and square images at --resolution 32: three buckets (48x16, 16x48, 32x32), every step one
    shape through the transformer (SD3 has no size ids: the latents' shape is all it sees); the LoRA loads and
    the pipeline renders a bucket's shape with it."""
    from test_image_buckets import mixed_folder

    model = str(build_tiny_sd3_pipeline(tmp_path / "sd3-wide", pos_embed_max_size=32))  # sides up to 64 px
    run = sd3_options(
        model, tmp_path / "ar", train_data_dir=str(mixed_folder(tmp_path / "mixed")), aspect_ratio_bucketing=True,
        resolution=32, per_device_train_batch_size=2, max_steps=6, learning_rate=5e-3, logging_steps=1, peft="lora",
    )  # fmt: skip
    train(run)
    assert "3 aspect-ratio buckets near 32px squared" in capsys.readouterr().out
    logged = [json.loads(line) for line in (tmp_path / "ar" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logged if "train/loss" in r]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    pipe = sd3_pipeline(model)
    generator = torch.Generator().manual_seed(0)
    wide = dict(num_inference_steps=2, height=16, width=48, output_type="np", guidance_scale=1.0)
    before = pipe(PROMPT, generator=generator, max_sequence_length=T5_TOKENS, **wide).images
    pipe.load_lora_weights(tmp_path / "ar")
    generator = torch.Generator().manual_seed(0)
    after = pipe(PROMPT, generator=generator, max_sequence_length=T5_TOKENS, **wide).images
    assert after.shape == (1, 16, 48, 3) and abs(after - before).max() > 1e-3


def test_sides_beyond_the_sd3_position_embedding_are_refused_in_one_line(tiny_sd3, squares, tmp_path):
    """The tiny SD3's embedding covers 16 patches (32 px): 32 px squares fit, a 48x16 bucket does not."""
    TextToImageTask(cfg := config(tiny_sd3, tmp_path, train_data_dir=squares, resolution=32)).check_options(cfg)
    for extra, line in (
        ({"resolution": 48}, "--resolution 48: it has a side of 48 px, beyond the 32 px"),
        ({"resolution": 32, "aspect_ratio_bucketing": True}, "--resolution 32: its longest aspect-ratio bucket"),
    ):
        cfg = config(tiny_sd3, tmp_path, train_data_dir=squares, **extra)
        with pytest.raises(UserError) as refused:
            TextToImageTask(cfg).check_options(cfg)
        assert str(refused.value).startswith(line) and "\n" not in str(refused.value)
    # patches of 2 pixels: the check made buckets of another step than training, and passed a run whose 48x16
    # bucket then crashed mid-way (found in audit)
    patched = str(build_tiny_sd3_pipeline(tmp_path / "patch-2", patch_size=2, pos_embed_max_size=8))  # 32 px sides
    cfg = config(patched, tmp_path, train_data_dir=squares, resolution=32, aspect_ratio_bucketing=True)
    with pytest.raises(UserError, match="^--resolution 32: its longest aspect-ratio bucket"):
        TextToImageTask(cfg).check_options(cfg)
    # the floor is training's bucket step (the VAE's factor x 8: 16 px here), not the patch's twice that (review)
    cfg = config(patched, tmp_path, train_data_dir=squares, resolution=16, aspect_ratio_bucketing=True)
    TextToImageTask(cfg).check_options(cfg)
