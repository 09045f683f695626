"""bench/sft_bench.py, the SFT comparison of `make bench`: ours (packing none and bfd) against transformers.Trainer
and TRL's SFTTrainer (packing off and on), on a tiny model and a few steps.

The five runners are trained in this process through the workers' own code (`train_once`), which is what
`make bench` runs in fresh interpreters; one slow test runs the section end to end in fresh processes.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import sft_bench

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

pytest.importorskip("trl")  # a development dependency (requirements-dev.txt)
pytestmark = pytest.mark.skipif(
    not (sft_bench.R8 / "reuters-r8-train.tab").is_file(), reason="data/reuters-r8 not fetched"
)

TINY_MODEL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)
# Rows of 512 tokens hold about two examples each, as in the real section; a high learning rate so that three
# steps move the held-out loss.
TINY = dict(
    batch_size=2,
    steps=3,
    learning_rate=1e-2,
    train_examples=48,
    heldout_examples=8,
    eval_batch_size=8,
    model_overrides=TINY_MODEL,
)
UNPACKED = ("ours-none", "hf-trainer", "trl-none")
PACKED = ("ours-bfd", "trl-packing")
TOPICS = {"acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"}


# ---------------------------------------------------------------- fast: the data and the report
def test_the_pairs_are_r8_articles_cut_to_fit_with_lengths_that_vary():
    from transformers import AutoTokenizer

    from cloudtrain.data.chat import ChatFormat

    chat = ChatFormat.setup(AutoTokenizer.from_pretrained(sft_bench.TOKENIZER), "chatml")
    rows = sft_bench.read_r8(sft_bench.R8 / "reuters-r8-train.tab", 40)
    assert len(rows) == 40 and {c for c, _ in rows} <= TOPICS
    pairs = [sft_bench.to_pair(c, t, chat, 256) for c, t in rows]
    lengths = [len(chat.encode(sft_bench.messages(p))[0]) for p in pairs]
    assert max(lengths) <= 256 and min(lengths) < 128 < max(lengths)
    for (category, text), pair in zip(rows, pairs, strict=True):
        assert pair["completion"] == category and pair["prompt"].startswith(sft_bench.QUESTION)
        article = pair["prompt"][len(sft_bench.QUESTION) :]
        assert (" ".join(text.split()) + " ").startswith(article + " ")  # its first words, whole


def fake_section(hf_rate: float = 400.0) -> dict:
    def run(rate, padding, loss, rows):
        return {
            "real_tokens_per_s": rate,
            "computed_tokens_per_s": rate / (1 - padding),
            "median_step_s": 3.0,
            "peak_rss_mb": 1500.0,
            "heldout_loss": loss,
            "train_loss": loss + 1,
            "padding_fraction": padding,
            "examples_seen": 72,
            "real_tokens_seen": 16000,
            "answer_tokens_seen": 300,
            "rows_per_step": rows,
        }

    shapes = {
        "ours-none": (400.0, 0.5, 5.38, 9),
        "ours-bfd": (800.0, 0.03, 5.42, 4),
        "hf-trainer": (hf_rate, 0.5, 5.38, 9),
        "trl-none": (390.0, 0.5, 5.38, 9),
        "trl-packing": (350.0, 0.0, 5.42, 4),
    }
    runners = {}
    for name, (rate, padding, loss, rows) in shapes.items():
        runs = [run(rate, padding, loss, rows), run(rate * 0.9, padding, loss, rows)]
        if name == "trl-none":
            for r in runs:
                r.update(inputs_differing_from_ours=0, trained_not_by_ours=400, not_trained_by_trl=0)
        runners[name] = {
            "rows_per_step": rows,
            "packed": sft_bench.PACKED[name],
            "runs": runs,
            "summary": sft_bench._summary(runs),
        }
    data = {
        "parameters": 5.5e6,
        "vocab_size": 4160,
        "train_examples": 400,
        "min_tokens": 67,
        "max_tokens": 512,
        "median_tokens": 188,
        "answer_tokens_per_example": 4.1,
        "examples_per_bfd_row": 2.26,
        "bfd_fill": 0.98,
        "heldout_examples": 64,
        "initial_heldout_loss": 8.2,
    }
    return {
        "settings": sft_bench.asdict(sft_bench.SFTSettings()),
        "repetitions": 2,
        "data": data,
        "runners": runners,
        "skipped": {},
        "goals": sft_bench.goals(runners),
        "wall_s": 250.0,
    }


def test_the_markdown_section_carries_every_runner_and_both_goals():
    section = fake_section()
    text = sft_bench.markdown(section)
    assert text.startswith(sft_bench.TITLE)
    assert "| ours-bfd | 4 | 72 | 16000 | 300 | 760 (720-800) | 2.00x | 784 | 3.0% | 1500 | 5.4200 | 6.4200 |" in text
    assert "| hf-trainer | 9 | 72 | 16000 | 300 | 380 (360-400) | 1.00x |" in text
    assert (
        "ours-bfd / hf-trainer real tokens/s: **2.00x** (goal at least 1.3x: met); held-out loss difference "
        "+0.0400" in text
    )
    assert "ours-bfd / trl-packing real tokens/s: **2.29x** (goal at least 1.0x: met)" in text
    assert "0 of 400 examples with other input tokens; it would train 400 tokens ours does not" in text
    assert "nan" not in text.lower()
    slow = fake_section(hf_rate=700.0)
    assert slow["goals"]["vs_hf_trainer"]["met"] is False
    assert "(goal at least 1.3x: not met)" in sft_bench.markdown(slow)


# ---------------------------------------------------------------- slow: the five runners, tiny
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(settings, prepared data, {runner: result}) for all five runners, trained in this process through the
    workers' code (about 45 s on 2 cores)."""
    from accelerate.state import AcceleratorState, GradientState

    tmp = tmp_path_factory.mktemp("sft-bench")
    s = replace(sft_bench.SFTSettings(), **TINY)
    prepared = sft_bench.prepare(s, tmp)
    results = {}
    for runner in sft_bench.RUNNERS:
        AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per run, as in a process
        GradientState._reset_state()
        results[runner] = sft_bench.train_once(sft_bench.worker_spec(s, prepared, runner, str(tmp / "cache")))
    return s, prepared, results


@pytest.mark.slow
def test_every_runner_starts_from_one_folder(tiny):
    s, prepared, _ = tiny
    pairs = [json.loads(line) for line in Path(prepared.train_file).read_text().splitlines()]
    assert len(pairs) == prepared.data["train_examples"] == s.train_examples
    d = prepared.data
    assert d["min_tokens"] < d["median_tokens"] <= d["max_tokens"] <= s.max_length  # lengths vary, all fit
    assert d["examples_per_bfd_row"] > 1.5 and prepared.unpacked_rows > s.batch_size
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared.model_dir)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.pad_token is None
    assert d["vocab_size"] % 64 == 0 and d["vocab_size"] >= len(tokenizer)


@pytest.mark.slow
def test_every_runner_trains_the_same_steps_and_reports_its_speed(tiny):
    s, _, results = tiny
    assert set(results) == set(sft_bench.RUNNERS)
    for name, r in results.items():
        assert r["steps"] == r["batches"] == s.steps, name
        assert r["real_tokens_per_s"] > 0 and r["computed_tokens_per_s"] >= r["real_tokens_per_s"], name
        assert 0 < r["real_tokens_seen"] <= r["computed_positions"] and r["answer_tokens_seen"] > 0, name
        assert r["peak_rss_mb"] > 0 and math.isfinite(r["heldout_loss"]) and math.isfinite(r["train_loss"]), name
    # Packed runners take fewer, fuller rows for about the same examples as the unpacked ones.
    for packed in PACKED:
        assert results[packed]["rows_per_step"] == s.batch_size
        for unpacked in UNPACKED:
            assert results[packed]["padding_fraction"] < results[unpacked]["padding_fraction"]
            assert results[unpacked]["rows_per_step"] > s.batch_size
    assert results["trl-packing"]["padding_free"] and results["trl-packing"]["train_rows"] < s.train_examples
    assert not results["trl-none"]["padding_free"]


@pytest.mark.slow
def test_the_same_tokens_batches_and_maths_give_the_same_loss(tiny):
    """Every runner trains our tokens and loss masks (TRL pre-tokenized; its own tokenization of the pairs gives the
    same input tokens and one more target, the newline after <|im_end|>). ours-none, hf-trainer and trl-none see
    the same batches (cloudtrain's sampler), TRL 1.16's bfd packs the same rows as ours; the same maths (loss
    summed over the step's answer tokens over their count, one micro-batch per step, AdamW, clipping, schedule)
    then reaches the same held-out loss: measured equal to 1e-6 here (other kernels, the same sums)."""
    s, prepared, results = tiny
    trl = results["trl-none"]
    assert trl["inputs_differing_from_ours"] == 0 and trl["not_trained_by_trl"] == 0
    assert trl["trained_not_by_ours"] == s.train_examples  # the newline after each <|im_end|>
    for group in (UNPACKED, PACKED):
        for key in ("examples_seen", "real_tokens_seen", "answer_tokens_seen"):
            assert len({results[r][key] for r in group}) == 1, (group, key)
        losses = {r: results[r]["heldout_loss"] for r in group}
        assert max(losses.values()) - min(losses.values()) < 1e-4, losses
    assert len({results[r]["computed_positions"] for r in UNPACKED}) == 1  # the same padded batches
    assert len({r["heldout_answer_tokens"] for r in results.values()}) == 1  # one held-out set for everyone
    for name, r in results.items():
        assert r["heldout_loss"] < prepared.data["initial_heldout_loss"] - 0.1, name  # the steps did train


@pytest.mark.slow
def test_the_section_runs_its_runners_in_fresh_processes(tmp_path):
    """run_section, as bench/run.py calls it: one fresh interpreter per run (two runners here, about a minute),
    JSON-ready results, the markdown, and a goal whose runner was not run."""
    log = tmp_path / "runs.log"
    with open(log, "w") as f:
        overrides = {**{k: v for k, v in TINY.items() if k != "steps"}, "train_examples": 24}
        text, results = sft_bench.run_section(1, 2, log=f, **overrides, runners=["ours-bfd", "hf-trainer"])
    assert set(results["runners"]) == {"ours-bfd", "hf-trainer"}
    assert all(r["runs"][0]["steps"] == 2 and r["runs"][0]["process_s"] > 0 for r in results["runners"].values())
    goals = json.loads(json.dumps(results))["goals"]
    assert goals["vs_hf_trainer"]["ratio"] > 0 and goals["vs_trl_packing"]["ratio"] is None
    assert text.startswith(sft_bench.TITLE) and "| ours-bfd | 2 |" in text
    assert "ours-bfd / trl-packing real tokens/s: n/a (trl-packing not run)" in text
