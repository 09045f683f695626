"""--context_parallel_size: what runs on CPU (the sequence cut into load-balanced shards and put back together, the
loss over split rows equal to the unsplit loss, the refusal), the reason of the refusal on CPU checked against
the installed torch, and ring attention itself on 2 GPUs (`gpu`: CP=2 equals one process)."""

import pytest
import torch
from conftest import REPO, assert_each_refused
from test_distributed import launch, torchrun
from test_tensor_parallel import corpus, options  # noqa: F401  (corpus: the fixture, taken by name)

CPU_ERROR = (
    "cannot run on cpu: NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
    "does not have a sharding strategy registered."
)


def test_context_parallel_is_refused_in_one_line_naming_why(tmp_path, corpus, tiny_llama_dir, capsys):  # noqa: F811
    opts = {**options(tiny_llama_dir, corpus, tmp_path / "out"), "context_parallel_size": "2"}
    why = "needs CUDA GPUs" if not torch.cuda.is_available() else "is not wired into a trainer yet"
    assert_each_refused({"context parallel": (opts, why)}, capsys, tmp_path / "out")


@pytest.mark.slow
def test_ring_attention_cannot_run_on_cpu_with_this_torch():
    """The refusal's reason, as the installed torch gives it: its context_parallel hands SDPA DTensors, and CPU's
    SDPA kernel has no sharding rule (the math kernel fails too: its causal mask is a plain tensor). If this
    fails because it ran, torch runs ring attention on CPU now: wire --context_parallel_size for CPU."""
    result = launch(torchrun(2), str(REPO / "tests" / "dist_cp.py"))
    assert result.stdout.count(CPU_ERROR) == 2, result.stdout[-2000:]
    assert "ok rank" not in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs: context parallelism runs one process per GPU (NCCL refuses two on one GPU)",
)
def test_cp2_equals_one_process_on_two_gpus():
    """Ring attention over CUDA's SDPA (fp32: the memory-efficient kernel), 2 processes each holding chunks r and
    3-r of every row: the summed losses and every gradient summed over the processes equal the unsplit model's,
    and torch's cut of the rows is cloudtrain.parallel.context's (dist_cp.py)."""
    result = launch(torchrun(2), str(REPO / "tests" / "dist_cp.py"))
    assert result.stdout.count("gradients equal the unsplit model's") == 2, result.stdout[-2000:]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_sequences_split_balanced_and_reassemble(cp):
    from cloudtrain.parallel import context

    sequence = torch.arange(3 * 48).reshape(3, 48)
    shards = [context.shard(sequence, cp, rank) for rank in range(cp)]
    assert all(part.shape == (3, 48 // cp) for part in shards)
    assert torch.equal(context.unshard(shards, cp), sequence)
    work = [context.attention_work(part[0]) for part in shards]  # causal attention: later positions cost more
    assert len(set(work)) == 1, work  # every process the same (a plain cut in cp pieces would not be)
    plain = [context.attention_work(part[0]) for part in sequence.chunk(cp, dim=1)]
    assert cp == 1 or len(set(plain)) == cp


def test_the_loss_over_split_sequences_equals_the_unsplit_loss(tiny_llama_dir):
    """Packed rows (two documents each, position ids restarting): the shards' summed losses, each shard's logits
    computed by the model on the whole row and cut as the shards are, add up to the unsplit shifted loss."""
    from transformers import AutoModelForCausalLM

    from cloudtrain.data.packing import IGNORE_INDEX, causal_lm_forward, shifted_loss
    from cloudtrain.parallel import context

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (2, 32))
    positions = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, 32)
    labels = ids.clone()
    labels[:, 20] = IGNORE_INDEX  # the second document's first token is no target of the first one's last
    labels[1, 28:] = IGNORE_INDEX
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels}
    with torch.no_grad():
        logits = causal_lm_forward(model, batch)
    whole, count = shifted_loss(logits, labels)
    for cp in (2, 4):
        parts = [context.split_batch(batch, cp, rank) for rank in range(cp)]
        assert torch.equal(context.unshard([p["position_ids"] for p in parts], cp), positions)
        losses = [context.shard_loss(context.shard(logits, cp, rank), p["targets"]) for rank, p in enumerate(parts)]
        assert sum(n for _, n in losses) == count
        torch.testing.assert_close(sum(s for s, _ in losses), whole, rtol=1e-6, atol=1e-5)
