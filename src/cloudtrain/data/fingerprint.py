"""What a run trains on, as its checkpoints record it, and the note a resume on other data prints.

A resume keeps its place in the data by step: the batches before it are skipped by index. On other rows (a file
edited or replaced, another image folder, another --max_length or --resolution) that place means other batches,
and the run is no longer the one that stopped. A changed dataset can be meant (a curriculum, a higher resolution
for the last steps), so it is a note, not a refusal. A stream's cursor records and checks its own layout
(cloudtrain.data.stream_layout.check_layout).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SAMPLED_ROWS = 256  # rows read for a processed dataset's fingerprint: evenly spaced, so any edit that moves rows shows


def data_record(train: Any) -> dict:
    """{"rows", "fingerprint"} of the training rows: an image set's own fingerprint (its files, captions and image
    options), a processed dataset's from its row count and sampled rows; {} for data with neither (a stream)."""
    from datasets import Dataset

    own = getattr(train, "fingerprint", None)
    if callable(own):
        return {"rows": len(train), "fingerprint": own()}
    if not isinstance(train, Dataset):
        return {}
    # not Dataset._fingerprint: a map whose function does not hash the same twice gets a random one
    n = len(train)
    picked = sorted({i * n // SAMPLED_ROWS for i in range(SAMPLED_ROWS)}) if n else []
    rows = train.select(picked).to_list()
    return {"rows": n, "fingerprint": digest(rows)}


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, default=str, sort_keys=True).encode()).hexdigest()[:16]


def other_data_note(state: dict, now: dict, checkpoint: Path) -> str | None:
    """The note for a resume on training rows other than the checkpoint's (`state`: its trainer state), or by a run
    of another task (records hold the task, beside the rows); None where they match, or where either has no
    record (checkpoints before the record, a stream)."""
    saved = state.get("data")
    if saved and now and saved.get("task", now.get("task")) != now.get("task"):  # (older records hold no task)
        return (
            f"note: {checkpoint.name} was trained by a --task {saved['task']} run and this one is --task "
            f"{now['task']}: its weights and its place in the data are another task's; resume it with --task "
            f"{saved['task']}, or start from a model, not a checkpoint"
        )
    saved, now = ({k: v for k, v in record.items() if k != "task"} for record in (saved or {}, now or {}))
    if not saved or not now or saved == now:
        return None
    how = (
        f"{saved['rows']} rows there, {now['rows']} here"
        if saved["rows"] != now["rows"]
        else f"the same {now['rows']} rows in number, other in content"
    )
    return (
        f"note: {checkpoint.name} was trained on other training data ({how}): the resume keeps its place by step, "
        "so it goes on over other batches than the run that stopped would have; resume with the data and data "
        "options it was trained on to continue that run"
    )
