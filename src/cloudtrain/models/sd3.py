"""What Stable Diffusion 3 changes in a text-to-image pipeline (`--task text_to_image`; docs/text-to-image.md).

SD3 (diffusers' StableDiffusion3Pipeline) denoises with a transformer (SD3Transformer2DModel) and is trained by
flow matching, not by noise prediction: a row at noise level sigma in [0, 1] is `(1 - sigma) * latents + sigma *
noise`, the transformer predicts the velocity `noise - latents` (or, preconditioned, the clean latents after
`prediction * -sigma + noisy`), and its timestep is `sigma * num_train_timesteps`. Sigma comes from the
FlowMatchEulerDiscreteScheduler's shifted schedule at an index drawn by --weighting_scheme (logit-normal or
mode density, else uniform, with sigma_sqrt or cosmap weighting the loss instead), as in the SD3 paper and
diffusers' SD3 training script, whose option names these are.

The prompt goes through three encoders: two CLIP text encoders with projections (their penultimate hidden states
side by side, zero-padded to T5's width, and their pooled projections side by side as `pooled_projections`)
and a T5 encoder (its last hidden states, appended along the sequence; zeros for a pipeline saved without T5).
There is no size conditioning. A pipeline is SD3 when model_index.json names StableDiffusion3Pipeline.
"""

from typing import Any

import torch

from cloudtrain.config import ImagesConfig

PIPELINE = "StableDiffusion3Pipeline"
ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
NEEDED = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
T5 = ("text_encoder_3", "tokenizer_3")  # optional: SD3 runs without it (zeros in its place)
# the attention projections of the image and the text stream: diffusers' SD3 LoRA script's default targets
LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]
# options of the noise-prediction loss, refused for flow matching (option, what to use instead)
NOT_FLOW = {
    "snr_gamma": "--weighting_scheme",
    "noise_offset": "--weighting_scheme",
    "prediction_type": "--precondition_outputs",
}
FLOW_OPTIONS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "precondition_outputs")


def is_sd3(index: dict) -> bool:
    """Whether a pipeline's model_index.json is Stable Diffusion 3's (3.0 or 3.5: the same pipeline class)."""
    return index.get("_class_name") == PIPELINE


def has_t5(index: dict) -> bool:
    return isinstance(index.get("text_encoder_3"), list) and index["text_encoder_3"][0] is not None


def encode(
    encoders: list[Any], ids: list[torch.Tensor | None], joint_dim: int, t5_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, pooled projections) as StableDiffusion3Pipeline.encode_prompt gives them: both CLIP
    encoders' penultimate states side by side, padded to T5's width and followed by T5's states (zeros without
    T5); the CLIP pooled projections side by side."""
    clip = [encoder(i, output_hidden_states=True) for encoder, i in zip(encoders[:2], ids[:2], strict=True)]
    states = torch.cat([out.hidden_states[-2] for out in clip], dim=-1)
    pooled = torch.cat([out.text_embeds for out in clip], dim=-1)
    states = torch.nn.functional.pad(states, (0, joint_dim - states.shape[-1]))
    if encoders[2] is not None and ids[2] is not None:
        t5 = encoders[2](ids[2])[0].to(states.dtype)
    else:
        t5 = states.new_zeros(states.shape[0], t5_length, joint_dim)
    return torch.cat([states, t5], dim=-2), pooled


def draw_timesteps(scheduler: Any, cfg: ImagesConfig, rows: int, generator: torch.Generator | None) -> torch.Tensor:
    """Timesteps of the training schedule at indices drawn by --weighting_scheme's density (diffusers'
    compute_density_for_timestep_sampling), from `generator` (a row's own, or the global one)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        cfg.weighting_scheme, rows, cfg.logit_mean, cfg.logit_std, cfg.mode_scale, generator=generator
    )
    steps = scheduler.config.num_train_timesteps
    indices = (u * steps).long().clamp(0, steps - 1)
    return scheduler.timesteps[indices].float()


def flow_loss(
    transformer: Any,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    text: tuple[torch.Tensor, torch.Tensor],
    cfg: ImagesConfig,
    train_timesteps: int,
) -> torch.Tensor:
    """Each row's flow-matching loss: the weighted squared error of the transformer's velocity (or, with
    --precondition_outputs, of the clean latents it implies), averaged over the latent."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sigmas = (timesteps.float() / train_timesteps).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    hidden, pooled = text
    from cloudtrain.models.diffusion import compute_dtype  # here: diffusion imports this module

    dtype = compute_dtype(transformer)
    predicted = transformer(
        hidden_states=noisy.to(dtype),
        timestep=timesteps,
        encoder_hidden_states=hidden.to(dtype),
        pooled_projections=pooled.to(dtype),
        return_dict=False,
    )[0].float()
    if cfg.precondition_outputs:  # EDM's preconditioning (Karras et al. 2022, section 5): the clean latents
        predicted, target = predicted * -sigmas + noisy, latents
    else:
        target = noise - latents
    weighting = compute_loss_weighting_for_sd3(cfg.weighting_scheme, sigmas).float()
    return (weighting * (predicted - target.float()) ** 2).mean(dim=(1, 2, 3))


def pixel_multiple(vae_factor: int, transformer_config: dict) -> int:
    """What a side in pixels must divide by: the VAE's factor times the transformer's patch size."""
    return vae_factor * int(transformer_config.get("patch_size", 1))


def largest_side(vae_factor: int, transformer_config: dict) -> int | None:
    """The longest side in pixels the transformer's position embedding covers (`pos_embed_max_size` patches:
    SD3 crops its embedding to the image), or None where it has no such limit."""
    patches = transformer_config.get("pos_embed_max_size")
    return pixel_multiple(vae_factor, transformer_config) * int(patches) if patches else None


def render_options(cfg: ImagesConfig) -> dict:
    """What the pipeline call adds for SD3: T5's prompt length as trained."""
    return {"max_sequence_length": cfg.max_sequence_length}
