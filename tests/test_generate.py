"""The `generate` command and `generate_texts`: greedy and sampled continuations of tiny random decoders.

The command (cloudtrain.commands.generate: its options and checks, then cloudtrain.generate.run) is driven through
a parser built here with its own add_arguments, stdout captured by capsys; tests patch the transformers classes
where cloudtrain.generate uses them.
"""

import logging
import re
import shutil
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from cloudtrain import generate
from cloudtrain.commands import generate as command
from cloudtrain.config import ConfigParser
from cloudtrain.errors import UserError
from cloudtrain.generate import generate_texts

PROMPTS = ["Once upon a time", "The frog said:"]


def parse(*argv: str):
    parser = ConfigParser(prog="generate")
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def load(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(
        model_dir
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models decode a token at a time: threads only add overhead (and contention on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load(tiny_llama_dir)


# ---------------------------------------------------------------- generate_texts


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_batched_greedy_answers_equal_one_at_a_time(fixture, request):
    """Left-padded batches (the sample answers of SFT evaluation) give each prompt's own continuation."""
    model, tokenizer = load(request.getfixturevalue(fixture))
    tokenizer.pad_token = tokenizer.eos_token  # as the training application loads it
    prompts = [*PROMPTS, "The", "Once upon a time there was a king who had three daughters"]
    alone = generate_texts(model, tokenizer, prompts, max_new_tokens=8)
    assert generate_texts(model, tokenizer, prompts, max_new_tokens=8, batch_size=3) == alone
    assert len(set(map(len, (tokenizer(p)["input_ids"] for p in prompts)))) > 2  # padding really happened


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_greedy_is_model_generate_new_text_only_and_keeps_train_mode(fixture, request):
    model, tokenizer = load(request.getfixturevalue(fixture))
    assert tokenizer.pad_token is None
    model.config.use_cache = False  # as training may leave it: generation still uses the cache
    seen_use_cache = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen_use_cache.append(kwargs.get("use_cache"))
        return forward(*args, **kwargs)

    model.forward = spy
    model.train()
    texts = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=12)
    assert model.training  # given back in train mode
    assert seen_use_cache and all(seen_use_cache)
    model.forward = forward
    assert generate_texts(model, tokenizer, PROMPTS, max_new_tokens=12) == texts  # deterministic

    model.eval()
    for prompt, text in zip(PROMPTS, texts, strict=True):
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(
            **inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id, use_cache=True
        )
        new_tokens = output[0, inputs["input_ids"].shape[1] :]
        assert len(new_tokens) > 0 and text == tokenizer.decode(new_tokens, skip_special_tokens=True)
        assert tokenizer.decode(output[0], skip_special_tokens=True) == prompt + text  # the prompt is not repeated
    assert not model.training
    generate_texts(model, tokenizer, PROMPTS[:1], max_new_tokens=2)
    assert not model.training  # an eval model stays in eval mode


def test_sampling_is_reproducible_with_a_seed_and_differs_from_greedy(llama):
    model, tokenizer = llama
    options = dict(max_new_tokens=12, do_sample=True, temperature=5.0, top_k=0, top_p=1.0)
    torch.manual_seed(0)
    first = generate_texts(model, tokenizer, PROMPTS, **options)
    torch.manual_seed(0)
    assert generate_texts(model, tokenizer, PROMPTS, **options) == first
    torch.manual_seed(1)
    assert generate_texts(model, tokenizer, PROMPTS, **options) != first
    greedy = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=12)
    assert first != greedy


def test_generate_texts_prints_and_warns_nothing(llama, capsys):
    """Training calls it at every evaluation: no output, no generation warnings (pad token, sampling flags)."""
    model, tokenizer = llama
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate_texts(model, tokenizer, PROMPTS, max_new_tokens=4)
            generate_texts(
                model,
                tokenizer,
                PROMPTS,
                max_new_tokens=4,
                do_sample=True,
                temperature=0.7,
                top_k=10,
                top_p=0.9,
                repetition_penalty=1.2,
            )
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [] and [str(w.message) for w in caught] == []
    assert capsys.readouterr() == ("", "")


def test_an_empty_prompt_starts_from_bos(llama):
    model, tokenizer = llama
    (text,) = generate_texts(model, tokenizer, [""], max_new_tokens=5)
    output = model.generate(
        torch.tensor([[tokenizer.bos_token_id]]), max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    assert text == tokenizer.decode(output[0, 1:], skip_special_tokens=True)


# ---------------------------------------------------------------- the command


def test_run_streams_each_prompt_and_its_continuation(tiny_llama_dir, llama, tmp_path, capsys, monkeypatch):
    model, tokenizer = llama
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("Hansel and Gretel\n\n   \nThe wolf knocked\n")
    prompts = PROMPTS + ["Hansel and Gretel", "The wolf knocked"]
    chunks = []

    class Recording(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            chunks.append(text)
            super().on_finalized_text(text, stream_end)

    monkeypatch.setattr(generate, "TextStreamer", Recording)
    command.run(
        parse(
            "--model_dir",
            tiny_llama_dir,
            "--prompt",
            PROMPTS[0],
            "--prompt",
            PROMPTS[1],
            "--input_file",
            str(prompts_file),
            "--max_new_tokens",
            "20",
            "--device",
            "cpu",
        )
    )
    out = capsys.readouterr().out

    texts = generate_texts(model, tokenizer, prompts, max_new_tokens=20)
    assert all(texts)
    assert out == f"\n{generate.SEPARATOR}\n".join(p + t for p, t in zip(prompts, texts, strict=True)) + "\n"
    # streamed: the continuations came through the streamer, in more pieces than one per prompt
    assert "".join(chunks) == "".join(texts)
    assert len([c for c in chunks if c]) > len(prompts)


def test_a_system_prompt_nothing_reads_is_noted(tiny_llama_dir, tmp_path, capsys):
    """--system_prompt with --raw true, or on a model without a chat template, was dropped without a word (found in
    audit): one note on stderr says why, as for sampling options without sampling; read, it says nothing."""
    chat = tmp_path / "chat"
    shutil.copytree(tiny_llama_dir, chat)
    tokenizer = AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(chat)
    common = ("--prompt", "Once", "--max_new_tokens", "2", "--device", "cpu", "--system_prompt", "Be brief")
    given = "note: --system_prompt 'Be brief' has no effect"
    for model_dir, extra, notes in (
        (tiny_llama_dir, (), [f"{given}: the model in {tiny_llama_dir} has no chat template to put it in; its "
         "prompts are continued as plain text"]),
        (str(chat), ("--raw", "true"),
         [f"{given} with --raw true (the prompts continue as plain text); leave out --raw"]),
        (str(chat), (), []),
    ):  # fmt: skip
        command.run(parse("--model_dir", model_dir, *common, *extra))
        assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")] == notes
    # --chat --raw: leaving out --raw is the way on for the model with a template, not for one without (audit)
    for model_dir, fix in ((str(chat), " (leave out --raw)"), (tiny_llama_dir, "; train one with --task sft, or")):
        with pytest.raises(UserError, match=re.escape(f"{model_dir} is not one{fix}")):
            command.run(parse("--model_dir", model_dir, "--chat", "--raw", "true"))


def test_run_samples_reproducibly_from_the_seed(tiny_llama_dir, llama, capsys):
    model, tokenizer = llama
    argv = [
        "--model_dir",
        tiny_llama_dir,
        "--prompt",
        PROMPTS[0],
        "--prompt",
        PROMPTS[1],
        "--max_new_tokens",
        "10",
        "--do_sample",
        "true",
        "--temperature",
        "3.0",
        "--top_k",
        "0",
        "--seed",
        "7",
        "--device",
        "cpu",
    ]
    command.run(parse(*argv))
    first = capsys.readouterr().out
    command.run(parse(*argv))
    assert capsys.readouterr().out == first
    expected = []
    for prompt in PROMPTS:  # seeded before each prompt
        torch.manual_seed(7)
        expected.append(
            prompt
            + generate_texts(model, tokenizer, [prompt], max_new_tokens=10, do_sample=True, temperature=3.0, top_k=0)[0]
        )
    assert first == f"\n{generate.SEPARATOR}\n".join(expected) + "\n"
    command.run(parse(*argv[:-4], "--do_sample", "false", "--device", "cpu"))
    assert capsys.readouterr().out != first


def test_beam_search_prints_each_whole_continuation_as_model_generate_writes_it(tiny_llama_dir, llama, capsys):
    model, tokenizer = llama
    command.run(parse("--model_dir", tiny_llama_dir, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                      "--max_new_tokens", "12", "--num_beams", "3", "--device", "cpu"))  # fmt: skip
    expected = []
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**ids, num_beams=3, max_new_tokens=12, do_sample=False)
        expected.append(prompt + tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    assert capsys.readouterr().out == f"\n{generate.SEPARATOR}\n".join(expected) + "\n"
    greedy = generate_texts(model, tokenizer, PROMPTS[:1], max_new_tokens=12)[0]
    assert expected[0] != PROMPTS[0] + greedy  # beams found another continuation than the greedy one
    with pytest.raises(ValueError, match="beam search cannot stream"):
        generate_texts(model, tokenizer, PROMPTS[:1], num_beams=2, streamer=TextStreamer(tokenizer))


def test_flags_and_defaults():
    args = parse("--model_dir", "m", "--prompt", "a")
    assert (
        args.do_sample,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.repetition_penalty,
        args.seed,
        args.device,
        args.text_column,
    ) == (False, 100, 1.0, 50, 1.0, 1.0, 42, "auto", "text")
    assert parse("--model_dir", "m", "--do_sample").do_sample is True
    assert parse("--model_dir", "m", "--do_sample", "false").do_sample is False
    with pytest.raises(UserError, match="--do_sample: expected true or false, got 'maybe'"):
        parse("--model_dir", "m", "--do_sample", "maybe")
    with pytest.raises(UserError, match="--model_dir"):
        parse("--prompt", "a")


@pytest.fixture
def nothing_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded a model or tokenizer before the checks passed")

    monkeypatch.setattr(generate.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(generate.AutoTokenizer, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ["--temperature", "0"],
            "--temperature must be greater than 0, got 0.0; for deterministic output use --do_sample",
        ),
        (["--top_p", "0"], r"--top_p must be in \(0, 1\]"),
        (["--top_p", "1.5"], r"--top_p must be in \(0, 1\]"),
        (["--top_k", "-1"], "--top_k must be 0 .no limit. or more"),
        (["--max_new_tokens", "0"], "--max_new_tokens must be at least 1"),
        (["--num_beams", "0"], "--num_beams must be at least 1"),
        (["--repetition_penalty", "0"], "--repetition_penalty must be greater than 0"),
        (["--temperature", "inf"], "--temperature must be a finite number, got inf"),  # uniform noise (audit)
        (["--repetition_penalty", "inf"], "--repetition_penalty must be a finite number"),
        (["--input_file", "/no/such/prompts.txt"], "--input_file /no/such/prompts.txt does not exist"),
        (["--input_file", "/tmp"], "--input_file /tmp is a folder; give a file"),  # it "did not exist" (audit)
    ],
)
def test_bad_options_are_refused_before_loading(tiny_llama_dir, nothing_loaded, extra, match):
    with pytest.raises(UserError, match=match) as err:
        command.run(parse("--model_dir", tiny_llama_dir, "--prompt", "hi", *extra))
    assert "\n" not in str(err.value)


def test_bad_model_dirs_are_refused_before_loading(
    tmp_path, tiny_llama_dir, tiny_model_dir, classifier_dir, nothing_loaded
):
    def error(model_dir: str, *extra: str) -> str:
        with pytest.raises(UserError) as err:
            command.run(parse("--model_dir", model_dir, *extra))
        assert "\n" not in str(err.value)
        return str(err.value)

    missing = str(tmp_path / "nowhere")
    assert (
        error(missing, "--prompt", "hi") == f"--model_dir {missing} does not exist; "
        "pass the output_dir of a training run"
    )
    assert "holds no config.json" in error(str(tmp_path), "--prompt", "hi")
    checkpoint = tmp_path / "checkpoint-2"  # "written by the training application", but no model (audit)
    checkpoint.mkdir()
    for name in ("trainer_state.json", "model.safetensors", "optimizer.bin"):
        (checkpoint / name).write_text("{}")
    assert error(str(checkpoint), "--prompt", "hi") == (
        f"--model_dir {checkpoint} is a training checkpoint (weights, optimizer state and progress), not a saved "
        f"model: give the run's --output_dir, or go on training from it with --resume_from_checkpoint {checkpoint}"
    )
    assert (
        error(classifier_dir, "--prompt", "hi") == f"--model_dir {classifier_dir} is a sequence-classification "
        "model; use the predict command to classify texts with it"
    )
    assert "holds a BertModel, not a language model" in error(tiny_model_dir, "--prompt", "hi")
    assert "nothing to generate from: pass --prompt" in error(tiny_llama_dir)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert "nothing to generate from" in error(tiny_llama_dir, "--input_file", str(empty))
    if not torch.cuda.is_available():
        assert "--device cuda: no CUDA GPU is visible" in error(tiny_llama_dir, "--prompt", "hi", "--device", "cuda")


def test_a_one_token_prompt_is_one_token(llama):
    """ "prompt 1 is 1 tokens" (found in audit)."""
    model, tokenizer = llama
    with pytest.raises(UserError, match="^prompt 1 is 1 token; with --max_new_tokens 256 that exceeds"):
        generate.check_lengths(model, tokenizer, [""], 256)  # an empty prompt: the BOS token


def test_a_prompt_past_the_context_length_is_refused(tiny_gpt2_dir):
    with pytest.raises(
        UserError,
        match="prompt 2 is .* tokens; with --max_new_tokens 255 that exceeds the model's "
        "context length of 256; shorten it or lower --max_new_tokens",
    ):
        command.run(
            parse(
                "--model_dir",
                tiny_gpt2_dir,
                "--prompt",
                "a",
                "--prompt",
                "Once upon a time",
                "--max_new_tokens",
                "255",
                "--device",
                "cpu",
            )
        )


@pytest.mark.gpu
def test_run_on_cuda_in_bf16(tiny_llama_dir, capsys):
    model, tokenizer = generate.load(tiny_llama_dir, torch.device("cuda"))
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16 and not model.training
    texts = generate_texts(model, tokenizer, PROMPTS, max_new_tokens=10)
    command.run(
        parse(
            "--model_dir",
            tiny_llama_dir,
            "--prompt",
            PROMPTS[0],
            "--prompt",
            PROMPTS[1],
            "--max_new_tokens",
            "10",
            "--device",
            "cuda",
        )
    )
    out = capsys.readouterr().out
    assert out == f"\n{generate.SEPARATOR}\n".join(p + t for p, t in zip(PROMPTS, texts, strict=True)) + "\n"
