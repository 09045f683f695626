"""--task sft on CPU with tiny random decoders: which tokens are trained, the chat template saved and
reproduced at inference, packing, an overfit-then-generate run, the chat terminal, and every refusal."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ENTRY, REPO, assert_each_refused, run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from cloudtrain.config import build_config
from cloudtrain.data.chat import CHATML, ChatFormat, Columns, to_messages
from cloudtrain.data.packing import IGNORE_INDEX, CausalLMCollator, causal_lm_forward, pack_examples, shifted_loss
from cloudtrain.errors import UserError
from cloudtrain.pipeline import build_run, run_training
from cloudtrain.tasks import build_task

# Answers of several tokens each, distinct, so "answers exactly and stops" means something.
CHATS = [
    ("Who found the golden key?", "The poor boy in the snow."),
    ("What did the wolf eat?", "Six little goats and chalk."),
    ("Where did the king live?", "In a castle by the sea."),
    ("How many brothers were there?", "Twelve brothers and a sister."),
]
MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a tale."},
    {"role": "assistant", "content": "The frog king."},
    {"role": "user", "content": "And another?"},
    {"role": "assistant", "content": "Rapunzel."},
]


@pytest.fixture
def chat(lm_tokenizer_dir) -> ChatFormat:
    return ChatFormat.setup(AutoTokenizer.from_pretrained(lm_tokenizer_dir), "chatml")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def chats_file(tmp_path) -> str:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in CHATS]
    return write_jsonl(tmp_path / "chats.jsonl", rows)


def sft_options(model_dir, train_file, out, **overrides) -> dict:
    return {
        "task": "sft",
        "model_name_or_path": model_dir,
        "train_file": train_file,
        "validation_file": train_file,
        "output_dir": str(out),
        "max_length": 64,
        "per_device_train_batch_size": 4,
        "max_steps": 4,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "mixed_precision": "no",
        "report_to": ["none"],
        "sample_max_new_tokens": 12,
        **overrides,
    }


def trained_text(chat: ChatFormat, ids: list[int], mask: list[int]) -> list[str]:
    """The runs of trained tokens, decoded (special tokens kept)."""
    runs, current = [], []
    for token, keep in zip(ids, mask, strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(chat.tokenizer.decode(current))
            current = []
    return runs + ([chat.tokenizer.decode(current)] if current else [])


# ---------------------------------------------------------------- which tokens are trained


def test_every_assistant_turn_and_its_end_of_turn_token_are_trained_and_nothing_else(chat):
    ids, mask = chat.encode(MULTI_TURN)
    # the newline after <|im_end|> is the template's: never generated, so never trained
    assert trained_text(chat, ids, mask) == ["The frog king.<|im_end|>", "Rapunzel.<|im_end|>"]
    end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id == end
    # <|im_end|> closes the system and user turns too: those are not trained.
    assert [m for token, m in zip(ids, mask, strict=True) if token == end] == [0, 0, 1, 0, 1]
    assert chat.tokenizer.decode(ids) == chat.render(MULTI_TURN)


def with_template(tokenizer_dir: str, template: str) -> ChatFormat:
    path = Path(tokenizer_dir).parent / f"template-{abs(hash(template))}.jinja"
    path.write_text(template)
    return ChatFormat.setup(AutoTokenizer.from_pretrained(tokenizer_dir), str(path))


def test_a_generation_prompt_the_answer_merges_with_is_refused(lm_tokenizer_dir):
    """A generation prompt ending in a space: byte-level BPE merges it into the answer's first token, which was
    trained (' I'), while inference fed the prompt's lone ' ' that training never showed (found in audit)."""
    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    refused = r"^the chat template .* prompt with ' ', which the answer's first token takes in \(' p'\)"
    with pytest.raises(UserError, match=refused):
        with_template(lm_tokenizer_dir, template + "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    chat = with_template(lm_tokenizer_dir, template + "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
    ids, mask = chat.encode([{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "I am the king."}])
    assert trained_text(chat, ids, mask) == [" I am the king.<|endoftext|>"]


def test_a_chatml_file_on_a_tokenizer_without_its_tokens_says_so(lm_tokenizer_dir):
    """Found in audit: chatml's text as a --chat_template file on a tokenizer lacking <|im_end|> was refused for
    ending turns "with no special token", not saying the tokenizer lacks that token."""
    chatml_text = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    lacking = r"\(<\|im_end\|> is not a token of this tokenizer: --chat_template chatml adds chatml's\)"
    with pytest.raises(UserError, match=lacking):
        with_template(lm_tokenizer_dir, chatml_text)
    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"])  # there, but not special (review)
    path = Path(lm_tokenizer_dir).parent / "chatml-text.jinja"
    path.write_text(chatml_text)
    with pytest.raises(UserError, match=r"\(<\|im_end\|> is not a special token of this tokenizer"):
        ChatFormat.setup(tokenizer, str(path))


def test_a_template_that_rewrites_earlier_turns_gives_one_example_per_answer(lm_tokenizer_dir):
    """Like Qwen3 dropping earlier reasoning: each answer is trained as inference renders its prompt."""
    chat = with_template(
        lm_tokenizer_dir,
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ 'assistant: (earlier)' + eos_token }}{% else %}{{ m['role'] + ': ' + "
        "m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}",
    )
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        chat.encode(MULTI_TURN)
    examples = chat.examples(MULTI_TURN)
    assert [trained_text(chat, ids, mask) for ids, mask in examples] == [
        [" The frog king.<|endoftext|>"],
        [" Rapunzel.<|endoftext|>"],
    ]
    assert "(earlier)" in chat.tokenizer.decode(examples[1][0])


REWRITING = (  # Qwen3-like: earlier answers are rendered otherwise, so each answer is an example of its own
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ 'assistant: (earlier)' + eos_token }}{% else %}{{ m['role'] + ': ' + "
    "m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def test_a_carved_split_and_sample_limits_count_conversations_and_evaluation_answers(lm_tokenizer_dir, tmp_path):
    """Two examples per conversation: the carve and --max_train_samples pick conversations, every answer of a
    conversation lands in its split, and no conversation is in both (the carve once mixed examples and rows)."""
    from datasets import Dataset, DatasetDict

    template = tmp_path / "rewriting.jinja"
    template.write_text(REWRITING)
    chats = [
        [{"role": "user", "content": f"Q{i}a"}, {"role": "assistant", "content": f"A{i}x"},
         {"role": "user", "content": f"Q{i}b"}, {"role": "assistant", "content": f"A{i}y"}]
        for i in range(20)
    ]  # fmt: skip
    raw = DatasetDict({"train": Dataset.from_list([{"messages": chat} for chat in chats])})

    def answers(rows) -> set[str]:
        text = " ".join(tokenizer.decode(r["input_ids"]) for r in rows)
        return {f"A{i}{k}" for i in range(20) for k in "xy" if f"A{i}{k}" in text}

    masks = {}
    for limit, trained, on_prompt in ((None, 15, False), (6, 6, False), (None, 15, True)):
        cfg = build_config(
            sft_options(lm_tokenizer_dir, None, tmp_path / "out", validation_file=None, chat_template=str(template),
                        validation_split_percentage=25, max_train_samples=limit, max_length=64, packing="none",
                        train_on_prompt=on_prompt)
        )  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
        data = build_task(cfg).process(raw, tokenizer, cfg)
        masks[limit, on_prompt] = {s: sum(map(sum, getattr(data, s)["loss_mask"])) for s in ("train", "validation")}
        train, validation = answers(data.train), answers(data.validation)
        assert len(train) == 2 * trained and len(validation) == 2 * 5 and not train & validation
        assert all(f"A{i}x" in split and f"A{i}y" in split for split in (train, validation) for i in range(20)
                   if f"A{i}x" in split)  # fmt: skip
        assert data.references and set(data.references) <= {a for a in validation if a.endswith("y")}
    # --train_on_prompt trains on every token; evaluation still measures the answers alone
    assert masks[None, True]["train"] > masks[None, False]["train"]
    assert masks[None, True]["validation"] == masks[None, False]["validation"]


def test_train_on_prompt_keeps_or_drops_an_example_by_its_answer(lm_tokenizer_dir, tmp_path):
    """--train_on_prompt kept examples whose answers --max_length cut off entirely, so nothing refused a length
    that left no answer, and the data line called every token an answer token (found in audit)."""
    from datasets import Dataset, DatasetDict

    long_question = " ".join(["the king and the frog went to the well"] * 8)
    chats = [[{"role": "user", "content": f"{long_question} {i}"}, {"role": "assistant", "content": f"A{i}"}]
             for i in range(8)]  # fmt: skip
    raw = DatasetDict({"train": Dataset.from_list([{"messages": chat} for chat in chats])})
    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    for on_prompt in (False, True):
        options = sft_options(lm_tokenizer_dir, None, tmp_path / "out", validation_file=None, chat_template="chatml",
                              validation_split_percentage=25, max_length=16, train_on_prompt=on_prompt,
                              packing="none")  # fmt: skip
        with pytest.raises(UserError, match="^6 of 6 train examples have no answer token within --max_length 16"):
            build_task(build_config(options)).process(raw, tokenizer, build_config(options))
    options = {**options, "max_length": 256}
    task = build_task(build_config(options))
    data = task.process(raw, tokenizer, build_config(options))
    said = task.describe_data(data)
    trained = sum(map(sum, data.train["loss_mask"]))
    assert "6 train examples in 6 rows (" in said and f"answer tokens, {trained - 6} trained of " in said, said


def test_a_template_without_a_generation_prompt_serves_a_model_that_only_scores(lm_tokenizer_dir, tmp_path):
    """A reward model reads the header as input and never generates: its template needs no such branch (the refusal
    meant for sft and dpo stopped reward runs; found in review)."""
    template = tmp_path / "no_generation_prompt.jinja"
    template.write_text(CHATML.split("{% if add_generation_prompt %}")[0])
    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    with pytest.raises(UserError, match="writes the assistant's header"):
        ChatFormat.setup(tokenizer, str(template))
    scoring = ChatFormat.setup(tokenizer, str(template), generates=False)
    assert scoring.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_an_end_of_turn_token_outside_the_special_tokens_map_is_found(lm_tokenizer_dir):
    """Llama-3's <|eot_id|> is an added special token that the special-tokens map does not list."""
    from tokenizers import AddedToken

    tokenizer = AutoTokenizer.from_pretrained(lm_tokenizer_dir)
    tokenizer.add_tokens([AddedToken("<|eot_id|>", special=True)])
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    chat = ChatFormat.setup(tokenizer, None)
    assert chat.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|eot_id|>")


def test_prompt_tokens_contribute_exactly_zero_loss_and_gradient(chat, tiny_llama_dir):
    ids, mask = chat.encode(MULTI_TURN)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.resize_token_embeddings(len(chat.tokenizer))
    batch = CausalLMCollator(0)([{"input_ids": ids, "seq_lengths": [len(ids)], "loss_mask": mask}])
    logits = causal_lm_forward(model, batch)
    logits.retain_grad()
    loss, count = shifted_loss(logits, batch["labels"])
    loss.backward()
    targets = torch.tensor(mask[1:], dtype=torch.bool)  # position t predicts token t + 1
    assert count == targets.sum() == sum(mask[1:]) > 0
    gradient = logits.grad[0, :-1].abs().sum(dim=-1)
    assert torch.all(gradient[~targets] == 0) and torch.all(gradient[targets] > 0)
    by_hand = F.cross_entropy(logits[0, :-1][targets], torch.tensor(ids[1:])[targets], reduction="sum")
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_the_data_formats_give_the_same_conversation():
    expected = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q\n\nextra"},
        {"role": "assistant", "content": "A"},
    ]
    sharegpt = {"conversations": [{"from": "human", "value": "Q\n\nextra"}, {"from": "gpt", "value": "A"}]}
    assert to_messages(sharegpt, Columns("conversations", ("conversations",)), "S") == expected
    assert (
        to_messages(
            {"prompt": "Q\n\nextra", "completion": "A"}, Columns("prompt_completion", ("prompt", "completion")), "S"
        )
        == expected
    )
    alpaca = {"instruction": "Q", "input": "extra", "output": "A"}
    assert to_messages(alpaca, Columns("alpaca", ("instruction", "input", "output")), "S") == expected


def test_packed_and_unpacked_examples_have_equal_losses(chat, tiny_llama_dir):
    examples = [
        chat.encode([{"role": "user", "content": q}, {"role": "assistant", "content": a}]) for q, a in CHATS
    ] + [chat.encode(MULTI_TURN)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.resize_token_embeddings(len(chat.tokenizer))
    collate = CausalLMCollator(0)

    def per_example(packing: str) -> dict[tuple, float]:
        rows = pack_examples([ids for ids, _ in examples], [mask for _, mask in examples], 128, packing)
        losses = {}
        for row in rows:
            batch = collate([row])
            with torch.no_grad():
                logits = causal_lm_forward(model, batch)
            per_token = F.cross_entropy(
                logits[0, :-1], batch["labels"][0, 1:], ignore_index=IGNORE_INDEX, reduction="none"
            )
            start = 0
            for length in row["seq_lengths"]:
                losses[tuple(row["input_ids"][start : start + length])] = (
                    per_token[start : start + length - 1].sum().item()
                )
                start += length
        return losses

    alone, packed = per_example("none"), per_example("bfd")
    assert len(pack_examples([ids for ids, _ in examples], [m for _, m in examples], 128, "bfd")) < len(examples)
    assert alone.keys() == packed.keys() and len(alone) == len(examples)
    for key in alone:
        assert packed[key] == pytest.approx(alone[key], abs=1e-4)


# ---------------------------------------------------------------- runs


def test_overfit_then_generate_answers_exactly_and_stops(tiny_llama_dir, chats_file, tmp_path, capsys):
    """A tiny model learns four chats; the saved tokenizer's own apply_chat_template reproduces the training
    tokens, and generation from the saved folder answers each question exactly and stops at <|im_end|>."""
    out = tmp_path / "run"
    cfg = build_config(
        sft_options(
            tiny_llama_dir,
            chats_file,
            out,
            max_steps=60,
            learning_rate=1e-2,
            warmup_ratio=0.0,
            num_sample_prompts=4,
            sample_max_new_tokens=20,
            eval_strategy="no",
            test_file=chats_file,
        )
    )
    results = run_training(cfg)
    assert results["eval"]["exact_match"] == 1.0, results["eval"]["generations"]
    # the sample answers are the validation prompts': the test results had them too, as the test's exact_match
    assert "loss" in results["test"] and not {"exact_match", "generations"} & set(results["test"])
    printed = capsys.readouterr().out
    assert "grew the embeddings from" in printed and "<|im_start|>, <|im_end|>" in printed
    assert "exact_match 1.000 (4 answers)" in printed

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in model.generation_config.eos_token_id
    training = ChatFormat.setup(AutoTokenizer.from_pretrained(out), None)  # the saved template, as training used it
    for question, answer in CHATS:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        assert tokenizer.apply_chat_template(messages)["input_ids"] == training.encode(messages)[0]
        prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_tensors="pt")
        output = model.generate(**prompt, max_new_tokens=20)[0, prompt["input_ids"].shape[1] :]
        assert tokenizer.decode(output, skip_special_tokens=True) == answer
        assert output[-1] == end and len(output) < 20  # stopped at the end of its turn

    card = build_task(cfg).model_card(out, replace(cfg, hub=replace(cfg.hub, hub_model_id="me/tiny-chat")), results)
    assert card.data.pipeline_tag == "text-generation" and "apply_chat_template" in card.text
    assert "100.0% equal the reference" in card.text and "| The poor boy in the snow. |" in card.text


def test_a_prompt_completion_csv_with_bfd_packing_and_a_system_prompt(tiny_gpt2_dir, tmp_path, capsys):
    data = tmp_path / "pairs.csv"
    data.write_text("question,answer\n" + "".join(f'"{q}","{a}"\n' for q, a in CHATS * 3))
    results = run_training(
        build_config(
            sft_options(
                tiny_gpt2_dir,
                str(data),
                tmp_path / "run",
                prompt_column="question",
                completion_column="answer",
                packing="bfd",
                max_length=256,
                system_prompt="Answer briefly.",
                chat_template="zephyr",
                training_type="basic",
            )
        )
    )
    printed = capsys.readouterr().out
    assert "12 train examples in 3 rows" in printed and "template: zephyr; packing bfd" in printed
    assert results["eval"]["tokens"] > 0 and 0 <= results["eval"]["exact_match"] <= 1
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nQ<|endoftext|>\n<|assistant|>\n"


def test_truncation_is_counted_and_reported(tiny_llama_dir, tmp_path, capsys):
    long = [{"prompt": "word " * 80, "completion": "late"}]
    short = [{"prompt": q, "completion": a} for q, a in CHATS * 2]
    data = write_jsonl(tmp_path / "mixed.jsonl", long + short)
    run = build_run(build_config(sft_options(tiny_llama_dir, data, tmp_path / "run", sample_max_new_tokens=8)))
    printed = capsys.readouterr().out
    assert "cut to --max_length 64, 1 of them dropped (no answer token left)" in printed
    assert all(len(row) <= 64 for row in run.data.train["input_ids"])
    # the sample prompts skip the example whose prompt leaves no room for an answer within --max_length
    assert run.data.references == [a for _, a in CHATS[:3]]


@pytest.mark.slow  # a real run (about 10 s): the full tier's, to keep `make test-fast` under 3 minutes
def test_chat_in_the_terminal_keeps_history_and_resets(tiny_llama_dir, chats_file, tmp_path):
    out = tmp_path / "run"
    run_training(
        build_config(
            sft_options(tiny_llama_dir, chats_file, out, max_steps=2, eval_strategy="no", num_sample_prompts=0)
        )
    )
    proc = subprocess.run(
        [sys.executable, str(ENTRY), "generate", "--model_dir", str(out), "--chat", "--max_new_tokens", "3"],
        input=f"Who found the golden key?\n{'word ' * 300}\nAnd then?\n/reset\nHello\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("assistant> ") == 3 and "(history cleared)" in proc.stdout
    assert "(that message does not fit the model's context of 256 tokens" in proc.stdout  # and the chat went on
    single = run_cli(
        "generate", "--model_dir", str(out), "--prompt", "Who found the golden key?", "--max_new_tokens", "3"
    )
    assert single.returncode == 0 and single.stdout.startswith("Who found the golden key?\n")


# ---------------------------------------------------------------- refusals


def bad_inputs(tmp_path, tiny_llama_dir, chats_file) -> dict:
    """{case: (options, message)}: one line each, exit 2, nothing written."""
    not_a_list = write_jsonl(tmp_path / "str.jsonl", [{"messages": "hello"}])
    robot = write_jsonl(
        tmp_path / "robot.jsonl",
        [{"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "boop"}]}],
    )
    no_columns = tmp_path / "body.csv"
    no_columns.write_text("body\nonce upon a time\n")
    users_only = tmp_path / "users_only.jinja"
    users_only.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    no_generation_prompt = tmp_path / "no_generation_prompt.jinja"  # ChatML without its add_generation_prompt branch
    no_generation_prompt.write_text(CHATML.split("{% if add_generation_prompt %}")[0])
    spaced = tmp_path / "spaced.jinja"  # trained ' Once', where inference fed a lone ' ' (found in audit)
    spaced.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}{% else %}"
        "{{ 'Assistant: ' + m['content'] + eos_token + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
    )
    base = sft_options(tiny_llama_dir, chats_file, tmp_path / "out")
    return {
        "generation prompt the answer merges with": (
            {**base, "chat_template": str(spaced)},
            "ends its generation prompt with ' ', which the answer's first token takes in (' p')",
        ),
        "no model": ({**base, "model_name_or_path": None}, "--task sft needs a decoder"),  # it said causal_lm (audit)
        "messages not a list": (
            {**base, "train_file": not_a_list, "validation_file": None},
            "train example 0: column 'messages' holds str, not a list",
        ),
        "unknown role": ({**base, "train_file": robot, "validation_file": None}, "unknown role 'robot'"),
        "unknown template": ({**base, "chat_template": "llama9"}, "--chat_template llama9 is neither a shipped"),
        "template without an assistant": (
            {**base, "chat_template": str(users_only)},
            "does not render assistant messages",
        ),
        "template without a generation prompt": (  # the header was trained and exact_match always 0
            {**base, "chat_template": str(no_generation_prompt)},
            "writes the assistant's header ('<|im_start|>assistant') but its generation prompt does not",
        ),
        "no example columns": (
            {**base, "train_file": str(no_columns), "validation_file": None},
            "--task sft found no examples in the columns body",
        ),
        "a named column that is missing": ({**base, "messages_column": "dialog"}, "column 'dialog' is not in"),
        "wrapped packing": ({**base, "packing": "wrapped"}, "--task sft packs whole examples"),
        "exact_match without references": (
            {**base, "metric_for_best_model": "exact_match", "num_sample_prompts": 0},
            "--metric_for_best_model exact_match compares sample answers",
        ),
        "every answer truncated away": ({**base, "max_length": 8}, "have no answer token within --max_length 8"),
        "exact_match where no prompt leaves room for an answer": (  # it crashed at the first checkpoint
            {**base, "metric_for_best_model": "exact_match", "num_sample_prompts": 2, "sample_max_new_tokens": 62},
            "--metric_for_best_model exact_match: no validation prompt fits in 2 tokens (--max_length 64 less "
            "--sample_max_new_tokens 62), so evaluations show no sample answers or exact_match: raise --max_length "
            "or lower --sample_max_new_tokens, or pick loss",
        ),
    }


def test_no_sample_answers_is_said_when_no_prompt_leaves_room_for_one(tiny_llama_dir, chats_file, tmp_path, capsys):
    options = sft_options(tiny_llama_dir, chats_file, tmp_path / "out", max_steps=1, num_sample_prompts=2)
    results = run_training(build_config({**options, "sample_max_new_tokens": 62}))
    assert "exact_match" not in results["eval"] and not results["eval"].get("generations")
    assert "note: no validation prompt fits in 2 tokens (--max_length 64 less --sample_max_new_tokens 62)" in (
        capsys.readouterr().out
    )


def test_every_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, tiny_llama_dir, chats_file, capsys):
    assert_each_refused(bad_inputs(tmp_path, tiny_llama_dir, chats_file), capsys, tmp_path / "out")


def test_the_planner_plans_sft_as_a_causal_lm_and_launches_sft(tmp_path):
    """SFT holds the same memory as causal-LM training (logits included); the launch command keeps --task sft."""
    import argparse

    from cloudtrain import planning as planner

    plans = {}
    for task in ("causal_lm", "sft"):
        parser = argparse.ArgumentParser()
        planner.add_arguments(parser)
        plans[task] = planner.make_plan(
            parser.parse_args(
                [
                    "--task",
                    task,
                    "--model_config",
                    "llama-600m",
                    "--gpu_memory_gb",
                    "24",
                    "--max_length",
                    "2048",
                    "--mixed_precision",
                    "bf16",
                    "--output_dir",
                    str(tmp_path / task),
                ]
            )
        )
    assert [r["estimate"] for r in plans["sft"]["strategies"]] == [
        r["estimate"] for r in plans["causal_lm"]["strategies"]
    ]
    assert plans["sft"]["strategies"][0]["estimate"]["logits"] > 0
    assert "--task sft --model_config llama-600m" in plans["sft"]["recommendation"]["command"]
