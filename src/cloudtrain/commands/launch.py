"""`cloudtrain launch`: a training run on several processes (one per GPU) and nodes, started by torchrun's own
launcher (torch.distributed.run), with the options checked once before any process starts and each error line
printed once, without the launcher's traceback. See docs/distributed.md (One command).

    cloudtrain launch --nproc_per_node 8 --fsdp true --task causal_lm --model_name_or_path ...
    cloudtrain launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --nproc_per_node 8 ...   (on each node)
"""

import argparse
import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import psutil

from cloudtrain.config import add_config_arguments, config_from_namespace
from cloudtrain.config.checks import process_count_refusals
from cloudtrain.errors import ERROR_DIR, UserError, first_line, recorded_errors, refuse_first
from cloudtrain.invocation import launch_target
from cloudtrain.paths import check_local_paths

# the launcher's own options: (default, help); every other option is the training run's
LAUNCHER = {
    "nproc_per_node": (None, "Processes on this node (default: one per visible GPU; 1 without a GPU)."),
    "nnodes": (1, "Nodes in the launch; run the same command on each with its --node_rank and --master_addr."),
    "node_rank": (0, "This node's rank, 0 to --nnodes - 1."),
    "master_addr": (None, "Address of the node of rank 0, the same on every node (needed with --nnodes > 1)."),
    "master_port": (None, "Port on the node of rank 0 (default: one node picks a free one; several use 29500)."),
    "max_restarts": (0, "Restart this node's processes this often after a failure; each restart resumes from the "
                        "latest checkpoint (one node)."),
    "stop_timeout": (300, "Seconds the processes get after Ctrl-C or SIGTERM to save a checkpoint and stop, "
                          "before they are killed."),
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launch (torchrun's options; the rest are the training run's)")
    for name, (default, text) in LAUNCHER.items():
        kind = str if name == "master_addr" else int
        group.add_argument(f"--{name}", type=kind, default=default, metavar=kind.__name__.upper(), help=text)
    add_config_arguments(parser)


def training_argv(argv: list[str]) -> list[str]:
    """The training run's arguments as typed, in their order: `argv` less the launcher's options and values."""
    training, i = [], 0
    while i < len(argv):
        name, has_value, _ = argv[i].partition("=")
        if name.startswith("--") and name[2:] in LAUNCHER:
            i += 1 if has_value else 2
            continue
        training.append(argv[i])
        i += 1
    return training


def torchrun_argv(args: argparse.Namespace, training: list[str], known: frozenset[str] | None = None) -> list[str]:
    """torch.distributed.run's arguments: one node standalone (torch picks a free port unless one is given), or
    the static rendezvous at --master_addr:--master_port that each node's launch joins. `known`: the options the
    installed torchrun takes (torch 2.9 has neither of the last two below, 2.11 no --shutdown_timeout)."""
    known = torchrun_options() if known is None else known
    rendezvous = ["--standalone", "--local_addr", "127.0.0.1"]  # not the host's name, which may not resolve
    if args.nnodes > 1 or args.master_port is not None or args.master_addr:
        address = ["--master_addr", args.master_addr or "127.0.0.1", "--master_port", str(args.master_port or 29500)]
        rendezvous = ["--nnodes", str(args.nnodes), "--node_rank", str(args.node_rank), *address]
    argv = ["--nproc_per_node", str(args.nproc_per_node), *rendezvous, "--max_restarts", str(args.max_restarts)]
    if "--shutdown_timeout" in known:
        argv += ["--shutdown_timeout", str(args.stop_timeout)]
    if "--signals_to_handle" in known:  # Ctrl-C is the launcher's own (SecondInterruptKills)
        argv += ["--signals_to_handle", "SIGTERM,SIGHUP,SIGQUIT"]
    return [*argv, *launch_target(), *training]


@functools.cache
def torchrun_options() -> frozenset[str]:
    from torch.distributed.run import get_args_parser

    return frozenset(option for action in get_args_parser()._actions for option in action.option_strings)


def check_options(args: argparse.Namespace) -> None:
    nodes = "0" if args.nnodes == 1 else f"0 to {args.nnodes - 1}"
    several = f"--nnodes {args.nnodes}: give --master_addr, the address of the node of rank 0 (the same on each)"
    restarts = (
        "--max_restarts restarts one node's processes only; over several nodes use torchrun with a c10d "
        "rendezvous (scripts/slurm_train.sbatch)"
    )
    problems = [
        (args.nproc_per_node is not None and args.nproc_per_node < 1, "--nproc_per_node must be at least 1"),
        (args.nnodes < 1, "--nnodes must be at least 1"),
        (
            not 0 <= args.node_rank < args.nnodes,
            f"--node_rank {args.node_rank} is not a node of --nnodes {args.nnodes}; give {nodes}",
        ),
        (args.nnodes > 1 and not args.master_addr, several),
        (args.master_port is not None and not 0 < args.master_port < 65536, "--master_port must be 1 to 65535"),
        (args.max_restarts < 0, "--max_restarts must be 0 or more"),
        (args.max_restarts > 0 and args.nnodes > 1, restarts),
        (args.stop_timeout < 0, "--stop_timeout must be 0 or more"),
    ]
    for failed, message in problems:
        if failed:
            raise UserError(message)


def main(argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Check the launcher's and the training run's options here, then start the processes; returns the exit
    status: 0, or the failed process's (2 for a user's mistake, 128 + the signal for a killed one)."""
    args = parser.parse_args(argv)  # types and choices of every option
    check_options(args)
    cfg = config_from_namespace(args)
    check_local_paths(cfg, args.nnodes)  # what `train` checks before it imports anything heavy
    training = training_argv(argv)
    args.nproc_per_node = args.nproc_per_node or _visible_gpus() or 1
    refuse_first(process_count_refusals(cfg, args.nproc_per_node * args.nnodes, "cloudtrain launch"))
    if "--shutdown_timeout" not in torchrun_options():
        print(
            "note: this torch's launcher gives the processes its own 30 s, not --stop_timeout, to save a checkpoint "
            "after Ctrl-C or SIGTERM (a newer torch, such as 2.13, takes the option)",
            file=sys.stderr,
        )
    errors = Path(tempfile.mkdtemp(prefix="cloudtrain-launch-"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    saved = {name: os.environ.get(name) for name in (ERROR_DIR, "OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE")}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # torch's agent sets its own
    os.environ[ERROR_DIR] = str(errors)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.nproc_per_node)))  # the cores each may use
    try:
        return _run(torchrun_argv(args, training), errors)
    finally:
        shutil.rmtree(errors, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _run(torchrun: list[str], errors: Path) -> int:
    import logging

    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    options = parse_args(torchrun)
    for name in QUIETED:  # failures are summed up below; the agent's loggers set their own levels
        logging.getLogger(name).setLevel(logging.CRITICAL)
    interrupts = SecondInterruptKills()
    try:
        signal.signal(signal.SIGINT, interrupts)  # main() puts the caller's handler back
        run(options)
    except ChildFailedError as err:
        lines, status = failure_lines(err.failures, recorded_errors(errors), err.get_first_failure()[0])
        print("\n".join(lines), file=sys.stderr)
        return status
    except SignalException as err:
        # a Ctrl-C in the middle of starting the ranks can leave some outside the agent's reach
        kill_everything_under_this_process()
        name = signal.Signals(err.sigval).name
        said = [KILLED_AT_ONCE] if interrupts.killed else stopped_lines(recorded_errors(errors), name)
        print("\n".join(said), file=sys.stderr)
        return 128 + err.sigval
    except (DistError, RendezvousError) as err:
        where = "this machine" if options.standalone else f"{options.master_addr}:{options.master_port}"
        advice = "check --master_addr and --master_port (a port in use: give another, or leave it out on one node)"
        print(f"error: the launch's processes could not meet at {where} ({first_line(err)}); {advice}", file=sys.stderr)
        return 1
    return 0


KILLED_AT_ONCE = (
    "stopped at once: a second Ctrl-C killed the launch's processes without a checkpoint; checkpoints saved earlier "
    "are kept (--resume_from_checkpoint latest continues from the newest)"
)


class SecondInterruptKills:
    """The launcher's Ctrl-C handler. The first is handed to torch's agent as its own handler would (it asks each
    process to save a checkpoint and stop, within --stop_timeout); a second kills every process under the
    launcher at once, as a second Ctrl-C does in a one-process run. torch's agent would pass it on as one more
    SIGTERM and wait out --stop_timeout again. (Where torchrun has no --signals_to_handle, as in torch 2.9, its
    agent keeps SIGINT, and a second Ctrl-C is torch's.)"""

    def __init__(self) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException  # here, not in the handler

        self.signal_exception = SignalException
        self.count, self.killed = 0, False

    def __call__(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.count > 1:  # killed: any was still running (not: all had saved and ended already)
            self.killed = kill_everything_under_this_process() > 0 or self.killed
        # raised each time: the agent shuts down from whatever it was doing (its wait for the killed ones is short)
        raise self.signal_exception(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)


def kill_everything_under_this_process() -> int:
    """SIGKILL to each process under this one: each rank's process group (torch starts every rank as the leader of
    its own session, with its loader workers in it), then any descendant left; how many were still running."""
    children = psutil.Process().children(recursive=True)
    running = 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            running += child.status() != psutil.STATUS_ZOMBIE
    for child in children:
        with contextlib.suppress(OSError):
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return running


QUIETED = (
    "torch.distributed.elastic",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
)


def failure_lines(failures: dict, records: list[dict], first: int) -> tuple[list[str], int]:
    """The lines that say why a launch failed, each once, the first failure's first, and its exit status: what each
    failed process recorded (cloudtrain.errors.report, matched by its pid), else how it ended. Not told: a process
    the launcher itself stopped (SIGTERM) after the first failure, and a process that left its mistake to rank 0's
    line (status 2) where a line was recorded."""
    by_pid = {r["pid"]: r for r in records}
    recorded = any(by_pid.get(failure.pid, {}).get("line") for failure in failures.values())
    lines, status = [], 1
    for rank in sorted(failures, key=lambda rank: rank != first):
        code, record = failures[rank].exitcode, by_pid.get(failures[rank].pid)
        stopped_by_launcher = code in (-signal.SIGTERM, -signal.SIGINT) and rank != first
        if record and record["line"]:
            lines.append(record["line"])
        elif record and recorded:  # quiet: another process said it (cloudtrain.errors.record_quiet)
            pass
        elif not stopped_by_launcher and not (code == 2 and recorded):
            lines.append(f"error: the process of rank {rank} {exit_reason(code)}")
        if rank == first:
            status = record["status"] if record else _status(code)
    return list(dict.fromkeys(lines)), status


def stopped_lines(records: list[dict], signal_name: str) -> list[str]:
    """After Ctrl-C or SIGTERM: what the processes of the last attempt said as they stopped (where their checkpoint
    went), each line once; else that they said nothing."""
    stopped = [r for r in records if r["status"] in (130, 143)]
    attempt = max((r["attempt"] for r in stopped), default=0)
    lines = list(dict.fromkeys(r["line"] for r in stopped if r["attempt"] == attempt and r["line"]))
    unsaid = (
        f"stopped: the launch received {signal_name} and its processes ended without saying whether they saved a "
        "checkpoint; checkpoints saved earlier are kept (--resume_from_checkpoint latest continues from the newest)"
    )
    return lines or [unsaid]


def _status(code: int) -> int:
    """A process's exit code as a shell reports it: 128 + the signal that killed it."""
    return 128 - code if code < 0 else code or 1


def exit_reason(code: int) -> str:
    if code == 2:
        return "exited with status 2 (a mistake in the options or the data)"
    if code >= 0:
        return f"exited with status {code}; its output is above"
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    oom = " (often the kernel's out-of-memory killer: see dmesg, and try a smaller batch)"
    return f"was killed by {name}{oom if -code == signal.SIGKILL else ''}"


def _visible_gpus() -> int:
    """GPUs this launch may use, without initialising CUDA in the launcher."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    import torch

    return torch.cuda.device_count()
