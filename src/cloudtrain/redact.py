"""Secrets never reach a file or a line: values that look like tokens are masked wherever arguments are
echoed or recorded, and a token given on the command line is taken out of `sys.argv` (which trackers
such as W&B record as the program's arguments) as soon as the options are parsed.

Shapes masked: Hugging Face tokens (hf_...), W&B API keys (40 hex characters, or local-/v1- keys),
AWS access key ids (AKIA.../ASIA...), the user and password of a URL, and the value after any `*token*`,
`*secret*`, `*password*`, `*api_key*` or `*signature*` name (a presigned URL's). docs/outputs.md says where a
token is read from instead.
"""

import re
import sys
from typing import Any

MASK = "***"
_SHAPES = re.compile(
    r"\bhf_(?=[A-Za-z_]*[0-9])[A-Za-z0-9_]{16,}"  # Hugging Face tokens (a digit: no identifier like hf_hub_...)
    r"|\b(?:local|v1)-[A-Za-z0-9_-]{30,}"  # W&B keys of a local server, and the newer key format
    r"|\b[0-9a-f]{40}\b"  # W&B API keys (git commit ids have this shape too: a masked commit id is harmless)
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"  # AWS access key ids
    r"|(?<=://)[^/\s@'\"]+(?=@)"  # the user and password of a URL (https://alice:pw@host/...)
)
_KEY = r"[\w-]*(?:token|secret|password|passwd|api_key|apikey|secret_access_key|signature)"  # a name that ends so
_NAMED = re.compile(
    rf"(?i)(--{_KEY}(?:\s+|=)"  # --hub_token X, --hub_token=X
    rf"|\b{_KEY}['\"]?\s*[=:]\s*['\"]?)"  # hub_token: X, HF_TOKEN=X, "hub_token": "X"
    r"([^\s'\",}]+)"
)


def mask(text: str) -> str:
    """`text` with every value that looks like a secret replaced by ***."""
    return _SHAPES.sub(MASK, _NAMED.sub(lambda m: m.group(1) + MASK, text))


def mask_value(value: Any) -> Any:
    """A recorded value with secrets masked: strings, and the strings inside lists and dicts."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, list):
        return [mask_value(item) for item in value]
    if isinstance(value, dict):
        return {key: mask_value(item) for key, item in value.items()}
    return value


def scrub_argv(secret_options: list[str]) -> None:
    """Take the values of `secret_options` (and anything token-shaped) out of sys.argv, in place: trackers
    record sys.argv as the program's arguments, and the value was read already."""
    flags = {f"--{name}" for name in secret_options}
    argv = sys.argv
    for i, arg in enumerate(argv):
        name, equals, _ = arg.partition("=")
        if name in flags and equals:
            argv[i] = f"{name}={MASK}"
        elif i > 0 and argv[i - 1] in flags:
            argv[i] = MASK
        else:
            argv[i] = _SHAPES.sub(MASK, arg)
