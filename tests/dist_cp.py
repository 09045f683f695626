"""Launched by tests/test_context_parallel.py under torchrun: context parallelism (torch's `context_parallel`, ring
attention over SDPA) on a tiny Llama against the same model on the whole rows, in every process.

Each process holds chunks r and 2N-1-r of every row (torch's head-tail load balancer, which must be the cut of
cloudtrain.parallel.context), with their position ids and next-token targets (shifted before the cut). The
self-attention layers are given no mask: the position ids of a shard jump between its two chunks, which
transformers reads as two packed documents and masks, while ring attention computes plain causal attention over
the whole row. The shards' summed losses, and every gradient summed over the processes, must equal the unsplit
model's. Prints one `ok` line per process; where ring attention cannot run (CPU), one `cannot run` line with the
error torch raised, and no `ok` line."""

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.parallel import context

LENGTH = 64  # 4 chunks of 16 with 2 processes


def tiny_llama(device: str) -> LlamaForCausalLM:
    """No grouped KV heads: transformers would ask SDPA for enable_gqa, which ring attention does not take."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=LENGTH,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).train()


def drop_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs["attention_mask"] = None  # plain causal attention: transformers' SDPA then passes is_causal=True
    return args, kwargs


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("cp",))

    torch.manual_seed(1)  # the same rows in every process
    ids = torch.randint(0, 256, (2, LENGTH), device=device)
    labels = ids.clone()
    labels[1, 40:] = IGNORE_INDEX  # uneven target counts: the global count matters
    positions = torch.arange(LENGTH, device=device).expand(2, LENGTH).contiguous()
    targets = context.shift_labels(labels)

    reference = tiny_llama(device)
    model = copy.deepcopy(reference)
    whole, count = context.shard_loss(reference(input_ids=ids, position_ids=positions, use_cache=False).logits, targets)
    (whole / count).backward()

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(drop_mask, with_kwargs=True, prepend=True)
    from torch.distributed.tensor.experimental import context_parallel

    buffers = [ids.clone(), positions.clone(), targets.clone()]
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1]):
            for part, full in zip(buffers, (ids, positions, targets), strict=True):
                assert torch.equal(part, context.shard(full, world, rank)), "torch's cut is not cloudtrain's"
            summed, n = context.shard_loss(
                model(input_ids=buffers[0], position_ids=buffers[1], use_cache=False).logits, buffers[2]
            )
            total = n.clone()
            dist.all_reduce(total)  # the global target count, as the trainer normalises by it
            (summed / total).backward()
    except (NotImplementedError, RuntimeError) as err:
        print(f"rank {rank} cannot run on {device}: {type(err).__name__}: {str(err).splitlines()[0]}", flush=True)
        dist.destroy_process_group()
        return

    assert total.item() == count.item()
    summed = summed.detach().clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(summed, whole.detach(), rtol=1e-5, atol=1e-4)
    checked = 0
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grad = param.grad.clone()
        dist.all_reduce(grad)  # each process's gradient comes from its own tokens' losses
        # the kernel adds in another order over half-length blocks; a wrong mask would differ by far more
        torch.testing.assert_close(grad, expected.grad, rtol=1e-3, atol=1e-5, msg=name)
        checked += 1
    print(f"ok rank {rank}: loss and {checked} gradients equal the unsplit model's", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)
