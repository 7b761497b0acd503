"""The sampler's draw (treadle.gpu_worker.sampling.hf.token_choice.draw): one token per row by a two-level
inverse-CDF search, one uniform per row from its request's generator.

It must sample the distribution it is given (frequencies, zero-probability tokens, point masses at the edges of its
blocks and of a vocabulary that is not a whole number of blocks) and give a request's rows the same tokens alone and
batched with others, bit for bit: the property the sampler's reproducibility rests on."""

import pytest
import torch

from treadle.gpu_worker.sampling.hf.token_choice import DRAW_BLOCK, draw

VOCAB = 2 * DRAW_BLOCK + 188  # two whole blocks and a partial one


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_frequencies_follow_the_probabilities_and_zero_mass_is_never_drawn():
    logits = torch.randn(1, VOCAB, generator=seeded(0)) * 2
    logits[0, 5:60] = float("-inf")  # removed (as by top-k/top-p): never drawn
    logits[0, DRAW_BLOCK - 1 : DRAW_BLOCK + 1] = float("-inf")  # zero mass on both sides of a block edge
    logprobs = torch.log_softmax(logits, dim=-1)
    rows, rounds = 1000, 200
    generator, counts = seeded(1), torch.zeros(VOCAB)
    for _ in range(rounds):
        tokens = draw(logprobs.expand(rows, VOCAB).contiguous(), [(generator, list(range(rows)))])
        counts += torch.bincount(tokens, minlength=VOCAB)
    n, p = rows * rounds, logprobs.exp()[0]
    assert counts[p == 0].sum() == 0
    # Pearson's chi-square over the tokens with mass: its mean is their number - 1, its sd sqrt(2 x that); an
    # off-by-one in either level of the search, or a block's mass put on the wrong block, lands far above.
    kept = p > 0
    chi2 = float((((counts - n * p) ** 2) / (n * p))[kept].sum())
    df = int(kept.sum()) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)


@pytest.mark.parametrize("token", [0, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK, VOCAB - 1])
def test_a_point_mass_is_drawn_wherever_it_is(token):
    logprobs = torch.full((3, VOCAB), float("-inf"))
    logprobs[:, token] = 0.0
    assert draw(logprobs, [(seeded(token), [0, 1, 2])]).tolist() == [token] * 3


@pytest.mark.parametrize("vocab", [VOCAB, 49152 + 17])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_requests_tokens_are_the_same_alone_and_batched(vocab, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logprobs = torch.log_softmax(torch.randn(24, vocab, generator=seeded(2)), dim=-1)
        mine = [5, 6, 7, 12]  # a request's rows among others', not contiguous
        others = [[0, 1, 2, 3, 4], [8, 9, 10, 11], list(range(13, 24))]
        batched = draw(logprobs, [(seeded(10 + i), rows) for i, rows in enumerate(others)] + [(seeded(7), mine)])
        alone = draw(logprobs[mine].clone(), [(seeded(7), [0, 1, 2, 3])])
        assert batched[mine].tolist() == alone.tolist()
        # and the others' streams are theirs alone: the same again without my rows
        kept = [i for i in range(24) if i not in mine]
        renumbered = [[kept.index(i) for i in rows] for rows in others]
        without = draw(logprobs[kept].clone(), [(seeded(10 + i), rows) for i, rows in enumerate(renumbered)])
        assert batched[kept].tolist() == without.tolist()
    finally:
        torch.set_num_threads(previous)
