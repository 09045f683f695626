"""What model a checkpoint was trained on, recorded at each save and compared at a resume before anything loads:
its shape (a checkpoint of another shape cannot be resumed) and, for adapters, a digest of the base weights they
were trained over (a base of the same shape with other weights, a fine-tuned variant, takes them silently)."""

import hashlib
import json
from pathlib import Path

from cloudtrain.config import Config

# sizes, not model_type: a transformers upgrade may rename a composite model's text config type
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "d_model")
SAMPLE_BYTES = 64  # read from each tensor's start: fine-tuning changes every trained tensor's first values


def model_record(cfg: Config) -> dict:
    """The model a run trains, from its config and files (read before the model loads). No shape where there is
    no config on this machine to read (a diffusers pipeline, a Hub model not downloaded yet): loading then tells."""
    from cloudtrain.models.load import trained_config  # transformers' config reading; load imports our users

    source = cfg.model.model_config or cfg.model.model_name_or_path or "the default model"
    record: dict = {"source": source, "shape": {}}
    try:  # no network: loading has read it already
        config = trained_config(cfg.model, local_files_only=True).get_text_config(decoder=True)
        shape = {k: getattr(config, k) for k in SHAPE_FIELDS if hasattr(config, k)}
        record["shape"] = json.loads(json.dumps(shape))  # as a state file gives it back
    except Exception:  # noqa: BLE001 (no config, remote code, an odd one: nothing recorded, the load tells)
        pass
    if cfg.model.peft != "none" and (digest := base_weights_digest(cfg)):
        record["base_weights"] = digest
    return record


def base_weights_digest(cfg: Config) -> str | None:
    """A digest of the base model's safetensors files (every tensor's name, dtype, shape and first bytes), read
    from their headers and a few bytes each; None where they are not on this machine (a random-init model)."""
    files = _weight_files(cfg)
    if not files:
        return None
    samples = []  # (name, what it is): sorted over every shard, so another shard layout digests the same
    try:
        for file in files:
            if (found := safetensors_header(file)) is None:
                return None  # an odd file: nothing to compare, the load tells
            length, tensors = found
            with file.open("rb") as f:
                for name, entry in tensors.items():
                    start, end = entry["data_offsets"]
                    f.seek(8 + length + start)
                    head = f.read(min(SAMPLE_BYTES, end - start))
                    samples.append((name, f"{name}:{entry['dtype']}:{entry['shape']}".encode() + head))
    except (OSError, KeyError, TypeError, ValueError):
        return None
    digest = hashlib.sha256()
    for _, sample in sorted(samples):
        digest.update(sample)
    return digest.hexdigest()[:16]


def safetensors_header(path: Path) -> tuple[int, dict] | None:
    """(the header's length in bytes, {tensor name: its dtype, shape and data_offsets}) of a safetensors file, read
    without its data; None where it has no readable header (not one after all, cut short, unreadable)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(f.read(length)) if 0 <= length <= size - 8 else None
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    return length, {name: entry for name, entry in header.items() if name != "__metadata__"}


def _weight_files(cfg: Config) -> list[Path]:
    from cloudtrain.paths import resolve_model_path

    if cfg.model.model_config:
        return []
    name = resolve_model_path(cfg.model)
    folder = Path(name)
    if not folder.is_dir():  # a Hub id: its downloaded snapshot, if any
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(name, local_files_only=True, allow_patterns=["*.safetensors"]))
        except Exception:  # noqa: BLE001 (not downloaded, offline, not a repo id: nothing to compare)
            return []
    return sorted(folder.glob("*.safetensors"))
