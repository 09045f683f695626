"""One benchmark run in a fresh interpreter, so peak memory is this run's alone.

Usage: python bench/worker.py '<Spec as JSON>' RESULT.json
"""

import json
import os
import sys
import time

START = time.perf_counter()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers fork after the tokenizer ran


def main(spec_json: str, result_path: str) -> None:
    import importlib

    from common import Spec, peak_rss_mb

    spec = Spec(**json.loads(spec_json))
    if spec.keep_freed_memory:  # the same allocator for every runner, so loops are compared, not allocators
        from cloudtrain.hardware import keep_freed_memory

        keep_freed_memory()
    module = {
        "basic": "cloudtrain_runner",
        "accelerated": "cloudtrain_runner",
        "reference": "reference_loop",
        "hf_trainer": "hf_trainer",
        "data": "data_bench",
    }[spec.runner]
    result = importlib.import_module(module).run(spec)
    result.update(peak_rss_mb=peak_rss_mb(), process_s=time.perf_counter() - START)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
