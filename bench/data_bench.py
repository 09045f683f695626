"""Tokenization throughput of cloudtrain's data processing on R8 train: a first run into an empty cache,
then the same call again, which reads the cached result back."""

import tempfile
import time

from common import Spec
from datasets import DatasetDict

from cloudtrain.data.processing import process_data
from cloudtrain.data.sources import connect_data
from cloudtrain.models.load import load_tokenizer
from cloudtrain.tasks import build_task


def run(spec: Spec) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        spec.cache_dir = cache
        cfg = spec.config()
        task = build_task(cfg)
        raw = DatasetDict(train=connect_data(cfg.data, task.columns(cfg.data))["train"])
        tokenizer = load_tokenizer(cfg.model)
        rows, result = len(raw["train"]), {}
        for name in ("first", "cached"):
            start = time.perf_counter()
            process_data(raw, tokenizer, cfg.data, cfg.training.seed)
            result[f"{name}_rows_per_s"] = rows / (time.perf_counter() - start)
        return {"rows": rows, **result}
