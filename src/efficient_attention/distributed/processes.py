"""Run a function on the ranks of a process group of local processes, and collect its results.

Context parallelism is meant for several devices, but its logic runs unchanged on ``p``
processes of one machine with the ``gloo`` backend, each process standing for a device
and communicating through the operating system. :func:`run_on_processes` starts them,
joins them into a process group, runs one function on every rank and returns what each
rank returned: enough for the examples and the chapter on context parallelism.

Starting a process costs what it has to import. With the start method ``"fork"`` (the
default where the platform has it, with ``gloo``) each process is a copy of the caller:
torch and everything else already imported is there at once, and so is a function
defined in a notebook or at the interactive prompt. ``"spawn"`` and ``"forkserver"``
start clean processes, which import torch again (seconds each) and find the function by
its module and name: it must be defined in an importable module. Use one of them with
``nccl``: CUDA cannot be used in a process forked from one that has used it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._checks import check_choice, check_positive_float, check_positive_int

__all__ = ["run_on_processes"]

BACKENDS = ("gloo", "nccl")
START_METHODS = ("fork", "forkserver", "spawn")


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of the process group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, function: Callable[..., Any], args: tuple, world_size: int,
               port: int, backend: str, threads: int, timeout_s: float,
               directory: str) -> None:
    """One rank: join the group, run ``function(*args)``, save its result, leave the group."""
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = function(*args)
        with open(Path(directory) / f"rank{rank}.pickle", "wb") as file:
            pickle.dump(result, file)
    except Exception:
        # Recorded before this rank leaves the group: a peer that fails *because* this
        # rank left ("connection closed by peer") records a later time.
        _record_failure(Path(directory), rank, traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _record_failure(directory: Path, rank: int, trace: str) -> None:
    """Save when and how ``rank`` failed (written whole, then renamed into place)."""
    partial = directory / f"rank{rank}.error.partial"
    with open(partial, "wb") as file:
        pickle.dump((time.time(), rank, trace), file)
    os.replace(partial, directory / f"rank{rank}.error")


def _first_failure(directory: str, reported: mp.ProcessRaisedException,
                   pids: Sequence[int]) -> mp.ProcessRaisedException:
    """The error of the rank that failed first, which the others' errors follow from.

    ``join`` reports the first process it sees *exit*; when one rank raises and leaves
    the group, its peers fail in turn with "connection closed by peer", and one of them
    may exit first. The times each rank recorded put the cause first.
    """
    failures = []
    for path in Path(directory).glob("rank*.error"):
        with open(path, "rb") as file:
            failures.append(pickle.load(file))  # (time, rank, traceback)
    if not failures:
        return reported
    failures.sort()
    moment, rank, trace = failures[0]
    later = [other for _, other, _ in failures[1:]]
    message = f"\n\n-- Process {rank:d} terminated with the following error:\n{trace}"
    if later:
        message += (f"\n(rank{'s' if len(later) > 1 else ''} "
                    f"{', '.join(map(str, later))} failed after it)")
    return mp.ProcessRaisedException(message, rank, pids[rank])


def run_on_processes(
    function: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    threads: int = 1,
    start_method: str | None = None,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``function(*args)`` on ``world_size`` new processes, the ranks of one process
    group, and return the results in rank order.

    Each process sets ``torch.set_num_threads(threads)``, calls
    ``torch.distributed.init_process_group(backend, ...)`` (rendezvous on a free port of
    127.0.0.1; with ``nccl``, rank ``r`` uses ``cuda:r``), runs ``function(*args)``, in
    which ``torch.distributed.get_rank()`` gives its rank, and leaves the group.

    Args:
        function: what every rank runs; its result must be picklable (it comes back
            through a file). With ``"spawn"`` or ``"forkserver"`` it must also be defined
            in an importable module (see the module docstring).
        world_size: the number of processes ``p``.
        args: the positional arguments, the same for every rank.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, one GPU per rank).
        threads: torch threads per process: 1 leaves one core per process.
        start_method: ``"fork"``, ``"forkserver"`` or ``"spawn"``; ``None`` takes
            ``"fork"`` for ``gloo`` where the platform has it, else ``"spawn"``.
        timeout_s: the limit, in seconds, for the whole run and for any collective that
            waits; past it every process is killed and ``TimeoutError`` raised.

    Returns:
        ``[result of rank 0, ..., result of rank p - 1]``.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised; the message holds
            the traceback of the rank that raised first (peers that failed because it
            left the group are named after it), and the other ranks are killed.
        TimeoutError: the processes ran past ``timeout_s``.
        RuntimeError: ``"fork"`` from a process that is itself in a process group.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    world_size = check_positive_int(world_size, "world_size")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    backend = check_choice(backend, "backend", BACKENDS)
    threads = check_positive_int(threads, "threads")
    timeout_s = check_positive_float(timeout_s, "timeout_s")
    available = mp.get_all_start_methods()
    if start_method is None:
        start_method = "fork" if backend == "gloo" and "fork" in available else "spawn"
    start_method = check_choice(start_method, "start_method", START_METHODS)
    if start_method not in available:
        raise ValueError(f"start_method {start_method!r} is not available on this platform "
                         f"(available: {available})")
    if start_method == "fork" and dist.is_available() and dist.is_initialized():
        raise RuntimeError("this process belongs to a process group, which forked processes "
                           "would inherit: call torch.distributed.destroy_process_group() first, "
                           "or pass start_method='spawn'")
    with tempfile.TemporaryDirectory(prefix="run_on_processes-") as directory:
        context = mp.start_processes(
            _rank_main,
            args=(function, tuple(args), world_size, _free_port(), backend, threads,
                  timeout_s, directory),
            nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        try:
            # join raises ProcessRaisedException (with the rank's traceback) if one fails
            while not context.join(timeout=min(1.0, timeout_s)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} processes still running after "
                                       f"{timeout_s:g} s")
        except mp.ProcessRaisedException as reported:
            pids = [process.pid for process in context.processes]
            raise _first_failure(directory, reported, pids) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)
        results = []
        for rank in range(world_size):
            with open(os.path.join(directory, f"rank{rank}.pickle"), "rb") as file:
                results.append(pickle.load(file))
    return results
