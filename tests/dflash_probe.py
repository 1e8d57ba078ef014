"""Run the published DFlash code and our AutoModel path on exports in a separate interpreter, so they can run under
another transformers release (the one the `dflash` package pins) put first on PYTHONPATH.

Usage: python tests/dflash_probe.py DFLASH_SIDE TARGET_DIR REFERENCE.pt EXPORT [EXPORT ...]
REFERENCE.pt: {"ids", "taps" [1, T, n*H], "anchors", "greedy", "block_size", "mask", export name: {anchor: our logits}}.
Prints `DFLASH_PROBE {json}`: per export and loader the largest logit difference and whether greedy decoding matched."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM


def main() -> None:
    side, target_dir, ref_path, *exports = sys.argv[1:]
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("_published_dflash_model", Path(side) / "dflash" / "model.py")
    published = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(published)
    ref = torch.load(ref_path)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids, taps, k, n = ref["ids"], ref["taps"], ref["block_size"], ref["greedy"].shape[1] - ref["ids"].shape[1]
    report: dict = {"transformers": transformers.__version__}
    for exp in exports:
        name = Path(exp).parent.name
        for loader in ("published", "ours"):
            if loader == "published":
                model = published.DFlashDraftModel.from_pretrained(exp, dtype=torch.float32).eval()
            else:
                model = AutoModel.from_pretrained(exp, trust_remote_code=True, dtype=torch.float32).eval()
            diff = 0.0
            for anchor, want in ref[name].items():
                block = torch.full((1, k), ref["mask"], dtype=torch.long)
                block[0, 0] = ids[0, anchor]
                emb = target.get_input_embeddings()(block)
                with torch.no_grad():
                    h = model(target_hidden=taps[:, :anchor], noise_embedding=emb, position_ids=torch.arange(anchor + k)[None])
                    got = (model.compute_logits(h[:, 1:], target.lm_head) if loader == "published" else model.logits(h[:, 1:], target))[0]
                diff = max(diff, float((got - want).abs().max()))
            out = model.spec_generate(target=target, input_ids=ids, max_new_tokens=n, stop_token_ids=None, temperature=0.0)
            report[f"{name}/{loader}"] = {"max_logit_diff": diff, "lossless": bool(torch.equal(out, ref["greedy"]))}
    print("DFLASH_PROBE " + json.dumps(report))


if __name__ == "__main__":
    main()
