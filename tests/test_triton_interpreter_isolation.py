"""conftest's `_triton_language_restored`: an interpreter test leaves triton.language as it found it, so CUDA tests
later in the same process compile with the real builtins (on the GPU image they failed without it)."""
import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _sum_kernel(x, y, N: tl.constexpr):
    tl.store(y, tl.sum(tl.load(x + tl.arange(0, N)), axis=0))  # tl.sum: a jit'd helper whose globals name core


def test_an_interpreted_kernel_with_a_jit_helper_runs():
    x = torch.randn(16)
    y = torch.zeros(1)
    triton.jit(_sum_kernel)[(1,)](x, y, N=16)
    torch.testing.assert_close(y[0], x.sum())


def test_the_next_test_sees_the_real_builtins():
    core = tl.core
    for name in ("cast", "arange", "load", "store"):
        assert core.is_builtin(getattr(core, name)), f"triton.language.core.{name} is still the interpreter's"
    assert core.is_builtin(core.tensor.to)
