"""--task text_to_image: fine-tune a diffusers text-to-image pipeline on captioned images or DreamBooth.

The model is cloudtrain.models.diffusion.TextToImageModel (the denoiser trained in full, or with --peft lora|dora
through this task's adapter hooks; VAE and text encoder frozen), the rows come from cloudtrain.data.images, and
the loss is each image's diffusion loss: a batch's sum over its instance rows (DreamBooth's class rows add
--prior_loss_weight times theirs). Evaluation reports that loss at fixed noise and timesteps, and renders
--validation_prompts from a fixed seed. See docs/text-to-image.md.
"""

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import torch
from datasets import DatasetDict
from huggingface_hub import ModelCard
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from cloudtrain.config import Config, DataConfig
from cloudtrain.data import images
from cloudtrain.data.processing import ProcessedData
from cloudtrain.errors import UserError, first_line
from cloudtrain.evaluation import eval_mode, whole_root
from cloudtrain.models import diffusion, sd3, sdxl
from cloudtrain.registry import TASKS
from cloudtrain.registry_table import TASK_ROWS
from cloudtrain.tasks.base import Task

if TYPE_CHECKING:  # parallel.distributed loads accelerate: not at import
    from cloudtrain.parallel.distributed import Sharding

EVAL_ROWS = 8  # evaluation rows (the first training images) when --max_eval_samples is not given


@TASKS.register
class TextToImageTask(Task):
    name = "text_to_image"
    no_mfu = "the denoiser's work grows with the image size, not with the caption's tokens that the formula counts"
    summary = "captioned images (or DreamBooth) -> a diffusers text-to-image pipeline (LoRA or full)"
    reads_options = TASK_ROWS[name].reads_options  # the row says it for the parser too
    metrics = ("loss",)
    auto_class = AutoModel  # not used to load: load_model is the task's own (preflight asks every task for one)
    load_error = "could not load the diffusers pipeline"
    plans_pipeline = True  # the planner counts the pipeline's parts (cloudtrain.planning.diffusion)
    plans_micro_batch = False
    size_option = "resolution"

    def __init__(self, cfg: Config | None = None):
        super().__init__(cfg)
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.tokenizer_2: PreTrainedTokenizerBase | None = None  # SDXL's and SD3's second CLIP tokenizer
        self.tokenizer_3: PreTrainedTokenizerBase | None = None  # SD3's T5 tokenizer (cloudtrain.models.sd3)
        self.skipped = 0
        self.rendered: list[tuple[str, object]] = []  # the last evaluation's images, logged by `tables`
        self.micro_batches = 0  # training forward passes so far: the step each row's draws are keyed by

    # ---------------------------------------------------------------- before anything heavy

    def check_options(self, cfg: Config) -> None:
        m, ic = cfg.model, cfg.images
        if not m.model_name_or_path or m.model_config:
            raise UserError(
                "--task text_to_image needs --model_name_or_path <a diffusers pipeline folder or Hub id> "
                "(model_index.json with unet, vae, text_encoder, tokenizer, scheduler)"
            )
        for name in ("attn_implementation", "tokenizer_name_or_path"):
            if getattr(m, name):
                raise UserError(f"--{name} does not apply to --task text_to_image (the pipeline has its own)")
        if cfg.data.group_by_length:
            raise UserError("--group_by_length does not apply to --task text_to_image (every image has one size)")
        path = diffusion.local_pipeline(m.model_name_or_path)
        index = diffusion.read_model_index(path)
        _check_loss_options(cfg, index)
        factor = vae = diffusion.vae_scale_factor(path)
        what = "the VAE's downscaling factor"
        if sd3.is_sd3(index):
            transformer = diffusion.denoiser_class(index)[1].load_config(path, subfolder="transformer")
            _check_sd3_sides(ic, factor, transformer)
            factor = sd3.pixel_multiple(factor, transformer)
            what = "the VAE's downscaling factor times the transformer's patch size"
        if ic.resolution % factor:
            raise UserError(
                f"--resolution {ic.resolution} is not divisible by {factor}, {what} of {path}; use "
                f"{ic.resolution // factor * factor or factor} or {(ic.resolution // factor + 1) * factor}"
            )
        if ic.validation_prompts and ic.resolution % 8 and not sd3.is_sd3(index):  # diffusers' pipelines' rule
            raise UserError(
                f"--resolution {ic.resolution}: the validation images render at it, and the pipeline needs sides "
                f"divisible by 8; use {ic.resolution // 8 * 8 or 8} or {(ic.resolution // 8 + 1) * 8}"
            )
        if cfg.output.merge_adapters:  # its PEFT merge reads a text model's adapter files (found in audit)
            raise UserError(
                "--merge_adapters true merges a text model's adapter; a text-to-image LoRA loads into the base "
                "pipeline with load_lora_weights (and pipeline.fuse_lora() merges it there): drop the option"
            )
        if ic.aspect_ratio_bucketing and ic.resolution < (step := bucket_step(vae)):  # training's buckets' step
            raise UserError(
                f"--aspect_ratio_bucketing makes sides of multiples of {step} px (8 latent pixels): "
                f"--resolution {ic.resolution} is below that; use {step} or more"
            )
        self._check_sharding(cfg)

    def resolve_options(self, cfg: Config) -> Config:
        """--validation_steps N is diffusers' name for evaluating (and so rendering) every N steps; a folder
        given as --train_file (a SageMaker job's train channel) is read as --train_data_dir."""
        ic, d = cfg.images, cfg.data
        if not (ic.train_data_dir or ic.instance_data_dir or d.dataset_name) and d.train_file:
            if Path(d.train_file).is_dir():
                cfg = replace(cfg, images=replace(ic, train_data_dir=d.train_file), data=replace(d, train_file=None))
        every, t = cfg.images.validation_steps, cfg.training
        if every is None:
            return cfg
        if t.eval_steps not in (None, every) or t.eval_strategy == "no":  # it overrode them without a word (audit)
            given = f"--eval_steps {t.eval_steps}" if t.eval_steps not in (None, every) else "--eval_strategy no"
            raise UserError(
                f"--validation_steps {every} evaluates (and renders) every {every} steps, and {given} says otherwise: "
                "give one of them (--validation_steps N is --eval_strategy steps --eval_steps N)"
            )
        return replace(cfg, training=replace(t, eval_strategy="steps", eval_steps=every))

    def data_label(self, cfg: Config) -> str:
        folder = cfg.images.train_data_dir or cfg.images.instance_data_dir
        return Path(folder).name if folder else super().data_label(cfg)

    def check_data(self, cfg: Config) -> None:
        """Image folders are read here (names and captions, no pixels); only --dataset_name goes through the
        data sources, so a run on folders never looks for the built-in text data."""
        ic = cfg.images
        if ic.train_data_dir:
            images.captioned_examples(ic.train_data_dir, ic.caption_column, notes=False)  # (said when it is read)
        elif ic.dreambooth:
            images.dreambooth_examples(ic)
        elif cfg.data.dataset_name:
            super().check_data(cfg)
        else:
            raise UserError(
                "--task text_to_image needs images: --train_data_dir (captioned), --instance_data_dir with "
                "--instance_prompt (DreamBooth) or --dataset_name (with --image_column and --caption_column)"
            )

    def connect(self, cfg: Config) -> DatasetDict:
        """No splits for image folders (`process` reads them); a dataset's splits from the data sources."""
        if cfg.images.train_data_dir or cfg.images.dreambooth:
            return DatasetDict()
        return super().connect(cfg)

    def check_adapters(self, cfg: Config) -> None:
        """--peft lora|dora adapts the denoiser (diffusers' PEFT integration); qlora's 4-bit base is not built."""
        if cfg.model.peft == "none":
            return
        if cfg.model.peft == "qlora":
            raise UserError("--task text_to_image trains --peft lora or dora on the denoiser, not qlora")
        path = diffusion.local_pipeline(str(cfg.model.model_name_or_path))
        diffusion.check_lora_targets(path, diffusion.lora_targets(cfg, diffusion.read_model_index(path)))

    def attach_adapters(self, model: torch.nn.Module, cfg: Config, announce: bool = False) -> torch.nn.Module:
        assert isinstance(model, diffusion.TextToImageModel)
        return model.attach_lora(cfg)

    def save_tokenizer(self, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
        """Nothing at the root: a LoRA folder holds only the adapter (the base pipeline has the tokenizer), and a
        fully fine-tuned pipeline keeps its own in tokenizer/."""

    def sharding_refusal(self, cfg: Config, shards: "Sharding") -> str | None:
        """ZeRO-3's set-up sizes its buckets from a transformers model's config, which a diffusers pipeline has not
        (DeepSpeed stopped at start-up on "Can't find model.config entry"), and validation images would render on
        the main process from a sharded denoiser; FSDP2 shards the same states and renders in step on every
        process (`evaluation.whole_root`)."""
        if shards.zero_stage == 3:
            return (
                "--task text_to_image does not run under ZeRO-3 (--zero_stage 3); use --fsdp true, which shards the "
                "same states, or --zero_stage 2"
            )
        return None

    def _check_sharding(self, cfg: Config) -> None:
        from cloudtrain.parallel.distributed import sharding

        refusal = self.sharding_refusal(cfg, sharding(cfg))
        if refusal:
            raise UserError(refusal)

    def columns(self, cfg: DataConfig) -> dict[str, tuple[str, bool]]:
        ic = self.cfg.images if self.cfg else None
        if ic is None or ic.train_data_dir or ic.dreambooth:
            return {}  # folders are read by cloudtrain.data.images, not by the data sources
        return {"--image_column": (ic.image_column, False), "--caption_column": (ic.caption_column, False)}

    # ---------------------------------------------------------------- data and model

    def load_tokenizer(self, cfg: Config) -> PreTrainedTokenizerBase:
        """The pipeline's tokenizer; an SDXL or SD3 pipeline's second is kept as `tokenizer_2`, SD3's T5
        tokenizer (when the pipeline has T5) as `tokenizer_3`."""
        path = diffusion.local_pipeline(str(cfg.model.model_name_or_path))
        index = diffusion.read_model_index(path)
        self.tokenizer_2 = _read_tokenizer(path, "tokenizer_2") if sdxl.is_xl(index) or sd3.is_sd3(index) else None
        self.tokenizer_3 = _read_tokenizer(path, "tokenizer_3") if sd3.is_sd3(index) and sd3.has_t5(index) else None
        return _read_tokenizer(path, "tokenizer")

    def _tokens(self, caption: str) -> dict:
        assert self.tokenizer is not None and self.cfg is not None
        t5_length = self.cfg.images.max_sequence_length
        return _tokens(self.tokenizer, self.tokenizer_2, caption, self.tokenizer_3, t5_length)

    def tokenizers(self) -> dict[str, Any]:
        """The pipeline's tokenizers by part name, for rendering."""
        return {"tokenizer": self.tokenizer, "tokenizer_2": self.tokenizer_2, "tokenizer_3": self.tokenizer_3}

    def process(self, raw: DatasetDict, tokenizer: PreTrainedTokenizerBase, cfg: Config) -> ProcessedData:
        ic = cfg.images
        self.tokenizer = tokenizer
        examples, class_examples = self._examples(raw, cfg)
        # --max_train_samples: the first N readable images, read no further (skipped ones leave N where possible)
        examples, self.skipped = images.readable(
            examples, ic.resolution, "training", ic.aspect_ratio_bucketing, limit=cfg.data.max_train_samples
        )
        if class_examples:
            class_examples, skipped = images.readable(class_examples, ic.resolution, "class")
            self.skipped += skipped
        if self.skipped:
            print(f"warning: skipped {self.skipped} images that could not be read", flush=True)
        tokens = functools.lru_cache(maxsize=None)(self._tokens)
        evaluated = examples[: cfg.data.max_eval_samples or EVAL_ROWS]
        xl = sdxl.is_xl(diffusion.read_model_index(diffusion.local_pipeline(str(cfg.model.model_name_or_path))))
        return ProcessedData(
            train=images.ImageRows(
                examples,
                tokens,
                ic,
                train=True,
                class_examples=class_examples,
                size_ids=xl,
                buckets=self._buckets(cfg),  # type: ignore[arg-type]
            ),
            validation=images.ImageRows(evaluated, tokens, ic, train=False, size_ids=xl),  # type: ignore[arg-type]
            test=None,
            collator=functools.partial(images.collate, prior_loss_weight=ic.prior_loss_weight),
            prompts=list(ic.validation_prompts),
        )

    def _buckets(self, cfg: Config) -> list[tuple[int, int]] | None:
        """--aspect_ratio_bucketing's sizes: near --resolution squared, sides in multiples of 8 latent pixels
        (the VAE's factor x 8: 64 px for SDXL), so every denoiser level halves them evenly."""
        if not cfg.images.aspect_ratio_bucketing:
            return None
        from cloudtrain.data.image_buckets import bucket_sizes

        factor = diffusion.vae_scale_factor(diffusion.local_pipeline(str(cfg.model.model_name_or_path)))
        return bucket_sizes(cfg.images.resolution**2, bucket_step(factor))

    def _examples(self, raw: DatasetDict, cfg: Config) -> tuple[list[images.Example], list[images.Example]]:
        ic = cfg.images
        if ic.dreambooth:
            return images.dreambooth_examples(ic)
        if ic.train_data_dir:
            return images.captioned_examples(ic.train_data_dir, ic.caption_column), []
        train = raw["train"]
        feature = train.features[ic.image_column]
        texts = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")  # image paths
        if not (isinstance(feature, datasets.Image) and feature.decode) and not texts:
            raise UserError(
                f"--image_column {ic.image_column} of --dataset_name {cfg.data.dataset_name} holds {feature}, not "
                "images or image paths; name the column that holds the images"
            )
        captions = train[ic.caption_column]
        unset = [i for i, caption in enumerate(captions) if not isinstance(caption, str)]
        if unset:  # str(None) would train on the caption "None"
            raise UserError(
                f"{len(unset)} rows of --dataset_name {cfg.data.dataset_name} have no {ic.caption_column!r} text "
                f"(first: row {unset[0]}, {captions[unset[0]]!r}); caption them, or drop those rows"
            )
        return [images.Example(images.DatasetImage(train, i, ic.image_column), c) for i, c in enumerate(captions)], []

    def load_model(
        self, cfg: Config, data: ProcessedData, tokenizer: PreTrainedTokenizerBase, announce: bool
    ) -> torch.nn.Module:
        self.tokenizer = tokenizer
        model = diffusion.load_text_to_image_model(cfg, diffusion.local_pipeline(str(cfg.model.model_name_or_path)))
        empty = self._tokens("")  # what --proportion_empty_prompts trains with
        model.empty_ids = [empty.get(key) for key in ("input_ids", "input_ids_2", "input_ids_3")]
        ic = cfg.images
        if ic.cache_latents or ic.pre_compute_text_embeddings:
            for rows in (data.train, data.validation):
                cache_rows(model, rows, cfg.training.seed, ic.cache_latents, ic.pre_compute_text_embeddings)  # type: ignore[arg-type]
        if announce:
            m = cfg.model
            total = sum(p.numel() for p in model.denoiser.parameters())
            how = (
                f"{m.peft} r={m.lora_r} on {','.join(diffusion.lora_targets(cfg, model.index))}"
                if m.peft != "none"
                else "full fine-tuning"
            )
            encoders = "text encoders" if model.text_encoder_2 is not None else "text encoder"
            print(
                f"text_to_image: {how} of the denoiser{f' and the {encoders}' if ic.train_text_encoder else ''} "
                f"({total:,} denoiser parameters; {model.prediction_type} loss); VAE "
                f"{'' if ic.train_text_encoder else f'and {encoders} '}frozen",
                flush=True,
            )
        return model

    # ---------------------------------------------------------------- loss and evaluation

    def loss_count(self, batch: dict) -> torch.Tensor:
        """Instance rows: DreamBooth's class rows add to the sum but not to what it is divided by."""
        if "is_prior" in batch:
            return (~batch["is_prior"]).sum()
        return torch.full((), batch["loss_weight"].shape[0], device=batch["loss_weight"].device)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draws come from --seed, the step and the row's number (`row_draws`): a global batch draws
        alike on any number of processes, and a resumed run (the count restored) draws what it would have."""
        assert self.cfg is not None
        t = self.cfg.training
        step = self.micro_batches // t.gradient_accumulation_steps
        self.micro_batches += 1
        batch = dict(batch)
        inner: Any = getattr(model, "module", model)  # DDP and DeepSpeed wrap a TextToImageModel
        draws = row_draws(inner, batch, t.seed, step)
        losses = model(**batch, **draws)
        return (losses * batch["loss_weight"]).sum(), self.loss_count(batch)

    def pending_state(self, reduce_sum: Callable) -> list[float] | None:
        """The training micro-batches so far (the same on every process): the step the draws are keyed by."""
        return [float(self.micro_batches)]

    def restore_state(self, state: list[float], is_main: bool) -> None:
        self.micro_batches = int(state[0])

    def evaluate(
        self,
        model: torch.nn.Module,
        batches: Iterable[dict],
        data: ProcessedData,
        gather: Callable,
        move: Callable,
        autocast: Callable,
    ) -> dict:
        """The loss at noise and timesteps drawn from the seed and each row's number (the same every evaluation,
        so evaluations compare, and whatever the process count), over every evaluation row once; then the
        validation images."""
        assert self.cfg is not None
        inner: Any = getattr(model, "module", model)  # DDP and DeepSpeed wrap a TextToImageModel
        with eval_mode(model):
            start, seed = time.perf_counter(), self.cfg.training.seed
            loss_sum, rows = 0.0, 0
            for batch in batches:
                batch = move(batch)
                draws = row_draws(inner, batch, seed, None)
                with torch.no_grad(), autocast():
                    losses = model(**batch, **draws)
                (weighted,) = gather(((losses.float() * batch["loss_weight"]),))
                loss_sum += weighted.double().sum().item()
                rows += len(weighted)
        result = {"loss": loss_sum / max(rows, 1), "samples": rows, "runtime_s": round(time.perf_counter() - start, 3)}
        from torch.distributed.fsdp import FSDPModule

        fsdp = isinstance(model, FSDPModule)
        if data.prompts and (_is_main() or fsdp):
            with whole_root(model):
                rendered = inner.render(data.prompts, self.tokenizers(), self.cfg.training.seed, autocast)
            if _is_main():
                self.rendered = list(zip(data.prompts, rendered, strict=True))
                result["validation_images"] = len(rendered)
        return result

    def tables(self, metrics: dict) -> dict[str, tuple[list[str], list[list]]]:
        """The images of the evaluation just made, once: RunLog logs a table of images as images."""
        rendered, self.rendered = self.rendered, []
        return {"validation_images": (["prompt", "image"], [list(pair) for pair in rendered])} if rendered else {}

    # ---------------------------------------------------------------- what it prints and publishes

    def model_card(self, output_dir: Path, cfg: Config, results: dict) -> ModelCard:
        from cloudtrain.publish.diffusion_card import build_card

        return build_card(output_dir, cfg, results)

    def published_files(self, output_dir: Path, results: dict) -> list[Path]:
        """The validation grid the card shows (cloudtrain.publish.diffusion_card)."""
        from cloudtrain.publish.diffusion_card import shown_grid

        grid = shown_grid(output_dir, results)
        return [grid] if grid else []

    def describe_data(self, data: ProcessedData) -> str:
        assert self.cfg is not None
        train = data.train
        line = f"data: {len(train.examples)} training images"  # type: ignore[attr-defined]
        if train.class_examples:  # type: ignore[attr-defined]
            line += f" and {len(train.class_examples)} class images (prior preservation)"  # type: ignore[attr-defined]
        if self.skipped:
            line += f" ({self.skipped} unreadable skipped)"
        size = f"{self.cfg.images.resolution}px"
        if train.buckets:  # type: ignore[attr-defined]
            size = f"{len(set(train.row_buckets))} aspect-ratio buckets near {size} squared"  # type: ignore[attr-defined]
        return f"{line}; {size}, {len(data.prompts)} validation prompts"

    def describe_metrics(self, metrics: dict) -> str:
        line = f"loss {metrics['loss']:.4f} ({metrics['samples']} images, fixed noise)"
        if metrics.get("validation_images"):
            line += f"; {metrics['validation_images']} validation images rendered"
        return line

    def inference_hint(self, output_dir: str) -> str:
        assert self.cfg is not None
        base = self.cfg.model.model_name_or_path
        # SD3 saved without T5: from_pretrained takes the folder with text_encoder_3=None, tokenizer_3=None only
        index = diffusion.read_model_index(diffusion.local_pipeline(str(base)))
        nones = diffusion.none_arguments(index)
        # SD3 renders at the T5 length it trained with, as the card says (diffusers' default is 256; audit)
        options = sd3.render_options(self.cfg.images) if sd3.is_sd3(index) else {}
        prompt = "".join(['"a prompt"', *(f", {name}={value!r}" for name, value in options.items())])
        if self.cfg.model.peft == "none":
            return f'DiffusionPipeline.from_pretrained("{output_dir}"{nones})({prompt}).images[0]'
        from cloudtrain.publish.diffusion_card import scheduler_line

        predicts = self.cfg.images.prediction_type
        return (
            f'p = DiffusionPipeline.from_pretrained("{base}"{nones}); p.load_lora_weights("{output_dir}"); '
            f"{scheduler_line('p', predicts) + '; ' if predicts else ''}p({prompt})"
        )


def _check_loss_options(cfg: Config, index: dict) -> None:
    """The noise-prediction loss's options are refused for SD3's flow matching, and SD3's for the others."""
    from cloudtrain.config import differs_from_default

    if sd3.is_sd3(index):
        for name, instead in sd3.NOT_FLOW.items():
            if differs_from_default(cfg, name):
                raise UserError(
                    f"--{name} does not apply to Stable Diffusion 3, trained by flow matching: leave it out (see "
                    f"{instead})"
                )
        return
    for name in (*sd3.FLOW_OPTIONS, "max_sequence_length"):
        if differs_from_default(cfg, name):
            raise UserError(
                f"--{name} applies to flow-matching pipelines (Stable Diffusion 3) only; "
                f"{index.get('_class_name', 'this pipeline')} trains on noise prediction: leave it out"
            )


def _read_tokenizer(path: str, subfolder: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, subfolder=subfolder)
    except Exception as err:  # noqa: BLE001 (tokenizers reports a damaged file as a bare Exception)
        raise UserError(f"could not load the {subfolder} of {path}: {first_line(err)}") from None


def _tokens(
    tokenizer: PreTrainedTokenizerBase,
    tokenizer_2: PreTrainedTokenizerBase | None,
    caption: str,
    tokenizer_3: PreTrainedTokenizerBase | None = None,
    t5_length: int = 77,
) -> dict:
    """A caption's token ids, padded to the text encoder's length as Stable Diffusion was trained (and SDXL's or
    SD3's second tokenizer's as `input_ids_2`, SD3's T5 ids, `t5_length` long, as `input_ids_3`). SD3's CLIP
    tokenizers both pad to the first one's length, as StableDiffusion3Pipeline does."""
    out = {}
    for key, tok in (("input_ids", tokenizer), ("input_ids_2", tokenizer_2), ("input_ids_3", tokenizer_3)):
        if tok is None:
            continue
        length = t5_length if key == "input_ids_3" else tok.model_max_length
        if key == "input_ids_2" and tokenizer_3 is not None:
            length = tokenizer.model_max_length
        encoded = tok(caption, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        out[key] = encoded["input_ids"][0]
        if key == "input_ids":
            out["attention_mask"] = encoded["attention_mask"][0]
    return out


def row_seed(seed: int, step: int | None, number: int, repeat: int = 0) -> int:
    """The seed of one row's draws: from --seed, the optimizer step (None: evaluation, the same every time), the
    row's number in the dataset and which repetition of it in the step this is (a step longer than the epoch
    repeats rows: cloudtrain.data.images.StepSampler), so a global batch draws alike whichever process holds
    each row, and a repeated row draws afresh instead of doubling the first one's gradient."""
    if step is None:
        return seed * 1_000_003 + number
    keyed = ((seed * 1_000_003 + number) * 2_654_435_761 + (step + 1) * 40_503) % (2**63)
    return (keyed + repeat * 0x9E3779B97F4A7C15) % (2**63) if repeat else keyed


def row_draws(model: diffusion.TextToImageModel, batch: dict, seed: int, step: int | None) -> dict:
    """Each row's noise and timestep (evaluation, `step` None), and while training its latent sample, noise
    offset, flip and empty caption: all from the row's own generator (`row_seed`; `batch.pop`s the numbers)."""
    numbers = batch.pop("row").tolist()
    repeats = batch.pop("repeat", torch.zeros(len(numbers), dtype=torch.long)).tolist()
    shape = latent_shape(model, batch)
    ic, train = model.images, step is not None
    flips = train and ic.random_flip and "pixel_values" in batch  # cached latents keep the flip they were cached with
    drawn: dict[str, list] = {"noise": [], "timesteps": [], "latent_noise": [], "flip": [], "empty_caption": []}
    for number, repeat in zip(numbers, repeats, strict=True):
        generator = torch.Generator().manual_seed(row_seed(seed, step, number, repeat))
        noise = torch.randn(shape, generator=generator)
        drawn["timesteps"].append(model.draw_timesteps(1, generator))
        if train:
            if ic.noise_offset:  # a per-channel shift: learns darker and brighter images than the mean
                noise = noise + ic.noise_offset * torch.randn(shape[0], 1, 1, generator=generator)
            drawn["latent_noise"].append(torch.randn(shape, generator=generator))
            drawn["flip"].append(bool(torch.rand((), generator=generator) < 0.5))
            drawn["empty_caption"].append(bool(torch.rand((), generator=generator) < ic.proportion_empty_prompts))
        drawn["noise"].append(noise)
    device = batch["attention_mask"].device
    out = {"noise": torch.stack(drawn["noise"]).to(device), "timesteps": torch.cat(drawn["timesteps"]).to(device)}
    if train:
        out["latent_noise"] = torch.stack(drawn["latent_noise"]).to(device)
        if flips:
            out["flip"] = torch.tensor(drawn["flip"], device=device)
        if ic.proportion_empty_prompts and any(drawn["empty_caption"]):  # known on the host: no device sync
            out["empty_caption"] = torch.tensor(drawn["empty_caption"], device=device)
    return out


def latent_shape(model: diffusion.TextToImageModel, batch: dict) -> tuple[int, ...]:
    if "latent_mean" in batch:
        return tuple(batch["latent_mean"].shape[1:])
    factor = 2 ** (len(model.vae.config.block_out_channels) - 1)
    height, width = batch["pixel_values"].shape[-2:]  # an aspect-ratio bucket's, or the square's
    return (model.denoiser.config.in_channels, height // factor, width // factor)


def cache_rows(
    model: diffusion.TextToImageModel, rows: images.ImageRows, seed: int, latents: bool, texts: bool
) -> None:
    """Every row through the frozen VAE (its latent distribution) and text encoder once, before training; with
    --random_flip a training image is cached flipped or not as drawn from --seed and its number."""
    cached = []
    rows.seed = seed  # a random crop is keyed by it (images.crop_seed); the sampler, which sets it, comes later
    for index in range(len(rows)):
        row = rows[index]
        for prefix in ("", "class_"):
            if f"{prefix}attention_mask" not in row:
                continue
            if latents:
                pixels = row.pop(f"{prefix}pixel_values")
                number = index if not prefix else index + len(rows)
                generator = torch.Generator().manual_seed(row_seed(seed, -1, number))
                if rows.train and model.images.random_flip and bool(torch.rand((), generator=generator) < 0.5):
                    pixels = pixels.flip(-1)
                mean, std = model.encode_images(pixels[None])
                row[f"{prefix}latent_mean"], row[f"{prefix}latent_std"] = mean[0], std[0]
            if texts:
                ids = [row.pop(f"{prefix}{key}", None) for key in ("input_ids", "input_ids_2", "input_ids_3")]
                hidden, pooled = model.encode_prompts(*(None if i is None else i[None] for i in ids))
                row[f"{prefix}encoder_hidden_states"] = hidden[0]
                if pooled is not None:
                    row[f"{prefix}pooled_prompt_embeds"] = pooled[0]
        cached.append(row)
    rows.cached = cached


def _check_sd3_sides(ic: Any, vae_factor: int, transformer: dict) -> None:
    """SD3's position embedding covers sides up to a size (192 patches: 3072 px for SD3 medium); the square, or
    with --aspect_ratio_bucketing the longest bucket's side (up to 4:1), must fit in it."""
    limit = sd3.largest_side(vae_factor, transformer)
    if not limit or (ic.aspect_ratio_bucketing and ic.resolution < bucket_step(vae_factor)):
        return  # a resolution too small for buckets is refused by check_options' own line
    from cloudtrain.data.image_buckets import bucket_sizes

    # the buckets training makes (found in audit: checked with another step, a run that passed crashed mid-way)
    step = bucket_step(vae_factor)
    sizes = bucket_sizes(ic.resolution**2, step) if ic.aspect_ratio_bucketing else [(ic.resolution,) * 2]
    if (side := max(max(size) for size in sizes)) > limit:
        how = "its longest aspect-ratio bucket has" if ic.aspect_ratio_bucketing else "it has"
        raise UserError(
            f"--resolution {ic.resolution}: {how} a side of {side} px, beyond the {limit} px the SD3 transformer's "
            f"position embedding covers (pos_embed_max_size {transformer['pos_embed_max_size']}); use a lower "
            "--resolution" + (" or leave out --aspect_ratio_bucketing" if ic.aspect_ratio_bucketing else "")
        )


def _is_main() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def bucket_step(vae_factor: int) -> int:
    """The pixels a bucket's sides are multiples of: 8 latent pixels, so every denoiser level halves them evenly."""
    return vae_factor * 8
