"""The drafter's signals and drafts in one stream (kernels/signals_triton.py) against `draft_signals`' torch path and
torch.argmax (CPU, Triton interpreter). Tolerance: fp32, 1e-5 relative on top1 and margin, 1e-4 absolute on entropy
(sums in another order); the drafts exactly (the first occurrence of the maximum, as torch.argmax)."""
import pytest
import torch

pytest.importorskip("triton")

from hybridspec_hf.kernels.signals_triton import BLOCK_V, CHUNK_V, draft_signals_fused  # noqa: E402
from hybridspec_hf.selector.survival import draft_signals  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def check(logits: torch.Tensor) -> None:
    (got, drafts), want = draft_signals_fused(logits), draft_signals(logits)  # CPU tensors: the torch path
    assert drafts.dtype == torch.long and torch.equal(drafts, logits.argmax(-1))
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
    logits[0, 4, :] = float("-inf")  # nothing drafted: argmax 0, as torch's
    logits[0, 4, [CHUNK_V + 3, 2 * CHUNK_V + 5]] = 1.0  # ... but for two ties in the second and third programs
    check(logits)
    signals, drafts = draft_signals_fused(logits)
    assert signals["margin"][0, [0, 3]].abs().max() < 1e-6
    assert drafts[0, [0, 2, 3, 4]].tolist() == [5, 9, 9, CHUNK_V + 3]  # the first occurrences
    assert drafts[0, 1] >= CHUNK_V + 11  # a masked prefix is never drafted
    bf16 = torch.randn(1, 2, 1000, generator=gen).to(torch.bfloat16)
    bf16[0, 1, [17, 900]] = 9.0  # a tie in bf16
    check(bf16)
    assert draft_signals_fused(bf16)[1][0, 1] == 17


def test_a_row_with_no_finite_logit_drafts_the_first_column():
    logits = torch.full((1, 2, CHUNK_V + 7), float("-inf"))
    logits[0, 1, CHUNK_V + 2] = 0.5
    assert draft_signals_fused(logits)[1].tolist() == [[0, CHUNK_V + 2]] == logits.argmax(-1).tolist()
