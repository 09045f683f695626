"""A diffusers text-to-image pipeline as one trainable module (`--task text_to_image`; docs/text-to-image.md).

`TextToImageModel` holds the denoiser (trained in full, or with LoRA/DoRA through PEFT after `attach_lora`), the
VAE and the text encoders (frozen), and the training noise schedule. The denoiser is a UNet (Stable Diffusion
1.x/2.x, SDXL: cloudtrain.models.sdxl) trained on noise or v-prediction, or SD3's transformer trained by flow
matching (cloudtrain.models.sd3). Its forward takes a batch and returns each
row's diffusion loss, so the trainers, DDP and DeepSpeed treat it as any other model; `save_pretrained` writes
what diffusers loads: the LoRA under PEFT's names through diffusers' save_lora_weights
(`pipeline.load_lora_weights(output_dir)`), or the whole pipeline after full fine-tuning.
"""

import functools
import importlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cloudtrain.config import Config, ModelConfig
from cloudtrain.errors import UserError, first_line
from cloudtrain.evaluation import eval_mode
from cloudtrain.models import sd3, sdxl
from cloudtrain.observe import console

MODEL_INDEX = "model_index.json"
NEEDED = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the attention projections diffusers' LoRA scripts adapt
TEXT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]  # the same in a CLIP text encoder
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# what a pipeline repo holds beyond the default weights (other formats, variants): never downloaded
SKIPPED_FILES = [
    "*.ckpt",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.h5",
    "*.pb",
    "*openvino*",
    "*.fp16.*",
    "*.non_ema.*",
]
OPTIONAL = ("safety_checker", "feature_extractor", "image_encoder")  # passed as None: not loaded to train
PARTS = ("unet", "transformer", "vae", *sd3.ENCODERS, "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler")


@functools.cache
def local_pipeline(name: str) -> str:
    """The folder of the pipeline --model_name_or_path names: a local folder as given, a Hub id downloaded once
    (the parts this task reads, default weights only) into the Hub cache. HF_ENDPOINT, HF_TOKEN and
    HF_HUB_OFFLINE (the cached copy only) are huggingface_hub's own, as for the text tasks."""
    from cloudtrain.paths import resolve_model_path

    path = resolve_model_path(ModelConfig(model_name_or_path=name))
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(
            path,
            allow_patterns=[MODEL_INDEX, *(f"{part}/*" for part in PARTS)],
            ignore_patterns=SKIPPED_FILES,
        )
    except LocalEntryNotFoundError as err:  # offline, or the endpoint unreachable, with nothing cached
        raise UserError(
            f"--model_name_or_path {name}: no cached copy and the Hub cannot be reached ({first_line(err)}); "
            "connect (or check HF_ENDPOINT), or give a local pipeline folder"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:  # not found, gated, private without a token
        raise UserError(
            f"--model_name_or_path {name} could not be downloaded from the Hub: {first_line(err)} (a private or "
            "gated repo needs HF_TOKEN or `hf auth login`)"
        ) from None


def read_model_index(path: str) -> dict:
    """The pipeline's model_index.json, checked for the parts this task trains with; one line when it is not a
    diffusers text-to-image pipeline."""
    folder = Path(path)
    index_file = folder / MODEL_INDEX
    if not index_file.is_file():
        raise UserError(
            f"--model_name_or_path {path} is not a diffusers pipeline (no {MODEL_INDEX}); --task text_to_image "
            "needs a folder written by DiffusionPipeline.save_pretrained (unet, vae, text_encoder, tokenizer, "
            "scheduler)"
        )
    try:
        index = json.loads(index_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{index_file} is not valid JSON ({first_line(err)})") from None
    if not sd3.is_sd3(index) and ("transformer" in index or "unet" not in index):
        raise UserError(
            f"{path} is a {index.get('_class_name', 'diffusers')} pipeline; --task text_to_image trains Stable "
            "Diffusion 1.x/2.x, SDXL (a UNet and CLIP text encoders) and Stable Diffusion 3 pipelines so far"
        )
    if sd3.is_sd3(index):
        needed = sd3.NEEDED + (sd3.T5 if sd3.has_t5(index) else ())
    else:
        needed = (*NEEDED, *sdxl.SECOND_ENCODER) if "text_encoder_2" in index else NEEDED
    missing = [name for name in needed if not isinstance(index.get(name), list) or index[name][0] is None]
    missing += [name for name in needed if name not in missing and not (folder / name).is_dir()]
    if missing:
        raise UserError(f"the diffusers pipeline in {path} lacks {', '.join(missing)}; it needs {', '.join(needed)}")
    return index


def vae_scale_factor(path: str) -> int:
    """How many pixels one latent covers along a side: 2 ** (VAE blocks - 1), 8 for Stable Diffusion."""
    config = Path(path) / "vae" / "config.json"
    try:
        blocks = json.loads(config.read_text()).get("block_out_channels", [0] * 4)
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"could not read the VAE config {config}: {first_line(err)}") from None
    return 2 ** (len(blocks) - 1)


def load_component(path: str, name: str, index: dict, dtype: torch.dtype | str) -> Any:
    """One part of the pipeline, by the library and class model_index.json names for it (in `dtype`, or "auto":
    as stored)."""
    library, class_name = index[name]
    try:
        cls = getattr(importlib.import_module(library), class_name)
        if name == "scheduler" and not sd3.is_sd3(index):
            from diffusers import DDPMScheduler  # training adds noise as DDPM does, whatever the pipeline samples with

            return DDPMScheduler.from_pretrained(path, subfolder=name)
        if name == "scheduler":  # SD3: its own flow-matching schedule (the training sigmas)
            return cls.from_pretrained(path, subfolder=name)
        if name == "tokenizer":
            return cls.from_pretrained(path, subfolder=name)
        key = "torch_dtype" if library == "diffusers" else "dtype"
        return cls.from_pretrained(path, subfolder=name, **{key: dtype})
    except (OSError, ValueError, AttributeError, ImportError, RuntimeError) as err:
        raise UserError(f"could not load the {name} of {path}: {first_line(err)}") from None


class TextToImageModel(torch.nn.Module):
    """The denoiser, VAE and text encoders of a pipeline; forward gives each row's diffusion loss. The denoiser
    is the attribute its pipeline names it by: `unet`, or SD3's `transformer` (`denoiser` either way)."""

    def __init__(self, path: str, index: dict, components: dict, cfg: Config):
        super().__init__()
        self.path, self.index, self.images = path, index, cfg.images
        self.flow = sd3.is_sd3(index)  # flow matching (cloudtrain.models.sd3), else noise or v-prediction
        self.denoiser_name = "transformer" if self.flow else "unet"
        setattr(self, self.denoiser_name, components[self.denoiser_name])
        self.vae, self.text_encoder = components["vae"], components["text_encoder"]
        self.text_encoder_2 = components.get("text_encoder_2")  # SDXL's or SD3's second CLIP encoder
        self.text_encoder_3 = components.get("text_encoder_3")  # SD3's T5: always frozen
        self.noise_scheduler = components["scheduler"]
        self.vae.requires_grad_(False)
        for encoder in self.frozen_encoders():
            encoder.requires_grad_(False)
        self.lora = False  # until attach_lora: the whole denoiser trains
        # --train_text_encoder: in full here (without --peft), or its adapters once attach_lora adds them
        self.text_encoder_trains = cfg.images.train_text_encoder
        if self.text_encoder_trains and cfg.model.peft == "none":
            for encoder in self.text_encoders():
                encoder.requires_grad_(True)
        # the empty prompt's tokens, for each tokenizer (--proportion_empty_prompts)
        self.empty_ids: list[torch.Tensor | None] = []
        if self.flow:
            self.prediction_type = "flow_matching"
            return
        self.prediction_type = cfg.images.prediction_type or self.noise_scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise UserError(f"the scheduler of {path} predicts {self.prediction_type}; use --prediction_type")

    @property
    def denoiser(self) -> Any:
        return getattr(self, self.denoiser_name)

    @property
    def xl(self) -> bool:
        return self.text_encoder_2 is not None and not self.flow

    def text_encoders(self) -> list[Any]:
        """The CLIP encoders --train_text_encoder trains (transformers models: add_adapter is PEFT's)."""
        return [self.text_encoder] + ([self.text_encoder_2] if self.text_encoder_2 is not None else [])

    def frozen_encoders(self) -> list[Any]:
        """Every text encoder, T5 included (never trained: it is large and diffusers' scripts keep it frozen)."""
        return self.text_encoders() + ([self.text_encoder_3] if self.text_encoder_3 is not None else [])

    def attach_lora(self, cfg: Config) -> "TextToImageModel":
        """LoRA (or DoRA, --peft dora) on the denoiser's --lora_target_modules through diffusers' PEFT
        integration, so the adapter saves under PEFT's names (diffusers' save_lora_weights); the rest of the
        denoiser frozen."""
        from peft import LoraConfig

        m = cfg.model
        targets = lora_targets(cfg, self.index)
        self.denoiser.requires_grad_(False)
        config = LoraConfig(
            r=m.lora_r,
            lora_alpha=m.lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int, scales by any number
            lora_dropout=m.lora_dropout,
            init_lora_weights="gaussian",
            target_modules=targets,
            use_dora=m.peft == "dora",
        )
        try:
            self.denoiser.add_adapter(config)
        except ValueError as err:
            raise UserError(f"--lora_target_modules {','.join(targets)}: {first_line(err)}") from None
        if self.text_encoder_trains:  # diffusers' scripts adapt the CLIP attention projections
            for encoder in self.text_encoders():
                encoder.requires_grad_(False)
                encoder.add_adapter(replace(config, target_modules=TEXT_LORA_TARGETS))
        for param in self.parameters():
            if param.requires_grad:
                param.data = param.data.float()  # what the optimizer updates is fp32, whatever the base's dtype
        self.lora = True
        return self

    def train(self, mode: bool = True) -> "TextToImageModel":
        super().train(mode)
        self.vae.eval()  # frozen: never in training mode (no dropout)
        for encoder in self.frozen_encoders():
            encoder.train(mode and self.text_encoder_trains and encoder is not self.text_encoder_3)
        return self

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """What models.prepare calls for --gradient_checkpointing: the denoiser recomputes its blocks."""
        self.denoiser.enable_gradient_checkpointing()

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent distribution (mean, std), scaled as the denoiser sees latents."""
        dist = self.vae.encode(pixel_values.to(compute_dtype(self.vae))).latent_dist
        scale, shift = self.vae.config.scaling_factor, getattr(self.vae.config, "shift_factor", None) or 0.0
        return (dist.mean.float() - shift) * scale, dist.std.float() * scale

    def encode_prompts(
        self,
        input_ids: torch.Tensor | None,
        input_ids_2: torch.Tensor | None = None,
        input_ids_3: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states, pooled embedding): the text encoder's last hidden states and no pooled one, SDXL's
        pair (cloudtrain.models.sdxl.encode) or SD3's (cloudtrain.models.sd3.encode); with gradients only where
        they train (--train_text_encoder)."""
        assert input_ids is not None
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.text_encoder_trains):
            if self.flow:
                encoders = [self.text_encoder, self.text_encoder_2, self.text_encoder_3]
                joint = self.denoiser.config.joint_attention_dim
                return sd3.encode(
                    encoders, [input_ids, input_ids_2, input_ids_3], joint, self.images.max_sequence_length
                )
            if self.text_encoder_2 is None:
                return self.text_encoder(input_ids)[0], None
            assert input_ids_2 is not None
            return sdxl.encode(self.text_encoder, self.text_encoder_2, input_ids, input_ids_2)

    def text_states(
        self,
        ids: tuple[torch.Tensor | None, ...],
        cached: tuple[torch.Tensor | None, torch.Tensor | None],
        empty: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captions' (hidden states, pooled embedding), cached or encoded now from `ids` (each tokenizer's),
        the empty prompt's on the rows `empty` marks."""
        tokens, (hidden, pooled) = list(ids), cached
        if empty is not None:  # present only when some row draws the empty prompt
            assert self.empty_ids, "set by the task with --proportion_empty_prompts"
            blanks = [None if b is None else b.to(empty.device)[None] for b in self.empty_ids]
            if tokens[0] is not None:
                tokens = [
                    t if t is None or blank is None else torch.where(empty[:, None], blank, t)
                    for t, blank in zip(tokens, blanks, strict=False)
                ]
            else:
                assert hidden is not None and blanks[0] is not None
                blank_hidden, blank_pooled = self.encode_prompts(*blanks)
                hidden = torch.where(empty[:, None, None], blank_hidden.to(hidden.dtype), hidden)
                if pooled is not None and blank_pooled is not None:
                    pooled = torch.where(empty[:, None], blank_pooled.to(pooled.dtype), pooled)
        if hidden is not None:
            return hidden, pooled
        assert tokens[0] is not None
        return self.encode_prompts(*tokens)

    def draw_timesteps(self, rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """`rows` training timesteps: uniform over the DDPM schedule, or SD3's by --weighting_scheme."""
        if self.flow:
            return sd3.draw_timesteps(self.noise_scheduler, self.images, rows, generator)
        return torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (rows,), generator=generator)

    def forward(
        self,
        attention_mask: torch.Tensor,
        loss_weight: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        latent_mean: torch.Tensor | None = None,
        latent_std: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        input_ids_2: torch.Tensor | None = None,  # SDXL and SD3: the second tokenizer's ids
        input_ids_3: torch.Tensor | None = None,  # SD3: T5's ids
        pooled_prompt_embeds: torch.Tensor | None = None,  # SDXL and SD3: cached pooled embeddings
        time_ids: torch.Tensor | None = None,  # SDXL: each row's sizes and crop (cloudtrain.models.sdxl.time_ids)
        is_prior: torch.Tensor | None = None,
        row: torch.Tensor | None = None,  # the rows' numbers, which the task draws by (unused here)
        repeat: torch.Tensor | None = None,  # which repetition of its row in the step (drawn by; unused here)
        noise: torch.Tensor | None = None,
        timesteps: torch.Tensor | None = None,
        latent_noise: torch.Tensor | None = None,
        flip: torch.Tensor | None = None,
        empty_caption: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row's loss: MSE between the denoiser's prediction and its target (the noise, or the velocity
        under v-prediction), averaged over the latent, Min-SNR weighted with --snr_gamma; SD3's flow-matching
        loss (cloudtrain.models.sd3.flow_loss). Cached latents and text embeddings are used when the batch holds
        them. The task passes each row's draws (cloudtrain.tasks.text_to_image.row_draws): `noise`,
        `timesteps`, the latent sample's `latent_noise`, `flip` and `empty_caption` (--proportion_empty_prompts);
        any left out is drawn here from the global generator. An SDXL denoiser also gets the pooled embedding
        and `time_ids` (cloudtrain.models.sdxl), SD3's the pooled projections."""
        if latent_mean is None:
            assert pixel_values is not None
            if flip is not None:
                pixel_values = torch.where(flip[:, None, None, None], pixel_values.flip(-1), pixel_values)
            latent_mean, latent_std = self.encode_images(pixel_values)
        assert latent_std is not None
        # a sample of each image's latent distribution while training; its mean in evaluation (no draw)
        if self.training:
            latents = latent_mean + latent_std * (
                latent_noise if latent_noise is not None else torch.randn_like(latent_mean)
            )
        else:
            latents = latent_mean
        encoder_hidden_states, pooled = self.text_states(
            (input_ids, input_ids_2, input_ids_3), (encoder_hidden_states, pooled_prompt_embeds), empty_caption
        )
        rows = latents.shape[0]
        if noise is None:
            noise = torch.randn_like(latents)
            if self.images.noise_offset:  # a per-channel shift: learns darker and brighter images than the mean
                noise = noise + self.images.noise_offset * torch.randn(
                    rows, latents.shape[1], 1, 1, device=noise.device
                )
        if timesteps is None:
            timesteps = self.draw_timesteps(rows).to(latents.device)
        if self.flow:
            assert pooled is not None
            steps = self.noise_scheduler.config.num_train_timesteps
            return sd3.flow_loss(
                self.denoiser, latents, noise, timesteps, (encoder_hidden_states, pooled), self.images, steps
            )
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        target = (
            noise if self.prediction_type == "epsilon" else self.noise_scheduler.get_velocity(latents, noise, timesteps)
        )
        dtype = compute_dtype(self.denoiser)
        added = None
        if self.xl:
            assert pooled is not None and time_ids is not None
            added = sdxl.added_cond(pooled, time_ids, dtype)
        # in the denoiser's dtype: DeepSpeed's bf16/fp16 engine casts the model and runs without autocast, and
        # the UNet embeds the timesteps in the dtype of its input
        predicted = self.denoiser(
            noisy.to(dtype),
            timesteps,
            encoder_hidden_states.to(dtype),
            added_cond_kwargs=added,
            return_dict=False,
        )[0]
        loss = F.mse_loss(predicted.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        return loss * self.snr_weights(timesteps) if self.images.snr_gamma else loss

    def snr_weights(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR for noise prediction, / (SNR + 1) for v."""
        from diffusers.training_utils import compute_snr

        snr = compute_snr(self.noise_scheduler, timesteps).float()
        clipped = torch.clamp(snr, max=self.images.snr_gamma)
        return clipped / (snr + 1) if self.prediction_type == "v_prediction" else clipped / snr

    # ---------------------------------------------------------------- saving and sampling

    def save_pretrained(self, output_dir: str | Path, state_dict: dict | None = None) -> None:
        """The LoRA as diffusers' pytorch_lora_weights.safetensors, or the whole pipeline after full training.
        `state_dict` (gathered under ZeRO-3 or FSDP2) holds this module's weights when given."""
        parts = self._saved_parts(state_dict)
        if not self.lora:
            # the frozen parts as the base holds them, in fp32 like the trained ones: those in the compute dtype
            # beside an fp32 denoiser made a pipeline that from_pretrained loads and cannot run (mixed dtypes)
            # (trained or not by the live part: under FSDP2 `parts` holds fresh copies, every weight trainable).
            # SD3's T5 stays as stored (fp16 in the Hub's SD3: 9.5 GB, not 19): its pipeline casts T5's states
            modules = {
                name: module
                if any(p.requires_grad for p in getattr(self, name).parameters())
                else load_component(self.path, name, self.index, "auto" if name == "text_encoder_3" else torch.float32)
                for name, (module, _) in parts.items()
            }
            self.pipeline(modules=modules).save_pretrained(output_dir)
            return
        from peft.utils import get_peft_model_state_dict

        saved: dict[str, Any] = {}
        for name, (module, own) in parts.items():
            if getattr(module, "peft_config", None):
                # PEFT's names (lora_A/lora_B), which every pipeline's loader reads: diffusers' conversion to its
                # own names (lora.down/up) renames only attention layers, and its loader then drops one of the two
                # kinds (an SDXL LoRA on attention and feed-forward layers lost 32 of its 48 adapters)
                saved[f"{name}_lora_layers"] = get_peft_model_state_dict(module, state_dict=own)
                # lora_alpha: the scale diffusers loads it with
                saved[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
        self.pipeline_class().save_lora_weights(output_dir, safe_serialization=True, **saved)

    def _saved_parts(self, state_dict: dict | None) -> dict[str, tuple[Any, dict | None]]:
        """Each part with the weights to save: `state_dict`'s, loaded into the part where its parameters are
        whole (ZeRO-3 leaves them whole in shape); FSDP2's are shards (DTensors), which take no plain tensor, so
        a fully trained part is read again from the pipeline folder and the gathered weights go into that copy
        (a LoRA is taken from the gathered weights alone)."""
        parts: dict[str, tuple[Any, dict | None]] = {}
        for part in (self.denoiser_name, "vae", *sd3.ENCODERS):
            module = getattr(self, part)
            if module is None:
                continue
            if state_dict is None:
                parts[part] = (module, None)
                continue
            own = {k.removeprefix(f"{part}."): v for k, v in state_dict.items() if k.startswith(f"{part}.")}
            if _sharded(module):
                if not self.lora:
                    dtype = next(iter(own.values())).dtype
                    module = load_component(self.path, part, self.index, dtype)
                    module.load_state_dict(own)
            else:
                module.load_state_dict(own, strict=False)
            parts[part] = (module, own)
        return parts

    def pipeline_class(self) -> Any:
        import diffusers

        return getattr(diffusers, self.index.get("_class_name", "StableDiffusionPipeline"))

    def pipeline(self, tokenizers: dict | None = None, modules: dict | None = None) -> Any:
        """The diffusers pipeline over these very modules (the denoiser as it trains, adapters active), or over
        `modules` (saving: unsharded copies); `tokenizers` by part name (tokenizer, tokenizer_2, tokenizer_3)."""
        parts: dict[str, Any] = {self.denoiser_name: self.denoiser, "vae": self.vae}
        parts.update({name: getattr(self, name) for name in sd3.ENCODERS if getattr(self, name) is not None})
        parts.update(modules or {})
        parts.update({name: given for name, given in (tokenizers or {}).items() if given is not None})
        for optional in OPTIONAL:
            if optional in self.index:
                parts[optional] = None
        # a part the base was saved without ([null, null]: SD3 without T5) is passed as None, or from_pretrained
        # refuses the pipeline (the trained model was lost at save, a LoRA run stopped at its first render)
        parts.update({name: None for name in absent_parts(self.index) if name not in parts})
        if "requires_safety_checker" in self.index:
            parts["requires_safety_checker"] = False
        console.follow_in_diffusers()  # its "Loading pipeline components" bar, in a log file too
        pipe = self.pipeline_class().from_pretrained(self.path, **parts)
        if not self.flow and pipe.scheduler.config.prediction_type != self.prediction_type:  # --prediction_type
            # what the denoiser learned to predict: rendered and saved with the base's, its images were noise
            pipe.scheduler = type(pipe.scheduler).from_config(
                pipe.scheduler.config, prediction_type=self.prediction_type
            )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @torch.no_grad()
    def render(self, prompts: list[str], tokenizers: dict, seed: int, autocast: Any = None) -> list:
        """One image per prompt, each from the same seed: the same prompts look alike from one evaluation to
        the next, so what changes is what the model learnt."""
        images, cfg = [], self.images
        pipe = self.pipeline(tokenizers)
        device = next(self.denoiser.parameters()).device
        extra = sd3.render_options(cfg) if self.flow else {}
        with eval_mode(self):
            for prompt in prompts:
                generator = torch.Generator(device=device).manual_seed(seed)
                with autocast() if autocast else torch.autocast(device.type, enabled=False):
                    out = pipe(
                        prompt,
                        height=cfg.resolution,
                        width=cfg.resolution,
                        num_inference_steps=cfg.validation_inference_steps,
                        guidance_scale=cfg.validation_guidance_scale,
                        generator=generator,
                        **extra,
                    )
                images.append(out.images[0])
        return images


def compute_dtype(module: Any) -> torch.dtype:
    """A diffusers model's `.dtype`, computed once per dtype of its first parameter. diffusers' property walks
    every submodule (for a layerwise-casting hook) and its parameters at each call: 1.2 ms per step on the demo's
    UNet with LoRA, half the gap to the reference loop in bench/t2i_interleaved.py. A cast of the whole model
    (DeepSpeed's fp16/bf16 engine, `.to(dtype)`) changes the first parameter's dtype, which computes it again."""
    first = next(module.parameters()).dtype
    cached = module.__dict__.get("_cloudtrain_dtype")
    if cached is None or cached[0] != first:
        cached = (first, module.dtype)
        module.__dict__["_cloudtrain_dtype"] = cached
    return cached[1]


def _sharded(module: torch.nn.Module) -> bool:
    """Whether FSDP2 holds the module's parameters as shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def lora_targets(cfg: Config, index: dict | None = None) -> list[str]:
    """--lora_target_modules, whose default (all-linear, a transformers notion) means diffusers' attention
    projections here: the UNet's, or both streams' of SD3's transformer (cloudtrain.models.sd3) when the
    pipeline's model_index.json `index` says SD3."""
    targets = cfg.model.lora_target_modules
    if targets == ["all-linear"]:
        return sd3.LORA_TARGETS if index is not None and sd3.is_sd3(index) else LORA_TARGETS
    return list(targets)


def denoiser_class(index: dict) -> tuple[str, Any]:
    """The denoiser's part name and class, as model_index.json names them."""
    import diffusers

    name = "transformer" if sd3.is_sd3(index) else "unet"
    return name, getattr(diffusers, index[name][1], diffusers.UNet2DConditionModel)


def check_lora_targets(path: str, targets: list[str]) -> None:
    """Each target names linear or convolution layers of the denoiser (as PEFT matches: the whole name or its
    dotted tail), checked on a weightless copy built from its config.json."""
    index = read_model_index(path)
    name, cls = denoiser_class(index)
    try:
        config = cls.load_config(path, subfolder=name)
    except OSError:  # diffusers: "... does not appear to have a file named config.json", with its traceback
        raise UserError(
            f"{path} names a {name} in model_index.json but has no {name}/config.json; give a whole diffusers "
            "pipeline folder (save_pretrained of the pipeline)"
        ) from None
    with torch.device("meta"):
        modules = dict(cls.from_config(config).named_modules())
    adaptable = {name for name, m in modules.items() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in adaptable):
            layers = sorted({name.rsplit(".", 1)[-1] for name in adaptable if not name.rsplit(".", 1)[-1].isdigit()})
            default = sd3.LORA_TARGETS if sd3.is_sd3(index) else LORA_TARGETS
            raise UserError(
                f"--lora_target_modules: {target} is not a linear or convolution layer of the denoiser in {path}; "
                f"its layers include {', '.join(layers)} (default: {','.join(default)})"
            )


def load_text_to_image_model(cfg: Config, path: str) -> TextToImageModel:
    """The pipeline's parts from `path`: frozen ones in the compute dtype (autocast would cast them anyway), the
    denoiser in fp32 when it trains in full; SD3's T5 in the compute dtype, never trained."""
    index = read_model_index(path)
    frozen = DTYPES.get(cfg.training.mixed_precision, torch.float32)
    denoiser, _ = denoiser_class(index)
    text_dtype = torch.float32 if cfg.images.train_text_encoder and cfg.model.peft == "none" else frozen
    dtypes = {denoiser: frozen if cfg.model.peft != "none" else torch.float32}
    dtypes.update({"text_encoder": text_dtype, "text_encoder_2": text_dtype})
    upcast = sdxl.is_xl(index) or sd3.is_sd3(index)
    if upcast and json.loads((Path(path) / "vae" / "config.json").read_text()).get("force_upcast", True):
        dtypes["vae"] = torch.float32  # SDXL's VAE overflows in fp16 (its config says so with force_upcast)
    names = [denoiser, "vae", "scheduler", *(e for e in sd3.ENCODERS if _listed(index, e))]
    components = {name: load_component(path, name, index, dtypes.get(name, frozen)) for name in names}
    return TextToImageModel(path, index, components, cfg)


def _listed(index: dict, name: str) -> bool:
    return isinstance(index.get(name), list) and index[name][0] is not None


def absent_parts(index: dict) -> list[str]:
    """The parts model_index.json lists as [null, null] (SD3 saved without T5: text_encoder_3, tokenizer_3) that
    its pipeline class does not take as optional: from_pretrained refuses the folder unless each is given as
    None, so the printed usage and the model card pass them."""
    return [
        name
        for name, entry in index.items()
        if not name.startswith("_") and isinstance(entry, list) and entry[:1] == [None] and name not in OPTIONAL
    ]


def none_arguments(index: dict) -> str:
    """`absent_parts` as from_pretrained's keyword arguments (", text_encoder_3=None, tokenizer_3=None")."""
    return "".join(f", {name}=None" for name in absent_parts(index))
