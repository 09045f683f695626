"""Preference pairs: TRL's data formats -> (prompt, chosen answer, rejected answer) as messages -> token rows.

Formats (as TRL defines them), told apart per row by the values' types:
- explicit prompt: `prompt`, `chosen`, `rejected` as strings (the prompt becomes a user message, each answer
  an assistant message, so the chat template applies as in `--task sft`);
- conversational: `prompt` as messages, `chosen`/`rejected` as lists of assistant messages;
- implicit prompt (no prompt column): `chosen`/`rejected` as whole conversations (or strings) sharing their
  prefix; the prompt is their longest common prefix of messages (of characters, for strings: cut before a
  space as TRL's `extract_prompt` does).
A pair is encoded as two rows, prompt + chosen and prompt + rejected, each with a loss mask on its answer's
tokens only (end-of-turn token included: the chat template's, as `ChatFormat` finds it).
"""

from dataclasses import dataclass

import datasets
import torch

from cloudtrain.data.chat import ChatFormat, _conversation
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.errors import UserError

SIDES = ("chosen", "rejected")
PAIR_FEATURES = datasets.Features(
    {
        f"{side}_{name}": datasets.List(datasets.Value(kind))
        for side in SIDES
        for name, kind in (("ids", "int32"), ("mask", "int8"))
    }
)
REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


@dataclass
class PairColumns:
    """The columns of a pair; `prompt` None: an implicit prompt."""

    prompt: str | None
    chosen: str
    rejected: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c for c in (self.prompt, self.chosen, self.rejected) if c)


def pair_columns(available: list[str], prompt: str | None, chosen: str, rejected: str) -> PairColumns:
    """The named columns, checked; the prompt is `prompt` when named, else `prompt` when present, else implicit."""
    for flag, column in (("--chosen_column", chosen), ("--rejected_column", rejected), ("--prompt_column", prompt)):
        if column and column not in available:
            raise UserError(
                f"the preference data has no {flag.removeprefix('--').removesuffix('_column')} column "
                f"{column!r} (its columns: {', '.join(available)}); name it with {flag}"
            )
    return PairColumns(prompt or ("prompt" if "prompt" in available else None), chosen, rejected)


def to_pair(row: dict, columns: PairColumns) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen answer, rejected answer) as messages; ValueError says what is wrong with the row."""
    chosen, rejected = row[columns.chosen], row[columns.rejected]
    if columns.prompt is None:
        prompt, chosen, rejected = _implicit(chosen, rejected, columns)
    else:
        value = row[columns.prompt]
        prompt = (
            [{"role": "user", "content": value}] if isinstance(value, str) else _conversation(value, columns.prompt)
        )
    answers = [_answer(value, column) for value, column in ((chosen, columns.chosen), (rejected, columns.rejected))]
    if answers[0] == answers[1]:
        raise ValueError("its chosen and rejected answers are equal, so there is no preference to learn")
    return prompt, answers[0], answers[1]


def _implicit(chosen, rejected, columns: PairColumns) -> tuple[list[dict], list | str, list | str]:
    """The prompt as the longest common prefix of two conversations (or strings), and what follows it."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        k = common_prefix(chosen, rejected)
        if k and k < min(len(chosen), len(rejected)) and chosen[k - 1] == " ":  # TRL: the space starts the answer
            k -= 1
        if k == 0:
            raise ValueError(
                "its chosen and rejected texts share no prefix, so no prompt can be found (no prompt column); "
                "add a prompt column or pass --prompt_column"
            )
        return [{"role": "user", "content": chosen[:k]}], chosen[k:], rejected[k:]
    chosen, rejected = _conversation(chosen, columns.chosen), _conversation(rejected, columns.rejected)
    k = common_prefix(chosen, rejected)
    if k == 0:
        raise ValueError(
            "its chosen and rejected conversations share no first message, so no prompt can be found (no prompt "
            "column); give conversations that share their prompt, or a prompt column"
        )
    return chosen[:k], chosen[k:], rejected[k:]


def common_prefix(a, b) -> int:
    """The length of the longest common prefix of two sequences (messages or characters)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _answer(value, column: str) -> list[dict]:
    if isinstance(value, str):
        messages = [{"role": "assistant", "content": value}]
    else:
        messages = _conversation(value, column) if value else []
    if not messages or any(m["role"] != "assistant" for m in messages):
        raise ValueError(f"its {column!r} answer is not one or more assistant messages (after the prompt)")
    return messages


def encode_pair(chat: ChatFormat, row: dict, columns: PairColumns) -> dict[str, list[int]]:
    """The two rows of a pair: {chosen_ids, chosen_mask, rejected_ids, rejected_mask}."""
    prompt, *answers = to_pair(row, columns)
    encoded: dict[str, list[int]] = {}
    for side, answer in zip(SIDES, answers, strict=True):
        encoded[f"{side}_ids"], encoded[f"{side}_mask"] = chat.answer(prompt, answer)
    return encoded


def truncate_pairs(rows: dict[str, list], limit: int) -> tuple[list[int], int]:
    """Cut both rows of every pair to `limit` tokens in place; (indices of pairs that keep an answer token on
    both sides, how many were cut). A row's first token is never a target."""
    keep, cut = [], 0
    for i in range(len(rows["chosen_ids"])):
        cut += any(len(rows[f"{side}_ids"][i]) > limit for side in SIDES)
        for side in SIDES:
            for name in ("ids", "mask"):
                rows[f"{side}_{name}"][i] = rows[f"{side}_{name}"][i][:limit]
        if all(any(rows[f"{side}_mask"][i][1:]) for side in SIDES):
            keep.append(i)
    return keep, cut


class PairCollator:
    """Pairs -> one batch of 2B rows, the B chosen then the B rejected, right-padded: input_ids, labels (the answer
    tokens; -100 elsewhere), attention_mask (real tokens, for counting: the causal model never needs it, as
    padding sits after every real token) and answer_window (its length: how many last positions hold every
    answer, the only logits the loss needs). Precomputed reference log-probabilities come as `ref_logps` [2B]."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [(row[f"{side}_ids"], row[f"{side}_mask"]) for side in SIDES for row in rows]
        width = max(len(ids) for ids, _ in sequences)
        shape = (len(sequences), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        for b, (ids, mask) in enumerate(sequences):
            n = len(ids)
            input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
            labels[b, :n] = torch.where(torch.tensor(mask, dtype=torch.bool), input_ids[b, :n], IGNORE_INDEX)
            attention_mask[b, :n] = 1
        labels[:, 0] = IGNORE_INDEX  # nothing predicts a row's first token
        # The positions whose logits the loss needs: from the one before the first answer token of any row to the
        # end. Carried as a tensor's length, so the forward reads it without waiting on the device.
        first = int((labels != IGNORE_INDEX).any(dim=0).int().argmax())
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "answer_window": torch.zeros(width - max(first - 1, 0), dtype=torch.int8),
        }
        if REFERENCE_COLUMNS[0] in rows[0]:
            batch["ref_logps"] = torch.tensor([row[c] for c in REFERENCE_COLUMNS for row in rows], dtype=torch.float32)
        return batch


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's target tokens, their count), [N] each. Positions that are not
    targets enter through `torch.where`, so they get exactly zero gradient."""
    targets = labels[:, 1:].to(logits.device)
    mask = targets != IGNORE_INDEX
    logits = logits[:, :-1].float()
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = torch.where(mask, picked - logits.logsumexp(dim=-1), 0.0)
    return token_logps.sum(dim=-1), mask.sum(dim=-1)
