"""Transformers batched generation: the fallback without vLLM, and the engine for tiny test targets."""

from __future__ import annotations

from typing import Any

from deepspec.data.engines.base import BatchEngine, LengthGuard, TurnOutput


class HFEngine(BatchEngine):
    name = "hf"

    def __init__(self, target_cfg, sampling, chat_template_kwargs: dict[str, Any], *, batch_size: int = 8,
                 max_model_len: int | None = None, device: str | None = None):
        import transformers

        from deepspec.targets import load_target_from_config

        self._version = transformers.__version__
        self.target = load_target_from_config(target_cfg, device=device)
        self.tokenizer = self.target.tokenizer
        self.tokenizer.padding_side = "left"  # generation continues from the right edge
        self.sampling = sampling
        self.chat_template_kwargs = dict(chat_template_kwargs)
        self.batch_size = batch_size
        self.max_tokens = sampling.max_tokens
        self.seed = sampling.seed
        ctx = max_model_len or getattr(self.target.config, "max_position_embeddings", None)
        self.guard = LengthGuard(self.tokenizer, ctx, self.chat_template_kwargs)

    @property
    def version(self) -> str:
        return self._version

    @property
    def template_hash(self) -> str:
        return self.target.template_hash

    def chat_batch(self, requests):
        import torch

        tok, model = self.tokenizer, self.target.model
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs)
                 for m, _, _ in requests]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        max_new = max(mt for _, mt, _ in requests)
        s = self.sampling
        gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
        if s.temperature > 0:
            torch.manual_seed(requests[0][2])
            gen_kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
            if s.top_k > 0:
                gen_kwargs["top_k"] = s.top_k
            if s.min_p > 0:
                gen_kwargs["min_p"] = s.min_p
        else:
            gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = model.generate(**enc, **gen_kwargs)
        new = out[:, enc["input_ids"].shape[1]:]
        results = []
        for row, (_, mt, _) in zip(new.tolist(), requests):
            row = row[:mt]
            n, reason = len(row), "length"
            if tok.eos_token_id in row:
                n, reason = row.index(tok.eos_token_id) + 1, "stop"
            text = tok.decode(row[: n - 1 if reason == "stop" else n], skip_special_tokens=True)
            results.append(TurnOutput(text=text, tokens=n, finish_reason=reason))
        return results
