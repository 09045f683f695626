"""How long the training loop is blocked per checkpoint save: synchronous vs --async_checkpointing true.

A model of --params parameters (Linear layers) with AdamW state is saved --saves times through the real
Checkpointer, the way each trainer saves, synchronously (the files written, then sealed and renamed) and
asynchronously (a CPU snapshot, then the same files in the background while training steps run), in the same
run. --trainer basic: the BasicTrainer's files (safetensors + torch.save); --trainer accelerated: the
AcceleratedTrainer's own `write_checkpoint` (accelerate's save_state) and `checkpoint_snapshot`, on one process
or, launched with torchrun, DDP on several (every process snapshots its part; the threads meet in a gloo group
of their own before the folder is renamed). Prints the blocked seconds per save of each, and the time until a
background save was published.

    .venv/bin/python bench/async_checkpoint_bench.py --params 50_000_000 --saves 3 --trainer both
    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/async_checkpoint_bench.py --trainer accelerated
"""

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from cloudtrain.async_save import cpu_copy, weights_snapshot
from cloudtrain.checkpointing import Checkpointer, Storage, TrainerState
from cloudtrain.config import build_config
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.training.accelerated import AcceleratedTrainer

Write = Callable[[Path], None]


def model_and_optimizer(params: int, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What the loop does while a background save is written: a training step (AdamW's moments exist after it)."""
    model(torch.randn(8, 1024)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def basic_writers(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Callable[[], Write], Write]:
    """(take a snapshot, write now) as the BasicTrainer does."""

    def snapshot() -> Write:
        weights, dropped = weights_snapshot(model.state_dict())
        training = cpu_copy({"optimizer": optimizer.state_dict()})

        def write(folder: Path) -> None:
            safetensors.torch.save_file(weights, str(folder / "model.safetensors"), metadata=dropped or None)
            torch.save(training, folder / "training_state.pt")

        return write

    def write_now(folder: Path) -> None:
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict()}, folder / "training_state.pt")

    return snapshot, write_now


def accelerated_writers(model, optimizer, accelerator: Accelerator) -> tuple[Callable[[], Write], Write]:
    """(take a snapshot, write now) through the AcceleratedTrainer's own methods, on the prepared model."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = SimpleNamespace(
        accelerator=accelerator,
        scheduler=scheduler,
        checkpoint_owner=accelerator.is_main_process,
        partial=False,
        tensor_parallel=False,
    )  # the attributes the two methods read: a trainer without the data and task it needs for training
    return (
        lambda: AcceleratedTrainer.checkpoint_snapshot(trainer),  # type: ignore[arg-type]
        lambda folder: AcceleratedTrainer.write_checkpoint(trainer, folder),  # type: ignore[arg-type]
    )


def everyone(flag: bool, processes: int) -> bool:
    if processes == 1:
        return flag
    votes = torch.tensor([int(flag)])
    torch.distributed.all_reduce(votes, op=torch.distributed.ReduceOp.MIN)
    return bool(votes.item())


def bench(trainer: str, params: int, saves: int) -> None:
    model, optimizer = model_and_optimizer(params)
    accelerator = None
    if trainer == "accelerated":
        accelerator = Accelerator(cpu=not torch.cuda.is_available())
        model, optimizer = accelerator.prepare(model, optimizer)
        snapshot, write_now = accelerated_writers(model, optimizer, accelerator)
        name, main = "AcceleratedTrainer", accelerator.is_main_process
        processes, index = accelerator.num_processes, accelerator.process_index
    else:
        snapshot, write_now = basic_writers(model, optimizer)
        name, main, processes, index = "BasicTrainer", True, 1, 0
    train_step(model, optimizer)
    mesh = Mesh(world=processes, dp_replicate=processes)
    barrier = accelerator.wait_for_everyone if accelerator else (lambda: None)
    share = (lambda value: broadcast_object_list([value])[0]) if processes > 1 else (lambda value: value)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(share(tmp))  # the main process's folder: one shared folder, as on one node
        saver = Checkpointer(
            build_config({"checkpointing_steps": "1"}), folder / "ck", folder, main, barrier,
            storage=Storage(owner=main), share=share, index=index,
        )  # fmt: skip
        sync, blocked, published, steps = [], [], [], 0
        for step in range(1, saves + 1):
            start = time.perf_counter()
            saver.save(step, write_now, name, mesh, TrainerState(global_step=step), start)
            sync.append(time.perf_counter() - start)
            train_step(model, optimizer)
        for step in range(saves + 1, 2 * saves + 1):
            start = time.perf_counter()
            blocked.append(saver.save_async(step, snapshot(), name, mesh, TrainerState(global_step=step), start))
            seen = False
            while True:  # the loop goes on until every process has published (each runs the same steps: DDP)
                saver.background.check()  # a failed background save: its error
                seen = seen or any(done == step for done, _ in saver.take_published())
                if everyone(seen, processes):
                    break
                train_step(model, optimizer)
                steps += 1
            published.append(time.perf_counter() - start)
        barrier()
    if main:
        count = sum(p.numel() for p in model.parameters())
        size = count * 4 * 3 / 2**20  # fp32 weights + two AdamW moments
        print(f"{name}, {processes} process(es): {count / 1e6:.1f}M parameters, about {size:.0f} MiB per checkpoint")
        print(f"  synchronous:  loop blocked {sum(sync) / saves:.3f}s per save")
        print(
            f"  asynchronous: loop blocked {sum(blocked) / saves:.3f}s per save (snapshot to CPU); published "
            f"{sum(published) / saves:.3f}s after it started, {steps / saves:.1f} training steps ran meanwhile"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--trainer", choices=["basic", "accelerated", "both"], default="both")
    args = parser.parse_args()
    for trainer in ("basic", "accelerated") if args.trainer == "both" else (args.trainer,):
        bench(trainer, args.params, args.saves)
