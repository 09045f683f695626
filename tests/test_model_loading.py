"""Model loading from checkpoints that already have a classification head (sentiment, NLI, ...):
the head is kept when its labels are the data's (in any order), replaced in one line otherwise."""

import pandas as pd
import pytest
import torch
from conftest import run_cli, topic_rows
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from cloudtrain.config import DataConfig, ModelConfig, build_config
from cloudtrain.data.processing import process_data
from cloudtrain.errors import UserError
from cloudtrain.models.load import head_labels, load_model
from cloudtrain.tasks.classification import ClassificationTask

TOPICS = ["finance", "sports", "weather"]  # the labels of topic_rows, sorted


def tiny_config(kind: str, vocab_size: int, labels: list[str]):
    common = dict(
        vocab_size=vocab_size,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )
    if kind == "bert":
        return BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, **common)
    if kind == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=128, pad_token_id=0, **common)
    return LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=0,
        **common,
    )


CLASSES = {
    "bert": BertForSequenceClassification,
    "gpt2": GPT2ForSequenceClassification,
    "llama": LlamaForSequenceClassification,
}
HEAD = {"bert": "classifier", "gpt2": "score", "llama": "score"}


@pytest.fixture
def make_checkpoint(tmp_path, tiny_model_dir):
    """A saved `<Model>ForSequenceClassification` with the given head labels and the real tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def make(kind: str, labels: list[str]) -> str:
        torch.manual_seed(7)
        folder = tmp_path / f"{kind}-{'-'.join(labels)}"
        CLASSES[kind](tiny_config(kind, tokenizer.vocab_size, labels)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return str(folder)

    return make


def load(checkpoint: str, announce: bool = True):
    """Data processing and model loading as the pipeline does them."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    raw = DatasetDict({"train": Dataset.from_list(topic_rows(4)), "validation": Dataset.from_list(topic_rows(1))})
    cfg = ModelConfig(model_name_or_path=checkpoint)
    data = process_data(raw, tokenizer, DataConfig(), seed=0, label_order=head_labels(cfg))
    torch.manual_seed(0)
    return data, load_model(
        build_config({"model_name_or_path": checkpoint}), ClassificationTask(), data, tokenizer, announce
    )


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_a_head_with_the_datas_labels_is_kept_in_its_order(kind, make_checkpoint, capsys):
    order = ["weather", "finance", "sports"]  # the checkpoint's ids, not sorted
    checkpoint = make_checkpoint(kind, order)
    data, model = load(checkpoint)
    saved = load_file(f"{checkpoint}/model.safetensors")
    assert data.label_names == order and model.config.id2label == dict(enumerate(order))
    head = f"{HEAD[kind]}.weight"
    torch.testing.assert_close(model.state_dict()[head], saved[head], rtol=0, atol=0)
    # each row's label id is the head's id for its label name
    texts_to_label = {row["text"]: row["label"] for row in topic_rows(4)}
    train = data.train
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for ids, label in zip(train["input_ids"], train["labels"], strict=True):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert order[label] == texts_to_label[text]
    assert "replacing" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "kind, labels",
    [
        ("bert", ["negative", "positive"]),  # another count
        ("bert", ["contradiction", "entailment", "neutral"]),  # the same count, other names
        ("gpt2", ["negative", "positive"]),  # a decoder classifier's `score`
    ],
)
def test_a_head_for_other_labels_is_replaced_in_one_line(kind, labels, make_checkpoint, capsys):
    checkpoint = make_checkpoint(kind, labels)
    data, model = load(checkpoint)
    out = capsys.readouterr().out
    assert f"replacing the {len(labels)}-label head of {checkpoint} with a new 3-label head" in out
    assert data.label_names == TOPICS and model.config.id2label == dict(enumerate(TOPICS))
    saved, state = load_file(f"{checkpoint}/model.safetensors"), model.state_dict()
    head = f"{HEAD[kind]}.weight"
    assert state[head].shape[0] == 3
    if saved[head].shape == state[head].shape:
        assert not torch.equal(saved[head], state[head])  # the old task's head is not carried over
    body = [name for name in saved if not name.startswith(HEAD[kind])]
    assert body and all(torch.equal(saved[name], state[name]) for name in body if name in state)


def test_replacing_is_said_only_when_asked(make_checkpoint, capsys):
    load(make_checkpoint("bert", ["negative", "positive"]), announce=False)
    assert "replacing" not in capsys.readouterr().out


def test_a_model_without_a_head_has_no_head_labels(tiny_model_dir):
    assert head_labels(ModelConfig(model_name_or_path=tiny_model_dir)) is None


@pytest.mark.slow
def test_fine_tuning_a_sentiment_checkpoint_on_other_labels_from_the_command_line(
    make_checkpoint, topic_csvs, tmp_path
):
    checkpoint = make_checkpoint("bert", ["negative", "positive"])
    out = tmp_path / "out"
    result = run_cli(
        "--model_name_or_path",
        checkpoint,
        "--train_file",
        str(topic_csvs["train"]),
        "--validation_file",
        str(topic_csvs["validation"]),
        "--max_steps",
        "2",
        "--output_dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("replacing the 2-label head of") == 1
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == dict(enumerate(TOPICS))
    pd.read_json(out / "metrics.jsonl", lines=True)  # the run logged as usual


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_classifier_computes_with_the_attention_asked_for(implementation, tiny_model_dir, topic_csvs, tmp_path):
    """--attn_implementation reaches a classification model too (it was once read only by the decoder tasks)."""
    from cloudtrain.pipeline import build_run

    options = {"train_file": str(topic_csvs["train"]), "validation_file": str(topic_csvs["validation"])}
    run = build_run(
        build_config(
            {
                "model_name_or_path": tiny_model_dir,
                **options,
                "output_dir": str(tmp_path / "out"),
                "attn_implementation": implementation,
                "report_to": "none",
            }
        )
    )
    assert run.model.config._attn_implementation == implementation
    layer = run.model.base_model.encoder.layer[0].attention.self
    assert layer.config._attn_implementation == implementation


def test_an_attention_a_model_cannot_use_is_refused_not_ignored():
    """DeBERTa-v2 has no SDPA path: transformers refuses it at load time but only warns when asked to switch
    later; both end in one clear error, never in a run that silently computes with another kernel."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    from cloudtrain.models.prepare import attention

    model = DebertaV2ForSequenceClassification(
        DebertaV2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99)
    )
    cfg = build_config({"attn_implementation": "sdpa"})
    with pytest.raises(UserError, match="--attn_implementation sdpa: DebertaV2ForSequenceClassification cannot use it"):
        attention(model, cfg, ClassificationTask(), announce=False)
    assert attention(model, build_config({"attn_implementation": "eager"}), ClassificationTask(), False) is model
