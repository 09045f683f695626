"""The collator that streamed and stored batches share builds each field as one tensor (the input path's
per-batch cost); its batches must equal those of the straightforward per-row, per-document version kept here."""

import random

import pytest
import torch

from cloudtrain.data.packing import IGNORE_INDEX, CausalLMCollator, pack_buffer


def reference(rows: list[dict], pad_token_id: int, cu_seqlens: bool, pad_to: int | None) -> dict:
    """The collator before it built whole fields at once (tensor writes per row and per document)."""
    width = max(pad_to or 0, *(len(row["input_ids"]) for row in rows))
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    sequences: list[int] = []
    for b, row in enumerate(rows):
        ids, lengths = row["input_ids"], row["seq_lengths"]
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids, dtype=torch.long)
        labels[b, :n] = input_ids[b, :n]
        if "loss_mask" in row:
            labels[b, :n][torch.tensor(row["loss_mask"], dtype=torch.bool).logical_not()] = IGNORE_INDEX
        attention_mask[b, :n] = 1
        start = 0
        for length in [*lengths, width - n]:
            position_ids[b, start : start + length] = torch.arange(length)
            if length and start < n:
                labels[b, start] = IGNORE_INDEX
            if length:
                sequences.append(length)
            start += length
    batch = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels, "attention_mask": attention_mask}
    if cu_seqlens:
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(sequences).cumsum(0).tolist()], dtype=torch.int32)
        batch["max_seqlen"] = torch.empty((0, max(sequences)), dtype=torch.int32)
    return batch


def random_rows(rng: random.Random, packing: str, masks: bool) -> list[dict]:
    """A micro-batch of rows as a stream packs them (documents of 1-90 tokens into blocks of 64)."""
    items = []
    for k in range(rng.randint(1, 12)):
        ids = [rng.randrange(1000) for _ in range(rng.randint(1, 90))]
        mask = [rng.randint(0, 1) for _ in ids] if masks else None
        items.append((0, (0, k), ids, mask))
    rows = pack_buffer(items, 64, packing)
    return [{k: v for k, v in row.items() if k not in ("starts", "tokens")} for row in rows[: rng.randint(1, 8)]]


@pytest.mark.parametrize("packing", ["bfd", "wrapped", "none"])
def test_collated_batches_equal_the_per_row_version(packing: str) -> None:
    rng = random.Random(packing)
    for case in range(60):
        masks = packing != "wrapped" and case % 2 == 1
        rows = random_rows(rng, packing, masks)
        pad_to = 96 if case % 3 == 0 else None
        cu = case % 4 != 1
        got = CausalLMCollator(pad_token_id=7, cu_seqlens=cu, pad_to=pad_to)(rows)
        want = reference(rows, 7, cu, pad_to)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            assert torch.equal(got[key], want[key]), (key, case)


def test_rows_as_tensors_and_bad_lengths() -> None:
    rows = [{"input_ids": [5, 6, 7, 8], "seq_lengths": [1, 3]}, {"input_ids": [9, 9], "seq_lengths": [2]}]
    as_tensors = [{k: torch.tensor(v) for k, v in row.items()} for row in rows]
    collate = CausalLMCollator(pad_token_id=0, cu_seqlens=True)
    for key, value in collate(rows).items():
        assert torch.equal(collate(as_tensors)[key], value)
    ignore = IGNORE_INDEX
    assert collate(rows)["labels"].tolist() == [[ignore, ignore, 7, 8], [ignore, 9, ignore, ignore]]
    assert collate(rows)["position_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 0, 1]]
    with pytest.raises(ValueError, match="do not split"):
        collate([{"input_ids": [1, 2, 3], "seq_lengths": [2]}])
    with pytest.raises(ValueError, match="do not split"):
        collate([{"input_ids": [1, 2], "seq_lengths": [2, 0]}])


def test_rows_with_and_without_answer_masks_in_one_batch() -> None:
    rng = random.Random(1)
    plain = random_rows(rng, "bfd", masks=False)
    masked = random_rows(rng, "bfd", masks=True)
    for rows in (plain[:2] + masked[:2], masked[:1] + plain[:3], plain[:1] + masked[:1] + plain[1:2]):
        got, want = CausalLMCollator(pad_token_id=3, cu_seqlens=True)(rows), reference(rows, 3, True, None)
        for key in want:
            assert torch.equal(got[key], want[key]), key
