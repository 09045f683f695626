"""How many tokens a model's position table holds, from its config: a transformers config object, or the plain
config.json of a saved model (light: `predict` checks --max_length with it before it imports torch)."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# encoders whose position ids start after the padding index: their table holds pad_token_id + 1 fewer tokens
PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod")


def positions(text_config: Any) -> int | None:
    """The most tokens a row may hold (a config's text part); None where positions are relative or unknown."""
    context = getattr(text_config, "max_position_embeddings", None)
    if not context or getattr(text_config, "position_biased_input", True) is False:  # DeBERTa's relative positions
        return None
    if getattr(text_config, "model_type", "") in PADDING_OFFSET_POSITIONS:
        pad = getattr(text_config, "pad_token_id", None)
        context -= (1 if pad is None else pad) + 1
    return context


def saved_positions(model_dir: Path | str) -> int | None:
    """`positions` of the model saved in `model_dir` (its config.json, or its text_config); None when it has none."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text: dict = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    return positions(SimpleNamespace(**text))
