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


class Replay:
    """fn() captured into a CUDA graph (after `warmup` eager calls on a side stream, which also compiles Triton
    kernels); on other devices every call runs fn() eagerly. `outputs` is what fn returned during capture."""

    def __init__(self, fn: Callable[[], object], device: torch.device, pool=None, warmup: int = 1):
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.capture_s = 0.0
        if torch.device(device).type != "cuda":
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
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
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
