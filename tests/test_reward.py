"""--task reward on CPU: the Bradley-Terry loss against its formula, a short run on a tiny encoder that learns to
rank the chosen answer higher and saves a one-output model that `predict` loads, and the refusals."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_each_refused
from test_preference import lora_output
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from cloudtrain.config import build_config
from cloudtrain.errors import UserError
from cloudtrain.pipeline import run_training
from cloudtrain.predict import predict
from cloudtrain.tasks.reward import bradley_terry

# The chosen answers name a topic; the rejected ones dodge the question (a tiny random encoder learns this in
# a few dozen steps).
PAIRS = [
    ("Which topic: the team won the match?", "sports", "no idea"),
    ("Which topic: shares fell on weak earnings?", "finance", "who knows"),
    ("Which topic: a storm hit the coast?", "weather", "no idea"),
    ("Which topic: the striker scored twice?", "sports", "who knows"),
    ("Which topic: the bank raised interest rates?", "finance", "no idea"),
    ("Which topic: snow closed the mountain roads?", "weather", "who knows"),
]


def write_pairs(path, margin: bool = True) -> str:
    rows = [{"prompt": q, "chosen": c, "rejected": r, **({"margin": 0.5} if margin else {})} for q, c, r in PAIRS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_bradley_terry_loss_with_its_margin():
    chosen, rejected, margin = [1.5, -0.2, 0.3], [0.5, 0.4, 0.3], [0.0, 1.0, 0.25]
    expected = [-math.log(1 / (1 + math.exp(-(c - r - m)))) for c, r, m in zip(chosen, rejected, margin, strict=True)]
    got = bradley_terry(*(torch.tensor(v, dtype=torch.float64) for v in (chosen, rejected, margin)))
    assert got.tolist() == pytest.approx(expected, rel=1e-12)


def test_a_reward_model_learns_to_rank_and_predict_scores_it(tiny_model_dir, tmp_path):
    data, out = write_pairs(tmp_path / "pairs.jsonl"), tmp_path / "out"
    options = {
        "task": "reward", "model_name_or_path": tiny_model_dir, "train_file": data, "validation_file": data,
        "output_dir": str(out), "margin_column": "margin", "max_length": 32, "per_device_train_batch_size": 6,
        "max_steps": 40, "learning_rate": 1e-2, "warmup_ratio": 0.0, "mixed_precision": "no", "report_to": "none",
        "eval_strategy": "no", "logging_steps": 10,
    }  # fmt: skip
    results = run_training(build_config(options))
    assert results["eval"]["samples"] == len(PAIRS) and results["eval"]["accuracy"] == 1.0
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        for question, chosen, rejected in PAIRS:
            scores = model(**tokenizer([question] * 2, [chosen, rejected], return_tensors="pt", padding=True)).logits
            assert scores[0, 0] > scores[1, 0] + 0.5  # the margin was learned too
    assert [r["label"] for r in predict(str(out), ["the team won the match"])] == ["reward"]


def test_bad_reward_input_is_refused(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    equal = tmp_path / "equal.jsonl"
    equal.write_text("".join(json.dumps({"prompt": "Q?", "chosen": "x", "rejected": "x"}) + "\n" for _ in range(4)))
    base = {"task": "reward", "model_name_or_path": tiny_model_dir, "output_dir": str(out), "report_to": "none"}
    cases = {
        "missing margin column": (
            {**base, "train_file": write_pairs(tmp_path / "plain.jsonl", margin=False), "margin_column": "margin"},
            "column 'margin' is not in the train data",
        ),
        "chosen equals rejected": (  # counted from 1, the file named (found in audit: "train pair 0")
            {**base, "train_file": str(equal)},
            f"train pair 1 (the 1st record of {equal}): its chosen and rejected answers are equal",
        ),
        "an SFT LoRA output": (  # found in audit: transformers' own "Unrecognized model ..."
            {**base, "train_file": str(equal), "model_name_or_path": lora_output(tmp_path, tiny_model_dir)},
            "holds an adapter, not a model: give its merge with the base (cloudtrain merge --model_dir",
        ),
    }
    for name, bad in (("nan margin", float("nan")), ("no margin", None)):  # NaN made the loss blame the rate
        rows = [json.loads(line) for line in Path(write_pairs(tmp_path / "m.jsonl")).read_text().splitlines()]
        rows[2]["margin"] = bad
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        cases[name] = (
            {**base, "train_file": str(path), "margin_column": "margin"},
            f"1 of {len(rows)} train pairs have no finite --margin_column 'margin' value (the first: train pair 3 "
            f"(the 3rd record of {path}), {bad!r})",
        )
    assert_each_refused(cases, capsys, out)


def test_a_decoder_without_a_chat_template_reads_its_pairs_through_chatml(tiny_llama_dir, tmp_path):
    """A decoder's tokenizer has no separator: read as a text pair, the prompt and the answer were glued into one
    text ("...the frogThe frog lived"), in training and in predict (found in audit). It reads them as dpo does."""
    from datasets import load_dataset

    from cloudtrain.tasks import build_task

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tokenizer.chat_template is None and tokenizer.sep_token is None
    cfg = build_config({"task": "reward", "model_name_or_path": tiny_llama_dir, "max_length": 64})
    task = build_task(cfg)
    raw = load_dataset("json", data_files={"train": write_pairs(tmp_path / "pairs.jsonl")})
    data = task.process(raw, tokenizer, cfg)
    chosen = tokenizer.decode(data.train[0]["chosen_ids"])
    assert task.chat is not None and chosen.count("<|im_start|>") == 2 and "<|im_end|>" in chosen


def test_a_reward_model_reads_implicit_string_pairs_as_their_plain_text(tiny_llama_dir, tmp_path):
    """Found in audit: an implicit-prompt pair of strings was split into a user message and an assistant message
    under the chat template; it is read as the text it is, as --task dpo reads it (no EOS: the score is read where
    the text ends)."""
    from datasets import Dataset, DatasetDict

    from cloudtrain.tasks import build_task

    rows = [{"chosen": f"Which topic: {q} {c}", "rejected": f"Which topic: {q} {r}"} for q, c, r in PAIRS]
    raw = DatasetDict({"train": Dataset.from_list(rows), "validation": Dataset.from_list(rows)})
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = build_config({"task": "reward", "model_name_or_path": tiny_llama_dir, "max_length": 64})
    task = build_task(cfg)
    data = task.process(raw, tokenizer, cfg)
    assert [tokenizer.decode(data.validation[i]["chosen_ids"]) for i in range(len(rows))] == [
        row["chosen"] for row in rows
    ]
    assert "plain text" in task.describe_data(data)
    # the model's input is one whole text, as each side was
    assert task.inference_hint("out").endswith('predict --model_dir out --text "<prompt and answer, as one text>"')


def test_pairs_the_cut_makes_equal_are_dropped_and_counted_among_those_used(tiny_model_dir, tmp_path):
    """Found in audit: answers differing only past --max_length trained at a constant log 2 with no gradient and no
    note, and the drops were counted over the whole file, not the --max_train_samples pairs used."""
    from datasets import Dataset, DatasetDict

    from cloudtrain.tasks import build_task

    tail = " ".join(["and the answer goes on"] * 8)
    late = [{"prompt": "Which topic?", "chosen": f"{tail} sports", "rejected": f"{tail} weather"}] * 3
    rows = [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in PAIRS[:2]] + late
    raw = DatasetDict({"train": Dataset.from_list(rows), "validation": Dataset.from_list(rows[:2])})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = {"task": "reward", "model_name_or_path": tiny_model_dir, "max_length": 24, "output_dir": str(tmp_path)}
    for samples, dropped in ((2, 0), (5, 3)):
        cfg = build_config({**base, "max_train_samples": samples})
        task = build_task(cfg)
        data = task.process(raw, tokenizer, cfg)
        assert len(data.train) == 2 and task.report["train"] == {"pairs": samples, "dropped": dropped}
        said = task.describe_data(data)
        assert ("note: 3 train pairs dropped" in said) == bool(dropped), said
    with pytest.raises(UserError, match="^all 3 train pairs lose an answer, or all that tells their answers apart"):
        task.process(DatasetDict({"train": Dataset.from_list(late), "validation": raw["validation"]}), tokenizer, cfg)


@pytest.mark.parametrize("own_pad", [False, True], ids=["no pad id in its config", "a pad id of its own"])
def test_predict_renders_a_chat_template_reward_model_s_prompt_and_answer_as_training_did(
    own_pad, tiny_llama_dir, tmp_path, capsys
):
    """A decoder reward model trained through chatml: `predict --text PROMPT --text_pair ANSWER` scores the pair
    rendered through the saved template, so its scores reproduce the run's own evaluation (it scored the raw text
    before); a lone --text is refused in one line, as it is for an encoder reward model. A checkpoint whose config
    names a pad id beside a tokenizer padding with EOS (older Llamas) read each row's reward on its padding, so the
    scores hung on the batch's widths and predict disagreed (found in audit)."""
    from cloudtrain.cli import main

    model = tiny_llama_dir
    if own_pad:
        model = str(tmp_path / "llama-with-pad")
        shutil.copytree(tiny_llama_dir, model)
        config = json.loads((Path(model) / "config.json").read_text())
        (Path(model) / "config.json").write_text(json.dumps({**config, "pad_token_id": 5}))
    data, out = write_pairs(tmp_path / "pairs.jsonl"), tmp_path / "out"
    options = {
        "task": "reward", "model_name_or_path": model, "train_file": data, "validation_file": data,
        "output_dir": str(out), "chat_template": "chatml", "max_length": 48, "per_device_train_batch_size": 6,
        "max_steps": 4, "learning_rate": 1e-2, "mixed_precision": "no", "report_to": "none", "eval_strategy": "no",
    }  # fmt: skip
    evaluation = run_training(build_config(options))["eval"]
    if own_pad:  # one row per batch: no padding at all
        alone = run_training(build_config({**options, "per_device_eval_batch_size": 1, "output_dir": str(out) + "-1"}))
        assert alone["eval"]["margin"] == pytest.approx(evaluation["margin"], abs=1e-5)
    capsys.readouterr()
    scores = {}
    for side, column in (("chosen", 1), ("rejected", 2)):
        argv = ["predict", "--model_dir", str(out)]
        for pair in PAIRS:
            argv += ["--text", pair[0], "--text_pair", pair[column]]
        assert main(argv) == 0
        scores[side] = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
    # the scores are printed to 4 places
    assert sum(scores["chosen"]) / len(PAIRS) == pytest.approx(evaluation["rewards/chosen"], abs=1e-4)
    assert sum(scores["rejected"]) / len(PAIRS) == pytest.approx(evaluation["rewards/rejected"], abs=1e-4)
    assert main(["predict", "--model_dir", str(out), "--text", PAIRS[0][0]]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: the model in {out} was trained on a prompt and an answer rendered through its chat template: give "
        'each --text its second text with --text_pair "..."'
    )
    # a prompt that fills the 48 tokens leaves no answer to score: null, as training dropped such a pair
    long_prompt = "Which topic: " + "the storm hit the coast again " * 20
    argv = ["predict", "--model_dir", str(out), "--text", PAIRS[0][0], "--text_pair", "sports"]
    assert main([*argv, "--text", long_prompt, "--text_pair", "weather"]) == 0
    printed = capsys.readouterr()
    assert [json.loads(line)["score"] for line in printed.out.splitlines()][1:] == [None]
    assert json.loads(printed.out.splitlines()[0])["score"] == scores["chosen"][0]
    assert "note: 1 of 2 pairs keep no token of their answer within 48 tokens" in printed.err


def plain_run(model: str, tmp_path, **extra) -> Path:
    """A short reward run on implicit-prompt pairs of strings (no prompt column): plain text, no template."""
    rows = [{"chosen": f"{q} {c}", "rejected": f"{q} {r}"} for q, c, r in PAIRS]
    data, out = tmp_path / "plain.jsonl", tmp_path / "out"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = {
        "task": "reward", "model_name_or_path": model, "train_file": str(data), "validation_file": str(data),
        "output_dir": str(out), "max_length": 48, "per_device_train_batch_size": 6, "max_steps": 2,
        "learning_rate": 1e-2, "mixed_precision": "no", "report_to": "none", "eval_strategy": "no", **extra,
    }  # fmt: skip
    run_training(build_config(options))
    return out


def trained_scores(model_dir, texts: list[str]) -> list[float]:
    """The saved model's own scores of `texts` encoded as training encoded a plain pair's side: the whole text at
    once, the tokenizer's own special tokens, no EOS (cloudtrain.data.pairs.plain_text), one row at a time."""
    from cloudtrain.data.pairs import plain_text
    from cloudtrain.predict import load

    model, tokenizer = load(str(model_dir))
    scores = []
    with torch.no_grad():
        for text in texts:
            ids, _ = plain_text(tokenizer, text[:1], text[1:], eos=False)
            scores.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return scores


@pytest.mark.parametrize(
    ("model", "peft"),
    [("tiny_llama_dir", "none"), ("tiny_model_dir", "none"), ("tiny_llama_dir", "lora")],
    ids=["decoder", "encoder", "decoder LoRA and its merge"],
)
def test_predict_scores_a_plain_pair_reward_model_s_texts_as_training_read_them(model, peft, request, tmp_path, capsys):
    """Found in review: a reward model trained on implicit-prompt pairs of strings read each side as its whole
    text, but `predict` refused a lone --text and read --text PROMPT --text_pair ANSWER as a text pair: a decoder's
    glued by the tokenizer's pair rule (tokens split at the join), an encoder's as [CLS] prompt [SEP] answer [SEP]:
    inputs it never saw. The run records how it read its texts with the tokenizer (an adapter's and its merge's
    too); a lone --text is the whole text, a --text_pair the rest of it, joined to --text as training joined the
    pair's prompt and answer. A model saved before the record is read as before."""
    from cloudtrain.cli import main
    from cloudtrain.commands.predict import reward_input

    merge = {"peft": "lora", "merge_adapters": True} if peft == "lora" else {}
    out = plain_run(request.getfixturevalue(model), tmp_path, **merge)
    texts = [f"{q} {c}" for q, c, _ in PAIRS]
    # the pair's own split (the answer starts at its space) and one inside the last word
    splits = [(text[:k], text[k:]) for (q, _, _), text in zip(PAIRS, texts, strict=True) for k in (len(q), -2)]
    for folder in [out, out / "merged"] if peft == "lora" else [out]:
        assert reward_input(folder) == "plain"
        expected = trained_scores(folder, texts)
        capsys.readouterr()
        argv = ["predict", "--model_dir", str(folder)]
        assert main([*argv, *(a for text in texts for a in ("--text", text))]) == 0
        whole = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
        assert whole == pytest.approx(expected, abs=1e-4)
        assert main([*argv, *(a for p, rest in splits for a in ("--text", p, "--text_pair", rest))]) == 0
        pairs = [json.loads(line)["score"] for line in capsys.readouterr().out.splitlines()]
        assert pairs == pytest.approx([score for score in expected for _ in range(2)], abs=1e-4)
    # an answer past --max_length (48 tokens) leaves the prompt alone to score: null, as training dropped the pair
    long_prompt = "Which topic: " + "the storm hit the coast again " * 20
    assert main(["predict", "--model_dir", str(out), "--text", long_prompt, "--text_pair", " weather"]) == 0
    printed = capsys.readouterr()
    assert (
        json.loads(printed.out)["score"] is None and "note: 1 of 1 pairs keep no token of their answer" in printed.err
    )
    # saved before the record: read as a text pair, as then
    (config := Path(out) / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "cloudtrain_reward_input"})
    )
    assert main(["predict", "--model_dir", str(out), "--text", texts[0]]) == 2
    assert "give each --text its second text with --text_pair" in capsys.readouterr().err
