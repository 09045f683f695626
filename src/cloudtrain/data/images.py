"""Images and captions for `--task text_to_image`: the folders diffusers' example scripts read, checked and
turned into training rows (docs/text-to-image.md).

Sources: --train_data_dir (metadata.jsonl or metadata.csv with file_name and the caption column, or a
<name>.txt caption beside each image), DreamBooth's --instance_data_dir with --instance_prompt (and
--class_data_dir with --class_prompt for prior preservation), or a dataset (--dataset_name) with an image and a
caption column.
Unreadable images are skipped and counted; none left, or an image smaller than --resolution, is refused.
"""

import csv
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from cloudtrain import paths
from cloudtrain.config import ImagesConfig
from cloudtrain.data.fingerprint import digest
from cloudtrain.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".jfif", ".webp", ".avif", ".bmp", ".gif", ".tif", ".tiff")
METADATA = "metadata.jsonl"
METADATA_CSV = "metadata.csv"  # the other file Hugging Face's imagefolder (diffusers' scripts) reads
ORIENTATION = 0x0112  # the EXIF tag a camera turns its photo by


@dataclass
class Example:
    image: Any  # a file path, a dataset row's image (DatasetImage), or a PIL image
    caption: str


@dataclass(frozen=True)
class DatasetImage:
    """A dataset row's image, decoded when read: a list of decoded images held every pixel of the set in memory
    (found in audit: ~2 MB per 512 px image, before --max_train_samples cut any)."""

    rows: Any  # the datasets.Dataset
    index: int
    column: str

    def open(self) -> Any:
        """A PIL image, or the path the column holds."""
        return self.rows[self.index][self.column]


def _named(image: Any) -> str:
    """A file image by its path; a dataset's image by its dataset and row (reading its pixels would cost a pass)."""
    if isinstance(image, DatasetImage):
        return f"{getattr(image.rows, '_fingerprint', '')}:{image.index}"
    return str(image) if isinstance(image, (str, Path)) else f"{getattr(image, 'size', None)}"


def image_files(folder: Path) -> list[Path]:
    return sorted(
        f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES and shown(f, folder)
    )


def shown(file: Path, folder: Path) -> bool:
    """Not hidden: macOS leaves ._name.png and __MACOSX/ beside a zip's images (Hugging Face's imagefolder skips
    them too; found in audit: a folder of captioned images was refused for them)."""
    return not any(part.startswith(".") or part == "__MACOSX" for part in file.relative_to(folder).parts)


def folder_images(folder: str, flag: str) -> list[Path]:
    """The images of `folder`, or one line saying why there are none (cheap: names only)."""
    files = image_files(paths.check_folder(flag, folder))
    if not files:
        raise UserError(f"{flag} {folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return files


def captioned_examples(folder: str, caption_column: str, notes: bool = True) -> list[Example]:
    """--train_data_dir's images and captions: metadata.jsonl or metadata.csv when present, else a .txt file per
    image."""
    path = Path(folder)
    files = folder_images(folder, "--train_data_dir")
    found = [path / n for n in (METADATA, METADATA_CSV) if (path / n).is_file()]
    if len(found) > 1:  # imagefolder refuses the two together too
        raise UserError(
            f"--train_data_dir {folder} has both {METADATA} and {METADATA_CSV}; keep the one that captions the images"
        )
    if found:
        metadata = found[0]
        examples = _metadata_examples(path, metadata, caption_column)
        listed = {e.image.resolve() for e in examples}
        unlisted = [f for f in files if f.resolve() not in listed]
        if unlisted and notes:  # the .txt layout refuses an image without a caption; here a choice the file made
            print(
                f"note: {len(unlisted)} image(s) in {folder} are not in its {metadata.name} and are left out (first: "
                f"{unlisted[0].relative_to(path)})",
                flush=True,
            )
        return _noting_uncaptioned(examples, folder, notes)
    missing = [f for f in files if not f.with_suffix(".txt").is_file()]
    if missing:
        # Hugging Face's imagefolder layout: train/metadata.jsonl (or .csv)
        nested = sorted([*path.glob(f"*/{METADATA}"), *path.glob(f"*/{METADATA_CSV}")])
        hint = f"; {nested[0]} is one: pass --train_data_dir {nested[0].parent}" if nested else ""
        raise UserError(
            f"--train_data_dir {folder} has no {METADATA} or {METADATA_CSV} and {len(missing)} images without a "
            f"caption file (first: {missing[0].name} has no {missing[0].with_suffix('.txt').name}){hint}"
        )
    captioned = {f.with_suffix(".txt") for f in files}
    orphans = sorted(t for t in path.rglob("*.txt") if t not in captioned and shown(t, path))
    if orphans and notes:  # an image in a format not read here, or one deleted: said, not dropped silently
        print(
            f"note: {len(orphans)} caption file(s) in {folder} have no image in a format read here "
            f"({', '.join(IMAGE_SUFFIXES)}) and are left out (first: {orphans[0].relative_to(path)})",
            flush=True,
        )
    return _noting_uncaptioned([Example(f, _read_text(f.with_suffix(".txt")).strip()) for f in files], folder, notes)


def _noting_uncaptioned(examples: list[Example], folder: str, notes: bool) -> list[Example]:
    """`examples`, after a note of those with an empty caption: they train unconditioned, which is a choice where
    meant ("" in the metadata) and a loss where a caption went missing (an empty .txt, a blank cell)."""
    empty = [e for e in examples if not e.caption.strip()]
    if empty and notes:
        print(
            f"note: {len(empty)} of {len(examples)} image(s) in {folder} have an empty caption and train "
            f"unconditioned (first: {os.path.relpath(empty[0].image, folder)})",
            flush=True,
        )
    return examples


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is no part of the caption
    except UnicodeDecodeError:
        raise UserError(f"{file} is not UTF-8 text; save it as UTF-8") from None


def _metadata_rows(metadata: Path) -> list[Any]:
    """metadata.jsonl's objects, one a line; metadata.csv's rows by its header (a cell a short row lacks: None)."""
    text = _read_text(metadata)
    if metadata.name == METADATA_CSV:
        try:
            # newline="": a quoted caption may span lines (the csv module's rule), and U+2028 in one is no new line
            rows = [row for row in csv.DictReader(io.StringIO(text, newline="")) if any(row.values())]
        except csv.Error as err:
            raise UserError(f"{metadata} could not be read as CSV ({err}); quote captions that hold commas") from None
        for number, row in enumerate(rows, 1):  # cells past the header: an unquoted comma cut a caption short
            if None in row:
                raise UserError(
                    f"{metadata} row {number} has more cells than its header; quote captions that hold commas"
                )
        return rows
    rows = []
    for number, line in enumerate(text.split("\n"), 1):  # (a caption may hold U+2028: no new line)
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise UserError(f"{metadata} line {number} is not JSON: {err.msg}") from None
    return rows


def _metadata_examples(folder: Path, metadata: Path, caption_column: str) -> list[Example]:
    rows = _metadata_rows(metadata)
    if not rows:  # an empty file, or a csv of its header alone
        raise UserError(f"{metadata} lists no images: give a row per image (file_name and {caption_column!r})")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            kind = "null" if row is None else type(row).__name__
            raise UserError(f"{metadata} row {number} is {kind}, not a JSON object with file_name")
        if caption_column not in row:
            raise UserError(
                f"{metadata} row {number} has no caption column {caption_column!r} (its keys: "
                f"{', '.join(k for k in row if isinstance(k, str))}); pass --caption_column <name>"
            )
        if not isinstance(row.get("file_name"), str) or not row["file_name"]:
            raise UserError(f"{metadata} row {number} has no file_name (the image's path in {folder}, a text)")
        if not isinstance(row[caption_column], str):  # str(None) would train on the caption "None"
            # a CSV row shorter than the header: None where the caption's cell would be
            value = "missing" if metadata.name == METADATA_CSV else json.dumps(row[caption_column])
            raise UserError(
                f'{metadata} row {number}: its caption {caption_column!r} is {value}, not a text; give it one ("" '
                "for an image trained without a caption)"
            )
        if not (folder / row["file_name"]).is_file():
            raise UserError(f"{metadata} row {number} names {row['file_name']}, which is not a file in {folder}")
    return [Example(folder / row["file_name"], row[caption_column]) for row in rows]


def dreambooth_examples(cfg: ImagesConfig) -> tuple[list[Example], list[Example]]:
    """(instance examples, class examples: empty without --with_prior_preservation)."""
    assert cfg.instance_data_dir and cfg.instance_prompt  # ImagesConfig.check
    instance = [Example(f, cfg.instance_prompt) for f in folder_images(cfg.instance_data_dir, "--instance_data_dir")]
    if not cfg.with_prior_preservation:
        return instance, []
    assert cfg.class_data_dir and cfg.class_prompt
    return instance, [Example(f, cfg.class_prompt) for f in folder_images(cfg.class_data_dir, "--class_data_dir")]


def readable(
    examples: list[Example], resolution: int, what: str, by_area: bool = False, limit: int | None = None
) -> tuple[list[Example], int]:
    """The examples whose images decode, as RGB images in memory-light form (paths kept); refuses images smaller
    than `resolution` (`by_area`, with aspect-ratio buckets: of fewer pixels than its square) and a set with
    nothing readable. `limit` (--max_train_samples): the first that many readable ones, in order, and no image
    after them opened (200 images were read to train on 2, and a small one past the 2 refused the run).
    Returns (kept, skipped)."""
    kept: list[Example] = []
    skipped, small = [], []
    for example in examples:
        if limit and len(kept) >= limit:
            break
        try:
            image = load_rgb(example.image)
        # PIL's ways of saying "not an image", and an image over its decompression-bomb limit (179 Mpx)
        except (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError):
            skipped.append(example)
            continue
        if (image.width * image.height < resolution**2) if by_area else (min(image.size) < resolution):
            small.append((example, image.size))
        kept.append(example)
    if not examples:  # a dataset of no rows
        raise UserError(f"the {what} data holds no images")
    if not kept:
        raise UserError(f"none of the {len(examples)} {what} images could be read (first: {name(skipped[0])})")
    if small:
        example, (w, h) = small[0]
        raise UserError(
            f"{len(small)} {what} images are smaller than --resolution {resolution} (first: {name(example)}, "
            f"{w}x{h}); lower --resolution or remove them"
        )
    return kept, len(skipped)


def name(example: Example) -> str:
    return str(example.image) if isinstance(example.image, Path) else "a dataset image"


def load_rgb(source: Any) -> Image.Image:
    """An image as RGB, turned upright as its EXIF orientation says (a phone's photo is stored on its side)."""
    if isinstance(source, DatasetImage):
        source = source.open()
    if source is None:  # a dataset row without its image: skipped as an unreadable one
        raise ValueError("no image")
    if isinstance(source, Image.Image):
        return _rgb(_upright(source))
    with Image.open(source) as image:
        image.load()  # decodes it all: a truncated file fails here, not in the middle of training
        return _rgb(_upright(image))


def _upright(image: Image.Image) -> Image.Image:
    """Turned as its EXIF orientation says; an image without one as it is (no copy on every read)."""
    return ImageOps.exif_transpose(image) if image.getexif().get(ORIENTATION, 1) != 1 else image


def _rgb(image: Image.Image) -> Image.Image:
    """RGB; 16- and 32-bit grey scaled to 8 bits (PIL's own conversion clips every value over 255 to white, and a
    float image's values in [0, 1] to black)."""
    if image.mode.startswith("I") or image.mode == "F":  # I;16, I;16B, I: 16-bit PNGs and TIFFs; F: float TIFFs
        values = np.asarray(image, dtype=np.float64)
        # the full scale: a 16-bit mode's; else the smallest of [0, 1] (floats), 8 and 16 bits that holds them all
        scales = (65535.0,) if image.mode.startswith("I;16") else (1.0, 255.0, 65535.0)[image.mode != "F" :]
        top = next((scale for scale in scales if values.max(initial=0) <= scale), values.max())
        image = Image.fromarray(np.clip(values / top * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L")
    return image.convert("RGB")


def to_pixels(
    image: Image.Image, resolution: int, center_crop: bool, flip: bool, rng: torch.Generator | None = None
) -> torch.Tensor:
    """Shorter side resized to `resolution`, a square crop (centred, or drawn from `rng`), flipped when asked;
    a (3, resolution, resolution) tensor in [-1, 1], as diffusers' examples prepare them."""
    return cropped_pixels(image, resolution, center_crop, flip, rng)[0]


def cropped_pixels(
    image: Image.Image,
    resolution: int | tuple[int, int],
    center_crop: bool,
    flip: bool,
    rng: torch.Generator | None = None,
) -> tuple[torch.Tensor, tuple[int, int]]:
    """`to_pixels` and the crop's top-left corner (top, left) in the resized image, which SDXL conditions on.
    `resolution` (width, height): an aspect-ratio bucket's size, the image resized to cover it, then cropped."""
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution
    w, h = image.size
    scale = max(width / w, height / h)
    image = image.resize((max(width, round(w * scale)), max(height, round(h * scale))), Image.Resampling.BILINEAR)
    w, h = image.size
    if center_crop:
        left, top = (w - width) // 2, (h - height) // 2
    else:
        left = int(torch.randint(0, w - width + 1, (1,), generator=rng))
        top = int(torch.randint(0, h - height + 1, (1,), generator=rng))
    image = image.crop((left, top, left + width, top + height))
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    return (pixels.flip(-1) if flip else pixels), (top, left)


class ImageRows(torch.utils.data.Dataset):
    """Training or evaluation rows: each image prepared when read (a random crop keyed by the row's place in the
    run, `crop_seed`), its caption's tokens, its number, and a class image for prior preservation."""

    def __init__(
        self,
        examples: list[Example],
        tokens: Callable[[str], dict],
        cfg: ImagesConfig,
        train: bool,
        class_examples: list[Example] | None = None,
        size_ids: bool = False,
        buckets: list[tuple[int, int]] | None = None,
    ):
        self.examples, self.tokens, self.cfg, self.train = examples, tokens, cfg, train
        # aspect-ratio buckets (cloudtrain.data.image_buckets): each image's (width, height) to crop to
        self.buckets = buckets
        self.row_buckets = _row_buckets(examples, buckets) if buckets else []
        self.size_ids = size_ids  # SDXL: each row's original size and crop (cloudtrain.models.sdxl.time_ids)
        self.class_examples = class_examples or []
        self.cached: list[dict] | None = None  # filled by cache(): latents and text embeddings per row
        # set by epoch_sampler: the seed, and how many indices one place in the run spans (RepeatMarked)
        self.seed, self.span = 0, 0

    def fingerprint(self) -> str:
        """The rows without reading an image: files (or sizes), captions, and the options that shape them."""
        c = self.cfg
        options = [c.resolution, c.center_crop, c.random_flip, c.max_sequence_length, self.buckets]
        described = [[_named(e.image), e.caption] for e in [*self.examples, *self.class_examples]]
        return digest([options, described])

    def __len__(self) -> int:
        # DreamBooth pairs each instance image with a class image, cycling the shorter list (as diffusers does)
        return max(len(self.examples), len(self.class_examples))

    def __getitem__(self, index: int) -> dict:
        # `index` past the rows: a repetition of row index % rows within one step (`RepeatMarked`), which draws
        # its own noise (its `repeat` count keys text_to_image.row_draws with the row's number); above `span`,
        # the row's place in the run, which keys its random crop
        place, index = divmod(index, self.span) if self.span else (0, index)
        index, repeat = index % len(self), index // len(self)
        if self.cached is not None:
            row = dict(self.cached[index])
        else:
            # each row's draws (noise, timestep, flip, ...) come from its number (text_to_image.row_draws); a class
            # row's number follows every instance row's
            size = self.buckets[self.row_buckets[index % len(self.examples)]] if self.buckets else None
            crop = self._crop_generator(place, index, repeat)
            row = {**self.prepare(self.examples[index % len(self.examples)], size, crop), "row": index}
            if self.class_examples:
                crop = self._crop_generator(place, index + len(self), repeat)
                prior = self.prepare(self.class_examples[index % len(self.class_examples)], rng=crop)
                row.update({f"class_{k}": v for k, v in {**prior, "row": index + len(self)}.items()})
        row["repeat"] = repeat
        if "class_row" in row:
            row["class_repeat"] = repeat
        return row

    def _crop_generator(self, place: int, number: int, repeat: int) -> torch.Generator | None:
        if self.cfg.center_crop or not self.train:
            return None
        return torch.Generator().manual_seed(crop_seed(self.seed, place, number, repeat))

    def prepare(
        self, example: Example, size: tuple[int, int] | None = None, rng: torch.Generator | None = None
    ) -> dict:
        """Pixels and tokens, unflipped: the flip is drawn with the row's other draws. A random crop comes from
        `rng`. SDXL rows add their `time_ids`: the crop's corner is the unflipped image's (a flip drawn later does
        not move it)."""
        center = self.cfg.center_crop or not self.train  # evaluation rows are the same every time
        image = load_rgb(example.image)
        target = size or (self.cfg.resolution, self.cfg.resolution)
        pixels, corner = cropped_pixels(image, target, center, False, rng)
        row = {"pixel_values": pixels, **self.tokens(example.caption)}
        if self.size_ids:
            from cloudtrain.models.sdxl import time_ids

            row["time_ids"] = time_ids((image.height, image.width), corner, (target[1], target[0]))
        return row

    def epoch_sampler(self, seed: int, step_rows: int) -> torch.utils.data.Sampler:
        """The epoch's order in whole steps of `step_rows`: with buckets, the one that keeps every step in one
        bucket (image_buckets.BucketSampler), else the trainer's own shuffle (EpochShuffleSampler); a row
        repeated within a step marked (`RepeatMarked`)."""
        from cloudtrain.data.processing import EpochShuffleSampler

        self.seed, self.span = seed, len(self) * step_rows
        if not self.buckets:
            return RepeatMarked(EpochShuffleSampler(len(self), seed, step_rows), step_rows, len(self))
        from cloudtrain.data.image_buckets import BucketSampler

        return RepeatMarked(BucketSampler(self.row_buckets, step_rows, seed), step_rows, len(self))


class RepeatMarked(torch.utils.data.Sampler):
    """An epoch order whose steps may repeat a row (an epoch, or a bucket, smaller than a step is completed with
    its own rows again), with the k-th repetition of a row within its step given as row + k * rows. The step's
    draws are keyed by the row's number and k (text_to_image.row_draws): without k a repeated row would draw
    the same noise and timestep, adding the very same gradient again instead of another sample."""

    def __init__(self, inner: torch.utils.data.Sampler, step_rows: int, rows: int):
        self.inner, self.step_rows, self.rows, self.epoch = inner, step_rows, rows, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.inner.set_epoch(epoch)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __iter__(self):
        # each index also carries its place in the run (epoch and position, in multiples of rows * step_rows):
        # the row's random crop is keyed by it, so it does not depend on which process, loader worker or
        # prefetch reads the row, and a resumed run crops as the uninterrupted one did
        marked = mark_repeats(list(self.inner), self.step_rows, self.rows)
        span, first = self.rows * self.step_rows, self.epoch * len(marked)
        return iter(index + span * (first + position) for position, index in enumerate(marked))


def crop_seed(seed: int, place: int, number: int, repeat: int) -> int:
    """The seed of a training row's random crop: --seed, its place in the run, its number and repetition."""
    keyed = ((seed * 1_000_003 + number) * 2_654_435_761 + (place + 1) * 40_503 + 0x5DEECE66D) % (2**63)
    return (keyed + repeat * 0x9E3779B97F4A7C15) % (2**63)


def mark_repeats(order: list[int], step_rows: int, rows: int) -> list[int]:
    """`order` with each row's k-th repetition within a step (consecutive slices of `step_rows`) as row + k * rows."""
    marked: list[int] = []
    for start in range(0, len(order), step_rows):
        seen: dict[int, int] = {}
        for row in order[start : start + step_rows]:
            marked.append(row + seen.get(row, 0) * rows)
            seen[row] = seen.get(row, 0) + 1
    return marked


def _row_buckets(examples: list[Example], buckets: list[tuple[int, int]]) -> list[int]:
    """Each example's bucket, from its image's size (read from the header, not decoded)."""
    from cloudtrain.data.image_buckets import assign

    sizes = []
    for example in examples:
        source = example.image.open() if isinstance(example.image, DatasetImage) else example.image
        if isinstance(source, Image.Image):
            sizes.append(upright_size(source))
        else:
            with Image.open(source) as image:
                sizes.append(upright_size(image))
    return assign(sizes, buckets)


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) as load_rgb turns the image: EXIF orientations 5-8 are a quarter turn."""
    width, height = image.size
    return (height, width) if image.getexif().get(ORIENTATION) in (5, 6, 7, 8) else (width, height)


def collate(rows: list[dict], prior_loss_weight: float = 1.0) -> dict:
    """A batch; with class images, the instance rows then the class rows, each weighted in `loss_weight`."""
    keys = [k for k in rows[0] if not k.startswith("class_")]
    batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in keys}
    batch["loss_weight"] = torch.ones(len(rows))
    if "class_pixel_values" in rows[0] or "class_latent_mean" in rows[0]:
        prior = {k: torch.stack([torch.as_tensor(r[f"class_{k}"]) for r in rows]) for k in keys}
        prior["loss_weight"] = torch.full((len(rows),), prior_loss_weight)
        prior["is_prior"] = torch.ones(len(rows), dtype=torch.bool)
        batch["is_prior"] = torch.zeros(len(rows), dtype=torch.bool)
        batch = {k: torch.cat([batch[k], prior[k]]) for k in batch}
    return batch
