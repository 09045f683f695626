"""How long the training loop is blocked per checkpoint save: synchronous vs --async_checkpointing true.

A model of --params parameters (Linear layers) with AdamW state is saved --saves times through the real
Checkpointer, the way the BasicTrainer saves: synchronously (safetensors + torch.save, then seal and rename),
and asynchronously (CPU snapshot, then the same files in the background, with a training step's worth of
matmuls running in between). Prints the blocked seconds per save of each, and the background write time.

    .venv/bin/python bench/async_checkpoint_bench.py --params 50_000_000 --saves 3
"""

import argparse
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

from cloudtrain.async_save import cpu_copy, weights_snapshot
from cloudtrain.checkpointing import Checkpointer, TrainerState
from cloudtrain.config import build_config
from cloudtrain.parallel.mesh import Mesh

MESH = Mesh(world=1, dp_replicate=1)


def model_and_optimizer(params: int, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # AdamW's moments exist: the checkpoint holds them
    return model, optimizer


def sync_write(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    def write(folder: Path) -> None:
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict()}, folder / "training_state.pt")

    return write


def async_write(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    weights, dropped = weights_snapshot(model.state_dict())
    training = cpu_copy({"optimizer": optimizer.state_dict()})

    def write(folder: Path) -> None:
        safetensors.torch.save_file(weights, str(folder / "model.safetensors"), metadata=dropped or None)
        torch.save(training, folder / "training_state.pt")

    return write


def busy_step(model: torch.nn.Module) -> None:
    """What the loop does while a background save is written (forward passes)."""
    with torch.no_grad():
        model(torch.randn(64, model[0].in_features))


def bench(params: int, saves: int) -> None:
    model, optimizer = model_and_optimizer(params)
    count = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        saver = Checkpointer(
            build_config({"checkpointing_steps": "1"}), Path(tmp) / "ck", Path(tmp), True, lambda: None
        )
        sync, background, written = [], [], []
        for step in range(1, saves + 1):
            start = time.perf_counter()
            saver.save(step, sync_write(model, optimizer), "BasicTrainer", MESH, TrainerState(global_step=step), start)
            sync.append(time.perf_counter() - start)
        for step in range(saves + 1, 2 * saves + 1):
            start = time.perf_counter()
            write = async_write(model, optimizer)
            background.append(
                saver.save_async(step, write, "BasicTrainer", MESH, TrainerState(global_step=step), start)
            )
            while saver.background.in_flight:
                busy_step(model)
            saver.background.wait()
            written.append(time.perf_counter() - start)
    size = count * 4 * 3 / 2**20  # fp32 weights + two AdamW moments
    print(f"model: {count / 1e6:.1f}M parameters, about {size:.0f} MiB per checkpoint, {saves} saves each")
    print(f"synchronous:  loop blocked {sum(sync) / saves:.3f}s per save")
    print(
        f"asynchronous: loop blocked {sum(background) / saves:.3f}s per save (snapshot to CPU); "
        f"written in the background in {sum(written) / saves:.3f}s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    bench(args.params, args.saves)
