"""--task causal_lm end to end on CPU with tiny random decoders: data, packing, loss normalisation, evaluation,
resume, generation, and every refusal."""

import json

import pytest
import torch
from conftest import assert_each_refused, lm_documents, run_cli
from safetensors.torch import load_file

from cloudtrain.config import build_config
from cloudtrain.observe.plotting import curve_data
from cloudtrain.observe.tracking import read_metrics
from cloudtrain.pipeline import build_run, run_training


@pytest.fixture
def corpus(tmp_path):
    """train.txt / validation.txt: one document per line, uneven lengths, one blank line."""
    files = {}
    for split, n, seed in (("train", 40, 0), ("validation", 8, 1)):
        files[split] = tmp_path / f"{split}.txt"
        docs = lm_documents(n, seed)
        files[split].write_text("\n".join(docs[:3] + [""] + docs[3:]) + "\n")
    return files


def lm_options(model_dir, corpus, out, **overrides) -> dict:
    return {
        "task": "causal_lm",
        "model_name_or_path": model_dir,
        "train_file": str(corpus["train"]),
        "validation_file": str(corpus["validation"]),
        "output_dir": str(out),
        "max_length": 32,
        "per_device_train_batch_size": 4,
        "max_steps": 4,
        "logging_steps": 2,
        "learning_rate": 1e-3,
        "mixed_precision": "no",
        "report_to": ["none"],
        **overrides,
    }


@pytest.mark.parametrize(
    "packing", ["wrapped", pytest.param("bfd", marks=pytest.mark.slow), pytest.param("none", marks=pytest.mark.slow)]
)
def test_a_run_trains_evaluates_and_saves(tiny_llama_dir, corpus, tmp_path, packing, capsys):
    out = tmp_path / "run"
    results = run_training(
        build_config(lm_options(tiny_llama_dir, corpus, out, packing=packing, sample_max_new_tokens=5))
    )
    assert results["eval"]["perplexity"] == pytest.approx(torch.tensor(results["eval"]["loss"]).exp().item())
    assert len(results["eval"]["generations"]) == 3
    saved = json.loads((out / "eval_results.json").read_text())
    assert saved["tokens"] == results["eval"]["tokens"] > 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    printed = capsys.readouterr().out
    assert f"packing {packing}" in printed and "perplexity" in printed and " -> " in printed
    curves = curve_data(read_metrics(out / "metrics.jsonl"))
    assert (out / "training_curves.png").is_file() and "eval/perplexity" in curves["perplexity"]


@pytest.mark.slow
def test_an_evaluation_cut_short_by_a_signal_generates_no_samples(tiny_llama_dir, corpus, tmp_path):
    """Its numbers are meaningless and a reclaim's grace period short: the samples are skipped, not generated."""
    run = build_run(build_config(lm_options(tiny_llama_dir, corpus, tmp_path / "out", num_sample_prompts=2)))
    run.trainer.setup()
    whole = run.trainer.evaluate("validation", stop=lambda: False)
    assert len(whole["generations"]) == 2
    cut = run.trainer.evaluate("validation", stop=lambda: True)
    assert cut["tokens"] > 0 and "generations" not in cut


def test_token_level_accumulation_equals_one_big_batch(tiny_llama_dir, corpus, tmp_path):
    """3 micro-batches of uneven token counts give the update of one batch holding all of them; averaging
    per-micro-batch means (the classic mistake) would not."""
    updates, losses = [], []
    for k, sizes in ((3, [2, 3, 1]), (1, [6])):
        run = build_run(
            build_config(
                lm_options(
                    tiny_llama_dir,
                    corpus,
                    tmp_path / f"k{k}",
                    packing="none",
                    max_length=128,
                    gradient_accumulation_steps=k,
                    max_grad_norm=0,
                    training_type="basic",
                )
            )
        )
        trainer = run.trainer
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
        trainer.setup()
        rows = [run.data.train[i] for i in range(6)]
        window, start = [], 0
        for size in sizes:
            window.append(trainer.move(run.data.collator(rows[start : start + size])))
            start += size
        counts = [int(run.task.loss_count(batch)) for batch in window]
        stats = trainer.backward_window(window, trainer._loss_scale(window))
        losses.append(float(stats.loss_sum / stats.count))
        updates.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        if k == 3:
            assert len(set(counts)) == 3  # the micro-batches really are uneven
            per_batch_means = (
                sum(run.task.loss(trainer.model, b)[0] / n for b, n in zip(window, counts, strict=True)) / 3
            )
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert float(per_batch_means) != pytest.approx(losses[1], rel=2e-5)  # the negative control: off by ~2e-4
    for name, grad in updates[1].items():
        torch.testing.assert_close(updates[0][name], grad, rtol=1e-4, atol=1e-6)


def test_exact_resume_mid_epoch_with_packing(tiny_llama_dir, corpus, tmp_path):
    """A run resumed from its step-5 checkpoint ends with the weights of the run that never stopped."""
    options = lm_options(
        tiny_llama_dir,
        corpus,
        tmp_path / "run",
        packing="bfd",
        max_steps=8,
        checkpointing_steps="5",
        eval_strategy="no",
    )
    run_training(build_config(options))
    straight = load_file(tmp_path / "run" / "model.safetensors")
    steps_per_epoch = len(build_run(build_config({**options, "output_dir": str(tmp_path / "probe")})).trainer.train_dl)
    assert 5 % steps_per_epoch != 0  # mid-epoch
    run_training(
        build_config(
            {
                **options,
                "resume_from_checkpoint": str(tmp_path / "run/checkpoints/checkpoint-5"),
                "overwrite_output_dir": True,
            }
        )
    )
    resumed = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_pretraining_from_a_preset_is_seeded(lm_tokenizer_dir, corpus, tmp_path, capsys):
    options = {
        **lm_options(None, corpus, tmp_path / "a", max_steps=1, sample_prompts="Once upon"),
        "model_config": "llama-8m",
        "tokenizer_name_or_path": lm_tokenizer_dir,
    }
    del options["model_name_or_path"]
    first = build_run(build_config(options)).model
    second = build_run(build_config({**options, "output_dir": str(tmp_path / "b")})).model
    assert "built LlamaForCausalLM from llama-8m with random weights (seed 42)" in capsys.readouterr().out
    assert first.config.vocab_size % 64 == 0 and first.config.vocab_size >= 400
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )
    third = build_run(build_config({**options, "output_dir": str(tmp_path / "c"), "seed": 7})).model
    assert not torch.equal(first.lm_head.weight, third.lm_head.weight)


@pytest.fixture(scope="module")
def tiny_bloom_dir(tmp_path_factory, lm_tokenizer_dir) -> str:
    """A decoder whose forward takes no position_ids (ALiBi): it cannot keep packed documents apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BloomConfig

    config = BloomConfig(vocab_size=400, hidden_size=32, n_layer=2, n_head=2)
    out = tmp_path_factory.mktemp("tiny-bloom")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(lm_tokenizer_dir).save_pretrained(out)
    return str(out)


def bad_inputs(tmp_path, corpus, tiny_llama_dir, tiny_model_dir, tiny_bloom_dir, lm_tokenizer_dir) -> dict:
    """{case: (options, message)}: one line each, exit 2, nothing written."""
    no_text = tmp_path / "no_text.csv"
    no_text.write_text("body\nonce upon a time\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    base = lm_options(tiny_llama_dir, corpus, tmp_path / "out")
    return {
        "no text column": (
            {**base, "train_file": str(no_text), "validation_file": None},
            "column 'text' is not in the train data",
        ),
        "empty corpus": ({**base, "train_file": str(empty), "validation_file": None}, "has no text in column 'text'"),
        "an encoder": ({**base, "model_name_or_path": tiny_model_dir}, "is not a causal language model"),
        "bfd that cannot isolate": (
            {**base, "model_name_or_path": tiny_bloom_dir, "packing": "bfd"},
            "--packing bfd: BloomForCausalLM",
        ),
        "no model": ({**base, "model_name_or_path": None}, "--task causal_lm needs a decoder"),
        "config without tokenizer": (
            {**base, "model_name_or_path": None, "model_config": "llama-8m"},
            "--model_config needs --tokenizer_name_or_path",
        ),
        "unknown preset": (
            {
                **base,
                "model_name_or_path": None,
                "model_config": "llama-1t",
                "tokenizer_name_or_path": lm_tokenizer_dir,
            },
            "neither a config.json file nor a preset",
        ),
        "a classification metric": ({**base, "metric_for_best_model": "accuracy"}, "not a metric of --task causal_lm"),
        "context too short": ({**base, "max_length": 4096}, "longer than the model's context"),
        # past its 256 positions the first evaluation failed (learned positions) or ran on for minutes (audit)
        "samples too long": (
            {**base, "sample_prompts": "Once upon a time", "sample_max_new_tokens": 300},
            "and --sample_max_new_tokens 300 exceed the model's context (256 positions); pass "
            "--sample_max_new_tokens 249 or less",
        ),
    }


def test_every_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path, corpus, tiny_llama_dir, tiny_model_dir, tiny_bloom_dir, lm_tokenizer_dir, capsys
):
    cases = bad_inputs(tmp_path, corpus, tiny_llama_dir, tiny_model_dir, tiny_bloom_dir, lm_tokenizer_dir)
    assert_each_refused(cases, capsys, tmp_path / "out")


def test_a_row_longer_than_the_context_is_refused_before_the_data_is_read(
    tmp_path, corpus, tiny_llama_dir, tiny_model_dir, tiny_bloom_dir, lm_tokenizer_dir, capsys
):
    cases = bad_inputs(tmp_path, corpus, tiny_llama_dir, tiny_model_dir, tiny_bloom_dir, lm_tokenizer_dir)
    options, message = cases["context too short"]
    from cloudtrain.cli import main

    for task in ("causal_lm", "sft"):  # sft's check is causal_lm's
        argv = [
            f"--{k}={','.join(v) if isinstance(v, list) else v}"
            for k, v in {**options, "task": task}.items()
            if v is not None
        ]
        assert main(argv) == 2
        said = capsys.readouterr()
        assert len(said.err.strip().splitlines()) == 1 and message in said.err, said.err
        assert "data:" not in said.out and "Tokenizing" not in said.err, said  # nothing was read or tokenized


@pytest.mark.slow  # three fresh interpreters
def test_generate_on_a_saved_model(tiny_llama_dir, corpus, tmp_path):
    out = tmp_path / "run"
    run_training(build_config(lm_options(tiny_llama_dir, corpus, out, sample_max_new_tokens=3)))
    proc = run_cli("generate", "--model_dir", str(out), "--prompt", "Once upon a time", "--max_new_tokens", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Once upon a time" in proc.stdout and proc.stdout.strip() != "Once upon a time"
    bad = run_cli("generate", "--model_dir", str(tmp_path / "missing"), "--prompt", "x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    wrong = run_cli("predict", "--model_dir", str(out), "--text", "x")
    assert (
        wrong.returncode == 2
        and "nor a question-answering model; write texts with it through the generate" in wrong.stderr
    )


def test_a_gpt2_style_model_from_a_csv_with_bfd_packing(tiny_gpt2_dir, tmp_path):
    """GPT-2 (learned positions, tied head) from a csv with --text_column, packed bfd, the basic trainer."""
    import pandas as pd

    pd.DataFrame({"story": lm_documents(30, 3), "id": range(30)}).to_csv(tmp_path / "stories.csv", index=False)
    results = run_training(
        build_config(
            {
                "task": "causal_lm",
                "model_name_or_path": tiny_gpt2_dir,
                "train_file": str(tmp_path / "stories.csv"),
                "text_column": "story",
                "packing": "bfd",
                "max_length": 64,
                "max_steps": 3,
                "training_type": "basic",
                "mixed_precision": "no",
                "output_dir": str(tmp_path / "out"),
                "sample_prompts": "The wolf|Once",
                "sample_max_new_tokens": 3,
            }
        )
    )
    assert [g["prompt"] for g in results["eval"]["generations"]] == ["The wolf", "Once"]
    assert results["eval"]["tokens"] > 0 and results["train"]["global_step"] == 3


def test_a_config_file_takes_from_the_tokenizer_what_it_does_not_set(tiny_llama_dir, tmp_path):
    """A copy of the llama-8m preset given as a file built a 32,000-token model whose eos id was Llama's 2 (a quote
    in the run's tokenizer), where the preset takes both from the tokenizer (found in audit). What a file sets it
    keeps."""
    from transformers import AutoConfig, AutoTokenizer

    from cloudtrain.tasks.causal_lm import PRESETS_DIR, CausalLMTask

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    copy = tmp_path / "my-8m.json"
    copy.write_text((PRESETS_DIR / "llama-8m.json").read_text())
    config = AutoConfig.from_pretrained(copy)
    CausalLMTask.fit_config(config, tokenizer, str(copy))
    assert config.vocab_size == -(-len(tokenizer) // 64) * 64 and config.eos_token_id == tokenizer.eos_token_id
    own = tmp_path / "own.json"
    own.write_text(json.dumps({**json.loads(copy.read_text()), "vocab_size": 1000, "eos_token_id": 7}))
    config = AutoConfig.from_pretrained(own)
    CausalLMTask.fit_config(config, tokenizer, str(own))
    assert (config.vocab_size, config.eos_token_id, config.bos_token_id) == (1000, 7, tokenizer.bos_token_id)
