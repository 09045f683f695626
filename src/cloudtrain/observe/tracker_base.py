"""What every tracker of cloudtrain.observe.tracking shares: the run it opens (RunContext), what RunLog asks of it
beyond accelerate's tracker API (RunMethods), and a probe of a tracking server."""

import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from cloudtrain.config import Config, TrackingConfig


@dataclass
class RunContext:
    """What a tracker needs to open its run."""

    cfg: Config
    output_dir: Path
    run_name: str
    resume_step: int | None
    # Where the part resumed logged at its checkpoint's own step after the save (a finished run's final evaluation,
    # which this part does again): the lines metrics.jsonl keeps at that step. None where it logged nothing there.
    kept_at_resume_step: list[dict] | None = None

    @property
    def tracking(self) -> TrackingConfig:
        return self.cfg.tracking


def numbers(values: dict) -> dict:
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class RunMethods:
    """What RunLog needs beyond accelerate's tracker API; the defaults suit a metrics-only tracker."""

    if TYPE_CHECKING:  # accelerate's GeneralTracker, every tracker's other base, provides these

        def start(self) -> None: ...

        def store_init_configuration(self, values: dict) -> None: ...

        def log(self, values: dict, step: int | None = None, **kwargs) -> None: ...

        def finish(self) -> None: ...

    def state(self) -> dict:
        """What a resumed run needs to find this run again."""
        raise NotImplementedError

    def log_config(self, config: dict) -> None:
        self.store_init_configuration(config)

    def log_summary(self, summary: dict, step: int) -> None:
        self.log(numbers(summary), step=step)

    def log_confusion_matrix(self, name: str, matrix: list[list[int]], labels: list[str], step: int) -> None:
        pass

    def log_table(self, name: str, header: list[str], rows: list[list], step: int) -> None:
        pass

    def alert(self, title: str, text: str) -> None:
        """A notification for a human, where the tracker has them."""

    def log_files(self, curves_png: Path, step: int) -> None:
        pass

    def log_images(self, name: str, captions: list[str], images: list, grid: Image.Image, step: int) -> None:
        """Images with captions (`grid`: all of them in one picture, for trackers that take one)."""


def reachable(url: str, timeout: float) -> bool:
    """Whether an HTTP server answers at `url` within `timeout` seconds, whatever its status (so a user and password
    in the URL are left out: urllib took them for part of the host name; found in audit)."""
    return http_status(urllib.request.Request(without_userinfo(url), method="HEAD"), timeout) is not None


def http_status(request: urllib.request.Request, timeout: float) -> int | None:
    """The HTTP status a server answers `request` with within `timeout` seconds; 0 where it answered over TLS with a
    certificate this process does not trust (MLflow's own TLS settings may trust it); None where no answer came.

    The request runs in a daemon thread because a DNS lookup is not bound by the socket timeout.
    """
    statuses: list[int] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                statuses.append(response.status)
        except urllib.error.HTTPError as err:
            statuses.append(err.code)
        except urllib.error.URLError as err:
            if isinstance(err.reason, ssl.SSLError):
                statuses.append(0)
        except ssl.SSLError:
            statuses.append(0)
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return statuses[0] if statuses else None


def without_userinfo(url: str) -> str:
    """`url` without its user and password (https://alice:pw@host/x -> https://host/x)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
