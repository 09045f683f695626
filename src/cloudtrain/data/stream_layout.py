"""What a stream's cursor means, and whether a resumed run can use it.

A cursor counts rows of a buffer from a mixture state (cloudtrain.data.streaming): its numbers point into the
same documents only where the resumed run reads the same files and cuts and packs them the same way. The layout
is recorded beside the cursor in each checkpoint and compared at a resume; a difference is one line naming it.
"""

from __future__ import annotations

from typing import Any

from cloudtrain.data.mixture import SourceSpec, relative_names
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
