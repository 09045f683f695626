"""Conversations for supervised fine-tuning: data formats, chat templates, and which tokens are trained.

- `to_messages` turns one row of any supported format into a list of {role, content} messages:
  conversations (`--messages_column`; ShareGPT's {from, value} accepted), prompt/completion columns,
  or Alpaca's instruction/input/output; `--system_prompt` goes first where a row has no system message.
- `ChatFormat.setup` picks the template (the tokenizer's own, a shipped one, or a Jinja file), adds the
  special tokens a shipped template needs, sets it on the tokenizer (so `save_pretrained` saves it),
  and finds the end-of-turn token by rendering a probe conversation.
- `ChatFormat.encode` renders a conversation with `apply_chat_template` (the very text inference
  renders) and marks the tokens of each assistant turn, its end-of-turn token included: the
  characters between the prompt rendered with `add_generation_prompt=True` and the conversation
  rendered through that turn. Tokenized once, with character offsets, without extra special tokens
  (the template writes its own BOS where it has one). A template that renders earlier turns
  differently once later ones follow gives one example per assistant turn instead.
"""

import re
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from cloudtrain.errors import UserError, first_line

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
FORMATS = ("conversations", "prompt_completion", "alpaca")

# Shipped templates: (Jinja source, the special tokens it needs in the vocabulary).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
ZEPHYR = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"]),
    "zephyr": (ZEPHYR, ["<|system|>", "<|user|>", "<|assistant|>"]),
}
PROBE = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong-7f3a"}]


@dataclass
class Columns:
    """Where a dataset's examples are: its format and the columns it reads."""

    format: str
    names: tuple[str, ...]


def detect_columns(available: list[str], messages: str | None, prompt: str | None, completion: str | None) -> Columns:
    """The format named by the flags, else the first one whose usual columns the data has."""
    if messages:
        return Columns("conversations", (messages,))
    if prompt or completion:
        return Columns("prompt_completion", (prompt or "prompt", completion or "completion"))
    for name in ("messages", "conversations"):
        if name in available:
            return Columns("conversations", (name,))
    if {"prompt", "completion"} <= set(available):
        return Columns("prompt_completion", ("prompt", "completion"))
    if {"instruction", "output"} <= set(available):
        return Columns("alpaca", ("instruction", "input", "output"))
    raise UserError(
        f"--task sft found no examples in the columns {', '.join(available)}; name them with "
        "--messages_column (conversations) or --prompt_column and --completion_column, or use the "
        "usual names: messages, prompt/completion, instruction/input/output"
    )


def to_messages(row: dict, columns: Columns, system_prompt: str | None = None) -> list[dict]:
    """One example as [{role, content}, ...], checked; ValueError says what is wrong with it."""
    if columns.format == "conversations":
        messages = conversation(row[columns.names[0]], columns.names[0])
    elif columns.format == "prompt_completion":
        prompt, completion = (row[name] for name in columns.names)
        messages = [
            {"role": "user", "content": _text(prompt, columns.names[0])},
            {"role": "assistant", "content": _text(completion, columns.names[1])},
        ]
    else:
        instruction, extra, output = (row.get(name) for name in columns.names)
        question = _text(instruction, "instruction") + (f"\n\n{extra}" if extra and str(extra).strip() else "")
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": _text(output, "output")}]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("it has no assistant message, so nothing to learn")
    return messages


def _text(value, column: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"column {column!r} holds {type(value).__name__}, not text")
    return value


def conversation(value, column: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"column {column!r} holds {type(value).__name__}, not a list of {{role, content}} messages")
    messages = []
    for turn in value:
        if not isinstance(turn, dict):
            raise ValueError(
                f"column {column!r} holds a {type(turn).__name__} where a {{role, content}} message belongs"
            )
        if turn.get("role") is not None:
            role, content = turn.get("role"), turn.get("content")
        elif turn.get("from") is not None:  # ShareGPT
            sender = turn["from"]
            role, content = SHAREGPT_ROLES.get(sender, sender), turn.get("value")
        else:
            raise ValueError(
                f"column {column!r} holds a message without a role (keys: {', '.join(turn)}); messages "
                "need role and content (or ShareGPT's from and value)"
            )
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)} (ShareGPT: human, gpt, system)")
        if not isinstance(content, str):
            raise ValueError(f"a {role} message's content is {type(content).__name__}, not text")
        messages.append({"role": role, "content": content})
    return messages


@dataclass
class ChatFormat:
    """A tokenizer with its chat template, and the end-of-turn token that ends every assistant turn."""

    tokenizer: PreTrainedTokenizerBase
    end_of_turn_id: int
    source: str  # where the template came from, for messages

    @classmethod
    def setup(cls, tokenizer: PreTrainedTokenizerBase, template: str | None, generates: bool = True) -> "ChatFormat":
        """Set the template on `tokenizer` (adding a shipped template's special tokens) and check it; for a model
        that `generates` its answers, also that the generation prompt writes the assistant's header."""
        if template:
            source, (text, tokens) = template, read_template(template)
        elif tokenizer.chat_template:
            source, text, tokens = "the tokenizer's chat template", tokenizer.chat_template, []
        else:
            source, (text, tokens) = "chatml (the tokenizer has no chat template)", TEMPLATES["chatml"]
        if tokens:
            tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
        tokenizer.chat_template = text
        return cls(tokenizer, _end_of_turn(tokenizer, source, generates), source)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(  # type: ignore[return-value]  # a str with tokenize=False
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # Jinja raises its own errors, and templates raise_exception(...)
            raise ValueError(f"the chat template ({self.source}) cannot render it: {first_line(err)}") from None

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(token ids, answer mask) of one conversation: 1 on every assistant turn's tokens up to and including
        its end-of-turn token. ValueError if the template renders
        earlier turns differently once later ones follow (see `examples`)."""
        text, spans = self.render(messages), []
        for prompt, through in self._turns(messages):
            if not (text.startswith(through) and through.startswith(prompt)):
                raise ValueError(
                    f"the chat template ({self.source}) renders earlier turns differently once later ones follow"
                )
            spans.append((len(prompt), len(through)))
        return self._example(text, spans)

    def examples(self, messages: list[dict]) -> list[tuple[list[int], list[int]]]:
        """The training examples of one conversation: `encode`'s one, or, where the template renders earlier
        turns differently once later ones follow (Qwen3 drops earlier reasoning, Mistral moves the system
        prompt to the last user turn), one per assistant turn, each rendered as inference renders it."""
        try:
            return [self.encode(messages)]
        except ValueError:
            pass
        examples = []
        for prompt, through in self._turns(messages):
            if not through.startswith(prompt):
                raise ValueError(
                    f"the chat template ({self.source}) renders an assistant turn that does not "
                    "continue its own generation prompt, so the answer's tokens cannot be found; use "
                    "--chat_template chatml"
                )
            examples.append(self._example(through, [(len(prompt), len(through))]))
        return examples

    def _turns(self, messages: list[dict]) -> list[tuple[str, str]]:
        """(prompt with the generation prompt, conversation through the answer) for each assistant turn."""
        return [
            (self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1]))
            for i, message in enumerate(messages)
            if message["role"] == "assistant"
        ]

    def _example(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        # A token is trained when it overlaps an answer: byte-level tokenizers give a merged " I" the offset of
        # its space, which may belong to the generation prompt.
        mask = [
            int(any(begin < stop and end > start for start, stop in spans)) for begin, end in encoded["offset_mapping"]
        ]
        closed = False  # the newline after an end-of-turn token is the template's, never generated
        for i, token in enumerate(ids):
            if not mask[i]:
                closed = False
            elif closed:
                mask[i] = 0
            elif token == self.end_of_turn_id:
                closed = True
        return ids, mask

    def answer(self, prompt: list[dict], answer: list[dict]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of `prompt` followed by `answer` (a preference pair's side: one or more assistant
        messages): 1 on each answer message's tokens through its end-of-turn token, 0 on the prompt's (rendered as
        inference renders it) and on the headers between the messages."""
        messages = prompt + answer
        text, spans = self.render(messages), []
        for i in range(len(prompt), len(messages)):  # each message of the answer, as SFT takes each assistant turn
            head, through = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(head)):
                raise ValueError(
                    f"the chat template ({self.source}) renders the answer not after its own generation prompt, so "
                    "the answer's tokens cannot be found; use --chat_template chatml"
                )
            spans.append((len(head), len(through)))
        return self._example(text, spans)

    def prompt(self, messages: list[dict]) -> str:
        """The text a model is given to answer the last assistant turn of `messages` (or to answer after them)."""
        return self.render(messages[: last_answer(messages)], add_generation_prompt=True)


def _check_boundary(tokenizer: PreTrainedTokenizerBase, source: str, prompt: str, text: str) -> None:
    """Training tokenizes a conversation whole, inference its generation prompt alone: the prompt's tokens must
    begin the conversation's, else the answer's first token merges with the prompt's end ('Assistant: ' then
    'Once' trains ' Once' where inference feeds a lone ' ' and the model never saw it)."""
    alone = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    if whole[: len(alone)] != alone:
        same = next(i for i, (a, b) in enumerate(zip(alone, whole, strict=False)) if a != b)
        last, merged = tokenizer.decode(alone[same:]), tokenizer.decode(whole[same : same + 1])
        raise UserError(
            f"the chat template ({source}) ends its generation prompt with {last!r}, which the answer's first "
            f"token takes in ({merged!r}) when a conversation is tokenized whole: inference would give the model "
            "a token training never showed it; end the generation prompt with a newline or a special token, or "
            "use --chat_template chatml"
        )


def last_answer(messages: list[dict]) -> int:
    """The index of the last assistant message (len(messages) when there is none)."""
    return max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))


def read_template(name: str) -> tuple[str, list[str]]:
    """(Jinja source, special tokens it needs) of a shipped template name or a Jinja file."""
    if name in TEMPLATES:
        return TEMPLATES[name]
    path = Path(name).expanduser()
    if path.is_file():
        return path.read_text(), []
    raise UserError(f"--chat_template {name} is neither a shipped template ({', '.join(TEMPLATES)}) nor a Jinja file")


def _end_of_turn(tokenizer: PreTrainedTokenizerBase, source: str, generates: bool = True) -> int:
    """The first special token the template writes after an assistant message's content (a model that `generates`:
    after a generation prompt that writes the assistant's header, as the conversation does)."""
    chat = ChatFormat(tokenizer, -1, source)
    try:
        text = chat.render(PROBE)
        prompt = chat.render(PROBE[:1], add_generation_prompt=True)
    except ValueError as err:
        raise UserError(str(err)) from None
    answer = PROBE[1]["content"]
    if answer not in text[len(prompt) :] or not text.startswith(prompt):
        raise UserError(
            f"the chat template ({source}) does not render assistant messages after its generation "
            "prompt; give a template with an assistant role, or --chat_template chatml"
        )
    header = text[len(prompt) : text.index(answer, len(prompt))]
    if generates and header.strip() and prompt == chat.render(PROBE[:1]):
        raise UserError(
            f"the chat template ({source}) writes the assistant's header ({header.strip()!r}) but its generation "
            "prompt does not (it has no add_generation_prompt branch): the model would learn to write the header "
            "itself and answer after it; give a template with that branch, or --chat_template chatml"
        )
    if generates:
        _check_boundary(tokenizer, source, prompt, text)
    tail = text[text.index(answer, len(prompt)) + len(answer) :]
    # Llama-3's <|eot_id|> is special but not in the special-tokens map: ask the added tokens too.
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token in special:
            return token
    named = re.findall(r"<\|[^|<>\s]+\|>", tail)  # a token the template writes that the tokenizer lacks
    lacking = ""
    if named:
        what = "not a special token" if named[0] in tokenizer.get_vocab() else "not a token"
        lacking = f" ({named[0]} is {what} of this tokenizer: --chat_template chatml adds chatml's)"
    raise UserError(
        f"the chat template ({source}) ends an assistant turn with no special token ({tail!r}){lacking}, so the "
        "model could not learn where to stop; use --chat_template chatml, or a template that ends turns "
        "with a special token of the tokenizer"
    )
