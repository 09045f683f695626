"""The `generate` entry: continue prompts with a causal language model saved by the training application, or
write the target of each prompt with an encoder-decoder (--task seq2seq).

    python src/training_application.py generate --model_dir outputs/run --prompt "Once upon a time"
    python src/training_application.py generate --model_dir outputs/run --input_file prompts.txt --do_sample true
    python src/training_application.py generate --model_dir outputs/sft-run --chat

A model whose tokenizer has a chat template (one trained with --task sft, or a chat model from
elsewhere) gets each prompt as a user message rendered with that template, exactly as in training,
after the training's --system_prompt if it had one, and answers until its end-of-turn token
(`--raw true` continues the plain text instead). `--chat` is an interactive conversation in the
terminal: the history is kept (the oldest turns are left out when it outgrows the context), `/reset`
starts over, `/exit` or Ctrl-D ends it.

For each prompt it prints the prompt and streams the continuation to the terminal as it is produced,
one prompt after another, with a separator line between them. Greedy decoding by default;
`--do_sample true` samples with --temperature, --top_k and --top_p; `--num_beams N` runs beam search, whose
text prints when it is complete (nothing can stream it). The random generator is seeded
from --seed before each prompt, so a prompt gives the same text whatever other prompts are run with it.
Prompts come from --prompt (repeatable) and --input_file: .txt (one prompt per line, blank lines
skipped) or .csv/.tsv/.json/.jsonl/.parquet with a --text_column. An empty prompt starts from the BOS token
(a chat model's is an empty user message).
The model runs in fp32 on CPU and in bf16 on a CUDA GPU that computes it natively.

An encoder-decoder reads each prompt whole and writes a new text (the training's --source_prefix, T5's
"summarize: ", goes before each prompt), with the beams its evaluation used (--generation_num_beams) unless
--num_beams or --do_sample true says otherwise.

Not supported: sequence-classification models (use `predict`), batched or multi-GPU generation.
Prompt plus --max_new_tokens must fit a decoder's context length.

The options, and the checks of their values, are cloudtrain.commands.generate's; `run` is the command once they
parsed. `generate_texts` is the library entry, used by training for its sample generations: it prints nothing
unless given a streamer.
"""

import argparse
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (  # noqa: F401 (AutoTokenizer: tests patch it here)
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    TextStreamer,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from cloudtrain.errors import UserError, first_line
from cloudtrain.evaluation import eval_mode
from cloudtrain.models.load import (
    check_checkpoint,
    is_causal_lm,
    is_seq2seq_lm,
    load_config,
    load_failure,
    read_tokenizer,
)
from cloudtrain.models.positions import positions
from cloudtrain.observe import console
from cloudtrain.publish.saving import (
    GENERATIVE,
    adapter_config,
    check_not_checkpoint,
    is_adapter_dir,
    read_arguments,
)
from cloudtrain.registry import TASKS

SEPARATOR = "-" * 60
# One greedy (or sampled) pass whatever the checkpoint's generation_config saved: summarization checkpoints save
# beam search and length rules (bart-large-cnn: 4 beams, at least 56 tokens, no repeated trigram), which the
# streamer cannot take and evaluation does not score. Given to generate() as arguments: a GenerationConfig's unset
# fields are filled from the saved one.
ONE_PASS = {
    "num_beams": 1,
    "min_length": 0,
    "min_new_tokens": None,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
}


def search_options(num_beams: int) -> dict:
    """generate()'s arguments for one pass (ONE_PASS) or for beam search with `num_beams` beams, which keeps the
    checkpoint's saved length penalty and length rules (as transformers' Seq2SeqTrainer does); one text per
    prompt either way, whatever number of return sequences the checkpoint saved."""
    return {**(ONE_PASS if num_beams == 1 else {"num_beams": num_beams}), "num_return_sequences": 1}


def beam_length_problem(generation_config: GenerationConfig, max_new_tokens: int, encoder_decoder: bool) -> str | None:
    """Why beam search under a checkpoint's saved minimum length could not end a text within `max_new_tokens`
    (every text would run to the cut), or None. An encoder-decoder's min_length counts its start token too; the
    text's end (EOS) comes after the minimum, so it needs one token more."""
    least = generation_config.min_new_tokens or 0
    if encoder_decoder and generation_config.min_length:
        least = max(least, generation_config.min_length - 1)
    if least < max_new_tokens:
        return None
    return f"the model's saved generation config lets beam search end a text only after {least} new tokens"


# ---------------------------------------------------------------- checks (before anything is loaded)


def check_model_dir(model_dir: str, trust_remote_code: bool = False) -> None:
    """`model_dir` holds the config of a causal language model and readable weights, or a UserError says what it
    holds instead. The command checked that it exists and finished any interrupted final save."""
    path = Path(model_dir)
    check_not_checkpoint("--model_dir", path)
    if is_adapter_dir(path):
        task_type = adapter_config(path).get("task_type")
        if task_type not in GENERATIVE:
            hint = "; use the predict command to classify texts with it" if task_type == "SEQ_CLS" else ""
            raise UserError(
                f"--model_dir {model_dir} holds a {task_type or 'PEFT'} adapter, not a causal language model{hint}"
            )
        return
    if not (path / "config.json").is_file():
        raise UserError(
            f"--model_dir {model_dir} holds no config.json; pass a directory written by the training application"
        )
    config = load_config(path, trust_remote_code)
    if is_causal_lm(config) or is_seq2seq_lm(config):
        check_checkpoint(path, "--model_dir")
        return
    architectures = list(getattr(config, "architectures", None) or [])
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        raise UserError(
            f"--model_dir {model_dir} is a sequence-classification model; use the predict command "
            "to classify texts with it"
        )
    if architectures:
        raise UserError(
            f"--model_dir {model_dir} holds a {architectures[0]}, not a language model; generate needs a model "
            "with a language-modelling head (a ...ForCausalLM, or an encoder-decoder's ...ForConditionalGeneration)"
        )
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"--model_dir {model_dir} holds a {config.model_type!r} model, which has no causal "
            "language-model form; generate needs a decoder such as GPT-2 or Llama"
        )


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.chat:
        return []
    prompts = list(args.prompt)
    if args.input_file:
        from cloudtrain.predict import read_texts

        texts = read_texts(args.input_file, args.text_column, "one text is generated per other line")
        prompts += [text for text in texts if text.strip()]
        if blank := len(texts) - len(prompts) + len(args.prompt):  # (a .txt file's blank lines: said as read)
            print(f"note: {blank} empty prompt(s) of {args.input_file} skipped", file=sys.stderr)
    if not prompts:  # an input file of blank lines
        raise UserError(f"nothing to generate from: --input_file {args.input_file} holds no prompt")
    return prompts


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible; use --device cpu (or auto)")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


# ---------------------------------------------------------------- loading and generating


def load(model_dir: str, device: torch.device, trust_remote_code: bool = False):
    """(model in eval mode on `device`, tokenizer): bf16 on a CUDA GPU that computes it natively, else fp32."""
    from cloudtrain.hardware import native_bf16
    from cloudtrain.models import adapters

    dtype = torch.bfloat16 if device.type == "cuda" and native_bf16("cuda") else torch.float32
    if is_adapter_dir(Path(model_dir)):  # the base named in its config, with the adapter on top
        model, tokenizer = adapters.load_adapter_model(Path(model_dir), dtype, trust_remote_code)
        return model.to(device).eval(), tokenizer
    tokenizer = read_tokenizer(model_dir, trust_remote_code)
    config = load_config(model_dir, trust_remote_code)
    auto_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    try:
        model = auto_class.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise load_failure(err, f"the model in {model_dir}", model_dir) from None
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers' wrapped `to`


def _prompt_ids(tokenizer, prompt: str, add_special_tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of one prompt, shape (1, n); an empty prompt is the BOS (else EOS) token.
    A prompt rendered by a chat template is tokenized without added special tokens: it holds its own."""
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=add_special_tokens)
    ids = encoded["input_ids"]
    if ids.shape[1] == 0:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is None:
            raise ValueError("an empty prompt needs a tokenizer with a BOS or EOS token")
        ids = torch.tensor([[start]])
        return ids, torch.ones_like(ids)
    return ids, encoded.get("attention_mask", torch.ones_like(ids))


def _pad_token_id(model, tokenizer) -> int | None:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, model.generation_config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return None


def generate_texts(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 50,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 50,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    streamer=None,
    synced_gpus: bool = False,
    add_special_tokens: bool = True,
    batch_size: int = 1,
    num_beams: int = 1,
) -> list[str]:
    """The continuation of each prompt: the new text only, special tokens skipped.

    One prompt at a time by default (no padding, so a tokenizer without a pad token is fine); with
    `batch_size` > 1, non-empty prompts go `batch_size` at a time, left-padded (many short answers
    are far faster so; greedy results can differ from one at a time in the last float bits). On the
    model's device, under no_grad, with the KV cache on (even where training set config.use_cache False).
    The model is put in eval mode and given back in the mode it came in (train mode restored).
    Prints nothing unless `streamer` is given.
    Sampling uses torch's global generator: seed it before calling for reproducible samples.
    `model` is the bare model (unwrap DDP/DeepSpeed first); `synced_gpus`: every rank calls this with
    the same prompts (ZeRO-3). `add_special_tokens=False` for prompts rendered by a chat template.
    `num_beams` > 1: beam search (search_options), which no streamer can follow.
    Generation stops at any of the model's generation_config.eos_token_id (a chat model's end of turn).
    """
    options = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=_pad_token_id(model, tokenizer),
        use_cache=True,
        synced_gpus=synced_gpus,
        streamer=streamer,
    )
    if num_beams > 1 and streamer is not None:
        raise ValueError("beam search cannot stream: pass streamer=None with num_beams > 1")
    options.update(search_options(num_beams))
    if repetition_penalty != 1.0:  # a checkpoint's own (Qwen's 1.05) applies otherwise
        options["repetition_penalty"] = repetition_penalty
    if do_sample:  # set only when used: generate warns about sampling options under greedy decoding
        options.update(temperature=temperature, top_k=top_k, top_p=top_p)
    device = next(model.parameters()).device
    texts = []
    batched = batch_size > 1 and streamer is None and all(prompts) and tokenizer.pad_token_id is not None
    with eval_mode(model), torch.no_grad():
        for start in range(0, len(prompts), batch_size if batched else 1):
            ids, mask = (
                _batch_ids(tokenizer, prompts[start : start + batch_size], add_special_tokens)
                if batched
                else _prompt_ids(tokenizer, prompts[start], add_special_tokens)
            )
            output = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **options)
            # a decoder's output repeats the prompt; an encoder-decoder's is the new text alone
            new = output if model.config.is_encoder_decoder else output[:, ids.shape[1] :]
            texts += tokenizer.batch_decode(new, skip_special_tokens=True)
    return texts


def _batch_ids(tokenizer, prompts: list[str], add_special_tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of non-empty prompts, left-padded so every answer starts at the same column."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    finally:
        tokenizer.padding_side = side
    return encoded["input_ids"], encoded["attention_mask"]


def _context(model) -> int | None:
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_lengths(model, tokenizer, prompts: list[str], max_new_tokens: int, add_special_tokens: bool = True) -> None:
    """Each prompt plus max_new_tokens fits the model's context length (when its config states one)."""
    limit = _context(model)
    if model.config.is_encoder_decoder:
        return _check_encoder_decoder(model, tokenizer, prompts, max_new_tokens)
    if not limit:
        return
    for number, prompt in enumerate(prompts, 1):
        length = _prompt_ids(tokenizer, prompt, add_special_tokens)[0].shape[1]
        if length + max_new_tokens > limit:
            raise UserError(
                f"prompt {number} is {console.counted(length, 'token')}; with --max_new_tokens {max_new_tokens} that "
                f"exceeds the model's context length of {limit}; shorten it or lower --max_new_tokens"
            )


def _check_encoder_decoder(model, tokenizer, prompts: list[str], max_new_tokens: int) -> None:
    """Each prompt fits the encoder's positions, and --max_new_tokens the decoder's (where they are learned)."""
    encoder = positions(model.config.get_text_config(encoder=True))
    decoder = positions(model.config.get_text_config(decoder=True))
    if decoder and max_new_tokens > decoder:  # the last token written is never read back
        raise UserError(
            f"--max_new_tokens {max_new_tokens} does not fit the model's decoder ({decoder} positions); pass "
            f"--max_new_tokens {decoder} or less"
        )
    for number, prompt in enumerate(prompts, 1):
        length = _prompt_ids(tokenizer, prompt)[0].shape[1]
        if encoder and length > encoder:
            raise UserError(
                f"prompt {number} is {console.counted(length, 'token')}, more than the model's encoder reads "
                f"({encoder} positions); shorten it"
            )


def _system(args: argparse.Namespace) -> list[dict]:
    return [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []


def _render(tokenizer, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # Jinja's errors, and templates that raise_exception (no system role, say)
        raise UserError(f"the model's chat template cannot render this conversation: {first_line(err)}") from None


def run(args: argparse.Namespace) -> None:
    check_model_dir(args.model_dir, args.trust_remote_code)
    prompts = read_prompts(args)
    device = resolve_device(args.device)
    model, tokenizer = load(args.model_dir, device, args.trust_remote_code)
    trained = read_arguments(args.model_dir)
    # A chat model (trained with --task sft, or not by cloudtrain) gets user messages; a causal LM that was
    # continued from an instruct checkpoint keeps its template but was trained, and is used, on plain text.
    task = trained.get("task")  # none: not trained by cloudtrain; an unknown one: by another version
    chat_task = task is None or (task in TASKS.names() and TASKS[task].chat_template)
    templated = bool(tokenizer.chat_template) and not args.raw and chat_task
    if args.chat and not templated:
        raise UserError(
            f"--chat needs a chat model, and {args.model_dir} is not one"
            # leaving out --raw helps only a model with a template (found in audit)
            + (
                " (leave out --raw)"
                if args.raw and tokenizer.chat_template and chat_task
                else "; train one with --task sft, or use --prompt"
            )
        )
    seq2seq = model.config.is_encoder_decoder
    if seq2seq:  # as its training's sources
        prompts = [trained.get("source_prefix", "") + prompt for prompt in prompts]
    if args.num_beams is None:  # as the run's evaluation decoded, unless asked to sample
        args.num_beams = trained.get("generation_num_beams", 1) if seq2seq and not args.do_sample else 1
    if args.system_prompt is not None and not templated:
        print(f"note: {unused_system_prompt(args, tokenizer, task)}", file=sys.stderr)  # stdout holds the texts
    if args.system_prompt is None and trained.get("system_prompt"):
        args.system_prompt = trained["system_prompt"]  # what every training example began with
    texts = (
        [_render(tokenizer, [*_system(args), {"role": "user", "content": p}]) for p in prompts]
        if templated
        else prompts
    )
    check_lengths(model, tokenizer, texts, args.max_new_tokens, add_special_tokens=not templated)
    if args.num_beams > 1 and (problem := beam_length_problem(model.generation_config, args.max_new_tokens, seq2seq)):
        raise UserError(
            f"{problem}, and --max_new_tokens {args.max_new_tokens} leaves no room for its end: raise "
            "--max_new_tokens, or pass --num_beams 1"
        )
    # beam search knows its text only at the end: printed whole (show), not streamed
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.num_beams == 1 else None
    options = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        streamer=streamer,
        add_special_tokens=not templated,
        num_beams=args.num_beams,
    )
    if args.chat:
        return chat(model, tokenizer, args, options)
    for number, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        if number:
            print(SEPARATOR)
        # a chat model answers, an encoder-decoder writes a new text: on its own line; a decoder continues the prompt
        print(f"{prompt}\n" if templated or seq2seq else prompt, end="", flush=True)
        torch.manual_seed(args.seed)
        show(generate_texts(model, tokenizer, [text], **options)[0], streamed=streamer is not None)


def unused_system_prompt(args: argparse.Namespace, tokenizer, task: str | None) -> str:
    """Why the --system_prompt given is not read, as config.inert's notes say it: only a chat template puts it
    before the prompts (it was dropped without a word; found in audit)."""
    from cloudtrain.config.inert import as_typed

    given = as_typed("system_prompt", args.system_prompt)
    if not tokenizer.chat_template:
        return (
            f"{given} has no effect: the model in {args.model_dir} has no chat template to put it in; its prompts are "
            "continued as plain text"
        )
    if args.raw:
        return f"{given} has no effect with --raw true (the prompts continue as plain text); leave out --raw"
    return f"{given} has no effect: the model in {args.model_dir} was trained with --task {task} on plain text"


def show(text: str, streamed: bool) -> None:
    """A generation's text where no streamer printed it as it was written (beam search)."""
    if not streamed:
        print(text, flush=True)


def _too_long(tokenizer, text: str, max_new_tokens: int, limit: int) -> bool:
    return _prompt_ids(tokenizer, text, False)[0].shape[1] + max_new_tokens > limit


def chat(model, tokenizer, args: argparse.Namespace, options: dict) -> None:
    """Read a user turn, stream the answer (print it whole with beams), keep both; /reset and /exit are
    commands."""
    system = _system(args)
    history: list[dict] = []
    limit = _context(model)
    print(
        f"chatting with {args.model_dir}: type a message; /reset clears the history, /exit or Ctrl-D quits", flush=True
    )
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if line == "/exit":
            return
        if line == "/reset":
            history = []
            print("(history cleared)", flush=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        text = _render(tokenizer, system + history)
        while limit and len(history) > 1 and _too_long(tokenizer, text, args.max_new_tokens, limit):
            history = history[2:]  # the oldest exchange goes first; the system message stays
            text = _render(tokenizer, system + history)
            print("(the oldest turns no longer fit the context and were left out)", flush=True)
        if limit and _too_long(tokenizer, text, args.max_new_tokens, limit):
            history.pop()
            print(
                f"(that message does not fit the model's context of {limit} tokens with --max_new_tokens "
                f"{args.max_new_tokens}; shorten it)",
                flush=True,
            )
            continue
        print("assistant> ", end="", flush=True)
        torch.manual_seed(args.seed)
        answer = generate_texts(model, tokenizer, [text], **options)[0]
        show(answer, streamed=options["streamer"] is not None)
        history.append({"role": "assistant", "content": answer.strip()})
