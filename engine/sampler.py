"""Turns the LM head's logits into tokens, one batched pass per step.

Order of operations (HF transformers / vLLM):
  1. penalties: repetition (HF: over prompt + output, positive logits
     divided, negative multiplied), then frequency and presence (OpenAI: over
     output tokens only, `logit -= frequency * count + presence * (count > 0)`);
  2. min_tokens: while a sequence is shorter, its stop token ids and EOS
     (unless ignore_eos) are masked to -inf;
  3. greedy rows (temperature below SAMPLING_EPS, 0 included): one argmax
     for all of them;
  4. random rows: temperature, top-k, top-p (the smallest set of tokens whose
     mass reaches top_p, always the top one), then inverse-CDF sampling with
     one uniform per draw. Top-k keeps exactly k tokens: a tie at the k-th
     logit is broken by torch.topk, where HF keeps every tied token.
Logprobs, when asked for, are log_softmax of the RAW logits: before
penalties, min_tokens and temperature (vLLM's default "raw logprobs").

Randomness. A request with a seed draws sample j from its own generator,
seeded from (seed, j) and kept under `fork_request_id(request_id, j)` until
`drop()`: the same seed gives the same tokens whatever else is in the batch.
With n > 1 the parent draws all n first tokens; the scheduler then forks
children with those ids, and each child keeps drawing from its generator
(so drop a fork's id only when that fork ends).
Unseeded requests share the engine-wide generator. Every draw consumes
exactly one uniform, so a seeded stream never depends on the filters.
torch's CPU generator (a Mersenne Twister) keeps only the low 32 bits of a
seed, so seeds 2^32 apart would draw the same: on the CPU the high half is
mixed into the low one first (`_generator_seed`). 2^32 streams are all
there are; this spreads them over all 64 bits instead of leaving the high
half unread. A seed below 2^32 draws its first sample as before; samples 1
to n - 1 of a seeded n > 1 request, whose fork seeds use all 64 bits, draw
other streams than before this mixing.

Cost (up to 256 rows x 49k vocab every step on a small CPU). Penalties and
min_tokens write only the positions they change. The working copy of the
logits lives in a reused buffer. Top-k and top-p work on `topk` candidates;
a full sort happens only for top-p rows whose nucleus is wider than
`_TOP_P_CANDIDATES[-2]` tokens. Only rows asking for logprobs normalise.
"""

from __future__ import annotations

from typing import Iterable

import torch

from engine.logit_overrides import Overrides, build_overrides
from engine.request import fork_request_id
from engine.step_io import SampledToken, ScheduledRequest

__all__ = ["Sampler", "fork_request_id"]

_MASK64 = (1 << 64) - 1
# Candidate counts tried in turn for top-p rows without top-k (None: all).
_TOP_P_CANDIDATES = (64, 1024, None)


class Sampler:
    """Not thread-safe: one per model runner."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(_generator_seed(seed & _MASK64, device))
        # fork_request_id(request_id, j) -> generator of a seeded request.
        self._seeded: dict[str, torch.Generator] = {}
        # Reused [rows, V] buffers: slot 0 the working logits, slot 1 a temporary.
        self._buffers: list[torch.Tensor | None] = [None, None]

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the generators of finished or aborted sequences."""
        for request_id in request_ids:
            self._seeded.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[ScheduledRequest],
               eos_token_ids: frozenset[int] = frozenset()) -> dict[str, list[SampledToken]]:
        """logits: [N, V] float32, row i for requests[i] (all with sample=True).
        Returns `num_samples` tokens per request_id. `logits` is not modified."""
        rows = self.sample_rows(logits, requests, eos_token_ids)
        return {r.request_id: samples for r, samples in zip(requests, rows)}

    @torch.inference_mode()
    def sample_rows(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                    eos_token_ids: frozenset[int] = frozenset()) -> list[list[SampledToken]]:
        """As `sample`, by row: several rows may sample for one request (the
        positions of a speculating slice, each its own ScheduledRequest)."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (logits.shape, len(requests))
        assert all(r.sample for r in requests)
        if not requests:
            return []
        logits = logits.to(torch.float32).contiguous()
        max_samples = max(r.num_samples for r in requests)
        overrides = build_overrides(logits, requests, eos_token_ids)

        tokens = torch.zeros(len(requests), max_samples, dtype=torch.int64, device=logits.device)
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        randoms = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if greedy:
            x = self._working_rows(logits, greedy, overrides, writable=False)
            # n > 1 greedy draws are all the argmax. max's indices follow
            # argmax's rules (the first of equal maxima, a NaN wins) at 2.5x
            # its speed on the CPU (docs/engine.md, "Sampling").
            tokens[greedy] = x.max(dim=1, keepdim=True).indices.expand(-1, max_samples)
        if randoms:
            x = self._working_rows(logits, randoms, overrides, writable=True)
            reqs = [requests[i] for i in randoms]
            tokens[randoms] = self._sample_random(x, reqs, max_samples)
        return self._assemble(logits, requests, tokens)

    def _working_rows(self, logits: torch.Tensor, rows: list[int], overrides: Overrides,
                      writable: bool) -> torch.Tensor:
        """Logits of `rows` with the overrides applied, in the working buffer;
        the logits themselves when that changes nothing and `writable` is False."""
        all_rows = len(rows) == logits.shape[0]
        if all_rows and not writable and not overrides.keys:
            return logits
        index = None if all_rows else torch.tensor(rows, dtype=torch.int64, device=logits.device)
        x = self._scratch(0, len(rows), logits)
        if index is None:
            x.copy_(logits)
        else:
            torch.index_select(logits, 0, index, out=x)
        overrides.apply(x, index, logits.shape[0])
        return x

    def _sample_random(self, x: torch.Tensor, reqs: list[ScheduledRequest],
                       max_samples: int) -> torch.Tensor:
        """x: [R, V] penalised logits (consumed). Returns tokens [R, max_samples]."""
        dev, vocab = x.device, x.shape[1]
        params = [r.sampling_params for r in reqs]
        x.div_(torch.tensor([[p.temperature] for p in params], dtype=x.dtype, device=dev))
        uniforms = self._uniforms(reqs, max_samples)

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        with_k = [i for i, k in enumerate(top_k) if k < vocab]
        only_p = [i for i, k in enumerate(top_k) if k == vocab and top_p[i] < 1.0]
        plain = [i for i, k in enumerate(top_k) if k == vocab and top_p[i] >= 1.0]

        def pick(group: list[int]) -> torch.Tensor:
            return x if len(group) == len(reqs) else x[group]

        out = torch.empty(len(reqs), max_samples, dtype=torch.int64, device=dev)
        if with_k:
            k = torch.tensor([top_k[i] for i in with_k], device=dev)
            p = torch.tensor([top_p[i] for i in with_k], dtype=x.dtype, device=dev)
            values, indices = pick(with_k).topk(int(k.max()), dim=1)
            beyond_k = torch.arange(values.shape[1], device=dev) >= k[:, None]
            log_norm = values.masked_fill(beyond_k, float("-inf")).logsumexp(1, keepdim=True)
            out[with_k] = _sample_candidates(values, indices, log_norm, k, p, uniforms[with_k])
        if only_p:
            p = torch.tensor([top_p[i] for i in only_p], dtype=x.dtype, device=dev)
            y = pick(only_p)
            out[only_p] = _sample_top_p(y, p, uniforms[only_p], self._scratch(1, y.shape[0], y))
        if plain:
            y = pick(plain)
            out[plain] = _inverse_cdf(y.sub_(y.amax(1, keepdim=True)).exp_(), uniforms[plain])
        return out

    def _uniforms(self, reqs: list[ScheduledRequest], max_samples: int) -> torch.Tensor:
        """[R, max_samples] uniforms in [0, 1): column j of a seeded row from
        the generator of its j-th fork, the rest from the engine generator."""
        dev = self.device
        u = torch.zeros(len(reqs), max_samples, device=dev)
        seeded_at: list[tuple[int, int]] = []
        seeded_values: list[torch.Tensor] = []
        shared_at: list[tuple[int, int]] = []
        for i, r in enumerate(reqs):
            for j in range(r.num_samples):
                if r.sampling_params.seed is None:
                    shared_at.append((i, j))
                else:
                    gen = self._seeded_generator(r, j)
                    seeded_values.append(torch.rand(1, generator=gen, device=dev))
                    seeded_at.append((i, j))
        if shared_at:
            i, j = zip(*shared_at)
            u[list(i), list(j)] = torch.rand(len(shared_at), generator=self._generator, device=dev)
        if seeded_at:
            i, j = zip(*seeded_at)
            u[list(i), list(j)] = torch.cat(seeded_values)
        return u

    def seeded_state(self, req: ScheduledRequest) -> torch.Tensor | None:
        """The state of a seeded random request's generator before this
        step's draws (None for others), for `replay_seeded`."""
        params = req.sampling_params
        if params.seed is None or params.greedy:
            return None
        return self._seeded_generator(req, 0).get_state()

    def replay_seeded(self, req: ScheduledRequest, state: torch.Tensor, num_draws: int) -> None:
        """Put the generator where `num_draws` plain draws from `state` leave
        it: a speculating request drew one uniform per position but keeps only
        the tokens it emits, so its stream stays the one plain decoding uses."""
        gen = self._seeded_generator(req, 0)
        gen.set_state(state)
        for _ in range(num_draws):
            torch.rand(1, generator=gen, device=self.device)  # as _uniforms draws

    def _seeded_generator(self, req: ScheduledRequest, index: int) -> torch.Generator:
        key = fork_request_id(req.request_id, index)
        gen = self._seeded.get(key)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(_generator_seed(_fork_seed(req.sampling_params.seed, index), self.device))
            self._seeded[key] = gen
        return gen

    def _assemble(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                  tokens: torch.Tensor) -> list[list[SampledToken]]:
        """SampledTokens per request, with raw logprobs where asked for."""
        want = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        chosen: list[list[float]] = []
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        if want:
            max_top = max(requests[i].sampling_params.logprobs for i in want)
            chosen, top_ids, top_values = self._raw_logprobs(logits, want, tokens[want], max_top)
        slot = {row: n for n, row in enumerate(want)}

        result: list[list[SampledToken]] = []
        for i, (r, row_tokens) in enumerate(zip(requests, tokens.tolist())):
            samples = row_tokens[: r.num_samples]
            n = slot.get(i)
            if n is None:
                result.append([SampledToken(t) for t in samples])
                continue
            count = r.sampling_params.logprobs
            top = tuple(zip(top_ids[n][:count], top_values[n][:count])) if count else ()
            result.append([SampledToken(t, chosen[n][j], top) for j, t in enumerate(samples)])
        return result

    def _raw_logprobs(self, logits: torch.Tensor, rows: list[int], tokens: torch.Tensor,
                      max_top: int) -> tuple[list[list[float]], list[list[int]], list[list[float]]]:
        """log_softmax of the raw logits of `rows`: the logprobs of `tokens`
        [M, S] and the top `max_top` (ids, logprobs) per row, best first."""
        x = self._working_rows(logits, rows, Overrides.none(), writable=False)
        logprobs = torch.log_softmax(x, dim=1, out=self._scratch(1, len(rows), x))
        chosen = logprobs.gather(1, tokens).tolist()
        if not max_top:
            return chosen, [[]] * len(rows), [[]] * len(rows)
        top_values, top_ids = logprobs.topk(max_top, dim=1)
        return chosen, top_ids.tolist(), top_values.tolist()

    def _scratch(self, slot: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, V] view of a buffer kept across steps: fresh multi-MB
        tensors every step cost more in page faults than the math."""
        need = rows * like.shape[1]
        buf = self._buffers[slot]
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(need, dtype=like.dtype, device=like.device)
            self._buffers[slot] = buf
        return buf[:need].view(rows, like.shape[1])


def _fork_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of a seeded request: the seed itself for
    index 0, a SplitMix64 mix of (seed, index) for the others."""
    if index == 0:
        return seed & _MASK64
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _generator_seed(seed: int, device: torch.device) -> int:
    """What torch's generator on `device` is seeded with for a 64-bit seed:
    on the CPU the low half XOR murmur3's 32-bit finalizer of the high half
    (which maps 0 to 0, so seeds below 2^32 stay as they are)."""
    if torch.device(device).type != "cpu":
        return seed  # CUDA's Philox takes all 64 bits
    high = seed >> 32
    high ^= high >> 16
    high = (high * 0x85EBCA6B) & 0xFFFFFFFF
    high ^= high >> 13
    high = (high * 0xC2B2AE35) & 0xFFFFFFFF
    high ^= high >> 16
    return (seed & 0xFFFFFFFF) ^ high


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Indices [M, S] drawn from unnormalised non-negative `weights` [M, K]
    (consumed), one uniform [M, S] per draw. A zero weight is never drawn."""
    cdf = weights.cumsum_(1)
    total = cdf[:, -1:]
    # Strictly below the total, so some cdf entry exceeds the target, and the
    # first that does follows a positive weight.
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target.contiguous(), right=True)
    return index.clamp_(max=weights.shape[1] - 1)


def _sample_candidates(values: torch.Tensor, indices: torch.Tensor, log_norm: torch.Tensor,
                       k: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p sampling over sorted candidates.

    values: [M, K] temperature-scaled logits, descending; indices: [M, K]
    their token ids; log_norm: [M, 1] log-normaliser of the distribution top-p
    measures mass in; k: [M] candidates allowed (<= K); p: [M] top_p;
    uniforms: [M, S]. Returns token ids [M, S].
    """
    pos = torch.arange(values.shape[1], device=values.device)
    probs = (values - log_norm).exp_().masked_fill_(pos >= k[:, None], 0.0)
    mass_before = probs.cumsum(1) - probs
    keep = (mass_before < p[:, None]) | (pos == 0) | (p[:, None] >= 1.0)
    chosen = _inverse_cdf(probs.mul_(keep), uniforms)
    return indices.gather(1, chosen)


def _sample_top_p(x: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor,
                  scratch: torch.Tensor) -> torch.Tensor:
    """Top-p without top-k over full rows x [M, V] (`scratch` is [M, V] of
    workspace). Candidates grow (64, 1024, then a full sort) per row until
    they hold at least top_p of the mass, so the nucleus is exact."""
    vocab = x.shape[1]
    top = x.amax(1, keepdim=True)
    log_norm = torch.sub(x, top, out=scratch).exp_().sum(1, keepdim=True).log_().add_(top)
    out = torch.empty(uniforms.shape, dtype=torch.int64, device=x.device)
    todo = torch.arange(x.shape[0], device=x.device)
    for size in _TOP_P_CANDIDATES:
        size = vocab if size is None or size >= vocab else size
        rows = x if todo.numel() == x.shape[0] else x[todo]
        if size < vocab:
            values, indices = rows.topk(size, dim=1)
            done = (values - log_norm[todo]).exp_().sum(1) >= p[todo]
        else:
            values, indices = rows.sort(dim=1, descending=True)
            done = torch.ones(todo.numel(), dtype=torch.bool, device=x.device)
        if bool(done.any()):
            rows_done = todo[done]
            k = torch.full((rows_done.numel(),), size, device=x.device)
            out[rows_done] = _sample_candidates(values[done], indices[done], log_norm[rows_done],
                                                k, p[rows_done], uniforms[rows_done])
        todo = todo[~done]
        if todo.numel() == 0:
            break
    return out
