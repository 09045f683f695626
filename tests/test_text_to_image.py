"""--task text_to_image on a tiny random Stable Diffusion pipeline (tests/t2i_fixtures.py): the diffusion loss and
DreamBooth's prior preservation, LoRA saved in diffusers' format, validation images, bad input. Its training runs
take a few seconds on one thread (the whole file about 15 s)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO
from PIL import Image
from t2i_fixtures import PROMPT, build_tiny_pipeline, captioned_folder, options, plain_folder, square

from cloudtrain import train
from cloudtrain.config import build_config
from cloudtrain.data import images
from cloudtrain.errors import UserError
from cloudtrain.models.diffusion import load_text_to_image_model
from cloudtrain.publish.output_dir import MANIFEST, holds_saved_model, is_run_name, written
from cloudtrain.tasks.text_to_image import TextToImageTask

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest: tiny layers run faster on one


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory) -> str:
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("t2i") / "tiny-sd"))


@pytest.fixture(scope="session")
def squares(tmp_path_factory) -> str:
    return str(captioned_folder(tmp_path_factory.mktemp("t2i-data") / "squares"))


def config(model: str, out: Path, **extra):
    return build_config(options(model, out, **extra))


def fixed_draw(model, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, 8, 8, generator=generator), torch.randint(0, 1000, (rows,), generator=generator)


# ---------------------------------------------------------------- the loss


def test_prior_preservation_adds_the_weighted_class_loss_to_the_instance_loss(tiny_sd, tmp_path):
    """loss = mean(instance losses) + prior_loss_weight * mean(class losses), as diffusers' DreamBooth."""
    inst, cls = plain_folder(tmp_path / "sks", (200, 40, 40)), plain_folder(tmp_path / "dogs", (40, 200, 40), n=2)
    cfg = config(
        tiny_sd, tmp_path / "out", instance_data_dir=str(inst), instance_prompt="a sks square", class_data_dir=str(cls),
        class_prompt="a square", with_prior_preservation=True, prior_loss_weight=0.5, center_crop=True,
    )  # fmt: skip
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    assert len(data.train) == 3  # each instance image with a class image, the 2 class images in turn
    model = load_text_to_image_model(cfg, tiny_sd).eval()  # eval: the latents' mean, no draw
    batch = data.collator([data.train[i] for i in range(3)])
    assert batch["is_prior"].tolist() == [False] * 3 + [True] * 3
    noise, timesteps = fixed_draw(model, 6)
    with torch.no_grad():
        losses = model(**batch, noise=noise, timesteps=timesteps)
    total = (losses * batch["loss_weight"]).sum() / task.loss_count(batch)
    instance, prior = losses[:3].mean(), losses[3:].mean()
    assert task.loss_count(batch).item() == 3
    assert total.item() == pytest.approx((instance + 0.5 * prior).item(), rel=1e-6)
    assert prior.item() != pytest.approx(instance.item(), rel=1e-3)  # the two halves are different images


def test_min_snr_weighting_and_v_prediction_follow_the_formulas(tiny_sd, tmp_path):
    cfg = config(tiny_sd, tmp_path / "out", snr_gamma=5.0, prediction_type="v_prediction")
    model = load_text_to_image_model(cfg, tiny_sd)
    timesteps = torch.tensor([10, 500, 990])
    alphas = model.noise_scheduler.alphas_cumprod[timesteps]
    snr = alphas / (1 - alphas)
    expected = torch.clamp(snr, max=5.0) / (snr + 1)  # v-prediction: min(SNR, gamma) / (SNR + 1)
    assert torch.allclose(model.snr_weights(timesteps), expected.float(), rtol=1e-5)
    model.prediction_type = "epsilon"  # noise prediction: min(SNR, gamma) / SNR, 1 where SNR < gamma
    assert torch.allclose(model.snr_weights(timesteps), (torch.clamp(snr, max=5.0) / snr).float(), rtol=1e-5)
    assert model.snr_weights(timesteps)[2].item() == pytest.approx(1.0)


def test_the_trained_prediction_type_renders_and_is_saved_with_the_pipeline(tiny_sd, tmp_path):
    """--prediction_type v_prediction trained v, but the validation render and the saved pipeline used the base's
    epsilon scheduler (found in audit); a LoRA's usage lines set it."""
    import json

    from cloudtrain.tasks.text_to_image import TextToImageTask

    cfg = config(tiny_sd, tmp_path / "out", prediction_type="v_prediction")
    model = load_text_to_image_model(cfg, tiny_sd)
    assert (
        json.loads((Path(tiny_sd) / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] == "epsilon"
    )
    assert model.pipeline().scheduler.config.prediction_type == "v_prediction"
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "scheduler" / "scheduler_config.json").read_text())
    assert saved["prediction_type"] == "v_prediction"
    lora = config(tiny_sd, tmp_path / "lora", prediction_type="v_prediction", peft="lora")
    task = TextToImageTask(lora)
    assert "prediction_type='v_prediction'" in task.inference_hint("out")
    from cloudtrain.publish.diffusion_card import build_card

    card = build_card(tmp_path / "lora", lora, {}).text  # the card's usage sets it too
    assert "pipeline.scheduler.from_config(pipeline.scheduler.config, prediction_type='v_prediction')" in card


# ---------------------------------------------------------------- saving in diffusers' format


@pytest.mark.parametrize("peft", ["lora", "dora"])
def test_the_lora_saved_loads_into_a_diffusers_pipeline_and_computes_as_trained(tiny_sd, tmp_path, peft):
    from diffusers import StableDiffusionPipeline

    cfg = config(tiny_sd, tmp_path / "out", peft=peft, lora_r=4, lora_alpha=8.0)  # scale 2: lost without alpha
    model = TextToImageTask(cfg).attach_adapters(load_text_to_image_model(cfg, tiny_sd), cfg).eval()
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trained and all(".lora_" in name for name in trained)  # only the adapters train
    torch.manual_seed(1)
    for name, param in model.unet.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapter do something
            param.data.normal_(0, 0.5)
        if "magnitude" in name:  # DoRA's magnitudes: changed too, so losing them on saving would show
            param.data.mul_(1.5)
    model.save_pretrained(tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    x, t = fixed_draw(model, 2)
    cond = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = pipe.unet(x, t, cond).sample
        pipe.load_lora_weights(tmp_path / "lora")
        loaded = pipe.unet(x, t, cond).sample
        trained = model.unet(x, t, cond).sample
    assert (loaded - base).abs().max() > 1e-3  # the adapter changes the pipeline's output
    assert torch.allclose(loaded, trained, atol=1e-5)  # ... exactly as it did in training, scale included


def test_the_text_encoder_lora_saves_beside_the_denoisers_and_loads_into_a_pipeline(tiny_sd, tmp_path):
    """--train_text_encoder with --peft lora: adapters on the CLIP attention projections, in the same file."""
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    cfg = config(tiny_sd, tmp_path / "out", peft="lora", lora_r=4, lora_alpha=8.0, train_text_encoder=True)
    model = TextToImageTask(cfg).attach_adapters(load_text_to_image_model(cfg, tiny_sd), cfg).eval()
    trained = [name for name, param in model.named_parameters() if param.requires_grad]
    assert any(name.startswith("text_encoder.") and "q_proj.lora_A" in name for name in trained)
    assert all(".lora_" in name for name in trained)
    torch.manual_seed(1)
    for name, param in model.text_encoder.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "lora")
    saved = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert {name.split(".")[0] for name in saved} == {"unet", "text_encoder"}

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    ids = pipe.tokenizer(["a red square"], padding="max_length", max_length=16, return_tensors="pt").input_ids
    with torch.no_grad():
        base = pipe.text_encoder(ids)[0]
        pipe.load_lora_weights(tmp_path / "lora")
        loaded, ours = pipe.text_encoder(ids)[0], model.encode_prompts(ids)[0]
    assert (loaded - base).abs().max() > 1e-3
    assert torch.allclose(loaded, ours, atol=1e-5)


def test_row_draws_follow_the_rows_numbers_not_the_batch_they_fall_in(tiny_sd, squares, tmp_path):
    """What makes 2 processes at batch 4 equal 1 at batch 8: a row draws by (seed, step, its number) alone."""
    from cloudtrain.tasks.text_to_image import row_draws

    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=squares, random_flip=True, noise_offset=0.1,
                 proportion_empty_prompts=0.5)  # fmt: skip
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    model = load_text_to_image_model(cfg, tiny_sd)
    whole = row_draws(model, data.collator([data.train[i] for i in (3, 0, 5, 1)]), seed=0, step=2)
    halves = [
        row_draws(model, data.collator([data.train[i] for i in part]), seed=0, step=2) for part in ((3, 0), (5, 1))
    ]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([half[key] for half in halves])), key
    later = row_draws(model, data.collator([data.train[i] for i in (3, 0, 5, 1)]), seed=0, step=3)
    assert not torch.equal(later["noise"], whole["noise"])  # a new step, new draws
    assert set(whole) == {"noise", "timesteps", "latent_noise", "flip", "empty_caption"}


def test_a_row_repeated_within_a_step_draws_afresh_at_any_process_count(tiny_sd, tmp_path):
    """3 images and a global step of 8 rows: the step repeats rows (whole_steps), each repetition marked in the
    sampler's order (row + k * rows), so a repeated row draws its own noise and timestep instead of adding the
    first one's gradient again; the marks come from the global order, so halves draw as the whole."""
    from cloudtrain.tasks.text_to_image import row_draws

    folder = captioned_folder(tmp_path / "three", n=3)
    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=str(folder), random_flip=True)
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    sampler = data.train.epoch_sampler(seed=0, step_rows=8)  # type: ignore[attr-defined]
    order = [i % (3 * 8) for i in sampler]  # above rows x step: the place in the run (keys the random crop)
    assert len(order) == 8 and sorted(i // 3 for i in order) == [0, 0, 0, 1, 1, 1, 2, 2]  # 1st, 2nd, 3rd times
    for row in range(3):  # each row's occurrences numbered 0, 1, ... in the step
        marks = [i // 3 for i in order if i % 3 == row]
        assert marks == list(range(len(marks)))
    model = load_text_to_image_model(cfg, tiny_sd)
    whole = row_draws(model, data.collator([data.train[i] for i in order]), seed=0, step=0)
    rows = [i % 3 for i in order]
    first = rows.index(rows[-1])
    assert not torch.equal(whole["noise"][first], whole["noise"][7])  # the same image, its own noise
    halves = [row_draws(model, data.collator([data.train[i] for i in part]), 0, 0) for part in (order[:4], order[4:])]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([half[key] for half in halves])), key
    unmarked = row_draws(model, data.collator([data.train[i % 3] for i in order]), seed=0, step=0)
    assert torch.equal(unmarked["noise"][first], unmarked["noise"][7])  # what the repeats drew before the fix


@pytest.mark.slow  # loader workers and three tokenized folders: the full suite's, not the fast tier's
def test_a_random_crop_follows_the_rows_place_in_the_run_not_who_reads_it(tiny_sd, tmp_path):
    """A random crop keyed by --seed and the row's place in the run (epoch, position, repetition): the same in a
    loader worker as in the main process, whatever the global generator's state (a resume, a prefetch), and new
    at each place: the crops a resumed or multi-process run reads are the uninterrupted run's."""
    from torch.utils.data import DataLoader

    folder = captioned_folder(tmp_path / "wide", n=4)
    for i in range(4):  # 64 x 16 noise: a 16 px crop has 49 places
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (16, 64, 3), np.uint8)).save(folder / f"{i}.png")
    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=str(folder))
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    sampler = data.train.epoch_sampler(seed=0, step_rows=4)  # type: ignore[attr-defined]

    def crops(epoch: int, workers: int) -> dict[int, torch.Tensor]:
        sampler.set_epoch(epoch)
        loader = DataLoader(data.train, batch_size=2, sampler=sampler, collate_fn=data.collator, num_workers=workers)
        return {int(r): p for b in loader for r, p in zip(b["row"], b["pixel_values"], strict=True)}

    torch.manual_seed(1)
    first = crops(0, 0)
    torch.manual_seed(2)
    in_workers = crops(0, 2)
    assert sorted(first) == [0, 1, 2, 3] and all(torch.equal(first[r], in_workers[r]) for r in first)
    again = crops(1, 0)
    assert sum(not torch.equal(first[r], again[r]) for r in first) >= 2  # a new epoch crops afresh
    from cloudtrain.tasks.text_to_image import cache_rows

    cached = {}  # --cache_latents reads the rows before the sampler: the crops still follow --seed (review)
    for seed in (1, 2):
        fresh = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
        cache_rows(None, fresh.train, seed, latents=False, texts=False)  # type: ignore[arg-type]
        cached[seed] = torch.stack([row["pixel_values"] for row in fresh.train.cached])  # type: ignore[attr-defined]
    assert not torch.equal(cached[1], cached[2])
    centred = config(tiny_sd, tmp_path / "out", train_data_dir=str(folder), center_crop=True)
    fixed = TextToImageTask(centred).process(None, task.load_tokenizer(centred), centred)  # type: ignore[arg-type]
    fixed.train.epoch_sampler(seed=0, step_rows=4)  # type: ignore[attr-defined]
    assert torch.equal(fixed.train[0]["pixel_values"], fixed.train[4 * 4 * 3]["pixel_values"])


# ---------------------------------------------------------------- options and data sources


def test_image_folders_connect_no_splits_so_the_builtin_text_data_is_never_loaded(tiny_sd, squares, tmp_path):
    for extra in ({"train_data_dir": squares}, {"instance_data_dir": squares, "instance_prompt": "a sks square"}):
        cfg = config(tiny_sd, tmp_path / "out", **extra)
        task = TextToImageTask(cfg)
        task.check_data(cfg)
        assert list(task.connect(cfg)) == []  # the base class would return R8's train/validation/test


def test_validation_steps_sets_the_evaluation_cadence(tiny_sd, squares, tmp_path):
    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=squares, validation_steps=7)
    resolved = TextToImageTask(cfg).resolve_options(cfg)
    assert (resolved.training.eval_strategy, resolved.training.eval_steps) == ("steps", 7)
    plain = config(tiny_sd, tmp_path / "out", train_data_dir=squares)
    assert TextToImageTask(plain).resolve_options(plain).training.eval_strategy == "epoch"
    # another --eval_steps, or --eval_strategy no, was overridden without a word (found in audit)
    for other, given in (({"eval_steps": 3, "eval_strategy": "steps"}, "--eval_steps 3"), ({"eval_strategy": "no"},
                         "--eval_strategy no")):  # fmt: skip
        cfg = config(tiny_sd, tmp_path / "out", train_data_dir=squares, validation_steps=7, **other)
        with pytest.raises(UserError, match=f"^--validation_steps 7 evaluates .* every 7 steps, and {given} says"):
            TextToImageTask(cfg).resolve_options(cfg)
    same = config(tiny_sd, tmp_path / "out", train_data_dir=squares, validation_steps=7, eval_steps=7)
    assert TextToImageTask(same).resolve_options(same).training.eval_steps == 7


def test_a_folder_given_as_train_file_is_read_as_the_image_folder(tiny_sd, squares, tmp_path):
    """A SageMaker job's train channel arrives as --train_file <the channel's folder>."""
    cfg = config(tiny_sd, tmp_path / "out", train_file=squares)
    resolved = TextToImageTask(cfg).resolve_options(cfg)
    assert (resolved.images.train_data_dir, resolved.data.train_file) == (squares, None)
    TextToImageTask(resolved).check_data(resolved)  # reads the folder's captions
    with_dir = config(tiny_sd, tmp_path / "out", train_file=squares, instance_data_dir=squares, instance_prompt="x")
    assert TextToImageTask(with_dir).resolve_options(with_dir).data.train_file == squares  # given images win


def test_the_saved_models_validation_grid_is_published_as_the_card_shows_it(tiny_sd, tmp_path):
    from cloudtrain.publish.diffusion_card import build_card

    cfg = config(tiny_sd, tmp_path / "out")
    task, grids = TextToImageTask(cfg), tmp_path / "out" / "validation"
    assert task.published_files(tmp_path / "out", {}) == []
    grids.mkdir(parents=True)
    for step in (3, 12, 6):
        square((1, 2, 3)).save(grids / f"eval-step-{step:06d}.png")
    assert task.published_files(tmp_path / "out", {"train": {}}) == [grids / "eval-step-000012.png"]
    # --load_best_model_at_end chose step 6's model: its grid, not the last step's (a model the run did not save)
    best = {"train": {"model_from_step": 6}}
    assert task.published_files(tmp_path / "out", best) == [grids / "eval-step-000006.png"]
    assert "validation/eval-step-000006.png" in build_card(tmp_path / "out", cfg, best).text


def test_zero3_is_refused_in_one_line_in_the_planners_line_too(tiny_sd, squares, tmp_path):
    """ZeRO-3 stopped at DeepSpeed's start-up ("Can't find model.config entry"), with or without validation prompts
    (found in review): refused before anything loads, pointing to FSDP2."""
    from cloudtrain.parallel.distributed import Sharding

    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=squares, validation_prompts=[PROMPT])
    task = TextToImageTask(cfg)
    line = task.sharding_refusal(cfg, Sharding(zero_stage=3))
    assert line and line.startswith("--task text_to_image does not run under ZeRO-3") and "\n" not in line
    assert task.sharding_refusal(cfg, Sharding(fsdp=True)) is None  # every process renders in step
    assert task.sharding_refusal(cfg, Sharding(zero_stage=2)) is None
    plain = config(tiny_sd, tmp_path / "out", train_data_dir=squares)
    assert task.sharding_refusal(plain, Sharding(zero_stage=3)) == line
    zero3 = config(tiny_sd, tmp_path / "out", train_data_dir=squares, validation_prompts=[PROMPT], zero_stage=3)
    with pytest.raises(UserError) as refused:
        task.check_options(zero3)
    assert str(refused.value) == line


# ---------------------------------------------------------------- bad input: one line, before heavy work


def bad_cases(tiny_sd: str, squares: str, tmp: Path) -> dict:
    (tmp / "empty").mkdir()
    (tmp / "not-diffusers").mkdir()
    (tmp / "not-diffusers" / "config.json").write_text("{}")
    nocap = captioned_folder(tmp / "nocap", n=2)
    (nocap / "metadata.jsonl").write_text(
        '{"file_name": "0.png", "prompt": "x"}\n{"file_name": "1.png", "prompt": "y"}\n'
    )
    null, gone = captioned_folder(tmp / "null", n=2), captioned_folder(tmp / "gone", n=2)
    (null / "metadata.jsonl").write_text('{"file_name": "0.png", "text": null}\n{"file_name": "1.png", "text": "y"}\n')
    (gone / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "x"}\n{"file_name": "9.png", "text": "y"}\n')
    unnamed, latin = captioned_folder(tmp / "unnamed", n=2), captioned_folder(tmp / "latin", n=2)
    (unnamed / "metadata.jsonl").write_text('{"file_name": null, "text": "x"}\n{"file_name": 1, "text": "y"}\n')
    (latin / "metadata.jsonl").unlink()  # the .txt layout
    (latin / "0.txt").write_text("a square")
    (latin / "1.txt").write_bytes("un carré".encode("latin-1"))
    headless = tmp / "headless"  # a pipeline without its UNet's config (an audit's OSError traceback)
    headless.mkdir()
    for part in Path(tiny_sd).iterdir():
        (headless / part.name).symlink_to(part)
    (headless / "unet").unlink()
    (headless / "unet").mkdir()  # its weights, not its config
    for weights in (Path(tiny_sd) / "unet").glob("*.safetensors"):
        (headless / "unet" / weights.name).symlink_to(weights)
    data = {"train_data_dir": squares}
    return {
        "no images": ({"train_data_dir": str(tmp / "empty")}, "holds no images"),
        # an audit's tracebacks: a file_name that is no text, a caption file not in UTF-8, no unet/config.json
        "file name": ({"train_data_dir": str(unnamed)}, "row 1 has no file_name (the image's path in"),
        "latin-1 caption": ({"train_data_dir": str(latin)}, "1.txt is not UTF-8 text; save it as UTF-8"),
        "no unet config": (
            {**data, "model_name_or_path": str(headless), "peft": "lora"},
            "names a unet in model_index.json but has no unet/config.json",
        ),
        # an audit's: a null caption trained as the text "None"; a missing file was skipped as unreadable
        "null caption": ({"train_data_dir": str(null)}, "row 1: its caption 'text' is null, not a text; give it one"),
        "missing file": ({"train_data_dir": str(gone)}, f"row 2 names 9.png, which is not a file in {gone}"),
        "caption column": (
            {"train_data_dir": str(nocap)},
            "has no caption column 'text' (its keys: file_name, prompt)",
        ),
        "not a pipeline": ({**data, "model_name_or_path": str(tmp / "not-diffusers")}, "is not a diffusers pipeline"),
        "hub id offline": (  # the suite runs with HF_HUB_OFFLINE=1 (tests/conftest.py)
            {**data, "model_name_or_path": "nobody/no-such-sd"},
            "--model_name_or_path nobody/no-such-sd: no cached copy and the Hub cannot be reached",
        ),
        "resolution": ({**data, "resolution": 17}, "--resolution 17 is not divisible by 2"),
        # an audit's: trained, then crashed in the final render and saved nothing; refused in the end's merge
        "render size": (
            {**data, "resolution": 36, "validation_prompts": ["a square"]},
            "--resolution 36: the validation images render at it, and the pipeline needs sides divisible by 8",
        ),
        "merge": ({**data, "peft": "lora", "merge_adapters": True}, "--merge_adapters true merges a text model's"),
        "no data": ({}, "needs images: --train_data_dir"),
        "qlora": ({**data, "peft": "qlora"}, "--peft lora or dora on the denoiser, not qlora"),
        "lora targets": (
            {**data, "peft": "lora", "lora_target_modules": ["q_proj"]},
            "--lora_target_modules: q_proj is not a linear or convolution layer of the denoiser",
        ),
        "instance prompt": ({"instance_data_dir": squares}, "--instance_data_dir needs --instance_prompt"),
        "text encoder cached": (
            {**data, "train_text_encoder": True, "pre_compute_text_embeddings": True},
            "--train_text_encoder changes the text embeddings as it trains",
        ),
        "empty prompts": ({**data, "proportion_empty_prompts": 1.0}, "--proportion_empty_prompts must be in [0, 1)"),
    }


def test_each_bad_option_is_refused_in_one_line_before_loading(tiny_sd, squares, tmp_path):
    for name, (extra, message) in bad_cases(tiny_sd, squares, tmp_path).items():
        with pytest.raises(UserError) as refused:
            train(options(tiny_sd, tmp_path / name, **extra))
        assert message in str(refused.value), name
        assert "\n" not in str(refused.value), name
        assert not (tmp_path / name).exists(), name  # refused before the run wrote anything


def test_unreadable_images_are_skipped_and_counted_or_refused_when_none_is_left(tiny_sd, tmp_path):
    folder = captioned_folder(tmp_path / "mixed", n=4)
    (folder / "1.png").write_bytes(b"not a png")
    (folder / "2.png").write_bytes((folder / "3.png").read_bytes()[:60])  # truncated
    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=str(folder))
    task = TextToImageTask(cfg)
    data = task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]
    assert (task.skipped, len(data.train)) == (2, 2)
    assert "(2 unreadable skipped)" in task.describe_data(data)

    for name in ("0.png", "3.png"):
        (folder / name).write_bytes(b"")
    with pytest.raises(UserError, match="none of the 4 training images could be read"):
        task.process(None, task.load_tokenizer(cfg), cfg)  # type: ignore[arg-type]


def test_images_smaller_than_the_resolution_are_refused(tiny_sd, tmp_path):
    folder = captioned_folder(tmp_path / "small", n=2)
    square((0, 0, 0), size=10).save(folder / "1.png")
    cfg = config(tiny_sd, tmp_path / "out", train_data_dir=str(folder))
    with pytest.raises(
        UserError, match=r"1 training images are smaller than --resolution 16 \(first: .*1.png, 10x10\)"
    ):
        TextToImageTask(cfg).process(None, TextToImageTask(cfg).load_tokenizer(cfg), cfg)  # type: ignore[arg-type]


def test_images_are_read_upright_and_16_bit_grey_keeps_its_tones(tmp_path):
    """A phone photo (EXIF orientation 6) trained on its side, and its bucket took the sideways size; a 16-bit grey
    ramp became white (PIL clips it at 255); a dataset row without its image was an AttributeError (audit)."""

    upright = np.zeros((64, 32, 3), np.uint8)  # 32 wide, 64 tall: red over blue
    upright[:32, :, 0], upright[32:, :, 2] = 255, 255
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # as the sensor wrote it: 64 x 32
    exif = stored.getexif()
    exif[images.ORIENTATION] = 6
    stored.save(tmp_path / "phone.jpg", exif=exif, quality=95)
    photo = images.load_rgb(tmp_path / "phone.jpg")
    assert photo.size == (32, 64) and np.asarray(photo)[8, 16, 0] > 200 and np.asarray(photo)[56, 16, 2] > 200
    with Image.open(tmp_path / "phone.jpg") as image:
        assert images.upright_size(image) == (32, 64)
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "ramp.png")  # mode I;16
    grey = np.asarray(images.load_rgb(tmp_path / "ramp.png"))[..., 0]
    assert grey.min() == 0 and grey.max() == 255 and len(np.unique(grey)) > 200
    Image.fromarray(ramp.astype(np.float32) / 65535, "F").save(tmp_path / "ramp.tif")  # [0, 1]: it was black
    assert np.array_equal(np.asarray(images.load_rgb(tmp_path / "ramp.tif"))[..., 0], grey)
    with pytest.raises(UserError, match="^the t data holds no images$"):  # a dataset of no rows: an IndexError
        images.readable([], 16, "t")
    kept, skipped = images.readable([images.Example(None, "x"), images.Example(tmp_path / "ramp.png", "y")], 16, "t")
    assert (len(kept), skipped) == (1, 1)


def test_a_metadata_file_one_folder_down_is_pointed_to(tmp_path):
    """Hugging Face's imagefolder layout (train/metadata.jsonl) was told "0.png has no 0.txt" (found in audit)."""
    captioned_folder(tmp_path / "set" / "train", n=2)
    with pytest.raises(UserError, match=f"is one: pass --train_data_dir {tmp_path / 'set' / 'train'}$"):
        images.captioned_examples(str(tmp_path / "set"), "text")


def test_metadata_rows_that_are_no_objects_byte_order_marks_and_huge_images(tmp_path, monkeypatch):
    """A metadata line that is an array or a text was a traceback; a caption saved with a BOM trained on
    "\\ufeff..." and such a metadata file was refused; an image over PIL's bomb limit was a traceback (audit)."""
    from PIL import Image

    folder = captioned_folder(tmp_path / "rows", n=2)
    for line, kind in (('["0.png", "x"]', "list"), ('"0.png x"', "str"), ("null", "null")):
        (folder / "metadata.jsonl").write_text(line + "\n")
        with pytest.raises(UserError, match=f"row 1 is {kind}, not a JSON object with file_name$"):
            images.captioned_examples(str(folder), "text")
    (folder / "metadata.jsonl").write_bytes('\ufeff{"file_name": "0.png", "text": "x"}\n'.encode())
    assert [e.caption for e in images.captioned_examples(str(folder), "text")] == ["x"]
    (folder / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "a\u2028b"}\n')  # JSON Lines: \n only
    assert [e.caption for e in images.captioned_examples(str(folder), "text")] == ["a\u2028b"]
    (folder / "metadata.jsonl").unlink()  # the .txt layout
    for name in ("0", "1"):
        (folder / f"{name}.txt").write_bytes("\ufeffa square".encode())
    examples = images.captioned_examples(str(folder), "text")
    assert [e.caption for e in examples] == ["a square", "a square"]
    (folder / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS's, beside a zip's images: left out
    (folder / "__MACOSX").mkdir()
    (folder / "__MACOSX" / "._1.png").write_bytes(b"AppleDouble")
    assert [e.image.name for e in images.captioned_examples(str(folder), "text")] == ["0.png", "1.png"]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)  # each square is over it twice: a bomb by PIL's rule
    with pytest.raises(UserError, match="none of the 2 training images could be read"):
        images.readable(examples, 8, "training")
    import datasets  # a dataset's image column: decoded when read, so skipped alike (found in review: a traceback)

    pictures = datasets.Dataset.from_dict(
        {"picture": [square((1, 2, 3))]}, features=datasets.Features({"picture": datasets.Image()})
    )
    with pytest.raises(UserError, match="none of the 1 training images could be read"):
        images.readable([images.Example(images.DatasetImage(pictures, 0, "picture"), "x")], 8, "training")


def test_caption_files_without_an_image_read_here_are_named_in_a_note(tmp_path, capsys):
    folder = captioned_folder(tmp_path / "orphans", n=2)
    (folder / "metadata.jsonl").unlink()  # the .txt layout
    for name in ("0", "1"):
        (folder / f"{name}.txt").write_text("a square")
    (folder / "photo.txt").write_text("a caption whose image is a .heic")
    assert len(images.captioned_examples(str(folder), "text")) == 2
    assert f"note: 1 caption file(s) in {folder} have no image in a format read here" in capsys.readouterr().out


def test_images_a_metadata_file_leaves_out_are_named_in_a_note(tmp_path, capsys):
    folder = captioned_folder(tmp_path / "some", n=3)
    (folder / "metadata.jsonl").write_text('{"file_name": "0.png", "text": "x"}\n')
    assert [e.caption for e in images.captioned_examples(str(folder), "text")] == ["x"]
    assert f"note: 2 image(s) in {folder} are not in its metadata.jsonl and are left out (first: 1.png)" in (
        capsys.readouterr().out
    )
    cfg = build_config({"task": "text_to_image", "train_data_dir": str(folder)})
    TextToImageTask(cfg).check_data(cfg)  # the checks before loading: the note comes once, when the run reads it
    assert "note:" not in capsys.readouterr().out


def test_images_with_an_empty_caption_are_counted_in_a_note(tmp_path, capsys):
    """A blank metadata cell or an empty .txt trained the image unconditioned without a word (left alone before)."""
    folder = captioned_folder(tmp_path / "blank", n=3)
    (folder / "metadata.jsonl").write_text(
        "".join(f'{{"file_name": "{i}.png", "text": "{text}"}}\n' for i, text in enumerate(["a square", "", " "]))
    )
    assert [e.caption for e in images.captioned_examples(str(folder), "text")] == ["a square", "", " "]
    said = capsys.readouterr().out
    assert f"note: 2 of 3 image(s) in {folder} have an empty caption and train unconditioned (first: 1.png)" in said
    (folder / "metadata.jsonl").unlink()  # the .txt layout: an empty caption file
    for i, text in enumerate(["a square", "a circle", "\n"]):
        (folder / f"{i}.txt").write_text(text)
    images.captioned_examples(str(folder), "text")
    assert "note: 1 of 3 image(s)" in capsys.readouterr().out
    images.captioned_examples(str(folder), "text", notes=False)
    assert "note:" not in capsys.readouterr().out


def test_a_resume_on_another_image_folder_or_resolution_is_told_the_rows_differ(tmp_path):
    """The record a checkpoint keeps of an image set (no image read), and the resume's note when it differs."""
    from cloudtrain.config import ImagesConfig
    from cloudtrain.data.fingerprint import data_record, other_data_note

    def record(folder: Path, **options) -> dict:
        examples = images.captioned_examples(str(folder), "text")
        return data_record(images.ImageRows(examples, lambda caption: {}, ImagesConfig(**options), train=True))

    first = record(captioned_folder(tmp_path / "a"), resolution=16)
    assert first == record(tmp_path / "a", resolution=16) and first["rows"] == 6
    checkpoint = tmp_path / "checkpoint-4"
    assert other_data_note({"data": first}, record(tmp_path / "a", resolution=16), checkpoint) is None
    assert other_data_note({}, first, checkpoint) is None  # a checkpoint from before the record
    larger = other_data_note({"data": first}, record(tmp_path / "a", resolution=32), checkpoint)
    assert larger is not None and "checkpoint-4 was trained on other training data (the same 6 rows" in larger
    other = other_data_note({"data": first}, record(captioned_folder(tmp_path / "b", n=4), resolution=16), checkpoint)
    assert other is not None and "(6 rows there, 4 here)" in other


def test_caption_files_beside_the_images_are_read(tmp_path):
    folder = plain_folder(tmp_path / "txt", (10, 10, 10), n=2)
    (folder / "0.txt").write_text("first caption\n")
    with pytest.raises(UserError, match="1 images without a caption file"):
        images.captioned_examples(str(folder), "text")
    (folder / "1.txt").write_text("second")
    assert [e.caption for e in images.captioned_examples(str(folder), "text")] == ["first caption", "second"]


def test_pixels_are_resized_cropped_and_scaled_to_minus_one_one():
    image = square((255, 0, 0), size=40)
    pixels = images.to_pixels(image.crop((0, 0, 40, 20)), 16, center_crop=True, flip=False)
    assert pixels.shape == (3, 16, 16)
    assert pixels.min() >= -1 and pixels.max() <= 1
    assert pixels[0].mean() > 0.5 and pixels[2].mean() < -0.5  # red stays red
    flipped = images.to_pixels(image.crop((0, 0, 40, 20)), 16, center_crop=True, flip=True)
    assert torch.equal(flipped, pixels.flip(-1))


# ---------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def lora_run(tiny_sd, squares, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("t2i-run") / "lora"
    results = train(
        options(
            tiny_sd, out, train_data_dir=squares, peft="lora", max_steps=30, learning_rate=5e-3,
            per_device_train_batch_size=6, logging_steps=10, eval_on_start=True, report_to=["tensorboard"],
            validation_prompts=[PROMPT, "a blue square"], validation_steps=30, checkpointing_steps=15,
        )
    )  # fmt: skip
    return results


def test_lora_training_lowers_the_fixed_noise_loss(lora_run):
    out = Path(lora_run["output_dir"])
    evaluations = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval/loss"] for r in evaluations if "eval/loss" in r]
    assert losses[-1] < losses[0] * 0.97, losses
    assert [r["step"] for r in evaluations if "eval/loss" in r][:2] == [0, 30]  # --validation_steps 30 evaluates


def test_a_lora_output_holds_the_adapter_and_no_tokenizer(lora_run):
    """The base pipeline has the tokenizer: a LoRA folder is what diffusers' scripts write, and the run's files,
    each a name the manifest lists, so a second run there is refused unless it overwrites."""
    out = Path(lora_run["output_dir"])
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    names = {p.name for p in out.iterdir()} - {MANIFEST}
    assert all(is_run_name(name) for name in names) and names <= written(out), sorted(names - written(out))
    assert holds_saved_model(out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges", "special"))]
    assert json.loads((out / "args.json").read_text())["eval_steps"] == 30


def test_validation_grids_are_written_and_logged_and_the_card_shows_them(lora_run, tiny_sd):
    from diffusers import StableDiffusionPipeline
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = Path(lora_run["output_dir"])
    grids = sorted(p.name for p in (out / "validation").glob("*.png"))
    assert grids == ["eval-step-000000.png", "eval-step-000030.png"]
    assert Image.open(out / "validation" / grids[-1]).size == (
        2 * 128,
        128 + 14,
    )  # two images (drawn at 128px) and their captions
    events = EventAccumulator(str(next((out / "tensorboard").iterdir())), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("eval/validation_images")] == [0, 30]

    from cloudtrain.publish.diffusion_card import build_card

    card = build_card(out, build_config(json.loads((out / "args.json").read_text())), lora_run)
    assert card.data.library_name == "diffusers" and "lora" in card.data.tags
    assert "validation/eval-step-000030.png" in card.content and "load_lora_weights" in card.content

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.set_progress_bar_config(disable=True)
    draw = dict(num_inference_steps=2, height=16, width=16, output_type="np")
    before = pipe(PROMPT, generator=torch.Generator().manual_seed(0), **draw).images
    pipe.load_lora_weights(out)
    after = pipe(PROMPT, generator=torch.Generator().manual_seed(0), **draw).images
    assert abs(after - before).max() > 1e-3


def test_full_fine_tuning_saves_a_whole_pipeline_and_dreambooth_trains(tiny_sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    inst, cls = plain_folder(tmp_path / "sks", (200, 40, 40)), plain_folder(tmp_path / "dogs", (40, 200, 40))
    results = train(
        options(
            tiny_sd, tmp_path / "full", instance_data_dir=str(inst),
            instance_prompt="a sks square", class_data_dir=str(cls), class_prompt="a square",
            with_prior_preservation=True, random_flip=True, cache_latents=True, pre_compute_text_embeddings=True,
            snr_gamma=5.0, noise_offset=0.05, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
        )
    )  # fmt: skip
    assert results["train"]["global_step"] == 4
    names = {p.name for p in (tmp_path / "full").iterdir()} - {MANIFEST}
    assert {"unet", "vae", "model_index.json"} <= names <= written(tmp_path / "full")
    assert all(is_run_name(name) for name in names) and holds_saved_model(tmp_path / "full")
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "full")
    base = StableDiffusionPipeline.from_pretrained(tiny_sd)
    trained = dict(pipe.unet.named_parameters())
    changed = [n for n, p in base.unet.named_parameters() if not torch.equal(p, trained[n])]
    assert len(changed) > len(trained) // 2  # every weight of the denoiser trained
    assert all(torch.equal(p, dict(base.vae.named_parameters())[n]) for n, p in pipe.vae.named_parameters())


def test_a_full_fine_tuning_in_bf16_saves_a_pipeline_that_runs_with_the_base_s_frozen_parts(tiny_sd, squares, tmp_path):
    """The frozen VAE and text encoder were saved in bf16 beside the fp32 UNet: the documented from_pretrained call
    failed on mixed dtypes, and they had lost precision against the base (found in audit)."""
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "bf16"
    train(options(tiny_sd, out, train_data_dir=squares, mixed_precision="bf16", max_steps=1, eval_strategy="no"))
    pipe, base = StableDiffusionPipeline.from_pretrained(out), StableDiffusionPipeline.from_pretrained(tiny_sd)
    for part in ("vae", "text_encoder"):
        theirs = dict(getattr(base, part).named_parameters())
        assert all(torch.equal(p, theirs[n]) for n, p in getattr(pipe, part).named_parameters()), part
    pipe.set_progress_bar_config(disable=True)
    pipe("a square", num_inference_steps=2, height=16, width=16, output_type="np")  # one dtype throughout


def test_train_text_encoder_in_full_trains_it_with_empty_captions(tiny_sd, squares, tmp_path):
    from diffusers import StableDiffusionPipeline

    extra = dict(train_text_encoder=True, proportion_empty_prompts=0.3, max_steps=2, learning_rate=1e-3)
    train(options(tiny_sd, tmp_path / "full", train_data_dir=squares, per_device_train_batch_size=6, **extra))
    pipe, base = (
        StableDiffusionPipeline.from_pretrained(tmp_path / "full"),
        StableDiffusionPipeline.from_pretrained(tiny_sd),
    )
    trained = dict(pipe.text_encoder.named_parameters())
    changed = [n for n, p in base.text_encoder.named_parameters() if not torch.equal(p, trained[n])]
    assert len(changed) > len(trained) // 2


def test_a_dataset_with_an_image_column_trains_through_the_data_sources(tiny_sd, tmp_path):
    """--dataset_name (a save_to_disk folder here, a Hub id elsewhere) with --image_column and --caption_column."""
    import datasets

    rows = {"picture": [square((200, 0, 0), seed=i) for i in range(3)], "caption": ["a red square"] * 3}
    features = datasets.Features({"picture": datasets.Image(), "caption": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "saved"))
    common = dict(dataset_name=str(tmp_path / "saved"), image_column="picture", max_steps=1)
    with pytest.raises(UserError, match="column 'text' is not in the train data"):
        train(options(tiny_sd, tmp_path / "wrong", **common))
    results = train(options(tiny_sd, tmp_path / "out", caption_column="caption", **common))
    assert results["train"]["global_step"] == 1 and results["eval"]["samples"] == 3
    rows["caption"][1] = None  # trained as the caption "None" (found in audit)
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "uncaptioned"))
    with pytest.raises(UserError, match=r"1 rows of --dataset_name .* have no 'caption' text \(first: row 1, None\)"):
        train(
            options(
                tiny_sd,
                tmp_path / "none",
                caption_column="caption",
                **{**common, "dataset_name": str(tmp_path / "uncaptioned")},
            )
        )
    rows["caption"][1] = "a red square"
    # paths as large_string (Arrow tables, parquet from polars) are paths too (found in review)
    for i, picture in enumerate(rows["picture"]):
        picture.save(tmp_path / f"{i}.png")
    paths = {"picture": [str(tmp_path / f"{i}.png") for i in range(3)], "caption": rows["caption"]}
    large = datasets.Features({"picture": datasets.Value("large_string"), "caption": datasets.Value("string")})
    datasets.Dataset.from_dict(paths, features=large).save_to_disk(str(tmp_path / "paths"))
    by_path = {**common, "dataset_name": str(tmp_path / "paths")}
    assert train(options(tiny_sd, tmp_path / "by-path", caption_column="caption", **by_path))["train"]["global_step"]
    datasets.Dataset.from_dict({**rows, "number": [1, 2, 3]}).save_to_disk(str(tmp_path / "numbered"))
    numbers = {**common, "dataset_name": str(tmp_path / "numbered"), "image_column": "number"}  # a traceback (audit)
    with pytest.raises(UserError, match="--image_column number of --dataset_name .* holds Value.*not images or"):
        train(options(tiny_sd, tmp_path / "numbers", caption_column="caption", **numbers))


def test_the_default_output_folder_is_named_after_the_image_folder(tmp_path):
    from cloudtrain.config import build_config
    from cloudtrain.pipeline import resolve_output_dir
    from cloudtrain.tasks import build_task

    for option in ("train_data_dir", "instance_data_dir"):
        cfg = build_config({"task": "text_to_image", "model_name_or_path": "sd/tiny-pipe", option: "data/my-dogs"})
        assert resolve_output_dir(cfg, build_task(cfg)) == Path("outputs/tiny-pipe-my-dogs")


def test_the_compute_dtype_is_diffusers_and_follows_a_cast_of_the_whole_model():
    """diffusion.compute_dtype caches diffusers' `.dtype` (a walk of every submodule) per dtype of the first
    parameter: a model cast afterwards (as DeepSpeed's half-precision engine casts it) is seen."""
    from t2i_fixtures import tiny_vae

    from cloudtrain.models.diffusion import compute_dtype

    vae = tiny_vae()
    assert compute_dtype(vae) == vae.dtype == torch.float32
    vae.to(torch.bfloat16)
    assert compute_dtype(vae) == vae.dtype == torch.bfloat16


def test_the_digits_demo_scores_a_lora_in_its_base_pipeline(lora_run):
    """`make text-to-image ARGS="--peft lora"` scored the default folder, and its scorer loaded only whole
    pipelines: OSError, no model_index.json (found in audit)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("t2i_digits", REPO / "scripts" / "make_t2i_digits.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)

    class EveryImageIsAZero:
        def predict(self, features):
            return np.zeros(len(features), dtype=int)

    accuracy = demo.score(lora_run["output_dir"], EveryImageIsAZero(), 1, 1, 1.0)
    assert accuracy[0] == 1.0 and accuracy[1] == 0.0 and len(accuracy) == 10
