"""What a stream's cursor means, and whether a resumed run can use it.

A cursor counts rows of a buffer from a mixture state (cloudtrain.data.streaming): its numbers point into the
same documents only where the resumed run reads the same files and cuts and packs them the same way. The layout
is recorded beside the cursor in each checkpoint and compared at a resume; a difference is one line naming it.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from cloudtrain.data.mixture import SourceSpec, relative_names
from cloudtrain.data.readers import is_remote
from cloudtrain.errors import UserError, first_difference


def layout_of(plan: Any) -> dict:
    """A StreamPlan's layout: each source's files (by path under the source, in order; the cursor names a file by
    its place) and how documents are cut and packed into rows (the cursor counts rows of a buffer)."""
    cut = {} if plan.buffer_mb is None else {"buffer_mb": plan.buffer_mb}  # None: a lineage from before the cap
    return {
        **cut,
        "files": [relative_names(spec) for spec in plan.sources],
        "file_names": "relative",  # paths under each source's root; checkpoints before this held base names
        "buffer_docs": plan.buffer_docs,
        "block_size": plan.block_size,
        "packing": plan.packing,
        "seed": plan.seed,
        "held_out": [source.get("held_out", 0) for source in plan.start["sources"]],  # validation's, per source
        "weights": [spec.weight for spec in plan.sources],
        "shares": [round(spec.weight / sum(s.weight for s in plan.sources), 9) for spec in plan.sources],  # 1,1 = 2,2
    }


LAYOUT_OPTIONS = {
    "buffer_docs": "--stream_buffer",
    "buffer_mb": "--stream_buffer_mb",
    "block_size": "--max_length",
    "packing": "--packing",
    "seed": "--seed",
}


def check_layout(saved: dict, now: dict, sources: list[SourceSpec]) -> None:
    """A resumed stream reads the same files and cuts the same rows as the run that saved its cursor; else one
    line naming the first difference (the cursor would point into other documents, without a word)."""
    for key, option in LAYOUT_OPTIONS.items():
        if saved.get(key) != now.get(key):  # (a lineage from before the byte cap records none: the resume neither)
            raise UserError(
                f"the checkpoint's data stream was cut with {option} {saved.get(key)}, this run's with {option} "
                f"{now.get(key)}: its cursor counts rows of that cut; resume with {option} {saved.get(key)}"
            )
    if "shares" in saved and saved["shares"] != now["shares"]:  # (checkpoints before the record hold none)
        was = ",".join(f"{w:g}" for w in saved["weights"])
        raise UserError(
            f"the checkpoint's data stream mixed its sources with weights {was}, this run's with "
            f"{','.join(f'{w:g}' for w in now['weights'])}: its cursor counts rows of buffers drawn with those weights "
            f"(other weights draw other documents); resume with --train_weights {was}, or start a fresh run from its "
            "model to change the mixture"
        )
    # recorded since the hold-out is skipped; the cursor keeps skipping what it held out, so fewer (or a
    # --validation_file instead) validate on none of its training documents, and only more would
    if any(n > was for n, was in zip(now["held_out"], saved.get("held_out", now["held_out"]), strict=True)):
        was, held = sum(saved["held_out"]), sum(now["held_out"])
        give = f"--stream_validation_docs {was}" if was else "--validation_file, as the run that saved it did"
        raise UserError(
            f"the checkpoint's data stream held out {was} documents for validation and this run's {held}: it would "
            f"validate on documents the run trained on; resume with {give}"
        )
    for spec, was, is_now in zip(sources, saved["files"], now["files"], strict=True):
        if saved.get("file_names") != now.get("file_names"):  # an older checkpoint's base names: compare those
            is_now = [f.rsplit("/", 1)[-1] for f in is_now]
        if was != is_now:
            i, then, here = first_difference(was, is_now)
            raise UserError(
                f"training source {spec.name} lists {here} as file {i + 1} where the checkpoint read {then}: its "
                "cursor names a file by its place; resume with the files it was trained on, or start a fresh run"
            )


SAMPLE_BYTES = 1 << 16  # a local file's digest reads this much of its start and of its end


def stamps_of(sources: list[SourceSpec], stream: dict, cache: dict) -> list[list[dict | None]]:
    """Per source, a stamp of each file read up to the cursor `stream` (a mixture state): every file once a pass
    is done, else those before the cursor's file and that file. A cursor is a byte offset (a row group) into its
    file, the rows of its buffer already trained on are skipped by count, and held-out documents are counted from
    the first: a file changed before a resume would have the run read text cut mid-record, skip other rows, or
    train on what it validates on."""
    stamps = []
    for spec, position in zip(sources, stream.get("sources", []), strict=False):
        read = len(spec.files) if position.get("pass", 0) else position["file"] + 1
        stamps.append([file_stamp(path, cache) for path in spec.files[: min(read, len(spec.files))]])
    return stamps


def file_stamp(path: str, cache: dict) -> dict | None:
    """A local file's size, modification time and a digest of its first and last bytes (a copy of it, say a SageMaker
    channel downloaded again, has another mtime and the same digest); an object's size and etag, as its filesystem
    gives them. None when neither can be had (a resume then compares nothing for it)."""
    if is_remote(path):
        if path not in cache:
            cache[path] = _remote_stamp(path)
        return cache[path]
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in cache:
        cache[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": _digest(path, st.st_size)}
    return cache[key]


def _digest(path: str, size: int) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(min(SAMPLE_BYTES, size))  # of the first `size` bytes: a file grown since reads the same
            f.seek(max(size - SAMPLE_BYTES, 0))
            return hashlib.sha1(head + f.read(min(SAMPLE_BYTES, size)), usedforsecurity=False).hexdigest()
    except OSError:
        return None


def _remote_stamp(path: str) -> dict | None:
    from cloudtrain.data.remote import _filesystem

    try:
        info = _filesystem(path).info(path)
    except Exception:  # noqa: BLE001 (any failure: a stamp is a check, never a reason to stop a run)
        return None
    tag = next((info[k] for k in ("ETag", "etag", "blob_id", "md5Hash") if info.get(k)), None)
    stamp = {"size": info.get("size"), "etag": str(tag).strip('"') if tag is not None else None}
    return {k: v for k, v in stamp.items() if v is not None} or None


def _change(was: dict, now: dict, path: str) -> str | None:
    """How a file differs from the stamp a checkpoint recorded of it; None when it reads the same. A local file
    that grew and whose first `size` bytes read as they did (a corpus appended to) reads the same: the cursor's
    offset points at the same text, and the stream reads the new text later."""
    grown = "digest" in was and now.get("size", 0) > was.get("size", 0)
    if grown and _digest(path, was["size"]) == was["digest"]:
        return None
    if was.get("size") is not None and now.get("size") is not None and was["size"] != now["size"]:
        return f"{now['size']} bytes where it had {was['size']}"
    if was.get("etag") and now.get("etag") and was["etag"] != now["etag"]:
        return f"etag {now['etag']} where it had {was['etag']}"
    if "mtime_ns" in was and was["mtime_ns"] != now.get("mtime_ns") and was.get("digest") != now.get("digest"):
        return "modified, its content not what it was"
    return None


def check_stamps(saved: list | None, sources: list[SourceSpec], cache: dict) -> None:
    """Each file the checkpoint's cursor read before it reads as it did; else one line naming it (a checkpoint from
    before the record holds none and resumes as before)."""
    for spec, stamps in zip(sources, saved or [], strict=False):
        names = relative_names(spec)
        for path, name, was in zip(spec.files, names, stamps, strict=False):
            now = file_stamp(path, cache) if was else None
            if now and (why := _change(was, now, path)):
                raise UserError(
                    f"training source {spec.name}: {name} changed since the checkpoint read it ({why}), so its "
                    "cursor would point into other text; restore the file as it was, or start a fresh run without "
                    "--resume_from_checkpoint"
                )
