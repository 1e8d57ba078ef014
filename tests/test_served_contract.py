"""The served-acceptance contract (export/contract.py) and `deepspec check EXPORT --served URL` (export/served.py):
the band's arithmetic, the contract's round trip through an export and its model card, and the check's exit codes
against a small stand-in server that speaks vLLM's /v1 and /metrics (the real vLLM server: test_conformance_vllm.py)."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import save_draft
from deepspec.eval.metrics import AcceptanceStats
from deepspec.export.contract import CONTRACT_FILE, build_contract, contract_card, read_contract, write_contract
from deepspec.export.served import UnusableInput, band_z, check_served, compare_split, half_width, usable_contract
from deepspec.export.writers import export_draft
from deepspec.targets import tiny_config

PROMPTS = ["one", "two", "three", "four", "five"]


# ------------------------------------------------------------------------------------------------ band arithmetic


def test_band_z_splits_the_false_alarm_over_the_positions():
    assert band_z(1) == pytest.approx(2.5758, abs=1e-3)  # 1% two-sided
    assert band_z(3) == pytest.approx(2.9352, abs=1e-3)  # 1% / 3 two-sided
    assert band_z(3) < band_z(7)


def test_half_width_is_the_two_sample_binomial_spread():
    # p~ = (0.8 * 100 + 1) / 102; var = p~ (1 - p~) (1/100 + 1/100)
    p = 81 / 102
    assert half_width(0.8, 100, 100, 2.0) == pytest.approx(2.0 * math.sqrt(p * (1 - p) * 0.02))
    # more served rounds: narrower; a contract rate of 1 still has a band
    assert half_width(0.8, 100, 1000, 2.0) < half_width(0.8, 100, 100, 2.0)
    assert half_width(1.0, 100, 100, 2.0) > 0.0


def test_the_check_samples_as_the_engine_backed_eval_does():
    from deepspec.eval.engine import PLAIN_SAMPLING
    from deepspec.export.served import PLAIN_SAMPLING as SERVED

    assert SERVED == PLAIN_SAMPLING


def test_compare_split_names_the_first_position_outside_the_band():
    z = band_z(3)
    # contract 0.9 / 0.7 / 0.5 over 200 rounds; served: same at 1, far lower at 2 and 3
    rows = compare_split("gsm8k", [0.9, 0.7, 0.5], 200, [180, 60, 30], 200, z)
    assert [r.direction for r in rows] == ["ok", "drops", "drops"]
    assert rows[0].lo < 0.9 < rows[0].hi and rows[1].served == pytest.approx(0.3)
    # within the band: all ok; far above: rises
    assert all(r.ok for r in compare_split("a", [0.9, 0.7, 0.5], 200, [178, 142, 96], 200, z))
    assert compare_split("a", [0.2], 200, [150], 200, z)[0].direction == "rises"
    # a position the contract has no figure for is not compared
    assert [r.position for r in compare_split("a", [0.9, None], 10, [9, 5], 10, z)] == [1]


# ------------------------------------------------------------------------------------------------ contract round trip


def _ckpt(tmp_path: Path) -> Path:
    from deepspec.config import load_config

    mcfg = ModelConfig(algorithm="eagle3", target_layer_ids=[0, 2, 3])
    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(tiny_config("llama"), mcfg)
    draft.set_token_frequencies(torch.arange(320).float())
    prov = {"target": "tiny-llama", "target_vocab_size": 320, "target_hidden_size": 64, "target_num_layers": 6}
    return save_draft(draft, tmp_path / "step_10", prov, config=load_config(None, []))


def _with_eval(ckpt: Path, tmp_path: Path, s: int = 3, kwargs: dict | None = None, samples: int = 5) -> Path:
    """results.json and samples.jsonl as `deepspec eval` writes them, over a custom prompt file of which the eval
    sampled `samples` rows (deepspec/eval/benchmarks.py: shuffled with eval.seed when the file holds more)."""
    from deepspec.eval.benchmarks import load_custom_task

    tasks = tmp_path / "mine.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    bench = load_custom_task(tasks, samples, 7)
    st = AcceptanceStats()
    for a in (3, 1, 0, 2, 3, 3, 2, 1):
        st.add_round(s, min(a, s))
    out = ckpt / "eval"
    out.mkdir()
    results = {"overall": st.summary(),
               "tasks": {"mine": {"file": str(tasks), "rows_in_file": bench.total_rows, **st.summary(), "samples": len(bench.samples)}},
               "meta": {"temperature": 0.0, "draft_sample_method": "greedy", "protocol": "greedy (T=0)", "num_draft_tokens": s,
                        "max_new_tokens": 48, "seed": 7, "serving_mode": {"chat_template_kwargs": kwargs or {}}}}
    (out / "results.json").write_text(json.dumps(results))
    (out / "samples.jsonl").write_text("".join(json.dumps({"task": "mine", "index": i, "id": row.get("id"), "turns": []}) + "\n"
                                               for i, row in enumerate(bench.samples)))
    return out / "results.json"


def test_contract_round_trips_through_the_export_and_the_card(tmp_path):
    ckpt = _ckpt(tmp_path)
    _with_eval(ckpt, tmp_path, kwargs={"enable_thinking": False})
    export = export_draft(ckpt, tmp_path / "out", "vllm", num_speculative_tokens=3, contract_prompts=2)
    c = read_contract(export)
    assert c == json.loads((export / CONTRACT_FILE).read_text()) and c["measured"] is True
    assert c["num_speculative_tokens"] == 3 and c["aligned"] and c["answer_budget"] == 48
    assert c["protocol"] == "greedy (T=0)" and c["temperature"] == 0.0 and c["thinking"] == "off"
    st = c["splits"]["mine"]
    assert st["rounds"] == 8 and len(st["survival"]) == 3
    assert st["survival"][0] == pytest.approx(7 / 8) and st["tau_at_S"] == pytest.approx(1 + sum(st["survival"]))
    # the first 2 prompts in the eval's own order, stored whole
    assert [(p["split"], p["index"], p["turns"]) for p in c["prompts"]] == [("mine", 0, [PROMPTS[0]]), ("mine", 1, [PROMPTS[1]])]
    assert c == build_contract(json.loads((export / "config.json").read_text()), ckpt, prompts_per_split=2)
    write_contract(tmp_path, c)
    assert read_contract(tmp_path) == c
    card = (export / "README.md").read_text()
    assert "## Served-acceptance contract" in card and "| mine | 8 | 0.875 |" in card and "thinking: off" in card
    assert usable_contract(export) == c


def test_the_stored_prompts_are_the_ones_the_eval_sampled_or_none(tmp_path):
    from deepspec.eval.benchmarks import load_custom_task

    ckpt = _ckpt(tmp_path)
    _with_eval(ckpt, tmp_path, samples=3)  # 3 of the file's 5 rows, shuffled with eval.seed 7
    cfg = {"deepspec": {"algorithm": "eagle3", "format": "vllm", "num_speculative_tokens": 3}}
    c = build_contract(cfg, ckpt)
    eval_rows = load_custom_task(tmp_path / "mine.jsonl", 3, 7).samples
    assert [(p["id"], p["turns"]) for p in c["prompts"]] == [(r["id"], r["turns"]) for r in eval_rows]
    assert [p["id"] for p in c["prompts"]] != ["p0", "p1", "p2"]  # shuffled, as the eval sampled them
    assert "eval.seed 7" in c["prompts_sampling"]
    # the file changed since the eval: no prompts (rather than other ones), the figures stay
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in reversed(list(enumerate(PROMPTS)))))
    changed = build_contract(cfg, ckpt)
    assert changed["prompts"] is None and changed["measured"] and "has changed since the eval" in changed["prompts_sampling"]
    (tmp_path / "mine.jsonl").unlink()
    gone = build_contract(cfg, ckpt)
    assert gone["prompts"] is None and "not readable here" in gone["prompts_sampling"]
    with pytest.raises(UnusableInput, match="stores no prompts"):
        export = tmp_path / "x"
        export.mkdir()
        (export / "config.json").write_text("{}")
        write_contract(export, gone)
        usable_contract(export)


def test_without_eval_results_the_contract_says_so_and_holds_no_figure(tmp_path):
    ckpt = _ckpt(tmp_path)
    export = export_draft(ckpt, tmp_path / "out", "vllm")
    c = read_contract(export)
    assert c["measured"] is False and "deepspec eval" in c["why"]
    assert not any(k in c for k in ("splits", "prompts", "protocol"))
    card = (export / "README.md").read_text()
    assert f"`{CONTRACT_FILE}` holds no figures: no eval results.json" in card
    assert contract_card(c).count("|") == 0
    with pytest.raises(UnusableInput, match="holds no measured acceptance"):
        usable_contract(export)


def test_a_baked_dspark_calibration_is_part_of_the_contract(tmp_path):
    baked = {"a": 1.25, "b": -0.5, "temperature": 0.0}
    cfg = {"deepspec": {"algorithm": "dspark", "format": "vllm", "num_speculative_tokens": 7,
                        "confidence_calibration": {"baked": baked, "per_position_not_baked": {"a": [1.0], "b": [0.0]}}}}
    c = build_contract(cfg, tmp_path)  # no eval results: still says what was baked
    assert c["calibration"] == baked and c["measured"] is False and c["num_speculative_tokens"] == 7
    c = build_contract({"deepspec": {**cfg["deepspec"], "confidence_calibration": None}}, tmp_path)
    assert c["calibration"] is None


def test_an_export_without_a_contract_is_unusable_input(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    with pytest.raises(UnusableInput, match=f"has no {CONTRACT_FILE}.*export the checkpoint again"):
        usable_contract(tmp_path / "x")
    with pytest.raises(UnusableInput, match="not an export folder"):
        usable_contract(tmp_path / "nothing")


# ------------------------------------------------------------------------------------------------ a stand-in server


class _Fake:
    """vLLM's /v1/models, /v1/chat/completions and /metrics: each chat adds `rounds` verify rounds, of which the
    share `rates[k]` accepted at least k + 1 drafts."""

    def __init__(self, rates: list[float], rounds: int = 40, sglang: bool = False):
        self.rates, self.rounds, self.sglang = rates, rounds, sglang
        self.drafts, self.per_pos, self.lock = 0, [0] * len(rates), threading.Lock()
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, body: str, ctype="application/json", code=200):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "tiny-target"}]}))
                elif self.path == "/metrics":
                    self._send(fake.metrics(), "text/plain")
                else:
                    self._send("{}", code=404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["max_tokens"] == 48 and body["temperature"] == 0.0 and body["top_k"] == 0
                with fake.lock:
                    fake.drafts += fake.rounds
                    for k, r in enumerate(fake.rates):
                        fake.per_pos[k] += round(r * fake.rounds)
                self._send(json.dumps({"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 5}}))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def metrics(self) -> str:
        if self.sglang:
            return "# HELP sglang:spec_accept_length x\nsglang:spec_accept_length 2.5\n"
        lines = [f'vllm:spec_decode_num_drafts_total{{engine="0"}} {self.drafts}',
                 'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9']
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{k}"}} {v}' for k, v in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def measured_export(tmp_path):
    ckpt = _ckpt(tmp_path)
    _with_eval(ckpt, tmp_path)
    return export_draft(ckpt, tmp_path / "out", "vllm", num_speculative_tokens=3)


def _run_cli(*argv) -> int:
    from deepspec.cli import main

    return main(["check", *map(str, argv)])


def test_served_check_exit_codes_against_a_stand_in_server(measured_export, capsys, monkeypatch):
    import deepspec.export.served as served

    monkeypatch.setattr(served.Server, "settled", lambda self: self.counters())  # the stand-in settles at once
    survival = read_contract(measured_export)["splits"]["mine"]["survival"]
    good = _Fake(survival)
    try:
        assert _run_cli(measured_export, "--served", good.url + "/v1") == 0
        out = capsys.readouterr().out
        assert "The served draft matches its contract" in out and "z = 2.94" in out and "band per position" in out
        rep = check_served(measured_export, good.url)
        assert rep.matches and rep.per_split["mine"]["drafts"] == 5 * 40  # 5 prompts x 40 rounds each
    finally:
        good.close()
    bad = _Fake([survival[0], 0.05, 0.0])
    try:
        assert _run_cli(measured_export, "--served", bad.url) == 1
        out = capsys.readouterr().out
        assert "does NOT match its contract: on split 'mine' position 2 first drops" in out
        assert _run_cli(measured_export, "--served", bad.url, "--json") == 1
        js = json.loads(capsys.readouterr().out)
        assert js["matches"] is False and js["first_outside"]["position"] == 2
    finally:
        bad.close()
    other_s = _Fake([0.9, 0.5])
    sglang = _Fake([0.9], sglang=True)
    try:
        assert _run_cli(measured_export, "--served", other_s.url) == 2
        assert 'drafts 2 tokens per round but the contract was measured at S = 3' in capsys.readouterr().out
        assert _run_cli(measured_export, "--served", sglang.url) == 2
        assert "SGLang server" in capsys.readouterr().out
    finally:
        other_s.close()
        sglang.close()
    from deepspec.data.engines.server import free_port

    assert _run_cli(measured_export, "--served", f"http://127.0.0.1:{free_port()}") == 2
    out = capsys.readouterr().out
    assert "Nothing usable answers at" in out and "start the server" in out


def test_served_check_without_a_contract_exits_2(tmp_path, capsys):
    ckpt = _ckpt(tmp_path)
    export = export_draft(ckpt, tmp_path / "out", "vllm")
    (export / CONTRACT_FILE).unlink()
    assert _run_cli(export, "--served", "http://127.0.0.1:9") == 2
    assert f"has no {CONTRACT_FILE}" in capsys.readouterr().out
