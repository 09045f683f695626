"""--training_type pipeline: stages that equal the whole model, gradients and losses that equal one process
(1F1B, GPipe, interleaved 1F1B, tied embeddings, 2 stages x 2 data-parallel pipelines), a saved model that
from_pretrained loads, exact resume after SIGKILL, and the refusals."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENTRY, REPO, assert_each_refused, lm_documents
from safetensors.torch import load_file
from test_checkpointing import train_losses
from test_distributed import launch, logged_losses, torchrun
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

from cloudtrain.checkpointing import complete_checkpoints
from cloudtrain.parallel.stages import balanced_split, build_stages, split_after, split_points_error

WORKER = Path(__file__).with_name("dist_pipeline.py")


# ------------------------------------------------------------ stages, on one process
def tiny(kind: str, layers: int = 4):
    torch.manual_seed(0)
    common = dict(vocab_size=96, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=64)
    config = {
        "llama": lambda: LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **common),
        "qwen2": lambda: Qwen2Config(  # sliding-window layers: a second kind of mask
            hidden_size=32,
            intermediate_size=64,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=2,
            **common,
        ),
        "gpt2": lambda: GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=96, n_positions=64),
    }[kind]()
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("n_stages", [2, 3, 6])
def test_stages_in_sequence_equal_the_whole_model_and_keep_its_names(kind, n_stages):
    model = tiny(kind)
    ids = torch.randint(0, 96, (2, 10))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(10))])  # two packed documents in row 0
    whole = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    stages = build_stages(model, balanced_split(4, n_stages), range(n_stages))
    hidden = ids
    for stage in stages:
        hidden = stage(hidden, positions)
    torch.testing.assert_close(hidden, whole, rtol=0, atol=1e-6)
    names = [name for stage in stages for name in stage.state_dict()]
    assert len(names) == len(set(names)) and set(names) == set(model.state_dict())


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("held", [[0], [1], [3], [1, 3]])
def test_a_process_keeps_only_the_weights_of_its_stages(kind, held):
    """The embeddings, final norm and head of stages elsewhere stayed in memory on every process (about 4 GB in
    fp32 for Llama-3-8B; found in audit): everything no stage here holds goes to the meta device."""
    from cloudtrain.parallel.stages import release_others, tied, untie

    model = tiny(kind)
    stages = build_stages(model, balanced_split(4, 4), held)
    if tied(model) and any(s.last for s in stages) and not any(s.first for s in stages):
        untie(next(s for s in stages if s.last))  # as the trainer does
    release_others(model, stages)
    live = {id(p) for p in model.parameters() if p.device.type != "meta"}
    assert live == {id(p) for stage in stages for p in stage.parameters()}
    assert all(t.device.type == "cpu" for stage in stages for t in [*stage.parameters(), *stage.buffers()])


@pytest.mark.parametrize("tied", [False, True])
def test_muon_leaves_the_last_stages_head_to_adamw_as_in_one_process(tied):
    """A pipeline's optimizer sees its stages, not the model: the LM head went to Muon (AdamW in one process),
    and a tied head drifted from the first stage's embeddings (found in audit)."""
    from cloudtrain.training.optim import hidden_matrices

    model = tiny("llama")
    model.config.tie_word_embeddings = tied
    if tied:
        model.tie_weights()
    names = {id(p): n for n, p in model.named_parameters()}
    whole = {names[id(p)] for p in hidden_matrices(model)}
    stages = build_stages(model, balanced_split(4, 2), range(2))
    staged = {names[id(p)] for p in hidden_matrices(torch.nn.ModuleList(stages))}
    assert staged == whole and not any("lm_head" in n or "embed" in n for n in staged)


def test_balanced_split_gives_the_ends_one_layer_fewer():
    assert [list(r) for r in balanced_split(4, 2)] == [[0, 1], [2, 3]]
    assert [len(r) for r in balanced_split(22, 4)] == [5, 6, 6, 5]  # 24 units: 6 each, ends one fewer
    assert [len(r) for r in balanced_split(7, 3)] == [2, 3, 2]
    assert [len(r) for r in balanced_split(2, 4)] == [0, 1, 1, 0]  # the ends hold embeddings / head only
    for n_layers, n_stages in ((4, 2), (22, 4), (7, 3), (32, 8), (30, 4)):
        ranges = balanced_split(n_layers, n_stages)
        assert [i for r in ranges for i in r] == list(range(n_layers))
        inner = [len(r) for r in ranges[1:-1]]
        assert not inner or max(inner) - min(inner) <= 1


def test_split_points_are_checked_and_applied():
    assert [list(r) for r in split_after([0, 2], 4)] == [[0], [1, 2], [3]]
    assert [list(r) for r in split_after([1, 3], 4)] == [[0, 1], [2, 3], []]  # the head alone on the last stage
    assert split_points_error(["model.layers.0", "model.layers.2"], "model.layers", 4, 3) is None
    assert "give 2 stages" in split_points_error(["model.layers.2"], "model.layers", 4, 3)
    assert "not a layer" in split_points_error(["model.layers.1", "model.layers.4"], "model.layers", 4, 3)
    assert "not a layer" in split_points_error(["transformer.h.1", "model.layers.2"], "model.layers", 4, 3)
    assert "increasing" in split_points_error(["model.layers.3", "model.layers.1"], "model.layers", 4, 3)


# ------------------------------------------------------------ refusals
@pytest.fixture()
def corpus_files(tmp_path):
    for split, n in (("train", 24), ("validation", 6)):
        (tmp_path / f"{split}.txt").write_text("\n".join(lm_documents(n, seed=len(split))) + "\n")
    return tmp_path


def test_each_refusal_is_one_line_before_anything_loads(
    tiny_llama_dir, tiny_model_dir, corpus_files, capsys, monkeypatch, tmp_path
):
    out = tmp_path / "out"
    lm = {
        "task": "causal_lm",
        "model_name_or_path": tiny_llama_dir,
        "train_file": str(corpus_files / "train.txt"),
        "validation_file": str(corpus_files / "validation.txt"),
        "output_dir": str(out),
        "training_type": "pipeline",
        "per_device_train_batch_size": "8",
    }
    opt = tmp_path / "opt"  # a decoder whose layer list cloudtrain.parallel.stages does not know
    AutoModelForCausalLM.from_config(
        OPTConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=2,
            word_embed_proj_dim=32,
        )
    ).save_pretrained(opt)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert_each_refused(
        {"no launcher": (lm, "needs a multiple of 2 processes (this launch has 1): torchrun --nproc_per_node 2")},
        capsys,
        out,
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # as a launcher sets them
    cases = {
        "classification": (
            {"model_name_or_path": tiny_model_dir, "training_type": "pipeline", "output_dir": str(out)},
            "trains decoders (--task causal_lm or sft), not --task classification: use --training_type accelerated",
        ),
        "deepspeed": ({**lm, "zero_stage": "2"}, "do not combine with --training_type pipeline"),
        "adapters": ({**lm, "peft": "lora"}, "--training_type pipeline does not train adapters"),
        "auto batch": ({**lm, "per_device_train_batch_size": "auto"}, "give a number"),
        "rows": ({**lm, "per_device_train_batch_size": "6"}, "does not split into 4 --pipeline_microbatches"),
        "few micro-batches": ({**lm, "pipeline_microbatches": "1"}, "at least as many --pipeline_microbatches"),
        "interleaved": ({**lm, "pipeline_schedule": "interleaved_1f1b"}, "needs --pipeline_stages_per_rank 2"),
        "stages per rank": ({**lm, "pipeline_stages_per_rank": "2"}, "needs --pipeline_schedule interleaved_1f1b"),
        "split points": ({**lm, "pipeline_split_points": "model.layers.7"}, "is not a layer that can end a stage"),
        "fp16": ({**lm, "mixed_precision": "fp16"}, "trains in bf16 or fp32: pass --mixed_precision bf16"),
        "fsdp": ({**lm, "fsdp": "true"}, "do not combine with --training_type pipeline"),
        "compile": ({**lm, "torch_compile": "true"}, "--torch_compile does not apply to pipeline stages"),
        "neftune": ({**lm, "neftune_noise_alpha": "5"}, "--neftune_noise_alpha does not apply to pipeline stages"),
        "label smoothing": ({**lm, "label_smoothing": "0.1"}, "--label_smoothing does not apply to pipeline stages"),
        "streaming": ({**lm, "streaming": "true", "max_steps": "2", "validation_file": None}, "basic and accelerated"),
        "no stages": ({**lm, "pipeline_parallel_size": "0"}, "--pipeline_parallel_size must be at least 1"),
        "no micro-batches": ({**lm, "pipeline_microbatches": "0"}, "--pipeline_microbatches must be at least 1"),
        "pipeline option elsewhere": (
            {**lm, "training_type": "accelerated", "pipeline_schedule": "gpipe"},
            "--pipeline_schedule needs --training_type pipeline (this run is accelerated)",
        ),
        "too many stages": (
            {
                **lm,
                "pipeline_parallel_size": "2",
                "pipeline_stages_per_rank": "4",
                "pipeline_microbatches": "8",
                "pipeline_schedule": "interleaved_1f1b",
            },
            "8 stages need at least 6 layers; the model has 2",
        ),
        "unknown family": (
            {**lm, "model_name_or_path": str(opt), "tokenizer_name_or_path": tiny_llama_dir},
            "cannot cut a opt model into stages",
        ),
    }
    assert_each_refused(cases, capsys, out)


# ------------------------------------------------------------ against one process, under torchrun
def lm_options(model_dir: str, corpus: Path, out: Path, **extra) -> dict:
    return {
        "task": "causal_lm",
        "model_name_or_path": model_dir,
        "train_file": str(corpus / "train.txt"),
        "validation_file": str(corpus / "validation.txt"),
        "output_dir": str(out),
        "max_length": 40,
        "packing": "none",  # rows of uneven length: padding and the token normalisation both matter
        "mixed_precision": "no",
        "report_to": ["none"],
        "training_type": "pipeline",
        **extra,
    }


def step_gradients(processes: int, scenarios: list[dict], out: Path) -> list[tuple[list[dict], dict]]:
    """Each scenario's one-step results: (every rank's, the one-process reference)."""
    launch(torchrun(processes), str(WORKER), json.dumps(scenarios), str(out))
    return [
        (
            [torch.load(out / str(i) / f"rank{r}.pt") for r in range(processes)],
            torch.load(out / str(i) / "reference.pt"),
        )
        for i in range(len(scenarios))
    ]


def assert_equal_to_one_process(ranks: list[dict], ref: dict, pp: int, case: str) -> None:
    seen = set()
    for rank in ranks:
        for name, grad in rank["grads"].items():
            twin = "transformer.wte.weight" if name == "lm_head.weight" else name  # the last stage's tied copy
            reference = ref["grads"][name] if name in ref["grads"] else ref["grads"][twin]
            torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-7, msg=f"{case}: {name}")
            seen.add(name)
    assert seen >= set(ref["grads"]), case  # every weight of the model is some stage's
    for pipeline in range(len(ranks) // pp):
        stages = ranks[pipeline * pp : (pipeline + 1) * pp]  # rank = pipeline * pp + stage
        assert stages[-1]["count"] > 0 and all(r["count"] == 0 for r in stages[:-1]), case
    last = ranks[pp - 1 :: pp]  # each pipeline's last process holds its loss
    loss = sum(r["loss_sum"] for r in last) / sum(r["count"] for r in last)
    assert float(loss) == pytest.approx(float(ref["loss_sum"] / ref["count"]), rel=1e-6), case


TWO_STAGES = {
    "1f1b, own split": (  # both layers on stage 0, the norm and head alone on stage 1
        "llama",
        {"pipeline_schedule": "1f1b", "max_grad_norm": 0, "pipeline_split_points": ["model.layers.1"]},
    ),
    "gpipe, accumulation, clipping": (
        "llama",
        {"pipeline_schedule": "gpipe", "gradient_accumulation_steps": 2, "max_grad_norm": 1e-3},
    ),
    "interleaved 1f1b": ("llama", {"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 2}),
    "gpt2, tied embeddings": ("gpt2", {"pipeline_schedule": "1f1b"}),  # stage 0 and the last stage hold a copy each
    # the last stage hands its hidden states to the chunked loss, which applies the head (its tied copy)
    "gpt2, tied, fused cross-entropy": ("gpt2", {"pipeline_schedule": "1f1b", "fused_cross_entropy": "true"}),
    "gpipe, fused cross-entropy": ("llama", {"pipeline_schedule": "gpipe", "fused_cross_entropy": "true"}),
}


@pytest.mark.slow
def test_one_step_gradients_equal_one_process_on_the_whole_batch(tiny_llama_dir, tiny_gpt2_dir, corpus_files, tmp_path):
    """2 processes, 2 stages (4 with interleaving), every schedule: the gradients after one optimizer step equal
    those of one process on the same rows (clipping applied to both by the global norm); with
    --fused_cross_entropy true the last stage's loss applies the head, and the reference takes the same loss."""
    dirs = {"llama": tiny_llama_dir, "gpt2": tiny_gpt2_dir}
    scenarios = [
        lm_options(dirs[model], corpus_files, tmp_path / f"run{i}", per_device_train_batch_size=8, **extra)
        for i, (model, extra) in enumerate(TWO_STAGES.values())
    ]
    for case, (ranks, ref), options in zip(
        TWO_STAGES, step_gradients(2, scenarios, tmp_path / "grads"), scenarios, strict=True
    ):
        max_norm = options.get("max_grad_norm", 1.0)  # the default clips
        if max_norm:  # the reference is not clipped: clip it the same way
            norm = torch.cat([g.flatten() for g in ref["grads"].values()]).norm()
            ref["grads"] = {n: g * min(1.0, max_norm / (float(norm) + 1e-6)) for n, g in ref["grads"].items()}
        assert_equal_to_one_process(ranks, ref, pp=2, case=case)
        fused = options.get("fused_cross_entropy") == "true"
        assert [r["head_in_loss"] for r in ranks] == [False, fused], case  # rank 1 holds the last stage


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.slow
def test_two_by_two_trains_like_one_process_saves_a_loadable_model_and_resumes_exactly_after_sigkill(
    tiny_gpt2_dir, corpus_files, tmp_path
):
    """GPT-2 (tied embeddings), 2 stages x 2 data-parallel pipelines, GPipe with clipping, against the BasicTrainer
    at the whole batch: the same losses, evaluation and weights. The model is saved in shards that
    from_pretrained loads, tied, equal to the stages' weights in the last checkpoint. A run killed after its
    mid-epoch checkpoint (SIGKILL inside the next save) resumes to bitwise the same final weights and losses."""

    def args(out: Path, *extra: str) -> list[str]:
        options = lm_options(
            tiny_gpt2_dir,
            corpus_files,
            out,
            per_device_train_batch_size=4,  # rows per pipeline: 8 per step
            max_steps=6,
            learning_rate=3e-3,
            logging_steps=1,
            eval_strategy="no",
            checkpointing_steps=3,
        )
        if "basic" not in extra:  # 1F1B's losses over several steps: tests/test_bench_pipeline.py
            options["pipeline_schedule"] = "gpipe"
        return [str(ENTRY), *(f"--{k}={v[0] if isinstance(v, list) else v}" for k, v in options.items()), *extra]

    pipe, one, resumed = tmp_path / "pipe", tmp_path / "one", tmp_path / "resumed"
    result = launch(torchrun(4), *args(pipe))
    assert "2 stages over 2 processes x 2 data-parallel" in result.stdout and "effective batch 8" in result.stdout
    launch([sys.executable], *args(one, "--training_type", "basic", "--per_device_train_batch_size", "8"))
    assert logged_losses(pipe) == pytest.approx(logged_losses(one), rel=1e-5)
    results = [json.loads((out / "eval_results.json").read_text()) for out in (pipe, one)]
    assert results[0]["perplexity"] == pytest.approx(results[1]["perplexity"], rel=1e-5)
    assert results[0]["tokens"] == results[1]["tokens"] and results[0]["samples"] == results[1]["samples"]

    trained, reference = saved_weights(pipe), saved_weights(one)
    assert set(trained) == set(reference)
    for name in trained:
        torch.testing.assert_close(trained[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(trained["lm_head.weight"], trained["transformer.wte.weight"])  # saved tied
    assert len(json.loads((pipe / "model.safetensors.index.json").read_text())["weight_map"]) == len(
        load_file(pipe / "model-00001-of-00002.safetensors")
    ) + len(load_file(pipe / "model-00002-of-00002.safetensors"))
    final = pipe / "checkpoints" / "checkpoint-6"
    stages = {**load_file(final / "pipeline-rank0.safetensors"), **load_file(final / "pipeline-rank1.safetensors")}
    assert set(stages) == set(trained) and all(torch.equal(trained[n], stages[n]) for n in stages)

    launch(torchrun(4), *args(resumed), kill_at="checkpoint.written:2")  # every process, inside the second save
    killed_at = complete_checkpoints(resumed / "checkpoints")[-1][0]
    assert killed_at == 3 and not (resumed / "model.safetensors.index.json").exists()
    again = launch(torchrun(4), *args(resumed, "--resume_from_checkpoint", "latest"))
    assert f"at step {killed_at} (loaded in" in again.stdout
    final_weights = saved_weights(resumed)
    assert all(torch.equal(final_weights[n], trained[n]) for n in trained), "resumed weights differ"
    assert {s: v for s, v in train_losses(resumed).items() if s > killed_at} == {
        s: v for s, v in train_losses(pipe).items() if s > killed_at
    }


def test_entry_help_lists_the_pipeline_options():
    result = subprocess.run([sys.executable, str(ENTRY), "--help"], capture_output=True, text=True, cwd=REPO)
    for flag in (
        "--pipeline_parallel_size",
        "--pipeline_schedule",
        "--pipeline_microbatches",
        "--pipeline_stages_per_rank",
        "--pipeline_split_points",
    ):
        assert flag in result.stdout
