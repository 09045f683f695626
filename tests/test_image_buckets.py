"""Aspect-ratio buckets (cloudtrain.data.image_buckets): the sizes, each image's bucket, an order whose every step
comes from one bucket (on any number of processes, resumable from seed and epoch), and the rows it yields: one
shape per batch, SDXL's time ids naming the real original size, crop and bucket."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cloudtrain.config import build_config
from cloudtrain.data import images
from cloudtrain.data.image_buckets import BucketSampler, assign, bucket_sizes, nearest_bucket


def test_buckets_are_multiples_of_the_step_near_the_area_and_up_to_4_to_1():
    sizes = bucket_sizes(1024 * 1024, 64)
    assert (1024, 1024) in sizes and (1152, 896) in sizes and (896, 1152) in sizes
    for width, height in sizes:
        assert width % 64 == 0 and height % 64 == 0
        assert width * height <= 1024 * 1024
        assert (height, width) in sizes  # portrait as landscape
        assert width * (height + 64) > 1024 * 1024 or (width + 64) * height > 1024 * 1024  # as large as fits
        assert max(width / height, height / width) <= 4
    ratios = [w / h for w, h in sizes]
    assert ratios == sorted(ratios) and ratios[0] < 0.3 and ratios[-1] > 3.5


def test_each_image_goes_to_the_bucket_of_nearest_aspect_ratio():
    sizes = bucket_sizes(64 * 64, 16)  # 16..256 wide
    assert sizes[nearest_bucket((640, 640), sizes)] == (64, 64)
    wide = sizes[nearest_bucket((1000, 500), sizes)]
    assert abs(math.log(wide[0] / wide[1]) - math.log(2)) == min(abs(math.log(w / h) - math.log(2)) for w, h in sizes)
    tall = sizes[nearest_bucket((500, 1000), sizes)]
    assert tall == (wide[1], wide[0])  # log ratio: 2:1 and 1:2 alike
    assert assign([(640, 640), (1000, 500)], sizes) == [sizes.index((64, 64)), sizes.index(wide)]


def test_every_step_of_the_order_is_from_one_bucket_and_the_order_follows_seed_and_epoch():
    rows = [0, 1, 1, 0, 2, 1, 0, 0, 1, 2, 0]  # each row's bucket
    sampler = BucketSampler(rows, step_rows=4, seed=3)
    order = list(sampler)
    assert len(order) == len(sampler) == 4 * (2 + 1 + 1)  # 5 of bucket 0, 4 of 1, 2 of 2: whole steps
    assert set(order) == set(range(len(rows)))  # every image in the epoch
    steps = [order[i : i + 4] for i in range(0, len(order), 4)]
    assert all(len({rows[r] for r in step}) == 1 for step in steps)
    # micro-batches of 2 on 2 processes (micro-batch b to process b % 2): each step's two halves share a bucket
    assert all(rows[step[0]] == rows[step[2]] for step in steps)
    assert list(BucketSampler(rows, step_rows=4, seed=3)) == order  # rebuilt on resume: nothing to restore
    sampler.set_epoch(1)
    assert list(sampler) != order


def mixed_folder(folder: Path) -> Path:
    """Wide, tall and square images, captioned."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, size in enumerate([(64, 32), (32, 64), (40, 40), (66, 30), (30, 62), (48, 48)]):
        pixels = np.random.default_rng(i).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": "a shape"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_bucketed_rows_batch_in_one_shape_with_their_real_sizes_in_the_time_ids(tmp_path):
    folder = mixed_folder(tmp_path / "mixed")
    cfg = build_config({"task": "text_to_image", "resolution": 32, "center_crop": True}).images
    examples = images.captioned_examples(str(folder), "text")
    sizes = bucket_sizes(32 * 32, 16)
    rows = images.ImageRows(examples, lambda caption: {"input_ids": torch.zeros(4)}, cfg, True, size_ids=True,
                            buckets=sizes)  # fmt: skip
    names = [sizes[b] for b in rows.row_buckets]
    assert names == [(48, 16), (16, 48), (32, 32), (48, 16), (16, 48), (32, 32)]
    sampler = rows.epoch_sampler(seed=0, step_rows=2)
    assert sampler is not None  # without buckets too: the trainer's shuffle, repeats marked (test_text_to_image)
    loader = torch.utils.data.DataLoader(rows, batch_size=2, sampler=sampler, collate_fn=images.collate)
    shapes = set()
    for batch in loader:  # stacks: one shape per batch
        height, width = batch["pixel_values"].shape[-2:]
        shapes.add((width, height))
        for row, ids in zip(batch["row"].tolist(), batch["time_ids"].tolist(), strict=True):
            image = Image.open(folder / f"{row}.png")
            original_w, original_h = image.size
            assert ids[:2] == [original_h, original_w] and ids[4:] == [height, width]
            scale = max(width / original_w, height / original_h)  # resized to cover the bucket, centred crop
            top, left = (round(original_h * scale) - height) // 2, (round(original_w * scale) - width) // 2
            assert ids[2:4] == [max(top, 0), max(left, 0)]
    assert shapes == {(48, 16), (16, 48), (32, 32)}


def test_a_bucketed_sdxl_batch_runs_through_the_denoiser(tmp_path):
    """Latents of a wide bucket, with its time ids, through the tiny SDXL UNet: non-square shapes are accepted."""
    from diffusers import UNet2DConditionModel
    from t2i_fixtures import build_tiny_sdxl_pipeline

    unet = UNet2DConditionModel.from_pretrained(build_tiny_sdxl_pipeline(tmp_path / "xl"), subfolder="unet")
    from cloudtrain.models.sdxl import added_cond, time_ids

    ids = torch.stack([time_ids((30, 66), (0, 3), (16, 48))] * 2)
    pooled = torch.randn(2, unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim)
    hidden = torch.randn(2, 4, unet.config.cross_attention_dim)
    latents = torch.randn(2, unet.config.in_channels, 2, 6)
    with torch.no_grad():
        out = unet(latents, torch.tensor([1, 500]), hidden, added_cond_kwargs=added_cond(pooled, ids, unet.dtype))
    assert out.sample.shape == latents.shape


def test_bucketing_refuses_prior_preservation_and_a_resolution_below_one_bucket(tmp_path):
    from t2i_fixtures import build_tiny_pipeline, plain_folder

    from cloudtrain.errors import UserError
    from cloudtrain.tasks.text_to_image import TextToImageTask

    model = str(build_tiny_pipeline(tmp_path / "tiny-sd"))  # VAE factor 2: sides in multiples of 16 px
    with pytest.raises(UserError, match="--aspect_ratio_bucketing puts each image in a bucket"):
        prior = build_config({"task": "text_to_image", "aspect_ratio_bucketing": True, "with_prior_preservation": True,
                      "instance_data_dir": str(plain_folder(tmp_path / "i", (1, 2, 3))), "instance_prompt": "sks",
                      "class_data_dir": str(plain_folder(tmp_path / "c", (3, 2, 1))), "class_prompt": "a"})  # fmt: skip
        prior.images.check()
    cfg = build_config({"task": "text_to_image", "model_name_or_path": model, "aspect_ratio_bucketing": True,
                        "resolution": 8, "train_data_dir": str(mixed_folder(tmp_path / "m"))})  # fmt: skip
    with pytest.raises(UserError) as refused:
        TextToImageTask(cfg).check_options(cfg)
    assert str(refused.value).startswith("--aspect_ratio_bucketing makes sides of multiples of 16 px")
