"""`make text-to-image`, step 1: scikit-learn's handwritten digits as a captioned image folder, and a small
text-conditioned Stable Diffusion pipeline to teach them to (random UNet and text encoder; its VAE first learns
to reconstruct the digits, so the pictures are readable). Nothing comes from the Hub.

    python scripts/make_t2i_digits.py [--images 600] [--vae_steps 300]
    python src/training_application.py --config configs/text_to_image_digits.yaml
    python scripts/make_t2i_digits.py --score outputs/t2i-digits      # step 3: before/after, measured

Writes data/t2i-digits/ (PNGs and metadata.jsonl: "digit 7") and data/t2i-digits-model/ (a diffusers folder).
--score renders each digit's prompt from several seeds with the base pipeline and the trained one, and prints
how often an SVM trained on the digits the demo left out reads the prompt's digit (chance: 10%).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from t2i_fixtures import build_tiny_pipeline  # noqa: E402  (the tests' builder: one definition of the model)

SIZE = 32  # pixels: the 8x8 digits upscaled 4x


def write_digits(folder: Path, count: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    digits = load_digits()
    folder.mkdir(parents=True, exist_ok=True)
    rows, pixels = [], []
    for i in range(min(count, len(digits.images))):
        gray = (255 - digits.images[i] * 255 / 16).astype(np.uint8)  # dark ink on white paper
        image = Image.fromarray(gray).resize((SIZE, SIZE), Image.Resampling.BILINEAR).convert("RGB")
        image.save(folder / f"{i:04d}.png")
        rows.append({"file_name": f"{i:04d}.png", "text": f"digit {digits.target[i]}"})
        pixels.append(np.asarray(image, np.float32) / 127.5 - 1)
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return np.stack(pixels).transpose(0, 3, 1, 2)


def fit_vae(model_dir: Path, pixels: np.ndarray, steps: int) -> float:
    """The VAE learns to reconstruct the digits (MSE plus a small KL term), then replaces the random one."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae")
    optimizer = torch.optim.AdamW(vae.parameters(), lr=2e-3)
    data, generator = torch.from_numpy(pixels), torch.Generator().manual_seed(0)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = data[torch.randint(0, len(data), (32,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        loss = torch.nn.functional.mse_loss(vae.decode(posterior.sample()).sample, batch) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # Stable Diffusion scales latents to unit variance (its 0.18215 is 1 / their std): at this VAE's own std
    # (~0.16 after 0.18215) the noise drowns the digits at almost every timestep, and the denoiser learns
    # to predict the noise without ever needing the caption
    with torch.no_grad():
        std = vae.encode(data).latent_dist.mean.std().item()
    vae.register_to_config(scaling_factor=1.0 / std)
    vae.save_pretrained(model_dir / "vae")
    return loss.item()


def digit_classifier(held_out: int, folder: Path) -> tuple[object, float]:
    """An SVM on scikit-learn's 8x8 digits the demo did not train on (all but the first `held_out`), and its
    accuracy on the demo's own training images taken back to 8x8: the ceiling of what scoring can show."""
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    digits = load_digits()
    classifier = SVC(gamma=0.001).fit(digits.data[held_out:], digits.target[held_out:])
    round_trip = [to_digit_features(Image.open(f)) for f in sorted(folder.glob("*.png"))]
    ceiling = float(np.mean(classifier.predict(np.stack(round_trip)) == digits.target[: len(round_trip)]))
    return classifier, ceiling


def to_digit_features(image: Image.Image) -> np.ndarray:
    """A generated 32px image as load_digits' features: 8x8 averages of the ink, 0 (paper) to 16."""
    gray = np.asarray(image.convert("L").resize((8, 8), Image.Resampling.BOX), np.float32)
    return np.clip((255 - gray) * 16 / 255, 0, 16).reshape(-1)


def score(pipeline_dir: str, classifier: object, samples: int, steps: int, guidance: float) -> dict[int, float]:
    """Each digit's prompt rendered from `samples` seeds; the share the classifier reads as that digit."""
    from diffusers import DiffusionPipeline

    folder = Path(pipeline_dir)
    if (folder / "model_index.json").is_file():  # a full fine-tune: the whole pipeline
        pipe = DiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    else:  # a LoRA (--peft lora): into the base pipeline its run names
        base = json.loads((folder / "args.json").read_text())["model_name_or_path"]
        pipe = DiffusionPipeline.from_pretrained(base, safety_checker=None, requires_safety_checker=False)
        pipe.load_lora_weights(folder)
    pipe.set_progress_bar_config(disable=True)
    accuracy = {}
    for digit in range(10):
        generator = torch.Generator().manual_seed(0)
        out = pipe([f"digit {digit}"] * samples, height=SIZE, width=SIZE, num_inference_steps=steps,
                   guidance_scale=guidance, generator=generator)  # fmt: skip
        predicted = classifier.predict(np.stack([to_digit_features(image) for image in out.images]))  # type: ignore[attr-defined]
        accuracy[digit] = float(np.mean(predicted == digit))
    return accuracy


def report(before: str, after: str, args: argparse.Namespace) -> None:
    """Before/after: how often the image drawn for "digit d" reads as d (chance: 10%)."""
    classifier, ceiling = digit_classifier(args.images, Path(args.data_dir) / "t2i-digits")
    print(f"a digit classifier (SVM on the {1797 - args.images} digits not trained on) reads "
          f"{ceiling:.0%} of the training images right")  # fmt: skip
    for label, folder in (("before", before), ("after", after)):
        accuracy = score(folder, classifier, args.samples, args.steps, args.guidance)
        each = " ".join(f"{d}:{a:.0%}" for d, a in accuracy.items())
        print(f"{label:>6}: {np.mean(list(accuracy.values())):.0%} of the images show the prompt's digit ({each})")


def fit_text_encoder(model_dir: Path, steps: int) -> float:
    """The random text encoder learns to tell the ten captions apart (a linear probe on its mean hidden state,
    cross-entropy), standing in for CLIP's pretraining: at random, "digit 0" and "digit 7" differ in one
    character and their hidden states in ~1% (cosine 0.99), too little for the denoiser to learn from."""
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
    encoder = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder")
    ids = tokenizer([f"digit {d}" for d in range(10)], padding="max_length", return_tensors="pt").input_ids
    probe = torch.nn.Linear(encoder.config.hidden_size, 10)
    optimizer = torch.optim.AdamW([*encoder.parameters(), *probe.parameters()], lr=3e-3)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(probe(encoder(ids)[0].mean(dim=1)), torch.arange(10))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    encoder.save_pretrained(model_dir / "text_encoder")
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--vae_steps", type=int, default=300)
    parser.add_argument("--text_steps", type=int, default=100)
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--score", metavar="OUTPUT_DIR", help="score a trained run against the base pipeline")
    parser.add_argument("--samples", type=int, default=10, help="--score: images per digit")
    parser.add_argument("--steps", type=int, default=30, help="--score: denoising steps")
    parser.add_argument("--guidance", type=float, default=6.0, help="--score: classifier-free guidance")
    args = parser.parse_args()
    torch.set_num_threads(1)  # these small convolutions run fastest on one thread of a shared machine
    if args.score:
        report(str(Path(args.data_dir) / "t2i-digits-model"), args.score, args)
        return
    root = Path(args.data_dir)
    pixels = write_digits(root / "t2i-digits", args.images)
    model_dir = build_tiny_pipeline(root / "t2i-digits-model", width=32, image_size=SIZE)
    loss = fit_vae(model_dir, pixels, args.vae_steps)
    text_loss = fit_text_encoder(model_dir, args.text_steps)
    print(
        f"wrote {len(pixels)} digits to {root / 't2i-digits'} and a pipeline to {model_dir} (VAE MSE {loss:.4f}, "
        f"text encoder's caption loss {text_loss:.4f})"
    )


if __name__ == "__main__":
    main()
