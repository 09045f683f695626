"""What the run's kernel options change in the estimate, chosen as the run chooses them on the GPU planned for:
the loss (`--fused_cross_entropy`: the full logits, Liger's fused linear cross-entropy or the chunked one) and
Liger's fused decoder modules (`--liger_kernels`). The formulas and their measurements: docs/planner-formulas.md."""

import math
from typing import TYPE_CHECKING

from cloudtrain.models.kernels import CHUNK_ROWS, liger_installed, liger_knows
from cloudtrain.planning.facts import ModelFacts
from cloudtrain.planning.strategies import Candidate

if TYPE_CHECKING:
    from cloudtrain.tasks.base import Task

FUSED_CHUNK_TOKENS = CHUNK_ROWS  # tokens whose logits the chunked linear cross-entropy holds at once


def fuses_loss(task: "Task") -> bool:
    """Whether the task's training loss can be a fused one (`use_loss_kernel`: causal LM and SFT; DPO keeps its
    own loss, sequence-to-sequence and classification have no such loss)."""
    return task.use_loss_kernel(None)


def loss_kernel(choice: str, liger: bool, fuses: bool = True) -> str | None:
    """The loss --fused_cross_entropy `choice` runs: "liger", "chunked", or None (the full logits). auto fuses it
    where Liger Kernel runs (`liger`), as the run does; true takes the chunked one elsewhere; none where the task's
    loss is not one that fuses (`fuses`)."""
    if not fuses or choice == "false" or (choice == "auto" and not liger):
        return None
    return "liger" if liger else "chunked"


def planned_kernels(
    fused_choice: str,
    liger_choice: bool | str,
    model_type: str | None,
    task: "Task",
    liger: bool | None = None,
    auto_off: str | None = None,
) -> tuple[str | None, bool]:
    """(the loss kernel, whether Liger's fused modules run), chosen as the run chooses them where Liger Kernel runs
    (`liger`; None: the GPU planned for runs it if it is installed here). `auto_off`: why the run's auto would leave
    the modules off (cloudtrain.models.kernels.liger_auto_off), where its options are known. The estimate counts
    the modules on the rows auto takes them on (full fine-tuning without tensor or context parallelism)."""
    liger = liger_installed() if liger is None else liger
    wanted = liger_choice is True or (liger_choice == "auto" and not auto_off)
    return loss_kernel(fused_choice, liger, fuses_loss(task)), liger and wanted and liger_knows(model_type)


def shards_head(cand: Candidate) -> bool:
    """Whether the row shards or splits the LM head's weight where a fused loss would read it whole (ZeRO-3, FSDP,
    tensor parallelism; the plan's context-parallel rows use FSDP): the run refuses --fused_cross_entropy true
    there and auto leaves it off (cloudtrain.models.prepare._fused_misfit)."""
    return cand.strategy.zero_stage == 3 or cand.strategy.fsdp or cand.model_parallel > 1


def logits_bytes(
    m: ModelFacts, micro_batch: int, seq: int, half: bool, fused: str | bool | None = None, hidden_bytes: int = 4
) -> int:
    """The logits and the loss's buffers per GPU (0 without an LM head): per logit, the forward holds the logits
    (c bytes), their fp32 copy and the log-softmax (4 + 4); the cross-entropy's backward holds the log-softmax, its
    gradient and the copy's gradient (3 x 4). Checkpointing does not shrink them. A fused loss (`fused`: its
    kernel, True: the chunked one) never holds them whole: `_liger_loss_bytes`, `_chunked_loss_bytes`."""
    c, tokens, V = (2 if half else 4), micro_batch * seq, m.vocab_size
    if not V:
        return 0
    if fused == "liger":
        return _liger_loss_bytes(m, tokens, half)
    if fused:
        return _chunked_loss_bytes(m, tokens, half, hidden_bytes)
    return tokens * V * max(c + 4 + 4, 3 * 4)


def _chunked_loss_bytes(m: ModelFacts, tokens: int, half: bool, hidden_bytes: int) -> int:
    """The chunked loss's forward keeps the hidden states' gradient (hidden_bytes each: their dtype), the head's
    fp32 weight gradient and its 16-bit copy, and one chunk of logits at a time (FUSED_CHUNK_TOKENS rows: the
    logits in 16 bits and fp32, the log-softmax, the softmax, its 16-bit copy: 2 + 4 + 4 + 4 + 2 bytes)."""
    V, h = m.vocab_size, m.hidden_size
    head = 4 * V * h + (2 * V * h if half else 0)
    return tokens * h * hidden_bytes + head + min(tokens, FUSED_CHUNK_TOKENS) * V * (16 if half else 12)


def _liger_loss_bytes(m: ModelFacts, tokens: int, half: bool) -> int:
    """Liger's fused linear cross-entropy, in the compute dtype (c bytes): the hidden states and the head cast to it
    (16-bit autocast), the input's and the head's gradients it computes in the forward, and one chunk of logits
    (its chunks hold about as many logits as there are hidden values: ceil(V / h) chunks, rounded to a power of 2
    rows)."""
    c, V, h = (2 if half else 4), m.vocab_size, m.hidden_size
    chunk = min(tokens, 2 ** math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(V / h))))))
    copies = c * (tokens + V) * h if half else 0
    return copies + c * (tokens * h + V * h + chunk * V)
