"""Exact speculative sampling: verify a chain of draft tokens against the target's distributions.

For each draft token x_i drawn from the draft's q_i, accept with probability min(1, p_i(x_i) / q_i(x_i));
at the first rejection emit a token from the residual norm(max(p_i - q_i, 0)); if every draft passes,
emit a bonus token from p_{k+1}. The emitted sequence is then distributed exactly as the target's own
samples (Leviathan et al. 2023, Chen et al. 2023) — which is what makes speculative decoding lossless.
At temperature 0 the rule becomes "accept while the draft equals the target's argmax".

Two draft-sampling protocols at T > 0 (`eval.draft_sample_method`, named as vLLM's `draft_sample_method`):

* ``probabilistic`` — drafts are sampled from softmax(z / T) and verified as above with their q. This is
  DeepSpec's protocol and the one the DFlash / DSpark / EAGLE papers report.
* ``greedy`` — drafts are the draft's argmax (no draft probabilities), which is what vLLM 0.32 serves by default
  (`SpeculativeConfig.draft_sample_method = "greedy"`; `rejection_sampler.py`, `NO_DRAFT_PROBS`): draft x is
  accepted iff p(x) >= u, u ~ U[0, 1); at the first rejection the token is drawn from p with x's mass removed,
  renormalised. That is the rule above with q = one-hot(x) — exact for any deterministic draft, so it is lossless
  too — and it accepts less: an oracle draft (the draft's distribution equals the target's) reaches
  acc0 = E[max p] instead of 1.

At T = 0 both are the same greedy verification.
"""

from __future__ import annotations

import torch

from deepspec.results import GREEDY_EPS, is_greedy, protocol_name  # noqa: F401 (the names sampling's users import)

DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")


def draft_temperature(temperature: float, method: str) -> float:
    """The temperature the proposer drafts at: the target's under `probabilistic`, 0 (argmax) under `greedy`."""
    if method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, got {method!r}")
    return temperature if method == "probabilistic" else 0.0


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of logits / T in float32 (the distribution the target samples from)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a [V] probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's own next token from [V] logits: argmax at T=0, else a sample."""
    if is_greedy(temperature):
        return int(logits.argmax().item())
    return sample(target_probs(logits, temperature), generator)


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    method: str = "probabilistic",
) -> tuple[int, int]:
    """Check k draft tokens; return (number accepted, the token the target emits after them).

    draft_tokens: [k] int64; draft_probs: [k, V] the distributions they were drawn from (unused at T=0 and under
    method="greedy", where the drafts are argmaxes); target_logits: [k+1, V] — row i is the target's next-token
    logits before draft i+1, row k the bonus.
    """
    k = int(draft_tokens.shape[0])
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must have k+1={k + 1} rows, got {target_logits.shape[0]}")
    if is_greedy(temperature):
        best = target_logits.argmax(dim=-1)
        matches = (best[:k] == draft_tokens.to(best.device)).long()
        n = int(matches.cumprod(0).sum().item()) if k else 0
        return n, int(best[n].item())
    if method == "greedy":
        return _verify_greedy_drafts(draft_tokens, target_probs(target_logits, temperature), generator)
    if method != "probabilistic":
        raise ValueError(f"method must be one of {DRAFT_SAMPLE_METHODS}, got {method!r}")
    if draft_probs is None:
        raise ValueError("probabilistic draft sampling needs the draft's probabilities")
    p = target_probs(target_logits, temperature)  # [k+1, V]
    q = draft_probs.to(device=p.device, dtype=torch.float32)
    tokens = draft_tokens.to(p.device)
    if k:
        idx = torch.arange(k, device=p.device)
        p_x, q_x = p[idx, tokens], q[idx, tokens]
        u = torch.rand(k, generator=generator, device=p.device)
        ok = (u * q_x < p_x).long()  # u < p/q without dividing (q=0 cannot have been sampled)
        n = int(ok.cumprod(0).sum().item())
    else:
        n = 0
    if n == k:
        return n, sample(p[k], generator)
    residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    # p == q exactly leaves no residual, but then a rejection has probability 0; guard rounding anyway
    return n, sample(residual / total if total > 0 else p[n], generator)


def _verify_greedy_drafts(draft_tokens: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """vLLM's rule for drafts without probabilities (`rejection_random_sample_kernel` with NO_DRAFT_PROBS, and
    `sample_recovered_tokens_kernel`): accept x_i iff p_i(x_i) >= u_i (u in float64 as there); at the first rejection
    emit a draw from p_i with x_i's entry zeroed; all accepted -> the bonus from p_k. A zero-probability draft is never
    accepted (vLLM would accept one only if u were exactly 0)."""
    k = int(draft_tokens.shape[0])
    tokens = draft_tokens.to(p.device)
    n = 0
    if k:
        idx = torch.arange(k, device=p.device)
        p_x = p[idx, tokens].double()
        u = torch.rand(k, generator=generator, device=p.device, dtype=torch.float64)
        ok = ((p_x >= u) & (p_x > 0)).long()
        n = int(ok.cumprod(0).sum().item())
    if n == k:
        return n, sample(p[k], generator)
    recovered = p[n].clone()
    recovered[tokens[n]] = 0
    total = recovered.sum()
    # a rejection implies p(x) < 1, so some mass is left; guard rounding anyway
    return n, sample(recovered / total if total > 0 else p[n], generator)
