"""What `cloudtrain preprocess` shards were made with, and the check a streaming run makes before its first step.

A manifest records the task, the options its encoder read and the tokenizer (a digest of its vocabulary, special
tokens and chat template): `made_with`. A run computes the same for itself and compares each source's manifest
with it, so tokens made by another tokenizer, for another task or with other options never train unseen. Shards
without a manifest (copied without it) are checked by the range of their first record's token ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from typing import TYPE_CHECKING, Any

from cloudtrain.errors import UserError

if TYPE_CHECKING:
    from cloudtrain.config.data import DataConfig
    from cloudtrain.data.mixture import SourceSpec

MANIFEST = "manifest.json"
TOKENS = "input_ids"  # a shard row's stored tokens


def tokenizer_digest(tokenizer: Any) -> str:
    """The tokenizer as its ids mean: vocabulary (added tokens included), special tokens and chat template."""
    vocabulary, specials = sorted(tokenizer.get_vocab().items()), sorted(tokenizer.all_special_ids)
    return _digest([vocabulary, specials, getattr(tokenizer, "chat_template", None)])


# A text whose ids show how a tokenizer encodes: case, accents, spacing, digits, punctuation, special tokens added
PROBE = "Once upon a TIME, in Ünïcödé:  two  spaces\ttab\n42 + 3.14 = 'x' (naïve) café."


def encoding_digest(tokenizer: Any) -> str | None:
    """How the tokenizer encodes a probe text: the same vocabulary can give other ids (lowercased, a BOS added).
    Its behaviour, not its serialized form, which another `tokenizers` version may write otherwise."""
    try:
        ids = list(tokenizer(PROBE)["input_ids"])
    except Exception:  # noqa: BLE001 (a tokenizer that cannot encode text: nothing to compare)
        return None
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def columns_made_with(manifest: dict) -> str:
    """The column options a manifest's shards were made with, as options (for a run that names others)."""
    named = [f"--{name} {value}" for name, value in manifest.items() if name.endswith("_column") and value]
    return " ".join(named) or "no column option"


def made_with(task: Any, tokenizer: Any, data: DataConfig) -> dict:
    """The task, the options its stream encoder reads, and the tokenizer's digest and size."""
    made = {
        "task": task.name,
        **{name: getattr(data, name) for name in task.stream_options},
        "tokenizer_digest": tokenizer_digest(tokenizer),
        "tokenizer_encoding": encoding_digest(tokenizer),
        "vocabulary": len(tokenizer),
    }
    if "chat_template" in task.stream_options:  # the template's text as set up (a file's, a name's, the tokenizer's)
        made["template_digest"] = _digest(getattr(tokenizer, "chat_template", None))
    return made


def _digest(value: Any) -> str:
    """16 hex digits of the SHA-256 of `value` as JSON: what a manifest records of a tokenizer or a template."""
    return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:16]


def check_shards(specs: list[SourceSpec], run: dict, max_length: int) -> None:
    """Every source's shards made as this run (`made_with` of it) would make them; one line naming the first
    difference otherwise."""
    for spec in specs:
        folders = list(dict.fromkeys(folder_of(path) for path in spec.files))
        checked = False
        for folder in folders:
            manifest = read_manifest(folder)
            if manifest is not None:
                _compare(folder, manifest, run, max_length)
                _check_complete(folder, manifest)
                checked = checked or "tokenizer_digest" in manifest
            else:
                _note_unfinished(folder, [path for path in spec.files if folder_of(path) == folder])
        if not checked and spec.format == "parquet":  # preprocess writes parquet: nothing else holds tokens
            _check_ids(spec, run["vocabulary"])


def is_shard_name(name: str) -> bool:
    """A shard's name as preprocess writes them: `shard-00000.parquet`."""
    return name.startswith("shard-") and name.endswith(".parquet") and name[6:-8].isdigit()


def _note_unfinished(folder: str, files: list[str]) -> None:
    """Shards named as preprocess names them, without the manifest it writes last: maybe a killed preprocess's
    part of a set (an object store cannot stage a set), maybe a copy. Said, not refused."""
    if files and all(is_shard_name(os.path.basename(path)) for path in files) and os.environ.get("RANK", "0") == "0":
        print(
            f"note: {folder} holds {len(files)} preprocess shard(s) but no {MANIFEST}, which preprocess writes last: "
            "if its preprocess did not finish, these are part of the corpus only; run it again into a new folder",
            flush=True,
        )


def folder_of(path: str) -> str:
    """The folder of a data file named locally (relative too: `shard-00000.parquet` is in `.`) or by URL."""
    return os.path.dirname(path) or "."


def read_manifest(folder: str) -> dict | None:
    """The preprocess manifest in `folder` (local or a URL), or None where there is none of ours."""
    from cloudtrain.data.readers import open_raw

    try:
        with open_raw(f"{folder}/{MANIFEST}") as handle:
            manifest = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("shards"), list) else None


def _compare(folder: str, manifest: dict, run: dict, max_length: int) -> None:
    again = "run cloudtrain preprocess again with this run's options"
    if manifest.get("task", run["task"]) != run["task"]:
        raise UserError(
            f"{folder} holds shards made for --task {manifest['task']} and this run is --task {run['task']}: "
            f"{again} (--task {run['task']}), or train them with --task {manifest['task']}"
        )
    by_text = "template_digest" in manifest and "template_digest" in run  # (older manifests: by --chat_template)
    if by_text and manifest["template_digest"] != run["template_digest"]:  # before the tokenizer's, which holds it
        raise UserError(
            f"{folder} holds shards made with another chat template than this run's (the templates' texts differ): "
            f"{again} (--chat_template naming this run's template)"
        )
    if manifest.get("tokenizer_digest", run["tokenizer_digest"]) != run["tokenizer_digest"]:
        raise UserError(
            f"{folder} holds shards tokenized by {manifest.get('tokenizer')} ({manifest.get('vocabulary')} tokens), "
            f"not by this run's tokenizer ({run['vocabulary']} tokens; the ids would mean other tokens): {again} "
            "(--tokenizer_name_or_path naming this run's tokenizer)"
        )
    if manifest.get("tokenizer_encoding", run["tokenizer_encoding"]) != run["tokenizer_encoding"]:  # (older: none)
        raise UserError(
            f"{folder} holds shards tokenized by {manifest.get('tokenizer')}, whose vocabulary is this run's but "
            "whose encoding is not (its normalizer, pre-tokenizer or post-processor differ: lowercasing, a BOS "
            f"added), so the shards hold other ids than this run would read: {again} (--tokenizer_name_or_path "
            "naming this run's tokenizer)"
        )
    for name, value in run.items():  # a column option names where text was read, not what the tokens mean
        if name in ("task", "tokenizer_digest", "tokenizer_encoding", "vocabulary", "template_digest"):
            continue
        if name.endswith("_column") or (name == "chat_template" and by_text):  # a template's path: its text counts
            continue
        if manifest.get(name, value) != value:
            theirs = _shown(manifest[name])
            raise UserError(
                f"{folder} holds shards made with --{name} {theirs} and this run has --{name} {_shown(value)}: "
                f"give --{name} {theirs}, or {again}"
            )
    made = manifest.get("max_length")
    if manifest.get("packing", "none") != "none" and made and made > max_length:
        raise UserError(
            f"{folder} holds rows packed to {made} tokens and --max_length {max_length} would cut them: give "
            f"--max_length {made}, or {again}"
        )


def _check_complete(folder: str, manifest: dict) -> None:
    """Every shard the manifest lists is in its folder: a copy that did not finish trained on part of the corpus."""
    listed = [str(shard.get("file")) for shard in manifest["shards"] if isinstance(shard, dict)]
    try:
        if "://" in folder:
            import fsspec

            from cloudtrain.data.readers import storage_options

            fs, root = fsspec.core.url_to_fs(folder, **storage_options(folder))
            present = {path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)}
        else:
            present = set(os.listdir(folder))
    except Exception:  # noqa: BLE001 (a folder that cannot be listed: reading its files says why)
        return
    missing = [name for name in listed if name not in present]
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise UserError(
            f"{folder}/{MANIFEST} lists {len(listed)} shards and {len(missing)} of them are not there ({shown}): a "
            "copy that did not finish, or shards deleted since; copy them again, or run cloudtrain preprocess again"
        )


def _shown(value: Any) -> str:
    """A value as the option takes it: `none` unsets one (`unset` would be read as the text "unset")."""
    return "none" if value is None else shlex.quote(str(value))


def _check_ids(spec: SourceSpec, vocabulary: int) -> None:
    """Shards with no manifest to vouch for them: their first record's token ids within this tokenizer's range."""
    from cloudtrain.data.mixture import first_record

    path, record = first_record(spec) or ("", {})
    ids = record.get(TOKENS)
    if not isinstance(ids, list):
        return
    flat = [i for example in ids for i in example] if ids and isinstance(ids[0], list) else ids
    if flat and max(flat) >= vocabulary:
        raise UserError(
            f"{path} holds token id {max(flat)}, beyond this run's tokenizer ({vocabulary} tokens): the shards "
            "were made by another tokenizer; run cloudtrain preprocess again with --tokenizer_name_or_path "
            "naming this run's"
        )
