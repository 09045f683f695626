"""Options of text-to-image fine-tuning (`--task text_to_image`): the images, their captions, DreamBooth, the
diffusion loss and the validation images. Names follow diffusers' example training scripts."""

from dataclasses import dataclass

from cloudtrain.config.fields import OnlyFields, opt
from cloudtrain.errors import UserError

PREDICTION_TYPES = ("epsilon", "v_prediction")
WEIGHTING_SCHEMES = ("logit_normal", "sigma_sqrt", "mode", "cosmap", "none")


@dataclass
class ImagesConfig(OnlyFields):
    train_data_dir: str | None = opt(
        None,
        "Text-to-image: a folder of images with their captions, in metadata.jsonl or metadata.csv (file_name and "
        "--caption_column per row) or in a <image name>.txt file beside each image.",
        path=True,
    )
    image_column: str = opt("image", "Text-to-image with --dataset_name: the column holding the images.")
    caption_column: str = opt("text", "Text-to-image: the caption column of metadata.jsonl/.csv or --dataset_name.")
    instance_data_dir: str | None = opt(
        None, "DreamBooth: a folder of images of the subject, all captioned with --instance_prompt.", path=True
    )
    instance_prompt: str | None = opt(None, "DreamBooth: the prompt naming the subject, e.g. 'a photo of sks dog'.")
    class_data_dir: str | None = opt(
        None, "DreamBooth: a folder of images of the subject's class, for --with_prior_preservation.", path=True
    )
    class_prompt: str | None = opt(None, "DreamBooth: the prompt of the class images, e.g. 'a photo of a dog'.")
    with_prior_preservation: bool = opt(
        False,
        "DreamBooth: also train on the class images, so the model keeps what the class looks like; the loss "
        "is the instance loss plus --prior_loss_weight times the class loss.",
    )
    prior_loss_weight: float = opt(1.0, "DreamBooth: the weight of the class images' loss.")
    resolution: int = opt(512, "Text-to-image: images are resized (shorter side) and cropped to this square size.")
    aspect_ratio_bucketing: bool = opt(
        False,
        "Text-to-image: train on buckets of sizes near --resolution squared (sides in multiples of 8 latent "
        "pixels, 64 px for SDXL) instead of square crops; each image goes to the bucket of nearest aspect ratio "
        "and every step's images come from one bucket (kohya's --enable_bucket).",
    )
    center_crop: bool = opt(False, "Text-to-image: crop the centre of each image (default: a random crop).")
    random_flip: bool = opt(False, "Text-to-image: flip training images horizontally at random.")
    prediction_type: str | None = opt(
        None, "Text-to-image: what the denoiser predicts (default: the scheduler config's).", PREDICTION_TYPES
    )
    snr_gamma: float | None = opt(
        None, "Text-to-image: Min-SNR loss weighting with this gamma (5.0 is the paper's; default: unweighted)."
    )
    noise_offset: float = opt(0.0, "Text-to-image: the scale of the per-channel offset added to the noise.")
    weighting_scheme: str = opt(
        "logit_normal",
        "Text-to-image, SD3 (flow matching): how training noise levels are drawn and weighted: logit_normal "
        "(--logit_mean, --logit_std) or mode (--mode_scale) draw them from that density; sigma_sqrt and cosmap "
        "draw uniformly and weight the loss; none: uniform, unweighted.",
        WEIGHTING_SCHEMES,
    )
    logit_mean: float = opt(0.0, "Text-to-image, SD3: the mean of --weighting_scheme logit_normal.")
    logit_std: float = opt(1.0, "Text-to-image, SD3: the standard deviation of --weighting_scheme logit_normal.")
    mode_scale: float = opt(1.29, "Text-to-image, SD3: the scale of --weighting_scheme mode.")
    precondition_outputs: bool = opt(
        True,
        "Text-to-image, SD3: take the loss on the clean latents the transformer's velocity implies (EDM's "
        "preconditioning, as diffusers' SD3 script by default), else on the velocity (noise - latents) itself.",
    )
    max_sequence_length: int = opt(
        77, "Text-to-image, SD3: the T5 encoder's prompt length (tokens), in training and for validation images."
    )
    proportion_empty_prompts: float = opt(
        0.0,
        "Text-to-image: the share of training captions replaced by the empty prompt, so the model also learns "
        "the unconditional prediction that classifier-free guidance (--validation_guidance_scale > 1) needs.",
    )
    train_text_encoder: bool = opt(
        False,
        "Text-to-image: train the text encoder too: in full without --peft, else with adapters on its attention "
        "projections (q_proj, k_proj, v_proj, out_proj), saved in the LoRA file beside the denoiser's.",
    )
    cache_latents: bool = opt(
        False, "Text-to-image: encode every image with the VAE once, before training (each keeps one crop and flip)."
    )
    pre_compute_text_embeddings: bool = opt(
        False, "Text-to-image: encode every caption with the text encoder once, before training."
    )
    validation_prompts: list = opt(
        [],
        "Text-to-image: prompts rendered at each evaluation with a fixed seed, saved as a grid under "
        "<output_dir>/validation and logged to the trackers, separated by '|'.",
        separator="|",
    )
    validation_steps: int | None = opt(
        None,
        "Text-to-image: evaluate, and render the validation prompts, every N steps (sets --eval_strategy steps "
        "--eval_steps N).",
    )
    validation_inference_steps: int = opt(30, "Text-to-image: denoising steps of each validation image.")
    validation_guidance_scale: float = opt(7.5, "Text-to-image: classifier-free guidance of the validation images.")

    def check(self) -> None:
        if self.resolution <= 0:
            raise UserError("--resolution must be positive")
        for name in ("prior_loss_weight", "noise_offset"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must not be negative")
        if not 0 <= self.proportion_empty_prompts < 1:
            raise UserError("--proportion_empty_prompts must be in [0, 1)")
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            raise UserError("--snr_gamma must be positive")
        if self.logit_std <= 0:
            raise UserError("--logit_std must be positive")
        if not 0 < self.max_sequence_length <= 512:
            raise UserError("--max_sequence_length must be in [1, 512] (T5's limit in StableDiffusion3Pipeline)")
        for name in ("validation_steps", "validation_inference_steps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name} must be positive")
        if self.train_text_encoder and self.pre_compute_text_embeddings:
            raise UserError(
                "--train_text_encoder changes the text embeddings as it trains: leave out --pre_compute_text_embeddings"
            )
        if self.train_data_dir and self.instance_data_dir:
            raise UserError("give --train_data_dir (captioned images) or --instance_data_dir (DreamBooth), not both")
        if self.instance_data_dir and not self.instance_prompt:
            raise UserError("--instance_data_dir needs --instance_prompt, e.g. 'a photo of sks dog'")
        if self.with_prior_preservation and not (self.class_data_dir and self.class_prompt):
            raise UserError("--with_prior_preservation needs --class_data_dir and --class_prompt")
        if self.aspect_ratio_bucketing and self.with_prior_preservation:
            raise UserError(
                "--aspect_ratio_bucketing puts each image in a bucket of its own shape, and a class image would "
                "join its instance image's batch: leave out one of it and --with_prior_preservation"
            )
        if self.with_prior_preservation and not self.instance_data_dir:
            raise UserError("--with_prior_preservation is DreamBooth's: give --instance_data_dir and --instance_prompt")

    @property
    def dreambooth(self) -> bool:
        return self.instance_data_dir is not None
