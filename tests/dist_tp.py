"""Launched by tests/test_tensor_parallel.py under torchrun: the tensor-parallel model (loaded as cloudtrain loads it,
on a (dp_replicate, tp) mesh) against the unsharded model on the whole batch, in every process. Each data-parallel
replica takes its own rows and scales its summed loss as the trainer does (processes / the global token count,
summed over every process); the loss and every gradient, gathered from the shards, must equal the unsharded
model's. Prints one `ok` line per process. Then LoRA (PEFT, as cloudtrain attaches it) on the sharded model: its
first forward must still fail as the --peft refusal says (one `refusal holds` line per process); once the
installed PEFT runs it, this says so, and the refusal can be reconsidered (docs/parallelism.md#adapters).

    python -m torch.distributed.run --nproc_per_node 4 tests/dist_tp.py MODEL_DIR TP MODE...

Each MODE (replicate: data-parallel replicas; fsdp: FSDP2 shards, 2-D) in turn in the one launch: a launch's
start (torch, transformers imported in every process) costs more than these checks."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from cloudtrain.config import Config
from cloudtrain.data.packing import IGNORE_INDEX, causal_lm_forward, shifted_loss
from cloudtrain.parallel import tensor


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def main(model_dir: str, tp: int, modes: list[str]) -> None:
    dist.init_process_group("gloo")
    for mode in modes:
        check(model_dir, tp, mode == "fsdp")
    dist.destroy_process_group()


def check(model_dir: str, tp: int, fsdp: bool) -> None:
    """The sharded model's loss and gradients against the unsharded one's, then the adapters' refusal."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = world // tp
    torch.manual_seed(0)  # the same batch in every process
    ids = torch.randint(0, 300, (4, 20))
    labels = ids.clone()
    labels[0, 12:] = IGNORE_INDEX  # uneven token counts: the global count matters
    labels[3, 5:] = IGNORE_INDEX
    positions = torch.arange(20).expand(4, 20)

    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    summed, count = shifted_loss(causal_lm_forward(reference, {"input_ids": ids, "position_ids": positions}), labels)
    (summed / count).backward()

    cfg = Config()
    cfg.distributed.tensor_parallel_size, cfg.distributed.fsdp = tp, fsdp
    sharded = AutoModelForCausalLM.from_pretrained(model_dir, **tensor.load_options(cfg, world))
    assert any(isinstance(p, DTensor) for p in sharded.parameters()), "the model was not sharded"
    rows = slice(rank // tp * 4 // replicas, (rank // tp + 1) * 4 // replicas)  # this replica's rows
    batch = {"input_ids": ids[rows], "position_ids": positions[rows], "labels": labels[rows]}
    local_sum, local_count = shifted_loss(causal_lm_forward(sharded, batch), batch["labels"])
    total = local_count.double().clone()
    dist.all_reduce(total)
    (local_sum * (world / total).float()).backward()

    replica_sum = local_sum.detach().clone()
    dist.all_reduce(replica_sum)  # each row counted tp times
    torch.testing.assert_close(replica_sum / tp, summed.detach(), rtol=1e-5, atol=1e-5)
    checked = 0
    grads = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        torch.testing.assert_close(full(param.grad), grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        checked += 1
    assert checked == len(grads)
    mode = "fsdp" if fsdp else "replicate"
    print(f"ok rank {rank} {mode}: loss and {checked} gradients equal the unsharded model's", flush=True)
    check_adapters_still_fail(model_dir, cfg, world, batch)


def check_adapters_still_fail(model_dir: str, cfg: Config, world: int, batch: dict) -> None:
    """PEFT builds a row-split layer's lora_A at the local input width (o_proj, down_proj); transformers' rowwise
    forward takes that width for the whole one and cannot lay the input out."""
    from cloudtrain.models import adapters

    cfg.model.peft, cfg.model.lora_dropout = "lora", 0.0
    model = AutoModelForCausalLM.from_pretrained(model_dir, **tensor.load_options(cfg, world))
    model = adapters.attach(model, cfg, "CAUSAL_LM", [])
    row_split = model.get_submodule("base_model.model.model.layers.0.self_attn.o_proj.lora_A.default")
    assert isinstance(row_split.weight, DTensor) and row_split.in_features < row_split.weight.shape[1]
    try:
        causal_lm_forward(model, batch)
    except RuntimeError as err:
        if "is invalid for input of size" not in str(err):
            raise
        print(f"refusal holds: LoRA on the sharded model fails: {str(err).splitlines()[0]}", flush=True)
        return
    print("LoRA on the sharded model ran: the installed PEFT may support it; reconsider the --peft refusal")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    os._exit(0)
