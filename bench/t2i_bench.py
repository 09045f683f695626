"""Text-to-image LoRA on CPU: cloudtrain's `--task text_to_image` against a reference loop, same model, data, steps.

    python bench/t2i_bench.py [--steps 30 --warmup_steps 5 --batch_size 16 --images 256 --repetitions 1]
    python bench/t2i_bench.py --quick        # a few steps on a smaller model: checks the bench, measures little

Separate processes see different loads on a shared machine: bench/t2i_interleaved.py takes both loops' steps in
turns in one process, with an A/A control, for a comparison robust to load (docs/t2i-benchmark.md).

The reference ("diffusers-loop") is a loop written here to match the training step of diffusers' example script
examples/text_to_image/train_text_to_image_lora.py; the script itself is not shipped in the diffusers package
(wheel or sdist), and nothing is downloaded here, so it cannot be run as is. What it does, written by us: an
Accelerator (no mixed precision), the pipeline's parts loaded one by one, the UNet frozen and given a LoRA through
PEFT (`unet.add_adapter`, gaussian init, alpha = rank), the captioned folder read with datasets' imagefolder and
prepared on access (shorter side resized, centre crop, [-1, 1]), AdamW on the adapter's parameters, a constant
learning rate, and per step: VAE latents (a sample, times the scaling factor), noise, random timesteps,
`noise_scheduler.add_noise`, the text encoder's hidden states, the UNet's prediction, MSE against the noise,
backward, clipping, step.

Both: the demo model of `make text-to-image` (scripts/make_t2i_digits.py: a small Stable Diffusion pipeline of
32px images, built here with random weights from the seed; its VAE's fit does not change the speed) on the same
scikit-learn digits, rank-4 LoRA on to_q, to_k, to_v, to_out.0 (no dropout), AdamW (lr 1e-4, weight decay 0.01),
clipping at 1.0, fp32, one thread, the same batches in the same order (the reference is given cloudtrain's seeded
sampler). Each runner trains in a fresh process (bench/fresh_process.py); repetitions are interleaved in an order
rotated each time. Reported per runner: median step time after the warm-up steps (steps/s = 1 / that; also the
median CPU time of a step, which other tenants of a shared machine disturb far less), its process's
peak resident memory after training (VmHWM), trainable parameters, and its loss per step; ratios are cloudtrain over
the reference of the same run ("best run": each runner's fastest repetition, the least disturbed by other tenants
of a shared machine). `cloudtrain-cached` adds --cache_latents and --pre_compute_text_embeddings (the VAE
and text encoder run once per image before training; the reference has no such option).

Known differences: the noise, timesteps and latent samples are drawn from each runner's own generator stream, and
LoRA's initial weights from a different point of it, so the losses agree statistically, not step by step (the
report compares their means over the same steps); cloudtrain's AdamW is the fused kernel (--adamw_implementation
auto), the reference's torch's default.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from fresh_process import prepare_worker, run_as_script, run_script

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RUNNERS = ("diffusers-loop", "cloudtrain", "cloudtrain-cached")
REFERENCE = "diffusers-loop"
REFERENCE_NAME = (
    "a loop written to match diffusers' example script's training step (train_text_to_image_lora.py); "
    "the script itself is not shipped in the package"
)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
QUICK = {"steps": 3, "warmup_steps": 1, "batch_size": 4, "images": 16, "width": 8, "resolution": 16}


# ---------------------------------------------------------------- the parent: model and data, once
def build_inputs(folder: Path, images: int, width: int, seed: int) -> tuple[str, str]:
    """The digits as a captioned folder and the demo's pipeline (random weights from `seed`), as
    scripts/make_t2i_digits.py writes them."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_t2i_digits import write_digits
    from t2i_fixtures import build_tiny_pipeline  # on the path through make_t2i_digits

    write_digits(folder / "digits", images)
    build_tiny_pipeline(folder / "model", seed=seed, width=width)
    return str(folder / "model"), str(folder / "digits")


def clock() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on one thread of a shared machine the CPU time of a step is
    what the step costs, its wall time that plus waiting for a core."""
    return time.perf_counter(), time.process_time()


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: a child does not inherit it, unlike ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------- cloudtrain, through the application
def cloudtrain_options(spec: dict, out: str) -> dict:
    cached = spec["runner"] == "cloudtrain-cached"
    return {
        "task": "text_to_image", "model_name_or_path": spec["model_dir"], "train_data_dir": spec["data_dir"],
        "output_dir": out, "resolution": spec["resolution"], "center_crop": True, "random_flip": False,
        "peft": "lora", "lora_r": spec["rank"], "lora_alpha": float(spec["rank"]), "lora_dropout": 0.0,
        "lora_target_modules": TARGETS, "per_device_train_batch_size": spec["batch_size"],
        "max_steps": spec["total_steps"], "learning_rate": spec["learning_rate"], "lr_scheduler_type": "constant",
        "warmup_steps": 0, "weight_decay": spec["weight_decay"], "max_grad_norm": 1.0, "mixed_precision": "no",
        "seed": spec["seed"], "logging_steps": 1, "eval_strategy": "no", "report_to": ["none"],
        "monitoring": False, "cache_latents": cached, "pre_compute_text_embeddings": cached,
    }  # fmt: skip


def run_cloudtrain(spec: dict, out: str) -> dict:
    from cloudtrain.config import build_config
    from cloudtrain.pipeline import build_run

    start = time.perf_counter()
    run = build_run(build_config(cloudtrain_options(spec, out)))
    ends: list[tuple[float, float]] = []
    step = run.trainer.optimizer_step

    def timed_step() -> None:
        step()
        ends.append(clock())

    run.trainer.optimizer_step = timed_step  # type: ignore[method-assign]
    first = clock()
    result = run.trainer.fit()
    peak = peak_rss_mb()
    run.run_log.finish({"train": result.summary()}, [])  # flushes metrics.jsonl
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    return {
        "setup_s": first[0] - start, "step_ends": [first, *ends], "peak_rss_mb": peak,
        "trainable_parameters": trainable, "losses": [r["train/loss"] for r in records if "train/loss" in r],
        "optimizer": "torch AdamW, fused",
    }  # fmt: skip


# ---------------------------------------------------------------- the reference loop
def pixels(image, resolution: int):
    """Shorter side resized to `resolution` (bilinear), the centre square, scaled to [-1, 1]: (3, H, W)."""
    import numpy as np
    import torch
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    scale = resolution / min(w, h)
    image = image.resize(
        (max(resolution, round(w * scale)), max(resolution, round(h * scale))), Image.Resampling.BILINEAR
    )
    left, top = (image.width - resolution) // 2, (image.height - resolution) // 2
    array = np.asarray(image.crop((left, top, left + resolution, top + resolution)), dtype=np.float32)
    return torch.from_numpy(array / 127.5 - 1.0).permute(2, 0, 1)


def reference_parts(spec: dict) -> dict:
    """The pipeline's parts, frozen, and the UNet with its LoRA, as the script sets them up."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from peft import LoraConfig
    from transformers import CLIPTextModel, CLIPTokenizer

    model = spec["model_dir"]
    parts = {
        "scheduler": DDPMScheduler.from_pretrained(model, subfolder="scheduler"),
        "tokenizer": CLIPTokenizer.from_pretrained(model, subfolder="tokenizer"),
        "text_encoder": CLIPTextModel.from_pretrained(model, subfolder="text_encoder"),
        "vae": AutoencoderKL.from_pretrained(model, subfolder="vae"),
        "unet": UNet2DConditionModel.from_pretrained(model, subfolder="unet"),
    }
    for name in ("unet", "vae", "text_encoder"):
        parts[name].requires_grad_(False)
    rank = spec["rank"]
    parts["unet"].add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=TARGETS))
    return parts


def reference_loader(spec: dict, tokenizer, cache_dir: str):
    """datasets' imagefolder over the captioned folder, each row prepared when read; cloudtrain's sampler, so
    that both runners see the same batches in the same order."""
    import datasets
    import torch

    from cloudtrain.data.processing import EpochShuffleSampler

    rows = datasets.load_dataset("imagefolder", data_dir=spec["data_dir"], split="train", cache_dir=cache_dir)

    def prepare(batch: dict) -> dict:
        ids = tokenizer(
            batch["text"], max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        return {"pixel_values": [pixels(image, spec["resolution"]) for image in batch["image"]], "input_ids": ids}

    def collate(examples: list[dict]) -> dict:
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]).contiguous().float(),
            "input_ids": torch.stack([e["input_ids"] for e in examples]),
        }

    sampler = EpochShuffleSampler(len(rows), spec["seed"])
    loader = torch.utils.data.DataLoader(
        rows.with_transform(prepare), batch_size=spec["batch_size"], sampler=sampler, collate_fn=collate
    )
    return loader, sampler


def reference_loop(spec: dict, out: str):
    """The script's set-up, then a callable taking one training step as its loop does (returns the step's loss,
    read back as the script logs it), and the trainable parameters."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler

    accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=1, cpu=True)
    set_seed(spec["seed"])
    parts = reference_parts(spec)
    unet, vae, text_encoder, noise_scheduler = parts["unet"], parts["vae"], parts["text_encoder"], parts["scheduler"]
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=spec["learning_rate"], betas=(0.9, 0.999), weight_decay=spec["weight_decay"], eps=1e-8
    )
    loader, sampler = reference_loader(spec, parts["tokenizer"], str(Path(out) / "datasets-cache"))
    schedule = get_scheduler(
        "constant", optimizer=optimizer, num_warmup_steps=0, num_training_steps=spec["total_steps"]
    )
    unet, optimizer, loader, schedule = accelerator.prepare(unet, optimizer, loader, schedule)
    unet.train()

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()

    def step() -> float:
        batch = next(stream)
        with accelerator.accumulate(unet):
            latents = vae.encode(batch["pixel_values"]).latent_dist.sample() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            hidden = text_encoder(batch["input_ids"], return_dict=False)[0]
            predicted = unet(noisy, timesteps, hidden, return_dict=False)[0]
            loss = F.mse_loss(predicted.float(), noise.float(), reduction="mean")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        return accelerator.gather(loss.detach()).mean().item()  # the script logs each step's loss

    return step, params


def run_reference(spec: dict, out: str) -> dict:
    start = time.perf_counter()
    step, params = reference_loop(spec, out)
    first = clock()
    ends: list[tuple[float, float]] = []
    losses: list[float] = []
    while len(ends) < spec["total_steps"]:
        losses.append(step())
        ends.append(clock())
    return {
        "setup_s": first[0] - start, "step_ends": [first, *ends], "peak_rss_mb": peak_rss_mb(),
        "trainable_parameters": sum(p.numel() for p in params), "losses": losses,
        "optimizer": "torch AdamW, default kernel",
    }  # fmt: skip


# ---------------------------------------------------------------- one run (a fresh interpreter)
def train_once(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as out:
        raw = (run_reference if spec["runner"] == REFERENCE else run_cloudtrain)(spec, out)
    ends = raw.pop("step_ends")
    times = [b[0] - a[0] for a, b in pairwise(ends)]
    cpu = [b[1] - a[1] for a, b in pairwise(ends)]
    step_s = statistics.median(times[spec["warmup_steps"] :])
    return {
        **raw,
        "runner": spec["runner"],
        "steps": len(times),
        "median_step_s": step_s,
        "median_cpu_step_s": statistics.median(cpu[spec["warmup_steps"] :]),
        "steps_per_s": 1 / step_s,
        "images_per_s": spec["batch_size"] / step_s,
        "train_s": sum(times),
        "num_threads": torch.get_num_threads(),
    }


def _worker_main(spec_json: str, result_path: str) -> None:
    prepare_worker()
    Path(result_path).write_text(json.dumps(train_once(json.loads(spec_json))))


# ---------------------------------------------------------------- the parent: runs, summary, report
def measure(spec: dict, runners: list[str], repetitions: int, log) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for rep in range(repetitions):
        order = runners[rep % len(runners) :] + runners[: rep % len(runners)]
        for name in order:
            print(f"[{time.strftime('%H:%M:%S')}] t2i bench {rep + 1}/{repetitions}: {name}", file=sys.stderr)
            runs[name].append(run_script(__file__, {**spec, "runner": name}, log, f"t2i benchmark run {name}"))
    return runs


def summarize(runs: list[dict], window: int) -> dict:
    """Medians over the repetitions; the loss means over the first and the last `window` steps."""
    losses = [statistics.fmean(col) for col in zip(*(r["losses"] for r in runs), strict=True)]
    keys = ("median_step_s", "median_cpu_step_s", "peak_rss_mb", "setup_s")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["steps_per_s"] = 1 / out["median_step_s"]
    out["best_steps_per_s"] = 1 / min(r["median_step_s"] for r in runs)  # the least disturbed run of a shared machine
    out["images_per_s"] = runs[0]["images_per_s"] * runs[0]["median_step_s"] / out["median_step_s"]
    out.update({k: runs[0][k] for k in ("steps", "trainable_parameters", "optimizer", "num_threads")})
    out["first_losses_mean"] = statistics.fmean(losses[:window])
    out["last_losses_mean"] = statistics.fmean(losses[-window:])
    out["losses"] = losses
    return out


def compare(summaries: dict) -> dict:
    """Each cloudtrain runner over the reference: steps/s, peak memory, and the last steps' mean loss."""
    ref = summaries[REFERENCE]
    return {
        name: {
            "steps_per_s": s["steps_per_s"] / ref["steps_per_s"],
            "best_steps_per_s": s["best_steps_per_s"] / ref["best_steps_per_s"],
            "cpu_steps_per_s": ref["median_cpu_step_s"] / s["median_cpu_step_s"],
            "peak_rss_mb": s["peak_rss_mb"] / ref["peak_rss_mb"],
            "last_losses_mean": s["last_losses_mean"] / ref["last_losses_mean"],
        }
        for name, s in summaries.items()
        if name != REFERENCE
    }


def report(results: dict) -> str:
    s = results["settings"]
    window = results["loss_window"]
    lines = [
        "## Text-to-image LoRA: cloudtrain vs a loop matching diffusers' example script",
        "",
        f"Reference (`{REFERENCE}`): {REFERENCE_NAME}.",
        "",
        f"Model: the demo's Stable Diffusion pipeline (UNet width {s['width']}, {s['resolution']}px, random weights),"
        f" {s['images']} scikit-learn digits, batch {s['batch_size']}, LoRA r={s['rank']} alpha={s['rank']} on "
        f"{','.join(TARGETS)}, AdamW lr {s['learning_rate']:g} wd {s['weight_decay']:g}, constant schedule, "
        f"fp32, {s['threads']} thread(s), {s['warmup_steps']} warm-up + {s['steps']} timed steps; medians of "
        f"{results['repetitions']} interleaved repetition(s), each runner a fresh process; wall "
        f"{results['wall_s']:.0f}s.",
        "",
        f"| runner | steps | s/step | steps/s | images/s | vs ref | best run steps/s | vs ref | CPU s/step | vs ref "
        f"| peak RSS MiB | vs ref | trainable | loss, first {window} | loss, last {window} | vs ref | setup s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = results["vs_reference"]
    for name, m in results["runners"].items():
        r = ratios.get(name)

        def x(key: str, r: dict | None = r) -> str:
            return f"{r[key]:.2f}x" if r else "1.00x"

        lines.append(
            f"| {name} | {m['steps']} | {m['median_step_s']:.3f} | {m['steps_per_s']:.2f} | {m['images_per_s']:.1f} "
            f"| {x('steps_per_s')} | {m['best_steps_per_s']:.2f} | {x('best_steps_per_s')} "
            f"| {m['median_cpu_step_s']:.3f} | {x('cpu_steps_per_s')} | {m['peak_rss_mb']:.0f} "
            f"| {x('peak_rss_mb')} | {m['trainable_parameters']:,} "
            f"| {m['first_losses_mean']:.4f} | {m['last_losses_mean']:.4f} | {x('last_losses_mean')} "
            f"| {m['setup_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("steps", 30), ("warmup_steps", 5), ("batch_size", 16), ("images", 256), ("width", 32),
        ("resolution", 32), ("rank", 4), ("threads", 1), ("seed", 42), ("repetitions", 1),
    ):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--runners", default=",".join(RUNNERS), help=f"comma-separated, from {', '.join(RUNNERS)}")
    p.add_argument("--quick", action="store_true", help=f"a check of the bench: {QUICK}")
    p.add_argument("--out", type=Path, help="also write t2i.md and t2i.json here")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args.runners = [r for r in args.runners.split(",") if r]
    if REFERENCE not in args.runners or set(args.runners) - set(RUNNERS):
        p.error(f"--runners takes names from {', '.join(RUNNERS)}, {REFERENCE} among them")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    settings = {k: v for k, v in vars(args).items() if k not in ("runners", "quick", "out", "repetitions")}
    with tempfile.TemporaryDirectory() as folder:
        model_dir, data_dir = build_inputs(Path(folder), args.images, args.width, args.seed)
        spec = {**settings, "model_dir": model_dir, "data_dir": data_dir, "total_steps": args.warmup_steps + args.steps}
        runs = measure(spec, args.runners, args.repetitions, sys.stderr)
    window = max(1, args.steps // 3)
    summaries = {name: summarize(r, window) for name, r in runs.items()}
    results = {
        "settings": settings, "reference": REFERENCE_NAME, "repetitions": args.repetitions, "loss_window": window,
        "runners": summaries, "vs_reference": compare(summaries), "runs": runs, "wall_s": time.perf_counter() - start,
    }  # fmt: skip
    text = report(results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "t2i.md").write_text(text)
        (args.out / "t2i.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    run_as_script(main, _worker_main)
