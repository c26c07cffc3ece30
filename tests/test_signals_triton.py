"""The drafter's signals in one launch (kernels/signals_triton.py) against `draft_signals`' torch path (CPU, Triton
interpreter). Tolerance: fp32, 1e-5 relative on top1 and margin, 1e-4 absolute on entropy (sums in another order)."""
import pytest
import torch

pytest.importorskip("triton")

from hybridspec_hf.kernels.signals_triton import BLOCK_V, CHUNK_V, draft_signals_fused  # noqa: E402
from hybridspec_hf.selector.survival import draft_signals  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def check(logits: torch.Tensor) -> None:
    got, want = draft_signals_fused(logits), draft_signals(logits)  # CPU tensors: the torch path
    for key in ("top1", "margin"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got["entropy"], want["entropy"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("vocab", [2, 97, BLOCK_V + 1, CHUNK_V, 2 * CHUNK_V + 333])
@pytest.mark.parametrize("scale", [0.5, 8.0])
def test_signals_match_the_reference(vocab, scale):
    gen = torch.Generator().manual_seed(vocab)
    check(torch.randn(2, 3, vocab, generator=gen) * scale)


def test_repeated_maximum_masked_logits_and_bf16():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 5, 2 * CHUNK_V + 99, generator=gen) * 3
    logits[0, 0, [5, BLOCK_V + 7]] = 20.0  # the maximum twice, in different blocks of one program: margin 0
    logits[0, 3, [9, CHUNK_V + 7]] = 20.0  # ... and in different programs
    logits[0, 1, : CHUNK_V + 11] = float("-inf")  # masked vocabulary, a whole first program's chunk included
    logits[0, 2, 9] = 30.0  # a near one-hot row
    check(logits)
    assert draft_signals_fused(logits)["margin"][0, [0, 3]].abs().max() < 1e-6
    check(torch.randn(1, 2, 1000, generator=gen).to(torch.bfloat16))
