"""Packing for the causal LM task: rows, the collator, and that packed documents stay apart in the model."""

import random
from collections import Counter

import pytest
import torch
from conftest import lm_documents
from transformers import AutoModelForCausalLM, AutoTokenizer

from cloudtrain.data.packing import (
    PACKING,
    CausalLMCollator,
    causal_lm_forward,
    chunk,
    isolation_error,
    pack,
    shifted_loss,
)

MODELS = ("tiny_llama_dir", "tiny_gpt2_dir")
BACKENDS = ("sdpa", "eager")


def random_docs(n: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def segments(row: dict) -> list[list[int]]:
    out, start = [], 0
    for length in row["seq_lengths"]:
        out.append(row["input_ids"][start : start + length])
        start += length
    return out


# ---------------------------------------------------------------- rows
def test_chunk_splits_a_long_document_without_losing_tokens():
    doc = list(range(23))
    assert chunk(doc, 10) == [list(range(10)), list(range(10, 20)), [20, 21, 22]]
    assert chunk(doc, 23) == [doc]
    assert chunk([], 4) == []
    with pytest.raises(ValueError):
        chunk(doc, 0)


def test_none_rows_are_the_documents_chunked():
    docs = [[1, 2, 3], [4] * 12, [5]]
    rows = pack(docs, 8, "none")
    assert [r["input_ids"] for r in rows] == [[1, 2, 3], [4] * 8, [4] * 4, [5]]
    assert [r["seq_lengths"] for r in rows] == [[3], [8], [4], [1]]
    assert pack([[], [7]], 8, "none") == pack([[], [7]], 8, "bfd") == [{"input_ids": [7], "seq_lengths": [1]}]


def test_wrapped_rows_are_the_stream_cut_into_blocks():
    docs = random_docs(50, seed=1)
    rows = pack(docs, 32, "wrapped")
    assert [t for r in rows for t in r["input_ids"]] == [t for d in docs for t in d]
    assert all(len(r["input_ids"]) == 32 for r in rows[:-1])
    assert 0 < len(rows[-1]["input_ids"]) <= 32
    assert all(r["seq_lengths"] == [len(r["input_ids"])] for r in rows)


def test_bfd_keeps_documents_whole_in_fewer_rows():
    docs = random_docs(200, seed=2, longest=90)  # some longer than the block: chunked first
    block = 64
    rows = pack(docs, block, "bfd")
    pieces = [p for d in docs for p in chunk(d, block)]
    assert Counter(tuple(s) for r in rows for s in segments(r)) == Counter(tuple(p) for p in pieces)
    assert all(sum(r["seq_lengths"]) == len(r["input_ids"]) <= block for r in rows)
    assert len(rows) < len(pack(docs, block, "none")) == len(pieces)
    # near the lower bound: best fit wastes little room on these lengths
    assert len(rows) <= sum(map(len, pieces)) / block * 1.1 + 1
    assert pack(docs, block, "bfd") == rows  # deterministic


def naive_best_fit_decreasing(pieces: list[list[int]], block: int) -> list[list[list[int]]]:
    """The textbook O(n^2) version: scan every bin for the least room that still fits, oldest first."""
    bins: list[list[list[int]]] = []
    for piece in sorted(pieces, key=len, reverse=True):
        fits = [i for i, b in enumerate(bins) if block - sum(map(len, b)) >= len(piece)]
        if fits:
            bins[min(fits, key=lambda i: block - sum(map(len, bins[i])))].append(piece)
        else:
            bins.append([piece])
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_bfd_equals_the_textbook_best_fit(seed):
    docs = random_docs(150, seed=seed, longest=50)
    rows = pack(docs, 64, "bfd")
    assert [segments(r) for r in rows] == naive_best_fit_decreasing(docs, 64)


def test_pack_rejects_unknown_modes():
    assert PACKING == ("none", "wrapped", "bfd")
    with pytest.raises(ValueError):
        pack([[1]], 8, "greedy")


# ---------------------------------------------------------------- the collator
def test_collator_restarts_positions_and_masks_segment_starts():
    rows = [{"input_ids": [11, 12, 13, 21, 22], "seq_lengths": [3, 2]}, {"input_ids": [31, 32, 33], "seq_lengths": [3]}]
    batch = CausalLMCollator(pad_token_id=0)(rows)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        k: (2, 5) for k in ("input_ids", "position_ids", "labels", "attention_mask")
    }
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22], [31, 32, 33, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 12, 13, -100, 22], [-100, 32, 33, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert all(v.dtype == torch.long for v in batch.values())


def test_collator_rejects_lengths_that_do_not_split_the_row():
    with pytest.raises(ValueError):
        CausalLMCollator(0)([{"input_ids": [1, 2, 3], "seq_lengths": [2]}])


def test_shifted_loss_sums_over_predicted_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7, dtype=torch.bfloat16)
    labels = torch.tensor([[-100, 1, 2, -100], [-100, 3, -100, -100]])
    total, count = shifted_loss(logits, labels)
    expected = sum(
        torch.nn.functional.cross_entropy(logits[b, t - 1].float(), labels[b, t], reduction="sum")
        for b, t in ((0, 1), (0, 2), (1, 1))
    )
    assert count.item() == 3 and total.dtype == torch.float32
    assert torch.allclose(total, expected)


# ---------------------------------------------------------------- packed documents stay apart in the model
def load(directory: str, attn_implementation: str):
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    for dropout in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop"):
        assert getattr(model.config, dropout, 0.0) == 0.0  # so train mode is deterministic
    assert model.config.use_cache  # the default that leaks, so use_cache=False is what keeps documents apart
    model.train()  # the mode training runs in, where a cache is still built unless use_cache=False
    return model


@pytest.fixture(scope="module")
def token_docs(lm_tokenizer_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(lm_documents(16, seed=2))["input_ids"]]


def packed_batch(token_docs: list[list[int]]) -> tuple[dict, list[dict]]:
    assert max(map(len, token_docs)) <= 128  # whole documents, so each compares with itself alone
    rows = pack(token_docs, 128, "bfd")
    assert any(len(r["seq_lengths"]) > 2 for r in rows) and len({len(r["input_ids"]) for r in rows}) > 1
    return CausalLMCollator(pad_token_id=0)(rows), rows


def alone(model, doc: list[int]) -> dict[str, torch.Tensor]:
    """The document as the only row of its batch: no padding, no packing, plain causal attention."""
    batch = CausalLMCollator(pad_token_id=0)([{"input_ids": doc, "seq_lengths": [len(doc)]}])
    return {"logits": causal_lm_forward(model, batch)[0], "labels": batch["labels"]}


def max_difference(references: dict[tuple, torch.Tensor], logits: torch.Tensor, rows: list[dict]) -> float:
    """The largest gap between a packed document's logits and its logits alone, over all documents."""
    worst = 0.0
    for b, row in enumerate(rows):
        start = 0
        for doc, length in zip(segments(row), row["seq_lengths"], strict=True):
            worst = max(worst, (logits[b, start : start + length] - references[tuple(doc)]).abs().max().item())
            start += length
    return worst


@pytest.fixture(
    scope="module", params=[(m, b) for m in MODELS for b in BACKENDS], ids=lambda p: f"{p[0].split('_')[1]}-{p[1]}"
)
def decoder(request, token_docs):
    """A tiny decoder in train mode, and each test document's logits and labels when it is alone."""
    model_dir, backend = request.param
    model = load(request.getfixturevalue(model_dir), backend)
    with torch.no_grad():
        return model, {tuple(doc): alone(model, doc) for doc in token_docs}


def test_packed_documents_match_documents_alone(decoder, token_docs):
    model, references = decoder
    batch, rows = packed_batch(token_docs)
    with torch.no_grad():
        logits = causal_lm_forward(model, batch)
    assert max_difference({k: v["logits"] for k, v in references.items()}, logits, rows) < 1e-5
    total, count = shifted_loss(logits, batch["labels"])
    alone_losses = [
        shifted_loss(references[tuple(d)]["logits"][None], references[tuple(d)]["labels"]) for d in token_docs
    ]  # some documents repeat: each counts once per occurrence
    assert count.item() == sum(c.item() for _, c in alone_losses) == sum(len(d) - 1 for d in token_docs)
    assert total.item() == pytest.approx(sum(t.item() for t, _ in alone_losses), rel=1e-5)
    assert batch["attention_mask"].sum().item() == sum(map(len, token_docs))
    assert model.training


def test_negative_controls_leak(decoder, token_docs):
    """The comparison above can fail: each of these calls lets packed documents attend to each other."""
    model, references = decoder
    batch, rows = packed_batch(token_docs)
    ids, positions = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        leaks = {
            "attention_mask": model(
                input_ids=ids, position_ids=positions, use_cache=False, attention_mask=torch.ones_like(ids)
            ).logits,
            "default use_cache (train mode)": model(input_ids=ids, position_ids=positions).logits,
            "positions not restarting": model(
                input_ids=ids, use_cache=False, position_ids=torch.arange(ids.shape[1]).expand_as(ids)
            ).logits,
        }
    logits = {k: v["logits"] for k, v in references.items()}
    differences = {name: max_difference(logits, leaked, rows) for name, leaked in leaks.items()}
    assert all(d > 1e-2 for d in differences.values()), differences


# ---------------------------------------------------------------- isolation_error
def test_isolation_error_passes_the_real_forward(decoder):
    model, _ = decoder
    assert isolation_error(model) is None
    assert model.training  # restored


def with_mask(model, batch):
    return model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        use_cache=False,
        attention_mask=batch["attention_mask"],
    ).logits


def without_positions(model, batch):
    return model(input_ids=batch["input_ids"], use_cache=False).logits


def with_default_cache(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits


@pytest.mark.parametrize("forward", (with_mask, without_positions, with_default_cache))
def test_isolation_error_names_a_leaking_forward(tiny_llama_dir, forward):
    model = load(tiny_llama_dir, "sdpa")
    message = isolation_error(model, forward)
    assert message.startswith("LlamaForCausalLM with attn_implementation 'sdpa' lets packed documents attend")
    assert "\n" not in message and model.training


def test_isolation_error_refuses_a_model_without_position_ids():
    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

        def forward(self, input_ids):
            return self.embed(input_ids)

    assert "takes no position_ids" in isolation_error(Bag())
