"""Checks a cache build makes before it loads a target: its size against the free disk / cache.max_gb, target.device_map
with several workers, and the vLLM internals the capture connector relies on."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest

from deepspec.config import config_from_dict
from deepspec.data.cache import format as fmt
from deepspec.data.cache import guards
from deepspec.errors import CacheError, ConfigError, EngineError

WORDS = "the cat sat on a mat and then it ran far away to find some food".split()


def write_conversations(path: Path, n: int) -> None:
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            conv = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=6))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 30)))}]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")


def make_cfg(root: Path, target_dir: Path, **cache):
    write_conversations(root / "data" / "regenerated.jsonl", 6)
    return config_from_dict({
        "target": {"name": str(target_dir)},
        "data": {"dir": str(root / "data")},
        "cache": {"dir": str(root / "cache"), "shard_bytes": 20_000, "batch_tokens": 512, "max_length": 128, **cache},
    })


@pytest.fixture
def no_target_load(monkeypatch):
    """A guard must stop the build before any target is loaded."""
    import deepspec.targets

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the guard stopped the build")

    monkeypatch.setattr(deepspec.targets, "load_target_from_config", refuse)
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")


# ---------------------------------------------------------------------------------- size before you spend


def test_build_over_max_gb_stops_with_one_sentence_and_writes_nothing(tmp_path, tiny_llama_dir, no_target_load):
    from deepspec.data.cache.writer import build_cache

    cfg = make_cfg(tmp_path, tiny_llama_dir, max_gb=1e-6)  # 1,000 bytes
    with pytest.raises(CacheError) as e:
        build_cache(cfg, "train")
    msg = str(e.value)
    assert "The train cache needs" in msg and "cache.max_gb is 1e-06" in msg and "bytes/token in bf16" in msg
    assert "cache.dtype=fp8" in msg and "cache.max_length" in msg and "cache.mode=stream" in msg and "cache.mode=online" in msg
    assert msg.count(". ") == 0 and msg.endswith(".")  # one sentence
    assert not (tmp_path / "cache" / "train").exists()


def test_build_over_free_disk_stops_and_fp8_is_not_offered_twice(tmp_path, tiny_llama_dir, no_target_load, monkeypatch):
    from deepspec.data.cache.writer import build_cache

    monkeypatch.setattr(guards, "free_bytes", lambda path: 5_000)
    cfg = make_cfg(tmp_path, tiny_llama_dir, dtype="fp8")
    with pytest.raises(CacheError, match=r"but only 5e-06 GB are free at .*cache/train, so it stopped before loading the target") as e:
        build_cache(cfg, "train")
    assert "cache.dtype=fp8" not in str(e.value) and "cache.mode=online" in str(e.value)
    assert not (tmp_path / "cache" / "train").exists()


def test_build_under_the_limit_proceeds(tmp_path, tiny_llama_dir, monkeypatch, one_torch_thread):
    from deepspec.data.cache.plan import estimate, plan_split
    from deepspec.data.cache.writer import build_cache

    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    cfg = make_cfg(tmp_path, tiny_llama_dir)
    need = estimate(plan_split(cfg, "train"))["bytes"]
    cfg.cache.max_gb = need * 1.01 / guards.GB
    d = build_cache(cfg, "train")
    assert fmt.is_complete(d) and fmt.load_manifest(d)["bytes"] == need


def test_resumed_build_counts_only_what_is_left(tmp_path, tiny_llama_dir):
    from deepspec.data.cache.plan import plan_split

    cfg = make_cfg(tmp_path, tiny_llama_dir)
    plan = plan_split(cfg, "train")
    assert len(plan.shards) >= 2
    d = tmp_path / "cache" / "train"
    d.mkdir(parents=True)
    # shard 0 complete (the writer's own test of completeness: index file + .bin of the planned size)
    (d / fmt.shard_name(0)).write_bytes(b"\0" * plan.shard_bytes(0))
    np.save(d / "shard_00000.idx.npy", np.zeros(1, dtype=fmt.INDEX_DTYPE))
    left = plan.total_bytes - plan.shard_bytes(0)
    assert guards.remaining_bytes(d, plan) == left
    cfg.cache.max_gb = (left + 1) / guards.GB  # the whole cache would not fit, what is left does
    assert guards.check_size(d, plan, cfg) == left
    cfg.cache.max_gb = (left - 1) / guards.GB
    with pytest.raises(CacheError, match="more"):
        guards.check_size(d, plan, cfg)


def test_max_gb_must_be_positive(tmp_path, tiny_llama_dir):
    with pytest.raises(ConfigError, match="cache.max_gb=0"):
        make_cfg(tmp_path, tiny_llama_dir, max_gb=0)


# ---------------------------------------------------------------------------------- device_map and several workers


@pytest.mark.parametrize("how", ["nproc", "num_workers", "torchrun"])
def test_device_map_with_several_workers_is_refused(tmp_path, tiny_llama_dir, no_target_load, monkeypatch, how):
    from deepspec.data.cache.writer import build_cache

    cfg = make_cfg(tmp_path, tiny_llama_dir, num_workers=2 if how == "num_workers" else 1)
    cfg.target.device_map = "auto"
    if how == "torchrun":  # what each rank of scripts/data/cache.sh sees: refused before any barrier
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match=r"target.device_map=auto spreads one copy .* starts 2 workers .* run one process instead "
                                          r"\(`bash scripts/data/cache.sh CONFIG --nproc 1`"):
        build_cache(cfg, "train", nproc=2 if how == "nproc" else None)
    assert not (tmp_path / "cache" / "train").exists()


def test_device_map_with_one_worker_or_no_device_map_passes(tmp_path, tiny_llama_dir):
    cfg = make_cfg(tmp_path, tiny_llama_dir)
    guards.check_workers(cfg, 8)  # no device_map: one whole target per worker is what device_map=null means
    cfg.target.device_map = "auto"
    guards.check_workers(cfg, 1)


# ---------------------------------------------------------------------------------- vLLM internals


def test_installed_vllm_has_every_internal_the_connector_uses():
    """Fails on a vLLM upgrade that renames what deepspec/data/cache/vllm_connector.py relies on, naming it."""
    pytest.importorskip("vllm")
    from deepspec.data.cache.vllm_internals import missing_vllm_internals

    missing = missing_vllm_internals()
    assert not missing, f"vLLM no longer has these internals the capture connector uses: {missing}"


FAKE_CONNECTOR = '''
from dataclasses import dataclass, field

def extract_from_kv_cache(kv_cache, slot_mapping, num_tokens):
    pass

@dataclass
class PendingSave:
    req_id: str
    filename: str
    token_ids: object
    block_ids: list

@dataclass
class ExampleHiddenStatesConnectorMetadata:
    pending_saves: list = field(default_factory=list)

class ExampleHiddenStatesConnector:
    def __init__(self, vllm_config, role, kv_cache_config):
        self._block_size = 16
        self._kv_cache = None
        self._is_tp_rank_zero: bool = True
        self._lock_fds = {}
        self._req_copy_events = {}
        self._accumulated_finished_req_ids = set()

    def has_connector_metadata(self):
        pass

    def _get_connector_metadata(self):
        pass

    def wait_for_save(self):
        lock_path = filename + ".lock"

    def request_finished(self, request, block_ids):
        return True, {"hidden_states_path": filename}

    def _submit_async_write(self, pending):
        pass

    def get_finished(self, finished_req_ids):
        pass
'''


def _fake_module(tmp_path: Path, source: str):
    path = tmp_path / "fake_vllm_connector.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fake_vllm_connector", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_renamed_vllm_internals_are_named_in_one_error(tmp_path):
    from deepspec.data.cache.vllm_internals import check_vllm_internals, missing_vllm_internals

    assert missing_vllm_internals(_fake_module(tmp_path, FAKE_CONNECTOR)) == []
    renamed = (FAKE_CONNECTOR.replace("self._lock_fds = {}", "self._lock_files = {}")
               .replace("def _submit_async_write(self, pending)", "def _submit_write(self, pending)")
               .replace("def get_finished(self, finished_req_ids)", "def get_finished(self, finished_req_ids, extra)")
               .replace('"hidden_states_path"', '"path"')
               .replace("    block_ids: list\n", ""))
    with pytest.raises(EngineError) as e:
        check_vllm_internals(_fake_module(tmp_path, renamed))
    msg = str(e.value)
    for name in ("ExampleHiddenStatesConnector._lock_fds", "ExampleHiddenStatesConnector._submit_async_write",
                 "ExampleHiddenStatesConnector.get_finished", '"hidden_states_path"', "PendingSave.block_ids"):
        assert name in msg, (name, msg)
    assert "cache.capture_backend=hf" in msg


def test_connector_instance_without_the_attributes_is_refused():
    from deepspec.data.cache.vllm_internals import check_connector_instance

    with pytest.raises(EngineError, match=r"_lock_fds \(not set by its __init__\)"):
        check_connector_instance(object())


@pytest.mark.parametrize("cuda", [True, False])
def test_capture_engine_arguments_pick_vllms_async_connector_on_a_gpu_and_ours_on_cpu(tmp_path, cuda):
    """vLLM resolves the capture's connector to its own asynchronous class on a GPU (pinned copies on a side stream,
    a writer thread pool) and to our synchronous subclass on CPU builds; every key is one vLLM's engine accepts."""
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as vllm_connector
    from vllm.engine.arg_utils import EngineArgs

    from deepspec.data.cache.vllm_capture import engine_kwargs

    kwargs = engine_kwargs("/targets/t", [2, 15, 28, 30], tmp_path, cuda=cuda, dtype="bfloat16", max_model_len=4104,
                           batch_tokens=65536)
    assert set(kwargs) <= {f.name for f in dataclasses.fields(EngineArgs)}, set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)}
    transfer = KVTransferConfig(**kwargs["kv_transfer_config"])
    cls = KVConnectorFactory.get_connector_class(transfer)
    assert transfer.get_from_extra_config("shared_storage_path", None) == str(tmp_path)
    assert kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 28, 30]
    if cuda:
        assert cls is vllm_connector.ExampleHiddenStatesConnector
        assert kwargs["max_num_batched_tokens"] == 65536  # one engine step prefills a whole capture call
    else:
        from deepspec.data.cache.vllm_connector import SyncHiddenStatesConnector

        assert cls is SyncHiddenStatesConnector and issubclass(cls, vllm_connector.ExampleHiddenStatesConnector)
        assert "max_num_batched_tokens" not in kwargs and kwargs["kv_cache_memory_bytes"] == 1 << 30
