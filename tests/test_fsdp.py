"""FSDP2 (torch's fully_shard through accelerate): the options, their refusals, and real launches.

On CPU the 2-process launches run on gloo, the same code path as on GPUs (cloudtrain.parallel.fsdp puts
accelerate in its FSDP mode there): full fine-tuning of a classifier and of a causal LM with bfd packing
against one process at twice the batch, the saved model against the last checkpoint's shards, resume from a
mid-run checkpoint through the shipped accelerate config, LoRA's adapter. The gpu-marked tests run the
same on CUDA (one process per GPU), and QLoRA, which needs bitsandbytes on CUDA.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    CUDA_AVAILABLE,
    ENTRY,
    REPO,
    SEQ2SEQ_WORDS,
    assert_each_refused,
    built_once,
    child_pythonpath,
    lm_documents,
    topic_rows,
    topic_run_args,
)
from safetensors.torch import load_file
from test_distributed import ONE_PROCESS, accelerate_launch, free_port, in_one_launch, launch, logged_losses

from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.parallel import fsdp
from cloudtrain.parallel.distributed import Sharding, sharding
from cloudtrain.parallel.fsdp import fsdp_settings, layer_classes, shard_degrees
from cloudtrain.parallel.mesh import Mesh
from cloudtrain.training.trainer import save_weights

FSDP_YAML = "configs/accelerate/fsdp.yaml"


# ---------------------------------------------------------------- options (in-process, fast)


def test_flags_reach_the_plugin(monkeypatch):
    from torch.distributed.fsdp import CPUOffloadPolicy

    for name in ("FSDP_SHARDING_STRATEGY", "FSDP_OFFLOAD_PARAMS", "FSDP_RESHARD_AFTER_FORWARD"):
        monkeypatch.delenv(name, raising=False)
    plugin = fsdp.build_plugin(build_config({"fsdp": True}))
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    plugin = fsdp.build_plugin(build_config({"fsdp": True, "fsdp_cpu_offload": True}))
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    plugin = fsdp.build_plugin(build_config({"fsdp": True, "fsdp_sharding_strategy": "shard_grad_op"}))
    assert plugin.reshard_after_forward is False  # shard_grad_op: gathered from forward to backward
    plugin = fsdp.build_plugin(build_config({"fsdp": True, "fsdp_reshard_after_forward": False}))
    assert plugin.reshard_after_forward is False


def test_an_accelerate_fsdp_config_fills_what_the_flags_left(monkeypatch):
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    settings = fsdp_settings(build_config({"fsdp": True}))
    assert settings == {"strategy": "shard_grad_op", "cpu_offload": True, "reshard_after_forward": False}
    given = fsdp_settings(build_config({"fsdp": True, "fsdp_sharding_strategy": "hybrid_shard"}))
    assert given["strategy"] == "hybrid_shard" and given["reshard_after_forward"] is True  # the flag wins
    from cloudtrain.config.distributed import DistributedConfig
    from cloudtrain.errors import UserError

    with pytest.raises(UserError, match="add --fsdp true"):
        DistributedConfig(fsdp_cpu_offload=True).check()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # the config turned FSDP on: its flags need no --fsdp
    DistributedConfig(fsdp_cpu_offload=True).check()
    assert fsdp_settings(build_config({"fsdp_cpu_offload": False}))["cpu_offload"] is True
    assert fsdp_settings(build_config({"fsdp_sharding_strategy": "hybrid_shard"}))["strategy"] == "hybrid_shard"


def test_sharding_strategies_give_the_data_parallel_mesh(monkeypatch):
    assert shard_degrees("full_shard", 16, 8) == (1, 16)
    assert shard_degrees("shard_grad_op", 16, 8) == (1, 16)
    assert shard_degrees("hybrid_shard", 16, 8) == (2, 8)  # sharded within a node, replicated across nodes
    assert shard_degrees("no_shard", 16, 8) == (16, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    hybrid = build_config({"fsdp": True, "fsdp_sharding_strategy": "hybrid_shard"})
    config = fsdp.parallelism(hybrid, 4)
    assert config is not None and (config.dp_replicate_size, config.dp_shard_size) == (2, 2)
    assert fsdp.mesh(hybrid, 4) == Mesh(world=4, dp_replicate=2, dp_shard=2)
    assert fsdp.parallelism(build_config({"fsdp": True}), 4) is None
    assert sharding(build_config({"fsdp": True})) == Sharding(fsdp=True)
    # no_shard keeps the whole model on every process: that is DDP, and runs as DDP; so does hybrid_shard with
    # one process per node
    assert sharding(build_config({"fsdp": True, "fsdp_sharding_strategy": "no_shard"})) == Sharding()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert sharding(hybrid) == Sharding() and sharding(build_config({"fsdp": True})) == Sharding(fsdp=True)


def test_the_sharded_units_are_the_repeated_layers_never_an_embedding_block(
    tiny_model_dir, tiny_llama_dir, tiny_gpt2_dir
):
    """BERT declares BertEmbeddings unsplittable too: sharded as a unit, its word embeddings would then be
    sharded a second time as the input embedding (accelerate's order), which fails."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    bert = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3)
    assert "BertEmbeddings" in bert._no_split_modules and layer_classes(bert) == ["BertLayer"]
    assert layer_classes(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)) == ["LlamaDecoderLayer"]
    assert layer_classes(AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)) == ["GPT2Block"]

    class Plain(torch.nn.Module):  # no _no_split_modules: the longest list's items
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(3))

    assert layer_classes(Plain()) == ["Sequential"]


def test_an_encoder_decoders_stacks_get_the_shared_embedding_module_itself(tiny_t5_dir, tiny_llama_dir, tmp_path):
    """T5 and BART hold their shared embedding as three modules tied by weight; FSDP2 needs a weight in one unit,
    so the encoder and the decoder are given the model's module: the same logits and state-dict names. A tied
    copy that computes differently (BART's scale) is refused; a decoder has nothing to replace."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    bart_config = dict(
        vocab_size=40,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        scale_embedding=True,
    )
    t5, bart = (
        AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir),
        BartForConditionalGeneration(BartConfig(**bart_config)),
    )
    ids, starts = torch.randint(3, 40, (2, 7)), torch.randint(3, 40, (2, 5))
    for model, stacks in ((t5.eval(), t5), (bart.eval(), bart.model)):  # eval: no dropout
        before, names = model(input_ids=ids, decoder_input_ids=starts).logits, set(model.state_dict())
        assert stacks.encoder.embed_tokens is not model.get_input_embeddings()
        assert fsdp.one_shared_embedding(model) == 2
        assert stacks.encoder.embed_tokens is stacks.decoder.embed_tokens is model.get_input_embeddings()
        assert torch.equal(model(input_ids=ids, decoder_input_ids=starts).logits, before)
        assert set(model.state_dict()) == names
    assert fsdp.one_shared_embedding(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)) == 0
    # an adapter's wrapper holds the embedding's weight in its own module (SFT's added chat tokens train it in
    # full): nothing to replace, nothing refused
    from peft import LoraConfig, get_peft_model

    for adapter in ({"modules_to_save": ["embed_tokens"]}, {"target_modules": ["embed_tokens", "q_proj"]}):
        wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), LoraConfig(r=2, **adapter))
        assert fsdp.one_shared_embedding(wrapped) == 0, adapter

    unscaled = BartForConditionalGeneration(BartConfig(**bart_config))
    unscaled.model.decoder.embed_tokens.embed_scale = 1.0
    with pytest.raises(
        UserError,
        match="--fsdp: BartForConditionalGeneration's model.decoder.embed_tokens shares the input embedding's "
        "weight but not its class, settings or hooks",
    ):
        fsdp.one_shared_embedding(unscaled)


def test_generation_after_a_training_step_gathers_the_root_unit(tiny_t5_dir, monkeypatch):
    """FSDP2 reshards the root unit (embedding, final norms) after backward; generation calls the encoder itself,
    not the root's forward whose hook would gather it, so the task gathers it around generate. One gloo process
    in this one: the code path of many."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForSeq2SeqLM

    from cloudtrain.tasks.seq2seq import Seq2SeqTask

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir)
        fsdp.one_shared_embedding(model)
        for block in (*model.encoder.block, *model.decoder.block):
            fully_shard(block)
        fully_shard(model)
        ids = torch.randint(3, 40, (2, 7))
        model(input_ids=ids, labels=ids[:, :4].contiguous()).loss.backward()
        task = Seq2SeqTask(build_config({"task": "seq2seq", "max_target_length": 4}))
        task.decoder_ids = (model.config.decoder_start_token_id, model.config.pad_token_id)
        assert task.generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}).shape == (2, 5)
        with pytest.raises(RuntimeError, match="DTensor"):  # what the task's gathering spares it
            model.generate(input_ids=ids, max_new_tokens=2)
    finally:
        dist.destroy_process_group()


def test_a_gathered_state_dict_saves_each_tied_weight_once(tiny_t5_dir, tmp_path):
    """FSDP and ZeRO-3 gather a tied weight as one copy per name: saved, the file holds the names a live model's
    save writes (T5: the shared embedding once), not three copies."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir)
    model.save_pretrained(tmp_path / "live")
    save_weights(model, tmp_path / "gathered", state_dict={k: v.clone() for k, v in model.state_dict().items()})
    live, gathered = (
        load_file(tmp_path / "live" / "model.safetensors"),
        load_file(tmp_path / "gathered" / "model.safetensors"),
    )
    assert gathered.keys() == live.keys() and "encoder.embed_tokens.weight" not in gathered
    assert all(torch.equal(gathered[name], live[name]) for name in live)


def test_qlora_under_fsdp_stores_the_4bit_base_in_the_compute_dtype(tiny_llama_dir, monkeypatch):
    """bitsandbytes needs CUDA to load: here the config the loader would pass is checked."""
    from transformers import AutoModelForCausalLM

    from cloudtrain.models import adapters

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    common = {"model_name_or_path": tiny_llama_dir, "peft": "qlora", "mixed_precision": "bf16", "task": "causal_lm"}
    sharded = adapters.load_options(build_config({**common, "fsdp": True}), AutoModelForCausalLM)
    assert sharded["quantization_config"].bnb_4bit_quant_storage == torch.bfloat16
    assert sharded["device_map"] == {"": 0}  # quantized on this process's GPU, then sharded
    plain = adapters.load_options(build_config(common), AutoModelForCausalLM)
    assert plain["quantization_config"].bnb_4bit_quant_storage == torch.uint8
    assert plain["device_map"] == {"": 0}


def test_each_refusal_is_one_line(capsys, tmp_path):
    out = tmp_path / "out"
    base = {"output_dir": str(out), "max_steps": 1}
    assert_each_refused(
        {
            "option without fsdp": ({**base, "fsdp_cpu_offload": "true"}, "is an FSDP option: add --fsdp true"),
            "strategy without fsdp": (
                {**base, "fsdp_sharding_strategy": "hybrid_shard"},
                "--fsdp_sharding_strategy is an FSDP option: add --fsdp true",
            ),
            "shard_grad_op resharding": (
                {
                    **base,
                    "fsdp": "true",
                    "fsdp_sharding_strategy": "shard_grad_op",
                    "fsdp_reshard_after_forward": "true",
                },
                "drop one of them (full_shard reshards)",
            ),
            "no_shard offload": (
                {**base, "fsdp": "true", "fsdp_sharding_strategy": "no_shard", "fsdp_cpu_offload": "true"},
                "use full_shard or hybrid_shard",
            ),
            "unknown strategy": ({**base, "fsdp": "true", "fsdp_sharding_strategy": "zero3"}, "zero3"),
            "with zero": ({**base, "fsdp": "true", "zero_stage": 2}, "choose one"),
            "no launcher": ({**base, "fsdp": "true"}, "FSDP needs a launcher to start its process group"),
        },
        capsys,
        out,
    )


# ---------------------------------------------------------------- launches


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", free_port()]


def launch_on_gpus(launcher: list[str], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Like test_distributed.launch, but the children see this suite's GPUs (the gpu fixture restored them)."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def grad_norms(out: Path) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [e["train/grad_norm"] for e in lines if "train/grad_norm" in e]


def checkpoint_model(folder: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The whole model as the sharded checkpoint holds it (each process wrote its shards with DCP)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / f"{folder.name}-{folder.parent.parent.name}.pt"
    dcp_to_torch_save(folder / "pytorch_model_fsdp_0", whole)
    return torch.load(whole, weights_only=False)["model"]


def assert_saved_is_the_trained(saved: dict, trained: dict, prefix: str = "") -> None:
    """Every saved tensor is the one the final checkpoint holds, bit for bit."""
    for name, tensor in saved.items():
        assert torch.equal(tensor.float(), trained[prefix + name].float()), name


def classification_args(model_dir, csvs, out, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        *topic_run_args(model_dir, csvs, out),
        "--training_type", "accelerated", "--eval_strategy", "no", "--learning_rate", "1e-2",
        "--warmup_ratio", "0", "--logging_steps", "1", "--max_steps", "6", "--checkpointing_steps", "3",
        "--mixed_precision", "no", *extra,
    ]  # fmt: skip


def lm_args(model_dir: str, corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(ENTRY),
        "--task", "causal_lm", "--model_name_or_path", model_dir, "--train_file", str(corpus / "train.txt"),
        "--output_dir", str(out), "--max_length", "48", "--learning_rate", "3e-3", "--logging_steps", "1",
        "--sample_max_new_tokens", "4", "--eval_strategy", "no", "--packing", "bfd", "--max_steps", "4",
        "--checkpointing_steps", "2", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-corpus")
    (folder / "train.txt").write_text("\n".join(lm_documents(64, 0)) + "\n")
    return folder


def load_classifier(folder: Path):
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info  # no weight newly initialised
    return model


def t5_args(model: str, train: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(ENTRY), "--task", "seq2seq", "--model_name_or_path", model, "--max_target_length", "8",
        "--train_file", str(train), "--report_to", "none", "--output_dir", str(out),
        "--max_steps", "4", "--learning_rate", "1e-2", "--logging_steps", "1", "--mixed_precision", "no", *extra,
    ]  # fmt: skip


FSDP, FOUR, EIGHT = ("--fsdp", "true"), ("--per_device_train_batch_size", "4"), ("--per_device_train_batch_size", "8")
GPT2_SHARDED = ["--fsdp", "true", "--fsdp_cpu_offload", "true", "--gradient_checkpointing", "true"]
# in bf16: the frozen base in bf16 beside fp32 adapters in each unit, gathered in bf16 (the GPU set-up)
ADAPTERS = ["--peft", "lora", "--lora_r", "4", "--learning_rate", "1e-2", "--mixed_precision", "bf16"]


def lora_args(model_dir: str, corpus: Path, out: Path, *extra: str) -> list[str]:
    return lm_args(model_dir, corpus, out, "--per_device_train_batch_size", "2", "--fsdp", "true", *ADAPTERS, *extra)


@pytest.fixture(scope="module")
def inputs(tiny_t5_dir, tmp_path_factory) -> Path:
    """The launches' data, built once for both of `make test`'s workers: the topic task's csvs (topics/), a
    FLAN-shaped T5 (flan/) and its headlines (headlines.jsonl: a text and its first four words)."""

    def build(root: Path) -> None:
        import pandas as pd

        (root / "topics").mkdir()
        for split, n, offset in (("train", 20, 0), ("validation", 4, 1), ("test", 4, 2)):
            pd.DataFrame(topic_rows(n, offset)).to_csv(root / "topics" / f"{split}.csv", index=False)
        flan_shaped_t5(tiny_t5_dir, root / "flan")
        rng = random.Random(0)
        texts = [" ".join(rng.choices(SEQ2SEQ_WORDS, k=rng.randint(5, 9))) for _ in range(64)]
        rows = "".join(json.dumps({"document": text, "summary": " ".join(text.split()[:4])}) + "\n" for text in texts)
        (root / "headlines.jsonl").write_text(rows)

    return built_once(tmp_path_factory, "fsdp-inputs", build)


def topics(inputs: Path) -> dict[str, Path]:
    return {split: inputs / "topics" / f"{split}.csv" for split in ("train", "validation", "test")}


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tiny_gpt2_dir, corpus, inputs, tmp_path_factory) -> Path:
    """The one-process runs the FSDP2 runs must equal, one after another in one plain process (a launch's start
    costs more than these tiny runs), built once for both of `make test`'s workers: "classifier" (8 rows),
    "gpt2" (causal LM, 4 rows), "t5" (the FLAN-shaped T5, 8 rows). Their folder."""

    def build(root: Path) -> None:
        runs = {
            "classifier": classification_args(tiny_model_dir, topics(inputs), root / "classifier", *EIGHT),
            "gpt2": lm_args(tiny_gpt2_dir, corpus, root / "gpt2", "--per_device_train_batch_size", "4"),
            "t5": t5_args(str(inputs / "flan"), inputs / "headlines.jsonl", root / "t5", *EIGHT),
        }
        in_one_launch(ONE_PROCESS, runs, root)

    return built_once(tmp_path_factory, "fsdp-one-process", build)


@pytest.fixture(scope="module")
def fsdp2_runs(tiny_model_dir, tiny_gpt2_dir, tiny_llama_dir, corpus, inputs, tmp_path_factory) -> Path:
    """The uninterrupted FSDP2 runs on 2 processes, one after another in one launch (a launch's start costs more
    than these few-step runs; each run's accelerate flags are undone at its end), built once for both of `make
    test`'s workers: "classifier" (4 rows), "gpt2" (1 row x 2 micro-batches, CPU offload, gradient
    checkpointing), "lora" (LoRA on the Llama in bf16), "t5" (4 rows). The resume tests resume copies of their
    runs' folders. Each run's folder and its stdout <name>.out."""

    def build(root: Path) -> None:
        runs = {
            "classifier": classification_args(tiny_model_dir, topics(inputs), root / "classifier", *FOUR, *FSDP),
            "gpt2": lm_args(
                tiny_gpt2_dir,
                corpus,
                root / "gpt2",
                "--per_device_train_batch_size",
                "1",
                "--gradient_accumulation_steps",
                "2",
                *GPT2_SHARDED,
            ),  # fmt: skip
            "lora": lora_args(tiny_llama_dir, corpus, root / "lora"),
            "t5": t5_args(str(inputs / "flan"), inputs / "headlines.jsonl", root / "t5", *FOUR, *FSDP),
        }
        for name, stdout in in_one_launch(torchrun(2), runs, root).items():
            (root / f"{name}.out").write_text(stdout)

    return built_once(tmp_path_factory, "fsdp2-runs", build)


@pytest.mark.slow
def test_fsdp2_classifier_matches_one_process_saves_every_weight_and_resumes(
    tiny_model_dir, inputs, one_process, fsdp2_runs, tmp_path
):
    """2 FSDP2 processes x 4 rows give the steps of 1 process x 8 rows; the saved model loads with every
    weight from its file and is the last checkpoint's; resumed at step 3 through `accelerate launch` with the
    shipped FSDP config, the run ends with the same losses and weights. (The runs are fsdp2_runs's and
    one_process's "classifier", the 2-process one copied here: the resume rewrites its folder.)"""
    two, one = tmp_path / "two", one_process / "classifier"
    shutil.copytree(fsdp2_runs / "classifier", two)
    result = (fsdp2_runs / "classifier.out").read_text()
    assert "2 process(es) on cpu (FSDP2, precision no)" in result
    assert logged_losses(two) == pytest.approx(logged_losses(one), rel=1e-5)
    assert grad_norms(two) == pytest.approx(grad_norms(one), rel=1e-4)
    saved, reference = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert saved.keys() == reference.keys()
    for name in saved:
        torch.testing.assert_close(saved[name], reference[name], rtol=1e-3, atol=1e-5)
    whole = sum(t.numel() for t in saved.values())  # the announcement counts the whole model, not a shard (review)
    assert f"training rows, {whole / 1e6:.1f}M parameters, 2 process(es)" in result
    load_classifier(two)
    assert_saved_is_the_trained(saved, checkpoint_model(two / "checkpoints" / "checkpoint-6", tmp_path))

    losses = logged_losses(two)
    resumed = launch(
        accelerate_launch(FSDP_YAML, 2),
        *classification_args(tiny_model_dir, topics(inputs), two, "--per_device_train_batch_size", "4",
                             "--overwrite_output_dir", "true", "--resume_from_checkpoint",
                             str(two / "checkpoints" / "checkpoint-3")),
    )  # fmt: skip
    assert "at step 3" in resumed.stdout and "(FSDP2, precision no)" in resumed.stdout
    assert logged_losses(two) == pytest.approx(losses, rel=1e-6)
    again = load_file(two / "model.safetensors")
    for name in saved:
        torch.testing.assert_close(again[name], saved[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_fsdp2_causal_lm_with_bfd_packing_and_a_lora_adapter(tiny_llama_dir, corpus, one_process, fsdp2_runs, tmp_path):
    """Full fine-tuning of a decoder with tied embeddings (GPT-2) with bfd packing, CPU offload, gradient
    checkpointing and accumulation: 2 FSDP2 processes x 1 row x 2 micro-batches match 1 process x 4 rows (the
    loss is normalised by the global token count); then LoRA on a Llama under FSDP2 in bf16 saves an adapter that
    loads onto the base and holds the trained adapter weights, and resumes from its mid-run checkpoint exactly.
    (The runs are fsdp2_runs's and one_process's "gpt2" and fsdp2_runs's "lora", copied here: the resume rewrites
    its folder.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    two, one, lora = fsdp2_runs / "gpt2", one_process / "gpt2", tmp_path / "lora"
    assert logged_losses(two) == pytest.approx(logged_losses(one), rel=1e-4)
    saved = load_file(two / "model.safetensors")
    assert saved.keys() == load_file(one / "model.safetensors").keys()  # the tied head's weight once
    model, info = AutoModelForCausalLM.from_pretrained(two, output_loading_info=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert_saved_is_the_trained(saved, checkpoint_model(two / "checkpoints" / "checkpoint-4", tmp_path))

    shutil.copytree(fsdp2_runs / "lora", lora)
    adapter, losses = load_file(lora / "adapter_model.safetensors"), logged_losses(lora)
    assert adapter and any("lora_B" in name and tensor.abs().sum() > 0 for name, tensor in adapter.items())
    trained = checkpoint_model(lora / "checkpoints" / "checkpoint-4", tmp_path)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), lora)
    state = loaded.state_dict()
    for name, tensor in adapter.items():  # PEFT's file names drop the adapter's name ("default")
        full = name.replace(".weight", ".default.weight")
        assert torch.equal(state[full], tensor) and torch.equal(trained[full], tensor), name

    resume = ["--overwrite_output_dir", "true", "--resume_from_checkpoint", str(lora / "checkpoints" / "checkpoint-2")]
    assert "at step 2" in launch(torchrun(2), *lora_args(tiny_llama_dir, corpus, lora, *resume)).stdout
    assert logged_losses(lora) == losses  # the same curve, bit for bit
    again = load_file(lora / "adapter_model.safetensors")
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)


def flan_shaped_t5(t5_dir: str, out: Path) -> str:
    """`t5_dir` as a FLAN-T5 checkpoint is: a gated MLP, and an LM head of its own beside the shared embedding
    (transformers 5 loads it untied), so under FSDP2 the encoder and decoder share a unit the head is not in."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    config = json.loads((Path(t5_dir) / "config.json").read_text())
    out.mkdir()
    for name in os.listdir(t5_dir):
        if name != "model.safetensors":
            (out / name).write_bytes((Path(t5_dir) / name).read_bytes())
    (out / "config.json").write_text(
        json.dumps({**config, "tie_word_embeddings": False, "feed_forward_proj": "gated-gelu"})
    )
    torch.manual_seed(0)
    state = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(out)).state_dict()
    weights = {name: t.clone() for name, t in state.items() if ".embed_tokens." not in name}
    weights["lm_head.weight"] = torch.randn_like(weights["shared.weight"])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.mark.slow
def test_fsdp2_encoder_decoder_matches_one_process_and_saves_each_weight_once(one_process, fsdp2_runs):
    """A FLAN-shaped T5 (the shared embedding read by both stacks, the head apart): 2 FSDP2 processes x 4 rows
    give the losses of 1 process x 8 rows and save the same file, each weight once, that loads with every weight
    from it; the evaluation's generations run on both processes. (The runs are fsdp2_runs's and one_process's
    "t5".)"""
    from transformers import AutoModelForSeq2SeqLM

    two, one = fsdp2_runs / "t5", one_process / "t5"
    assert "2 process(es) on cpu (FSDP2, precision no)" in (fsdp2_runs / "t5.out").read_text()
    assert logged_losses(two) == pytest.approx(logged_losses(one), rel=1e-5)
    saved, reference = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert saved.keys() == reference.keys() and "encoder.embed_tokens.weight" not in saved
    for name in saved:
        torch.testing.assert_close(saved[name], reference[name], rtol=1e-3, atol=1e-5)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(two, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert loaded.lm_head.weight is not loaded.shared.weight  # the head stayed its own
    evaluated = [json.loads((run / "eval_results.json").read_text()) for run in (two, one)]
    assert evaluated[0]["samples"] == evaluated[1]["samples"] > 0
    assert evaluated[0]["loss"] == pytest.approx(evaluated[1]["loss"], rel=1e-4)


# ---------------------------------------------------------------- the same on CUDA


def gpu_processes() -> int:
    return min(torch.cuda.device_count(), 2) if CUDA_AVAILABLE else 1


def runs_on(n: int, precision: str = "bf16") -> str:
    """The trainer's announcement of an FSDP run on `n` GPUs."""
    return f"{n} process(es) on cuda (FSDP2, precision {precision})"


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["torchrun", "accelerate launch"])
def test_fsdp2_on_gpus_trains_saves_reloads_and_resumes(how, tiny_model_dir, topic_csvs, tmp_path):
    n, out = gpu_processes(), tmp_path / "out"
    launcher = torchrun(n) if how == "torchrun" else accelerate_launch(FSDP_YAML, n)
    flags = ["--fsdp", "true"] if how == "torchrun" else []
    args = classification_args(tiny_model_dir, topic_csvs, out, "--per_device_train_batch_size", "4",
                               "--mixed_precision", "bf16", *flags)  # fmt: skip
    result = launch_on_gpus(launcher, *args)
    assert runs_on(n) in result.stdout
    load_classifier(out)
    saved, losses = load_file(out / "model.safetensors"), logged_losses(out)
    assert_saved_is_the_trained(saved, checkpoint_model(out / "checkpoints" / "checkpoint-6", tmp_path))
    resume = ["--overwrite_output_dir", "true", "--resume_from_checkpoint", str(out / "checkpoints" / "checkpoint-3")]
    resumed = launch_on_gpus(launcher, *args, *resume)
    assert "at step 3" in resumed.stdout
    assert logged_losses(out) == pytest.approx(losses, rel=1e-3)


@pytest.mark.gpu
def test_causal_lm_under_fsdp2_on_gpus_with_bfd_packing(tiny_gpt2_dir, corpus, tmp_path):
    """Full fine-tuning of a decoder with tied embeddings in bf16 with bfd packing: trains, saves the model that
    the last checkpoint holds (loading with every weight from its file), resumes with the same losses."""
    from transformers import AutoModelForCausalLM

    n, out = gpu_processes(), tmp_path / "lm"
    args = lm_args(tiny_gpt2_dir, corpus, out, "--per_device_train_batch_size", "2", "--fsdp", "true",
                   "--mixed_precision", "bf16")  # fmt: skip
    assert runs_on(n) in launch_on_gpus(torchrun(n), *args).stdout
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    saved, losses = load_file(out / "model.safetensors"), logged_losses(out)
    assert_saved_is_the_trained(saved, checkpoint_model(out / "checkpoints" / "checkpoint-4", tmp_path))
    resume = ["--overwrite_output_dir", "true", "--resume_from_checkpoint", str(out / "checkpoints" / "checkpoint-2")]
    assert "at step 2" in launch_on_gpus(torchrun(n), *args, *resume).stdout
    assert logged_losses(out) == pytest.approx(losses, rel=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("peft", ["lora", "dora", "qlora"])
def test_adapters_under_fsdp2_on_gpus(peft, tiny_llama_dir, corpus, tmp_path):
    """LoRA, DoRA and QLoRA (4-bit base stored in bf16, so it is sharded) on a causal LM with bfd packing:
    trains, saves an adapter that loads, resumes from its mid-run checkpoint with the same losses."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    n, out = gpu_processes(), tmp_path / peft
    args = lm_args(tiny_llama_dir, corpus, out, "--per_device_train_batch_size", "2", "--fsdp", "true",
                   "--peft", peft, "--lora_r", "4", "--mixed_precision", "bf16")  # fmt: skip
    result = launch_on_gpus(torchrun(n), *args)
    assert runs_on(n) in result.stdout
    adapter, losses = load_file(out / "adapter_model.safetensors"), logged_losses(out)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), out)
    as_saved = get_peft_model_state_dict(loaded)  # the adapter's weights under the file's names
    assert as_saved.keys() == adapter.keys()
    assert all(torch.equal(as_saved[name].to(tensor.dtype).cpu(), tensor) for name, tensor in adapter.items())
    resume = ["--overwrite_output_dir", "true", "--resume_from_checkpoint", str(out / "checkpoints" / "checkpoint-2")]
    resumed = launch_on_gpus(torchrun(n), *args, *resume)
    assert "at step 2" in resumed.stdout
    assert logged_losses(out) == pytest.approx(losses, rel=1e-3)
