"""Well-known model shapes, shipped: `plan --model_name_or_path llama-2-13b` works offline, with no Hub config.

Each entry is the architecture fields of the model's published config.json (the fields the memory model reads:
sizes, heads, vocabulary, activation, dropout); the rest take transformers' defaults, which do not change the
parameter count. A short name and the Hub id both find an entry; a local folder of that name wins over it.
"""

import os
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from cloudtrain.errors import UserError

_LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)
_LLAMA_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40)


def _t5(d_model: int, d_ff: int, heads: int, layers: int, gated: bool = True) -> dict:
    return dict(
        d_model=d_model,
        d_ff=d_ff,
        d_kv=64,
        num_heads=heads,
        num_layers=layers,
        num_decoder_layers=layers,
        vocab_size=32128,
        feed_forward_proj="gated-gelu" if gated else "relu",
        tie_word_embeddings=not gated,
        dropout_rate=0.1,
    )


def _bart(d_model: int, ffn: int, heads: int, layers: int, vocab: int, dropouts: float) -> dict:
    return dict(
        d_model=d_model,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_layers=layers,
        decoder_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=1024,
        dropout=0.1,
        attention_dropout=dropouts,
        activation_dropout=dropouts,
    )


# short name -> (Hub id, model_type, the config's architecture fields)
KNOWN_MODELS: dict[str, tuple[str, str, dict]] = {
    "llama-7b": ("huggyllama/llama-7b", "llama", {**_LLAMA_7B, "vocab_size": 32000, "max_position_embeddings": 2048}),
    "llama-13b": (
        "huggyllama/llama-13b",
        "llama",
        {**_LLAMA_13B, "vocab_size": 32000, "max_position_embeddings": 2048},
    ),
    "llama-2-7b": (
        "meta-llama/Llama-2-7b-hf",
        "llama",
        {**_LLAMA_7B, "vocab_size": 32000, "max_position_embeddings": 4096},
    ),
    "llama-2-13b": (
        "meta-llama/Llama-2-13b-hf",
        "llama",
        {**_LLAMA_13B, "vocab_size": 32000, "max_position_embeddings": 4096},
    ),
    "llama-2-70b": (
        "meta-llama/Llama-2-70b-hf",
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
    ),
    "llama-3-8b": (
        "meta-llama/Meta-Llama-3-8B",
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        ),
    ),
    "mistral-7b": (
        "mistralai/Mistral-7B-v0.1",
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            sliding_window=4096,
        ),
    ),
    "opt-1.3b": (
        "facebook/opt-1.3b",
        "opt",
        dict(
            hidden_size=2048,
            ffn_dim=8192,
            num_hidden_layers=24,
            num_attention_heads=32,
            vocab_size=50272,
            max_position_embeddings=2048,
            word_embed_proj_dim=2048,
            activation_function="relu",
            dropout=0.1,
            attention_dropout=0.0,
        ),
    ),
    "gpt2": ("openai-community/gpt2", "gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257)),
    # encoder-decoders (--task seq2seq): FLAN-T5 is T5 1.1 (gated GELU; small's 6 heads of 64 are narrower than
    # its d_model, and its LM head its own), the original T5 a ReLU MLP with a tied head
    "flan-t5-small": ("google/flan-t5-small", "t5", _t5(512, 1024, 6, 8)),
    "flan-t5-base": ("google/flan-t5-base", "t5", _t5(768, 2048, 12, 12)),
    "flan-t5-large": ("google/flan-t5-large", "t5", _t5(1024, 2816, 16, 24)),
    "t5-base": ("google-t5/t5-base", "t5", _t5(768, 3072, 12, 12, gated=False)),
    "bart-base": ("facebook/bart-base", "bart", _bart(768, 3072, 12, 6, 50265, dropouts=0.1)),
    "bart-large-cnn": ("facebook/bart-large-cnn", "bart", _bart(1024, 4096, 16, 12, 50264, dropouts=0.0)),
    "bert-base-uncased": (
        "google-bert/bert-base-uncased",
        "bert",
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522),
    ),
}
_BY_HUB_ID = {hub.lower(): short for short, (hub, _, _) in KNOWN_MODELS.items()}


def known_name(name: str) -> str | None:
    """The table's short name for `name` (a short name or a Hub id, any case), unless a local folder has that
    name (its own config wins); None: not in the table."""
    if Path(name).expanduser().exists():
        return None
    key = name.lower()
    return key if key in KNOWN_MODELS else _BY_HUB_ID.get(key)


def known_config(name: str, num_labels: int) -> PretrainedConfig | None:
    """The shipped config of a well-known model (`known_name`), with `num_labels` for a classification head."""
    short = known_name(name)
    if short is None:
        return None
    _, model_type, fields = KNOWN_MODELS[short]
    return AutoConfig.for_model(model_type, num_labels=num_labels, **fields)


def hub_id(name: str) -> str:
    """The Hub id training loads for `name`: a well-known model's, else `name` itself."""
    short = known_name(name)
    return KNOWN_MODELS[short][0] if short else name


def config_folder(name: str) -> str | None:
    """A folder holding the shipped config.json of a well-known model, for what reads a model from a folder;
    None when `name` is not in the table. Written once, atomically, under the cache (CLOUDTRAIN_CACHE)."""
    short = known_name(name)
    if short is None:
        return None
    cache = Path(os.environ.get("CLOUDTRAIN_CACHE", Path.home() / ".cache" / "cloudtrain"))
    folder = cache / "known-models" / short
    if not (folder / "config.json").is_file():
        config = known_config(short, num_labels=2)  # a reader passes its own num_labels
        assert config is not None  # short is in the table
        try:
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f"config.json.{os.getpid()}"
            partial.write_text(config.to_json_string())
            partial.replace(folder / "config.json")  # a concurrent plan reads a whole file or none
        except OSError as err:
            raise UserError(
                f"cannot write the model's config under {cache} ({err.strerror}); set CLOUDTRAIN_CACHE to a folder "
                "you can write"
            ) from None
    return str(folder)
