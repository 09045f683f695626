"""What every runner of bench/sft_bench.py starts from: one model+tokenizer folder, the pairs as JSON lines,
and each runner's spec (its rows per step: equal work)."""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from sft_data import R8, REPO, messages, read_r8, to_pair
from sft_heldout import heldout_loss
from sft_settings import PACKED, SFTSettings

TOKENIZER = REPO / "data" / "grimm" / "tokenizer"
PRESETS = REPO / "src" / "cloudtrain" / "model_presets"


def model_config(s: SFTSettings, tokenizer) -> dict:
    """The preset's config.json with the vocabulary (chat tokens included) rounded up to a multiple of 64."""
    config = json.loads((PRESETS / f"{s.preset}.json").read_text())
    config.update(s.model_overrides)
    config.update(
        vocab_size=math.ceil(len(tokenizer) / 64) * 64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        max_position_embeddings=max(config.get("max_position_embeddings", 0), s.max_length),
    )
    return config


@dataclass
class Prepared:
    model_dir: str
    train_file: str
    heldout_file: str
    data: dict  # statistics for the report
    unpacked_rows: int  # examples per step for the unpacked runners


def prepare(s: SFTSettings, folder: Path) -> Prepared:
    """One model+tokenizer folder (chatml set, tokens added, random weights from the seed), the pairs as
    JSON lines, and how many examples per step hold the real tokens of `batch_size` packed rows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cloudtrain.data.chat import ChatFormat
    from cloudtrain.data.packing import pack_examples

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    chat = ChatFormat.setup(tokenizer, "chatml")
    model_dir = folder / "model"
    tokenizer.save_pretrained(model_dir)
    config = model_config(s, tokenizer)
    torch.manual_seed(s.seed)
    kwargs = dict(config)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(kwargs.pop("model_type"), **kwargs), dtype=torch.float32
    )
    model.save_pretrained(model_dir)
    parameters = sum(p.numel() for p in model.parameters())

    files = {}
    encoded = {}
    for split, source, limit in (
        ("train", "reuters-r8-train.tab", s.train_examples),
        ("heldout", "reuters-r8-test.tab", s.heldout_examples),
    ):
        pairs = [to_pair(c, t, chat, s.max_length) for c, t in read_r8(R8 / source, limit)]
        files[split] = folder / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(p) + "\n" for p in pairs))
        encoded[split] = [chat.encode(messages(p)) for p in pairs]
    ids = [i for i, _ in encoded["train"]]
    rows = pack_examples(ids, [m for _, m in encoded["train"]], s.max_length, "bfd")
    per_row = len(ids) / len(rows)
    lengths = sorted(len(x) for x in ids)
    data = {
        "train_examples": len(ids),
        "heldout_examples": len(encoded["heldout"]),
        "train_tokens": sum(lengths),
        "min_tokens": lengths[0],
        "median_tokens": lengths[len(lengths) // 2],
        "max_tokens": lengths[-1],
        "answer_tokens_per_example": sum(sum(m[1:]) for _, m in encoded["train"]) / len(ids),
        "bfd_rows": len(rows),
        "examples_per_bfd_row": per_row,
        "bfd_fill": sum(lengths) / (len(rows) * s.max_length),
        "vocab_size": config["vocab_size"],
        "parameters": parameters,
        "chat_template": chat.source,
        "initial_heldout_loss": heldout_loss(str(model_dir), str(model_dir), str(files["heldout"]), s.eval_batch_size)[
            "heldout_loss"
        ],
    }
    return Prepared(
        str(model_dir), str(files["train"]), str(files["heldout"]), data, max(1, round(s.batch_size * per_row))
    )


def worker_spec(s: SFTSettings, p: Prepared, runner: str, cache_dir: str) -> dict:
    return {
        "settings": asdict(s),
        "runner": runner,
        "model_dir": p.model_dir,
        "train_file": p.train_file,
        "heldout_file": p.heldout_file,
        "rows_per_step": s.batch_size if PACKED[runner] else p.unpacked_rows,
        "cache_dir": cache_dir,
    }
