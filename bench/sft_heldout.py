"""bench/sft_bench.py's held-out loss: one function, the same for the starting weights and every runner's."""

import json
from pathlib import Path

from sft_data import messages
from sft_settings import IGNORE_INDEX


def heldout_loss(model_dir: str, tokenizer_dir: str, heldout_file: str, batch_size: int) -> dict:
    """Mean cross-entropy over the answer tokens of the held-out pairs, one example per row, on the weights saved
    in `model_dir`; the same function for every runner."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.data.chat import ChatFormat

    chat = ChatFormat.setup(AutoTokenizer.from_pretrained(tokenizer_dir), None)
    encoded = [chat.encode(messages(json.loads(line))) for line in Path(heldout_file).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    total, count = 0.0, 0
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i : i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), chat.tokenizer.eos_token_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, (ids, mask) in enumerate(chunk):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            labels[b, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), IGNORE_INDEX)
            attention[b, : len(ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        targets = labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ).item()
        count += int((targets != IGNORE_INDEX).sum())
    return {"heldout_loss": total / max(count, 1), "heldout_answer_tokens": count}
