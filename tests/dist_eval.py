"""Run under torchrun by test_distributed.py: evaluate fixed weights with the AcceleratedTrainer.

    python -m torch.distributed.run --nproc_per_node N tests/dist_eval.py OPTIONS_JSON RESULT_JSON
"""

import json
import sys
from pathlib import Path

from cloudtrain.config import build_config
from cloudtrain.data_connecting import connect_data
from cloudtrain.data_processing import process_data
from cloudtrain.distributed import build_accelerator
from cloudtrain.model_loading import load_model, load_tokenizer
from cloudtrain.tracking import RunLog
from cloudtrain.trainers import AcceleratedTrainer


def main(options_file: str, result_file: str) -> None:
    cfg = build_config({"mixed_precision": "no", **json.loads(Path(options_file).read_text())})  # exact fp32 sums
    accelerator = build_accelerator(cfg)
    tokenizer = load_tokenizer(cfg.model)
    data = process_data(connect_data(cfg.data), tokenizer, cfg.data, cfg.training.seed)
    model = load_model(cfg.model, data.label_names, tokenizer)  # a saved classifier: the same weights everywhere
    run_log = RunLog(cfg, Path(cfg.output.output_dir), accelerator.is_main_process, run_info={})
    trainer = AcceleratedTrainer(cfg, model, data, run_log, accelerator)
    trainer.setup()
    result = trainer.evaluate("validation")
    if accelerator.is_main_process:
        Path(result_file).write_text(json.dumps({**result, "num_processes": accelerator.num_processes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
