"""Draft vocabulary: d2t / t2d built from token frequencies, and mapping draft outputs to target ids.

Layout shared with vLLM, SGLang and peers: ``d2t`` int64 [draft_vocab] offsets with
``target_id = draft_id + d2t[draft_id]``; ``t2d`` bool [target_vocab] membership. Draft ids are the
chosen target ids sorted ascending, so the mapping is monotone and d2t is non-negative.
"""

from __future__ import annotations

import torch

from deepspec.errors import ConfigError


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] (loss-masked token counts) -> (d2t [Dv] int64, t2d [V] bool).

    Keeps the `draft_vocab_size` most frequent ids; ties go to the lower id so the result is
    deterministic. `None` or a size >= V keeps the full vocabulary (identity mapping).

    Computed on the CPU whatever `counts`' device and whatever `torch.device(...)` context is active (a draft
    built under `with torch.device("cuda"):` or `"meta"`); the results land on the default device, as the tensors
    a factory call made there would (the CPU outside any context). Meta counts carry no values: they count as zeros
    (shapes only).
    """
    cpu = torch.device("cpu")
    if counts.device.type == "meta":
        counts = torch.zeros(counts.shape, dtype=torch.float64, device=cpu)
    counts = counts.detach().to(cpu, torch.float64).flatten()
    vocab = counts.numel()
    out = torch.get_default_device()
    if draft_vocab_size is None or draft_vocab_size >= vocab:
        return torch.zeros(vocab, dtype=torch.int64, device=out), torch.ones(vocab, dtype=torch.bool, device=out)
    if draft_vocab_size < 1:
        raise ConfigError(f"model.draft_vocab_size={draft_vocab_size} must be >= 1 (or null for the full vocabulary).")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    ids = torch.sort(order).values
    d2t = ids - torch.arange(draft_vocab_size, dtype=torch.int64, device=cpu)
    t2d = torch.zeros(vocab, dtype=torch.bool, device=cpu)
    t2d[ids] = True
    return d2t.to(out), t2d.to(out)


def draft_ids_to_target(ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return ids + d2t[ids]


def target_ids_of_draft_vocab(d2t: torch.Tensor) -> torch.Tensor:
    """[Dv] the target id of every draft id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def sample_token(
    logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int, temperature: float, generator: torch.Generator | None
) -> tuple[int, torch.Tensor]:
    """Draw one token from draft logits [Dv]; return (target id, distribution over the target vocab [V] fp32).

    Temperature 0 is greedy with a one-hot distribution (the contract the evaluator's rejection
    sampler expects).
    """
    probs = torch.zeros(vocab_size, dtype=torch.float32, device=logits.device)
    if temperature <= 0:
        tid = int(target_ids[int(torch.argmax(logits))])
        probs[tid] = 1.0
        return tid, probs
    p = torch.softmax(logits.float() / temperature, dim=-1)
    idx = int(torch.multinomial(p.cpu() if generator is not None and generator.device.type == "cpu" else p, 1, generator=generator))
    probs[target_ids] = p
    return int(target_ids[idx]), probs
