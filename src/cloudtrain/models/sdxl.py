"""What Stable Diffusion XL adds to a text-to-image pipeline (`--task text_to_image`; docs/text-to-image.md).

SDXL conditions its UNet on two text encoders and on each image's geometry: the prompt's hidden states are the
penultimate layers of both encoders side by side, the second encoder's pooled (projected) embedding goes in
`added_cond_kwargs["text_embeds"]`, and `added_cond_kwargs["time_ids"]` holds six numbers per row: the image's
original size, the top-left corner of the crop taken from it (after resizing), and the target size. A pipeline is
SDXL when its model_index.json names a `text_encoder_2`.
"""

import torch

SECOND_ENCODER = ("text_encoder_2", "tokenizer_2")


def is_xl(index: dict) -> bool:
    """Whether a pipeline's model_index.json is SDXL-shaped (a UNet and a second text encoder)."""
    return "unet" in index and isinstance(index.get("text_encoder_2"), list) and index["text_encoder_2"][0] is not None


def encode(
    text_encoder: torch.nn.Module, text_encoder_2: torch.nn.Module, input_ids: torch.Tensor, input_ids_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, pooled embedding): each encoder's penultimate hidden states, concatenated on the feature
    axis, and the second encoder's projected pooled output, as SDXL was trained."""
    first = text_encoder(input_ids, output_hidden_states=True)
    second = text_encoder_2(input_ids_2, output_hidden_states=True)
    hidden = torch.cat([first.hidden_states[-2], second.hidden_states[-2].to(first.hidden_states[-2].dtype)], dim=-1)
    return hidden, second.text_embeds


def time_ids(original: tuple[int, int], crop_top_left: tuple[int, int], target: int | tuple[int, int]) -> torch.Tensor:
    """One row's six size numbers: (original height, width, crop top, left, target height, width); `target` an
    int for a square, or (height, width) for an aspect-ratio bucket."""
    height, width = (target, target) if isinstance(target, int) else target
    return torch.tensor([*original, *crop_top_left, height, width], dtype=torch.float32)


def added_cond(pooled: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The UNet's `added_cond_kwargs`, in its dtype."""
    return {"text_embeds": pooled.to(dtype), "time_ids": ids.to(dtype)}
