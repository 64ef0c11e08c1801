"""The sampler against naive references: argmax, per-token penalty loops,
log_softmax, and seeded statistics (fixed seeds, so never flaky)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.sampler import Sampler, _generator_seed, fork_request_id
from engine.sampling_params import SamplingParams
from engine.step_io import ScheduledRequest

CPU = torch.device("cpu")


def make_request(request_id: str, num_samples: int = 1, prompt: list[int] | None = None,
                 output: list[int] | None = None, **params) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id, group_id=request_id, token_ids=[0], start_pos=0,
        block_table=[0], sample=True, num_samples=num_samples,
        sampling_params=SamplingParams(**params),
        prompt_token_ids=list(prompt or [0]), output_token_ids=list(output or []))


def tokens_of(result, request_id: str) -> list[int]:
    return [s.token_id for s in result[request_id]]


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def draw_many(params: dict, logits_row: torch.Tensor, draws: int, seed: int = 0) -> Counter:
    """Counts of tokens drawn by `draws` unseeded rows sharing one row of logits."""
    sampler = Sampler(CPU, seed=seed)
    reqs = [make_request(f"r{i}", **params) for i in range(draws)]
    out = sampler.sample(logits_row.expand(draws, -1).contiguous(), reqs)
    return Counter(tokens_of(out, r.request_id)[0] for r in reqs)


def chi_square(counts: Counter, probs: dict[int, float], draws: int) -> float:
    return sum((counts.get(t, 0) - draws * p) ** 2 / (draws * p) for t, p in probs.items())


def test_fork_request_id():
    assert fork_request_id("req", 0) == "req"
    assert fork_request_id("req", 3) == "req#3"


def test_greedy_is_argmax_and_logits_are_untouched():
    logits = random_logits(7, 50, seed=1)
    before = logits.clone()
    reqs = [make_request(f"g{i}", num_samples=1 + i % 3, temperature=0.0) for i in range(7)]
    out = Sampler(CPU).sample(logits, reqs)
    for i, r in enumerate(reqs):
        assert tokens_of(out, r.request_id) == [int(logits[i].argmax())] * r.num_samples
        assert out[r.request_id][0].logprob is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_top_k_one_is_greedy(temperature):
    logits = random_logits(16, 300, seed=2)
    reqs = [make_request(f"r{i}", temperature=temperature, top_k=1, top_p=0.5 if i % 2 else 1.0,
                         seed=i if i % 3 else None) for i in range(16)]
    out = Sampler(CPU).sample(logits, reqs)
    assert [tokens_of(out, r.request_id)[0] for r in reqs] == logits.argmax(1).tolist()


SEEDED_VARIANTS = [dict(), dict(top_k=20), dict(top_p=0.7), dict(top_p=0.9, top_k=50),
                   dict(temperature=0.5, repetition_penalty=1.3)]


@pytest.mark.parametrize("variant", SEEDED_VARIANTS)
def test_same_seed_same_tokens_whatever_the_batch(variant):
    steps, vocab = 12, 2000
    logits = [random_logits(1, vocab, seed=100 + s, scale=1.0) for s in range(steps)]

    def run(batch_before: int, batch_after: int, engine_seed: int) -> list[int]:
        sampler = Sampler(CPU, seed=engine_seed)
        got = []
        for s in range(steps):
            others_before = [make_request(f"b{j}", temperature=0.0 if j % 2 else 1.0, top_p=0.8)
                             for j in range(batch_before)]
            others_after = [make_request(f"a{j}", seed=j, top_k=5) for j in range(batch_after)]
            reqs = others_before + [make_request("mine", seed=1234, output=got, **variant)] + others_after
            rows = [random_logits(1, vocab, seed=s * 7 + j) for j in range(batch_before)]
            rows += [logits[s]] + [random_logits(1, vocab, seed=999 + j) for j in range(batch_after)]
            got.append(tokens_of(sampler.sample(torch.cat(rows), reqs), "mine")[0])
        return got

    alone = run(0, 0, engine_seed=0)
    assert run(0, 0, engine_seed=5) == alone
    assert run(3, 0, engine_seed=1) == alone
    assert run(2, 5, engine_seed=2) == alone
    assert run(0, 4, engine_seed=3) == alone


def test_different_seeds_differ_and_unseeded_use_the_engine_generator():
    logits = torch.zeros(1, 1000)  # uniform: 20 draws collide with probability ~0

    def run(seed: int | None, engine_seed: int = 0) -> list[int]:
        sampler = Sampler(CPU, seed=engine_seed)
        return [tokens_of(sampler.sample(logits, [make_request("r", seed=seed)]), "r")[0]
                for _ in range(20)]

    assert run(1) != run(2)
    assert run(None, engine_seed=7) == run(None, engine_seed=7)
    assert run(None, engine_seed=7) != run(None, engine_seed=8)


def test_seeds_that_differ_only_above_32_bits_draw_differently():
    """torch's CPU generator reads 32 bits of a seed; the sampler mixes the
    high half in, and leaves a seed below 2^32 as torch would take it."""
    logits = torch.zeros(1, 1000)

    def run(seed: int) -> list[int]:
        sampler = Sampler(CPU, seed=0)
        return [tokens_of(sampler.sample(logits, [make_request("r", seed=seed)]), "r")[0] for _ in range(20)]

    assert len({tuple(run(s)) for s in (0, 2**32, -2**63, 1, 2**32 + 1, -1, 2**32 - 1, 2**63 - 1)}) == 8
    # Below 2^32 the generator gets the seed itself, so those seeds draw what they always did.
    assert [_generator_seed(s, CPU) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]


def test_n_samples_use_their_own_forks_and_children_continue_them():
    vocab, n = 1000, 4
    logits = torch.zeros(1, vocab)

    def run(children_together: bool) -> list[list[int]]:
        sampler = Sampler(CPU, seed=0)
        first = tokens_of(sampler.sample(logits, [make_request("p", num_samples=n, seed=42)]), "p")
        seqs = [[t] for t in first]
        ids = [fork_request_id("p", j) for j in range(n)]
        for _ in range(5):
            reqs = [make_request(ids[j], seed=42, output=seqs[j]) for j in range(n)]
            if children_together:
                out = sampler.sample(logits.expand(n, -1).contiguous(), reqs)
            else:
                out = {}
                for r in reversed(reqs):
                    out.update(sampler.sample(logits, [r]))
            for j in range(n):
                seqs[j].append(tokens_of(out, ids[j])[0])
        return seqs

    seqs = run(children_together=True)
    assert len({tuple(s) for s in seqs}) == n  # distinct generators
    assert run(children_together=False) == seqs  # reproducible, batch-independent
    # Sample 0 of the parent is the plain seeded stream of a request with n=1.
    sampler = Sampler(CPU)
    single = [tokens_of(sampler.sample(logits, [make_request("q", seed=42)]), "q")[0] for _ in range(6)]
    assert single == seqs[0]


def test_drop_forgets_the_generator():
    logits = torch.zeros(1, 1000)
    sampler = Sampler(CPU)
    first = [tokens_of(sampler.sample(logits, [make_request("r", seed=3)]), "r")[0] for _ in range(5)]
    sampler.drop(["r"])
    again = [tokens_of(sampler.sample(logits, [make_request("r", seed=3)]), "r")[0] for _ in range(5)]
    assert again == first


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Naive reference: walk tokens by probability until the mass reaches top_p."""
    kept, mass = set(), 0.0
    for p, t in sorted(zip(probs.tolist(), range(len(probs))), reverse=True):
        kept.add(t)
        mass += p
        if mass >= top_p:
            break
    return kept


def test_top_p_keeps_exactly_the_nucleus_small_vocab():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.15, 0.2])
    logits = probs.log()
    draws = 8000
    counts = draw_many(dict(top_p=0.8), logits, draws)
    kept = nucleus(probs, 0.8)
    assert kept == {1, 4, 3}
    assert set(counts) == kept
    renorm = {t: float(probs[t]) / sum(float(probs[k]) for k in kept) for t in kept}
    assert chi_square(counts, renorm, draws) < 16.0  # df=2, p ~ 3e-4


@pytest.mark.parametrize("top_p, scale", [(0.9, 4.0), (0.5, 1.0), (0.5, 0.05), (0.95, 0.5)])
def test_top_p_subset_of_nucleus_at_every_candidate_size(top_p, scale):
    # Nucleus sizes 25 (within 64 candidates), 474 (1024), 1441 and 2623 (full sort).
    vocab, draws = 3000, 1000
    logits = random_logits(1, vocab, seed=11, scale=scale)[0]
    kept = nucleus(torch.softmax(logits.double(), 0), top_p)
    counts = draw_many(dict(top_p=top_p), logits, draws)
    assert set(counts) <= kept
    # The draws reach the low end of the nucleus, not just its head.
    ranked = sorted(kept, key=lambda t: -float(logits[t]))
    tail = set(ranked[len(ranked) // 2:])
    assert sum(counts[t] for t in tail) > 0


def test_top_k_and_top_p_together_measure_mass_within_top_k():
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    # top_k=3 leaves (0.3, 0.25, 0.2) renormalised to (0.4, 0.33, 0.27); top_p=0.7 keeps two.
    counts = draw_many(dict(top_k=3, top_p=0.7), probs.log(), 5000)
    assert set(counts) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_the_scaled_softmax(temperature):
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    draws = 8000
    counts = draw_many(dict(temperature=temperature), logits, draws)
    expected = torch.softmax(logits / temperature, 0).tolist()
    assert chi_square(counts, dict(enumerate(expected)), draws) < 21.0  # df=3, p ~ 1e-4


def reference_penalised(logits: torch.Tensor, prompt: list[int], output: list[int],
                        repetition: float, frequency: float, presence: float) -> torch.Tensor:
    out = logits.clone()
    for t in set(prompt) | set(output):
        v = float(out[t])
        out[t] = v / repetition if v > 0 else v * repetition
    for t, n in Counter(output).items():
        out[t] -= frequency * n + presence
    return out


PENALTIES = [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
             dict(frequency_penalty=0.7), dict(frequency_penalty=-0.5), dict(presence_penalty=1.5),
             dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3)]


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("mode", [dict(temperature=0.0), dict(temperature=0.7, top_k=1)])
def test_penalties_match_a_per_token_reference(penalty, mode):
    rows, vocab = 120, 40
    logits = random_logits(rows, vocab, seed=5, scale=1.0)
    gen = torch.Generator().manual_seed(6)
    reqs, expected = [], []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 15, (1,), generator=gen)),),
                               generator=gen).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 15, (1,), generator=gen)),),
                               generator=gen).tolist()
        with_penalty = i % 3 != 0  # interleave rows without penalties
        params = {**mode, **(penalty if with_penalty else {})}
        reqs.append(make_request(f"r{i}", prompt=prompt, output=output, **params))
        full = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        full.update(penalty if with_penalty else {})
        ref = reference_penalised(logits[i], prompt, output, full["repetition_penalty"],
                                  full["frequency_penalty"], full["presence_penalty"])
        expected.append(int(ref.argmax()))
    out = Sampler(CPU).sample(logits, reqs)
    got = [tokens_of(out, r.request_id)[0] for r in reqs]
    assert got == expected
    assert got != logits.argmax(1).tolist()  # the penalties did change some picks


def test_penalties_with_mixed_greedy_and_random_rows():
    vocab = 30
    logits = random_logits(6, vocab, seed=8, scale=1.0)
    prompt, output = [1, 2, 3], [int(logits[i].argmax()) for i in range(6)]
    reqs = [make_request(f"r{i}", prompt=prompt, output=[output[i]] * 3, frequency_penalty=2.0,
                         temperature=0.0 if i % 2 else 1.0, top_k=1) for i in range(6)]
    out = Sampler(CPU).sample(logits, reqs)
    for i, r in enumerate(reqs):
        ref = reference_penalised(logits[i], prompt, [output[i]] * 3, 1.0, 2.0, 0.0)
        assert tokens_of(out, r.request_id) == [int(ref.argmax())]


def test_logprobs_are_raw_log_softmax_with_a_sorted_top_list():
    vocab = 100
    logits = random_logits(5, vocab, seed=9)
    reqs = [make_request("a", temperature=0.0, logprobs=5, repetition_penalty=2.0, prompt=[1, 2]),
            make_request("b", temperature=0.6, top_p=0.9, logprobs=20, num_samples=3, seed=1),
            make_request("c", temperature=1.3, logprobs=0),
            make_request("d", temperature=1.0),
            make_request("e", temperature=0.0, logprobs=1)]
    out = Sampler(CPU).sample(logits, reqs)
    raw = torch.log_softmax(logits.double(), dim=1)
    for i, r in enumerate(reqs):
        count = r.sampling_params.logprobs
        for s in out[r.request_id]:
            if count is None:
                assert s.logprob is None and s.top_logprobs is None
                continue
            assert s.logprob == pytest.approx(float(raw[i, s.token_id]), abs=1e-5)
            assert len(s.top_logprobs) == count
            values = [lp for _, lp in s.top_logprobs]
            assert values == sorted(values, reverse=True)
            best = raw[i].topk(count).indices.tolist() if count else []
            assert [t for t, _ in s.top_logprobs] == best
            for t, lp in s.top_logprobs:
                assert lp == pytest.approx(float(raw[i, t]), abs=1e-5)
    assert len(out["b"]) == 3


@pytest.mark.parametrize("mode", [dict(temperature=0.0), dict(temperature=1.0),
                                  dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, top_k=3)])
def test_min_tokens_masks_eos_and_stop_ids(mode):
    vocab, eos, stop = 50, 0, 7
    logits = torch.full((1, vocab), -10.0)
    logits[0, eos], logits[0, stop], logits[0, 20] = 10.0, 9.0, -5.0
    sampler = Sampler(CPU)

    def pick(output: list[int], **extra) -> int:
        req = make_request("r", output=output, min_tokens=3, max_tokens=8, stop_token_ids=[stop],
                           **{**mode, **extra})
        return tokens_of(sampler.sample(logits, [req], frozenset({eos})), "r")[0]

    for length in range(3):
        for _ in range(20):
            assert pick([5] * length) not in (eos, stop)
    assert pick([5] * 3, top_k=1) == eos
    # ignore_eos: EOS does not end the sequence, so it is not masked; stop ids still are.
    assert pick([], ignore_eos=True, top_k=1) == eos
    logits[0, eos] = -10.0
    assert pick([], ignore_eos=True, top_k=1) not in (eos, stop)


def test_empty_batch():
    assert Sampler(CPU).sample(torch.zeros(0, 10), []) == {}


def test_entropy_sanity_of_plain_sampling():
    # A wide flat distribution is spread out, never stuck on a few tokens.
    counts = draw_many(dict(), torch.zeros(500), 5000)
    assert len(counts) > 450
    assert max(counts.values()) < 40


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_subnormal_temperature_is_greedy_not_nan(temperature):
    # Dividing float32 logits by 1e-40 (below float32's smallest normal)
    # overflows them to +-inf, and inverse-CDF sampling over NaN picks garbage.
    logits = random_logits(8, 300, seed=4)
    reqs = [make_request(f"r{i}", temperature=temperature, seed=i if i % 2 else None, logprobs=2)
            for i in range(8)]
    out = Sampler(CPU).sample(logits, reqs)
    assert [tokens_of(out, r.request_id)[0] for r in reqs] == logits.argmax(1).tolist()
    assert all(s.logprob == s.logprob for r in reqs for s in out[r.request_id])


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_sampling_numbers_are_rejected(name, value):
    with pytest.raises(ValueError, match=f"{name}: must be a finite number"):
        SamplingParams(**{name: value})


def test_greedy_picks_as_argmax_does_on_ties_and_nan():
    """The greedy rows take max's indices: they must be argmax's, the first
    of equal maxima and a NaN over any number, whatever the row's length."""
    logits = torch.zeros(5, 49152)
    logits[0, [7, 300, 49151]] = 2.0  # a three-way tie
    logits[1] = 1.0  # every token ties
    logits[2, 40] = float("nan")
    logits[2, 41] = float("inf")
    logits[3] = float("-inf")
    logits[4, [0, 49151]] = 5.0
    reqs = [make_request(f"r{i}", temperature=0.0) for i in range(5)]
    out = Sampler(CPU).sample(logits, reqs)
    got = [tokens_of(out, r.request_id)[0] for r in reqs]
    assert got == logits.argmax(1).tolist() == [7, 0, 40, 0, 0]
