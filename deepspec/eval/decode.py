"""Batch-1 decoding with an HF target: target-only (the baseline) and speculative (target + Proposer).

Both loops keep the target's KV cache in a `DynamicCache`, so the timing comparison is fair:
the baseline runs one token per forward, the speculative loop verifies 1 + k tokens per forward.
After a verify round the cache is cropped to the committed tokens (rejected drafts are dropped),
and only tap features of committed positions are handed to the proposer, as its contract says.
Taps are caught by forward hooks on the tapped modules (`tap_hooks`, as in the cache stage); the
target never returns every layer's hidden states (`output_hidden_states=False`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from deepspec.drafts.base import Proposer
from deepspec.eval.metrics import AcceptanceStats
from deepspec.eval.sampling import draft_temperature, next_token, verify
from deepspec.targets.taps import tap_hooks


@dataclass
class Generation:
    """One generated answer: token ids (without the prompt), wall-clock seconds, verify rounds."""

    tokens: list[int]
    seconds: float
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    stopped_by_eos: bool = False


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """Every id that ends an answer: the generation config's eos ids plus the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else list(eos))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(model, ids: torch.Tensor, cache):
    """One target forward over `ids` appended to `cache`; a prefill (no cache yet) keeps only the last
    position's logits (a [P, V] logits tensor for a long prompt costs more than the forward itself).
    Hidden states are not requested: taps, where needed, come from `tap_hooks`."""
    from transformers import DynamicCache

    kwargs = {}
    if cache is None:
        cache = DynamicCache(config=model.config)
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=ids[None], past_key_values=cache, use_cache=True, output_hidden_states=False, **kwargs)
    return out, cache


def _draft_tap_reduction(proposer: Proposer) -> str:
    """How the proposer's draft reduces a multi-stream target's taps (mean | concat); mean for any other proposer."""
    return getattr(getattr(getattr(proposer, "draft", None), "arch", None), "tap_reduction", "mean")


def _commit_round(stats: AcceptanceStats, accepted: list[int], num_proposed: int, target_token: int | None,
                  eos_ids: set[int] | frozenset[int], room: int,
                  on_round: Callable[[int, int], None] | None = None) -> tuple[list[int], bool]:
    """Settle one verify round into `stats`; return the tokens it commits (at most `room`) and whether the answer ended.

    An EOS among the accepted drafts ends the round there: the drafts after it were never really checked. Otherwise
    the target's own token (a correction or the bonus) follows the accepted drafts."""
    checked, stopped = num_proposed, False
    for j, tok in enumerate(accepted):
        if tok in eos_ids:
            accepted, checked, stopped = accepted[: j + 1], j + 1, True
            break
    new = accepted
    if not stopped:
        new, stopped = accepted + [target_token], target_token in eos_ids
    stats.add_round(checked, len(accepted), min(len(new), room))
    if on_round is not None:  # (drafts checked, drafts accepted), e.g. for confidence calibration
        on_round(checked, len(accepted))
    return new[:room], stopped


def _crop(cache, keep: int) -> None:
    """Drop cached positions >= keep (rejected drafts); negative crop = remove that many (transformers >= 5.18)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def generate_target_only(
    model,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """The target alone, one token per forward with a KV cache (the speed baseline)."""
    device = next(model.parameters()).device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    _sync(device)
    t0 = time.perf_counter()
    out, cache = _forward(model, ids, None)
    tokens: list[int] = []
    stopped = False
    while True:
        tok = next_token(out.logits[0, -1], temperature, generator)
        tokens.append(tok)
        if tok in eos_ids:
            stopped = True
            break
        if len(tokens) >= max_new_tokens:
            break
        out, cache = _forward(model, torch.tensor([tok], device=device), cache)
    _sync(device)
    return Generation(tokens, time.perf_counter() - t0, stopped_by_eos=stopped)


@torch.inference_mode()
def generate_speculative(
    model,
    proposer: Proposer,
    taps: Sequence[int],
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    tap_reduction: str | None = None,
    draft_sample_method: str = "probabilistic",
    on_round: Callable[[int, int], None] | None = None,
) -> Generation:
    """Speculative decoding of one answer; returns the tokens and the per-round acceptance counters.

    `tap_reduction` (multi-stream targets: mean | concat of the streams) defaults to the proposer's draft's.
    `draft_sample_method` (T > 0 only): `probabilistic` drafts are sampled at the target's temperature and verified
    with their q (the papers' protocol); `greedy` drafts are the draft's argmax, verified as vLLM does by default
    (eval/sampling.py). At T = 0 both are greedy verification.

    Lossless: at T=0 the tokens equal the target's greedy tokens; at T>0 they are distributed as the
    target's samples (exact rejection sampling in `verify`).
    A round whose accepted drafts contain EOS stops there; drafts after it are not counted as checked.
    """
    device = next(model.parameters()).device
    prompt = list(prompt_ids)
    stats = AcceptanceStats()
    proposer.reset()
    tap_reduction = tap_reduction or _draft_tap_reduction(proposer)
    t_draft = draft_temperature(temperature, draft_sample_method)
    _sync(device)
    t0 = time.perf_counter()
    with tap_hooks(model, taps, tap_reduction) as recorder:  # hooks on the tapped modules for this answer
        out, cache = _forward(model, torch.tensor(prompt, dtype=torch.long, device=device), None)
        new_taps = recorder.stacked(device)[0]  # [P, n_taps, W]: positions 0..P-1
        first = next_token(out.logits[0, -1], temperature, generator)
        committed = prompt + [first]
        tokens = [first]
        seen = 0  # positions whose tap features the proposer has received
        stopped = first in eos_ids
        while not stopped and len(tokens) < max_new_tokens:
            ids = torch.tensor(committed, dtype=torch.long, device=device)
            drafts, q = proposer.propose(ids, new_taps, seen, num_draft_tokens, temperature=t_draft, generator=generator)
            seen = len(committed) - 1
            drafts = drafts.to(device=device, dtype=torch.long).reshape(-1)[:num_draft_tokens]
            k = int(drafts.shape[0])
            # verify: one forward over [last committed token, drafts]; logits row i is the target before draft i+1
            verify_in = torch.cat([ids[-1:], drafts])
            out, cache = _forward(model, verify_in, cache)
            verify_taps = recorder.stacked(device)[0]  # [1 + k, n_taps, W]: this forward's positions
            n, emitted = verify(drafts, q[:k] if q is not None else None, out.logits[0], temperature, generator,
                                method=draft_sample_method)
            new, stopped = _commit_round(stats, drafts[:n].tolist(), k, emitted, eos_ids, max_new_tokens - len(tokens), on_round)
            tokens.extend(new)
            committed.extend(new)
            # keep the target cache for committed positions that it has processed (all but the newest token)
            _crop(cache, len(committed) - 1)
            # tap features for the newly committed, target-processed positions: the input token + accepted drafts
            new_taps = verify_taps[: len(committed) - 1 - seen]
    _sync(device)
    return Generation(tokens, time.perf_counter() - t0, stats, stopped_by_eos=bool(tokens) and tokens[-1] in eos_ids)


# ----------------------------------------------------------------------------------------- greedy replay


@torch.inference_mode()
def greedy_answers(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: set[int] | frozenset[int] = frozenset(),
                   pad_id: int = 0, batch_size: int = 16) -> list[list[int]]:
    """The target's greedy answers to many prompts, `batch_size` at a time (left-padded, length-sorted), each cut
    after its first EOS. Batching is what makes this cheap: one forward serves a whole batch per token. Our own loop,
    not `generate`, so no generation-config default (its EOS ids, a repetition penalty) changes the answers."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(idx), width), dtype=torch.long, device=device)
        for row, i in enumerate(idx):
            ids[row, width - len(prompts[i]):] = torch.tensor(list(prompts[i]), dtype=torch.long, device=device)
            mask[row, width - len(prompts[i]):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        steps = []
        for _ in range(max_new_tokens):
            nxt = out.logits[:, -1].argmax(-1)
            steps.append(torch.where(done, -1, nxt))
            done |= torch.isin(nxt, eos)
            if bool(done.all()) or len(steps) == max_new_tokens:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        table = torch.stack(steps, dim=1).tolist()
        for row, i in enumerate(idx):
            answers[i] = [t for t in table[row] if t >= 0]
    return answers


@torch.inference_mode()
def replay_speculative(
    model,
    proposer: Proposer,
    taps: Sequence[int],
    prompt_ids: Sequence[int],
    greedy: Sequence[int],
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    tap_reduction: str | None = None,
    on_round: Callable[[int, int], None] | None = None,
) -> Generation:
    """`generate_speculative` at T=0 replayed against the target's greedy answer `greedy`: the same rounds, drafts
    and counters, with one target forward over prompt + answer instead of one verify forward per round.

    Why it is exact: greedy verification accepts the leading drafts equal to the target's argmax and then emits the
    argmax, so every round's outcome is fixed by the greedy answer; and the taps the proposer receives are causal,
    so one full forward yields those of every committed position. `greedy` must run `num_draft_tokens` + 1 tokens
    past `max_new_tokens` (or end with EOS) so the last round's drafts have something to be checked against.
    """
    device = next(model.parameters()).device
    prompt, greedy = list(prompt_ids), list(greedy)
    if not greedy:
        raise ValueError("replay needs the target's greedy answer (at least one token)")
    stats = AcceptanceStats()
    proposer.reset()
    tap_reduction = tap_reduction or _draft_tap_reduction(proposer)
    _sync(device)
    t0 = time.perf_counter()
    with tap_hooks(model, taps, tap_reduction) as recorder:
        model(input_ids=torch.tensor(prompt + greedy, dtype=torch.long, device=device)[None], use_cache=False,
              output_hidden_states=False, logits_to_keep=1)
        all_taps = recorder.stacked(device)[0]  # [P + len(greedy), n_taps, W]
    tokens = [greedy[0]]
    committed = prompt + tokens
    new_taps = all_taps[: len(prompt)]
    seen = 0
    stopped = greedy[0] in eos_ids
    while not stopped and len(tokens) < max_new_tokens:
        ids = torch.tensor(committed, dtype=torch.long, device=device)
        drafts, _ = proposer.propose(ids, new_taps, seen, num_draft_tokens, temperature=0.0)
        seen = len(committed) - 1
        drafts = drafts.reshape(-1)[:num_draft_tokens].tolist()
        k = len(drafts)
        ref = greedy[len(tokens) : len(tokens) + k + 1]  # the target's argmax after committed, then after each draft
        if len(ref) < k + 1 and not (ref and ref[-1] in eos_ids):
            raise ValueError(f"the greedy answer ends after {len(greedy)} tokens without EOS; replay needs "
                             f"{len(tokens) + k + 1} (max_new_tokens + num_draft_tokens + 1)")
        n = 0
        while n < min(k, len(ref)) and drafts[n] == ref[n]:
            n += 1
        # ref[n] is the target's own token after the accepted drafts; only an accepted EOS can leave none
        new, stopped = _commit_round(stats, drafts[:n], k, ref[n] if n < len(ref) else None, eos_ids,
                                     max_new_tokens - len(tokens), on_round)
        tokens.extend(new)
        committed.extend(new)
        new_taps = all_taps[seen : len(committed) - 1]
    _sync(device)
    return Generation(tokens, time.perf_counter() - t0, stats, stopped_by_eos=bool(tokens) and tokens[-1] in eos_ids)
