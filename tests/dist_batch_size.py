"""Run under torchrun by test_batch_size.py: the batch-size search on every rank, with out-of-memory injected.

python -m torch.distributed.run --nproc_per_node 2 tests/dist_batch_size.py OPTIONS_JSON SCENARIOS_JSON RESULT_DIR

For each scenario in turn (one launch: the process group and the model are built once), each rank probes
the real model (forward and backward of its longest row, repeated) and raises torch.OutOfMemoryError
above its own limit ({rank: largest size that fits}, or {rank: "error"} for an error other than
out-of-memory at the second probe). RESULT_DIR/rank<R>.json gets, per scenario, what the rank chose (or
the error it stopped with) and the sizes it probed.
"""

import json
import sys
from pathlib import Path

import torch

from cloudtrain.batch_size import probe_on_device, worst_case_probe
from cloudtrain.config import build_config
from cloudtrain.data.sources import connect_data
from cloudtrain.errors import UserError
from cloudtrain.models.load import load_model, load_tokenizer
from cloudtrain.parallel.runtime import Runtime
from cloudtrain.pipeline import resolve
from cloudtrain.tasks import build_task


def main() -> None:
    options, scenarios, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    cfg = build_config(options)
    task = build_task(cfg)
    cfg = resolve(cfg, task)
    runtime = Runtime.for_launch(cfg)
    data = task.process(connect_data(cfg.data, task.columns(cfg.data)), load_tokenizer(cfg.model), cfg)
    model = load_model(cfg, task, data, load_tokenizer(cfg.model))
    real, _ = worst_case_probe(model, data, task, cfg.training.mixed_precision, runtime.device)
    results = [search_with(limits[str(runtime.index)], real, model, runtime) for limits in scenarios]
    (out / f"rank{runtime.index}.json").write_text(json.dumps(results))


def search_with(limit, real, model, runtime) -> dict:
    probed: list[int] = []

    def probe(size: int) -> None:
        probed.append(size)
        if limit == "error" and len(probed) == 2:
            raise ValueError("injected: not an out-of-memory error")
        real(size)  # the real forward and backward first, then the injected failure
        if limit != "error" and size > limit:
            raise torch.OutOfMemoryError(f"injected: {size} rows do not fit")

    result: dict = {"rank": runtime.index, "probed": probed}
    try:
        result["found"] = probe_on_device(model, probe, runtime.device, runtime.count, 2, 64, runtime, print)
    except UserError as err:
        result["error"] = str(err)
    return result


if __name__ == "__main__":
    main()
