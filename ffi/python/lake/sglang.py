"""Lake as SGLang's HiCache storage backend (its L3), loaded as the
``dynamic`` backend, zero-copy against SGLang's registered host pool:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "lake",
        "module_path": "lake.sglang", "class_name": "LakeStore",
        "interface_v1": 1, "dp_socket": "...", "mirror": "...",
        "cp_socket": "...", "tenant_key": "<64 hex>"}'

``interface_v1`` makes SGLang call ``batch_get_v1`` / ``batch_set_v1`` with
host indices (zero-copy); the store refuses to start without it. Targets
``HiCacheStorage`` of SGLang's ``mem_cache/hicache_storage.py`` as
recorded in ``tests/fixtures/sglang_hicache_storage.json`` (source and
commit named there). SGLang itself is not installed where this is tested:
without it a stand-in base class with the same name is used, and the
tests drive the store through the calls SGLang's cache controller makes.

Keys: SGLang names each page by a SHA-256 chain over its parent's hash and
its tokens, so a page hash already names its whole prefix. Lake keys it
in a namespace of scheme ``engine_prefix_hash`` (one keyed hash per page,
under the tenant's key), so any run of pages can be keyed wherever it
starts — which is what SGLang's storage calls pass.

The host pool is described from its tensor's shape and strides for every
host layout (``layer_first``, ``page_first``, ``page_first_direct``,
``page_head``; MLA too) and registered with the pool once: a get scatters
each page straight into the host pool, a set gathers it straight into the
pool, in Lake's own payload order, so every layout reads what every other
wrote. Nothing here raises into SGLang's storage threads: a bad call is
logged and answered ``False`` per page (SGLang never restarts those
threads, so an exception would disable L3 for the life of the process).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import numpy as np

import lake
from lake.vllm import _tensor_facts

logger = logging.getLogger("lake.sglang")

try:  # pragma: no cover - exercised only where SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    SGLANG_PRESENT = True
except ImportError:
    SGLANG_PRESENT = False

    class HiCacheStorage:
        """Stand-in with the name and the default hook of SGLang's base."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host


#: Dimension names of SGLang's host KV buffer, by layout (MHA pools have a
#: leading K/V dimension, MLA pools none). "token" is the pool's token index
#: (page * page_size + offset) unless the layout has a "page" dimension.
HOST_DIMENSIONS = {
    False: {
        "layer_first": ("plane", "layer", "token", "head", "dim"),
        "page_first": ("plane", "token", "layer", "head", "dim"),
        "page_first_direct": ("plane", "page", "layer", "token", "head", "dim"),
        "page_head": ("plane", "page", "head", "token", "layer", "dim"),
    },
    True: {
        "layer_first": ("layer", "token", "head", "dim"),
        "page_first": ("token", "layer", "head", "dim"),
        "page_first_direct": ("page", "layer", "token", "head", "dim"),
    },
}


def describe_host_pool(buffer, layout: str, page_size: int, mla: bool):
    """(layers, heads, head_dim, pages, pieces, dtype) of a host KV buffer:
    one piece per (layer, plane) — address of page 0, byte strides of pages,
    tokens and heads — read from the buffer's shape and strides."""
    names = HOST_DIMENSIONS[mla].get(layout)
    if names is None:
        raise ValueError(f"lake.sglang: host layout {layout!r} is not one of {sorted(HOST_DIMENSIONS[mla])}")
    facts = _tensor_facts(buffer)
    if facts.device != "cpu":
        raise ValueError(f"lake.sglang: the host pool is on {facts.device}, not in host memory")
    if len(facts.shape) != len(names):
        raise ValueError(f"lake.sglang: a {layout} host buffer has {len(names)} dimensions, not {facts.shape}")
    size = dict(zip(names, facts.shape))
    stride = {name: s * facts.element_size for name, s in zip(names, facts.stride)}
    if stride["dim"] != facts.element_size:
        raise ValueError(f"lake.sglang: head_dim is not the innermost dimension {facts.stride}")
    if "page" in size:
        if size["token"] != page_size:
            raise ValueError(f"lake.sglang: pages of {size['token']} tokens, the pool says {page_size}")
        pages, page_stride = size["page"], stride["page"]
    else:
        if size["token"] % page_size:
            raise ValueError(f"lake.sglang: {size['token']} tokens are not whole pages of {page_size}")
        pages, page_stride = size["token"] // page_size, stride["token"] * page_size
    planes = 1 if mla else 2
    pieces = []
    for layer in range(size["layer"]):
        for plane in range(planes):
            address = facts.data_ptr + layer * stride["layer"] + (plane * stride["plane"] if planes == 2 else 0)
            pieces.append((address, page_stride, stride["token"], stride["head"] if size["head"] > 1 else 0))
    return size["layer"], size["head"], size["dim"], pages, np.array(pieces, dtype=np.int64), facts.dtype


class LakeStore(HiCacheStorage):
    """The storage backend: ``LakeStore(storage_config, kwargs)``, as
    SGLang's backend factory builds a dynamic backend."""

    def __init__(self, storage_config, kwargs: Any = None):
        extra = lake.pool_settings(getattr(storage_config, "extra_config", None) or {}, "lake.sglang: the extra config")
        if not extra.get("interface_v1"):
            raise ValueError(
                'lake.sglang: set "interface_v1": 1 in the extra config (Lake serves the zero-copy '
                "batch_get_v1 / batch_set_v1 calls only)"
            )
        self.config = storage_config
        self.extra = extra
        self.mla = bool(getattr(storage_config, "is_mla_model", False))
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0))
        self.tp_size = int(getattr(storage_config, "tp_size", 1))
        dcp = int(getattr(storage_config, "dcp_size", 1) or 1)
        if dcp != 1:
            # Each decode-context-parallel rank holds a shard of every
            # page's MLA latent; Lake stores MLA pages whole, alike on every
            # rank.
            raise ValueError(
                f"lake.sglang: decode context parallelism (dcp_size {dcp}) shards MLA pages across ranks:"
                " not served; run SGLang without it"
            )
        self.namespace: lake.Namespace | None = None
        self.pool: lake.Pool | None = None
        self.layout: lake.Layout | None = None
        self.memory_id: int | None = None
        self.page_size = 0
        self.timeout = float(extra.get("timeout_s", 30.0))
        # A prefix other nodes hold is pulled here in batch_exists (SGLang's
        # prefetch thread asks it, off the scheduler's path), where pulls
        # are worth it. Not under tensor parallelism: a pull brings a
        # block, not every rank's shard.
        pull, self.pull_timeout_s, compute_ns = lake.pull_settings(extra, "lake.sglang: the extra config")
        self.pull = pull and self.tp_size == 1
        self.pull_gate = lake.PullGate(compute_ns)

    # ---------------- registration ----------------

    def register_mem_pool_host(self, mem_pool_host):
        """Describes the host pool from its buffer, attaches under the
        layout it makes (this rank's heads) and registers it."""
        super().register_mem_pool_host(mem_pool_host)
        self.page_size = int(mem_pool_host.page_size)
        layers, heads, head_dim, pages, pieces, dtype = describe_host_pool(
            mem_pool_host.kv_buffer, mem_pool_host.layout, self.page_size, self.mla
        )
        model = "|".join(
            str(x)
            for x in (
                getattr(self.config, "model_name", ""),
                self.extra.get("model_revision", ""),
                dtype,
                "mla" if self.mla else "mha",
            )
        )
        self.namespace = lake.Namespace(
            bytes.fromhex(self.extra.get("tenant_key", "00" * 32)),
            self.page_size,
            hashlib.sha256(model.encode()).digest(),
            key_scheme="engine_prefix_hash",
        )
        shard = None if self.mla else (self.tp_rank * heads, (self.tp_rank + 1) * heads)
        self.layout = lake.Layout(
            layers=layers,
            kv_heads=heads if self.mla else heads * self.tp_size,
            head_dim=head_dim,
            dtype=dtype,
            block_tokens=self.page_size,
            planes=1 if self.mla else 2,
            shard=shard,
        )
        self.pool = lake.Pool(
            self.extra["dp_socket"],
            self.extra["mirror"],
            self.namespace,
            cp_socket=self.extra.get("cp_socket"),
            name=f"sglang-{self.tp_rank}",
            layout=self.layout,
        )
        self.memory_id = self.pool.register_kv_memory(self.layout, pages, pieces, keep_alive=mem_pool_host.kv_buffer)
        logger.info("lake.sglang: %s host pool of %d pages registered, %s", mem_pool_host.layout, pages, self.layout)

    # ---------------- the v1 interface ----------------

    def _keys(self, keys) -> np.ndarray:
        if self.namespace is None or self.pool is None:
            raise RuntimeError("register_mem_pool_host was not called (or the store was closed)")
        return self.namespace.page_keys(list(keys))

    def _pages(self, host_indices, count: int) -> np.ndarray:
        indices = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices, dtype=np.int64)
        if indices.ndim != 1 or len(indices) != count * self.page_size:
            raise ValueError(f"{len(indices)} host indices for {count} pages of {self.page_size}")
        firsts = indices[:: self.page_size]
        if (firsts % self.page_size).any():
            raise ValueError("host indices do not start on page boundaries")
        return (firsts // self.page_size).astype(np.uint32)

    def batch_exists(self, keys, extra_info=None) -> int:
        """How many leading pages of ``keys`` the pool holds (read from its
        shared-memory mirror: no round trip). On a node of a cluster, the
        pages past them that other nodes hold are pulled here first, for
        at most ``pull_timeout_s`` (a page that left its holder ends the
        run there), unless the pull gate is shut (a pulled page, as
        measured here, costs more than computing one)."""
        if not keys:
            return 0
        try:
            lake_keys = self._keys(keys)
            hits, _ = self.pool.lookup(lake_keys)
            if self.pull and hits < len(lake_keys) and not self.pull_gate.shut(time.monotonic()):
                held, _ = self.pool.lookup_cluster(lake_keys)
                if held > hits:
                    started = time.monotonic()
                    landed = self.pool.pull(lake_keys[:held], timeout_s=self.pull_timeout_s)
                    now = time.monotonic()
                    self.pull_gate.measured(now, now - started, landed - hits)
                    hits = landed
            return int(hits)
        except Exception as error:  # never into SGLang's threads
            logger.error("lake.sglang: batch_exists failed: %s", error)
            return 0

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Loads the leading run of ``keys`` that the pool holds into the
        host pool's pages at ``host_indices``; one bool per key."""
        results = [False] * len(keys)
        if not keys:
            return results
        try:
            lake_keys = self._keys(keys)
            pages = self._pages(host_indices, len(keys))
            hits, table = self.pool.lookup(lake_keys)
            if hits == 0:
                return results
            request = self.pool.submit_load(self.memory_id, lake_keys[:hits], table, pages[:hits])
            statuses = self.pool.wait(request, hits, timeout=self.timeout)
            for i, status in enumerate(statuses):
                results[i] = bool(status == lake.OK)
        except Exception as error:
            logger.error("lake.sglang: batch_get_v1 of %d pages failed: %s", len(keys), error)
        return results

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Saves the pages at ``host_indices`` as ``keys``; pages the pool
        already holds are not written again. One bool per key."""
        results = [False] * len(keys)
        if not keys:
            return results
        try:
            lake_keys = self._keys(keys)
            pages = self._pages(host_indices, len(keys))
            held, _ = self.pool.lookup(lake_keys)
            for i in range(held):
                results[i] = True
            if held == len(keys):
                return results
            prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
            if held > 0:
                parent = lake_keys[held - 1]
            elif prefix:
                parent = self._keys([prefix[-1]])[0]
            else:
                parent = None
            request = self.pool.submit_save(self.memory_id, lake_keys[held:], pages[held:], parent=parent)
            statuses = self.pool.wait(request, len(keys) - held, timeout=self.timeout)
            for i, status in enumerate(statuses):
                results[held + i] = bool(status == lake.OK)
        except Exception as error:
            logger.error("lake.sglang: batch_set_v1 of %d pages failed: %s", len(keys), error)
        return results

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # The copying interface SGLang uses without interface_v1: refused (the
    # constructor already insists on v1), loudly rather than with None.
    def get(self, key, target_location=None, target_sizes=None):
        raise NotImplementedError("lake.sglang serves the zero-copy v1 interface only")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        raise NotImplementedError("lake.sglang serves the zero-copy v1 interface only")

    def set(self, key, value=None, target_location=None, target_sizes=None):
        raise NotImplementedError("lake.sglang serves the zero-copy v1 interface only")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        raise NotImplementedError("lake.sglang serves the zero-copy v1 interface only")

    def clear(self) -> None:
        """The pool is shared by every instance: one instance does not wipe
        it. Logged, nothing else."""
        logger.warning("lake.sglang: clear() ignored: the pool is shared; evict through lake-cp")

    def get_stats(self):
        return None if self.pool is None else self.pool.stats()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
