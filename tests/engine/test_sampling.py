"""The batched sampler: greedy, temperature, top-k, top-p, (seed, position) determinism, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.sampling import SamplingParams, _filter, _inverse_cdf, row_uniform, sample, with_seed

torch.set_num_threads(1)

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = PROBS.log()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, **kw)


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [greedy()] * 5, [0] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_token_is_a_function_of_seed_and_position_only() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=gen)
    params = [seeded(7), seeded(8), greedy(), seeded(7)]
    positions = [10, 10, 10, 11]
    batch = sample(logits, params, positions).token_ids
    # Each row alone, and the batch reversed, sample the same tokens.
    alone = [sample(logits[i : i + 1], [params[i]], [positions[i]]).token_ids[0] for i in range(4)]
    rev = sample(logits.flip(0), params[::-1], positions[::-1]).token_ids[::-1]
    assert batch == alone == rev
    # Over many positions the seed and the position both change the draw.
    flat = torch.zeros(1, 1000)
    draws = [sample(flat, [seeded(7)], [p]).token_ids[0] for p in range(20)]
    assert len(set(draws)) > 10
    other = [sample(flat, [seeded(8)], [p]).token_ids[0] for p in range(20)]
    assert draws != other


def test_temperature_sampling_follows_softmax() -> None:
    n = 4000
    logits = LOGITS.expand(n, 4)
    params = [seeded(s) for s in range(n)]
    tokens = torch.tensor(sample(logits, params, [3] * n).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, PROBS, atol=0.03), freq
    # A low temperature sharpens toward the argmax.
    cold = [SamplingParams(temperature=0.02, seed=s) for s in range(200)]
    assert set(sample(LOGITS.expand(200, 4), cold, [0] * 200).token_ids) == {0}


def test_top_k_and_top_p_restrict_the_support() -> None:
    n = 600
    logits = LOGITS.expand(n, 4)
    top2 = sample(logits, [seeded(s, top_k=2) for s in range(n)], [0] * n).token_ids
    assert set(top2) == {0, 1}
    top1 = sample(logits, [seeded(s, top_k=1) for s in range(n)], [0] * n).token_ids
    assert set(top1) == {0}
    # top_p=0.5 keeps tokens while the mass before them is < 0.5: {0 (0.0), 1 (0.4)}.
    nucleus = sample(logits, [seeded(s, top_p=0.5) for s in range(n)], [0] * n).token_ids
    assert set(nucleus) == {0, 1}
    tiny_p = sample(logits, [seeded(s, top_p=0.01) for s in range(n)], [0] * n).token_ids
    assert set(tiny_p) == {0}
    # Mixed rows: filtering one row leaves its neighbours alone.
    mixed = sample(logits[:2], [seeded(1, top_k=1), seeded(1)], [5, 5])
    assert mixed.token_ids[0] == 0


def test_logprobs_are_of_the_processed_distribution() -> None:
    logits = LOGITS.unsqueeze(0)
    out = sample(logits, [greedy(logprobs=2)], [0])
    lp = out.logprobs[0]
    assert out.token_ids == [0]
    assert lp.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert [t for t, _ in lp.top] == [0, 1]
    assert lp.top[1][1] == pytest.approx(math.log(0.3), abs=1e-5)
    # With top_k=2 the distribution sampled from is renormalized over {0, 1}.
    out = sample(logits, [seeded(3, top_k=2, logprobs=0)], [0])
    token, lp = out.token_ids[0], out.logprobs[0]
    assert lp.top == ()
    expected = {0: math.log(0.4 / 0.7), 1: math.log(0.3 / 0.7)}[token]
    assert lp.logprob == pytest.approx(expected, abs=1e-5)


def test_with_seed_assigns_once_and_keeps_given_seeds() -> None:
    p = SamplingParams(temperature=1.0)
    a, b = with_seed(p), with_seed(p)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert with_seed(a) is a
    assert a.max_tokens == p.max_tokens and a.temperature == p.temperature


def test_unseeded_sampled_row_is_an_error() -> None:
    with pytest.raises(ValueError, match="seed"):
        sample(LOGITS.unsqueeze(0), [SamplingParams(temperature=1.0)], [0])
    with pytest.raises(ValueError, match="rows"):
        sample(LOGITS.unsqueeze(0), [], [])


@pytest.mark.gpu
def test_cuda_logits_sample_the_same_tokens_as_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5))
    params = [seeded(s, top_k=50 * s, top_p=1.0 - 0.1 * s) for s in range(6)]
    positions = list(range(100, 106))
    cpu = sample(logits, params, positions).token_ids
    assert sample(logits.cuda(), params, positions).token_ids == cpu


# --- the batched implementation: filters by threshold, inverse CDF over one uniform a row ------


def _reference_keep(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The filters by their definition: sort the row, keep the top k, then keep tokens while
    the mass before them (over what top-k left) is below top_p."""
    vocab = logits.shape[-1]
    vals, order = logits.sort(descending=True)
    keep = torch.arange(vocab) < (top_k if 0 < top_k < vocab else vocab)
    probs = vals.masked_fill(~keep, float("-inf")).softmax(-1)
    if top_p < 1.0:  # (1.0 is off: float rounding may take the cumsum to 1.0 early)
        keep &= (probs.cumsum(-1) - probs) < top_p
    return torch.zeros(vocab, dtype=torch.bool).scatter(0, order, keep)


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (sorts the row) .. peaked (top 64)
def test_top_k_top_p_keep_exactly_the_defined_sets(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 10))
    vocab = 3000
    logits = torch.randn(8, vocab, generator=gen) * scale
    cases = [(0, 0.9), (50, 1.0), (0, 0.5), (700, 0.95), (5, 0.3), (0, 0.999), (600, 1.0), (1, 1.0)]
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    inv_t = torch.ones(8, 1)
    out = _filter(logits, weights, inv_t, [k for k, _ in cases], [p for _, p in cases])
    for row, (k, p) in enumerate(cases):
        ref = _reference_keep(logits[row], k, p)
        assert torch.equal(~out[row], ref), (row, k, p, int(ref.sum()), int((~out[row]).sum()))
        assert torch.equal(weights[row] > 0, ref)


def test_mixed_batch_rows_sample_as_they_would_alone() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 3000  # not a multiple of the CDF chunk
    logits = torch.cat([torch.randn(3, vocab, generator=gen) * 0.5,   # flat: top-p sorts
                        torch.randn(3, vocab, generator=gen) * 8.0])  # peaked: top 64 suffice
    params = [seeded(1, top_p=0.9), greedy(), seeded(2, top_k=40, top_p=0.8, logprobs=3),
              seeded(3, top_k=2000), SamplingParams(temperature=0.7, seed=4), seeded(5, top_p=0.5, logprobs=0)]
    positions = [5, 6, 7, 8, 9, 10]
    batch = sample(logits, params, positions)
    for i in range(6):
        alone = sample(logits[i : i + 1], [params[i]], [positions[i]])
        assert alone.token_ids[0] == batch.token_ids[i]
        assert alone.logprobs[0] == batch.logprobs[i]
    rev = sample(logits.flip(0), params[::-1], positions[::-1])
    assert rev.token_ids[::-1] == batch.token_ids


def test_inverse_cdf_ends_and_zero_weights() -> None:
    vocab = 700                                  # three chunks, the last one padded
    w = torch.zeros(2, vocab)
    w[0, [3, 300, 650]] = torch.tensor([1.0, 2.0, 1.0])
    w[1, 511] = 5.0                              # one token: always it
    for u, want in ((0.0, 3), (0.2499, 3), (0.25, 300), (0.7499, 300), (0.75, 650),
                    (1.0 - 2.0**-53, 650)):
        got = _inverse_cdf(w, torch.tensor([u, u], dtype=torch.float64)).tolist()
        assert got == [want, 511], (u, got)


def test_row_uniform_is_a_pure_function_in_the_unit_interval() -> None:
    draws = [row_uniform(s, p) for s in range(50) for p in range(50)]
    assert all(0.0 <= d < 1.0 for d in draws) and len(set(draws)) == len(draws)
    assert row_uniform(7, 11) == row_uniform(7, 11) != row_uniform(11, 7)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02
