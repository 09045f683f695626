"""`make text-to-image`, step 1: scikit-learn's handwritten digits as a captioned image folder, and a small
text-conditioned Stable Diffusion pipeline to teach them to (random UNet and text encoder; its VAE first learns
to reconstruct the digits, so the pictures are readable). Nothing comes from the Hub.

    python scripts/make_t2i_digits.py [--images 600] [--vae_steps 300]
    python src/training_application.py --config configs/text_to_image_digits.yaml

Writes data/t2i-digits/ (PNGs and metadata.jsonl: "digit 7") and data/t2i-digits-model/ (a diffusers folder).
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
    vae.save_pretrained(model_dir / "vae")
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--vae_steps", type=int, default=300)
    parser.add_argument("--data_dir", default="data")
    args = parser.parse_args()
    torch.set_num_threads(1)  # these small convolutions run fastest on one thread of a shared machine
    root = Path(args.data_dir)
    pixels = write_digits(root / "t2i-digits", args.images)
    model_dir = build_tiny_pipeline(root / "t2i-digits-model", width=32)
    loss = fit_vae(model_dir, pixels, args.vae_steps)
    print(f"wrote {len(pixels)} digits to {root / 't2i-digits'} and a pipeline to {model_dir} (VAE MSE {loss:.4f})")


if __name__ == "__main__":
    main()
