"""Preference pairs: TRL's data formats -> (prompt, chosen answer, rejected answer) as messages -> token rows.

Formats (as TRL defines them), told apart per row by the values' types:
- explicit prompt: `prompt`, `chosen`, `rejected` as strings (the prompt becomes a user message, each answer
  an assistant message, so the chat template applies as in `--task sft`);
- conversational: `prompt` as messages, `chosen`/`rejected` as lists of assistant messages;
- implicit prompt (no prompt column): `chosen`/`rejected` as whole conversations (or strings) sharing their
  prefix; the prompt is their longest common prefix of messages (of characters, for strings: cut before a
  space as TRL's `extract_prompt` does).
A pair is encoded as two rows, prompt + chosen and prompt + rejected, each with a loss mask on its answer's
tokens only (end-of-turn token included: the chat template's, as `ChatFormat` finds it). Implicit-prompt pairs
given as strings are plain text (HH-RLHF's "\n\nHuman: ... \n\nAssistant: ..." transcripts, completions):
they are encoded as that text, tokenized as the tokenizer tokenizes a text, with EOS after the answer and no chat
template (`plain_pair`, `plain_text`), as TRL trains them; a template would move shared answer words into a user
turn and wrap the transcript in headers the data never had.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from cloudtrain.config import DataConfig
from cloudtrain.data.chat import ChatFormat, conversation
from cloudtrain.data.files import FILE_FORMATS, data_files, split_files
from cloudtrain.data.packing import IGNORE_INDEX
from cloudtrain.data.sources import load_files
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
        prompt = [{"role": "user", "content": value}] if isinstance(value, str) else conversation(value, columns.prompt)
    answers = [_answer(value, column) for value, column in ((chosen, columns.chosen), (rejected, columns.rejected))]
    if not any(str(m.get("content") or "").strip() for m in answers[0]):  # it would teach stopping at once
        raise ValueError(f"its {columns.chosen!r} answer is empty; remove the pair or give its chosen answer")
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
        if k == min(len(chosen), len(rejected)) and chosen != rejected:
            # the shorter answer would become part of the prompt, its side left empty
            raise ValueError(
                "one of its chosen and rejected texts begins the other, so the prompt cannot be told from the "
                "answers (no prompt column); add a prompt column or pass --prompt_column"
            )
        return [{"role": "user", "content": chosen[:k]}], chosen[k:], rejected[k:]
    chosen, rejected = conversation(chosen, columns.chosen), conversation(rejected, columns.rejected)
    k = common_prefix(chosen, rejected)
    if k == 0:
        raise ValueError(
            "its chosen and rejected conversations share no first message, so no prompt can be found (no prompt "
            "column); give conversations that share their prompt, or a prompt column"
        )
    return chosen[:k], chosen[k:], rejected[k:]


def pair_place(cfg: DataConfig, split: str, index: int) -> str:
    """Where pair `index` (0-based, in its split as loaded) is, in words that find it: "train pair 7 (the 7th record
    of b.jsonl)". A folder's files are read in name order, one after another, so the index is mapped to its file
    by their record counts (read again only here, once a pair is refused)."""
    place, number = f"{split} pair {index + 1}", index + 1
    path = split_files(cfg).get(split)
    files = [] if path is None else data_files(Path(path)) if Path(path).is_dir() else [Path(path)]
    for file in files:
        count = _records(file) if len(files) > 1 else number
        if count is None:
            break
        if index < count:
            return f"{place} (the {ordinal(index + 1)} record of {file})"
        index -= count
    return f"{place} (its {ordinal(number)} record)"


def _records(file: Path) -> int | None:
    """How many records the reader the split was loaded with finds in `file` (None if it cannot read it alone)."""
    builder, options = FILE_FORMATS[file.suffix.lower()]
    try:
        return len(load_files(builder, [file], options=options))
    except UserError:
        return None


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


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
        messages = conversation(value, column) if value else []
    if not messages or any(m["role"] != "assistant" for m in messages):
        raise ValueError(f"its {column!r} answer is not one or more assistant messages (after the prompt)")
    return messages


def plain_pair(row: dict, columns: PairColumns) -> tuple[str, str, str] | None:
    """(prompt, chosen answer, rejected answer) as texts of an implicit-prompt pair given as strings (plain text,
    encoded without a chat template); None for any other pair. ValueError as `to_pair`."""
    if not is_plain(row, columns):
        return None
    prompt, chosen, rejected = to_pair(row, columns)  # its checks, and the split at the common prefix
    return prompt[0]["content"], chosen[0]["content"], rejected[0]["content"]


def is_plain(row: dict, columns: PairColumns) -> bool:
    """Whether a pair is plain text: no prompt column, its chosen and rejected values strings."""
    return columns.prompt is None and all(isinstance(row[c], str) for c in (columns.chosen, columns.rejected))


def plain_text(
    tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str, eos: bool = True
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of `prompt + answer` as plain text: tokenized whole with the tokenizer's own special
    tokens (its BOS, as inference on the prompt gets it), then (`eos`) the EOS token; the mask 1 on the tokens that
    overlap the answer and on that EOS, so the row decodes to the data's text exactly."""
    text = prompt + answer
    encoded = tokenizer(text, return_offsets_mapping=True)
    ids, spans = list(encoded["input_ids"]), encoded["offset_mapping"]
    # special tokens have empty spans at 0, so they stay 0 (the prompt is never empty)
    mask = [int(begin < len(text) and end > len(prompt)) for begin, end in spans]
    if not eos:
        return ids, mask
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "its texts are plain (no prompt column), which end with the tokenizer's EOS token so the model learns "
            "to stop, but the tokenizer has none; set eos_token in its tokenizer_config.json"
        )
    if ids and ids[-1] == tokenizer.eos_token_id:  # a tokenizer that appends EOS itself
        ids, mask = ids[:-1], mask[:-1]
    return [*ids, tokenizer.eos_token_id], [*mask, 1]


def encode_pair(chat: ChatFormat, row: dict, columns: PairColumns) -> dict[str, list[int]]:
    """The two rows of a pair: {chosen_ids, chosen_mask, rejected_ids, rejected_mask}; plain text for an
    implicit-prompt pair of strings, else through the chat template."""
    plain = plain_pair(row, columns)
    encoded: dict[str, list[int]] = {}
    if plain is not None:
        for side, text in zip(SIDES, plain[1:], strict=True):
            encoded[f"{side}_ids"], encoded[f"{side}_mask"] = plain_text(chat.tokenizer, plain[0], text)
        return encoded
    prompt, *answers = to_pair(row, columns)
    for side, answer in zip(SIDES, answers, strict=True):
        encoded[f"{side}_ids"], encoded[f"{side}_mask"] = chat.answer(prompt, answer)
    return encoded


def truncate_pairs(rows: dict[str, list], limit: int, distinct: bool = True) -> tuple[list[int], int]:
    """Cut both rows of every pair to `limit` tokens in place; (indices of pairs that keep an answer token on
    both sides and, where `distinct`, still differ; how many were cut). A row's first token is never a target;
    equal sides give a preference loss no gradient (ORPO's SFT term still has one: not `distinct`)."""
    keep, cut = [], 0
    for i in range(len(rows["chosen_ids"])):
        cut += any(len(rows[f"{side}_ids"][i]) > limit for side in SIDES)
        for side in SIDES:
            for name in ("ids", "mask"):
                rows[f"{side}_{name}"][i] = rows[f"{side}_{name}"][i][:limit]
        differ = not distinct or rows["chosen_ids"][i] != rows["rejected_ids"][i]
        if all(any(rows[f"{side}_mask"][i][1:]) for side in SIDES) and differ:
            keep.append(i)
    return keep, cut


class PairCollator:
    """Pairs -> one batch for one forward over both answers. Two layouts:

    - shared prompt (`shared`, the default): one row per pair, the tokens chosen and rejected share (the prompt,
      the assistant header) once, then the chosen answer, then the rejected one, right-padded. `position_ids` start
      the rejected answer where the chosen one starts, and `segments` (0 shared, 1 chosen, 2 rejected, 3 padding)
      give the attention mask `segment_mask` builds: the rejected answer never sees the chosen one. Prompts are
      mostly longer than answers, so this nearly halves the tokens of a pair (the prompt is computed once);
    - separate rows: 2B rows, the B chosen then the B rejected, right-padded, no attention mask (padding sits after
      every real token, and attention is causal), for attention kernels that take no custom mask.

    Either way the answers' tokens are gathered by (row, position): `rows` [2B] (chosen then rejected) names each
    answer's row; `sources` [2B, T] the positions (in the answers' window) whose logits predict its `targets`
    [2B, T] (IGNORE_INDEX past its last target). `answer_window`'s length is how many last positions hold every
    source, the only logits the loss needs (a tensor's length, so the forward reads it without waiting on the
    device). `attention_mask` [rows, width] marks real tokens, for counting. Precomputed reference log-probabilities
    come as `ref_logps` [2B]."""

    def __init__(self, pad_token_id: int, shared: bool = True):
        self.pad_token_id = pad_token_id
        self.shared = shared  # the task turns it off for a model whose attention takes no custom mask

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        layout = [self._shared(row) for row in rows] if self.shared else self._separate(rows)
        # (row, sources, targets) of every answer: the B chosen, then the B rejected
        answers = [(r, *side) for r, (_, _, _, sides) in enumerate(layout) for side in sides]
        answers = answers[0::2] + answers[1::2] if self.shared else answers
        width = max(len(ids) for ids, _, _, _ in layout)
        longest = max(len(targets) for _, _, targets in answers)
        first = min(min(sources) for _, sources, _ in answers)  # the window starts at the first source
        shape = (len(layout), width)
        batch = {
            "input_ids": torch.full(shape, self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros(shape, dtype=torch.long),
            "rows": torch.tensor([row for row, _, _ in answers], dtype=torch.long),
            "sources": torch.zeros(len(answers), longest, dtype=torch.long),
            "targets": torch.full((len(answers), longest), IGNORE_INDEX, dtype=torch.long),
            "answer_window": torch.zeros(width - first, dtype=torch.int8),
        }
        if self.shared:
            batch["position_ids"] = torch.arange(width).repeat(len(layout), 1)
            batch["segments"] = torch.full(shape, PADDING, dtype=torch.int8)
        for r, (ids, positions, segments, _) in enumerate(layout):
            batch["input_ids"][r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            batch["attention_mask"][r, : len(ids)] = 1
            if self.shared:
                batch["position_ids"][r, : len(ids)] = torch.tensor(positions, dtype=torch.long)
                batch["segments"][r, : len(ids)] = torch.tensor(segments, dtype=torch.int8)
        for a, (_, sources, targets) in enumerate(answers):
            batch["sources"][a, : len(sources)] = torch.tensor(sources, dtype=torch.long) - first
            batch["targets"][a, : len(targets)] = torch.tensor(targets, dtype=torch.long)
        if REFERENCE_COLUMNS[0] in rows[0]:
            batch["ref_logps"] = torch.tensor([row[c] for c in REFERENCE_COLUMNS for row in rows], dtype=torch.float32)
        return batch

    @staticmethod
    def _shared(row: dict) -> tuple[list[int], list[int], list[int], list[tuple[list[int], list[int]]]]:
        """(ids, position ids, segments, [(sources, targets) of the chosen answer, of the rejected]) of one pair's
        row."""
        chosen, rejected = row["chosen_ids"], row["rejected_ids"]
        k = common_prefix(chosen, rejected)  # the prompt, the assistant header, and any shared answer tokens
        ids = chosen + rejected[k:]
        positions = list(range(len(chosen))) + list(range(k, len(rejected)))
        segments = [SHARED] * k + [CHOSEN] * (len(chosen) - k) + [REJECTED] * (len(rejected) - k)
        # a target at index t is predicted by index t - 1 of its own sequence: in the shared part, or (rejected)
        # shifted past the chosen answer's own tokens
        shift = len(chosen) - k
        sides = [
            _targets(chosen, row["chosen_mask"], lambda t: t - 1),
            _targets(rejected, row["rejected_mask"], lambda t: t - 1 if t - 1 < k else t - 1 + shift),
        ]
        return ids, positions, segments, sides

    @staticmethod
    def _separate(rows: list[dict]) -> list[tuple[list[int], list[int], list[int], list]]:
        """Each side its own row: the B chosen, then the B rejected."""
        return [
            (row[f"{side}_ids"], [], [], [_targets(row[f"{side}_ids"], row[f"{side}_mask"], lambda t: t - 1)])
            for side in SIDES
            for row in rows
        ]


SHARED, CHOSEN, REJECTED, PADDING = 0, 1, 2, 3  # PairCollator's segments


def _targets(ids: list[int], mask: list[int], source: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """(the positions predicting each target token, the target tokens); a row's first token is never a target
    (nothing predicts it)."""
    targets = [t for t in range(1, len(ids)) if mask[t]]
    return [source(t) for t in targets], [ids[t] for t in targets]


def segment_mask(segments: torch.Tensor, additive: bool) -> torch.Tensor:
    """The attention mask [R, 1, W, W] of the shared-prompt layout: causal, and a query sees a key in the shared
    part or in its own segment (padding sees everything before it, so no row is empty). Boolean (True: attend) for
    SDPA; additive (0, or the float minimum) for eager attention."""
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    query, key = segments[:, :, None], segments[:, None, :]
    allowed = causal & ((key == SHARED) | (key == query) | (query == PADDING))
    allowed = allowed[:, None]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape, device=segments.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def answer_logps(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each answer's target tokens, their count), [2B] each, from the logits of the
    answers' window [R, window, V]. Only the gathered positions enter the loss, so every other position (the
    prompt's) gets exactly zero gradient."""
    targets = batch["targets"].to(logits.device)
    valid = targets != IGNORE_INDEX
    offset = logits.shape[1] - len(batch["answer_window"])  # a full forward's logits start before the window
    picked = logits[batch["rows"][:, None], batch["sources"] + offset].float()  # [2B, T, V]
    chosen = picked.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logps = torch.where(valid, chosen - picked.logsumexp(dim=-1), 0.0)
    return token_logps.sum(dim=-1), valid.sum(dim=-1)
