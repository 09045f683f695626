"""--task causal_lm end to end on CPU with tiny random decoders: data, packing, loss normalisation, evaluation,
resume, generation, and every refusal."""

import json

import pytest
import torch

from cloudtrain.config import build_config
from cloudtrain.pipeline import build_run, run_training

from conftest import lm_documents, run_cli


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
    return {"task": "causal_lm", "model_name_or_path": model_dir, "train_file": str(corpus["train"]),
            "validation_file": str(corpus["validation"]), "output_dir": str(out), "max_length": 32,
            "per_device_train_batch_size": 4, "max_steps": 4, "logging_steps": 2, "learning_rate": 1e-3,
            "mixed_precision": "no", "report_to": ["none"], **overrides}


@pytest.mark.parametrize("packing", ["wrapped", "bfd", "none"])
def test_a_run_trains_evaluates_and_saves(tiny_llama_dir, corpus, tmp_path, packing, capsys):
    out = tmp_path / "run"
    results = run_training(build_config(lm_options(tiny_llama_dir, corpus, out, packing=packing,
                                                   sample_max_new_tokens=5)))
    assert results["eval"]["perplexity"] == pytest.approx(torch.tensor(results["eval"]["loss"]).exp().item())
    assert len(results["eval"]["generations"]) == 3
    saved = json.loads((out / "eval_results.json").read_text())
    assert saved["tokens"] == results["eval"]["tokens"] > 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    printed = capsys.readouterr().out
    assert f"packing {packing}" in printed and "perplexity" in printed and " -> " in printed
