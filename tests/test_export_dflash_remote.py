"""DFlash exports outside the engines: transformers' `trust_remote_code` path (our modeling file, shipped in the export
and mapped by `auto_map`) and the published DFlash reference code (`DFlashDraftModel` of the `dflash` package, installed
into a side folder by scripts/dflash_side.sh and loaded from there, never copied here). Both load a deepspec export of a
tiny random Qwen3 target; their block logits equal ours and their greedy speculative decoding equals the target's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import load_draft, save_draft, target_weights
from deepspec.errors import ConfigError
from deepspec.export.card import transformers_loaders
from deepspec.export.writers import export_draft
from deepspec.targets import capture, tiny_target

ROOT = Path(__file__).resolve().parents[1]
K = 4  # block size
TAPS = [0, 2, 3]
MASK = 259
# The field names every published z-lab DFlash checkpoint's config.json carries (Qwen3-4B/8B-DFlash-b16 era).
PUBLISHED_FIELDS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "bos_token_id", "dflash_config", "dtype",
    "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads", "num_hidden_layers",
    "num_key_value_heads", "num_target_layers", "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window",
    "tie_word_embeddings", "transformers_version", "use_cache", "use_sliding_window", "vocab_size",
}
CASES = {
    "full": dict(num_draft_layers=2),
    "sliding": dict(num_draft_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=K),
    "draft-vocab": dict(num_draft_layers=1, draft_vocab_size=100),
}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("qwen3")
    return model


@pytest.fixture(scope="module")
def exports(target, tmp_path_factory):
    """case -> (our draft with the target's weights, checkpoint, export folder)."""
    root = tmp_path_factory.mktemp("dflash_remote")
    out = {}
    for case, fields in CASES.items():
        torch.manual_seed(0)
        cfg = ModelConfig(algorithm="dflash", block_size=K, target_layer_ids=TAPS, mask_token_id=MASK, **fields)
        draft = get_algorithm("dflash").from_target_config(target.config, cfg)
        draft.set_token_frequencies(torch.rand(320))
        with torch.no_grad():  # random everywhere, norms included, so a dropped or swapped tensor shows
            for p in draft.parameters():
                p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
        draft.load_target_weights(*target_weights(target))
        prov = {"target": "tiny-qwen3", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6}
        ckpt = save_draft(draft, root / case / "ckpt", prov)
        exp = export_draft(ckpt, root / case / "export", dtype="float32")
        out[case] = (load_draft(ckpt, target_model=target).eval(), ckpt, exp)
    return out


@pytest.fixture(scope="module")
def prompt(target):
    ids = torch.randint(0, 250, (1, 14), generator=torch.Generator().manual_seed(3))
    return ids, capture(target, ids, TAPS)[0]  # taps [1, T, n_taps, H]


def _greedy(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The target's own greedy continuation (no cache, no draft): the reference every loop must reproduce."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


def _ours(draft, ids, taps, anchor: int) -> torch.Tensor:
    """Our proposer's draft logits [K-1, Dv] for the block anchored at `anchor` (context = positions < anchor)."""
    prop = draft.proposer()
    with torch.no_grad():
        prop.propose(ids[0, : anchor + 1], taps[0, :anchor], 0, K - 1)
        return draft.base_logits(prop.last_hidden)


def _block(target, ids, anchor):
    block = torch.full((1, K), MASK, dtype=torch.long)
    block[0, 0] = ids[0, anchor]
    return target.get_input_embeddings()(block)


def _oracle(model, ref: torch.Tensor, logits_attr: str, vocab: int, miss_every: int = 3):
    """Make `model` propose the reference continuation, except slot 2 of every `miss_every`-th anchor (partial
    acceptance), so the loop's accept / crop / bonus paths all run. Returns the list of anchors drafted."""
    anchors: list[int] = []
    forward, logits_fn = model.forward, getattr(model, logits_attr)

    def fwd(*args, **kw):
        anchors.append(int(kw["position_ids"][0, -kw["noise_embedding"].shape[1]]))  # the block's first position
        return forward(*args, **kw)

    def logits(h, head):
        real = logits_fn(h, head)
        a = anchors[-1]
        want = [int(ref[0, a + 1 + j]) if a + 1 + j < ref.shape[1] else 0 for j in range(h.shape[1])]
        if a % miss_every == 0 and len(want) > 1:
            want[1] = (want[1] + 1) % vocab
        return torch.nn.functional.one_hot(torch.tensor([want]), real.shape[-1]).to(real.dtype) * 10.0

    model.forward, model.__dict__[logits_attr] = fwd, logits
    return anchors


# --- the export -----------------------------------------------------------------------------------------------------
def test_export_carries_the_published_fields_and_our_modeling_file(exports):
    for case, (_, _, exp) in exports.items():
        cfg = json.loads((exp / "config.json").read_text())
        assert PUBLISHED_FIELDS <= set(cfg), (case, sorted(PUBLISHED_FIELDS - set(cfg)))
        assert cfg["auto_map"] == {"AutoModel": "modeling_deepspec_dflash.DFlashDraftModel"} and (exp / "modeling_deepspec_dflash.py").is_file()
        assert cfg["is_causal"] is False and cfg["dflash_config"]["target_layer_ids"] == TAPS and cfg["num_target_layers"] == 6
        assert len(cfg["layer_types"]) == cfg["num_hidden_layers"]
        assert cfg["use_sliding_window"] == (case == "sliding") and (cfg["sliding_window"] == K if case == "sliding" else cfg["sliding_window"] is None)
    card = (exports["draft-vocab"][2] / "README.md").read_text()
    assert "trust_remote_code=True" in card and "ignores lm_head / d2t" in card
    assert "also runs it as trained" in (exports["full"][2] / "README.md").read_text()


def test_loader_notes_for_drafts_that_loaders_cannot_run():
    base = {"vocab_size": 320, "draft_vocab_size": 320, "num_target_layers": 6, "deepspec": {"taps": [0, 2, 3]}}
    assert transformers_loaders(base) == {"deepspec": None, "dflash": None}
    assert "last layer" in transformers_loaders(dict(base, deepspec={"taps": [0, 2, 5]}))["dflash"]
    multi = transformers_loaders(dict(base, target_hc_mult=4))
    assert "residual streams" in multi["deepspec"] and "residual streams" in multi["dflash"]


# --- our modeling file through AutoModel(trust_remote_code) ---------------------------------------------------------
def _auto(exp):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(exp), trust_remote_code=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(CASES))
def test_auto_map_model_matches_ours_and_decodes_losslessly(exports, target, prompt, case):
    draft, _, exp = exports[case]
    ids, taps = prompt
    model = _auto(exp)
    assert type(model).__name__ == "DFlashDraftModel" and type(model).__module__.endswith("modeling_deepspec_dflash")
    assert hasattr(model, "spec_generate")
    for anchor in (3, 11):
        with torch.no_grad():
            pos = torch.arange(anchor + K)[None]
            h = model(noise_embedding=_block(target, ids, anchor), position_ids=pos, target_hidden=taps[:, :anchor].flatten(-2))
            got = model.logits(h[:, 1:], target)[0]
        torch.testing.assert_close(got, _ours(draft, ids, taps, anchor), rtol=1e-5, atol=1e-5)
        assert torch.equal(model.to_target_ids(got.argmax(-1)), draft.vocab_target_ids()[got.argmax(-1)])
    n = 20
    ref = _greedy(target, ids, n)
    out, rounds = model.spec_generate(target=target, input_ids=ids, max_new_tokens=n, stop_token_ids=None, temperature=0.0, return_stats=True)
    assert torch.equal(out, ref)  # the draft as trained
    if case == "full":  # an oracle draft: accepted blocks, a rejection in some, the bonus token, cache crops
        anchors = _oracle(model, ref, "logits", 320)
        out, rounds = model.spec_generate(target=target, input_ids=ids, max_new_tokens=n, return_stats=True)
        assert torch.equal(out, ref) and max(rounds) == K and 2 in rounds and len(anchors) < n - 1
        p = ids.shape[1]
        stop = int(ref[0, p + 9])
        first = [int(t) for t in ref[0, p:]].index(stop)
        assert torch.equal(model.spec_generate(target=target, input_ids=ids, max_new_tokens=n, stop_token_ids=[stop]), ref[:, : p + first + 1])


# --- the published DFlash code, from its side folder ----------------------------------------------------------------
@pytest.fixture(scope="module")
def published():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "dflash_side.sh")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))  # the folder is per Python: this one's
    if r.returncode != 0 or not r.stdout.strip():
        pytest.skip(f"the dflash package could not be installed by scripts/dflash_side.sh: {r.stderr.strip()[-300:]}")
    path = Path(r.stdout.strip().splitlines()[-1]) / "dflash" / "model.py"
    spec = importlib.util.spec_from_file_location("_published_dflash_model", path)  # loaded from the side folder as is
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("case", ["full", "sliding"])
def test_published_dflash_code_matches_ours_and_decodes_losslessly(published, exports, target, prompt, case):
    draft, _, exp = exports[case]
    ids, taps = prompt
    model = published.DFlashDraftModel.from_pretrained(str(exp), dtype=torch.float32).eval()
    assert model.block_size == K and model.mask_token_id == MASK and list(model.target_layer_ids) == TAPS
    for anchor in (3, 11):
        with torch.no_grad():
            h = model(target_hidden=taps[:, :anchor].flatten(-2), noise_embedding=_block(target, ids, anchor), position_ids=torch.arange(anchor + K)[None])
            got = model.compute_logits(h[:, 1:], target.lm_head)[0]
        torch.testing.assert_close(got, _ours(draft, ids, taps, anchor), rtol=1e-5, atol=1e-5)
    n = 20
    ref = _greedy(target, ids, n)
    assert torch.equal(model.spec_generate(target=target, input_ids=ids, max_new_tokens=n, stop_token_ids=None, temperature=0.0), ref)
    anchors = _oracle(model, ref, "compute_logits", 320)
    assert torch.equal(model.spec_generate(target=target, input_ids=ids, max_new_tokens=n, stop_token_ids=None, temperature=0.0), ref)
    assert len(anchors) < n - 1  # blocks were accepted, so the published loop's crop / bonus paths ran on our export


def test_export_refuses_a_window_shorter_than_the_block(exports, tmp_path):
    """A checkpoint written before the config refused it (edited here) is refused by the export with the reason."""
    _, ckpt, _ = exports["sliding"]
    import shutil

    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    cfg = json.loads((old / "config.json").read_text())
    cfg["deepspec"]["model"]["sliding_window"] = K - 1
    (old / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="shorter than model.block_size"):
        export_draft(old, tmp_path / "export")


PINNED_TRANSFORMERS = "5.15.0"  # what dflash 0.1.0 pins (its `local` extra); vLLM needs >= 5.16.1, so it runs in a child


@pytest.mark.slow
def test_published_code_and_ours_under_the_transformers_the_package_pins(exports, target, prompt, tmp_path):
    """The same checks under the transformers release the dflash package pins, in a child interpreter with that release
    first on PYTHONPATH (tests/dflash_probe.py)."""
    from deepspec.targets import save_tiny_target

    r = subprocess.run(["bash", str(ROOT / "scripts" / "dflash_side.sh"), "--transformers", PINNED_TRANSFORMERS], capture_output=True,
                       text=True, env=dict(os.environ, PYTHON=sys.executable))
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or len(lines) < 2:
        pytest.skip(f"dflash / transformers {PINNED_TRANSFORMERS} could not be installed by scripts/dflash_side.sh: {r.stderr.strip()[-300:]}")
    side, tf_dir = lines[-2], lines[-1]
    ids, taps = prompt
    ref = {"ids": ids, "taps": taps.flatten(-2), "block_size": K, "mask": MASK, "greedy": _greedy(target, ids, 16)}
    names = ["full", "sliding"]
    for case in names:
        ref[case] = {a: _ours(exports[case][0], ids, taps, a) for a in (3, 11)}
    torch.save(ref, tmp_path / "ref.pt")
    tdir = save_tiny_target(tmp_path / "target", "qwen3")  # the same seed-0 weights as the `target` fixture
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tf_dir, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "dflash_probe.py"), side, str(tdir), str(tmp_path / "ref.pt"),
                        *(str(exports[c][2]) for c in names)], capture_output=True, text=True, timeout=600, env=env)
    line = [x for x in r.stdout.splitlines() if x.startswith("DFLASH_PROBE ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    report = json.loads(line[-1][len("DFLASH_PROBE "):])
    assert report["transformers"] == PINNED_TRANSFORMERS
    for case in names:
        for loader in ("published", "ours"):
            got = report[f"{case}/{loader}"]
            assert got["max_logit_diff"] < 1e-4 and got["lossless"], (case, loader, got)
