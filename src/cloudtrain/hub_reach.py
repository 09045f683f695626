"""Whether the Hub ids a run's options name can be had, checked before the heavy imports (cloudtrain.paths).

An id that is no local folder and that nothing in the local caches holds can only come from the Hub. When the
endpoint does not answer, huggingface_hub retries each request for about half a minute, a line each time, before
transformers or datasets fail: one request with a short timeout says so here, in one line. With HF_HUB_OFFLINE
set such an id is refused at once. When every id is cached and the endpoint does not answer, the run goes offline
(the loaders use their caches at once, not after their retries); when it answers, the loaders have every id.

Imports neither huggingface_hub nor datasets (seconds of CPU): their settings are read as they read them, from
their modules where something imported them already (a notebook; a test that points the client at a local
server), else from the same environment variables.
"""

import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from cloudtrain.errors import UserError

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 3.0  # one request: an endpoint that answers does so well within it
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's and datasets' spelling of a true variable


@dataclass(frozen=True)
class HubId:
    flag: str  # the option that names it: --model_name_or_path, --tokenizer_name_or_path, --dataset_name
    repo_id: str
    kind: str = "model"  # or "dataset"


def looks_like_repo_id(name: str) -> bool:
    """`name` could be a Hub repo id (`gpt2`, `org/name`), not a path."""
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not name.startswith((".", "-"))


def _true(value: str | None) -> bool:
    return value is not None and value.upper() in _TRUE


def _hub_constants():  # noqa: ANN202 (huggingface_hub.constants when imported: the values the client uses)
    return sys.modules.get("huggingface_hub.constants")


def endpoint() -> str:
    constants = _hub_constants()
    return constants.ENDPOINT if constants else os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def _hub_offline() -> str | None:
    constants = _hub_constants()
    if constants is not None:
        return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None
    # huggingface_hub: HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE where HF_HUB_OFFLINE is unset or empty
    variable = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return variable if _true(os.environ.get(variable)) else None


def offline(kind: str) -> str | None:
    """The variable that keeps `kind`'s loader off the network (None: it may download)."""
    if kind != "dataset":
        return _hub_offline()
    own = os.environ.get("HF_DATASETS_OFFLINE")  # datasets: its own variable first, else the hub's
    loaded = sys.modules.get("datasets.config")
    if loaded is not None:
        return ("HF_DATASETS_OFFLINE" if own is not None else "HF_HUB_OFFLINE") if loaded.HF_HUB_OFFLINE else None
    if own is not None:
        return "HF_DATASETS_OFFLINE" if _true(own) else None
    return _hub_offline()


def _home() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "huggingface")
    return os.path.expandvars(os.path.expanduser(os.environ.get("HF_HOME", default)))


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repos (HF_HUB_CACHE)."""
    constants = _hub_constants()
    if constants:
        return Path(constants.HF_HUB_CACHE)
    legacy = os.environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(_home(), "hub"))
    return Path(os.path.expandvars(os.path.expanduser(os.environ.get("HF_HUB_CACHE", legacy))))


def datasets_cache() -> Path:
    """Where datasets keeps the datasets it prepared (HF_DATASETS_CACHE)."""
    loaded = sys.modules.get("datasets.config")
    if loaded is not None:
        return Path(loaded.HF_DATASETS_CACHE)
    return Path(os.path.expanduser(os.environ.get("HF_DATASETS_CACHE", os.path.join(_home(), "datasets"))))


def _snake(name: str) -> str:
    """datasets.naming.camelcase_to_snakecase: how datasets names a dataset's cache folder."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()


def cached(hub_id: HubId) -> bool:
    """Anything of the repo in the Hub cache (a snapshot with files), or a dataset datasets prepared earlier. A
    partial copy counts: the loader says what it lacks better than a guess here."""
    try:
        snapshots = hub_cache() / f"{hub_id.kind}s--{hub_id.repo_id.replace('/', '--')}" / "snapshots"
        if snapshots.is_dir() and any(any(s.iterdir()) for s in snapshots.iterdir() if s.is_dir()):
            return True
        if hub_id.kind == "dataset":  # <cache>/<namespace>___<name>/<config>/<version>/<hash>, as datasets lays it
            *namespace, name = hub_id.repo_id.split("/")
            prepared = datasets_cache() / "___".join([*namespace, _snake(name)])
            return any(p.is_dir() for p in prepared.glob("*/*/*"))
    except OSError:  # an unreadable cache: as if empty, the loaders will say more
        return False
    return False


def unreachable(url: str, timeout: float = TIMEOUT_S) -> str | None:
    """Why `url` does not answer within `timeout` seconds; None when it answers, with any status (a 404, a 401:
    someone is there). A TLS failure is left to the loaders too: a server answered, and they judge certificates
    with their own trust store."""
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    why: list[str] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        except urllib.error.HTTPError:
            pass
        except urllib.error.URLError as err:
            if not isinstance(err.reason, ssl.SSLError | ssl.CertificateError):
                why.append(str(err.reason) or type(err.reason).__name__)
        except (http.client.HTTPException, ssl.SSLError):  # something answered, not as the loaders expect
            pass
        except (OSError, ValueError) as err:  # a timeout, a reset; a malformed HF_ENDPOINT
            why.append(str(err) or type(err).__name__)

    # in a thread: the name lookup (getaddrinfo) knows no timeout, and a resolver that cannot be reached hangs it
    thread = threading.Thread(target=probe, name="cloudtrain-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if thread.is_alive():
        return f"no answer in {timeout:.0f} s"
    return why[0] if why else None


def check_hub_ids(wanted: list[HubId], may_go_offline: bool = True) -> None:
    """Refuse, in one line, an id that only the Hub can give while the Hub cannot be reached or may not be used."""
    ids = list(dict.fromkeys(wanted))
    missing = [hub_id for hub_id in ids if not cached(hub_id)]
    for hub_id in missing:
        variable = offline(hub_id.kind)
        if variable:
            cache = datasets_cache() if hub_id.kind == "dataset" else hub_cache()
            local = "give local files (--train_file)" if hub_id.kind == "dataset" else "give a local folder"
            raise UserError(
                f"{hub_id.flag} {hub_id.repo_id}: no cached copy and the Hub cannot be reached ({variable} is set; "
                f"nothing of it in {cache}); unset {variable} to download it, or {local}"
            )
    if not missing:
        if may_go_offline:  # not when the run pushes to the Hub: offline, the push would be refused
            _use_the_cache_if_unreachable(ids)
        return
    url = endpoint()
    reason = unreachable(url)
    if reason:
        first = missing[0]
        named, connect = (
            (" (HF_ENDPOINT)", "check HF_ENDPOINT and the network")
            if url != DEFAULT_ENDPOINT
            else ("", "connect to the internet")
        )
        local = "give local files (--train_file)" if first.kind == "dataset" else "give a local folder"
        raise UserError(
            f"cannot reach {url}{named} to download {first.repo_id} ({first.flag}; no local folder has that name "
            f"either): {reason}; {connect}, {local}, "
            "or set HF_HUB_OFFLINE=1 to use only what is cached",
            transient=True,
        )


_SWITCHED: dict = {}  # what going offline changed: {variable or (module, attribute): the value before}


def _use_the_cache_if_unreachable(ids: list[HubId]) -> None:
    """Every id is cached. A Hub that does not answer would cost each loader half a minute of retries before it
    falls back to its cache: the run goes offline at once instead (this process and the ones it starts, until
    `back_online`), saying so."""
    online = [hub_id for hub_id in ids if offline(hub_id.kind) is None]
    url = endpoint()
    if not online or not (reason := unreachable(url)):
        return
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        _SWITCHED.setdefault(variable, os.environ.get(variable))
        os.environ[variable] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):  # imported already: they read the variable then
        if (loaded := sys.modules.get(module)) is not None:
            _SWITCHED.setdefault((module, "HF_HUB_OFFLINE"), loaded.HF_HUB_OFFLINE)
            setattr(loaded, "HF_HUB_OFFLINE", True)  # noqa: B010 (a module found at run time)
    if os.environ.get("RANK", "0") == "0":
        names = ", ".join(hub_id.repo_id for hub_id in online)
        print(f"note: cannot reach {url} ({reason}): {names} from the local cache (HF_HUB_OFFLINE=1 for this run)")


def back_online() -> None:
    """Undo what going offline changed: a notebook's next run asks the Hub again."""
    for key, value in _SWITCHED.items():
        if isinstance(key, tuple):
            if (loaded := sys.modules.get(key[0])) is not None:
                setattr(loaded, key[1], value)
        elif value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SWITCHED.clear()
