"""benchmarks/barrier_cost.py's kernels on the CPU (TRITON_INTERPRET=1): the persistent chain with its barrier (one
program: the interpreter runs programs one after another, so more than one would wait for a program that has not
run), its give-up path, its barrier-free form, and the chain of skinny GEMM launches, against the float32 truth."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("triton_interpreter")


@pytest.fixture
def barrier_cost(benchmarks):
    import barrier_cost

    return barrier_cost


def _chain(stages, d):
    weights = (torch.randn(stages, d, d) * d ** -0.5).to(torch.bfloat16)
    return weights, torch.randn(d).to(torch.bfloat16)


def test_persistent_chain_with_its_barrier_matches_the_truth(barrier_cost):
    weights, y0 = _chain(3, 64)
    truth = barrier_cost.chain_reference(weights, y0)
    y, counter = barrier_cost.chain_persistent(weights, y0, block_n=64, block_k=32)  # one program, two K tiles
    assert barrier_cost.relative_error(y[-1], truth[-1]) < 1e-2
    assert barrier_cost.relative_error(y[1], truth[1]) < 1e-2
    assert counter.tolist() == [3, 0]  # a signal per stage, no timeout


def test_a_barrier_that_never_completes_gives_up_and_counts_it(barrier_cost, monkeypatch):
    monkeypatch.setattr(barrier_cost, "MAX_POLLS", 4)
    weights, y0 = _chain(2, 64)
    # two programs run one after the other: the first waits for the second's stage-0 signal in vain
    _, counter = barrier_cost.chain_persistent(weights, y0, block_n=32, block_k=64)
    assert counter.tolist() == [4, 1]


def test_barrier_free_chain_is_right_for_one_stage(barrier_cost):
    weights, y0 = _chain(1, 64)
    y, counter = barrier_cost.chain_persistent(weights, y0, block_n=16, block_k=32, sync=False)
    assert barrier_cost.relative_error(y[1], barrier_cost.chain_reference(weights, y0)[1]) < 1e-2
    assert counter.tolist() == [0, 0]


def test_launch_chain_matches_the_truth(barrier_cost):
    from hybridspec_hf.kernels.gemv_triton import GemvConfig

    weights, y0 = _chain(3, 64)
    truth = barrier_cost.chain_reference(weights, y0)
    for config in (GemvConfig(16, 32, 1, 4, 1, False), GemvConfig(16, 16, 2, 4, 1, True)):
        assert barrier_cost.relative_error(barrier_cost.chain_launches(weights, y0, config), truth[-1]) < 1e-2


def test_tiles_and_stages(barrier_cost):
    assert barrier_cost.tiles(1024) == (8, 1024)
    assert barrier_cost.tiles(2048) == (16, 1024)
    assert barrier_cost.tiles(4096) == (32, 512)
    with pytest.raises(ValueError, match="128 times a power of two"):
        barrier_cost.tiles(3 * 128)
    for d in (1024, 2048, 4096):
        s1, s2 = barrier_cost._stages(d)
        assert s1 * 2 * d * d >= 4 * barrier_cost.L2_BYTES and s2 == 2 * s1


def test_main_needs_a_gpu(barrier_cost, cpu_only):
    with pytest.raises(SystemExit, match="CUDA graphs on a GPU"):
        barrier_cost.main(["--dims", "1024"])
