"""The input path of a training step (cloudtrain.training.prefetch): batches placed ahead in the loader's
order, the data time as the device's wait for input, and no host-device sync in a step outside the
logging steps (checked on a GPU with torch's sync debug mode)."""

import math

import pytest
import torch
from test_training import tiny_setup

from cloudtrain.config import DataConfig
from cloudtrain.data.processing import loader_options
from cloudtrain.training import AcceleratedTrainer, BasicTrainer, Hook, LoopState
from cloudtrain.training import trainer as trainer_module
from cloudtrain.training.prefetch import InputClock, prefetch


def numbered(n: int, fetched: list[int]):
    """n batches, each noting in `fetched` when the loop asked for it."""
    for i in range(n):
        fetched.append(i)
        yield {"input_ids": torch.full((2, 3), i), "labels": torch.tensor([i, -i])}


def place(device: torch.device):
    return lambda batch: {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def this_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_prefetch_hands_over_the_same_batches_in_order_on_the_device(ahead):
    device, fetched, handed = this_device(), [], []
    for batch in prefetch(numbered(6, fetched), place(device), device, ahead):
        handed.append(batch)
        # the loader was asked for exactly `ahead` batches more than handed over (fewer at its end)
        assert len(fetched) == min(len(handed) + ahead, 6)
    assert len(handed) == 6
    for i, batch in enumerate(handed):
        assert set(batch) == {"input_ids", "labels"}
        assert all(value.device == device for value in batch.values())
        torch.testing.assert_close(batch["input_ids"].cpu(), torch.full((2, 3), i), rtol=0, atol=0)
        torch.testing.assert_close(batch["labels"].cpu(), torch.tensor([i, -i]), rtol=0, atol=0)


def test_without_workers_a_batch_is_fetched_only_when_its_step_asks(tiny_setup_basic):
    """A dataset transform may draw from the global RNG (an image flip): fetched ahead of the step before
    it, a resumed run would draw in another order. With workers the draws happen in the workers."""
    trainer = tiny_setup_basic(dataloader_num_workers=0)
    fetched: list[int] = []
    batches = trainer.input_batches(numbered(4, fetched))
    for i, _ in enumerate(batches):
        assert len(fetched) == i + 1
    with_workers = tiny_setup_basic(dataloader_num_workers=1)
    fetched.clear()
    for i, _ in enumerate(with_workers.input_batches(numbered(4, fetched))):
        assert len(fetched) == min(i + 2, 4)


@pytest.fixture
def tiny_setup_basic(tiny_model_dir, tmp_path):
    def build(**overrides) -> BasicTrainer:
        trainer = tiny_setup(tiny_model_dir, tmp_path, BasicTrainer, per_device_train_batch_size=2, **overrides)
        trainer.setup()
        return trainer

    return build


def test_pinning_is_on_by_default_where_there_is_a_gpu():
    assert loader_options(DataConfig())["pin_memory"] == torch.cuda.is_available()
    assert loader_options(DataConfig(dataloader_pin_memory=False))["pin_memory"] is False


class Seen(Hook):
    """Each step's loss, and the batches the model saw (host reads: this is a test)."""

    def __init__(self, trainer):
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: self.batches.append(kwargs["input_ids"].cpu()), with_kwargs=True
        )

    def on_step_end(self, loop: LoopState) -> None:
        assert loop.stats is not None
        self.losses.append(float(loop.stats.loss_sum / loop.stats.count))


def trained(trainer) -> Seen:
    seen, real = Seen(trainer), trainer.hooks
    trainer.hooks = lambda *args: [*real(*args), seen]
    trainer.fit()
    return seen


def test_loader_workers_and_prefetching_train_on_the_same_batches(tiny_setup_basic):
    """Fetched ahead from a worker or in step order in this process: the same batches, in the same order,
    and the same losses, across an epoch boundary (5 steps per epoch)."""
    runs = [
        trained(tiny_setup_basic(max_steps=7, logging_steps=3, dataloader_num_workers=workers)) for workers in (0, 1)
    ]
    assert len(runs[0].batches) == 7
    for a, b in zip(runs[0].batches, runs[1].batches, strict=True):
        assert torch.equal(a, b)
    assert runs[0].losses == runs[1].losses and all(map(math.isfinite, runs[0].losses))


@pytest.mark.slow  # the fast tier's slowest (5-6 s): the full suite runs it
def test_a_resumed_epoch_keeps_accelerates_non_blocking_copies(tiny_model_dir, tmp_path, monkeypatch):
    """accelerate's skip_first_batches builds its loader without the non-blocking flag: the loop carries it over,
    or the rest of a resumed epoch would copy each batch with a blocking copy (a sync per step on CUDA)."""
    trainer = tiny_setup(tiny_model_dir, tmp_path, AcceleratedTrainer, max_steps=8, per_device_train_batch_size=2)
    trainer.accelerator.dataloader_config.non_blocking = True  # as cloudtrain.parallel.distributed builds it
    loop = trainer._start(None, None)
    assert trainer.train_dl._non_blocking
    loop.state.global_step = 2  # resumed mid-epoch (5 steps per epoch): 2 steps' batches are skipped
    loaders = []
    monkeypatch.setattr(trainer_module, "micro_batch_windows", lambda batches, k: loaders.append(batches) or iter([[]]))
    next(trainer._windows(loop))
    assert loaders[0] is not trainer.train_dl and loaders[0]._non_blocking is True
    assert len(loaders[0]) == len(trainer.train_dl) - 2


class FakeEvent:
    """A CUDA event's timing on a clock the test moves."""

    def __init__(self, now: list[float]):
        self.at, self.synchronized = now[0], False

    def elapsed_time(self, later: "FakeEvent") -> float:
        return (later.at - self.at) * 1000  # milliseconds, as CUDA's

    def synchronize(self) -> None:
        self.synchronized = True


def test_the_data_time_is_the_devices_wait_between_a_steps_start_and_its_batch():
    """On CUDA a step's time and its data wait come from events on the GPU's timeline (here a fake one):
    start -> batch ready is the wait, start -> end the step; the hooks' time between steps is neither."""
    now = [0.0]
    events: list[FakeEvent] = []

    def event() -> FakeEvent:
        events.append(FakeEvent(now))
        return events[-1]

    clock = InputClock(torch.device("cpu"), event=event)
    clock.cuda = True  # the CUDA path, with the fake events
    for wait, compute, hooks in ((0.5, 2.0, 7.0), (0.0, 3.0, 0.0), (0.25, 1.0, 0.0)):
        clock.start_step()
        now[0] += wait
        clock.data_ready()
        now[0] += compute
        clock.end_step()
        now[0] += hooks  # logging, evaluation, a checkpoint: outside the step
    clock.start_step()  # the next step began to wait; not ended before the read
    steps, step_s, data_s, forward_s = clock.read()
    assert events[-2].synchronized  # the read waited for the last ended step's events only
    assert (steps, step_s, data_s, forward_s) == (3, 6.75, 0.75, 0.0)
    assert clock.read() == [0.0, 0.0, 0.0, 0.0]  # read once


def test_on_cpu_the_data_time_is_the_hosts(monkeypatch):
    clock = InputClock(torch.device("cpu"))
    ticks = iter([10.0, 11.5, 14.0])  # the step starts waiting, its batch is there, it ends
    monkeypatch.setattr("cloudtrain.observe.monitoring.time.perf_counter", lambda: next(ticks))
    clock.start_step(), clock.data_ready(), clock.end_step()
    monkeypatch.undo()
    assert clock.read() == [1.0, 4.0, 1.5, 0.0]


class SyncDebug(Hook):
    """torch's sync debug mode raises on any host-device sync from the end of the first step (its lazy
    set-up: optimizer state, the scaler's) until the step before the last (a logging step, where the loop
    syncs by design): the data, the step and the hooks of every step between. The model's own forward is
    left out: transformers' attention-mask check reads the mask on the host (issue 30's attention work)."""

    def __init__(self, model: torch.nn.Module):
        self.on = False
        model.register_forward_pre_hook(lambda *args: torch.cuda.set_sync_debug_mode(0))
        model.register_forward_hook(lambda *args: torch.cuda.set_sync_debug_mode("error" if self.on else 0))

    def on_step_end(self, loop: LoopState) -> None:
        self.on = loop.step < loop.total_steps - 1
        torch.cuda.set_sync_debug_mode("error" if self.on else 0)

    def close(self) -> None:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("trainer_cls", [BasicTrainer, AcceleratedTrainer])
def test_no_host_device_sync_in_a_step_outside_the_logging_steps(tiny_model_dir, tmp_path, trainer_cls, precision):
    """8 steps logged only at the last (--logging_steps 100), gradient accumulation 2, clipping on, across
    epochs: steps 2 to 7 run under the sync debug mode. The AcceleratedTrainer needs accelerate's
    non-blocking copies (DataLoaderConfiguration(non_blocking=True) in cloudtrain.parallel.distributed)."""
    trainer = tiny_setup(
        tiny_model_dir,
        tmp_path,
        trainer_cls,
        mixed_precision=precision,
        max_steps=8,
        logging_steps=100,
        gradient_accumulation_steps=2,
        max_grad_norm=1.0,
        per_device_train_batch_size=2,
        eval_strategy="no",
    )
    real, debug = trainer.hooks, SyncDebug(trainer.model)
    trainer.hooks = lambda *args: [*real(*args), debug]
    result = trainer.fit()
    assert result.global_step == 8 and math.isfinite(result.train_loss)
    assert torch.cuda.get_sync_debug_mode() == 0
