"""--task dpo on CPU with tiny random decoders: each loss against its paper's formula, which tokens get gradient,
the three kinds of reference, the pair formats, every refusal, and a short run that trains and saves."""

import io
import json
import math

import pytest
import torch
from conftest import assert_each_refused
from transformers import AutoModelForCausalLM, AutoTokenizer

from cloudtrain.cli import main
from cloudtrain.config import build_config
from cloudtrain.data.chat import ChatFormat
from cloudtrain.data.fingerprint import data_record
from cloudtrain.data.pairs import (
    SIDES,
    PairCollator,
    PairColumns,
    answer_logps,
    encode_pair,
    ordinal,
    segment_mask,
    to_pair,
    truncate_pairs,
)
from cloudtrain.errors import UserError
from cloudtrain.observe.plotting import curve_data
from cloudtrain.pipeline import build_run, run_training
from cloudtrain.tasks.dpo import DPOTask, pair_logps, preference_loss

QUESTIONS = [
    ("Who found the golden key?", "The poor boy in the snow.", "A wolf in the forest."),
    ("What did the wolf eat?", "Six little goats and chalk.", "Bread from the little house."),
    ("Where did the king live?", "In a castle by the sea.", "Under the old well."),
    ("How many brothers were there?", "Twelve brothers and a sister.", "Three daughters."),
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def conversational(q: str, chosen: str, rejected: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": q}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


@pytest.fixture
def pairs_file(tmp_path) -> str:
    return write_jsonl(tmp_path / "pairs.jsonl", [conversational(*row) for row in QUESTIONS])


@pytest.fixture
def chat(lm_tokenizer_dir) -> ChatFormat:
    return ChatFormat.setup(AutoTokenizer.from_pretrained(lm_tokenizer_dir), "chatml")


def dpo_options(model_dir, train_file, out, **overrides) -> dict:
    return {
        "task": "dpo",
        "model_name_or_path": model_dir,
        "train_file": train_file,
        "validation_file": train_file,
        "output_dir": str(out),
        "max_length": 64,
        "per_device_train_batch_size": 2,
        "max_steps": 3,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "mixed_precision": "no",
        "report_to": ["none"],
        "sample_max_new_tokens": 8,
        "num_sample_prompts": 2,
        "eval_strategy": "no",
        **overrides,
    }


def load_base(model_dir: str, tokenizer) -> torch.nn.Module:
    torch.manual_seed(0)  # the new rows are drawn at random
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)  # as the task grows it for chatml
    return model


# ---------------------------------------------------------------- the losses, from the papers


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Two pairs: summed answer log-probabilities of policy and reference (chosen, then rejected) and answer lengths.
POLICY = [-4.0, -7.5, -6.0, -5.0]
REFERENCE = [-5.0, -7.0, -6.5, -4.0]
COUNTS = [4, 3, 5, 2]


def by_hand(kind: str, beta: float, gamma: float) -> list[float]:
    """Each loss written out per pair from its paper, in plain floats."""
    out = []
    for i in range(2):
        pc, pr, rc, rr = POLICY[i], POLICY[i + 2], REFERENCE[i], REFERENCE[i + 2]
        h = (pc - rc) - (pr - rr)  # DPO's implicit reward difference over beta
        if kind == "sigmoid":  # Rafailov et al. eq. 7
            out.append(-math.log(sigmoid(beta * h)))
        elif kind == "ipo":  # Azar et al. eq. 17, tau = beta
            out.append((h - 1 / (2 * beta)) ** 2)
        elif kind == "simpo":  # Meng et al. eq. 6
            out.append(-math.log(sigmoid(beta / COUNTS[i] * pc - beta / COUNTS[i + 2] * pr - gamma)))
        else:  # Hong et al. eq. 6-7: NLL of the chosen (per token) + lambda * odds-ratio loss
            mc, mr = pc / COUNTS[i], pr / COUNTS[i + 2]
            odds_c, odds_r = math.exp(mc) / (1 - math.exp(mc)), math.exp(mr) / (1 - math.exp(mr))
            out.append(-mc - beta * math.log(sigmoid(math.log(odds_c / odds_r))))
    return out


@pytest.mark.parametrize(
    ("kind", "beta", "gamma"), [("sigmoid", 0.1, 0.0), ("ipo", 0.1, 0.0), ("simpo", 2.0, 1.0), ("orpo", 0.1, 0.0)]
)
def test_each_loss_equals_its_papers_formula(kind, beta, gamma):
    losses, chosen, rejected = preference_loss(
        kind,
        beta,
        gamma,
        torch.tensor(POLICY, dtype=torch.float64),
        torch.tensor(COUNTS, dtype=torch.float64),
        torch.tensor(REFERENCE, dtype=torch.float64),
    )
    assert losses.tolist() == pytest.approx(by_hand(kind, beta, gamma), rel=1e-12)
    if kind in ("sigmoid", "ipo"):  # the implicit rewards: beta * log(pi / pi_ref)
        assert chosen.tolist() == pytest.approx([beta * (POLICY[i] - REFERENCE[i]) for i in range(2)])
        assert rejected.tolist() == pytest.approx([beta * (POLICY[i + 2] - REFERENCE[i + 2]) for i in range(2)])


def test_the_paper_defaults_apply_when_beta_is_not_given():
    losses = ("sigmoid", "ipo", "simpo", "orpo")
    strengths = {loss: build_config({"preference_loss": loss}).preference.strength for loss in losses}
    assert strengths == {"sigmoid": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}
    assert build_config({"preference_loss": "simpo", "beta": "2.5"}).preference.strength == 2.5


# ---------------------------------------------------------------- pairs and tokens


def test_the_three_formats_give_the_same_pair():
    explicit = {"prompt": "Q?", "chosen": "Yes.", "rejected": "No."}
    implicit = {
        "chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "Yes."}],
        "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "No."}],
    }
    expected = to_pair(conversational("Q?", "Yes.", "No."), PairColumns("prompt", "chosen", "rejected"))
    assert to_pair(explicit, PairColumns("prompt", "chosen", "rejected")) == expected
    assert to_pair(implicit, PairColumns(None, "chosen", "rejected")) == expected
    # implicit strings: the common prefix, cut before the space that starts the answers (TRL's rule)
    prompt, chosen, rejected = to_pair(
        {"chosen": "The sky is blue.", "rejected": "The sky is green."}, PairColumns(None, "chosen", "rejected")
    )
    assert (prompt[0]["content"], chosen[0]["content"], rejected[0]["content"]) == ("The sky is", " blue.", " green.")


def test_only_the_answer_and_its_end_of_turn_token_are_targets(chat):
    row = conversational(*QUESTIONS[0])
    encoded = encode_pair(chat, row, PairColumns("prompt", "chosen", "rejected"))
    for side, answer in (("chosen", QUESTIONS[0][1]), ("rejected", QUESTIONS[0][2])):
        ids, mask = encoded[f"{side}_ids"], encoded[f"{side}_mask"]
        assert chat.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == f"{answer}<|im_end|>"
        assert chat.tokenizer.decode(ids).startswith("<|im_start|>user\nWho found the golden key?")


HH = "\n\nHuman: Who found the golden key?\n\nAssistant:"


@pytest.mark.parametrize(
    "chosen, rejected, answers",
    [
        ("Q: Who found the key? A: The answer is the poor boy", "Q: Who found the key? A: The answer is the wolf",
         (" poor boy", " wolf")),
        (f"{HH} The poor boy in the snow.", f"{HH} A wolf in the forest.",
         (" The poor boy in the snow.", " A wolf in the forest.")),
    ],
    ids=["shared answer words", "an HH-RLHF transcript"],
)  # fmt: skip
def test_implicit_string_pairs_are_trained_as_their_plain_text(chat, chosen, rejected, answers):
    """Found in audit: the common prefix became a user message under the chat template, so shared answer words
    ("The answer is the") moved into the user's turn and HH transcripts were wrapped in ChatML headers; TRL, and
    now cloudtrain, train the text itself: its tokens, then EOS, the loss on the differing answers and EOS."""
    encoded = encode_pair(chat, {"chosen": chosen, "rejected": rejected}, PairColumns(None, "chosen", "rejected"))
    tokenizer, eos = chat.tokenizer, chat.tokenizer.eos_token
    for side, text, answer in (("chosen", chosen, answers[0]), ("rejected", rejected, answers[1])):
        ids, mask = encoded[f"{side}_ids"], encoded[f"{side}_mask"]
        assert tokenizer.decode(ids) == text + eos  # the data's text, no template
        assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == answer + eos


def test_an_answer_of_several_assistant_messages_trains_each_as_sft_takes_the_conversation(chat):
    """Found in audit: one span over the whole answer ended its targets at the first end-of-turn token, so a pair
    whose answers share their first message trained nothing (loss 0.6931 at every step)."""
    think = {"role": "assistant", "content": "Let me think."}
    row = {
        "prompt": [{"role": "user", "content": "Who found the golden key?"}],
        "chosen": [think, {"role": "assistant", "content": "A poor boy."}],
        "rejected": [think, {"role": "assistant", "content": "A king."}],
    }
    encoded = encode_pair(chat, row, PairColumns("prompt", "chosen", "rejected"))
    for side, last in (("chosen", "A poor boy."), ("rejected", "A king.")):
        ids, mask = encoded[f"{side}_ids"], encoded[f"{side}_mask"]
        targets = chat.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert targets == f"Let me think.<|im_end|>{last}<|im_end|>"  # no header between them, no prompt
        assert (ids, mask) == chat.encode(row["prompt"] + row[side])  # SFT's own targets of the conversation


def test_truncation_drops_and_counts_pairs_that_lose_an_answer():
    rows = {
        "chosen_ids": [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7]],
        "chosen_mask": [[0, 0, 1, 1], [0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1]],
        "rejected_ids": [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 8]],
        "rejected_mask": [[0, 0, 1], [0, 0, 0, 0, 1], [0, 0, 1, 1, 1]],
    }
    copy = {name: [list(r) for r in value] for name, value in rows.items()}
    keep, cut = truncate_pairs(rows, 4)  # the third pair's answers differ past the cut: one answer, no gradient
    assert keep == [0] and cut == 2
    assert truncate_pairs(copy, 4, distinct=False) == ([0, 2], 2)  # ORPO: its SFT term trains the chosen side
    from cloudtrain.tasks.dpo import cut_notes

    report = {"train": {"truncated": 2, "dropped": 1}, "validation": {"truncated": 0, "dropped": 3}}
    assert cut_notes(report, 4) == [  # a drop without a cut is said too (found in review: a trimming template)
        "2 train pairs cut to --max_length 4, 1 train pairs dropped (an answer lost every token, or both are the "
        "same tokens)",
        "3 validation pairs dropped (an answer lost every token, or both are the same tokens)",
    ]
    assert rows["chosen_ids"][1] == [1, 2, 3, 4]


def test_prompt_tokens_get_exactly_zero_gradient(chat, tiny_llama_dir):
    model = load_base(tiny_llama_dir, chat.tokenizer)
    columns = PairColumns("prompt", "chosen", "rejected")
    batch = PairCollator(0)([encode_pair(chat, conversational(*row), columns) for row in QUESTIONS[:2]])
    logits = model(input_ids=batch["input_ids"], attention_mask=segment_mask(batch["segments"], False),
                   position_ids=batch["position_ids"]).logits  # fmt: skip
    logits.retain_grad()
    logps, counts = answer_logps(logits, batch)  # what pair_logps does after the forward
    losses, _, _ = preference_loss("simpo", 2.0, 1.0, logps, counts, None)
    losses.sum().backward()
    # the positions whose logits predict an answer token: nothing else may get gradient
    offset = logits.shape[1] - len(batch["answer_window"])
    sources = torch.zeros(logits.shape[:2], dtype=torch.bool)
    for answer, row in enumerate(batch["rows"].tolist()):
        valid = batch["targets"][answer] != -100
        sources[row, batch["sources"][answer][valid] + offset] = True
    gradient = logits.grad.abs().sum(dim=-1)
    assert counts.sum() > 0 and sources.sum() <= counts.sum()  # a shared answer token is one position for two
    assert torch.all(gradient[~sources] == 0) and torch.all(gradient[sources] > 0)


def alone(model, chat, row: dict) -> list[float]:
    """Each answer's summed log-probability from its own unpadded forward: [chosen, rejected]."""
    encoded = encode_pair(chat, row, PairColumns("prompt", "chosen", "rejected"))
    out = []
    for side in ("chosen", "rejected"):
        ids, mask = (
            torch.tensor(encoded[f"{side}_ids"]),
            torch.tensor(encoded[f"{side}_mask"], dtype=torch.bool),
        )
        logps = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        out.append(float(logps[mask[1:]].sum()))
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_forward_over_a_shared_prompt_gives_each_answers_own_values(chat, tiny_llama_dir, attention):
    """The shared-prompt layout (each prompt once, the rejected answer masked from the chosen one, its positions
    restarted) and the separate rows, with and without the LM head's window, against each answer's own forward.
    One pair's answers share their first words, so shared answer tokens count for both."""
    model = load_base(tiny_llama_dir, chat.tokenizer)
    model.set_attn_implementation(attention)
    rows = [conversational(*q) for q in QUESTIONS] + [conversational("Who ate?", "The wolf ate.", "The wolf slept.")]
    encoded = [encode_pair(chat, row, PairColumns("prompt", "chosen", "rejected")) for row in rows]
    shared, separate = PairCollator(0)(encoded), PairCollator(0, shared=False)(encoded)
    assert shared["input_ids"].numel() < 0.75 * separate["input_ids"].numel()  # the prompts once, not twice
    assert 0 < len(shared["answer_window"]) < shared["input_ids"].shape[1]  # the prompts are left out
    with torch.no_grad():
        expected = [alone(model, chat, row) for row in rows]
        expected = [e[0] for e in expected] + [e[1] for e in expected]  # chosen, then rejected
        for batch in (shared, separate):
            for window in (True, False):
                logps, counts = pair_logps(model, batch, window=window, additive=attention == "eager")
                assert logps.tolist() == pytest.approx(expected, rel=1e-5)
                assert counts.tolist() == [sum(e[f"{side}_mask"][1:]) for side in SIDES for e in encoded]


@pytest.mark.parametrize("kind", ["mistral", "lfm2"])
def test_a_sliding_window_or_a_recurrent_layer_takes_separate_rows(chat, kind):
    """The shared layout's 4D mask replaces the model's own, sliding window included: a Mistral with a 4-token
    window scored each answer as if it had none (found in audit); an LFM2's convolutions (Jamba's, Qwen3-Next's
    state spaces) ignore the mask, and its rejected answer read the chosen one (found in review). Separate rows."""
    from transformers import AutoModelForCausalLM, Lfm2Config, MistralConfig

    from cloudtrain.tasks.dpo import separate_rows_reason

    torch.manual_seed(0)
    sizes = dict(vocab_size=len(chat.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)  # fmt: skip
    if kind == "mistral":
        config = MistralConfig(sliding_window=4, **sizes)
        said = "the model's sliding window of 4 tokens is shorter than --max_length 64"
    else:
        config = Lfm2Config(layer_types=["conv", "full_attention"], **sizes)
        said = "the model's conv layers read the tokens before them whatever the mask says"
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    assert separate_rows_reason(model, 64) == said
    assert (separate_rows_reason(model, 4) is None) == (kind == "mistral")  # no answer outgrows the window
    rows = [conversational(*q) for q in QUESTIONS]
    encoded = [encode_pair(chat, row, PairColumns("prompt", "chosen", "rejected")) for row in rows]
    with torch.no_grad():
        expected = [alone(model, chat, row) for row in rows]
        expected = [e[0] for e in expected] + [e[1] for e in expected]
        separate, _ = pair_logps(model, PairCollator(0, shared=False)(encoded), window=True, additive=False)
        shared, _ = pair_logps(model, PairCollator(0)(encoded), window=True, additive=False)
    assert separate.tolist() == pytest.approx(expected, rel=1e-5)
    assert shared.tolist() != pytest.approx(expected, rel=1e-3)  # what the shared layout would have trained on


# ---------------------------------------------------------------- the reference


def test_the_adapters_disabled_reference_equals_the_frozen_base(chat, tiny_llama_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    task = DPOTask(build_config({"task": "dpo", "mixed_precision": "no"}))
    columns = PairColumns("prompt", "chosen", "rejected")
    batch = PairCollator(0)([encode_pair(chat, conversational(*row), columns) for row in QUESTIONS])
    base = load_base(tiny_llama_dir, chat.tokenizer)
    expected = pair_logps(base, batch, window=task.window)[0]
    lora = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    policy = get_peft_model(load_base(tiny_llama_dir, chat.tokenizer), lora).train()
    with torch.no_grad():
        assert not torch.allclose(pair_logps(policy, batch)[0], expected)  # the adapters change the policy
    assert torch.equal(task.reference_logps(policy, batch), expected)
    assert policy.training  # the reference's eval mode is the reference's only


def test_precomputed_reference_equals_the_live_reference(tiny_llama_dir, pairs_file, tmp_path):
    run = build_run(
        build_config(dpo_options(tiny_llama_dir, pairs_file, tmp_path / "out", precompute_reference="true"))
    )
    precomputed_rng = torch.random.get_rng_state()
    assert run.task.reference is None  # nothing kept
    batch = run.data.collator([run.data.train[i] for i in range(len(run.data.train))])
    base = load_base(tiny_llama_dir, run.tokenizer)
    with torch.no_grad():
        live = pair_logps(base, batch)[0]
    assert batch["ref_logps"].tolist() == pytest.approx(live.tolist(), abs=1e-4)

    live_run = build_run(build_config(dpo_options(tiny_llama_dir, pairs_file, tmp_path / "live")))
    # the pass drew nothing from the seeded generator: adapters, dropout and the batches are those of a live run
    assert torch.equal(torch.random.get_rng_state(), precomputed_rng)
    live_batch = live_run.data.collator([live_run.data.train[i] for i in range(len(live_run.data.train))])
    assert live_run.task.reference is not None
    assert live_run.task.reference_logps(live_run.model, live_batch).tolist() == pytest.approx(
        batch["ref_logps"].tolist(), abs=1e-4
    )
    # the rows a checkpoint records are those processed, before the reference's columns: a resume of either run
    # on the same data is not told its data differs (the audit saw that note on every precomputed resume)
    assert run.trained_on == live_run.trained_on and run.trained_on["rows"] == len(run.data.train)
    assert {**data_record(run.data.train), "task": "dpo"} != run.trained_on  # what the columns added would give


# ---------------------------------------------------------------- refusals


def test_bad_input_is_refused_in_one_line_before_training(tiny_llama_dir, tiny_model_dir, pairs_file, tmp_path, capsys):
    out = tmp_path / "out"

    def data(name: str, rows: list[dict]) -> str:
        return write_jsonl(tmp_path / f"{name}.jsonl", rows)

    equal = data("equal", [conversational("Q?", "Same.", "Same.")] * 4)
    no_prefix = data(
        "no-prefix",
        [
            {
                "chosen": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "x"}],
                "rejected": [{"role": "user", "content": "B?"}, {"role": "assistant", "content": "y"}],
            }
        ]
        * 4,
    )
    empty = data("empty", [{"prompt": "Q?", "chosen": " ", "rejected": "No."}] * 4)  # it would teach stopping
    # one text begins the other: the shorter answer ("Yes") would become part of the prompt, its side empty
    prefix = data("prefix", [{"chosen": "Is the king old? Yes", "rejected": "Is the king old? Yes, very."}] * 4)
    base = {"model_name_or_path": tiny_llama_dir, "output_dir": str(out), "task": "dpo", "report_to": "none"}
    cases = {
        "an empty chosen answer": (
            {**base, "train_file": empty},
            f"train pair 1 (the 1st record of {empty}): its 'chosen' answer is empty",
        ),
        # found in audit: "train pair 6" for the bad record on line 7, counted from 0 across a folder's files
        "a bad record in a folder's second file": (
            {**base, "train_file": channel(tmp_path, pairs_file)},
            f"train pair 7 (the 3rd record of {tmp_path / 'channel' / 'b.jsonl'}): its 'chosen' answer is empty",
        ),
        "one text begins the other": ({**base, "train_file": prefix}, "the prompt cannot be told from the answers"),
        "missing column": (
            {**base, "train_file": pairs_file, "rejected_column": "worse"},
            "column 'worse' is not in the train data",
        ),
        "chosen equals rejected": ({**base, "train_file": equal}, "chosen and rejected answers are equal"),
        "no shared prefix": ({**base, "train_file": no_prefix}, "share no first message"),
        "every answer truncated away": (
            {**base, "train_file": pairs_file, "validation_file": pairs_file, "max_length": "8"},
            "lose an answer, or all that tells their answers apart, within --max_length 8",
        ),
        "an encoder": ({**base, "model_name_or_path": tiny_model_dir, "train_file": pairs_file}, "--task reward"),
        # found in audit: transformers' own "Unrecognized model ... Should have a model_type key"
        "an SFT LoRA output": (
            {**base, "model_name_or_path": lora_output(tmp_path, tiny_llama_dir), "train_file": pairs_file},
            "holds an adapter, not a model: give its merge with the base (cloudtrain merge --model_dir",
        ),
    }
    assert_each_refused(cases, capsys, out)


def channel(tmp_path, pairs_file: str) -> str:
    """A SageMaker-channel-like folder of two files, a.jsonl (4 good pairs) then b.jsonl whose 3rd pair has an
    empty chosen answer."""
    folder = tmp_path / "channel"
    folder.mkdir()
    good = [conversational(*row) for row in QUESTIONS]
    write_jsonl(folder / "a.jsonl", good)
    write_jsonl(folder / "b.jsonl", [*good[:2], conversational("Q?", " ", "No."), good[3]])
    return str(folder)


def test_ordinals_name_a_pair_as_a_user_counts():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th",
    ]  # fmt: skip


def lora_output(tmp_path, base: str) -> str:
    """A --peft run's output as far as a loader sees it: an adapter's config naming its base, no config.json."""
    folder = tmp_path / "lora"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    return str(folder)


# ---------------------------------------------------------------- a run


def test_dpo_turns_the_models_dropout_off_so_the_policy_starts_as_the_reference(
    tiny_llama_dir, pairs_file, tmp_path, capsys
):
    """With dropout in the model's config the policy scored pairs with it, the reference without: step 1's loss
    was not log 2 and the rewards were noise around a policy equal to its reference (found in audit)."""
    import shutil

    model = tmp_path / "dropout-llama"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    out = tmp_path / "out"
    run_training(build_config(dpo_options(str(model), pairs_file, out, max_steps=1, num_sample_prompts=0)))
    assert "note: the model's dropout is off" in capsys.readouterr().out
    (first,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert first["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)


def test_dpo_trains_logs_its_rewards_and_saves_a_chat_model(tiny_llama_dir, pairs_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    results = run_training(build_config(dpo_options(tiny_llama_dir, pairs_file, out, max_steps=6)))
    printed = capsys.readouterr().out
    assert "rewards/margins" in printed and "reference model: a frozen copy" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/rewards/margins" in r]
    assert len(train) == 6
    assert train[-1]["train/rewards/margins"] > train[0]["train/rewards/margins"]  # it learns the preference
    assert train[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert train[0]["train/loss"] == pytest.approx(math.log(2), rel=1e-6)  # -log sigmoid(0), averaged over pairs
    evaluation = results["eval"]
    assert evaluation["samples"] == 4 and evaluation["rewards/accuracies"] == 1.0
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "exact_match"} <= set(evaluation)
    assert evaluation["logps/accuracies"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # a share of the 4 pairs
    first = evaluation["generations"][0]  # the printed answers show the chosen one beside them, as SFT's do
    assert f"-> {json.dumps(first['answer'])} (chosen {json.dumps(first['reference'])})" in printed
    assert any(r.get("eval/rewards/accuracies") == 1.0 for r in records)
    curves = curve_data(records)
    preference = set(curves["reward margins"]) | set(curves["pair accuracy"])  # the curves plot's panels of their own
    assert preference == {
        f"{split}/rewards/{name}" for split in ("train", "eval") for name in ("margins", "accuracies")
    }
    assert (out / "training_curves.png").is_file()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>" in tokenizer.chat_template
    AutoModelForCausalLM.from_pretrained(out)

    # `generate` talks to it through its chat template: in the terminal, and for a prompt
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("Who found the golden key?\nAnd then?\n/exit\n"))
    assert main(["generate", "--model_dir", str(out), "--chat", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.count("assistant> ") == 2
    assert (
        main(["generate", "--model_dir", str(out), "--prompt", "Who found the golden key?", "--max_new_tokens", "3"])
        == 0
    )
    assert capsys.readouterr().out.startswith("Who found the golden key?\n")


def test_no_sample_answers_is_said_when_no_prompt_leaves_room_for_one(tiny_llama_dir, pairs_file, tmp_path, capsys):
    options = dpo_options(tiny_llama_dir, pairs_file, tmp_path / "out", max_steps=1, sample_max_new_tokens=60)
    results = run_training(build_config(options))
    assert "exact_match" not in results["eval"] and not results["eval"].get("generations")
    assert (
        "note: no validation prompt fits in 4 tokens (--max_length 64 less --sample_max_new_tokens 60), so "
        "evaluations show no sample answers or exact_match" in capsys.readouterr().out
    )
    best = {
        **options,
        "metric_for_best_model": "exact_match",
        "num_sample_prompts": 2,
        "output_dir": str(tmp_path / "b"),
    }
    with pytest.raises(UserError, match=r"^--metric_for_best_model exact_match: no validation prompt fits in 4 tokens"):
        run_training(build_config(best))  # before training: it crashed at the first checkpoint
    assert not (tmp_path / "b").exists()


def test_a_reference_from_whole_weights_is_refused_under_sharding_in_one_line(tiny_llama_dir):
    """Under ZeRO-3 the full-fine-tuning copy and the precomputed reference are refused; under FSDP2 only the
    precomputed one (the copy is sharded as the policy); the live reference of LoRA (the base) passes both."""
    from cloudtrain.tasks import build_task

    base = {"task": "dpo", "model_name_or_path": tiny_llama_dir}
    refused = {
        "ZeRO-3 with full fine-tuning: the reference copy would be whole": {"zero_stage": 3},
        "ZeRO-3 with --precompute_reference true: the reference is computed from whole weights": {
            "zero_stage": 3, "precompute_reference": True, "peft": "lora"},
        "FSDP with --precompute_reference true: the reference is computed from whole weights": {
            "fsdp": True, "precompute_reference": True},
    }  # fmt: skip
    for message, extra in refused.items():
        cfg = build_config({**base, **extra})
        with pytest.raises(UserError, match=f"under {message}") as refusal:
            build_task(cfg).check_options(cfg)
        assert "\n" not in str(refusal.value)
    for extra in ({"fsdp": True}, {"zero_stage": 3, "peft": "lora"}, {"fsdp": True, "peft": "lora"}):
        cfg = build_config({**base, **extra})
        build_task(cfg).check_options(cfg)


@pytest.mark.parametrize("task", ["dpo", "reward"])
def test_packing_on_a_pair_task_is_only_noted_as_unused(task, tiny_llama_dir, tiny_model_dir):
    """Pairs are padded, so --packing is one of the options such a run does not use: a note said so, then a
    refusal stopped the run all the same (left alone in an earlier audit)."""
    from cloudtrain.config.inert import inert_notes
    from cloudtrain.tasks import build_task

    cfg = build_config(
        {"task": task, "model_name_or_path": tiny_llama_dir if task == "dpo" else tiny_model_dir, "packing": "wrapped"}
    )
    build_task(cfg).check_options(cfg)
    assert f"--packing wrapped has no effect on --task {task}; it counts for --task causal_lm or sft" in inert_notes(
        cfg
    )


def test_a_dpo_model_of_plain_text_pairs_is_saved_without_a_chat_template(tiny_llama_dir, tmp_path):
    """Found in review: plain-text pairs trained no template, but the run saved ChatML's, so the hinted `generate`
    wrapped prompts in headers the model never saw. (Its tokens stay: a checkpoint's embeddings count them.)"""
    turns = [(f"\n\nHuman: {q}\n\nAssistant:", f" {c}", f" {r}") for q, c, r in QUESTIONS]
    train = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": p + c, "rejected": p + r} for p, c, r in turns])
    out = tmp_path / "out"
    run_training(build_config(dpo_options(tiny_llama_dir, train, out, max_steps=2)))
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    assert not (out / "chat_template.jinja").exists()
