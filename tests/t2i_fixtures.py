"""A tiny random Stable Diffusion pipeline and small image folders for the text-to-image tests, the demo and the
bench: real diffusers components (UNet2DConditionModel, AutoencoderKL, CLIPTextModel, a CLIP tokenizer over a
vocabulary written here, DDPMScheduler), saved in diffusers' folder layout. Nothing comes from the Hub."""

import json
import string
from pathlib import Path

import numpy as np
from PIL import Image

SPECIAL = ("<|startoftext|>", "<|endoftext|>")


def write_clip_tokenizer(folder: Path, max_length: int = 16):
    """A CLIP BPE tokenizer over single characters (CLIP marks a word's last character with </w>)."""
    from transformers import CLIPTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    chars = list(string.ascii_lowercase + string.digits)
    tokens = chars + [c + "</w>" for c in chars] + list(SPECIAL)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length)


def clip_config(tokenizer, layers: int = 1, **extra):
    """A CLIP text encoder's config of hidden size 16 over `tokenizer`'s vocabulary."""
    from transformers import CLIPTextConfig

    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL))
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=ids[0],
        eos_token_id=ids[1],
        pad_token_id=ids[1],
        **extra,
    )


def tiny_vae(latent_channels: int = 4, **extra):
    """A two-level AutoencoderKL: 16px images to 8x8 latents."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=latent_channels,
        norm_num_groups=4,
        **{"sample_size": 16, **extra},
    )


def build_tiny_pipeline(
    out: Path, seed: int = 0, prediction_type: str = "epsilon", width: int = 8, image_size: int = 16
) -> Path:
    """A Stable-Diffusion-shaped pipeline of about 0.2M parameters (width 8): `image_size` px images (the size the
    pipeline draws when called without height and width), latents half as wide."""
    import torch
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    tokenizer = write_clip_tokenizer(out.parent / f"{out.name}-vocab")
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(clip_config(tokenizer))
    unet = UNet2DConditionModel(
        sample_size=image_size // 2,
        block_out_channels=(width, 2 * width),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=4,
        attention_head_dim=4,
    )
    vae = tiny_vae(sample_size=image_size)
    scheduler = DDPMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        prediction_type=prediction_type,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(out)
    return out


def square(color: tuple[int, int, int], size: int = 20, seed: int = 0, width: int | None = None) -> Image.Image:
    """A flat colour with a little noise: two colours are two concepts a tiny model can tell apart. `width`: a
    wider image, where a random crop has places to choose from."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(color, np.int16) + rng.integers(-20, 20, (size, width or size, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8))


def captioned_folder(folder: Path, n: int = 6, size: int = 20, width: int | None = None) -> Path:
    """n images, red and blue by turns, captioned in metadata.jsonl (diffusers' imagefolder layout)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name, color = ("red", (220, 30, 30)) if i % 2 else ("blue", (30, 30, 220))
        square(color, size, seed=i, width=width).save(folder / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": f"a {name} square"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def plain_folder(folder: Path, color: tuple[int, int, int], n: int = 3, size: int = 20) -> Path:
    """n images and no captions: DreamBooth's instance or class folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        square(color, size, seed=10 + i).save(folder / f"{i}.png")
    return folder


def build_tiny_sdxl_pipeline(out: Path, seed: int = 0, width: int = 8) -> Path:
    """An SDXL-shaped pipeline (StableDiffusionXLPipeline): two CLIP text encoders (the second with a projection,
    its pooled embedding conditioning the UNet with the size ids through text_time), 16px images, 8x8 latents."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = write_clip_tokenizer(out.parent / f"{out.name}-vocab")
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(clip_config(tokenizer, layers=2))  # SDXL reads the penultimate layer
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(tokenizer, layers=2, projection_dim=16))
    time_dim = 8
    unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(width, 2 * width),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,  # both encoders' hidden states side by side
        norm_num_groups=4,
        attention_head_dim=4,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=16 + 6 * time_dim,  # the pooled embedding and six size ids
    )
    vae = tiny_vae()
    scheduler = EulerDiscreteScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, timestep_spacing="leading"
    )
    pipeline = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=scheduler,
    )
    pipeline.save_pretrained(out)
    return out


PROMPT = "a red square"


def options(model: str, out: Path, **extra) -> dict:
    """A short text-to-image run's options: the basic trainer, fp32, 16 px, 2 rendering steps."""
    return {
        "task": "text_to_image",
        "model_name_or_path": model,
        "resolution": 16,
        "output_dir": str(out),
        "training_type": "basic",
        "mixed_precision": "no",
        "report_to": ["none"],
        "validation_inference_steps": 2,
        **extra,
    }


def write_t5_tokenizer(folder: Path, max_length: int = 12):
    """A T5 (unigram) tokenizer over single characters, saved in `folder`."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_lowercase + string.digits]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_tiny_sd3_pipeline(
    out: Path, seed: int = 0, t5: bool = True, pos_embed_max_size: int = 16, patch_size: int = 1
) -> Path:
    """A Stable-Diffusion-3-shaped pipeline (StableDiffusion3Pipeline): two CLIP text encoders with projections
    (their pooled embeddings side by side condition the transformer), a T5 encoder whose states follow the CLIP
    ones in the sequence, an SD3Transformer2DModel, a VAE with a shift factor and a flow-matching scheduler; 16px
    images, 8x8 latents. `t5` False: a pipeline saved without its third encoder, as SD3 may be run.
    `pos_embed_max_size`: the position embedding's side in patches (16: images of sides up to 32 px)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = write_clip_tokenizer(out.parent / f"{out.name}-vocab")
    tokenizer_3 = write_t5_tokenizer(out.parent / f"{out.name}-t5")
    torch.manual_seed(seed)
    text_encoder = CLIPTextModelWithProjection(clip_config(tokenizer, layers=2, projection_dim=16))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(tokenizer, layers=2, projection_dim=16))
    text_encoder_3 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_3), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    )
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=patch_size,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,  # T5's width; the CLIP states (16 + 16) are padded to it
        caption_projection_dim=16,
        pooled_projection_dim=32,  # both CLIP encoders' projections
        out_channels=4,
        pos_embed_max_size=pos_embed_max_size,
    )
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(shift_factor=0.06, scaling_factor=1.5),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=text_encoder_3 if t5 else None,
        tokenizer_3=tokenizer_3 if t5 else None,
    )
    pipeline.save_pretrained(out)
    return out
