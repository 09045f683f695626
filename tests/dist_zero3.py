"""Run under torchrun by test_deepspeed.py: load a classifier under ZeRO-3 and report what was built.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_zero3.py OPTIONS_JSON RESULT_JSON

Reports the AdamW parameter groups (sizes by their real, unpartitioned shapes) and the gathered full
state dict, so the test can check weight decay grouping and head replacement under zero.Init, and saves the
model as a run does (`saved/`).
"""

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from cloudtrain.config import build_config
from cloudtrain.pipeline import build_run


def main(options_file: str, result_dir: str) -> None:
    options = {"output_dir": str(Path(result_dir) / "out"), **json.loads(Path(options_file).read_text())}
    cfg = build_config({"mixed_precision": "no", "zero_stage": 3, **options})  # output_dir: not the repo's outputs/
    run = build_run(cfg)
    accelerator, trainer, data = run.runtime.accelerator, run.trainer, run.data
    groups = [
        {
            "weight_decay": g["weight_decay"],
            "shapes": [list(p.ds_shape) for p in g["params"]],
            "local_numel": sum(p.numel() for p in g["params"]),
        }
        for g in trainer.optimizer.param_groups
    ]
    trainer.setup()
    state = accelerator.get_state_dict(trainer.model)  # every rank: gathers the partitions
    trainer.save_model(Path(result_dir) / "saved")  # every rank too: the model as a run saves it
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(result_dir) / "gathered.safetensors"))
        (Path(result_dir) / "result.json").write_text(json.dumps({"groups": groups, "labels": data.label_names}))


if __name__ == "__main__":
    from dist_runs import exit_without_teardown

    main(*sys.argv[1:])
    exit_without_teardown()
