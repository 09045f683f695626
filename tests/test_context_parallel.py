"""--context_parallel_size on CPU with gloo (all-to-all sequence parallelism, cloudtrain.parallel.context and
.sequence): the cut and its re-assembly, the loss over cut rows equal to the whole rows' (fast, in-process);
the attention over cut rows against the whole model (logits of packed documents kept apart, losses, every
gradient; one 4-process launch: CP=2 x 2 groups); through the application, CP=2, CP=2 x 2 replicas and CP=2 with
FSDP2 train like one process on packed rows, a checkpoint resumes exactly, the saved model generates alike in one
process; every refusal is one line."""

import json
import shutil
from pathlib import Path

import pytest
import test_sft_dist
import torch
from conftest import REPO, assert_each_refused, built_once
from safetensors.torch import load_file
from test_distributed import ONE_PROCESS, in_one_launch, launch, logged_losses, torchrun
from test_sft_dist import sft_args
from test_tensor_parallel import (  # noqa: F401  (corpus: the fixture)
    args,
    assert_generates_alike,
    assert_monitored_like_one_process,
    corpus,
    metrics,
    options,
    samples,
)

from cloudtrain.data.packing import IGNORE_INDEX, CausalLMCollator, shifted_loss, target_loss
from cloudtrain.parallel.context import cut_batch, unshard, widen

chats = test_sft_dist.chats  # conversations of uneven answer lengths, the fixture taken by name


def packed_batch() -> dict:
    rows = [
        {"input_ids": list(range(1, 8)), "seq_lengths": [3, 4]},
        {"input_ids": list(range(10, 15)), "seq_lengths": [5]},
        {"input_ids": list(range(20, 29)), "seq_lengths": [2, 2, 5]},
    ]
    return CausalLMCollator(0, cu_seqlens=True)(rows)  # width 9: 3 does not divide 2 or 4


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_cut_puts_back_together_and_keeps_every_target(cp):
    batch = packed_batch()
    parts = [cut_batch(batch, cp, rank) for rank in range(cp)]
    width = batch["input_ids"].shape[1]
    for key in ("input_ids", "position_ids", "attention_mask"):
        assert torch.equal(unshard([p[key] for p in parts])[:, :width], batch[key]), key
    targets = unshard([p["targets"] for p in parts])
    assert torch.equal(targets[:, : width - 1], batch["labels"][:, 1:])  # shifted before the cut: none lost
    assert (targets[:, width - 1 :] == IGNORE_INDEX).all()
    assert all("labels" not in p for p in parts)  # nothing may shift a slice again
    # the whole rows' lengths, moved with each row's padding: every row still ends on a bound
    padded = widen(batch, cp)
    new_width = padded["input_ids"].shape[1]
    assert new_width % cp == 0 and new_width - width < cp
    bounds = padded["cu_seqlens"].tolist()
    assert [b for b in bounds if b % new_width == 0] == [r * new_width for r in range(4)]
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    original = [b - a for a, b in zip(batch["cu_seqlens"].tolist(), batch["cu_seqlens"].tolist()[1:], strict=False)]
    assert sum(lengths) == sum(original) + 3 * (new_width - width)
    assert padded["max_seqlen"].shape[-1] == batch["max_seqlen"].shape[-1] + new_width - width


def test_unpacked_rows_get_one_sequence_per_row():
    rows = [{"input_ids": [1, 2, 3], "seq_lengths": [3]}, {"input_ids": [4, 5, 6, 7, 8], "seq_lengths": [5]}]
    batch = CausalLMCollator(0)(rows)
    part = cut_batch(batch, 2, 1)
    assert part["cu_seqlens"].tolist() == [0, 6, 12] and part["max_seqlen"].shape[-1] == 6


def test_the_summed_loss_over_the_slices_equals_the_whole_rows_loss():
    torch.manual_seed(0)
    batch = packed_batch()
    logits = torch.randn(*batch["input_ids"].shape, 40)
    whole_sum, whole_count = shifted_loss(logits, batch["labels"])
    padded = torch.nn.functional.pad(logits, (0, 0, 0, 1))  # the cut pads the rows to a multiple of 2
    sums, counts = zip(
        *(
            target_loss(part, cut["targets"])
            for part, cut in zip(padded.chunk(2, dim=1), [cut_batch(batch, 2, 0), cut_batch(batch, 2, 1)], strict=True)
        ),
        strict=True,
    )
    assert sum(counts) == whole_count
    torch.testing.assert_close(sum(sums), whole_sum)


@pytest.mark.slow
def test_attention_over_cut_rows_equals_the_whole_model(tiny_llama_dir):
    """4 processes: 2 groups of CP=2, each group its rows; unpacked and packed rows (see tests/dist_cp.py)."""
    result = launch(torchrun(4), str(REPO / "tests" / "dist_cp.py"), tiny_llama_dir, "2")
    assert result.stdout.count("gradients equal the whole model's") == 8, result.stdout[-2000:]


MIXED = {"mixed_precision": "bf16", "gradient_checkpointing": "true", "peft": "lora"}  # bf16, checkpointing, LoRA
SFT = ["--max_steps", "3", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
SFT += ["--max_grad_norm", "1", "--num_sample_prompts", "3"]  # the sft runs' options beside the model and data


def packed_args(model_dir: str, corpus: Path, out: Path, rows: str, **extra: str) -> list[str]:  # noqa: F811
    """The packed (bfd) causal_lm runs' command line: 4 steps of `rows` per process, evaluated at step 4."""
    opts = {**options(model_dir, corpus, out), "packing": "bfd", "eval_strategy": "steps"}
    return args(opts, max_steps="4", eval_steps="4", per_device_train_batch_size=rows, max_grad_norm="1", **extra)


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir, corpus, chats, tmp_path_factory) -> Path:  # noqa: F811
    """The one-process runs the CP=2 runs must equal, one after another in one plain process (no launcher: a run
    without context parallelism is the same without one), built once for both of `make test`'s workers (their
    inputs are the same, seeded): "one" and "one-mixed" (packed causal_lm, 4 rows; the second with MIXED), "sft"
    (sft, its embeddings grown for chatml's tokens). Their folder, with each run's stdout in <name>.out."""

    def build(root: Path) -> None:
        runs = {
            "one": packed_args(tiny_llama_dir, corpus, root / "one", "4"),
            "one-mixed": packed_args(tiny_llama_dir, corpus, root / "one-mixed", "4", **MIXED),
            "sft": sft_args(tiny_llama_dir, chats, root / "sft", *SFT),
        }
        for name, stdout in in_one_launch(ONE_PROCESS, runs, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "context-parallel-one-process", build)


@pytest.mark.slow
def test_cp2_cp2_x_dp2_and_cp2_fsdp_train_like_one_process(
    tiny_llama_dir,
    corpus,  # noqa: F811
    one_process,
    tmp_path,
    capsys,
):
    """Packed rows (bfd): one process x 4 rows, CP=2 on 2 processes x 4 rows (both take the same rows, each half of
    their tokens), CP=2 x 2 replicas on 4 processes x 2 rows each, CP=2 x FSDP2 on 2 processes: the same losses and
    gradient norms at every step (clipped), the same weights after 4 steps of 2 accumulated micro-batches, the
    same evaluation over exactly the same tokens and rows. The CP=2 run saves a checkpoint at step 2: resumed there,
    it ends with the same weights bit for bit; its saved model generates in one process what it sampled. Every run
    logs its monitoring like one process; CP=2 with bf16, gradient checkpointing and LoRA trains like the same in
    one process (`assert_mixed_lora_like_one_process`). The 2-process runs share one launch."""
    cp2 = {"context_parallel_size": "2"}
    two = {  # the 2-process runs in one launch; FSDP2 first: the next runs must not find its settings
        "cp2fsdp": packed_args(tiny_llama_dir, corpus, tmp_path / "cp2fsdp", "4", **cp2, fsdp="true"),
        "cp2": packed_args(tiny_llama_dir, corpus, tmp_path / "cp2", "4", **cp2, checkpointing_steps="2"),
        "cp2-mixed": packed_args(tiny_llama_dir, corpus, tmp_path / "cp2-mixed", "4", **cp2, **MIXED),
    }
    outputs = in_one_launch(torchrun(2), two, tmp_path)
    outputs["cp2x2"] = launch(torchrun(4), *packed_args(tiny_llama_dir, corpus, tmp_path / "cp2x2", "2", **cp2)).stdout
    assert "context parallel 2 (all-to-all)" in outputs["cp2"] and "4 process(es)" in outputs["cp2x2"]
    assert "effective batch 8 (2 per device x 2 x 2 accumulation)" in outputs["cp2x2"]
    assert "FSDP" in outputs["cp2fsdp"]
    initial = load_file(Path(tiny_llama_dir) / "model.safetensors")
    one = load_file(one_process / "one" / "model.safetensors")
    evaluation = json.loads((one_process / "one" / "eval_results.json").read_text())
    for name in ("cp2", "cp2x2", "cp2fsdp"):
        out = tmp_path / name
        assert logged_losses(out) == pytest.approx(logged_losses(one_process / "one"), rel=1e-5), name
        assert metrics(out, "train/grad_norm") == pytest.approx(
            metrics(one_process / "one", "train/grad_norm"), rel=1e-4
        )
        saved = load_file(out / "model.safetensors")
        assert set(saved) == set(one)
        for key in one:
            assert (one[key] - initial[key]).abs().max() > 1e-3, key  # it trained, by far more than the tolerance
            torch.testing.assert_close(saved[key], one[key], rtol=1e-3, atol=3e-4, msg=f"{name} {key}")
        trained = [
            json.loads((run / "train_results.json").read_text())["train_samples"] for run in (out, one_process / "one")
        ]
        assert trained[0] == trained[1], name  # each row counted once, not once per process of its group
        theirs = json.loads((out / "eval_results.json").read_text())
        assert (theirs["tokens"], theirs["samples"]) == (evaluation["tokens"], evaluation["samples"]), name
        assert theirs["loss"] == pytest.approx(evaluation["loss"], rel=1e-5), name
        assert_monitored_like_one_process(out, one_process / "one")
    assert_mixed_lora_like_one_process(tmp_path / "cp2-mixed", one_process / "one-mixed", outputs["cp2-mixed"])

    out = tmp_path / "cp2"
    weights, losses = load_file(out / "model.safetensors"), logged_losses(out)
    generations = json.loads((out / "eval_results.json").read_text())["generations"]
    shutil.copytree(out, tmp_path / "cp2-first")
    checkpoint = out / "checkpoints" / "checkpoint-2"
    resume = {"overwrite_output_dir": "true", "resume_from_checkpoint": str(checkpoint)}
    resumed = launch(torchrun(2), *packed_args(tiny_llama_dir, corpus, out, "4", **cp2, **resume)).stdout
    assert "at step 2" in resumed
    again = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert logged_losses(out) == pytest.approx(losses, rel=1e-12)
    assert samples(outputs["cp2"]) == samples(resumed)
    assert_generates_alike(out, generations, capsys)


def assert_mixed_lora_like_one_process(out: Path, one: Path, stdout: str) -> None:
    """bf16 autocast, gradient checkpointing and LoRA adapters under CP=2 against the same in one process: losses
    and the evaluation within bf16 rounding (measured: 1e-5 relative), gradient norms within 1e-2 (measured:
    2e-3), the same evaluation tokens and rows, the adapters trained and saved (the base model is not)."""
    assert "context parallel 2" in stdout and "precision bf16" in stdout
    assert logged_losses(out) == pytest.approx(logged_losses(one), rel=1e-4)
    assert metrics(out, "train/grad_norm") == pytest.approx(metrics(one, "train/grad_norm"), rel=1e-2)
    ours, theirs = (json.loads((folder / "eval_results.json").read_text()) for folder in (out, one))
    assert (ours["tokens"], ours["samples"]) == (theirs["tokens"], theirs["samples"])
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
    assert json.loads((out / "args.json").read_text())["gradient_checkpointing"] is True
    adapters = load_file(out / "adapter_model.safetensors")
    assert adapters and set(adapters) == set(load_file(one / "adapter_model.safetensors"))
    assert not (out / "model.safetensors").exists()
    assert_monitored_like_one_process(out, one)


@pytest.mark.slow
def test_a_nan_step_is_skipped_on_every_process_under_tp2_and_cp2(tiny_llama_dir, corpus, tmp_path):  # noqa: F811
    """--nonfinite_loss skip under TP=2 and CP=2: a nan loss on process 0 alone at step 3 is skipped by every
    process of the group (its slice or shard of the step would otherwise differ), counted once, and training
    goes on with finite weights."""
    for name, split in (("tp2", "tensor_parallel_size"), ("cp2", "context_parallel_size")):
        out = tmp_path / name
        opts = {**options(tiny_llama_dir, corpus, out), split: "2", "nonfinite_loss": "skip", "max_steps": "6"}
        opts.update(gradient_accumulation_steps="1", logging_steps="2")
        (tmp_path / f"{name}.json").write_text(json.dumps(opts))
        launch(torchrun(2), str(REPO / "tests" / "dist_nonfinite.py"), str(tmp_path / f"{name}.json"), "3")
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        skipped = [(e["step"], e["train/skipped_steps"]) for e in logged if "train/skipped_steps" in e]
        assert skipped == [(4, 1)], (name, skipped)
        losses = [e["train/loss"] for e in logged if "train/loss" in e]
        assert len(losses) == 3 and all(loss == loss for loss in losses), (name, losses)
        assert all(torch.isfinite(t).all() for t in load_file(out / "model.safetensors").values()), name


@pytest.mark.slow
def test_sft_cp2_trains_like_one_process(tiny_llama_dir, chats, one_process, tmp_path):
    """--task sft (answer-only targets, chat-template tokens grown in every process alike): CP=2 and one process
    alike in losses and gradient norms at every step, weights after 3 steps, the evaluation over the same answer
    tokens, the sample answers."""
    cp2 = launch(torchrun(2), *sft_args(tiny_llama_dir, chats, tmp_path / "cp2", *SFT, "--context_parallel_size", "2"))
    assert "context parallel 2" in cp2.stdout
    a, b = tmp_path / "cp2", one_process / "sft"
    assert logged_losses(a) == pytest.approx(logged_losses(b), rel=1e-5)
    assert metrics(a, "train/grad_norm") == pytest.approx(metrics(b, "train/grad_norm"), rel=1e-4)
    ours, theirs = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-3, atol=3e-4, msg=key)
    ours, theirs = (json.loads((folder / "eval_results.json").read_text()) for folder in (a, b))
    assert ours["tokens"] == theirs["tokens"] and ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert (ours["exact_match"], ours["generations"]) == (theirs["exact_match"], theirs["generations"])


def sliding_window_model(tokenizer_dir: str, folder: Path) -> str:
    """A tiny Mistral whose layers attend within a window of 16 tokens, with the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)  # fmt: skip
    MistralForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return str(folder)


def test_every_refusal_is_one_line(tmp_path, corpus, tiny_llama_dir, tiny_gpt2_dir, capsys, monkeypatch):  # noqa: F811
    base = {**options(tiny_llama_dir, corpus, tmp_path / "out"), "context_parallel_size": "2"}
    cases = {  # name: (processes the launcher started, options, the line's end)
        "basic trainer": (1, {**base, "training_type": "basic"}, "needs --training_type accelerated"),
        "pipeline trainer": (4, {**base, "training_type": "pipeline"}, "needs --training_type accelerated"),
        "odd process count": (3, base, "needs a multiple of 2 processes, and this launch has 3"),
        "one process": (1, base, "needs a multiple of 2 processes, and this launch has 1"),
        "tensor parallel": (4, {**base, "tensor_parallel_size": "2"}, "does not combine with --tensor_parallel_size"),
        "tensor parallel, any launch": (  # refused first: the process count named first could not help (audit)
            1,
            {**base, "tensor_parallel_size": "2"},
            "--context_parallel_size 2 does not combine with --tensor_parallel_size yet; use one of the two",
        ),
        "deepspeed": (2, {**base, "zero_stage": "2"}, "does not combine with DeepSpeed ZeRO"),
        "an accelerate FSDP config": (2, {**base, "env:ACCELERATE_USE_FSDP": "true"}, "not through an accelerate"),
        "hybrid shard": (
            2,
            {**base, "fsdp": "true", "fsdp_sharding_strategy": "hybrid_shard"},
            "use --fsdp_sharding_strategy full_shard or shard_grad_op",
        ),
        "dpo": (2, {**base, "task": "dpo"}, "is supported for --task causal_lm, sft only (this run is dpo)"),
        "compile": (2, {**base, "torch_compile": "true"}, "does not combine with --torch_compile"),
        "attention": (2, {**base, "attn_implementation": "sdpa"}, "leave --attn_implementation out"),
        "batch size auto": (2, {**base, "per_device_train_batch_size": "auto"}, "not auto"),
        "heads": (3, {**base, "context_parallel_size": "3"}, "does not divide the model's attention heads (4)"),
        "kv heads": (4, {**base, "context_parallel_size": "4"}, "does not divide the model's KV heads (2)"),
        "zero size": (2, {**base, "context_parallel_size": "0"}, "error: --context_parallel_size must be at least 1"),
        "sliding window": (  # the refusal named no way on (found in audit)
            2,
            {**base, "model_name_or_path": sliding_window_model(tiny_llama_dir, tmp_path / "mistral")},
            "uses sliding-window attention, which its attention does not compute; drop --context_parallel_size "
            "(--fsdp true or --tensor_parallel_size share the model's memory instead)",
        ),
    }
    for name, (processes, opts, message) in cases.items():
        with monkeypatch.context() as env:
            env.setenv("WORLD_SIZE", str(processes))
            env.setenv("MASTER_ADDR", "127.0.0.1")  # as a launcher sets them
            for key in [k for k in opts if k.startswith("env:")]:
                env.setenv(key[4:], opts.pop(key))
            assert_each_refused({name: (opts, message)}, capsys, tmp_path / "out")


def test_the_mesh_gives_context_parallel_groups_and_replicas_or_shards():
    from cloudtrain.config import Config
    from cloudtrain.training.accelerated import AcceleratedTrainer

    cfg = Config()
    cfg.distributed.context_parallel_size = 2
    mesh = AcceleratedTrainer.mesh(cfg, 8)
    assert (mesh.cp, mesh.dp_replicate, mesh.data_parallel, mesh.fits) == (2, 4, 4, True)
    assert mesh.describe() == "8 process(es): replicated 4 x context 2"
    cfg.distributed.fsdp = True
    mesh = AcceleratedTrainer.mesh(cfg, 8)
    assert (mesh.cp, mesh.dp_shard, mesh.dp_replicate, mesh.data_parallel) == (2, 4, 1, 4)


def test_a_training_forward_without_a_cut_batch_is_an_error_not_a_local_attention(monkeypatch):
    """With a context-parallel group in use, attention over an uncut batch would attend within each process's
    slice only (wrong weights, no error): a training forward refuses it; evaluation and generation of whole
    prompts (not training) attend locally."""
    from cloudtrain.parallel import sequence

    monkeypatch.setattr(sequence, "_GROUP", [object()])
    module = torch.nn.Linear(1, 1)
    q = torch.randn(1, 2, 4, 8)
    bounds = torch.tensor([0, 4], dtype=torch.int32)
    extra = {"cu_seq_lens_q": bounds, "max_length_q": 4}
    with pytest.raises(RuntimeError, match="no cut batch"):
        sequence.ulysses_attention(module.train(), q, q, q, None, **extra)
    out, _ = sequence.ulysses_attention(module.eval(), q, q, q, None, **extra)
    assert out.shape == (1, 4, 2, 8)
