"""NEFTune (--neftune_noise_alpha, cloudtrain.models.embedding_noise): the noise's law, training mode only, through
the model-preparation path under adapters, an SFT run whose evaluation and saved model carry no noise, refusals."""

import json
import math

import pytest
import torch
from conftest import assert_each_refused
from test_sft import chats_file, sft_options  # noqa: F401 (a fixture)
from transformers import AutoModelForCausalLM

from cloudtrain.config import build_config
from cloudtrain.models import prepare
from cloudtrain.pipeline import run_training
from cloudtrain.registry import TASKS


def test_the_noise_is_uniform_at_alpha_over_sqrt_length_x_hidden_and_only_in_training(tiny_llama_dir):
    cfg = build_config({"task": "sft", "model_name_or_path": tiny_llama_dir, "train_file": "x.jsonl", "peft": "lora"})
    cfg.training.neftune_noise_alpha = 5.0
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ids = torch.randint(3, 100, (16, 50), generator=torch.Generator().manual_seed(0))
    plain = model.get_input_embeddings()(ids).detach()
    task = TASKS["sft"](cfg)
    model = prepare.prepare(model, cfg, task, start=prepare.adapters_for_task, stop=prepare.compile_model)
    assert type(model).__name__.startswith("Peft")  # the hook reaches the embeddings under the adapters
    embed = model.get_input_embeddings()
    noise = embed.train()(ids) - plain
    scale = 5.0 / math.sqrt(50 * model.config.hidden_size)
    assert noise.abs().max() <= scale * 1.0001 and noise.abs().max() > 0.95 * scale
    assert noise.abs().mean().item() == pytest.approx(scale / 2, rel=0.05)  # U(-s, s): mean |x| = s / 2
    assert noise.mean().abs() < 0.05 * scale
    assert not torch.equal(embed(ids), embed(ids))  # drawn anew on each forward
    assert torch.equal(embed.eval()(ids), plain)  # evaluation and generation: none


def test_an_sft_run_trains_with_noise_and_evaluates_and_saves_without_it(tiny_llama_dir, chats_file, tmp_path, capsys):  # noqa: F811
    # a learning rate too small to move any weight: what differs between the runs is the noise alone
    still = {"learning_rate": 1e-30, "eval_strategy": "no", "num_sample_prompts": 0}
    runs = {
        alpha: run_training(
            build_config(
                sft_options(tiny_llama_dir, chats_file, tmp_path / f"a{alpha}", **still, neftune_noise_alpha=alpha)
            )
        )
        for alpha in (0.0, 5.0)
    }
    assert "NEFTune: noise of alpha 5 on the input embeddings in training" in capsys.readouterr().out
    assert runs[5.0]["train"]["train_loss"] != runs[0.0]["train"]["train_loss"]  # the training forward had noise
    assert runs[5.0]["eval"]["loss"] == pytest.approx(runs[0.0]["eval"]["loss"], rel=1e-6)  # evaluation had none
    saved = {alpha: sorted(p.name for p in (tmp_path / f"a{alpha}").iterdir()) for alpha in runs}
    assert saved[5.0] == saved[0.0]
    assert json.loads((tmp_path / "a5.0" / "args.json").read_text())["neftune_noise_alpha"] == 5.0


def test_each_refusal_is_one_line(tiny_llama_dir, tiny_model_dir, chats_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    sft = sft_options(tiny_llama_dir, chats_file, out, report_to="none")
    cases = {
        "negative": ({**sft, "neftune_noise_alpha": "-1"}, "--neftune_noise_alpha must not be negative (0: off)"),
        "a reference shares the embeddings": (
            {**sft, "task": "dpo", "neftune_noise_alpha": "5"},
            "--neftune_noise_alpha applies to --task classification, causal_lm, sft, not --task dpo: drop it",
        ),
        "tensor parallel": (
            {**sft, "neftune_noise_alpha": "5", "tensor_parallel_size": "2"},
            "--neftune_noise_alpha does not run under --tensor_parallel_size or --context_parallel_size",
        ),
    }
    assert_each_refused(cases, capsys, out)
