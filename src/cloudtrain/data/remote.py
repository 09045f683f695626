"""Object-storage sources (`s3://bucket/prefix/*.jsonl`): their files listed through fsspec, and every way the
listing can fail said in one line that names what to set.

Reading goes through the same RecordReader as local files (cloudtrain.data.readers opens the URL with fsspec and
seeks by byte offset or parquet row group), so a resume reopens an object at its offset without reading what
lies before it. The client has short timeouts and two attempts (readers.REMOTE_TIMEOUTS): a wrong endpoint or an
unreachable store fails in seconds, before training, rather than hanging in botocore's retries.
"""

from __future__ import annotations

import os

from cloudtrain.data.readers import file_format, storage_options
from cloudtrain.errors import UserError

CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance or task role "
    "gives them; AWS_ENDPOINT_URL names an S3-compatible server"
)


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS's default endpoint"


def _check_credentials(path: str) -> None:
    """No credentials anywhere botocore looks: say so before any request (botocore would only fail per call)."""
    import botocore.session

    if botocore.session.get_session().get_credentials() is None:
        raise UserError(f"no AWS credentials for {path}: {CREDENTIALS_HINT}")


def _filesystem(path: str):  # noqa: ANN202 (fsspec's AbstractFileSystem; s3fs is an optional dependency)
    import fsspec

    protocol = path.split("://", 1)[0]
    try:
        return fsspec.filesystem(protocol, **storage_options(path))
    except ImportError:
        raise UserError(f"{path}: reading {protocol}:// needs s3fs: pip install 'cloudtrain[s3]'") from None


def _list(fs, path: str) -> list[str]:  # noqa: ANN001
    """Every object the source names: the glob's matches, a prefix's objects (recursively), or the one object."""
    if any(ch in path for ch in "*?["):
        return list(fs.glob(path))
    if fs.isdir(path):
        return list(fs.find(path))
    return [path] if fs.isfile(path) else []


def _failure(path: str, err: Exception) -> UserError:
    """One line for a listing that failed: unreachable endpoint, refused credentials, or something else."""
    kind, text = type(err).__name__, " ".join(str(err).split())[:200]
    if kind in ("NoCredentialsError", "PartialCredentialsError"):
        return UserError(f"no AWS credentials for {path}: {CREDENTIALS_HINT}")
    if isinstance(err, PermissionError) or kind in ("ClientError", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return UserError(f"{path}: the object store refused the credentials ({text}); {CREDENTIALS_HINT}")
    if "Connect" in kind or "Endpoint" in kind or "Timeout" in kind or isinstance(err, ConnectionError):
        return UserError(
            f"{path}: cannot reach the object store at {_endpoint()} ({kind}); check AWS_ENDPOINT_URL and the network"
        )
    return UserError(f"{path}: listing the object store at {_endpoint()} failed ({kind}: {text})")


def expand_remote(path: str) -> list[str]:
    """The data files of an object-store source, sorted, as URLs; [] when nothing matches (the caller says so).
    A missing bucket is nothing matching; no credentials, refused ones, or an unreachable endpoint are one line."""
    protocol = path.split("://", 1)[0]
    if protocol in ("s3", "s3a"):
        _check_credentials(path)
    fs = _filesystem(path)
    try:
        found = _list(fs, path)
    except FileNotFoundError:
        return []
    except Exception as err:  # noqa: BLE001 (botocore and s3fs raise many kinds; each becomes one line)
        raise _failure(path, err) from None
    return sorted(f"{protocol}://{p.split('://', 1)[-1]}" for p in found if file_format(p))
