"""Tensor and context parallelism in a SageMaker job with several processes per node (issue 34, item 3): a job
launched as a user would (sagemaker/launch.py against the local AWS, tests/aws_server.py), run like one instance
by the SDK's own torchrun driver with 2 processes, once with --tensor_parallel_size 2 and once with
--context_parallel_size 2. Each job saves in SM_MODEL_DIR an ordinary model that loads in one process and
continues the job's sample prompts as the job's model did at the end of training."""

import json
from pathlib import Path

import pytest
from aws_server import container_environment, local_aws, run_torchrun_driver
from conftest import lm_documents
from safetensors.torch import load_file
from test_sagemaker import launcher  # noqa: F401  # a fixture, taken by name

from cloudtrain.cli import main


def text_channels(root: Path) -> dict[str, str]:
    """Channels as folders of text files (one document a line)."""
    folders = {}
    for split, n, seed in (("train", 32, 0), ("validation", 6, 1)):
        folder = root / split
        folder.mkdir(parents=True)
        (folder / "part-0.txt").write_text("\n".join(lm_documents(n, seed)) + "\n")
        folders[split] = str(folder)
    return folders


@pytest.mark.slow
def test_tp2_and_cp2_jobs_with_two_processes_save_a_model_that_generates(
    launcher,  # noqa: F811
    tiny_llama_dir,
    tmp_path,
    monkeypatch,
    capsys,
):
    channels = text_channels(tmp_path / "data")
    (tmp_path / "aws").mkdir()
    degrees = {
        "tp": ("tensor_parallel_size", "tensor parallel 2"),
        "cp": ("context_parallel_size", "context parallel 2"),
    }
    with local_aws(tmp_path / "aws") as aws:
        for name, (flag, announced) in degrees.items():
            spec = launcher.JobSpec(
                instance_type="ml.g5.12xlarge",
                processes_per_host=2,
                base_job_name=f"cloudtrain-{name}",
                **channels,
                hyperparameters={
                    "task": "causal_lm",
                    "model_name_or_path": tiny_llama_dir,
                    flag: 2,
                    "max_steps": 3,
                    "per_device_train_batch_size": 4,
                    "max_length": 48,
                    "packing": "none",
                    "learning_rate": 3e-3,
                    "logging_steps": 1,
                    "mixed_precision": "no",
                    "sample_max_new_tokens": 4,
                },
            )
            request = aws.request_for(launcher.launch(spec, launcher.make_session()))
            root = tmp_path / f"opt-ml-{name}"
            env = container_environment(request, aws.client("s3"), root)
            job = run_torchrun_driver(env, root, root / "checkpoints")
            output = job.stdout + job.stderr
            assert job.returncode == 0, output[-4000:]
            assert "--nnodes=1 --nproc_per_node=2" in job.stdout and announced in output, output[-4000:]

            model_dir = Path(env["SM_MODEL_DIR"])
            assert json.loads((model_dir / "train_results.json").read_text())["global_step"] == 3
            config = json.loads((model_dir / "config.json").read_text())
            assert "distributed_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
            initial, saved = (
                load_file(Path(tiny_llama_dir) / "model.safetensors"),
                load_file(model_dir / "model.safetensors"),
            )
            assert set(saved) == set(initial) and all(saved[k].shape == initial[k].shape for k in initial)  # whole
            assert any((saved[k] - initial[k]).abs().max() > 1e-3 for k in initial)  # it trained (Adam, lr 3e-3)
            generations = json.loads((model_dir / "eval_results.json").read_text())["generations"]
            whole = [g for g in generations if "\ufffd" not in g["continuation"]]  # decoded alone, a split char differs
            assert whole, generations
            for generation in whole:
                capsys.readouterr()
                prompt = generation["prompt"]
                assert (
                    main(["generate", "--model_dir", str(model_dir), "--prompt", prompt, "--max_new_tokens", "4"]) == 0
                )
                assert capsys.readouterr().out.strip().splitlines()[-1] == prompt + generation["continuation"], name
