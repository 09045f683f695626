"""A SageMaker channel in FastFile mode as a streaming source: the platform mounts the channel's S3 objects as a
folder (SM_CHANNEL_TRAIN), read lazily as they are opened, which is what a stream does with a folder source.
The entry point runs as inside a job (the SM_* variables of the contract, cloudtrain.sagemaker_env) with
--streaming true and no --train_file: it streams the channel folder, nested files included, and reports its
documents under the channel's path."""

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ENTRY, REPO, child_pythonpath, lm_documents
from test_streaming import data_cfg, write_jsonl

from cloudtrain.data.mixture import resolve_sources


@pytest.mark.slow
def test_the_entry_point_streams_a_fastfile_train_channel(tiny_llama_dir, tmp_path):
    root = tmp_path / "opt-ml"
    channel = root / "input" / "data" / "train"
    (channel / "part-2").mkdir(parents=True)
    write_jsonl(channel / "part-0.jsonl", lm_documents(40, 0))
    write_jsonl(channel / "part-1.jsonl.gz", lm_documents(30, 1), gzip.open)
    write_jsonl(channel / "part-2" / "more.jsonl", lm_documents(30, 2))
    pq.write_table(pa.table({"text": ["not this source"]}), root / "input" / "data" / "elsewhere.parquet")
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "SM_MODEL_DIR": str(root / "model"),
        "SM_CHANNEL_TRAIN": str(channel),
        "SM_CHANNEL_MODEL": tiny_llama_dir,
        "TRAINING_JOB_NAME": "cloudtrain-stream-1",
    }
    env.pop("ACCELERATE_USE_CPU", None)
    args = [
        "--task", "causal_lm", "--streaming", "true", "--max_steps", "6", "--max_length", "32",
        "--per_device_train_batch_size", "2", "--mixed_precision", "no", "--eval_strategy", "no",
        "--logging_steps", "2", "--stream_buffer", "16", "--stream_validation_docs", "8",
        "--sample_max_new_tokens", "2", "--num_sample_prompts", "1", "--packing", "bfd",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=600, cwd=REPO, env=env
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    model_dir = root / "model"
    assert json.loads((model_dir / "args.json").read_text())["train_file"] == str(channel)
    results = json.loads((model_dir / "train_results.json").read_text())
    assert results["global_step"] == 6
    sources = results["sources"]
    assert sources[str(channel)]["documents"] > 0 and sources[str(channel)]["tokens"] > 0
    assert (model_dir / "model.safetensors").is_file()
    (spec,) = resolve_sources(data_cfg(train_file=str(channel)).data)  # the channel's files, as the run read them
    assert [f.removeprefix(str(channel)) for f in spec.files] == [
        "/part-0.jsonl",
        "/part-1.jsonl.gz",
        "/part-2/more.jsonl",
    ]
