"""Context lookup on the device (kernels/lookup_triton.py): over a static token buffer, for each row's first
length[r] tokens, the static torch form and the kernel (Triton interpreter on the CPU) return exactly what
`context_lookup` returns for the row's tokens alone; garbage past a row's length is never read as its text."""
import pytest
import torch

from hybridspec_hf.drafter.lookup import context_lookup
from hybridspec_hf.kernels import lookup_triton
from hybridspec_hf.kernels.lookup_triton import context_lookup_static, context_lookup_static_reference


def _cases(symbols: int, seed: int, rows: int = 12, capacity: int = 1100):
    """A buffer of rows of few symbols (many matches), each row's length random (1 .. capacity, some short), and
    past its length a different symbol set (tokens that would match if they were read)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, symbols, (rows, capacity), generator=generator)
    lengths = torch.randint(1, capacity + 1, (rows,), generator=generator)
    repeating = min(300, capacity)
    lengths[:5] = torch.tensor([1, 2, 3, capacity, repeating])
    ids[4, :repeating] = torch.arange(repeating) % 7 % symbols  # a row that repeats itself (period 7)
    for row in range(rows):
        ids[row, lengths[row]:] = torch.randint(100, 100 + symbols, (capacity - int(lengths[row]),),
                                                generator=generator)
    return ids, lengths


def _expected(ids, lengths, block, low, high):
    proposals, ns = [], []
    for row in range(ids.shape[0]):
        proposal, n = context_lookup(ids[row:row + 1, : int(lengths[row])], block, low, high)
        proposals.append(proposal[0])
        ns.append(int(n[0]))
    return torch.stack(proposals), torch.tensor(ns)


@pytest.mark.parametrize("symbols", [2, 5, 40])
@pytest.mark.parametrize("low,high", [(2, 4), (1, 3), (3, 3)])
def test_the_static_form_equals_the_lookup_of_each_row(symbols, low, high):
    ids, lengths = _cases(symbols, seed=symbols * 10 + low + high)
    proposal, n = context_lookup_static_reference(ids, lengths, 16, low, high)
    want_proposal, want_n = _expected(ids, lengths, 16, low, high)
    assert torch.equal(n, want_n)
    found = want_n > 0  # where nothing matches the proposal is never used (the anchor repeated by both)
    assert torch.equal(proposal[found], want_proposal[found])
    assert bool(found.any()) and bool((~found).any())  # both cases exercised (a 1-token row never matches)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("symbols", [2, 40])
@pytest.mark.parametrize("low,high,block,capacity", [(2, 4, 16, 1100), (1, 3, 5, 1100), (2, 4, 16, 9)])
def test_the_kernel_equals_the_static_form(monkeypatch, symbols, low, high, block, capacity):
    """Rows over several of the kernel's programs (BLOCK_S positions each) and within one."""
    monkeypatch.setattr(lookup_triton, "_ON_CPU", True)
    ids, lengths = _cases(symbols, seed=symbols + high + block, capacity=capacity)
    want = context_lookup_static_reference(ids, lengths, block, low, high)
    out = (torch.full((ids.shape[0], block - 1), -7), torch.full((ids.shape[0],), -7))
    got = context_lookup_static(ids, lengths, block, low, high, out=out)
    assert got[0] is out[0] and got[1] is out[1]  # written in place (the resident rounds' static buffers)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])  # the no-match rows too: the row's last token repeated


def test_bad_arguments_are_refused():
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="ids \\[rows, capacity\\] long"):
        context_lookup_static(ids.float(), torch.ones(2, dtype=torch.long), 4, 2, 3)
    with pytest.raises(ValueError, match="length \\[rows\\] long"):
        context_lookup_static(ids, torch.ones(3, dtype=torch.long), 4, 2, 3)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        context_lookup_static(ids, torch.ones(2, dtype=torch.long), 4, 3, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel on a GPU (the CPU runs it interpreted above)")
@pytest.mark.parametrize("symbols", [2, 40])
def test_the_kernel_equals_the_static_form_on_a_gpu(symbols):
    """Three launches in a row (each resets the row counters it shares with the split-K kernels), 66 programs a
    row."""
    ids, lengths = _cases(symbols, seed=symbols, rows=16, capacity=33000)
    want = context_lookup_static_reference(ids, lengths, 16, 2, 4)
    for _ in range(3):
        got = context_lookup_static(ids.cuda(), lengths.cuda(), 16, 2, 4)
        assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
