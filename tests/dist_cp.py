"""Launched by tests/test_context_parallel.py under torchrun (gloo): context parallelism as the trainer runs it,
against the whole model in every process. Processes form (data parallel, cp) groups as the runtime lays them out;
each group takes its rows, each process its slice of their tokens (`cut_batch`), attends through the all-to-all
attention, and scales its summed loss as the trainer does (processes / the global target count). For unpacked
rows (of uneven lengths, padded, and a width the group does not divide) and packed rows (bfd: several documents a
row, with their lengths): the logits put back together equal the whole model's (so packed documents stay apart),
the summed losses and every gradient (averaged over the processes, as DDP does) equal the whole model's.
Prints one `ok` line per process and case."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from cloudtrain.data.packing import CausalLMCollator, causal_lm_forward, shifted_loss, target_loss
from cloudtrain.parallel import sequence
from cloudtrain.parallel.context import cut_batch, unshard


def batches() -> dict[str, dict]:
    rng = torch.Generator().manual_seed(0)

    def doc(n: int) -> list[int]:
        return torch.randint(1, 300, (n,), generator=rng).tolist()

    unpacked = [{"input_ids": doc(n), "seq_lengths": [n]} for n in (19, 11, 19, 6)]  # width 19: cut after padding
    packed = []
    for lengths in ((7, 9, 4), (12, 8), (5, 5, 5, 3), (20,)):
        docs = [doc(n) for n in lengths]
        packed.append({"input_ids": [t for d in docs for t in d], "seq_lengths": list(lengths)})
    return {
        "unpacked": CausalLMCollator(0)(unpacked),
        "packed": CausalLMCollator(0, cu_seqlens=True)(packed),
    }


def main(model_dir: str, cp: int) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // cp
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp_replicate", "cp"))
    group, cp_rank, dp_rank = mesh.get_group("cp"), mesh.get_local_rank("cp"), mesh.get_local_rank("dp_replicate")
    for name, batch in batches().items():
        reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        whole_batch = {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}  # sdpa: positions
        logits = causal_lm_forward(reference, whole_batch)
        summed, count = shifted_loss(logits, batch["labels"])
        (summed / count).backward()

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        sequence.install(model, group)
        rows = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)  # this group's rows
        mine = cut_batch(_rows(batch, rows), cp, cp_rank)
        sequence.mark_cut(mine["cu_seqlens"])
        local_logits = causal_lm_forward(model, mine)
        local_sum, local_count = target_loss(local_logits, mine["targets"])
        total = local_count.double().clone()
        dist.all_reduce(total)
        (local_sum * (world / total).float()).backward()

        parts = [torch.empty_like(local_logits) for _ in range(cp)]
        dist.all_gather(parts, local_logits.detach().contiguous(), group=group)
        width = batch["input_ids"].shape[1]
        real = batch["attention_mask"][rows].bool()  # padding attends otherwise (no target sees it)
        torch.testing.assert_close(unshard(parts)[:, :width][real], logits[rows][real].detach(), rtol=1e-4, atol=1e-5)
        loss = local_sum.detach().clone()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss, summed.detach(), rtol=1e-5, atol=1e-5)
        assert int(total) == int(count)
        grads = dict(reference.named_parameters())
        for param_name, param in model.named_parameters():
            assert param.grad is not None
            grad = param.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / world, grads[param_name].grad, rtol=1e-4, atol=1e-6, msg=param_name)
        print(f"ok rank {rank} {name}: logits, loss and {len(grads)} gradients equal the whole model's", flush=True)
    dist.destroy_process_group()


def _rows(batch: dict, rows: slice) -> dict:
    """The group's rows of a collated batch; packed rows' lengths re-based to them (whole rows: a bound per row)."""
    out = {k: v[rows] for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}
    if "cu_seqlens" in batch:
        width = batch["input_ids"].shape[1]
        first, last = rows.start * width, rows.stop * width
        bounds = batch["cu_seqlens"]
        kept = bounds[(bounds >= first) & (bounds <= last)] - first
        out.update(cu_seqlens=kept, max_seqlen=batch["max_seqlen"])
    return out


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    os._exit(0)
