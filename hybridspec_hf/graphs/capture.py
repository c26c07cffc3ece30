"""`Replay`: a function over static buffers, captured once into a CUDA graph on CUDA and called eagerly elsewhere.

The same Python code therefore runs on the CPU (tests, the eager twin) and is replayed on the GPU. A captured
function must not read device values on the host, allocate outside the graph's pool, or change tensor addresses
between calls: the buffers it reads and writes are attributes of its owner, created before capture.
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable

import torch

_warming = False  # inside a Replay's warm-up calls (`branch` then runs both functions)


class Replay:
    """fn() captured into a CUDA graph (after `warmup` eager calls on a side stream, which also compiles Triton
    kernels); on other devices, or with capture=False, every call runs fn() eagerly. `outputs` is what fn returned
    during capture.

    Under torch.distributed (tensor parallelism: the forward's all-reduces and all-gathers are NCCL collectives,
    captured into the graph like any kernel; every rank captures and replays the same sequence) the capture is
    thread-local, so that the process group's watchdog thread, which queries its own events meanwhile, cannot
    invalidate it."""

    def __init__(self, fn: Callable[[], object], device: torch.device, pool=None, warmup: int = 1,
                 capture: bool = True):
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.capture_s = 0.0
        if torch.device(device).type != "cuda" or not capture:
            return
        start = time.perf_counter()
        # no garbage collection while capturing: collecting an unreachable object that holds a CUDA graph or device
        # memory (e.g. rounds of an earlier call) calls CUDA APIs that are illegal during stream capture (seen on
        # the H200 as an abort inside a captured launch)
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            global _warming
            _warming = True
            try:
                with torch.cuda.stream(stream):
                    for _ in range(warmup):
                        fn()
            finally:
                _warming = False
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode=_capture_mode()):
                self.outputs = fn()
            torch.cuda.synchronize(device)
        finally:
            if collecting:
                gc.enable()
        self.capture_s = time.perf_counter() - start

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def pool(self):
        """The graph's memory pool, to share with graphs that read its outputs (None when not captured)."""
        return None if self.graph is None else self.graph.pool()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.outputs


def branches_capture(device: torch.device) -> bool:
    """Whether `branch` captures into CUDA graph conditional nodes on `device`: torch exposes them (2.13 does; the
    GPU image's 2.11 does not) and its CUDA runtime is 12.4 or newer (not ROCm)."""
    if torch.device(device).type != "cuda" or torch.version.hip is not None or torch.version.cuda is None:
        return False
    major, minor = (int(part) for part in torch.version.cuda.split(".")[:2])
    graph = getattr(torch.cuda, "CUDAGraph", None)
    return (major, minor) >= (12, 4) and all(hasattr(graph, name) for name in (
        "get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node"))


def branch(pred: torch.Tensor, if_true: Callable[[], None], if_false: Callable[[], None]) -> None:
    """if_true() where the one-element bool `pred` holds, else if_false(), with no host read of pred in a capture.

    Captured, each function becomes the body of a CUDA graph conditional node (an "if" on pred, one on its negation;
    CUDA >= 12.4, `branches_capture`): a replay launches only the chosen body's kernels. Both functions must leave
    their results in buffers that exist before the branch (what they allocate is not for after it), draw no random
    numbers (torch refuses RNG inside a conditional body) and return nothing. Eagerly the host reads pred (a sync
    on CUDA) and runs one of them, except in a Replay's warm-up on CUDA, which runs both in turn (each must have
    compiled its Triton kernels and any recompiles before the capture): a warm-up's results are never used."""
    if pred.is_cuda and torch.cuda.is_current_stream_capturing():
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        condition = pred.reshape(1).to(torch.bool)
        for holds, fn in ((condition, if_true), (~condition, if_false)):
            graph.begin_capture_to_if_node(holds)
            try:
                fn()
            finally:
                graph.end_capture_to_conditional_node()
        return
    if _warming and pred.is_cuda:
        if_true()
        if_false()
        return
    with host_syncs():
        holds = bool(pred.reshape(-1)[0])
    (if_true if holds else if_false)()


def distributed() -> bool:
    """Several ranks (tensor parallelism): they must take identical decisions and capture identical graphs."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def _capture_mode() -> str:
    return "thread_local" if distributed() else "global"


_COLLECTIVE_CAPTURE: dict[torch.device, str | None] = {}


def collective_capture_failure(device: torch.device) -> str | None:
    """None if this process group's collectives can be captured in a CUDA graph on `device` and replayed with the
    right result, else why not. A tensor-parallel forward all-reduces (rowwise layers, experts) and all-gathers
    (DTensor's redistribution of colwise outputs, through functional collectives): the probe captures one of each.
    Every rank probes at once (a collective) and all get the same answer, so that they all capture or none does;
    the answer is kept for the process."""
    from torch.distributed import _functional_collectives as funcol

    device = torch.device(device)
    if device in _COLLECTIVE_CAPTURE:
        return _COLLECTIVE_CAPTURE[device]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    group = torch.distributed.group.WORLD
    error = None
    with host_syncs():  # the call's set-up: waits for the probe and reads its result
        try:
            x = torch.zeros(4, device=device)
            torch.distributed.all_reduce(x)  # outside capture: communicators are set up lazily, not in a graph
            funcol.all_gather_tensor(x, 0, group) * 1.0  # the product waits for the gather
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode=_capture_mode()):
                torch.distributed.all_reduce(x)
                gathered = funcol.all_gather_tensor(x, 0, group) * 1.0
            x.fill_(rank + 1.0)
            graph.replay()
            total = world * (world + 1) / 2
            if not (bool((x == total).all()) and bool((gathered == total).all())):
                error = f"a captured all-reduce/all-gather replayed to {x.tolist()}/{gathered.tolist()}, not {total}"
        except Exception as failure:  # noqa: BLE001 - the reason goes to telemetry.path_reason / the error
            error = f"{type(failure).__name__}: {failure}"
        failed = torch.tensor([0.0 if error is None else rank + 1.0], device=device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        failed = float(failed)
    if error is None and failed > 0:
        error = f"capturing collectives failed on rank {int(failed) - 1}"
    _COLLECTIVE_CAPTURE[device] = None if error is None else f"NCCL collectives do not capture here ({error})"
    return _COLLECTIVE_CAPTURE[device]


@contextlib.contextmanager
def host_syncs():
    """Device→host syncs are allowed here even under `torch.cuda.set_sync_debug_mode("error")`: a call's set-up
    (prefill, capture, loading the cache), each round's hand-off and the call's finish. Rounds must not sync."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
