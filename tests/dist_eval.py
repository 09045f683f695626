"""Run under torchrun by test_distributed.py: evaluate fixed weights with the AcceleratedTrainer, once per run of
OPTIONS_JSON (a list of option dicts: one launch for all); RESULT_JSON gets the list of their results, each with the
predictions of any unlabelled split under the split's name.

python -m torch.distributed.run --nproc_per_node N tests/dist_eval.py OPTIONS_JSON RESULT_JSON
"""

import json
import sys
from pathlib import Path

from cloudtrain.config import build_config
from cloudtrain.pipeline import build_run


def main(options_file: str, result_file: str) -> None:
    results = []
    for options in json.loads(Path(options_file).read_text()):
        cfg = build_config({"mixed_precision": "no", **options})  # exact fp32 sums
        run = build_run(cfg)  # a saved model: the same weights everywhere
        run.trainer.setup()
        predicted = {split: run.trainer.predict(split) for split in run.data.unlabelled}
        results.append({**run.trainer.evaluate("validation"), "num_processes": run.runtime.count, **predicted})
        if run.runtime.is_main:
            Path(result_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
