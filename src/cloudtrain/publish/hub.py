"""Pushing to the Hugging Face Hub: the access check before training, the upload after it, the
`push` command that (re)uploads an existing output dir, and a background uploader for saves made
during training.

    python src/training_application.py push --output_dir DIR [--hub_model_id USER/NAME]

Supports model repos on the Hub, or on any server that `HF_ENDPOINT` names; the token from
--hub_token, else HF_TOKEN, else the stored login (`hf auth login`); public or private repos
(--hub_private_repo, applied when the repo is created); a branch (--hub_revision, created from main
when missing). A push uploads the top-level files of the output dir that a model repo needs
(UPLOAD_PATTERNS): weights, config with label names, tokenizer, the generated README.md card,
arguments, results and the training-curves plot, and a --trust_remote_code model's .py modules that its config's
(or tokenizer's) auto_map names; checkpoint folders, tracker logs and
metrics.jsonl stay local. A file that a push writes (PUSHED_NAMES) left at the repo root (or in merged/) by an
earlier run, that this push does not hold, is deleted in the same commit (an old adapter_config.json made
transformers apply an old adapter to a new full model); any other file in the repo is kept. Does not open pull requests.

An adapter (`--peft`) goes up in PEFT's layout (adapter_config.json, adapter_model.safetensors,
labels.json, generation_config.json), and with it the merged model in merged/ when --merge_adapters
wrote one. Its adapter_config.json goes up naming the base model by the card's base_model (a Hub id)
where it named a local copy of it (the built-in model's folder): `AutoPeftModelFor...` then loads it
anywhere; the local file is left as it is, for offline use here.

The token lives only in memory: it is never printed, logged, written to a file or the card, and
error messages are scrubbed of it. Only the main process may call into this module.

A Hub that stops answering ends in one line, not a run that hangs: huggingface_hub sends its requests with no
timeout, and once this module made a client every request of the process that has none gets one
(CLOUDTRAIN_HUB_TIMEOUT seconds to connect, and for each read and write; default 60); a wait for the background
uploads lasts CLOUDTRAIN_HUB_WAIT seconds at most (default 1800). A call the Hub answers with 429 (too many
requests) or a 5xx (busy or down) is made again, RETRIES times, after CLOUDTRAIN_HUB_RETRY_WAIT seconds (default 2;
or the Retry-After the Hub gives, a minute at most), doubled each time.
"""

import argparse
import concurrent.futures
import contextlib
import fnmatch
import json
import math
import os
import shlex
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx2  # huggingface_hub's HTTP client: its transport errors mean "the Hub cannot be reached"
from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.errors import (
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from cloudtrain import invocation
from cloudtrain.config import Config, HubConfig, build_config
from cloudtrain.errors import UserError, first_line
from cloudtrain.publish import atomic
from cloudtrain.publish.card_metadata import base_model_info
from cloudtrain.publish.output_dir import edited, ours_in_merged, record, remote_code, written
from cloudtrain.publish.saving import ADAPTER_CONFIG, LABELS, MERGED, MODEL_FILES, holds_model, read_json
from cloudtrain.sagemaker_env import in_training_job, job_name

CARD = "README.md"
UPLOAD_PATTERNS = [  # matched against file names, in the output dir and in its merged/
    CARD,
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    ADAPTER_CONFIG,
    LABELS,
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
    "args.json",
    "*_results.json",
    "training_curves.png",
]
RESULT_NAMES = ("train", "eval", "test", "compute")
# the names a push of model files writes at the repo root or in merged/: one an earlier push left that this one does
# not write is deleted. Names, not UPLOAD_PATTERNS: a user's own tokenizer_corpus.txt or mteb_results.json, uploaded
# beside the model, was deleted by the next push (found in audit); *.model: sentencepiece files (spm.model, spiece...)
PUSHED_NAMES = (
    *(CARD, *MODEL_FILES, "model-*-of-*.safetensors", "adapter_model.safetensors", "generation_config.json", LABELS),
    *("model_index.json", "pytorch_lora_weights.safetensors", "args.json", "training_curves.png"),
    *(f"{name}_results.json" for name in RESULT_NAMES),
    *("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json"),
    *("vocab.json", "vocab.txt", "merges.txt", "*.model", "chat_template.jinja", "chat_template.json"),
)
TOKEN_HELP = (
    "set HF_TOKEN, pass --hub_token_file, or run `hf auth login` (tokens: https://huggingface.co/settings/tokens)"
)
TIMEOUT = ("CLOUDTRAIN_HUB_TIMEOUT", 60.0)  # (variable, default seconds): one request's connect, each read or write
WAIT = ("CLOUDTRAIN_HUB_WAIT", 1800.0)  # how long a wait for the background uploads lasts at most
RETRY_WAIT = ("CLOUDTRAIN_HUB_RETRY_WAIT", 2.0)  # before the first call again after a 429 or 5xx; doubled each time
RETRIES = 3  # calls again after a 429 or 5xx
MAX_RETRY_AFTER_S = 60.0  # the longest Retry-After the Hub may ask for that is waited
T = TypeVar("T")


# ---------------------------------------------------------------- access


def hub_api(cfg: HubConfig) -> HfApi:
    """A client holding the token from --hub_token, else HF_TOKEN, else the stored login; its requests time out."""
    token = cfg.hub_token or token_from_file(cfg.hub_token_file) or get_token()
    if not token:
        raise UserError(f"pushing to the Hub needs a token with write access: {TOKEN_HELP}")
    seconds(*TIMEOUT), seconds(*WAIT), seconds(*RETRY_WAIT, zero=True)  # a bad value: said now, in one line
    _bound_requests()
    return HfApi(token=token)


def seconds(variable: str, default: float, zero: bool = False) -> float:
    """The number of seconds environment variable `variable` gives (unset or empty: `default`)."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        least = "0 or more" if zero else "more than 0"
        raise UserError(f"{variable}={value!r} must be a number of seconds, {least}")
    return number


def _bound_requests() -> None:
    """Every request huggingface_hub's client sends with no timeout (all of them, but downloads) gets
    CLOUDTRAIN_HUB_TIMEOUT: a Hub that stopped answering held a run forever. Set in the client factory (a
    user's own factory is kept, wrapped), so the client it makes again (after a connection error, a fork) has
    it too."""
    from huggingface_hub.utils import _http, set_client_factory

    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    if getattr(factory, "bounds_hub_requests", False):
        return

    def bounded() -> httpx2.Client:
        client = factory()
        client.event_hooks = {**client.event_hooks, "request": [*client.event_hooks["request"], _with_timeout]}
        return client

    bounded.bounds_hub_requests = True  # type: ignore[attr-defined]
    set_client_factory(bounded)  # closes the client made before, if any: the next request makes a bounded one


def _with_timeout(request: httpx2.Request) -> None:
    """The request's timeout: its own, or CLOUDTRAIN_HUB_TIMEOUT where it has none."""
    if all(value is None for value in request.extensions.get("timeout", {}).values()):
        timeout = seconds(*TIMEOUT)
        request.extensions = {**request.extensions, "timeout": httpx2.Timeout(timeout).as_dict()}


def hub_call(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, made again up to RETRIES times when the Hub answers 429 or a 5xx: it is busy, or
    down for a moment. Waits CLOUDTRAIN_HUB_RETRY_WAIT seconds first (or the Retry-After it asks for, a minute at
    most), twice as long each time after; the last failure is raised."""
    wait = seconds(*RETRY_WAIT, zero=True)
    for attempt in range(RETRIES + 1):
        try:
            return call(*args, **kwargs)
        except HfHubHTTPError as err:
            if attempt == RETRIES or not busy(err):
                raise
            time.sleep(max(wait, _retry_after(err)))
            wait *= 2
    raise AssertionError("unreachable")  # the loop returns or raises


def busy(err: BaseException) -> bool:
    """The Hub answered 429 (too many requests) or a 5xx (a server error): a later try may pass."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    return isinstance(err, HfHubHTTPError) and isinstance(status, int) and (status == 429 or status >= 500)


def _retry_after(err: HfHubHTTPError) -> float:
    """The seconds the Hub's Retry-After header asks for (a number of them), a minute at most; else 0."""
    try:
        return min(max(float(err.response.headers.get("Retry-After", 0)), 0.0), MAX_RETRY_AFTER_S)
    except (TypeError, ValueError):
        return 0.0


def token_from_file(path: str | None) -> str | None:
    """The token in --hub_token_file (a mounted secret, say): its first line."""
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text().strip().splitlines()[0]
    except (OSError, IndexError, UnicodeDecodeError) as err:
        reason = "it is empty" if isinstance(err, IndexError) else getattr(err, "strerror", None) or str(err)
        raise UserError(f"--hub_token_file {path} cannot be read ({reason}); give a file holding the token") from None


def check_access(cfg: HubConfig) -> None:
    """Before training: the token is valid and can write to --hub_model_id (created when missing)."""
    if not cfg.hub_model_id or cfg.hub_model_id.count("/") != 1:
        raise UserError(f"--hub_model_id {cfg.hub_model_id!r} must be <user or organization>/<name>")
    api = hub_api(cfg)
    with hub_errors(api, cfg, "checking Hub access"):
        me = hub_call(api.whoami)
    user = me["name"]
    if me.get("auth", {}).get("accessToken", {}).get("role") == "read":
        raise UserError(f"the token of user {user} is read-only; pushing needs one with write access: {TOKEN_HELP}")
    with hub_errors(api, cfg, f"checking that {user} can write to {cfg.hub_model_id}", user):
        ensure_repo(api, cfg)
        # A dry run of the first step of a commit: the Hub refuses it without write access,
        # which also catches an existing repo owned by someone else. Nothing is stored.
        hub_call(
            api.preupload_lfs_files,
            cfg.hub_model_id,
            additions=[CommitOperationAdd("README.md", b"")],
            revision=cfg.hub_revision,
        )


def check_access_from_main(cfg: HubConfig, is_main: bool, share: Callable[[str | None], str | None]) -> None:
    """`check_access` on the main process only; `share` hands its verdict (an error message or None) to
    every process, so a launch of N processes makes one set of Hub calls and fails or goes on as one."""
    error = None
    if is_main:
        try:
            check_access(cfg)
        except UserError as err:
            error = str(err)
    error = share(error)
    if error:
        raise UserError(error, quiet=not is_main)


def ensure_repo(api: HfApi, cfg: HubConfig) -> str:
    """Create the repo (and branch) when missing; returns the repo's URL."""
    assert cfg.hub_model_id is not None  # check_access checked it
    url = hub_call(api.create_repo, cfg.hub_model_id, private=cfg.hub_private_repo, exist_ok=True)
    if cfg.hub_private_repo and not hub_call(api.repo_info, cfg.hub_model_id).private:  # an existing one's is kept
        raise UserError(
            f"--hub_private_repo true, but {cfg.hub_model_id} already exists and is public: the model would be "
            "public; make the repository private in its settings on the Hub, or choose a new --hub_model_id"
        )
    if cfg.hub_revision:
        hub_call(api.create_branch, cfg.hub_model_id, branch=cfg.hub_revision, exist_ok=True)
        return f"{url}/tree/{cfg.hub_revision}"
    return str(url)


@contextlib.contextmanager
def hub_errors(api: HfApi, cfg: HubConfig, action: str, user: str | None = None) -> Iterator[None]:
    """Whatever a Hub call raises leaves as a one-line UserError: what failed and how to fix it.

    Broad on purpose: every failure of a remote service is something the user must act on.
    """
    try:
        yield
    except Exception as err:
        raise as_user_error(err, api, cfg, action, user) from None


def as_user_error(err: BaseException, api: HfApi, cfg: HubConfig, action: str, user: str | None = None) -> UserError:
    if isinstance(err, UserError):
        return err
    unreachable = isinstance(err, httpx2.TransportError)  # the network (or a timeout): a restart may get past it
    if isinstance(err, OfflineModeIsEnabled):
        text = f"{action}: HF_HUB_OFFLINE is set; unset it to push to the Hub"
    elif unreachable:
        text = f"{action}: cannot reach {api.endpoint} ({first_line(err)}); check the network (and HF_ENDPOINT)"
    elif isinstance(err, HFValidationError):
        text = f"--hub_model_id {cfg.hub_model_id!r} is not a valid repo id: {first_line(err)}"
    elif isinstance(err, HfHubHTTPError):
        text = f"{action} failed: {describe(err, cfg, user)}"
    else:
        text = f"{action} failed: {first_line(err)}"
    return UserError(scrub(text, api.token), transient=unreachable or busy(err))


def describe(err: HfHubHTTPError, cfg: HubConfig, user: str | None) -> str:
    """The HTTP failure in the user's terms."""
    status = err.response.status_code
    if status == 401:
        return f"the Hub rejected the token (401 Unauthorized); {TOKEN_HELP}"
    if status == 403:
        who = f"user {user}" if user else "this token"
        return (
            f"{who} may not write to {cfg.hub_model_id} (403 Forbidden: {err.server_message or 'no reason'}); "
            f"use --hub_model_id {user or '<you>'}/<name> or an organization you belong to, "
            "and a token with write access"
        )
    reason = (err.server_message or "").strip().splitlines() or [first_line(err)]
    if busy(err):  # hub_call made it again, RETRIES times
        return f"{status} {reason[0]} (the Hub is busy or down: {RETRIES + 1} tries failed; try again later)"
    return f"{status} {reason[0]}"


def scrub(text: str, token: str | bool | None) -> str:
    """Belt and braces: no message ever carries the token."""
    return text.replace(token, "<token>") if isinstance(token, str) and token else text


# ---------------------------------------------------------------- push at the end


def push_output_dir(output_dir: Path, cfg: Config, results: dict) -> str:
    """Write the model card into `output_dir`, upload the model files, return the repo URL.

    On failure `output_dir` stays as it is and the UserError gives the command that retries.
    """
    output_dir, hub = Path(output_dir), cfg.hub
    from cloudtrain.tasks import build_task  # the card is the task's: classification or text generation

    task = build_task(cfg)
    write_card(output_dir, lambda path: task.model_card(output_dir, cfg, results).save(path))
    files, theirs = written_by_cloudtrain(output_dir, model_files(output_dir))
    if theirs:
        names = ", ".join(str(path.relative_to(output_dir)) for path in theirs[:4]) + (
            " ..." if len(theirs) > 4 else ""
        )
        print(f"note: {names} in {output_dir} are not cloudtrain's: left out of the push (upload them yourself)")
    files += task.published_files(output_dir, results)  # e.g. the card's pictures
    try:
        api = hub_api(hub)
        with hub_errors(api, hub, f"pushing to {hub.hub_model_id}"):
            url = ensure_repo(api, hub)
            commit = commit_model_files(
                api, hub, output_dir, files, commit_message(results), base_model_info(cfg.model)[0]
            )
    except UserError as err:
        where = "the job's model.tar.gz" if in_training_job() else output_dir
        raise UserError(
            f"{err}. The model is safe in {where}; once fixed, retry with: {retry_command(output_dir, hub)}",
            transient=err.transient,
        ) from None
    print(f"pushed {output_dir} to {url} (commit {commit.oid[:8]})", flush=True)
    return url


def write_card(output_dir: Path, save: Callable[[Path], None]) -> None:
    """The model card into <output_dir>/README.md (written whole, then renamed), and listed as cloudtrain's; a
    README.md the user put there, or edited since cloudtrain wrote it, is theirs: kept, and pushed as the card."""
    card = output_dir / CARD
    if card.exists() and CARD not in written(output_dir):
        how = "was edited since cloudtrain wrote it" if CARD in edited(output_dir) else "is not one cloudtrain wrote"
        print(f"{card} {how}: it is kept, and pushed as the model card", flush=True)
        return
    partial = output_dir / f"{CARD}.partial"
    save(partial)
    os.replace(partial, card)
    record(output_dir, [CARD])


def model_files(folder: Path) -> list[Path]:
    """The files of `folder` that a model repo needs (UPLOAD_PATTERNS, and the .py modules its config's auto_map
    names: a --trust_remote_code model's code, without which it cannot be loaded): its own, and those of merged/
    (the merged model next to an adapter); checkpoints, tracker logs and any other sub-folder stay local."""
    files = []
    for place in (folder, folder / MERGED):
        code = remote_code(place)
        files += [
            path
            for path in place.glob("*")
            if path.is_file() and (path.name in code or _matches(path.name, tuple(UPLOAD_PATTERNS)))
        ]
    return sorted(files)


def commit_model_files(
    api: HfApi,
    hub: HubConfig,
    folder: Path,
    files: list[Path],
    message: str,
    base_model: str | None,
) -> CommitInfo:
    """One commit of `files` (from `folder`) to the repo root, deleting the model files an earlier run left there
    that `files` does not replace; returns its CommitInfo."""
    assert hub.hub_model_id is not None  # check_access checked it
    operations: list = [
        CommitOperationAdd(path.relative_to(folder).as_posix(), hub_copy(path, base_model)) for path in files
    ]
    uploaded = {operation.path_in_repo for operation in operations}
    for name in _repo_model_files(api, hub):
        if name not in uploaded:
            operations.append(CommitOperationDelete(name))
    return hub_call(api.create_commit, hub.hub_model_id, operations, commit_message=message, revision=hub.hub_revision)


def _repo_model_files(api: HfApi, hub: HubConfig) -> list[str]:
    """The repo's files that a push of model files writes: at its root or in merged/, named as PUSHED_NAMES."""
    try:
        names = hub_call(api.list_repo_files, hub.hub_model_id, revision=hub.hub_revision)
    except (RepositoryNotFoundError, RevisionNotFoundError):  # a branch the commit creates
        return []
    return [
        name
        for name in names
        if name.count("/") == 0 or (name.count("/") == 1 and name.startswith(f"{MERGED}/"))
        if _matches(name.rsplit("/", 1)[-1], PUSHED_NAMES)
    ]


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def written_by_cloudtrain(output_dir: Path, files: list[Path]) -> tuple[list[Path], list[Path]]:
    """`files` split into those cloudtrain wrote (its manifest's, in the folder and in merged/; the model card,
    the user's edit of it included; a remote-code model's modules) and the user's files with a model file's name
    (tokenizer_corpus.txt, vocab.backup), which a push must not publish."""
    top, merges = written(output_dir) | remote_code(output_dir) | {CARD}, ours_in_merged(output_dir)
    ours = [path for path in files if path.parent == output_dir and path.name in top]
    ours += [path for path in files if path.parent == output_dir / MERGED and merges(path.name)]
    return sorted(ours), [path for path in files if path not in ours]


def hub_copy(path: Path, base_model: str | None) -> Path | bytes:
    """What goes up for `path`: the file, except an adapter config naming its base otherwise than by the card's
    `base_model` (the built-in model's local folder): that one names the Hub id instead; and args.json, whose
    absolute paths go up as their last part, as the card shows them (the user's directory layout is not public)."""
    if path.name == "args.json":  # the run's, and its copy in merged/
        return (json.dumps(without_folders(json.loads(path.read_text())), indent=2) + "\n").encode()
    if path.name != ADAPTER_CONFIG or not base_model:
        return path
    config = json.loads(path.read_text())
    if config.get("base_model_name_or_path") == base_model:
        return path
    return (json.dumps({**config, "base_model_name_or_path": base_model}, indent=2, sort_keys=True) + "\n").encode()


def without_folders(arguments: dict) -> dict:
    """args.json with each absolute path of a path option as its last part (a prompt that starts with "/" is no
    path); lists and a datasets list's mappings item by item."""
    from cloudtrain.config.root import option_fields

    paths = {name for name, (_, f) in option_fields().items() if f.metadata.get("path")}
    paths |= {"model_name_or_path", "tokenizer_name_or_path"}

    def reduced(value: Any) -> Any:
        if isinstance(value, str) and "://" not in value and Path(value).expanduser().is_absolute():
            return Path(value).expanduser().name
        if isinstance(value, list):
            return [reduced(item) for item in value]
        if isinstance(value, dict):
            return {key: reduced(item) for key, item in value.items()}
        return value

    return {name: reduced(value) if name in paths else value for name, value in arguments.items()}


def commit_message(results: dict) -> str:
    """One line: the steps, and each split's accuracy (a classifier) or perplexity (a language model)."""
    steps = results.get("train", {}).get("global_step")
    scores = ""
    for name in ("eval", "test"):
        metrics = results.get(name, {})
        if "accuracy" in metrics:
            scores += f", {name} accuracy {metrics['accuracy']:.4f}"
        elif "micro_f1" in metrics:
            scores += f", {name} micro F1 {metrics['micro_f1']:.4f}"
        elif "perplexity" in metrics:
            scores += f", {name} perplexity {metrics['perplexity']:.2f}"
    return f"Upload model trained with cloudtrain ({steps} steps{scores})"


def retry_command(output_dir: Path, cfg: HubConfig) -> str:
    """The `push` command that uploads `output_dir` again; the token comes from the environment. Inside a
    SageMaker job the folder goes with the instance: the job's model.tar.gz is downloaded first, on your machine."""
    assert cfg.hub_model_id is not None  # check_access checked it
    job = job_name(os.environ) if in_training_job() else None
    if job:  # from the repository's root on your machine: the job's model first, where `download` unpacks it
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        parts = ["python", "sagemaker/launch.py", "download", shlex.quote(job)]
        parts += ["--region", shlex.quote(region)] if region else []
        parts += ["&&", "python", "src/training_application.py", "push", "--output_dir"]
        parts += [shlex.quote(f"outputs/sagemaker/{job}")]
    else:
        parts = [invocation.command(), "push", "--output_dir", shlex.quote(str(Path(output_dir).resolve()))]
    parts += ["--hub_model_id", shlex.quote(cfg.hub_model_id)]
    if cfg.hub_revision:
        parts += ["--hub_revision", shlex.quote(cfg.hub_revision)]
    if cfg.hub_private_repo:
        parts += ["--hub_private_repo", "true"]
    return " ".join(parts)


# ---------------------------------------------------------------- pushes during training


class HubUploader:
    """Uploads folders to --hub_model_id on one background thread: one commit per upload, in order.

    `upload` returns at once (huggingface_hub's `run_as_future` queue); `wait` blocks until all
    queued uploads are done. A folder is read when its turn comes, so it must stay as it is until
    then (call `wait` before deleting or rewriting it).
    """

    def __init__(self, cfg: Config):
        self._hub = cfg.hub
        self._api = hub_api(cfg.hub)
        self._base_model = base_model_info(cfg.model)[0]
        self._queued: list[tuple[str, Future]] = []

    def upload(self, folder: Path, commit_message: str, path_in_repo: str = "") -> None:
        """Queue one commit of `folder`.

        At the repo root (path_in_repo "") only the model-repo files (UPLOAD_PATTERNS) go up, and no README.md:
        the card comes with the final push (a PEFT save writes a blank template); an earlier run's card, arguments
        and results are deleted, as they describe other weights. Under a path (e.g. "last-checkpoint") the whole
        folder goes up and replaces what was under that path, so it always holds exactly one checkpoint.
        """
        if path_in_repo:  # listed and hashed on the upload thread, not in the training loop
            future = self._api.run_as_future(self._upload_checkpoint, folder, path_in_repo, commit_message)
        else:
            future = self._api.run_as_future(self._upload_model_files, folder, commit_message)
        self._queued.append((commit_message, future))

    def _upload_model_files(self, folder: Path, commit_message: str) -> CommitInfo:
        """The save's model files at the root. The earlier run's card, arguments and results go in the same commit:
        they describe other weights (the final push writes this run's)."""
        files = [path for path in model_files(folder) if path.name != CARD]
        return commit_model_files(self._api, self._hub, folder, files, commit_message, self._base_model)

    def _upload_checkpoint(self, folder: Path, path_in_repo: str, commit_message: str) -> CommitInfo:
        """The whole checkpoint under `path_in_repo`, replacing what was there, in one commit: upload_folder
        commits a large folder in parts, and a kill between them left one checkpoint's weights beside another's
        optimizer state."""
        assert self._hub.hub_model_id is not None  # check_access checked it
        operations: list = [
            CommitOperationAdd(f"{path_in_repo}/{path.relative_to(folder).as_posix()}", path)
            for path in sorted(folder.rglob("*"))
            if path.is_file() and ".git" not in path.relative_to(folder).parts
        ]
        uploaded = {operation.path_in_repo for operation in operations}
        try:
            names = hub_call(self._api.list_repo_files, self._hub.hub_model_id, revision=self._hub.hub_revision)
        except (RepositoryNotFoundError, RevisionNotFoundError):  # a branch the commit creates
            names = []
        operations += [
            CommitOperationDelete(name)
            for name in names
            if name.startswith(f"{path_in_repo}/") and name not in uploaded
        ]
        return hub_call(
            self._api.create_commit,
            self._hub.hub_model_id,
            operations,
            commit_message=commit_message,
            revision=self._hub.hub_revision,
        )

    def settle(self) -> None:
        """`wait`, where a failed upload must not end the run (before rotation deletes a checkpoint, and at the
        end): said as a warning; the final push uploads the model and its files again."""
        try:
            self.wait()
        except UserError as err:
            print(f"warning: {err}; training goes on, and the push at the end uploads the model", flush=True)

    def wait(self) -> None:
        """Block until every queued upload is done, CLOUDTRAIN_HUB_WAIT seconds at most; raise UserError if any
        failed or is not done by then. One not done by then is given up: unless it began, it never does (a later
        save supersedes it); one that began goes on, and the next `wait` says how it ended."""
        queued, self._queued = self._queued, []
        limit = seconds(*WAIT)
        deadline = time.monotonic() + limit
        failed: list[tuple[str, BaseException]] = []
        for message, future in queued:
            try:
                error = future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                if not future.cancel():  # it began: the next wait says how it ended
                    self._queued.append((message, future))
                error = TimeoutError(f"not done in {limit:g} s ({WAIT[0]}); the Hub does not answer in time")
            if error:
                failed.append((message, error))
        if failed:
            message, error = failed[0]
            err = as_user_error(error, self._api, self._hub, f"background upload {message!r}")
            raise UserError(f"{len(failed)} of {len(queued)} background Hub uploads failed; first: {err}")


# ---------------------------------------------------------------- the `push` command (its options: commands.push)


def run(args: argparse.Namespace) -> None:
    output_dir = Path(args.output_dir)
    atomic.recover(output_dir)  # a final save a kill interrupted is finished before anything is read
    cfg, results = load_output_dir(output_dir)
    if args.hub_token is None and args.hub_token_file is None and os.environ.get("HF_TOKEN"):
        cfg.hub.hub_token_file = None  # HF_TOKEN before the training run's token file, as --help says
    for name in ("hub_model_id", "hub_token", "hub_token_file", "hub_private_repo", "hub_revision"):
        if getattr(args, name) is not None:
            setattr(cfg.hub, name, getattr(args, name))
    if args.hub_model_id == "":
        raise UserError("--hub_model_id is empty: give <user or organization>/<name>")
    if not cfg.hub.hub_model_id:
        raise UserError(f"{output_dir}/args.json names no Hub repository: pass --hub_model_id <user>/<name>")
    check_access(cfg.hub)
    push_output_dir(output_dir, cfg, results)


def load_output_dir(output_dir: Path) -> tuple[Config, dict]:
    """The configuration (args.json) and results (*_results.json) of a finished run."""
    args_file = output_dir / "args.json"
    if output_dir.is_file():
        raise UserError(f"--output_dir {output_dir} is a file; give the directory the training application wrote")
    if not output_dir.is_dir():
        raise UserError(
            f"--output_dir {output_dir} does not exist; give a directory written by the training application"
        )
    if output_dir.name == MERGED and (output_dir.parent / ADAPTER_CONFIG).is_file():
        raise UserError(
            f"--output_dir {output_dir} is the merged model of the run in {output_dir.parent}: push that folder (its "
            f"{MERGED}/ goes up with the adapter)"
        )
    if not holds_model(output_dir) or not args_file.is_file():
        raise UserError(
            f"--output_dir {output_dir} holds no finished run (model and args.json); "
            "give a directory written by the training application"
        )
    try:
        cfg = build_config(json.loads(args_file.read_text()))
    except (json.JSONDecodeError, UserError) as err:
        raise UserError(f"{args_file} cannot be read back: {first_line(err)}") from None
    results = {
        name: read_json(path) for name in RESULT_NAMES if (path := output_dir / f"{name}_results.json").is_file()
    }
    if "train" not in results:
        raise UserError(f"{output_dir}/train_results.json is missing: the run did not finish; train again")
    recorded = cfg.hub.hub_token_file
    if recorded and not Path(recorded).expanduser().is_file():  # the training run's secret, gone since (a mount)
        cfg.hub.hub_token_file = None  # the token comes from --hub_token, HF_TOKEN or the login, as documented
    return cfg, results
