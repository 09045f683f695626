"""--tensor_parallel_size on CPU with gloo: the sharded model's loss and every gradient equal the unsharded model's;
through the application, TP=2 on 2 processes and TP=2 x 2 replicas on 4 processes equal one process (losses,
gradient norms, weights after several steps, evaluation counts); a killed run resumes exactly from its sharded
checkpoint; the saved model is ordinary safetensors that one process loads and generates the same text with;
every refusal is one line (those need no launch); --task sft (answer-only loss) from a model whose embeddings hold
the chat template's tokens equals one process too."""

import json
import math
import shutil
from pathlib import Path

import pytest
import test_sft_dist
import torch
from conftest import ENTRY, REPO, assert_each_refused, built_once, lm_documents
from safetensors.torch import load_file
from test_distributed import ONE_PROCESS, in_one_launch, launch, logged_losses, torchrun
from test_sft_dist import sft_args

from cloudtrain.cli import main

chats = test_sft_dist.chats  # conversations of uneven answer lengths, the fixture taken by name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tp-corpus")
    for split, n, seed in (("train", 48, 0), ("validation", 8, 1)):
        (folder / f"{split}.txt").write_text("\n".join(lm_documents(n, seed)) + "\n")
    return folder


def options(model_dir: str, corpus: Path, out: Path) -> dict:
    return {
        "task": "causal_lm",
        "model_name_or_path": model_dir,
        "train_file": str(corpus / "train.txt"),
        "validation_file": str(corpus / "validation.txt"),
        "output_dir": str(out),
        "max_length": "48",
        "learning_rate": "3e-3",
        "logging_steps": "1",
        "mixed_precision": "no",
        "sample_max_new_tokens": "4",
        "eval_strategy": "no",
        "packing": "none",  # rows of uneven token counts: the global token normalisation matters
        "gradient_accumulation_steps": "2",
    }


def args(opts: dict, **extra) -> list[str]:
    return [str(ENTRY), *(f"--{k}={v}" for k, v in {**opts, **extra}.items())]


def metrics(out: Path, key: str) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [e[key] for e in lines if key in e]


MONITORED = ("train/loss", "train/grad_norm", "train/tokens_per_s", "train/samples_per_s", "train/step_time_s")


def assert_monitored_like_one_process(out: Path, one: Path) -> None:
    """The monitoring of a split model's run: at every logging step the loss, gradient norm, throughput, step
    time and peak memory are logged, finite and positive, and the interval's tokens per sample (tokens/s over
    samples/s: the seconds cancel) equal one process's: each row and token counted once, not once per process of
    a group. (No train/mfu on a CPU: it has no known peak; on GPUs it divides these same tokens.)"""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [e for e in lines if "train/loss" in e]
    assert logged and all("train/mfu" not in e for e in logged)
    for entry in logged:
        for key in (*MONITORED, "train/peak_memory_gib"):
            assert math.isfinite(entry[key]) and entry[key] > 0, (out.name, entry)
    per_sample = [e["train/tokens_per_s"] / e["train/samples_per_s"] for e in logged]
    theirs = metrics(one, "train/tokens_per_s")
    assert per_sample == pytest.approx(
        [a / b for a, b in zip(theirs, metrics(one, "train/samples_per_s"), strict=True)]
    )


def samples(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines() if '" -> "' in line]


def assert_generates_alike(out: Path, generations: list[dict], capsys) -> None:
    """The model saved in `out`, loaded in this one process (no launch to start), continues each sample prompt as
    the training run's model did at the end of training (`generations`, from its eval_results.json)."""
    whole = [g for g in generations if "\ufffd" not in g["continuation"]]  # decoded alone, a split character differs
    assert whole, generations
    for generation in whole:
        capsys.readouterr()
        prompt = generation["prompt"]
        assert main(["generate", "--model_dir", str(out), "--prompt", prompt, "--max_new_tokens", "4"]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1] == prompt + generation["continuation"]


@pytest.mark.slow
def test_sharded_loss_and_every_gradient_equal_the_unsharded_model(tiny_llama_dir):
    """4 processes: tensor parallel 2 x 2 data-parallel processes (replicas, then FSDP2 shards: 2-D, in the same
    launch), each taking its own rows, loaded as cloudtrain loads it."""
    result = launch(torchrun(4), str(REPO / "tests" / "dist_tp.py"), tiny_llama_dir, "2", "replicate", "fsdp")
    for mode in ("replicate", "fsdp"):
        assert result.stdout.count(f"{mode}: loss and") == 4, result.stdout[-2000:]
    assert result.stdout.count("gradients equal the unsharded model's") == 8, result.stdout[-2000:]
    assert result.stdout.count("refusal holds: LoRA on the sharded model fails") == 8, result.stdout[-2000:]


SFT = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
SFT += ["--max_grad_norm", "1", "--num_sample_prompts", "3"]  # the sft runs' options beside the model and data
ONE_STEPS = {"max_steps": "4", "per_device_train_batch_size": "4", "max_grad_norm": "1"}  # one_process's "one"


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, corpus, chats, tmp_path_factory) -> Path:
    """The one-process runs the TP=2 runs must equal, one after another in one plain process (no launcher: a
    run without tensor parallelism is the same without one), built once for both of `make test`'s workers (their
    inputs are the same, seeded): "one" (causal_lm, 4 rows, 4 steps), "grown" (a one-step sft run growing the
    test model's embeddings for chatml's tokens, the refusal's advice), "sft" (sft from "grown"). Their folder."""

    def build(root: Path) -> None:
        runs = {
            "one": args(options(tiny_llama_dir, corpus, root / "one"), **ONE_STEPS),
            "grown": sft_args(tiny_llama_dir, chats, root / "grown", "--max_steps", "1", "--num_sample_prompts", "0"),
            "sft": sft_args(str(root / "grown"), chats, root / "sft", *SFT),
        }
        for name, stdout in in_one_launch(ONE_PROCESS, runs, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "tensor-parallel-one-process", build)


TP2 = {"tensor_parallel_size": "2", "max_steps": "4", "max_grad_norm": "1"}  # the tp2 run's options
RESUMED = dict(max_steps="5", checkpointing_steps="3", per_device_train_batch_size="4", tensor_parallel_size="2")


@pytest.fixture(scope="module")
def tp2_runs(tiny_llama_dir, corpus, chats, one_process, tmp_path_factory) -> Path:
    """The uninterrupted TP=2 runs on 2 processes, one after another in one launch (its start, torch imported in
    both processes, costs more than these few steps), built once for both of `make test`'s workers: "tp2"
    (causal_lm, 4 rows, 4 steps), "first" (5 steps, a checkpoint at step 3: the resume test resumes a copy of
    it), "sft" (sft from one_process's "grown"). Each run's folder and its stdout <name>.out."""

    def build(root: Path) -> None:
        runs = {
            "tp2": args(options(tiny_llama_dir, corpus, root / "tp2"), **TP2, per_device_train_batch_size="4"),
            "first": args(options(tiny_llama_dir, corpus, root / "first"), **RESUMED),
            "sft": sft_args(str(one_process / "grown"), chats, root / "sft", *SFT, "--tensor_parallel_size", "2"),
        }
        for name, stdout in in_one_launch(torchrun(2), runs, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "tensor-parallel-tp2", build)


@pytest.mark.slow
def test_tp2_and_tp2_x_dp2_train_like_one_process(tiny_llama_dir, corpus, one_process, tp2_runs, tmp_path):
    """One process x 4 rows, TP=2 on 2 processes x 4 rows (both take the same rows), TP=2 x 2 replicas and TP=2 x
    FSDP2 shard 2 on 4 processes x 2 rows each: the same losses and gradient norms at every step (clipped:
    --max_grad_norm 1), the same weights after 4 steps of 2 accumulated micro-batches, the same evaluation over
    exactly the same tokens. (The two 4-process runs share one launch; the TP=2 run is tp2_runs's.)"""
    outputs = {"one": (one_process / "one.out").read_text(), "tp2": (tp2_runs / "tp2.out").read_text()}
    four = {  # one launch
        name: args(options(tiny_llama_dir, corpus, tmp_path / name), **TP2, per_device_train_batch_size="2", **fsdp)
        for name, fsdp in (("tp2x2", {}), ("tp2xfsdp2", {"fsdp": "true"}))
    }
    outputs |= in_one_launch(torchrun(4), four, tmp_path)
    assert "tensor parallel 2" in outputs["tp2"] and "4 process(es)" in outputs["tp2x2"]
    assert "effective batch 8 (2 per device x 2 x 2 accumulation)" in outputs["tp2x2"]
    assert "tensor parallel 2 x FSDP2" in outputs["tp2xfsdp2"]
    initial = load_file(Path(tiny_llama_dir) / "model.safetensors")
    one = load_file(one_process / "one" / "model.safetensors")
    evaluation = json.loads((one_process / "one" / "eval_results.json").read_text())
    for name in ("tp2", "tp2x2", "tp2xfsdp2"):
        out = tp2_runs / name if name == "tp2" else tmp_path / name
        assert logged_losses(out) == pytest.approx(logged_losses(one_process / "one"), rel=1e-6)
        assert metrics(out, "train/grad_norm") == pytest.approx(
            metrics(one_process / "one", "train/grad_norm"), rel=1e-5
        )
        saved = load_file(out / "model.safetensors")  # gathered from the shards: ordinary full tensors
        assert set(saved) == set(one) and all(saved[k].shape == one[k].shape for k in one)
        for key in one:
            moved = (one[key] - initial[key]).abs().max()
            assert moved > 1e-3, key  # it trained, by far more than the tolerance below
            # Adam divides by the gradient's root mean square: an element whose gradient is ~0 moves by up to
            # lr from a rounding difference (row-wise layers add their partial sums in another order)
            torch.testing.assert_close(saved[key], one[key], rtol=1e-3, atol=3e-4, msg=key)
        theirs = json.loads((out / "eval_results.json").read_text())
        assert (theirs["tokens"], theirs["samples"]) == (evaluation["tokens"], evaluation["samples"])  # each once
        assert theirs["loss"] == pytest.approx(evaluation["loss"], rel=1e-5)
        assert_monitored_like_one_process(out, one_process / "one")
        trained = [
            json.loads((run / "train_results.json").read_text())["train_samples"] for run in (out, one_process / "one")
        ]
        assert trained[0] == trained[1], name  # each row counted once, not once per process of its group


@pytest.mark.slow
def test_sft_tp2_trains_like_one_process_from_a_model_grown_in_one_process(one_process, tp2_runs):
    """The test model has no rows for chatml's tokens: a one-process sft run grows them (the refusal's advice),
    then TP=2 (tp2_runs's "sft") and one process fine-tune its output alike: answer-only losses and gradient norms
    at every step (clipped, 2 accumulated micro-batches of uneven answer-token counts), the evaluation over the
    same answer tokens, the sample answers, and the weights after 4 steps."""
    grown, one = one_process / "grown", (one_process / "sft.out").read_text()
    tp2 = (tp2_runs / "sft.out").read_text()
    assert "tensor parallel 2" in tp2 and "grew the embeddings" not in one + tp2
    a, b = tp2_runs / "sft", one_process / "sft"
    assert logged_losses(a) == pytest.approx(logged_losses(b), rel=1e-6)
    assert metrics(a, "train/grad_norm") == pytest.approx(metrics(b, "train/grad_norm"), rel=1e-5)
    initial, ours, theirs = (load_file(folder / "model.safetensors") for folder in (grown, a, b))
    assert set(ours) == set(theirs) == set(initial)
    for key in theirs:
        assert (theirs[key] - initial[key]).abs().max() > 1e-3, key  # it trained
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-3, atol=3e-4, msg=key)  # see the test above
    ours, theirs = (json.loads((folder / "eval_results.json").read_text()) for folder in (a, b))
    assert ours["tokens"] == theirs["tokens"] and ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert (ours["exact_match"], ours["generations"]) == (theirs["exact_match"], theirs["generations"])


@pytest.mark.slow
def test_resume_is_exact_and_the_saved_model_generates_alike_in_one_process(
    tiny_llama_dir, corpus, tp2_runs, tmp_path, capsys
):
    """TP=2: a run with a checkpoint at step 3 of 5 (tp2_runs's "first", copied here: the resume rewrites its
    folder), then the same run resumed there (as after kill -9) ends with the same weights and losses; the saved
    model loads in one process and continues the sample prompts as the tensor-parallel model did at the end of
    training."""
    out = tmp_path / "tp"
    shutil.copytree(tp2_runs / "first", out)
    opts = options(tiny_llama_dir, corpus, out)
    first = (tp2_runs / "first.out").read_text()
    weights, losses = load_file(out / "model.safetensors"), logged_losses(out)
    checkpoint = out / "checkpoints" / "checkpoint-3"
    assert (checkpoint / "tensor_parallel" / ".metadata").is_file()  # every process's shards
    resumed = launch(
        torchrun(2), *args(opts, **RESUMED, overwrite_output_dir="true", resume_from_checkpoint=str(checkpoint))
    ).stdout
    assert "at step 3" in resumed
    again = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert logged_losses(out) == pytest.approx(losses, rel=1e-12)

    config = json.loads((out / "config.json").read_text())
    assert "distributed_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert samples(first) == samples(resumed)
    assert_generates_alike(out, json.loads((out / "eval_results.json").read_text())["generations"], capsys)


def test_every_refusal_is_one_line(tmp_path, corpus, chats, tiny_llama_dir, tiny_gpt2_dir, capsys, monkeypatch):
    base = {**options(tiny_llama_dir, corpus, tmp_path / "out"), "tensor_parallel_size": "2"}
    sft = {**base, "train_file": str(chats / "train.jsonl"), "validation_file": str(chats / "validation.jsonl")}
    cases = {  # name: (processes the launcher started, options, the line's end)
        "basic trainer": (1, {**base, "training_type": "basic"}, "needs --training_type accelerated"),
        "pipeline trainer": (4, {**base, "training_type": "pipeline"}, "needs --training_type accelerated"),
        "odd process count": (3, base, "needs a multiple of 2 processes, and this launch has 3"),
        "one process": (1, base, "needs a multiple of 2 processes, and this launch has 1"),
        "deepspeed": (2, {**base, "zero_stage": "2"}, "does not combine with DeepSpeed ZeRO"),
        "an accelerate FSDP config": (2, {**base, "env:ACCELERATE_USE_FSDP": "true"}, "not through an accelerate FSDP"),
        "adapters": (2, {**base, "peft": "lora"}, "does not combine with --peft"),
        "fused loss": (2, {**base, "fused_cross_entropy": "true"}, "does not combine with --fused_cross_entropy true"),
        "liger": (2, {**base, "liger_kernels": "true"}, "does not combine with --liger_kernels true"),
        "fsdp options": (
            2,
            {**base, "fsdp": "true", "fsdp_cpu_offload": "true"},
            "with --fsdp shards fully, through transformers",
        ),
        "dpo": (2, {**base, "task": "dpo"}, "is supported for --task causal_lm, sft only (this run is dpo)"),
        "sft, template tokens without rows": (
            2,
            {**sft, "task": "sft"},
            "the chat template's tokens (<|im_start|>, <|im_end|>) have no embedding rows in the model (400 rows)",
        ),
        "compile": (2, {**base, "torch_compile": "true"}, "does not combine with --torch_compile"),
        "batch size auto": (2, {**base, "per_device_train_batch_size": "auto"}, "not auto"),
        "no plan": (2, {**base, "model_name_or_path": tiny_gpt2_dir}, "the gpt2 model family has no tensor-parallel"),
        "heads": (3, {**base, "tensor_parallel_size": "3"}, "does not divide the model's attention heads (4)"),
        "kv heads": (4, {**base, "tensor_parallel_size": "4"}, "does not divide the model's KV heads (2)"),
        "zero size": (2, {**base, "tensor_parallel_size": "0"}, "error: --tensor_parallel_size must be at least 1"),
        "built from a config": (
            2,
            {
                **base,
                "model_name_or_path": "none",
                "model_config": f"{tiny_llama_dir}/config.json",
                "tokenizer_name_or_path": tiny_llama_dir,
            },
            "pass its output folder to --model_name_or_path",
        ),
    }
    for name, (processes, opts, message) in cases.items():
        with monkeypatch.context() as env:
            env.setenv("WORLD_SIZE", str(processes))
            env.setenv("MASTER_ADDR", "127.0.0.1")  # as a launcher sets them
            for key in [k for k in opts if k.startswith("env:")]:
                env.setenv(key[4:], opts.pop(key))
            assert_each_refused({name: (opts, message)}, capsys, tmp_path / "out")


def test_the_mesh_gives_tensor_parallel_groups_and_data_parallel_replicas_or_shards(tmp_path):
    from cloudtrain.config import Config
    from cloudtrain.training.accelerated import AcceleratedTrainer

    cfg = Config()
    cfg.distributed.tensor_parallel_size = 2
    mesh = AcceleratedTrainer.mesh(cfg, 8)
    assert (mesh.tp, mesh.dp_replicate, mesh.data_parallel, mesh.fits) == (2, 4, 4, True)
    assert mesh.describe() == "8 process(es): replicated 4 x tensor 2"
    cfg.distributed.fsdp = True
    mesh = AcceleratedTrainer.mesh(cfg, 8)
    assert (mesh.tp, mesh.dp_shard, mesh.dp_replicate, mesh.data_parallel) == (2, 4, 1, 4)
