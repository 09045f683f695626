"""--task seq2seq (cloudtrain.tasks.seq2seq, cloudtrain.data.source_target, cloudtrain.metrics.text_overlap): ROUGE
and BLEU against rouge_score and sacreBLEU, sources and targets as rows (prefix, EOS, truncation, padding), a run
that learns and writes predictions, `generate` and the card's snippet on the saved model, an adapter, and every
refusal in one line (two processes: test_distributed.py)."""

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
from conftest import SEQ2SEQ_WORDS, assert_each_refused
from datasets import Dataset, DatasetDict
from rouge_score import rouge_scorer
from transformers import AutoTokenizer

from cloudtrain import generate
from cloudtrain.cli import main
from cloudtrain.config import DataConfig
from cloudtrain.data.source_target import (
    SourceTargetCollator,
    check_family,
    family_columns,
    process_source_target,
    shift_right,
)
from cloudtrain.errors import UserError
from cloudtrain.metrics.text_overlap import bleu, porter_stemmer, rouge, rouge_pair, sentences


def headline_rows(n: int, seed: int, source: str = "document", target: str = "summary") -> list[dict]:
    """XSum-shaped rows: a few words, and their first four as the summary."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.choices(SEQ2SEQ_WORDS, k=rng.randint(5, 9))
        rows.append({source: " ".join(words), target: " ".join(words[:4])})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def headline_writer(model_dir: str, folder: Path) -> str:
    """`model_dir` trained to write headlines (about 5 s): its generations stop at different lengths, as a random
    model's do not."""
    options = {
        "task": "seq2seq",
        "model_name_or_path": model_dir,
        "train_file": write_jsonl(folder / "headlines.jsonl", headline_rows(320, 0)),
        "output_dir": str(folder / "headline-writer"),
        "max_target_length": 12,
        "num_train_epochs": 12,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
        "eval_strategy": "no",
        "mixed_precision": "no",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    return options["output_dir"]


def test_rouge_and_bleu_equal_the_reference_packages():
    rng = random.Random(0)
    words = 'the cat sat on a mat . , 3.5 10-20 dog\'s "quoted" &amp; x-ray (big) over! Yes? CAT'.split()
    predictions = [" ".join(rng.choices(words, k=rng.randint(0, 14))) for _ in range(300)]
    references = [" ".join(rng.choices(words, k=rng.randint(1, 14))) for _ in range(300)]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    for prediction, reference in zip(predictions, references, strict=True):
        theirs = scorer.score(reference, prediction)
        ours = rouge_pair(prediction, reference)
        for name in ("rouge1", "rouge2", "rougeL"):  # rougeLsum splits sentences: the next test
            assert ours[name] == pytest.approx(theirs[name].fmeasure, abs=1e-12), (prediction, reference, name)
    for size in (300, 40, 3):
        ours = bleu(predictions[:size], references[:size])
        assert ours == pytest.approx(sacrebleu.corpus_bleu(predictions[:size], [references[:size]]).score, abs=1e-9)
    assert bleu(["a b c"], ["a b c"]) == 0.0 == sacrebleu.corpus_bleu(["a b c"], [["a b c"]]).score  # no 4-grams
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100)
    assert (
        bleu(["a b c d", ""], ["e f g h", "x"])
        == 0.0
        == sacrebleu.corpus_bleu(["a b c d", ""], [["e f g h", "x"]]).score
    )
    # letters outside ASCII are words here (rouge_score drops them: every Greek summary would score 0)
    assert rouge(["καλή μέρα φίλε"], ["καλή μέρα"]) == pytest.approx(
        {"rouge1": 80.0, "rouge2": 200 / 3, "rougeL": 80.0, "rougeLsum": 80.0}
    )


def test_rouge_lsum_equals_rouge_score_on_the_same_sentences():
    """Summaries of a few sentences over five words (many repeats and ties between LCSs): ours, with sentences
    ending at . ! ? or a line break, equals rouge_score's rougeLsum given one sentence a line."""
    rng = random.Random(1)

    def summary() -> list[str]:
        return [" ".join(rng.choices("a b c d e".split(), k=rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]

    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
    for _ in range(300):
        predicted, reference = summary(), summary()
        ends = [rng.choice([". ", "! ", "? ", '." ', "\n"]) for _ in predicted]
        written = "".join(sentence + end for sentence, end in zip(predicted, ends, strict=True))
        theirs = scorer.score("\n".join(reference), "\n".join(predicted))["rougeLsum"].fmeasure
        assert rouge_pair(written, " ".join(s + "." for s in reference))["rougeLsum"] == pytest.approx(theirs)
    assert sentences("He paid 3.5 dollars. (Really!) Then\nleft.") == [["he", "paid", "3", "5", "dollars"],
                                                                     ["really"], ["then"], ["left"]]  # fmt: skip
    assert rouge_pair("b a. d c.", "a b c d")["rougeLsum"] == pytest.approx(0.5)  # one reference sentence: LCS 2
    assert rouge_pair("猫が好き。犬も好き。", "犬も好き。猫が好き。")["rougeLsum"] == 1.0  # full stops without spaces


def test_stemmed_rouge_equals_rouge_score_with_its_stemmer():
    rng = random.Random(2)
    words = "running runs runner ran cats cat's generously generous happiness happy the a Flies flying".split()

    def text() -> str:
        return ". ".join(" ".join(rng.choices(words, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))

    stem = porter_stemmer()
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    for _ in range(200):
        prediction, reference = text(), text()
        theirs = scorer.score(reference.replace(". ", "\n"), prediction.replace(". ", "\n"))
        ours = rouge_pair(prediction, reference, stem)
        for name, score in theirs.items():
            assert ours[name] == pytest.approx(score.fmeasure), (prediction, reference, name)
    assert rouge(["the cats ran"], ["a cat runs"], stem)["rouge1"] == pytest.approx(100 / 3)  # "cat" alike
    assert rouge(["the cats ran"], ["a cat runs"])["rouge1"] == 0.0


def test_the_stemmer_is_refused_in_one_line_where_nltk_is_missing(tiny_t5_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "nltk.stem.porter", None)  # what an environment without nltk imports
    options = {
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", headline_rows(8, 0)),
        "output_dir": str(tmp_path / "out"),
        "rouge_stemmer": "true",
    }
    cases = {"no nltk": (options, "error: --rouge_stemmer true needs NLTK's Porter stemmer: pip install nltk")}
    assert_each_refused(cases, capsys, tmp_path / "out")


def test_sources_and_targets_as_rows(tiny_t5_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    train = headline_rows(20, 0)
    train[0]["summary"] = " ".join(SEQ2SEQ_WORDS)  # longer than --max_target_length
    raw = DatasetDict(
        {"train": Dataset.from_list(train), "test": Dataset.from_list([{"document": "red cat"}, {"document": "dog"}])}
    )
    cfg = DataConfig(
        text_column="document",
        label_column="summary",
        max_target_length=6,
        source_prefix="sum: ",
        cache_dir=str(tmp_path),
    )
    data = process_source_target(raw, tokenizer, cfg, seed=0)
    assert len(data.train) + len(data.validation) == 20 and data.test is None  # validation carved from train
    assert data.unlabelled_texts == {"test": ["red cat", "dog"]}
    row = next(r for r in data.train if tokenizer.decode(r["input_ids"]) == "sum: " + train[0]["document"])
    assert len(row["labels"]) == 6 and row["labels"][-1] == eos  # cut at 6 tokens, EOS last
    assert tokenizer.decode(row["labels"][:-1]) == tokenizer.decode(tokenizer(train[0]["summary"])["input_ids"][:5])
    short = data.train[1]
    assert short["labels"].count(eos) == 1 and short["labels"][-1] == eos  # EOS added once
    assert "labels" not in data.unlabelled["test"].column_names

    batch = SourceTargetCollator(pad)(
        [
            {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [8, eos]},
            {"input_ids": [5], "attention_mask": [1], "labels": [9, 10, 11, eos]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[8, eos, -100, -100], [9, 10, 11, eos]]
    assert shift_right(batch["labels"], 0, pad).tolist() == [[0, 8, eos, pad], [0, 9, 10, 11]]

    assert family_columns(["id", "article", "highlights"]) == {"text_column": "article", "label_column": "highlights"}
    assert family_columns(["document", "highlights"]) == {}


def test_a_tokenizer_that_adds_eos_gets_no_second_one(tiny_t5_dir, tmp_path):
    from tokenizers import processors

    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    eos = tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", eos)]
    )  # as T5's own tokenizer
    raw = DatasetDict(
        {"train": Dataset.from_list(headline_rows(10, 1)), "validation": Dataset.from_list(headline_rows(2, 2))}
    )
    cfg = DataConfig(text_column="document", label_column="summary", max_target_length=3, cache_dir=str(tmp_path))
    data = process_source_target(raw, tokenizer, cfg, seed=0)
    for row in data.validation:
        assert len(row["labels"]) == 3 and row["labels"][-1] == eos and row["labels"].count(eos) == 1


@pytest.mark.slow  # about 6 s: twelve short epochs, then generate and the card's snippet
def test_a_run_learns_predicts_and_the_saved_model_generates(tiny_t5_dir, tmp_path, capsys):
    out = tmp_path / "out"
    sources = [row["document"] for row in headline_rows(4, 3)]
    options = {  # XSum's column names: read without options
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", headline_rows(320, 0)),
        "validation_file": write_jsonl(tmp_path / "validation.jsonl", headline_rows(40, 1)),
        "test_file": write_jsonl(tmp_path / "test.jsonl", [{"document": s} for s in sources]),
        "output_dir": str(out),
        "max_target_length": 12,
        "num_train_epochs": 12,
        "per_device_train_batch_size": 16,
        "learning_rate": 3e-3,
        "mixed_precision": "no",
        "eval_on_start": "true",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    said = capsys.readouterr().out
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before = next(row for row in logged if "eval/rougeL" in row)
    assert before["eval/rougeL"] < 5 and before["eval/bleu"] < 1, before  # the random model writes no headline
    results = json.loads((out / "eval_results.json").read_text())
    assert results["rougeL"] > 45 and results["bleu"] > 4 and results["samples"] == 40, results
    assert f"eval: rougeL {results['rougeL']:.2f} | rouge1 " in said
    assert 0 < results["generated_tokens"] <= 12
    shown = results["generations"][0]
    assert set(shown) == {"source", "target", "generated"} and shown["target"] == headline_rows(40, 1)[0]["summary"]

    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [row["source"] for row in written] == sources
    model, tokenizer = generate.load(str(out), torch.device("cpu"))
    again = generate.generate_texts(model, tokenizer, sources, max_new_tokens=12)
    assert [text.strip() for text in again] == [row["generated"] for row in written]  # greedy: the same texts
    assert all(0 < row["tokens"] <= 12 and row["ended"] for row in written)

    assert main(["generate", "--model_dir", str(out), "--prompt", sources[0], "--max_new_tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert f"{sources[0]}\n{again[0]}" in printed  # the source, then the new text on its own line

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/headlines"})
    run_results = {"train": json.loads((out / "train_results.json").read_text()), "eval": results}
    card = build_task(cfg).model_card(out, cfg, run_results)
    assert card.data.pipeline_tag == "text2text-generation" and "sequence-to-sequence generation" in card.text
    assert "## Labels" not in card.text and "- ROUGE-L: " in card.text and "- BLEU: " in card.text
    snippet = card.text.split("```python\n")[1].split("```")[0].replace('"me/headlines"', repr(str(out)))
    snippet = snippet.replace("Replace me by any text you'd like.", sources[0])
    exec(snippet, {})  # the card's usage, as a reader runs it
    assert capsys.readouterr().out.strip() == again[0].strip()
    prefixed = resolve_options(  # a prefix with a quote, a backslash and a line break: still one Python string
        None, {**options, "push_to_hub": True, "hub_model_id": "me/h", "source_prefix": 'say "a"\\\n'}
    )
    card = build_task(prefixed).model_card(out, prefixed, run_results)
    line = next(line for line in card.text.splitlines() if line.startswith("inputs = tokenizer("))
    assert (
        eval(line.split("tokenizer(", 1)[1].rsplit(", return_tensors", 1)[0])
        == 'say "a"\\\nReplace me by any text you\'d like.'
    )


def test_an_adapter_writes_as_its_merged_model(tiny_t5_dir, tmp_path, capsys):
    out = tmp_path / "lora"
    options = {
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", headline_rows(40, 0, "source", "target")),
        "output_dir": str(out),
        "source_prefix": "headline: ",
        "peft": "lora",
        "lora_r": "4",
        "merge_adapters": "true",
        "max_steps": "3",
        "max_target_length": "8",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["task_type"] == "SEQ_2_SEQ_LM"
    assert not (out / "labels.json").exists() and (out / "generation_config.json").is_file()
    capsys.readouterr()
    texts = []
    for folder in (out, out / "merged"):
        assert main(["generate", "--model_dir", str(folder), "--prompt", "red cat runs", "--max_new_tokens", "6"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("headline: red cat runs\n")  # the training's prefix first
    assert main(["predict", "--model_dir", str(out), "--text", "hi"]) == 2
    assert "holds a SEQ_2_SEQ_LM adapter, not a classifier; write texts with it through the generate command" in (
        capsys.readouterr().err
    )
    assert main(["generate", "--model_dir", str(out / "merged"), "--chat"]) == 2
    assert "--chat needs a chat model" in capsys.readouterr().err


def test_each_refusal_is_one_line(tiny_t5_dir, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rows = headline_rows(20, 0)
    base = {
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", rows),
        "output_dir": str(out),
        "report_to": "none",
        "max_steps": 2,
    }
    untargeted = [{**row, "summary": ""} if i % 5 == 0 else row for i, row in enumerate(rows)]
    partly = [{**row, "summary": None} if i == 1 else row for i, row in enumerate(headline_rows(6, 1))]
    references = [{**row, "summary": [row["summary"], ""]} for row in headline_rows(6, 2)]
    cases = {
        "the default model": (  # it was named "None" (found in audit)
            {**base, "model_name_or_path": None},
            "the default model (all-MiniLM-L6-v2) is not an encoder-decoder model (BertModel)",
        ),
        "a decoder": (
            {**base, "model_name_or_path": tiny_llama_dir},
            "is not an encoder-decoder model (LlamaForCausalLM); --task seq2seq trains models such as T5 or BART; "
            "for a decoder use --task sft with --prompt_column and --completion_column",
        ),
        "training rows without a target": (
            {**base, "train_file": write_jsonl(tmp_path / "untargeted.jsonl", untargeted)},
            "4 of 20 training rows have no 'summary' text; give each a target or drop those rows",
        ),
        "a validation file partly without targets": (
            {**base, "validation_file": write_jsonl(tmp_path / "partly.jsonl", partly)},
            "1 of 6 rows of the validation data have no 'summary' text; give each a target or drop those rows",
        ),
        "an empty one of several references": (  # lists were read as "['a', 'b']" before (audit); now references
            {**base, "validation_file": write_jsonl(tmp_path / "references.jsonl", references)},
            "row 1 of 6 of the validation data's 'summary' column holds an empty reference text (",
        ),
        "no source column": (
            {**base, "text_column": "body"},
            "column 'body' is not in the train data (its columns: document, summary); pass --text_column <name>",
        ),
        "a source without its target": (  # was "column 'text' is not in the train data ...; pass --text_column" (audit)
            {**base, "train_file": write_jsonl(tmp_path / "sources.jsonl", [{"source": r["document"]} for r in rows])},
            "the training data has a 'source' column but no 'target' beside it (its columns: source); add the target "
            "column 'target', or name it with --label_column <name>",
        ),
        "a summary without its document": (
            {**base, "train_file": write_jsonl(tmp_path / "alone.jsonl", [{"summary": r["summary"]} for r in rows])},
            "the training data has a 'summary' column but no 'document' beside it (its columns: summary); add the "
            "source column 'document', or name it with --text_column <name>",
        ),
        "target length": ({**base, "max_target_length": "0"}, "--max_target_length must be at least 1"),
        "no beams": ({**base, "generation_num_beams": "0"}, "--generation_num_beams must be at least 1 (1: greedy)"),
        "from a config": (
            {**base, "model_config": "llama-8m", "tokenizer_name_or_path": tiny_t5_dir, "model_name_or_path": None},
            "--task seq2seq starts from a pretrained model: pass --model_name_or_path",
        ),
    }
    assert_each_refused(cases, capsys, out)


def test_a_whole_family_is_read_beside_a_column_named_like_anothers():
    """document/summary data with a `source` column of its own (where each row came from) was refused as a source
    without its target (found in review)."""
    check_family(["document", "summary", "source"], DataConfig())
    with pytest.raises(UserError, match="has a 'source' column but no 'target' beside it"):
        check_family(["source", "id"], DataConfig())


@pytest.fixture(scope="module")
def tiny_bart_dir(tiny_t5_dir, tmp_path_factory) -> str:
    """A 2+2-layer BART (learned positions: 32; the decoder starts from EOS, not pad) whose tokenizer puts BOS and
    EOS around every text itself, and whose saved generation config asks for beam search and a minimum length, as
    bart-large-cnn's does."""
    from tokenizers import processors
    from transformers import BartConfig, BartForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    config = BartConfig(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=bos,
        eos_token_id=eos,
        decoder_start_token_id=eos,
        forced_eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = BartForConditionalGeneration(config)
    model.generation_config.update(num_beams=4, min_length=6, no_repeat_ngram_size=3)
    out = tmp_path_factory.mktemp("tiny-bart")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_bart_trains_and_writes_in_one_pass_whatever_its_saved_beams(tiny_bart_dir, tmp_path, capsys):
    """BOS and EOS from the tokenizer (none added twice), the decoder started from EOS, and both evaluation and
    `generate` decoding greedily although the checkpoint saved beam search (with a streamer, beams would fail)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_bart_dir)
    raw = DatasetDict({"train": Dataset.from_list(headline_rows(10, 0))})
    cfg = DataConfig(text_column="document", label_column="summary", max_target_length=4, cache_dir=str(tmp_path))
    labels = process_source_target(raw, tokenizer, cfg, seed=0).train[0]["labels"]
    assert len(labels) == 4 and labels[0] == tokenizer.bos_token_id and labels[-1] == tokenizer.eos_token_id
    assert labels.count(tokenizer.eos_token_id) == 1

    out = tmp_path / "out"
    options = {
        "task": "seq2seq",
        "model_name_or_path": tiny_bart_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", headline_rows(40, 0)),
        "test_file": write_jsonl(tmp_path / "test.jsonl", [{"document": "red cat runs"}, {"document": "a dog"}]),
        "output_dir": str(out),
        "max_length": 16,
        "max_target_length": 8,
        "max_steps": 3,
        "mixed_precision": "no",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["generated_tokens"] <= 8  # one greedy pass (min_length 6 with no EOS before it would not hold)
    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    assert [row["source"] for row in written] == ["red cat runs", "a dog"]

    from cloudtrain.tasks.seq2seq import Seq2SeqTask

    task, eos, pad = Seq2SeqTask(), tokenizer.eos_token_id, tokenizer.pad_token_id
    task.tokenizer, task.decoder_ids = tokenizer, (eos, pad)
    generated = torch.tensor([[eos, 7, 7, 7, eos], [eos, 7, eos, pad, pad]])  # cut with a forced EOS; ended
    for forced, ended in ((True, [False, True]), (False, [True, True])):
        task.forced_eos = forced
        tokens, stopped = task.written(generated)
        assert tokens.tolist() == [3, 1] and stopped.tolist() == ended
    capsys.readouterr()
    model, tokenizer = generate.load(str(out), torch.device("cpu"))
    expected = generate.generate_texts(model, tokenizer, ["red cat runs"], max_new_tokens=5)[0]
    assert main(["generate", "--model_dir", str(out), "--prompt", "red cat runs", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith(f"red cat runs\n{expected}")
    for extra, message in (
        (
            ["--prompt", "red " * 40, "--max_new_tokens", "5"],
            "tokens, more than the model's encoder reads (32 positions); shorten it",
        ),
        (["--prompt", "red", "--max_new_tokens", "33"], "--max_new_tokens 33 does not fit the model's decoder"),
    ):
        assert main(["generate", "--model_dir", str(out), *extra]) == 2
        assert message in capsys.readouterr().err


def test_beam_search_scores_writes_and_generates_as_the_checkpoint_configures_it(
    tiny_bart_dir, tmp_path, capsys, monkeypatch
):
    """--generation_num_beams 3: evaluation, predictions, `generate` (by default, from args.json) and the card's
    snippet all decode as transformers' generate() does with 3 beams, under the checkpoint's saved length rules
    (its minimum length holds here, as it does not in one greedy pass). --rouge_stemmer reaches the scores."""
    from cloudtrain.tasks import seq2seq

    stemmed: list[str] = []

    def watched_stemmer():
        stem = porter_stemmer()
        return lambda word: stemmed.append(word) or stem(word)

    monkeypatch.setattr(seq2seq, "porter_stemmer", watched_stemmer)
    out = tmp_path / "out"
    sources = ["red cat runs", "a dog"]
    options = {
        "task": "seq2seq",
        "model_name_or_path": tiny_bart_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", headline_rows(40, 0)),
        "test_file": write_jsonl(tmp_path / "test.jsonl", [{"document": s} for s in sources]),
        "output_dir": str(out),
        "max_length": 16,
        "max_target_length": 8,
        "generation_num_beams": 3,
        "rouge_stemmer": "true",
        "max_steps": 3,
        "mixed_precision": "no",
        "report_to": "none",
    }
    assert main([f"--{k}={v}" for k, v in options.items()]) == 0
    assert ", 3 beams)" in capsys.readouterr().out  # the evaluation line says how it decoded
    assert stemmed  # the evaluation's ROUGE stemmed its words
    written = [json.loads(line) for line in (out / "test_predictions.jsonl").read_text().splitlines()]
    model, tokenizer = generate.load(str(out), torch.device("cpu"))
    expected = []
    for source in sources:  # transformers' own beam search, the saved rules included
        ids = model.generate(**tokenizer(source, return_tensors="pt"), num_beams=3, max_new_tokens=8)
        expected.append(tokenizer.decode(ids[0], skip_special_tokens=True).strip())
    assert [row["generated"] for row in written] == expected
    assert all(row["tokens"] >= 5 for row in written)  # the saved min_length 6 (start token included)
    greedy = generate.generate_texts(model, tokenizer, sources, max_new_tokens=8)
    assert [text.strip() for text in greedy] != expected  # one pass ignores the saved rules: other texts

    assert main(["generate", "--model_dir", str(out), "--prompt", sources[0], "--max_new_tokens", "8"]) == 0
    assert capsys.readouterr().out == f"{sources[0]}\n{expected[0]}\n"  # 3 beams, printed whole
    assert (
        main(["generate", "--model_dir", str(out), "--prompt", sources[0], "--max_new_tokens", "8", "--num_beams", "1"])
        == 0
    )
    assert capsys.readouterr().out.startswith(f"{sources[0]}\n{greedy[0].strip()}")
    assert main(["generate", "--model_dir", str(out), "--prompt", "x", "--num_beams", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --num_beams must be at least 1 (1: no beam search), got 0"
    assert main(["generate", "--model_dir", str(out), "--prompt", "x", "--max_new_tokens", "5"]) == 2
    assert "end a text only after 5 new tokens, and --max_new_tokens 5 leaves no room" in capsys.readouterr().err
    assert (
        main(["generate", "--model_dir", str(out), "--prompt", sources[0], "--max_new_tokens", "8", "--do_sample"]) == 0
    )
    torch.manual_seed(42)  # generate's --seed: asked to sample, it samples, one beam, streamed
    sampled = generate.generate_texts(model, tokenizer, sources[:1], max_new_tokens=8, do_sample=True)[0]
    assert capsys.readouterr().out.startswith(f"{sources[0]}\n{sampled}")

    from cloudtrain.config.parse import resolve_options
    from cloudtrain.tasks import build_task

    cfg = resolve_options(None, {**options, "push_to_hub": True, "hub_model_id": "me/beams"})
    results = {name: json.loads((out / f"{name}_results.json").read_text()) for name in ("train", "eval")}
    card = build_task(cfg).model_card(out, cfg, results)
    snippet = card.text.split("```python\n")[1].split("```")[0].replace('"me/beams"', repr(str(out)))
    exec(snippet.replace("Replace me by any text you'd like.", sources[1]), {})
    assert "num_beams=3)" in snippet and capsys.readouterr().out.strip() == expected[1]


def test_bart_refusals_and_an_encoder_decoder_classifier_is_not_for_generate(tiny_bart_dir, tmp_path, capsys):
    out = tmp_path / "out"
    base = {
        "task": "seq2seq",
        "model_name_or_path": tiny_bart_dir,
        "train_file": write_jsonl(tmp_path / "train.jsonl", headline_rows(20, 0)),
        "output_dir": str(out),
        "max_length": 16,
        "report_to": "none",
    }
    cases = {
        "no room for text": (
            {**base, "max_target_length": "2"},
            "--max_target_length 2 leaves no room for a target's text beside its 2 special token(s); pass "
            "--max_target_length 3 or more",
        ),
        "past the decoder": (
            {**base, "max_target_length": "40"},
            "--max_target_length 40 is longer than the model's context (32 positions); pass --max_target_length 32",
        ),
        "a second text": (
            {**base, "text_pair_column": "summary"},
            "--task seq2seq reads one source column (--text_column); drop --text_pair_column",
        ),
        "beams that could not end": (  # the saved min_length 6: five new tokens at least
            {**base, "max_target_length": "5", "generation_num_beams": "2"},
            "the model's saved generation config lets beam search end a text only after 5 new tokens, and "
            "--max_target_length 5 leaves no room for its end: raise --max_target_length, or pass "
            "--generation_num_beams 1",
        ),
    }
    assert_each_refused(cases, capsys, out)

    from transformers import BartForSequenceClassification

    classifier = tmp_path / "classifier"
    BartForSequenceClassification.from_pretrained(tiny_bart_dir).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(tiny_bart_dir).save_pretrained(classifier)
    assert main(["generate", "--model_dir", str(classifier), "--prompt", "hi"]) == 2
    assert "is a sequence-classification model; use the predict command" in capsys.readouterr().err


def test_the_batch_size_probe_pairs_the_longest_source_with_the_longest_target(tiny_t5_dir, tmp_path):
    from cloudtrain.tasks.seq2seq import Seq2SeqTask

    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    rows = [{"document": "red " * 20, "summary": "cat"}, {"document": "dog", "summary": "bird " * 9}]
    raw = DatasetDict({"train": Dataset.from_list(rows), "validation": Dataset.from_list(rows)})
    cfg = DataConfig(text_column="document", label_column="summary", cache_dir=str(tmp_path))
    train = process_source_target(raw, tokenizer, cfg, seed=0).train
    row = Seq2SeqTask().probe_row(train)
    assert len(row["input_ids"]) == max(len(r["input_ids"]) for r in train)
    assert len(row["labels"]) == max(len(r["labels"]) for r in train) > len(train[0]["labels"])


def test_wmt_translation_records_are_read_by_language(tiny_t5_dir, tmp_path, capsys):
    """A `translation` column of {language: text} records: JSON objects in a file, or a saved dataset's Translation
    feature; --source_lang and --target_lang pick two keys, and each mistake is one line naming the keys."""
    rows = [{"translation": {"en": row["document"], "de": row["summary"], "fr": "x"}} for row in headline_rows(30, 0)]
    out = tmp_path / "out"
    base = {
        "task": "seq2seq",
        "model_name_or_path": tiny_t5_dir,
        "train_file": write_jsonl(tmp_path / "wmt.jsonl", rows),
        "output_dir": str(out),
        "max_steps": 1,
        "max_target_length": 8,
        "report_to": "none",
    }
    cases = {
        "no languages": (
            base,
            "the training data holds 'translation' records of de, en, fr: pass --source_lang and --target_lang",
        ),
        "one language": (
            {**base, "source_lang": "en"},
            "--target_lang: the 'translation' column holds de, en, fr; pass --target_lang <one of them>",
        ),
        "the same one": (
            {**base, "source_lang": "en", "target_lang": "en"},
            "--source_lang and --target_lang are both en: a translation needs two languages",
        ),
        "columns as well": (
            {**base, "source_lang": "en", "target_lang": "de", "text_column": "src"},
            "--source_lang and --target_lang name the source and the target: drop --text_column",
        ),
        "an unknown one": (
            {**base, "source_lang": "en", "target_lang": "es"},
            "--target_lang es: the 'translation' column holds de, en, fr; pass --target_lang <one of them>",
        ),
        "no such column": (
            {**base, "train_file": write_jsonl(tmp_path / "plain.jsonl", headline_rows(30, 0)), "source_lang": "en"},
            "--source_lang and --target_lang read a 'translation' column of {language: text} records, which the "
            "training data has not (its columns: document, summary)",
        ),
    }
    assert_each_refused(cases, capsys, out)

    from datasets import Features, Translation

    features = Features({"translation": Translation(languages=["de", "en"])})
    pairs = [{"translation": {"en": r["translation"]["en"], "de": r["translation"]["de"]}} for r in rows]
    saved = tmp_path / "wmt-saved"
    DatasetDict({"train": Dataset.from_list(pairs, features=features)}).save_to_disk(str(saved))
    for source in ({"train_file": base["train_file"]}, {"train_file": None, "dataset_name": str(saved)}):
        options = {**base, **source, "source_lang": "en", "target_lang": "de"}
        assert main([f"--{k}={v}" for k, v in options.items() if v is not None]) == 0
        said = capsys.readouterr().out
        assert "data: 27 train / 3 validation (source, target) pairs" in said
        recorded = json.loads((out / "args.json").read_text())
        assert (recorded["source_lang"], recorded["target_lang"]) == ("en", "de")
        shutil.rmtree(out)


def test_generate_reads_an_encoder_decoder_saved_under_an_old_class_name(tiny_t5_dir, tmp_path, capsys):
    """t5-small's own config.json names T5WithLMHeadModel: still a model with a language-modelling head."""
    old = tmp_path / "t5-old"
    shutil.copytree(tiny_t5_dir, old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "architectures": ["T5WithLMHeadModel"]}))
    assert main(["generate", "--model_dir", str(old), "--prompt", "red cat", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("red cat\n")
