"""Run under torchrun by test_distributed.py: evaluate fixed weights with the AcceleratedTrainer.

python -m torch.distributed.run --nproc_per_node N tests/dist_eval.py OPTIONS_JSON RESULT_JSON
"""

import json
import sys
from pathlib import Path

from cloudtrain.config import build_config
from cloudtrain.pipeline import build_run


def main(options_file: str, result_file: str) -> None:
    cfg = build_config({"mixed_precision": "no", **json.loads(Path(options_file).read_text())})  # exact fp32 sums
    run = build_run(cfg)  # a saved classifier: the same weights everywhere
    run.trainer.setup()
    result = run.trainer.evaluate("validation")
    if run.runtime.is_main:
        Path(result_file).write_text(json.dumps({**result, "num_processes": run.runtime.count}))


if __name__ == "__main__":
    main(*sys.argv[1:])
