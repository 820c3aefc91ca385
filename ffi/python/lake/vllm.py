"""Lake as a vLLM KV connector (V1), loadable out of tree:

    --kv-transfer-config '{"kv_connector": "LakeConnector",
        "kv_connector_module_path": "lake.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"dp_socket": "...", "mirror": "...",
                                      "cp_socket": "...", "tenant_key": "<64 hex>",
                                      "trace_every": 0}}'

Targets the connector interface of vLLM's ``kv_connector/v1/base.py`` as
recorded in ``tests/fixtures/vllm_kv_connector_v1.json`` (the source and
commit are named there); optional hooks are feature-detected. vLLM itself
is not installed on the machines that test this: without it, stand-in
base classes with the same names are used, and the tests drive the
connector through the call sequence vLLM's scheduler and workers make.

Worker side: the paged KV tensors are described from their shapes and
strides (one piece per layer and plane) and registered with the pool once;
loads scatter each block's payload straight into the engine's blocks and
saves gather it straight into the pool, on the agent's thread. A block's
stored object holds every layer, so the first layer's
``wait_for_layer_load`` waits for the step's loads and saves go at
``wait_for_save``; vLLM keeps the saved blocks until ``get_finished``
reports them. Host-memory KV caches (vLLM's CPU backend, numpy or torch
CPU tensors) are copied by the agent; CUDA KV caches are moved by Lake's
kernels (gather and scatter across the bus, segment CRCs on the GPU).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import lake

logger = logging.getLogger("lake.vllm")

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    VLLM_PRESENT = True
except ImportError:
    VLLM_PRESENT = False
    import enum

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class SupportsHMA:
        pass

    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config
            self._role = role
            self._kv_cache_config = kv_cache_config
            self._connector_metadata = None

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None


@dataclass
class LoadSpec:
    """Blocks to load for one request: their keys and the vLLM block ids
    they go to. Each worker looks the keys up itself: under tensor
    parallelism every rank reads its own shard's replicas."""

    request_id: str
    keys: np.ndarray
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Blocks to save when a request finishes."""

    request_id: str
    keys: np.ndarray
    block_ids: list[int]
    # The block the first of them continues (the cached prefix's last), or
    # None for a prompt's first block.
    parent: np.ndarray | None = None


@dataclass
class LakeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler ships to the workers each step (picklable)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(frozen=True)
class PagedLayout:
    """One layer's paged KV tensor, described from its shape and strides
    (never assumed): ``kind`` is ``"kv_first"`` for ``(2, blocks, ...)``,
    ``"blocks_first"`` for ``(blocks, 2, ...)``, ``"mla"`` for
    ``(blocks, block_size, head_size)``; ``order`` is ``"NHD"`` or
    ``"HND"`` for the per-block token/head order in memory."""

    kind: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_size: int
    order: str
    element_size: int

    @property
    def bytes_per_block(self) -> int:
        planes = 1 if self.kind == "mla" else 2
        return planes * self.block_size * self.kv_heads * self.head_size * self.element_size


def describe_layout(shape, stride, element_size: int, block_size: int) -> PagedLayout:
    """Describes a vLLM paged KV tensor from its shape and strides.

    The logical shape names the dimensions; the strides say how they lie in
    memory (vLLM permutes a physically HND tensor to the logical NHD shape).
    """
    shape, stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)
    if len(shape) != len(stride):
        raise ValueError(f"shape {shape} and stride {stride} differ in rank")
    if len(shape) == 3:
        blocks, tokens, head = shape
        if tokens != block_size:
            raise ValueError(f"MLA tensor {shape}: dimension 1 is not the block size {block_size}")
        return PagedLayout("mla", blocks, tokens, 1, head, "NHD", element_size)
    if len(shape) != 5:
        raise ValueError(f"a paged KV tensor has rank 3 (MLA) or 5, not {len(shape)}: {shape}")
    if shape[0] == 2 and shape[2] == block_size:
        kind, blocks, tokens, heads, head = "kv_first", shape[1], shape[2], shape[3], shape[4]
        token_stride, head_stride = stride[2], stride[3]
    elif shape[1] == 2 and shape[2] == block_size:
        kind, blocks, tokens, heads, head = "blocks_first", shape[0], shape[2], shape[3], shape[4]
        token_stride, head_stride = stride[2], stride[3]
    else:
        raise ValueError(f"cannot tell the K/V dimension of {shape} with block size {block_size}")
    order = "NHD" if token_stride >= head_stride else "HND"
    return PagedLayout(kind, blocks, tokens, heads, head, order, element_size)


def _extra(vllm_config) -> dict[str, Any]:
    config = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(config, "kv_connector_extra_config", None) or {}
    for name in ("dp_socket", "mirror"):
        if name not in extra:
            raise ValueError(f"kv_connector_extra_config needs {name!r} (the pool to attach to)")
    return extra


def _model_fingerprint(vllm_config) -> bytes:
    model = getattr(vllm_config, "model_config", None)
    identity = "|".join(
        str(getattr(model, name, ""))
        for name in ("model", "revision", "tokenizer", "tokenizer_revision", "dtype")
    )
    cache = getattr(vllm_config, "cache_config", None)
    identity += "|kv:" + str(getattr(cache, "cache_dtype", ""))
    return hashlib.sha256(identity.encode()).digest()


class LakeConnector(KVConnectorBase_V1, SupportsHMA):
    """The connector. One instance per role: the scheduler's plans, the
    workers' move bytes."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = _extra(vllm_config)
        self.block_size = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 16))
        tenant = bytes.fromhex(extra.get("tenant_key", "00" * 32))
        self.namespace = lake.Namespace(tenant, self.block_size, _model_fingerprint(vllm_config))
        self._extra = extra
        self._vllm_config = vllm_config
        self.pool = None
        # The shard codes of every tensor-parallel rank (None: the ranks
        # hold the whole block alike — one rank, or MLA).
        self._shards: list[int] | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Lookups only: no layout of its own; a hit must hold for the
            # shard of every rank.
            self._shards = _group_shard_codes(vllm_config, extra)
            self.pool = self._attach(None, "vllm-scheduler")
        self._loads: dict[str, LoadSpec] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_saves: list[SaveSpec] = []
        self._saving: set[str] = set()
        self._load_errors: set[int] = set()
        self.layouts: dict[str, PagedLayout] = {}
        self.layout: lake.Layout | None = None
        self.memory_id: int | None = None
        # Load request id -> the vLLM block ids it fills; save request id ->
        # (the vLLM request it belongs to, its block count).
        self._loading: dict[int, np.ndarray] = {}
        self._saves: dict[int, tuple[str, int]] = {}
        # Layer name -> its index in the registered memory; whether the
        # caches are on a GPU (then loads are waited for layer by layer).
        self._layer_index: dict[str, int] = {}
        self._on_gpu = False
        # Trace one request in `trace_every` (0: none): its loads carry a
        # trace id made from its vLLM request id, the data plane logs them
        # under it, and one line here says what they took.
        self._trace_every = int(extra.get("trace_every", 0))
        if self._trace_every < 0:
            raise ValueError("kv_connector_extra_config['trace_every'] is 0 (none) or N (one request in N)")
        self._traced: dict[int, str] = {}

    def _attach(self, layout, name):
        return lake.Pool(
            self._extra["dp_socket"],
            self._extra["mirror"],
            self.namespace,
            cp_socket=self._extra.get("cp_socket"),
            name=name,
            layout=layout,
        )

    # ---------------- scheduler side ----------------

    def _prompt_keys(self, request) -> np.ndarray:
        tokens = np.asarray(request.prompt_token_ids, dtype=np.uint32)
        full = (len(tokens) // self.block_size) * self.block_size
        return self.namespace.keys(tokens[:full])

    def _hits(self, keys) -> int:
        """The cached prefix every rank can load (its own heads' replicas)."""
        if self._shards is None:
            return self.pool.lookup(keys)[0]
        return self.pool.lookup_shards(keys, self._shards)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens Lake can supply beyond vLLM's own prefix hit, read from
        the mirror: no pin, no lease, no state kept (it may be asked again)."""
        keys = self._prompt_keys(request)
        if len(keys) == 0:
            return 0, False
        hits = self._hits(keys)
        matched = hits * self.block_size
        # vLLM must compute at least the last prompt token itself.
        prompt = len(request.prompt_token_ids)
        if matched >= prompt:
            matched = ((prompt - 1) // self.block_size) * self.block_size
        extra = max(0, matched - num_computed_tokens)
        return extra, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Plans the load into the blocks vLLM allocated (decided by the
        token count, not by whether ``blocks`` is empty)."""
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0] if hasattr(blocks, "get_block_ids") else list(blocks)
        keys = self._prompt_keys(request)
        hits = self._hits(keys)
        first = (request.num_computed_tokens if hasattr(request, "num_computed_tokens") else 0) // self.block_size
        count = num_external_tokens // self.block_size
        last = min(first + count, hits)
        if last <= first:
            return
        spec = LoadSpec(request.request_id, keys[first:last], list(block_ids[first:last]))
        self._loads[request.request_id] = spec
        self._pending_loads.append(spec)

    def build_connector_meta(self, scheduler_output) -> LakeConnectorMetadata:
        """This step's loads and saves, shipped to the workers; resets."""
        meta = LakeConnectorMetadata(loads=self._pending_loads, saves=self._pending_saves)
        self._pending_loads, self._pending_saves = [], []
        return meta

    def update_connector_output(self, connector_output):
        finished = getattr(connector_output, "finished_sending", None) or set()
        self._saving.difference_update(finished)

    def request_finished(self, request, block_ids):
        """Saves the request's publishable full blocks past the prefix the
        pool holds already (every rank's shard of it: it is not written
        again); vLLM keeps them until a worker reports the save in
        ``get_finished``."""
        self._loads.pop(request.request_id, None)
        tokens = np.asarray(getattr(request, "all_token_ids", request.prompt_token_ids), dtype=np.uint32)
        publishable = getattr(request, "num_publishable_block_hashes", None)
        full = len(tokens) // self.block_size
        if publishable is not None:
            full = min(full, int(publishable))
        full = min(full, len(block_ids))
        if full == 0:
            return False, None
        keys = self.namespace.keys(tokens[: full * self.block_size])
        cached = min(self._hits(keys), full) if self.pool is not None else 0
        if cached == full:
            return False, None
        parent = keys[cached - 1] if cached > 0 else None
        self._pending_saves.append(SaveSpec(request.request_id, keys[cached:], list(block_ids[cached:full]), parent))
        self._saving.add(request.request_id)
        return True, None

    def request_finished_all_groups(self, request, block_ids):
        """HMA: the attention group's blocks are the ones Lake stores."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        # Layer-wise waits and saves cannot run inside a full CUDA graph.
        return True

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches):
        """Describes every layer's paged tensor from its shape and strides,
        attaches with the layout they make (this rank's shard), and
        registers them with the pool as one engine memory."""
        names = list(kv_caches)
        if not names:
            raise ValueError("lake.vllm: no KV caches to register")
        self._layer_index = {name: i for i, name in enumerate(names)}
        facts = [_tensor_facts(kv_caches[name]) for name in names]
        devices = {(f.device, f.device_index) for f in facts}
        if len(devices) != 1:
            raise ValueError(f"lake.vllm: the layers live on several devices: {sorted(devices)}")
        device_type, device_index = devices.pop()
        self._on_gpu = device_type == "cuda"
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"lake.vllm: KV caches on {device_type} are not served (CPU or CUDA)")
        for name, f in zip(names, facts):
            if f.stride[-1] != 1:
                raise ValueError(f"lake.vllm: layer {name}: head_size is not the innermost dimension {f.stride}")
            self.layouts[name] = describe_layout(f.shape, f.stride, f.element_size, self.block_size)
        first = self.layouts[names[0]]
        geometry = lambda l: (l.kind, l.num_blocks, l.block_size, l.kv_heads, l.head_size, l.element_size)  # noqa: E731
        for name in names[1:]:
            if geometry(self.layouts[name]) != geometry(first):
                raise ValueError(f"lake.vllm: layer {name} differs from {names[0]}: {self.layouts[name]} vs {first}")
        if len({f.dtype for f in facts}) != 1:
            raise ValueError("lake.vllm: the layers' dtypes differ")
        mla = first.kind == "mla"
        rank, size = _tensor_parallel(self._vllm_config, self._extra)
        shard = None if mla else (rank * first.kv_heads, (rank + 1) * first.kv_heads)
        self.layout = lake.Layout(
            layers=len(names),
            kv_heads=first.kv_heads if mla else first.kv_heads * size,
            head_dim=first.head_size,
            dtype=facts[0].dtype,
            block_tokens=self.block_size,
            planes=1 if mla else 2,
            shard=shard,
        )
        pieces = []
        for f, l in zip(facts, (self.layouts[n] for n in names)):
            s, e, base = f.stride, f.element_size, f.data_ptr
            if l.kind == "kv_first":
                pieces += [(base + p * s[0] * e, s[1] * e, s[2] * e, s[3] * e) for p in (0, 1)]
            elif l.kind == "blocks_first":
                pieces += [(base + p * s[1] * e, s[0] * e, s[2] * e, s[3] * e) for p in (0, 1)]
            else:
                pieces.append((base, s[0] * e, s[1] * e, 0))
        self.pool = self._attach(self.layout, f"vllm-worker-{rank}")
        self.memory_id = self.pool.register_kv_memory(
            self.layout,
            first.num_blocks,
            np.array(pieces, dtype=np.int64),
            keep_alive=dict(kv_caches),
            device=device_index if device_type == "cuda" else None,
        )
        logger.info("lake.vllm: %d layers registered, %s", len(names), self.layout)

    def _worker(self):
        if self.pool is None or self.memory_id is None:
            raise RuntimeError("lake.vllm: register_kv_caches was not called on this worker")
        return self.pool

    def start_load_kv(self, forward_context, **kwargs):
        """Submits this step's loads; they run on the agent's thread while
        the engine goes on."""
        meta = self._connector_metadata
        if meta is None or not meta.loads:
            return
        pool = self._worker()
        for spec in meta.loads:
            # This rank's own replicas (its shard); what went since the
            # scheduler planned is reported and recomputed.
            hits, table = pool.lookup(spec.keys)
            block_ids = np.asarray(spec.block_ids, dtype=np.int64)
            if hits < len(block_ids):
                self._load_errors.update(int(b) for b in block_ids[hits:])
                logger.warning(
                    "lake.vllm: %d of %d planned blocks are no longer cached for this rank; vLLM recomputes them",
                    len(block_ids) - hits,
                    len(block_ids),
                )
            if hits == 0:
                continue
            trace = self._trace_of(spec.request_id)
            if trace:
                lake.set_trace(trace)
            try:
                request = pool.submit_load(self.memory_id, spec.keys[:hits], table, block_ids[:hits])
            finally:
                if trace:
                    lake.set_trace(0)
            self._loading[request] = block_ids[:hits]

    def _trace_of(self, request_id: str) -> int:
        """The trace id of a vLLM request if it is sampled (one in
        ``trace_every``, by its id: the same on every rank), else 0."""
        if self._trace_every == 0:
            return 0
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        trace = int.from_bytes(digest, "little") or 1
        if trace % self._trace_every != 0:
            return 0
        if trace not in self._traced:
            logger.info("lake.vllm: request %s traced as %016x", request_id, trace)
            if len(self._traced) >= 1024:
                # A traced request whose loads were all L1 hits leaves no
                # span: the oldest such goes.
                self._traced.pop(next(iter(self._traced)))
            self._traced[trace] = request_id
        return trace

    def _log_traces(self):
        """One line per traced request whose loads came back: its blocks
        loaded from L2 and L3, what the agent waited and what the data
        plane took (its log has a line per block under the same id)."""
        if not self._traced:
            return
        spans = self._worker().trace_spans()
        spans = spans[spans["op"] == lake.SPAN_LOAD]
        for trace in sorted(set(int(t) for t in spans["trace"])):
            mine = spans[spans["trace"] == trace]
            # A try refused for want of an L1 slot and retried is a span
            # of its own: blocks are counted once, tries apart.
            blocks = {bytes(k) for k in mine["key"]}
            loaded = {bytes(k) for k in mine[mine["status"] == lake.OK]["key"]}
            logger.info(
                "lake.vllm: request %s (trace %016x): %d blocks from L2/L3, %d not loaded, %d tries, "
                "agent waited %.3f ms, data plane %.3f ms",
                self._traced.pop(trace, "?"),
                trace,
                len(loaded),
                len(blocks - loaded),
                len(mine),
                float(mine["took_ns"].sum()) / 1e6,
                float(mine["data_plane_us"].sum()) / 1e3,
            )

    def wait_for_layer_load(self, layer_name):
        """On a GPU, the current CUDA stream waits (on the GPU, the host
        goes on) until this layer of every load of the step has landed; the
        last layer also collects the loads' completions. Elsewhere (or for a
        layer name not registered) the first call waits for every load: a
        block's object holds every layer. A failed block's vLLM id is kept
        for ``get_block_ids_with_load_errors`` (vLLM then recomputes it)."""
        if not self._loading:
            return
        layer = self._layer_index.get(layer_name)
        if self._on_gpu and layer is not None:
            import torch

            stream = torch.cuda.current_stream().cuda_stream
            pool = self._worker()
            for request in self._loading:
                pool.wait_layer(request, layer, stream)
            if layer < len(self._layer_index) - 1:
                return
        self._collect_loads()

    def _collect_loads(self):
        """Waits for the step's loads' completions; failed blocks are kept
        for ``get_block_ids_with_load_errors``."""
        if not self._loading:
            return
        pool = self._worker()
        for request, block_ids in self._loading.items():
            statuses = pool.wait(request, len(block_ids), timeout=30.0)
            failed = statuses != lake.OK
            if failed.any():
                self._load_errors.update(int(b) for b in block_ids[failed])
                logger.warning(
                    "lake.vllm: %d of %d blocks not loaded (%s); vLLM recomputes them",
                    int(failed.sum()),
                    len(block_ids),
                    ", ".join(sorted({lake.STATUS.get(int(x), str(x)) for x in statuses[failed]})),
                )
        self._loading.clear()
        self._log_traces()

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing per layer: a block is saved whole (every layer in one
        object) at ``wait_for_save``, gathered straight from the tensors."""
        return None

    def wait_for_save(self):
        """Submits the saves of requests that finished; does not wait: vLLM
        keeps their blocks until ``get_finished`` reports them."""
        # Loads whose last layer was never waited for are settled here, at
        # the end of the forward pass, before vLLM asks for load errors.
        self._collect_loads()
        meta = self._connector_metadata
        if meta is None or not meta.saves:
            return
        pool = self._worker()
        # On a GPU the saves' reads wait, on the GPU, for what this step
        # queued on the current stream (the forward that wrote the blocks).
        stream = None
        if self._on_gpu:
            import torch

            stream = torch.cuda.current_stream().cuda_stream
        for spec in meta.saves:
            request = pool.submit_save(self.memory_id, spec.keys, spec.block_ids, parent=spec.parent, stream=stream)
            self._saves[request] = (spec.request_id, len(spec.block_ids))

    def get_finished(self, finished_req_ids):
        """(requests whose saves completed, None): loads are synchronous."""
        if not self._saves:
            return None, None
        pool = self._worker()
        done = set()
        for request, (request_id, count) in list(self._saves.items()):
            statuses = pool.try_wait(request, count)
            if statuses is None:
                continue
            skipped = int((statuses != lake.OK).sum())
            if skipped:
                logger.info("lake.vllm: %d blocks of a save were skipped (pool full)", skipped)
            del self._saves[request]
            done.add(request_id)
        return (done or None), None

    def get_block_ids_with_load_errors(self):
        self._collect_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        if self.pool is not None:
            self.pool.close()


@dataclass(frozen=True)
class _TensorFacts:
    shape: tuple
    stride: tuple
    element_size: int
    data_ptr: int
    dtype: str
    device: str
    device_index: int = 0


def _tensor_facts(tensor) -> _TensorFacts:
    """Shape, element strides, element size, address, dtype and device of a
    torch tensor or a numpy array (the tests' host tensors)."""
    if hasattr(tensor, "data_ptr") and hasattr(tensor, "stride"):
        return _TensorFacts(
            tuple(int(s) for s in tensor.shape),
            tuple(int(s) for s in tensor.stride()),
            int(tensor.element_size()),
            int(tensor.data_ptr()),
            str(tensor.dtype).replace("torch.", ""),
            str(tensor.device.type),
            int(tensor.device.index or 0),
        )
    if isinstance(tensor, np.ndarray):
        item = tensor.itemsize
        if any(s % item for s in tensor.strides):
            raise ValueError(f"strides {tensor.strides} are not whole elements")
        return _TensorFacts(
            tensor.shape, tuple(s // item for s in tensor.strides), item, tensor.ctypes.data, tensor.dtype.name, "cpu"
        )
    raise TypeError(f"lake.vllm: a KV cache must be a torch tensor or numpy array, not {type(tensor).__name__}")


def _group_shard_codes(vllm_config, extra) -> list[int] | None:
    """The shard code of every rank of the tensor-parallel group, as its
    worker's layout will have it (``register_kv_caches``: each rank holds
    ``max(1, total // size)`` heads of a layout of that many times ``size``);
    None where every rank holds the whole block (one rank, or MLA)."""
    size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    model = getattr(vllm_config, "model_config", None)
    if size == 1 or getattr(model, "use_mla", False):
        return None
    total = extra.get("kv_heads")
    if total is None and hasattr(model, "get_total_num_kv_heads"):
        total = model.get_total_num_kv_heads()
    if total is None:
        raise ValueError(
            "lake.vllm: tensor parallelism needs the model's KV head count: model_config.get_total_num_kv_heads()"
            " or kv_connector_extra_config['kv_heads']"
        )
    per_rank = max(1, int(total) // size)
    return [lake.shard_code(per_rank * size, r * per_rank, (r + 1) * per_rank) for r in range(size)]


def _tensor_parallel(vllm_config, extra) -> tuple[int, int]:
    """This worker's tensor-parallel (rank, size)."""
    size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    try:  # pragma: no cover - only where vLLM is installed
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception:
        rank = int(extra.get("tp_rank", 0))
    if not 0 <= rank < size:
        raise ValueError(f"lake.vllm: tensor-parallel rank {rank} is outside size {size}")
    return rank, size
