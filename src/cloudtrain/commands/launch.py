"""`cloudtrain launch`: a training run on several processes (one per GPU) and nodes, started by torchrun's own
launcher (torch.distributed.run), with the options checked once before any process starts and each error line
printed once, without the launcher's traceback. See docs/distributed.md (One command).

    cloudtrain launch --nproc_per_node 8 --fsdp true --task causal_lm --model_name_or_path ...
    cloudtrain launch --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 --nproc_per_node 8 ...   (on each node)
"""

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from cloudtrain.config import add_config_arguments, config_from_namespace
from cloudtrain.errors import ERROR_DIR, UserError
from cloudtrain.invocation import launch_target
from cloudtrain.paths import check_local_paths

# the launcher's own options: (default, help); every other option is the training run's
LAUNCHER = {
    "nproc_per_node": (None, "Processes on this node (default: one per visible GPU; 1 without a GPU)."),
    "nnodes": (1, "Nodes in the launch; run the same command on each with its --node_rank."),
    "node_rank": (0, "This node's rank, 0 to --nnodes - 1."),
    "master_addr": ("127.0.0.1", "Address of the node of rank 0 (several nodes)."),
    "master_port": (None, "Port on the node of rank 0 (default: a free one on one node; 29500 on several)."),
    "max_restarts": (0, "Restart the processes this often after a failure; each restart resumes from the latest "
                        "checkpoint."),
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launch (torchrun's options; the rest are the training run's)")
    for name, (default, text) in LAUNCHER.items():
        kind = str if name == "master_addr" else int
        group.add_argument(f"--{name}", type=kind, default=default, metavar=kind.__name__.upper(), help=text)
    add_config_arguments(parser)


def split_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({launcher option: value as typed}, the training run's arguments in their order)."""
    launcher, training, i = {}, [], 0
    while i < len(argv):
        name, has_value, value = argv[i].partition("=")
        if name.startswith("--") and name[2:] in LAUNCHER:
            if not has_value:
                i += 1
                value = argv[i] if i < len(argv) else ""
            launcher[name[2:]] = value
        else:
            training.append(argv[i])
        i += 1
    return launcher, training


def torchrun_argv(args: argparse.Namespace, training: list[str]) -> list[str]:
    """torch.distributed.run's arguments: one node standalone on a free port, or the static rendezvous at
    --master_addr:--master_port that each node's launch joins."""
    port = args.master_port or (29500 if args.nnodes > 1 else _free_port())
    rendezvous = ["--nnodes", str(args.nnodes), "--node_rank", str(args.node_rank),
                  "--master_addr", args.master_addr, "--master_port", str(port)]  # fmt: skip
    return ["--nproc_per_node", str(args.nproc_per_node), *rendezvous, "--max_restarts", str(args.max_restarts),
            *launch_target(), *training]  # fmt: skip


def check_options(args: argparse.Namespace) -> None:
    problems = [
        (args.nproc_per_node is not None and args.nproc_per_node < 1, "--nproc_per_node must be at least 1"),
        (args.nnodes < 1, "--nnodes must be at least 1"),
        (
            not 0 <= args.node_rank < args.nnodes,
            f"--node_rank {args.node_rank} is not a node of --nnodes {args.nnodes}; give 0 to {args.nnodes - 1}",
        ),
        (args.max_restarts < 0, "--max_restarts must be 0 or more"),
    ]  # fmt: skip
    for failed, message in problems:
        if failed:
            raise UserError(message)


def main(argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Check the launcher's and the training run's options here, then start the processes; returns the exit
    status: 0, the status of the error lines the processes recorded (2 for a user's mistake), or 1."""
    args = parser.parse_args(argv)  # types and choices of every option
    check_options(args)
    check_local_paths(config_from_namespace(args))  # what `train` checks before it imports anything heavy
    _, training = split_argv(argv)
    args.nproc_per_node = args.nproc_per_node or _visible_gpus() or 1
    errors = Path(tempfile.mkdtemp(prefix="cloudtrain-launch-"))
    os.environ[ERROR_DIR] = str(errors)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))  # the cores
    try:
        return _run(torchrun_argv(args, training), errors)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _run(torchrun: list[str], errors: Path) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures are summed up below
    try:
        run(parse_args(torchrun))
    except ChildFailedError as err:
        recorded = recorded_errors(errors)
        for line in dict.fromkeys(line for line, _ in recorded):  # each distinct line once, in rank order
            print(line, file=sys.stderr)
        if recorded:
            return recorded[0][1]
        rank, failure = err.get_first_failure()
        print(
            f"error: the process of rank {rank} {exit_reason(failure.exitcode)}; its output is above", file=sys.stderr
        )
        return 1
    except SignalException as err:
        print(f"stopped: the launch received {signal.Signals(err.sigval).name}", file=sys.stderr)
        return 128 + err.sigval
    return 0


def recorded_errors(folder: Path) -> list[tuple[str, int]]:
    """(line, exit status) the processes of the last attempt recorded (cloudtrain.errors.report), by rank."""
    records = [json.loads(path.read_text()) for path in folder.glob("*.json")]
    last = max((r["attempt"] for r in records), default=0)
    return [(r["line"], r["status"]) for r in sorted(records, key=lambda r: r["rank"]) if r["attempt"] == last]


def exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    hint = " (often the kernel's out-of-memory killer)" if -code == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"


def _visible_gpus() -> int:
    """GPUs this launch may use, without initialising CUDA in the launcher."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    import torch

    return torch.cuda.device_count()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
