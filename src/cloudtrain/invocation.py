"""How this process was started, so that the command lines cloudtrain prints (`use it:`, plan's launch line, the
push hint) run as printed: `cloudtrain`, `python -m cloudtrain` or `python <the path given>/training_application.py`,
with this interpreter's name (`python`, `python3`, or its path where neither on PATH is this one).
`check_launcher_variables`: a launcher's variables left where no launcher started the process. Light: imported before
anything heavy."""

import os
import shlex
import shutil
import sys
from pathlib import Path

from cloudtrain.errors import UserError

ENTRY_SCRIPT = "training_application.py"  # the script entry point (SageMaker's, and the README's)


def _script() -> str | None:
    """The entry script as the user typed its path (relative to the folder they are in), when started through it."""
    arg0 = sys.argv[0] if sys.argv else ""
    return arg0 if Path(arg0).name == ENTRY_SCRIPT else None


def _as_module() -> bool:
    path = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return path.name == "__main__.py" and path.parent.name == "cloudtrain"


def prog() -> str:
    """The program's name in usage lines: cloudtrain, training_application.py or python -m cloudtrain."""
    if _as_module():
        return "python -m cloudtrain"
    name = Path(sys.argv[0]).name if sys.argv else ""
    return name if name.endswith(".py") and name not in ("__main__.py", "ipykernel_launcher.py") else "cloudtrain"


def python() -> str:
    """This interpreter as a command: `python` or `python3` where that name on PATH is this interpreter (Debian has
    no `python`; another on PATH may lack cloudtrain), else its path (relative to here when below)."""
    exe = Path(sys.executable).absolute() if sys.executable else None
    if exe is None:
        return "python"
    for name in ("python", "python3"):
        found = shutil.which(name)
        if found and Path(found).absolute() == exe:
            return name
    here = Path.cwd()
    if not exe.is_relative_to(here):
        return shlex.quote(str(exe))
    relative = str(exe.relative_to(here))
    return shlex.quote(relative if "/" in relative else f"./{relative}")  # a bare name would be looked up on PATH


def command() -> str:
    """The start of a command line that runs cloudtrain the way this process was run."""
    script = _script()
    if script:
        return f"{python()} {shlex.quote(script)}"
    return f"{python()} -m cloudtrain" if _as_module() else "cloudtrain"


def launch_target() -> list[str]:
    """What torchrun or accelerate launch is given to run cloudtrain: the entry script when this process was started
    through it, else the installed module (both launchers take `-m`; neither runs a console script)."""
    script = _script()
    return [script] if script else ["-m", "cloudtrain"]


def check_launcher_variables() -> None:
    """A WORLD_SIZE over 1 left in the environment of a process no launcher started (it would wait for a
    rendezvous address that nothing set) is refused in one line."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit():
        raise UserError(f"the environment sets WORLD_SIZE={world}, not a number of processes: unset it")
    if int(world) > 1 and not os.environ.get("MASTER_ADDR"):
        raise UserError(
            f"the environment sets WORLD_SIZE={world} but no launcher started this process (no MASTER_ADDR): start "
            "it with torchrun or cloudtrain launch, which set both, or unset WORLD_SIZE"
        )
