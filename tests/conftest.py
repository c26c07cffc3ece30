import contextlib
import os
import tempfile
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HYBRIDSPEC_CACHE", tempfile.mkdtemp(prefix="hybridspec-cache-"))
torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores

from _tiny import float64_gdn  # noqa: E402

NEAR_TIES: list[dict] = []


@pytest.fixture
def benchmarks(monkeypatch):
    """benchmarks/ on sys.path for the test (its scripts import one another as top-level modules)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture
def fp64_gdn():
    with float64_gdn():
        yield


@contextlib.contextmanager
def interpreted():
    """TRITON_INTERPRET=1 inside. Our kernels bind to `triton.jit` at launch, so they follow it; triton.language's
    own helpers (tl.sum, tl.cumsum, ...) and our jit helpers were bound when triton was first imported, possibly
    without the variable, so they are run as interpreted device functions here too."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(JITFunction, "__call__", lambda self, *args, **kwargs: InterpretedFunction(self.fn)(*args, **kwargs))
        yield


@pytest.fixture(scope="module")
def triton_interpreter():
    """TRITON_INTERPRET=1 for one test module (`pytestmark = pytest.mark.usefixtures("triton_interpreter")`)."""
    with interpreted():
        yield


@pytest.fixture
def cpu_only(monkeypatch):
    """The test runs as on a machine without a GPU (torch.cuda.is_available() is False): the benchmark harnesses'
    CPU runs (their smoke checks) pick the CPU and the interpreter also on the GPU image, where they otherwise took
    CUDA and asserted CPU-only facts (gpu_rounds_runs.md, run 35). Their CUDA paths are the benchmarks' own runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _triton_language_namespaces() -> list:
    language = sys.modules.get("triton.language")
    if language is None:
        return []
    core = language.core
    return [language, core, language.math, core.tensor, core.tensor_descriptor_base]


@pytest.fixture(autouse=True)
def _triton_language_restored():
    """Put back triton.language as it was before the test. The Triton interpreter patches the language's builtins
    while it runs a kernel, and a jit'd device function called from an interpreted kernel (tl.sum, ours) patches
    the modules its own globals name — triton.language.core for Triton's helpers — without ever restoring them
    (triton 3.6, InterpretedFunction.__call__). On a machine with a GPU, a later real compile in the same process
    then fails inside the interpreter ("'ir.value' object has no attribute 'dtype'"), so every CUDA test that ran
    after an interpreter test failed in the full suite on the GPU image (gpu_rounds_runs.md, run 31)."""
    saved = [(namespace, dict(vars(namespace))) for namespace in _triton_language_namespaces()]
    yield
    for namespace, attributes in saved:
        for name, value in attributes.items():
            if vars(namespace).get(name) is not value:
                setattr(namespace, name, value)


def pytest_terminal_summary(terminalreporter):
    if NEAR_TIES:
        terminalreporter.write_line(f"HybridSpec exactness: {len(NEAR_TIES)} divergence(s) at AR near-ties (gap < 1e-6)")
