"""Calibrated DSpark confidence: fit, measure and price the confidence head the way vLLM uses it.

vLLM's adaptive verification (vllm/v1/worker/gpu/spec_decode/adaptive_verification.py) decides which draft slots
the target verifies from the confidence head alone: each slot scores the *survival probability* of its request (the
running product of per-position sigmoid(head) values) and the globally best slots under a draft-token budget win.
A head that is overconfident, or biased at deeper positions, spends the budget on slots that get rejected. Here:

  1. `collect_rounds` decodes held-out prompts with the evaluator's own speculative loop (eval/decode.py) and records,
     per verify round, the head's logit of every drafted slot and how many drafts the target accepted;
  2. `fit_scaling` chooses, by cross-validation over the fit split's answers, between the raw head (identity), one
     global sigmoid(a * z + b) and per-position sigmoid(a_k * z + b_k) shrunk towards the global pair by each
     position's count, and fits the choice by NLL on the whole fit split; `ece` measures per-position expected
     calibration error (equal-mass bins) on a disjoint split;
  3. `admit` replays vLLM's slot admission and `replay_table` prices raw, calibrated and oracle scores as accepted
     drafts per verified slot at several budgets.

A position's label is conditional acceptance (draft k accepted given drafts 1..k-1 were): the head is trained towards
it and vLLM's product of the per-position values is a survival probability only under that reading. So a round gives
pairs for the positions it *reached* (1 .. accepted + 1, at most the drafts checked).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from deepspec.errors import ConfigError

DEFAULT_BINS = 10
MIN_PAIRS = 30  # fewer labelled pairs (or one class only) at a position: it takes the global fit
# Pseudo-counts pulling a position's (a_k, b_k) towards the global pair: the fit minimises the position's summed NLL +
# lambda/2 |(a_k, b_k) - (a, b)|^2, so a position with n_k >> lambda pairs keeps its own fit and one with few moves
# little. Cross-validation picks lambda among these (or the global pair alone, or the raw head).
SHRINKAGE = (1000.0, 100.0, 10.0)
CV_FOLDS = 5


@dataclass
class Round:
    """One verify round: the confidence logit of each drafted slot, the drafts the target checked and accepted."""

    logits: list[float]
    checked: int
    accepted: int
    answer: int  # which answer (prompt turn) it came from: the fit / evaluation split is by answer
    temperature: float = 0.0


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


# ----------------------------------------------------------------------------------------- pairs, fit, ECE


def _reached(r: Round) -> int:
    return min(r.checked, r.accepted + 1, len(r.logits))


def pairs(rounds: Sequence[Round]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logit, accepted 0/1, 0-based position) for every slot a round reached (conditional acceptance labels)."""
    z, y, pos = [], [], []
    for r in rounds:
        for k in range(_reached(r)):
            z.append(r.logits[k])
            y.append(1.0 if k < r.accepted else 0.0)
            pos.append(k)
    return np.asarray(z, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(pos, dtype=np.int64)


def pair_answers(rounds: Sequence[Round]) -> np.ndarray:
    """The answer each of `pairs(rounds)` came from, in the same order: the unit cross-validation holds out (a greedy
    answer's rounds are far from independent: one repetitive answer gives hundreds of near-identical ones)."""
    return np.asarray([r.answer for r in rounds for _ in range(_reached(r))], dtype=np.int64)


def _newton(x: np.ndarray, y: np.ndarray, prior: np.ndarray, ridge: float, iters: int) -> np.ndarray:
    """Minimise mean NLL of sigmoid(x @ theta) + ridge/2 |theta - prior|^2 by damped Newton steps (float64)."""
    theta, n = prior.astype(np.float64).copy(), max(len(y), 1)

    def loss(t: np.ndarray) -> float:
        s = x @ t
        return float(np.mean(np.logaddexp(0.0, s) - y * s) + 0.5 * ridge * np.sum((t - prior) ** 2))

    cur = loss(theta)
    for _ in range(iters):
        p = sigmoid(x @ theta)
        grad = x.T @ (p - y) / n + ridge * (theta - prior)
        hess = (x * (p * (1 - p))[:, None]).T @ x / n + ridge * np.eye(len(theta))
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while True:  # backtracking: Newton on the logistic loss can overshoot from far away
            cand = theta - t * step
            new = loss(cand)
            if new <= cur or t < 1e-6:
                break
            t *= 0.5
        if new > cur:
            break
        theta, gain, cur = cand, cur - new, new
        if gain < 1e-13 or float(np.max(np.abs(t * step))) < 1e-10:
            break
    return theta


def fit_logistic(z: np.ndarray, y: np.ndarray, *, bias: bool = True, ridge: float = 1e-4, iters: int = 100,
                 prior: tuple[float, float] = (1.0, 0.0)) -> tuple[float, float]:
    """(a, b) minimising the mean NLL of sigmoid(a z + b) + ridge/2 |(a, b) - prior|^2. The default tiny ridge towards
    the identity (a = 1, b = 0) keeps separable data (all accepted, say) from running off to infinity; a larger one
    towards the global pair is the per-position shrinkage. a is held >= 0: a temperature must not invert the head's
    ranking; where the free optimum has a < 0 (no signal, e.g. one class only) the constrained one is a = 0 with the
    bias alone."""
    z, y = np.asarray(z, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if bias:
        a, b = _newton(np.stack([z, np.ones_like(z)], 1), y, np.array(prior, dtype=np.float64), ridge, iters)
    else:
        (a,), b = _newton(z[:, None], y, np.array([prior[0]]), ridge, iters), 0.0
    if a < 0:
        a = 0.0
        b = float(_newton(np.ones((len(z), 1)), y, np.array([prior[1]]), ridge, iters)[0]) if bias else 0.0
    return float(a), float(b)


@dataclass
class Scaling:
    """sigmoid(a[k] * z + b[k]) at 0-based position k (positions past the list use the global pair).

    `method` is what cross-validation over the fit split's answers chose for the per-position pairs: "identity" (the
    raw head), "global" (the global pair everywhere) or "per_position" (shrunk towards the global pair with pseudo-count
    `shrinkage`). (global_a, global_b), the pair an export bakes into vLLM's shared head, is the fitted global pair
    where it beat the raw head in the same cross-validation, else (1, 0); `global_fit` is the fitted pair either way.
    `cv_nll`: each candidate's held-out NLL per pair; `cv_answers`: the answers the folds held out."""

    a: list[float]
    b: list[float]
    global_a: float
    global_b: float
    fallback: list[int] = field(default_factory=list)  # positions that took the global pair (too few pairs)
    method: str = "per_position"
    shrinkage: float | None = None
    global_fit: list[float] = field(default_factory=lambda: [1.0, 0.0])
    cv_nll: dict[str, float] = field(default_factory=dict)
    cv_answers: int = 0

    def apply(self, z: np.ndarray, pos: np.ndarray) -> np.ndarray:
        pos = np.asarray(pos)
        a = np.array([self.a[k] if k < len(self.a) else self.global_a for k in pos.ravel()]).reshape(pos.shape)
        b = np.array([self.b[k] if k < len(self.b) else self.global_b for k in pos.ravel()]).reshape(pos.shape)
        return sigmoid(a * np.asarray(z) + b)


def _nll(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def _per_position(z, y, pos, num_positions: int, glob: tuple[float, float], shrinkage: float, bias: bool,
                  min_pairs: int) -> tuple[list[float], list[float], list[int]]:
    """Per-position pairs, each shrunk towards `glob` with pseudo-count `shrinkage` (ridge = shrinkage / n_k on the
    mean NLL); a position with fewer than `min_pairs` pairs or one class only takes `glob`."""
    a, b, fallback = [], [], []
    for k in range(num_positions):
        m = pos == k
        if m.sum() < min_pairs or len(np.unique(y[m])) < 2:
            a.append(glob[0]), b.append(glob[1]), fallback.append(k)
            continue
        ak, bk = fit_logistic(z[m], y[m], bias=bias, ridge=max(shrinkage / m.sum(), 1e-4), prior=glob)
        a.append(ak), b.append(bk)
    return a, b, fallback


def _candidates(z, y, pos, num_positions: int, bias: bool, min_pairs: int) -> dict[str, tuple[list[float], list[float]]]:
    """Every candidate scaling fitted on (z, y, pos), simplest first: identity, global, per-position by decreasing
    shrinkage."""
    k = num_positions
    glob = fit_logistic(z, y, bias=bias) if len(z) else (1.0, 0.0)
    out = {"identity": ([1.0] * k, [0.0] * k), "global": ([glob[0]] * k, [glob[1]] * k)}
    for lam in SHRINKAGE:
        a, b, _ = _per_position(z, y, pos, k, glob, lam, bias, min_pairs)
        out[f"per_position@{lam:g}"] = (a, b)
    return out


def _apply(ab: tuple[list[float], list[float]], z: np.ndarray, pos: np.ndarray) -> np.ndarray:
    a, b = np.asarray(ab[0])[pos], np.asarray(ab[1])[pos]
    return sigmoid(a * z + b)


def _one_se_choice(per_answer: dict[str, np.ndarray], order: Sequence[str]) -> str:
    """The simplest candidate (in `order`) whose held-out NLL, summed per answer, is within one standard error of the
    best candidate's: the paired per-answer differences give the error, so answers, not rounds, are the samples."""
    best = min(order, key=lambda c: per_answer[c].sum())
    for c in order:
        d = per_answer[c] - per_answer[best]
        se = float(np.sqrt(len(d)) * d.std(ddof=1)) if len(d) > 1 else 0.0
        if d.sum() <= se:
            return c
    return best


def fit_scaling(z: np.ndarray, y: np.ndarray, pos: np.ndarray, num_positions: int, *, bias: bool = True,
                min_pairs: int = MIN_PAIRS, answers: np.ndarray | None = None, folds: int = CV_FOLDS) -> Scaling:
    """Calibrate the head's logits on a fit split, choosing the scaling by cross-validation inside that split.

    Candidates, simplest first: the raw head (identity), one global (a, b), and per-position (a_k, b_k) shrunk
    towards the global pair with each pseudo-count in SHRINKAGE. Folds hold out whole answers (`answers`: each pair's;
    None: each pair is its own answer); a candidate's held-out NLL is summed per answer, and the simplest candidate
    within one standard error (over answers) of the best is chosen (`_one_se_choice`), then fitted on the whole split.
    So a fit that does not beat the raw head on answers it did not see is not taken, and a position with few pairs
    stays near the global pair. The baked global pair is chosen the same way between identity and global. With fewer
    than two answers nothing can be held out and the raw head is kept."""
    z, y, pos = np.asarray(z, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(pos, dtype=np.int64)
    groups = np.arange(len(z)) if answers is None else np.asarray(answers)
    uniq = np.unique(groups)
    full = _candidates(z, y, pos, num_positions, bias, min_pairs)
    names = list(full)
    glob_fit = [full["global"][0][0], full["global"][1][0]] if num_positions else [1.0, 0.0]
    if len(uniq) < 2:
        return Scaling([1.0] * num_positions, [0.0] * num_positions, 1.0, 0.0, [], "identity", None, glob_fit, {}, len(uniq))
    n_folds = min(folds, len(uniq))
    fold_of = {g: i % n_folds for i, g in enumerate(np.random.default_rng(0).permutation(uniq))}
    fold = np.array([fold_of[g] for g in groups])
    index = {g: i for i, g in enumerate(uniq)}
    per_answer = {c: np.zeros(len(uniq)) for c in names}
    for f in range(n_folds):
        tr, te = fold != f, fold == f
        fitted = _candidates(z[tr], y[tr], pos[tr], num_positions, bias, min_pairs)
        rows = np.array([index[g] for g in groups[te]])
        for c in names:
            np.add.at(per_answer[c], rows, _nll(_apply(fitted[c], z[te], pos[te]), y[te]))
    method = _one_se_choice(per_answer, names)
    glob_ok = _one_se_choice(per_answer, ["identity", "global"]) == "global"
    ga, gb = glob_fit if glob_ok else (1.0, 0.0)
    cv = {c: round(float(per_answer[c].sum() / max(len(z), 1)), 6) for c in names}
    if method.startswith("per_position"):
        lam = float(method.split("@")[1])
        a, b, fallback = _per_position(z, y, pos, num_positions, tuple(glob_fit), lam, bias, min_pairs)
        return Scaling(a, b, ga, gb, fallback, "per_position", lam, glob_fit, cv, len(uniq))
    a, b = full[method]
    return Scaling(list(a), list(b), ga, gb, [], method, None, glob_fit, cv, len(uniq))


def ece(p: np.ndarray, y: np.ndarray, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error with equal-mass bins: sort by p, cut into `bins` groups of (nearly) equal count,
    sum |mean p - mean y| weighted by the group's share. NaN for no pairs."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(p) == 0:
        return float("nan")
    order = np.argsort(p, kind="stable")
    return float(sum(len(g) / len(p) * abs(p[g].mean() - y[g].mean()) for g in np.array_split(order, min(bins, len(p))) if len(g)))


def ece_per_position(p: np.ndarray, y: np.ndarray, pos: np.ndarray, num_positions: int, bins: int = DEFAULT_BINS) -> list[float | None]:
    return [None if not (pos == k).any() else round(ece(p[pos == k], y[pos == k], bins), 5) for k in range(num_positions)]


# ----------------------------------------------------------------------------------------- vLLM's admission rule


def admit(probs: Sequence[Sequence[float]], capacities: Sequence[int], budget: int) -> list[int]:
    """Drafts admitted per request under a draft-token budget, by vLLM's rule (`_assign_draft_token_budget` in
    vllm/v1/worker/gpu/spec_decode/adaptive_verification.py): every (request, step) slot within the request's
    capacity scores the request's survival probability, the running product of its per-position confidences up to
    that step, and the `budget` highest scores win; a request verifies as many drafts as it won slots. vLLM calls the
    rule only when the budget is short; here a budget that covers every slot admits them all. Ties (which torch's
    top-k leaves unordered) go to the earlier request, then the earlier step."""
    slots = []
    for r, (row, cap) in enumerate(zip(probs, capacities)):
        surv = 1.0
        for k in range(min(cap, len(row))):
            surv *= float(row[k])
            slots.append((-surv, r, k))
    slots.sort()
    out = [0] * len(capacities)
    for _, r, _ in slots[: max(budget, 0)]:
        out[r] += 1
    return out


def replay_table(rounds: Sequence[Round], scores: dict[str, Sequence[Sequence[float]]], *, batch_size: int,
                 budgets_per_request: Sequence[float], seed: int = 0) -> list[dict[str, Any]]:
    """Price scorings the way the engine uses them: rounds are shuffled (seeded) into batches of `batch_size`
    concurrent requests; each batch admits round(budget_per_request * requests) slots by `admit`; a request admitted
    n drafts gains min(n, accepted) (verification of a prefix of the drafts accepts the same leading drafts).
    Per budget and scoring: accepted drafts per verified slot and per request."""
    order = list(range(len(rounds)))
    random.Random(seed).shuffle(order)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    table = []
    for per_req in budgets_per_request:
        row: dict[str, Any] = {"budget_per_request": per_req}
        for name, sc in scores.items():
            verified = accepted = 0
            for idx in batches:
                caps = [len(rounds[i].logits) for i in idx]
                got = admit([sc[i] for i in idx], caps, int(round(per_req * len(idx))))
                verified += sum(got)
                accepted += sum(min(n, rounds[i].accepted) for n, i in zip(got, idx))
            row[name] = {"accepted_per_verified_slot": round(accepted / verified, 5) if verified else None,
                         "accepted_per_request": round(accepted / len(rounds), 5) if rounds else None,
                         "verified_slots": verified}
        table.append(row)
    return table


def oracle_scores(rounds: Sequence[Round]) -> list[list[float]]:
    """The true outcome as a score: 1 for slots the target accepted, 0 after (survival = the accepted prefix)."""
    return [[1.0 if k < r.accepted else 0.0 for k in range(len(r.logits))] for r in rounds]


# ----------------------------------------------------------------------------------------- collection


def collect_rounds(cfg, checkpoint_dir: str | Path, *, temperatures: Sequence[float] = (0.0, 1.0), device: str = "cpu",
                   max_answers: int | None = None, rounds_path: str | Path | None = None) -> list[Round]:
    """Decode the recipe's eval prompts (cfg.eval.tasks) with the evaluator's speculative loop at each temperature and
    record each round's confidence logits and outcome. The draft's confidence threshold is switched off meanwhile:
    vLLM does not read it, so every slot is drafted and scored as the engine would.

    With `rounds_path`, each answer's rounds are appended there as soon as it is decoded, and a rerun on the same
    file (same checkpoint and decode settings, checked against its sidecar) decodes only the answers it lacks: on
    CPU a collection takes most of an hour, and a crash or a kill should cost one answer, not all of them."""
    import torch

    from deepspec.data.chat import render_prompt
    from deepspec.drafts.checkpoint import load_draft
    from deepspec.eval.decode import eos_token_ids, generate_speculative
    from deepspec.eval.runner import build_work, check_target_matches, checkpoint_provenance, first_messages, resolve_target_name
    from deepspec.log import progress
    from deepspec.targets import load_target

    meta = checkpoint_provenance(checkpoint_dir)
    if meta.get("algorithm") != "dspark":
        raise ConfigError(f"Confidence calibration needs a DSpark draft; {checkpoint_dir} holds '{meta.get('algorithm')}'.")
    target = load_target(resolve_target_name(cfg, meta), revision=cfg.target.revision, dtype=cfg.target.dtype, device=device,
                         attn_implementation=cfg.target.attn_implementation, trust_remote_code=cfg.target.trust_remote_code)
    check_target_matches(meta, target)
    draft = load_draft(checkpoint_dir, target.model, device=device).to(dtype=next(target.model.parameters()).dtype).eval()
    if draft.confidence_head is None:
        raise ConfigError(f"The DSpark draft in {checkpoint_dir} has no confidence head; train it with model.enable_confidence_head=true.")
    draft.model_cfg.confidence_threshold = 0.0
    proposer = draft.proposer()
    eos = eos_token_ids(target.model, target.tokenizer)
    items, _ = build_work(cfg)
    prompts = [render_prompt(target.tokenizer, first_messages(it.row) + [{"role": "user", "content": it.row["turns"][0]}],
                             dict(cfg.target.chat_template_kwargs or {})) for it in items][:max_answers]
    settings = {"checkpoint": str(Path(checkpoint_dir).resolve()), "prompts": len(prompts), "seed": cfg.eval.seed,
                "max_new_tokens": cfg.eval.max_new_tokens, "num_draft_tokens": cfg.eval.num_draft_tokens,
                "draft_sample_method": cfg.eval.draft_sample_method}
    rounds = _resume_rounds(rounds_path, settings) if rounds_path is not None else []
    done = {(r.temperature, r.answer) for r in rounds}
    # answer by answer, every temperature of an answer before the next: a collection stopped early still has both
    # temperatures on the same answers
    todo = [(t, i) for i in range(len(prompts)) for t in temperatures if (float(t), i) not in done]
    for temp, i in progress(todo, desc="calibration answers", unit="answer"):
        got: list[Round] = []

        def on_round(checked: int, accepted: int, i: int = i, temp: float = temp) -> None:
            got.append(Round(list(draft.last_confidence_logits), checked, accepted, i, float(temp)))

        gen = torch.Generator(device=device).manual_seed(cfg.eval.seed + i)
        generate_speculative(target.model, proposer, list(draft.taps), prompts[i], max_new_tokens=cfg.eval.max_new_tokens,
                             num_draft_tokens=cfg.eval.num_draft_tokens, temperature=temp, eos_ids=eos, generator=gen,
                             draft_sample_method=cfg.eval.draft_sample_method, on_round=on_round)
        rounds.extend(got)
        if rounds_path is not None:
            with open(rounds_path, "a") as f:  # one write per answer: the file only ever holds whole answers
                f.write("".join(json.dumps(asdict(r)) + "\n" for r in got))
    keep = {float(t) for t in temperatures}
    return sorted((r for r in rounds if r.temperature in keep), key=lambda r: (r.temperature, r.answer))


def _resume_rounds(path: str | Path, settings: dict[str, Any]) -> list[Round]:
    """The rounds a previous collection with the same `settings` left in `path` (none when it is new); a file written
    with other settings is refused rather than mixed in."""
    path = Path(path)
    meta = path.with_name(path.name + ".settings.json")
    if path.is_file() and path.stat().st_size:
        old = json.loads(meta.read_text()) if meta.is_file() else None
        if old != settings:
            raise ConfigError(f"{path} holds rounds collected with other settings ({old} vs {settings}); delete it or "
                              "choose another --out to collect afresh.")
        return load_rounds(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    meta.write_text(json.dumps(settings, indent=2))
    return []


# ----------------------------------------------------------------------------------------- the report


def split_by_answer(rounds: Sequence[Round]) -> tuple[list[Round], list[Round]]:
    """Fit on even answers, evaluate on odd ones: no answer contributes to both."""
    return [r for r in rounds if r.answer % 2 == 0], [r for r in rounds if r.answer % 2 == 1]


def calibration_report(rounds: Sequence[Round], *, bins: int = DEFAULT_BINS, bias: bool = True, batch_size: int = 8,
                       budgets_per_request: Sequence[float] = (1.0, 2.0, 3.0, 4.0)) -> dict[str, Any]:
    """Per temperature: the fitted scaling, per-position ECE before / after on the evaluation split, and the admission
    replay (raw / calibrated / global only / global fit / oracle) over the evaluation split's rounds; `global_fit` is
    the fitted global pair taken regardless of the selection, and `with_pair_of` the other temperatures' baked pairs
    on this one's evaluation split."""
    out: dict[str, Any] = {"bins": bins, "binning": "equal-mass", "label": "conditional acceptance (draft k | drafts < k accepted)",
                           "split": "fit on even answers, evaluated on odd answers",
                           "selection": f"identity / global / per-position shrunk by pseudo-counts {list(SHRINKAGE)}: the simplest "
                                        f"within one standard error of the best held-out NLL, {CV_FOLDS}-fold cross-validation "
                                        "over the fit split's answers", "temperatures": {}}
    for temp in sorted({r.temperature for r in rounds}):
        fit_r, eval_r = split_by_answer([r for r in rounds if r.temperature == temp])
        if not fit_r or not eval_r:
            raise ConfigError("Calibration needs at least two answers per temperature (one to fit, one to evaluate); "
                              "give the eval more prompts (eval.max_samples).")
        k = max(len(r.logits) for r in rounds)
        zf, yf, pf = pairs(fit_r)
        sc = fit_scaling(zf, yf, pf, k, bias=bias, answers=pair_answers(fit_r))
        ze, ye, pe = pairs(eval_r)
        raw_p, cal_p = sigmoid(ze), sc.apply(ze, pe)
        glob_p = sigmoid(sc.global_a * ze + sc.global_b)
        fa, fb = sc.global_fit
        fit_p = sigmoid(fa * ze + fb)
        raw_scores = [list(sigmoid(np.asarray(r.logits))) for r in eval_r]
        cal_scores = [list(sc.apply(np.asarray(r.logits), np.arange(len(r.logits)))) for r in eval_r]
        glob_scores = [list(sigmoid(sc.global_a * np.asarray(r.logits) + sc.global_b)) for r in eval_r]
        fit_scores = [list(sigmoid(fa * np.asarray(r.logits) + fb)) for r in eval_r]
        out["temperatures"][f"{temp:g}"] = {
            "rounds": {"fit": len(fit_r), "eval": len(eval_r)},
            "pairs_per_position": {"fit": [int((pf == j).sum()) for j in range(k)], "eval": [int((pe == j).sum()) for j in range(k)]},
            "scaling": asdict(sc),
            "ece_raw": ece_per_position(raw_p, ye, pe, k, bins),
            "ece_calibrated": ece_per_position(cal_p, ye, pe, k, bins),
            "ece_global_only": ece_per_position(glob_p, ye, pe, k, bins),
            # the fitted global pair whether or not the selection took it: what taking it regardless would have given
            "ece_global_fit": ece_per_position(fit_p, ye, pe, k, bins),
            "ece_all_positions": {"raw": round(ece(raw_p, ye, bins), 5), "calibrated": round(ece(cal_p, ye, bins), 5),
                                  "global_only": round(ece(glob_p, ye, bins), 5), "global_fit": round(ece(fit_p, ye, bins), 5)},
            "mean_confidence_raw": [None if not (pe == j).any() else round(float(raw_p[pe == j].mean()), 5) for j in range(k)],
            "acceptance_observed": [None if not (pe == j).any() else round(float(ye[pe == j].mean()), 5) for j in range(k)],
            "admission_replay": {"batch_size": batch_size, "rows": replay_table(
                eval_r, {"raw": raw_scores, "calibrated": cal_scores, "global_only": glob_scores, "global_fit": fit_scores,
                         "oracle": oracle_scores(eval_r)},
                batch_size=batch_size, budgets_per_request=budgets_per_request)},
            "_plot": (raw_p, cal_p, ye),
            "_eval": eval_r,
        }
    _cross_temperature(out["temperatures"], bins, batch_size, budgets_per_request)
    return out


def _cross_temperature(temps: dict[str, Any], bins: int, batch_size: int, budgets: Sequence[float]) -> None:
    """Each temperature's baked pair applied to every other temperature's evaluation split (`with_pair_of`): an export
    bakes one pair, and the server may sample at another temperature than it was fitted at."""
    for name, t in temps.items():
        eval_r = t["_eval"]
        ze, ye, _ = pairs(eval_r)
        t["with_pair_of"] = {}
        for other, o in temps.items():
            if other == name:
                continue
            a, b = o["scaling"]["global_a"], o["scaling"]["global_b"]
            rows = replay_table(eval_r, {"pair": [list(sigmoid(a * np.asarray(r.logits) + b)) for r in eval_r]},
                                batch_size=batch_size, budgets_per_request=budgets)
            # the raw column is this temperature's own replay (same rounds, same seeded batches): read, not replayed
            t["with_pair_of"][other] = {"pair": [a, b], "ece_all_positions": round(ece(sigmoid(a * ze + b), ye, bins), 5),
                                        "accepted_per_verified_slot": [{"budget_per_request": r["budget_per_request"],
                                                                        "raw": own["raw"]["accepted_per_verified_slot"],
                                                                        "pair": r["pair"]["accepted_per_verified_slot"]}
                                                                       for r, own in zip(rows, t["admission_replay"]["rows"])]}


def plot_reliability(report: dict[str, Any], path: Path, bins: int = DEFAULT_BINS) -> Path | None:
    """Reliability diagram (equal-mass bins): mean confidence vs observed acceptance, raw and calibrated, pooled over
    positions (per-position ECE is in the JSON), one panel per temperature. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    temps = report["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 4.2), squeeze=False)
    for ax, (name, t) in zip(axes[0], temps.items()):
        raw_p, cal_p, y = t["_plot"]
        for p, label, style in ((raw_p, "raw", "o-"), (cal_p, "calibrated", "s-")):
            groups = [g for g in np.array_split(np.argsort(p, kind="stable"), min(bins, len(p))) if len(g)]
            ax.plot([p[g].mean() for g in groups], [y[g].mean() for g in groups], style,
                    label=f"{label} (ECE {ece(p, y, bins):.3f})")
        ax.plot([0, 1], [0, 1], ":", color="gray")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (bin mean)", ylabel="accepted (bin mean)",
               title=f"T = {name}, all positions, {bins} equal-mass bins")
        ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_calibration(report: dict[str, Any], out_dir: str | Path, bake_temperature: float | None = None) -> dict[str, Path]:
    """calibration.json and calibration.png in `out_dir` (beside the eval's acceptance.png). `bake` names the
    temperature whose global (a, b) an export bakes into the head (default: the highest measured)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_reliability(report, out / "calibration.png", report["bins"])
    temps = report["temperatures"]
    key = f"{bake_temperature:g}" if bake_temperature is not None else max(temps, key=float)
    if key not in temps:
        raise ConfigError(f"No calibration at temperature {key}; measured: {', '.join(temps)}.")
    clean = {**report, "temperatures": {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in temps.items()}}
    clean["bake"] = {"temperature": float(key), "a": temps[key]["scaling"]["global_a"], "b": temps[key]["scaling"]["global_b"]}
    (out / "calibration.json").write_text(json.dumps(clean, indent=2))
    return {"json": out / "calibration.json", **({"png": png} if png else {})}


ROUNDS_FILE = "calibration_rounds.jsonl"


def save_rounds(rounds: Sequence[Round], path: str | Path) -> Path:
    """One JSON object per round: what a refit needs without decoding again (`--rounds`)."""
    path = Path(path)
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rounds))
    return path


def load_rounds(path: str | Path) -> list[Round]:
    """Rounds saved by save_rounds; a user error when the file is not such a list."""
    try:
        return [Round(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a {ROUNDS_FILE} written by `python -m deepspec.eval.calibration` ({e}).") from e


def calibrate(cfg, checkpoint_dir: str | Path, out_dir: str | Path, *, temperatures: Sequence[float] = (0.0, 1.0),
              bins: int = DEFAULT_BINS, batch_size: int = 8, budgets_per_request: Sequence[float] = (1.0, 2.0, 3.0, 4.0),
              max_answers: int | None = None, device: str = "cpu", rounds: Sequence[Round] | None = None,
              bake_temperature: float | None = None) -> dict[str, Any]:
    """Collect (unless `rounds` are given), fit, evaluate and write calibration.json + calibration.png, and the rounds
    (calibration_rounds.jsonl, for a refit without decoding), for a DSpark checkpoint; returns the report. The rounds
    are written answer by answer as they are decoded, and a rerun into the same `out_dir` resumes the collection."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if rounds is None:
        rounds = collect_rounds(cfg, checkpoint_dir, temperatures=temperatures, device=device, max_answers=max_answers,
                                rounds_path=Path(out_dir) / ROUNDS_FILE)
    else:
        save_rounds(rounds, Path(out_dir) / ROUNDS_FILE)
    report = calibration_report(rounds, bins=bins, batch_size=batch_size, budgets_per_request=budgets_per_request)
    write_calibration(report, out_dir, bake_temperature)
    return json.loads((Path(out_dir) / "calibration.json").read_text())


def main(argv: Sequence[str] | None = None) -> None:
    """python -m deepspec.eval.calibration CHECKPOINT [--out DIR] [--opts k=v ...]: the recipe is the checkpoint's."""
    import argparse

    from deepspec.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--out", help="folder for calibration.json / calibration.png (default: CHECKPOINT/eval)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--bins", type=int, default=DEFAULT_BINS)
    ap.add_argument("--rounds", help=f"refit from a {ROUNDS_FILE} an earlier run wrote instead of decoding again")
    ap.add_argument("--bake-temperature", type=float, default=None,
                    help="the temperature whose global pair an export bakes: the one you serve at (default: the highest measured)")
    ap.add_argument("--opts", nargs="*", default=[])
    a = ap.parse_args(argv)
    ckpt = Path(a.checkpoint)
    cfg = load_config(str(ckpt / "config.yaml"), list(a.opts))
    rep = calibrate(cfg, ckpt, a.out or ckpt / "eval", temperatures=[float(t) for t in a.temperatures.split(",")], bins=a.bins,
                    rounds=load_rounds(a.rounds) if a.rounds else None, bake_temperature=a.bake_temperature)
    print(json.dumps({t: v["ece_all_positions"] for t, v in rep["temperatures"].items()}))


if __name__ == "__main__":
    main()
