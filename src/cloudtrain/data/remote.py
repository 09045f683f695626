"""Object-storage sources (`s3://bucket/prefix/*.jsonl`): their files listed through fsspec, and every way the
listing can fail said in one line that names what to set.

Reading goes through the same RecordReader as local files (cloudtrain.data.readers opens the URL with fsspec and
seeks by byte offset or parquet row group), so a resume reopens an object at its offset without reading what
lies before it. The client has short timeouts and two attempts (readers.REMOTE_TIMEOUTS): a wrong endpoint or an
unreachable store fails in seconds, before training, rather than hanging in botocore's retries.

Hub datasets (`hf://datasets/<owner>/<name>[@revision][/path or glob]`) go through huggingface_hub's HfFileSystem,
which reads a file by ranged GETs of its resolve URL, so they are read, and resumed, like objects. The listing pins
the revision to its commit: every process and loader worker, and every file opened later, read that commit even
if the branch moves during training. HF_ENDPOINT and HF_TOKEN (or a stored login) are huggingface_hub's own.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from cloudtrain.data.readers import file_format, folder_data_files, is_glob, storage_options
from cloudtrain.errors import UserError

CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance or task role "
    "gives them; AWS_ENDPOINT_URL names an S3-compatible server"
)


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's default endpoint"


def check_credentials(path: str) -> None:
    """No credentials anywhere botocore looks: say so before any request (botocore would only fail per call)."""
    import botocore.session

    if botocore.session.get_session().get_credentials() is None:
        raise UserError(f"no AWS credentials for {path}: {CREDENTIALS_HINT}")


def _filesystem(path: str):  # noqa: ANN202 (fsspec's AbstractFileSystem; s3fs is an optional dependency)
    import fsspec
    from fsspec.registry import known_implementations

    protocol = path.split("://", 1)[0]
    if protocol not in known_implementations and protocol not in fsspec.available_protocols():
        close = difflib.get_close_matches(protocol, ["s3", "hf", "gs", "az", "http", "https"], n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}://? " if close else ""
        raise UserError(f"{path}: {protocol}:// is not a storage protocol; {hint}give s3://, hf:// or a local path")
    try:
        return fsspec.filesystem(protocol, **storage_options(path))
    except ImportError:
        package = known_implementations[protocol]["class"].split(".")[0]
        how = "pip install 'cloudtrain[s3]'" if package == "s3fs" else f"pip install {package}"
        raise UserError(f"{path}: reading {protocol}:// needs {package}: {how}") from None


def _list(fs, path: str) -> list[str]:  # noqa: ANN001
    """Every object the source names: the glob's matches, a prefix's objects (recursively), or the one object."""
    if is_glob(path):  # its files (a prefix matched is no object to read)
        return [p for p, info in fs.glob(path, detail=True).items() if info.get("type") != "directory"]
    if fs.isdir(path):
        return list(fs.find(path))
    return [path] if fs.isfile(path) else []


def remote_failure(path: str, err: Exception, doing: str = "listing") -> UserError:
    """One line for a listing (or an opening) that failed: unreachable endpoint, refused credentials, or else."""
    kind, text = type(err).__name__, " ".join(str(err).split())[:200]
    if kind in ("NoCredentialsError", "PartialCredentialsError"):
        return UserError(f"no AWS credentials for {path}: {CREDENTIALS_HINT}")
    if isinstance(err, PermissionError) or kind in ("ClientError", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return UserError(f"{path}: the object store refused the credentials ({text}); {CREDENTIALS_HINT}")
    if "Connect" in kind or "Endpoint" in kind or "Timeout" in kind or isinstance(err, ConnectionError):
        return UserError(
            f"{path}: cannot reach the object store at {_endpoint()} ({kind}); check AWS_ENDPOINT_URL and the network",
            transient=True,
        )
    return UserError(f"{path}: {doing} the object store at {_endpoint()} failed ({kind}: {text})")


def expand_remote(path: str, fmt: str | None = None) -> list[str]:
    """The data files of an object-store source, sorted, as URLs; [] when nothing matches (the caller says so).
    A missing bucket is nothing matching; no credentials, refused ones, or an unreachable endpoint are one line."""
    protocol = path.split("://", 1)[0]
    if protocol == "hf":
        return expand_hub(path, fmt)
    if protocol in ("s3", "s3a"):
        check_credentials(path)
    fs = _filesystem(path)
    try:
        found = _list(fs, path)
    except FileNotFoundError:
        return []
    except Exception as err:  # noqa: BLE001 (botocore and s3fs raise many kinds; each becomes one line)
        raise remote_failure(path, err) from None
    named = [p for p in found if file_format(p) or (fmt and not p.rsplit("/", 1)[-1].startswith(("_", ".")))]
    found = named if is_glob(path) else folder_data_files(found, fmt)  # a glob keeps the matches a format names
    return sorted(f"{protocol}://{p.split('://', 1)[-1]}" for p in found)


# ---------------------------------------------------------------- Hugging Face Hub datasets
HUB_TIMEOUT = 10  # seconds for the first request (the dataset's info): an unreachable Hub is one line, not a hang
TOKEN_HINT = "set HF_TOKEN (or run `hf auth login`) with a token that can read it"
# A file or folder named for a split, as the Hub names them (train-00000-of-00002.parquet, data/test/...)
SPLIT_WORDS = {"train": "train|training", "other": "validation|valid|val|dev|test|testing|eval|evaluation"}


def hub_dataset_source(name: str, config: str | None = None) -> str:
    """The stream source that `--dataset_name <name> --streaming true` means: the Hub dataset's data files."""
    if Path(name).is_dir():
        raise UserError(
            f"--dataset_name {name} is a saved dataset (save_to_disk), which is not streamed; give its data files "
            "as --train_file, or drop --streaming"
        )
    if config:
        raise UserError(
            f"--dataset_config {config} with --streaming true: name that configuration's files instead, "
            f"--train_file 'hf://datasets/{name}/<its folder or glob>'"
        )
    return f"hf://datasets/{name}"


def _hub_uri(path: str) -> Any:
    from huggingface_hub.utils import parse_hf_uri

    try:
        uri = parse_hf_uri(path)
    except ValueError as err:
        raise UserError(
            f"{path} is not a Hub dataset path ({err}); write hf://datasets/<owner>/<name>[/path]"
        ) from None
    if uri.type != "dataset" or uri.is_bucket:
        raise UserError(f"{path}: only dataset repos stream; write hf://datasets/<owner>/<name>[/path or glob]")
    return uri


def _hub_commit(path: str, repo_id: str, revision: str | None) -> str:
    """The commit that `revision` (default: main) names, from the dataset's info; every way that fails is one line."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{path}: HF_HUB_OFFLINE is set; unset it to stream from the Hub, or give local files")
    try:
        info = HfApi().dataset_info(repo_id, revision=revision, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        raise UserError(
            f"{path}: the dataset is gated; accept its conditions on its Hub page and {TOKEN_HINT}"
        ) from None
    except RepositoryNotFoundError:
        if get_token() is None:
            raise UserError(f"{path}: dataset {repo_id} is not on {endpoint}, or is private: {TOKEN_HINT}") from None
        raise UserError(f"{path}: dataset {repo_id} is not on {endpoint}, or the token cannot read it") from None
    except RevisionNotFoundError:
        raise UserError(f"{path}: dataset {repo_id} has no revision {revision!r} (a branch, tag or commit)") from None
    except Exception as err:  # noqa: BLE001 (httpx and huggingface_hub raise many kinds; each becomes one line)
        raise _hub_failure(path, endpoint, err) from None
    if not info.sha:
        raise UserError(f"{path}: {endpoint} gave no commit for dataset {repo_id}; check HF_ENDPOINT")
    return info.sha


def _hub_failure(path: str, endpoint: str, err: Exception) -> UserError:
    kind, text = type(err).__name__, " ".join(str(err).split())[:200]
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return UserError(f"{path}: the Hub at {endpoint} refused the token ({text}); {TOKEN_HINT}")
    if status is None and ("Connect" in kind or "Timeout" in kind or isinstance(err, OSError)):
        return UserError(
            f"{path}: cannot reach the Hub at {endpoint} ({kind}); check HF_ENDPOINT and the network", transient=True
        )
    return UserError(f"{path}: the Hub at {endpoint} failed ({kind}: {text})")


def _training_files(found: list[str], root: str) -> list[str]:
    """A folder's data files; when some are named for a split, its training ones (the Hub's layout of splits)."""
    relative = {f: f[len(root) :] for f in found}
    named = {
        split: {f for f, rel in relative.items() if re.search(rf"(^|[/\-._ 0-9])({words})([/\-._ 0-9]|$)", rel)}
        for split, words in SPLIT_WORDS.items()
    }
    return sorted(named["train"]) if named["train"] else sorted(set(found) - named["other"])


def expand_hub(path: str, fmt: str | None = None) -> list[str]:
    """The data files of a Hub dataset source, as `hf://datasets/<repo>@<commit>/<file>` URLs, sorted; [] when
    nothing matches. A repo or folder gives its data files (its training split's, when files are named for splits),
    a glob its matches, a file itself."""
    import fsspec

    uri = _hub_uri(path)
    root = f"datasets/{uri.id}@{_hub_commit(path, uri.id, uri.revision)}/"
    inside = root + uri.path_in_repo.strip("/")
    fs = fsspec.filesystem("hf")  # cached: what is listed under a commit never changes, and files opened reuse it
    try:
        if is_glob(uri.path_in_repo):
            found = list(fs.glob(inside))
        elif not uri.path_in_repo or fs.isdir(inside):
            found = _training_files(folder_data_files(fs.find(inside), fmt), root)
        else:
            found = [inside] if fs.isfile(inside) else []
    except FileNotFoundError:
        return []
    except Exception as err:  # noqa: BLE001 (the listing's own failures: as for the info)
        raise _hub_failure(path, fs.endpoint, err) from None
    return sorted(f"hf://{f}" for f in found if file_format(f) or fmt)
