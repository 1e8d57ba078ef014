"""The vLLM server wrapper: Prometheus parsing and counter arithmetic (the real server is
exercised by the regeneration, export and quickstart tests)."""

from deepspec.data.engines.server import counters_delta, parse_prometheus, spec_decode_counters

SAMPLE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
"""


def test_parse_and_delta():
    m = parse_prometheus(SAMPLE)
    assert not any("_created" in k for k in m)
    c = spec_decode_counters(m)
    assert c == {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 12.0, "accepted_per_pos": [7.0, 4.0, 1.0]}
    zero = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_pos": []}
    d = counters_delta(zero, c)
    assert d["mean_acceptance_length"] == 1.0 + 12 / 10
    assert d["acceptance_rate_per_pos"] == [0.7, 0.4, 0.1]
    assert counters_delta(c, c)["mean_acceptance_length"] is None
