"""NEFTune (--neftune_noise_alpha, cloudtrain.models.embedding_noise): the noise's law, training mode only, through
the model-preparation path under adapters, an SFT run whose evaluation and saved model carry no noise, refusals."""

import json
import math

import pytest
import torch
from conftest import assert_each_refused
from test_best_model import same_weights
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
    model.train()
    noise = embed(ids) - plain
    scale = 5.0 / math.sqrt(50 * model.config.hidden_size)
    assert noise.abs().max() <= scale * 1.0001 and noise.abs().max() > 0.95 * scale
    assert noise.abs().mean().item() == pytest.approx(scale / 2, rel=0.05)  # U(-s, s): mean |x| = s / 2
    assert noise.mean().abs() < 0.05 * scale
    assert not torch.equal(embed(ids), embed(ids))  # drawn anew on each forward
    model.eval()
    assert torch.equal(embed(ids), plain)  # evaluation and generation: none


def test_an_sft_run_trains_with_noise_and_evaluates_samples_and_saves_without_it(
    tiny_llama_dir,
    chats_file,  # noqa: F811
    tmp_path,
    capsys,
):
    # a learning rate too small to move any weight: what differs between the runs is the noise alone; an evaluation
    # with sample answers at step 2, between training steps
    still = {"learning_rate": 1e-30, "eval_strategy": "steps", "eval_steps": 2, "num_sample_prompts": 2}
    results = {
        alpha: run_training(
            build_config(
                sft_options(tiny_llama_dir, chats_file, tmp_path / f"a{alpha}", **still, neftune_noise_alpha=alpha)
            )
        )  # fmt: skip
        for alpha in (0.0, 5.0)
    }
    assert "NEFTune: noise of alpha 5 on the input embeddings in training" in capsys.readouterr().out
    logged = {alpha: logged_lines(tmp_path / f"a{alpha}") for alpha in (0.0, 5.0)}
    train = {a: [r["train/loss"] for r in lines if "train/loss" in r] for a, lines in logged.items()}
    assert len(train[5.0]) == 4 and all(n != p for n, p in zip(train[5.0], train[0.0], strict=True))  # step 3 too
    evaluated = {a: [r for r in lines if "eval/loss" in r] for a, lines in logged.items()}
    assert len(evaluated[5.0]) == 2 and evaluated[5.0] == evaluated[0.0]  # at step 2 and at the end: no noise
    answers = {a: results[a]["eval"]["generations"] for a in results}
    assert len(answers[5.0]) == 2 and answers[5.0] == answers[0.0]  # nor had the sample answers
    assert same_weights(tmp_path / "a0.0", tmp_path / "a5.0")  # the saved model is the weights alone
    assert json.loads((tmp_path / "a5.0" / "args.json").read_text())["neftune_noise_alpha"] == 5.0


def logged_lines(out) -> list[dict]:
    """metrics.jsonl's records without their clock readings (which differ between runs)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "time" not in k and "per_s" not in k and "runtime" not in k} for r in lines]


def test_each_refusal_is_one_line(tiny_llama_dir, tiny_model_dir, chats_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    sft = sft_options(tiny_llama_dir, chats_file, out, report_to="none")
    cases = {
        "negative": ({**sft, "neftune_noise_alpha": "-1"}, "--neftune_noise_alpha must not be negative (0: off)"),
        "preference pairs": (
            {**sft, "task": "dpo", "neftune_noise_alpha": "5"},
            "--neftune_noise_alpha applies to --task classification, multi_label, regression, token_classification, "
            "question_answering, causal_lm, sft, not --task dpo",
        ),
        "tensor parallel": (
            {**sft, "neftune_noise_alpha": "5", "tensor_parallel_size": "2"},
            "--neftune_noise_alpha does not run under --tensor_parallel_size or --context_parallel_size",
        ),
        "context parallel": (
            {**sft, "neftune_noise_alpha": "5", "context_parallel_size": "2"},
            "--neftune_noise_alpha does not run under --tensor_parallel_size or --context_parallel_size",
        ),
    }
    assert_each_refused(cases, capsys, out)
