"""A vLLM KV connector that writes `extract_hidden_states` captures synchronously (works on CPU).

vLLM's `ExampleHiddenStatesConnector` copies states to pinned host memory on a CUDA stream
and writes them from a thread pool, which fails on CPU builds (`pin_memory=True requires a
CUDA backend`). This subclass gathers the captured rows from the hidden-state cache and writes
the file in place (tmp + rename), then reports the request as done; vLLM loads it by module
path (`kv_connector_module_path`), so this module is imported only inside vLLM's workers.

It reuses private members of vLLM's class (listed and checked in deepspec/data/cache/vllm_internals.py): the
module refuses to load, and the connector to start, with one error naming whatever a vLLM release renamed.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _base

from deepspec.data.cache.vllm_internals import check_connector_instance, check_vllm_internals

check_vllm_internals(_base)
ExampleHiddenStatesConnector = _base.ExampleHiddenStatesConnector
extract_from_kv_cache = _base.extract_from_kv_cache


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_connector_instance(self)

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        slots = slots.to(self._kv_cache.device)
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).to("cpu").contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tmp = pending.filename + ".tmp"
        save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp)
        os.replace(tmp, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # readers waiting on the lock may go now
        self._req_copy_events[pending.req_id] = None  # written: nothing left in flight

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, _base.ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._accumulated_finished_req_ids):
            if req_id in self._req_copy_events:
                self._req_copy_events.pop(req_id)
                done.add(req_id)
            self._accumulated_finished_req_ids.discard(req_id)
            lock_fd = self._lock_fds.pop(req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)
        return done or None, None
