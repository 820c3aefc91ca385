"""Lake as a vLLM KV connector (V1), loadable out of tree:

    --kv-transfer-config '{"kv_connector": "LakeConnector",
        "kv_connector_module_path": "lake.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool_dir": "/var/lib/lake",
                                      "tenant_key": "<64 hex>"}}'

The pool does not care which side is prefill or decode: under any
``kv_role`` the connector loads what the pool holds and saves what vLLM
computes, so a prefill's KV reaches its decode (P→D), a decode's grown
context returns to the pool (D→pool) and the next turn's prefill reuses it
(D→P), on any node of a cluster: a prefix that only other nodes hold is
pulled into this node's pool before vLLM is told its hit (``pull``).

Runs inside real vLLM (tested in its CPU build, ``ffi/python/tests_vllm``);
optional hooks are feature-detected. Without vLLM installed, stand-in base
classes with the same names are used, so the worker side can be driven by
hand (``ffi/python/tests``).

Hybrid models (Mamba, Gated DeltaNet) keep their recurrent state in KV
cache groups of their own: Lake stores the attention group's blocks and,
beside them, checkpoints of the state (``lake.vllm_state``).

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
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import lake
from lake.vllm_state import KVGroups, StateCheckpoints, kv_groups

logger = logging.getLogger("lake.vllm")

# A load not done in this long is cancelled and its blocks recomputed.
LOAD_TIMEOUT_S = 30

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    except ImportError:  # a vLLM reporting failed loads by block id only
        KVConnectorTransferResults = None
    from vllm.v1.metrics.utils import create_metric_per_engine

    VLLM_PRESENT = True
except ImportError:
    VLLM_PRESENT = False
    KVConnectorTransferResults = None
    import enum

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class SupportsHMA:
        pass

    @dataclass
    class KVConnectorStats:
        data: dict = field(default_factory=dict)

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
    # Asynchronous: vLLM holds the request (WAITING_FOR_REMOTE_KVS) until
    # a worker names it in get_finished; else the step's forward waits.
    asynchronous: bool = False
    # A hybrid model's: the state blocks (one per state group) the
    # checkpoint after the last of ``keys`` goes to. The load is then all
    # or nothing: vLLM cannot resume part way without the state.
    state_block_ids: list[int] | None = None


@dataclass
class SaveSpec:
    """Blocks to save: those of a request whose every token the step that
    carries this computes (or computed before)."""

    request_id: str
    keys: np.ndarray
    block_ids: list[int]
    # The block the first of them continues (the cached prefix's last), or
    # None for a prompt's first block.
    parent: np.ndarray | None = None


@dataclass
class StateSaveSpec:
    """A hybrid model's recurrent-state checkpoint to save: the state
    after the block keyed ``key``, in vLLM's state blocks ``block_ids``
    (one per state group) once the step's forward ran."""

    request_id: str
    key: np.ndarray
    block_ids: list[int]


@dataclass
class LakeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler ships to the workers each step (picklable)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    state_saves: list[StateSaveSpec] = field(default_factory=list)
    # Requests vLLM preempted before this step: their blocks go to others,
    # so the worker lets no save of theirs still read them.
    preempted: set[str] = field(default_factory=set)
    # Requests that ended (aborted) while their asynchronous load ran: the
    # worker cancels what of it has not started.
    cancels: set[str] = field(default_factory=set)


@dataclass
class LakeConnectorStats(KVConnectorStats):
    """What a worker moved in an interval, as vLLM's KV-connector stats:
    blocks loaded and failed, blocks saved and skipped, and how long each
    step's loads were waited for."""

    def __post_init__(self):
        for name in _STAT_COUNTS:
            self.data.setdefault(name, 0)
        self.data.setdefault("load_seconds", [])

    def record_load(self, loaded: int, failed: int, seconds: float) -> None:
        self.data["blocks_loaded"] += loaded
        self.data["blocks_load_failed"] += failed
        self.data["load_seconds"].append(seconds)

    def record_save(self, saved: int, skipped: int, refused: int = 0) -> None:
        """Blocks saved; not sent (the pool refusing saves, a block before
        them not saved, the pool gone); refused by the pool (full, only its
        load reserve free, stopping)."""
        self.data["blocks_saved"] += saved
        self.data["blocks_save_skipped"] += skipped
        self.data["blocks_save_refused"] += refused

    def record_states(self, loaded: int = 0, saved: int = 0, skipped: int = 0) -> None:
        """A hybrid model's recurrent-state checkpoints."""
        self.data["states_loaded"] += loaded
        self.data["states_saved"] += saved
        self.data["states_save_skipped"] += skipped

    def reset(self):
        self.data = {name: 0 for name in _STAT_COUNTS}
        self.data["load_seconds"] = []

    def aggregate(self, other):
        for name in _STAT_COUNTS:
            self.data[name] += other.data.get(name, 0)
        self.data["load_seconds"] = self.data["load_seconds"] + list(other.data.get("load_seconds", ()))
        return self

    def reduce(self):
        loaded, waited = self.data["blocks_loaded"], sum(self.data["load_seconds"])
        return {
            "blocks_loaded": loaded,
            "blocks_load_failed": self.data["blocks_load_failed"],
            "load_ms_per_block": round(1e3 * waited / loaded, 4) if loaded else 0.0,
            "blocks_saved": self.data["blocks_saved"],
            "blocks_save_skipped": self.data["blocks_save_skipped"],
            "blocks_save_refused": self.data["blocks_save_refused"],
            "states_loaded": self.data["states_loaded"],
            "states_saved": self.data["states_saved"],
            "states_save_skipped": self.data["states_save_skipped"],
        }

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in _STAT_COUNTS) and not self.data["load_seconds"]


# Statuses of blocks the pool itself refused (the rest not saved were not
# sent).
_REFUSED = (lake.NO_SPACE, lake.LOAD_RESERVE, lake.STOPPING, lake.OVER_QUOTA)

_STAT_COUNTS = (
    "blocks_loaded",
    "blocks_load_failed",
    "blocks_saved",
    "blocks_save_skipped",
    "blocks_save_refused",
    "states_loaded",
    "states_saved",
    "states_save_skipped",
)


if VLLM_PRESENT:

    class _LakePromMetrics(KVConnectorPromMetrics):
        """Lake's stats as metrics of vLLM's own Prometheus registry."""

        _COUNTERS = {
            "blocks_loaded": "KV blocks loaded from the Lake pool",
            "blocks_load_failed": "KV blocks the Lake pool failed to load (vLLM recomputed them)",
            "blocks_saved": "KV blocks saved into the Lake pool",
            "blocks_save_skipped": "KV blocks not sent to the Lake pool (it refused saves then, or a block "
            "before them was not saved)",
            "blocks_save_refused": "KV blocks the Lake pool refused (full, only its load reserve free, or stopping)",
            "states_loaded": "Recurrent-state checkpoints (hybrid models) loaded from the Lake pool",
            "states_saved": "Recurrent-state checkpoints (hybrid models) saved into the Lake pool",
            "states_save_skipped": "Recurrent-state checkpoints the Lake pool skipped saving",
        }

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {}
            for name, documentation in self._COUNTERS.items():
                counter = self._counter_cls(name=f"vllm:lake_{name}", documentation=documentation, labelnames=labelnames)
                self._counters[name] = create_metric_per_engine(counter, self.per_engine_labelvalues)
            waits = self._histogram_cls(
                name="vllm:lake_load_seconds",
                documentation="Seconds a step waited for its loads from the Lake pool",
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
                labelnames=labelnames,
            )
            self._load_seconds = create_metric_per_engine(waits, self.per_engine_labelvalues)

        def observe(self, transfer_stats_data, engine_idx: int = 0):
            for name, per_engine in self._counters.items():
                value = transfer_stats_data.get(name, 0)
                if value:
                    per_engine[engine_idx].inc(value)
            for seconds in transfer_stats_data.get("load_seconds", ()):
                self._load_seconds[engine_idx].observe(seconds)


class _Tracked:
    """A request the scheduler side follows from allocation to finish: the
    keys of its blocks so far (hashed once each, as tokens arrive) and how
    many leading blocks the pool holds or was asked to save."""

    def __init__(self, request, chain, block_size: int):
        self.request = request
        self._chain = chain
        self._block_size = block_size
        self._keys = np.zeros((0, 16), dtype=np.uint8)
        self.saved = 0
        # Whether a save of it was ever planned (vLLM then keeps its
        # blocks at the finish until the workers report).
        self.saving = False
        # A hybrid model's: the deepest block whose state checkpoint the
        # pool holds or was asked to save.
        self.state_saved = 0

    def keys_to(self, blocks: int) -> np.ndarray:
        """The keys of its first ``blocks`` blocks (fewer where its known
        tokens do not fill that many)."""
        have = len(self._keys)
        if blocks > have:
            tokens = self.request.all_token_ids
            end = min(blocks, len(tokens) // self._block_size) * self._block_size
            if end > have * self._block_size:
                new = np.asarray(tokens[have * self._block_size : end], dtype=np.uint32)
                self._keys = np.concatenate([self._keys, self._chain.extend(new)])
        return self._keys[:blocks]


@dataclass
class _Pull:
    """Another node's blocks a waiting request asked to be pulled here:
    the local hit when it asked, the hit it waits for, when it asked and
    until when it waits."""

    local: int
    held: int
    started: float
    deadline: float


def _groups_block_ids(blocks) -> list[list[int]]:
    """vLLM's KVCacheBlocks (or a plain list: one group's): each KV cache
    group's block ids."""
    if hasattr(blocks, "get_block_ids"):
        return [list(ids) for ids in blocks.get_block_ids()]
    return [list(blocks)]


@dataclass(frozen=True)
class PagedLayout:
    """One layer's paged KV tensor, described from its shape and strides
    (never assumed). ``kind`` names the logical shape:

    - ``"bhnc"``: ``(blocks, heads, block_size, content)``, vLLM's per-layer
      view since its layouts became stride orders of ``[L, B, H, N, C]``
      (``vllm/v1/kv_cache_layout.py``): the content is K then V of one
      token of one head (``2 * head_size``), or an MLA latent;
    - ``"kv_first"``: ``(2, blocks, block_size, heads, head_size)``;
    - ``"blocks_first"``: ``(blocks, 2, block_size, heads, head_size)``;
    - ``"mla"``: ``(blocks, block_size, head_size)``.

    Strides and plane offsets are in elements: a plane's element (block,
    token, head, i) lies at ``plane_offset + block * block_stride + token *
    token_stride + head * head_stride + i``. ``order`` is ``"NHD"`` or
    ``"HND"``, the per-block token/head order in memory."""

    kind: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_size: int
    order: str
    element_size: int
    block_stride: int = 0
    token_stride: int = 0
    head_stride: int = 0
    plane_offsets: tuple = (0,)

    @property
    def planes(self) -> int:
        return len(self.plane_offsets)

    @property
    def bytes_per_block(self) -> int:
        return self.planes * self.block_size * self.kv_heads * self.head_size * self.element_size

    def pieces(self, address: int) -> list:
        """This layer's pieces for ``Pool.register_kv_memory``: (address,
        block, token and head byte strides), one per plane."""
        e = self.element_size
        return [
            (address + offset * e, self.block_stride * e, self.token_stride * e, self.head_stride * e)
            for offset in self.plane_offsets
        ]


def describe_layout(
    shape, stride, element_size: int, block_size: int, num_blocks: int | None = None, mla: bool = False
) -> PagedLayout:
    """Describes a vLLM paged KV tensor from its shape and strides.

    The logical shape names the dimensions; the strides say how they lie in
    memory. ``num_blocks``: vLLM's block count (``kv_cache_config``), where
    known — a rank-4 view may hold several kernel blocks per vLLM block.
    ``mla``: the model's KV is one latent per token (``model_config.use_mla``).
    A shape that fits none of vLLM's layouts is refused, naming it."""
    shape, stride = tuple(int(s) for s in shape), tuple(int(s) for s in stride)
    if len(shape) != len(stride):
        raise ValueError(f"shape {shape} and stride {stride} differ in rank")
    if stride[-1] != 1:
        raise ValueError(f"the innermost dimension of {shape} is not contiguous (strides {stride})")
    if len(shape) == 4:
        return _describe_bhnc(shape, stride, element_size, block_size, num_blocks, mla)
    if len(shape) == 3:
        blocks, tokens, head = shape
        if tokens != block_size:
            raise ValueError(f"MLA tensor {shape}: dimension 1 is not the block size {block_size}")
        return PagedLayout("mla", blocks, tokens, 1, head, "NHD", element_size, stride[0], stride[1], 0, (0,))
    if len(shape) != 5:
        raise ValueError(f"a paged KV tensor has rank 4, 5 or 3 (MLA), not {len(shape)}: {shape}")
    if shape[0] == 2 and shape[2] == block_size:
        kind, blocks, plane_stride, block_stride = "kv_first", shape[1], stride[0], stride[1]
    elif shape[1] == 2 and shape[2] == block_size:
        kind, blocks, plane_stride, block_stride = "blocks_first", shape[0], stride[1], stride[0]
    else:
        raise ValueError(f"cannot tell the K/V dimension of {shape} with block size {block_size}")
    tokens, heads, head = shape[2], shape[3], shape[4]
    token_stride, head_stride = stride[2], stride[3]
    order = "NHD" if token_stride >= head_stride else "HND"
    return PagedLayout(
        kind, blocks, tokens, heads, head, order, element_size, block_stride, token_stride, head_stride,
        (0, plane_stride),
    )


def _describe_bhnc(shape, stride, element_size, block_size, num_blocks, mla) -> PagedLayout:
    """A rank-4 ``(blocks, heads, tokens, content)`` view, in any stride
    order. Where vLLM splits each of its blocks into kernel blocks (the
    view's first dimension is a multiple of ``num_blocks``), the split is
    taken only where the tokens run on at one stride across it."""
    blocks, heads, tokens, content = shape
    block_stride, head_stride, token_stride = stride[0], stride[1], stride[2]
    if num_blocks is not None and blocks != num_blocks:
        ratio = blocks // num_blocks if num_blocks else 0
        if ratio < 2 or blocks != ratio * num_blocks or tokens * ratio != block_size:
            raise ValueError(
                f"a paged KV tensor {shape} holds neither vLLM's {num_blocks} blocks nor kernel blocks of them"
                f" (block size {block_size})"
            )
        if block_stride != tokens * token_stride:
            raise ValueError(
                f"vLLM splits each block of {block_size} tokens into {ratio} kernel blocks of {tokens} whose"
                f" tokens do not run on at one stride (shape {shape}, strides {stride}): not served;"
                f" run vLLM with --block-size {tokens}"
            )
        blocks, tokens, block_stride = num_blocks, block_size, ratio * block_stride
    if tokens != block_size:
        raise ValueError(f"a paged KV tensor {shape}: dimension 2 is not the block size {block_size}")
    order = "NHD" if token_stride >= head_stride else "HND"
    if mla:
        if heads != 1:
            raise ValueError(f"an MLA KV tensor {shape} has {heads} heads, not 1")
        return PagedLayout("bhnc", blocks, tokens, 1, content, order, element_size, block_stride, token_stride, 0, (0,))
    if content % 2:
        raise ValueError(f"a paged KV tensor {shape}: content {content} is not K and V of one head size")
    head = content // 2
    return PagedLayout(
        "bhnc", blocks, tokens, heads, head, order, element_size, block_stride, token_stride, head_stride, (0, head)
    )


def _extra(vllm_config) -> dict[str, Any]:
    """The connector's settings: the pool named by its directory
    (``pool_dir``, what ``lake serve --dir`` was given) or by its
    ``dp_socket`` and ``mirror`` (and ``cp_socket``)."""
    config = getattr(vllm_config, "kv_transfer_config", None)
    return lake.pool_settings(getattr(config, "kv_connector_extra_config", None) or {}, "kv_connector_extra_config")


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
        fingerprint = _model_fingerprint(vllm_config)
        self.namespace = lake.Namespace(tenant, self.block_size, fingerprint)
        # What a router (`lake route`'s [namespace]) needs to chain a
        # request's tokens into this engine's keys.
        logger.info(
            "lake.vllm: namespace %016x: block_tokens %d, model_fingerprint %s",
            self.namespace.id,
            self.block_size,
            fingerprint.hex(),
        )
        self._extra = extra
        self._vllm_config = vllm_config
        self.pool = None
        # The KV cache groups Lake stores; a hybrid model's state groups.
        self.groups: KVGroups = kv_groups(kv_cache_config, self.block_size)
        if self.groups.hybrid and _tensor_parallel_size(vllm_config) > 1:
            raise ValueError("lake.vllm: a hybrid model under tensor parallelism is not served (one rank)")
        speculative = getattr(vllm_config, "speculative_config", None)
        use_eagle = getattr(speculative, "use_eagle", None)
        if callable(use_eagle) and use_eagle():
            # Such a draft's KV of a token is written a step after the
            # target's: a block saved when the target completes it would
            # hold a draft slot never computed.
            raise ValueError(
                f"lake.vllm: speculative method {speculative.method!r} (a draft on the target's hidden states) is"
                " not served: its KV lags the target's by a token; use method 'draft_model' or no connector"
            )
        # The shard codes of every tensor-parallel rank (None: the ranks
        # hold the whole block alike — one rank, or MLA).
        self._shards: list[int] | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Lookups only: no layout of its own; a hit must hold for the
            # shard of every rank.
            self._shards = _group_shard_codes(vllm_config, extra)
            self.pool = self._attach(None, "vllm-scheduler")
        # Scheduler: the local hit vLLM named for each waiting request;
        # requests being followed (allocated, not yet finished).
        self._local_hits: dict[str, int] = {}
        self._running: dict[str, _Tracked] = {}
        if not hasattr(self, "_kv_cache_manager"):
            self._kv_cache_manager = None
        self._pending_loads: list[LoadSpec] = []
        self._pending_saves: list[SaveSpec] = []
        self._pending_state_saves: list[StateSaveSpec] = []
        # Asynchronous loads (``load_async``): requests whose load a worker
        # has not reported yet, and those to cancel at the next step.
        self._load_async = extra.get("load_async", False)
        if not isinstance(self._load_async, bool):
            raise ValueError("kv_connector_extra_config['load_async'] is true or false")
        if self.groups.hybrid:
            # vLLM takes a failed load of a model of several KV cache groups
            # only as a whole request's (an asynchronous load's), and the
            # state must be in place before the request's first step.
            self._load_async = True
        self._receiving: set[str] = set()
        self._load_failed: set[str] = set()
        self._pending_cancels: set[str] = set()
        self._load_errors: set[int] = set()
        self.layouts: dict[str, PagedLayout] = {}
        self.layout: lake.Layout | None = None
        self.memory_id: int | None = None
        # Load request id -> the vLLM block ids it fills; save request id ->
        # (the vLLM request it belongs to, its block count).
        self._loading: dict[int, np.ndarray] = {}
        self._load_started = 0.0
        self._saves: dict[int, tuple[str, int]] = {}
        # Worker: saves in flight per vLLM request; requests this worker
        # ever saved for; those vLLM finished whose saves still run.
        self._saves_of: dict[str, int] = {}
        self._saved_for: set[str] = set()
        self._finishing: set[str] = set()
        # Worker: asynchronous loads by vLLM request (load request, vLLM
        # block ids, start); those that ended with nothing to load; those
        # cancelled for taking too long.
        self._receives: dict[str, _Receive] = {}
        self._received: set[str] = set()
        self._timed_out: set[str] = set()
        self._aborted: set[str] = set()
        self._stats = LakeConnectorStats()
        # Worker, hybrid models: the state checkpoints' side; asynchronous
        # loads that failed (vLLM recomputes those requests); state saves
        # in flight (request id -> staging slot).
        self.states: StateCheckpoints | None = None
        self._failed_receives: set[str] = set()
        self._state_saves: dict[int, int] = {}
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
        # Scheduler: pulls of other nodes' blocks by waiting request, and
        # whether they are worth asking.
        self._pull, self._pull_timeout_s, compute_ns = lake.pull_settings(extra, "kv_connector_extra_config")
        if self.groups.hybrid or self._shards is not None:
            # A pull brings KV blocks by key: not a hybrid's state
            # checkpoints, nor every tensor-parallel shard of a block.
            self._pull = False
        self._pulls: dict[str, _Pull] = {}
        self.pull_gate = lake.PullGate(compute_ns)

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

    def _known_keys(self, request) -> np.ndarray:
        """The keys of every full block of the request's tokens: its prompt,
        and for one vLLM preempted, what it had generated."""
        tokens = np.asarray(request.all_token_ids, dtype=np.uint32)
        full = (len(tokens) // self.block_size) * self.block_size
        return self.namespace.keys(tokens[:full])

    def _hits(self, keys) -> int:
        """The cached prefix every rank can load (its own heads' replicas)."""
        if len(keys) == 0:
            return 0
        try:
            if self._shards is None:
                return self.pool.lookup(keys)[0]
            return self.pool.lookup_shards(keys, self._shards)
        except lake.LakeError as e:
            # No answer from the pool is no hit: vLLM computes.
            logger.warning("lake.vllm: looking up a prefix: %s", e)
            return 0

    def _state_hits(self, keys) -> int:
        """A hybrid model's resumable prefix: the deepest block at most the
        KV hit with a state checkpoint after it."""
        if len(keys) == 0:
            return 0
        try:
            return self.pool.lookup_state(keys)[2]
        except lake.LakeError as e:
            logger.warning("lake.vllm: looking up a prefix: %s", e)
            return 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens Lake can supply beyond vLLM's own prefix hit
        (``num_computed_tokens``, whole blocks), read from the mirror: no
        pin, no lease. The local hit is kept for the load's plan (vLLM sets
        ``request.num_computed_tokens`` only after it allocated)."""
        keys = self._known_keys(request)
        if len(keys) == 0 or request.request_id in self._load_failed:
            return 0, False
        # vLLM must compute at least the last token itself.
        known = len(request.all_token_ids)
        if self.groups.hybrid:
            # A hybrid resumes only where a state checkpoint is.
            matched = self._state_hits(keys[: (known - 1) // self.block_size]) * self.block_size
        else:
            matched = self._hits(keys) * self.block_size
            if matched >= known:
                matched = ((known - 1) // self.block_size) * self.block_size
            if self._pull:
                pulled = self._pulled(request.request_id, keys[: (known - 1) // self.block_size], matched)
                if pulled is None:
                    return None, False
                matched = pulled
        extra = max(0, matched - num_computed_tokens)
        self._local_hits[request.request_id] = num_computed_tokens
        return extra, self._load_async and extra > 0

    def _pulled(self, request_id: str, keys, matched: int) -> int | None:
        """The hit in tokens once the blocks of the request's prefix that
        only other nodes hold are here: a pull of them is asked once (the
        data plane copies them into this node's L1 while vLLM goes on with
        other requests) and ``None`` (vLLM asks again next step) is the
        answer until they landed or ``pull_timeout_s`` passed. A block that
        left its holder meanwhile never lands: the hit ends before it, and
        vLLM computes the rest. No pull where the pull gate is shut."""
        local = matched // self.block_size
        pull = self._pulls.get(request_id)
        now = time.monotonic()
        if pull is None:
            # This node holds the whole prefix, or pulls cost more than
            # computing (as last measured, lately): nothing to ask the
            # cluster view.
            if local >= len(keys) or self.pull_gate.shut(now):
                return matched
            try:
                held, _ = self.pool.lookup_cluster(keys)
                if held <= local:
                    return matched
                # Asked, not waited for: the call returns at once.
                self.pool.pull(keys[:held], timeout_s=0)
            except lake.LakeError as e:
                logger.warning("lake.vllm: pulling a prefix from other nodes: %s", e)
                return matched
            self._pulls[request_id] = _Pull(local, held, now, now + self._pull_timeout_s)
            return None
        if local < pull.held and now < pull.deadline:
            return None
        del self._pulls[request_id]
        # The pull's cost: its wait spread over the blocks it brought.
        self.pull_gate.measured(now, now - pull.started, local - pull.local)
        logger.debug(
            "lake.vllm: request %s: pulled %d blocks in %.3f s; a pulled block costs %d ns",
            request_id, local - pull.local, now - pull.started, self.pull_gate.ns_per_block,
        )
        if local < pull.held:
            logger.info(
                "lake.vllm: request %s: %d of %d blocks pulled from other nodes in %.3f s; vLLM computes the rest",
                request_id, local - pull.local, pull.held - pull.local, now - pull.started,
            )
        return matched

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Plans the load into the blocks vLLM allocated, after its local
        hit (decided by the token count, not by whether ``blocks`` is
        empty), and starts following the request to save its blocks as
        their tokens are computed."""
        request_id = request.request_id
        local = self._local_hits.pop(request_id, 0)
        tracked = self._running.get(request_id)
        if tracked is None:
            tracked = self._running[request_id] = _Tracked(request, lake.KeyChain(self.namespace), self.block_size)
            known_blocks = len(request.all_token_ids) // self.block_size
            # Blocks the pool holds already are not written again.
            tracked.saved = self._hits(tracked.keys_to(known_blocks))
            if self.groups.hybrid:
                tracked.state_saved = self._state_hits(tracked.keys_to(known_blocks))
        else:
            tracked.request = request
        if num_external_tokens <= 0:
            return
        if local % self.block_size or num_external_tokens % self.block_size:
            raise AssertionError(f"lake.vllm: a load of {num_external_tokens} tokens after {local} is not whole blocks")
        first = local // self.block_size
        last = first + num_external_tokens // self.block_size
        keys = tracked.keys_to(last)
        groups = _groups_block_ids(blocks)
        block_ids = groups[self.groups.attention] if len(groups) > self.groups.attention else []
        if len(keys) < last or len(block_ids) < last:
            raise AssertionError(
                f"lake.vllm: request {request_id}: {num_external_tokens} tokens to load after {local} exceed its"
                f" {len(keys)} keys or {len(block_ids)} blocks"
            )
        spec = LoadSpec(request_id, keys[first:last], list(block_ids[first:last]), self._load_async)
        if self.groups.hybrid:
            # The state after the last loaded block goes where vLLM resumes
            # from: each state group's block ``last - 1``.
            spec.state_block_ids = [groups[g][last - 1] if len(groups[g]) >= last else 0 for g in self.groups.states]
            tracked.state_saved = max(tracked.state_saved, last)
        self._pending_loads.append(spec)
        if self._load_async:
            self._receiving.add(request_id)
        # What is loaded is in the pool: not saved again.
        tracked.saved = max(tracked.saved, last)

    def build_connector_meta(self, scheduler_output) -> LakeConnectorMetadata:
        """This step's loads, and the saves of every block this step
        completes: a block is saved once every token in it has its KV
        computed — the step computes ``num_scheduled_tokens`` past
        ``request.num_computed_tokens`` (vLLM advances that field after
        this call), less speculative tokens, which may be rejected. A
        request's last sampled token has no KV yet, so a block it would
        complete is not saved."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        speculative = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        for request_id, count in scheduled.items():
            tracked = self._running.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            computed = int(request.num_computed_tokens) + int(count) - len(speculative.get(request_id, ()))
            full = min(computed, len(request.all_token_ids)) // self.block_size
            # A hybrid's state is checkpointed where a step ends on a block
            # boundary (with draft tokens in the step, vLLM's state is past
            # them: not taken).
            state_due = (
                self.groups.hybrid
                and not speculative.get(request_id)
                and computed % self.block_size == 0
                and computed // self.block_size > tracked.state_saved
            )
            if full <= tracked.saved and not state_due:
                continue
            groups = self._block_ids(scheduler_output, request_id)
            if state_due:
                self._plan_state_save(tracked, computed, groups)
            if full <= tracked.saved:
                continue
            block_ids = groups[self.groups.attention] if len(groups) > self.groups.attention else []
            full = min(full, len(block_ids))
            keys = tracked.keys_to(full)
            if full <= tracked.saved:
                continue
            first = tracked.saved
            parent = keys[first - 1] if first > 0 else None
            self._pending_saves.append(SaveSpec(request_id, keys[first:full], list(block_ids[first:full]), parent))
            tracked.saved = full
            tracked.saving = True
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta = LakeConnectorMetadata(
            loads=self._pending_loads,
            saves=self._pending_saves,
            state_saves=self._pending_state_saves,
            preempted=preempted,
            cancels=self._pending_cancels,
        )
        self._pending_loads, self._pending_saves, self._pending_cancels = [], [], set()
        self._pending_state_saves = []
        return meta

    def _plan_state_save(self, tracked, computed: int, groups) -> None:
        """A hybrid model's checkpoint: a step that ends on a block boundary
        leaves the state there in each state group's block before it
        (vLLM's align mode); saved once, after the step's forward."""
        boundary = computed // self.block_size
        keys = tracked.keys_to(boundary)
        ids = [groups[g][boundary - 1] if len(groups) > g and len(groups[g]) >= boundary else 0
               for g in self.groups.states]
        # The null block (0): vLLM keeps no state there.
        if len(keys) < boundary or not all(ids):
            return
        self._pending_state_saves.append(StateSaveSpec(tracked.request.request_id, keys[boundary - 1], ids))
        tracked.state_saved = boundary

    def _block_ids(self, scheduler_output, request_id) -> list[list[int]]:
        """The request's vLLM block ids, per KV cache group, as the
        scheduler holds them this step."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        ids = state.get_block_ids(request_id) if state is not None else None
        if ids is None and self._kv_cache_manager is not None:
            ids = self._kv_cache_manager.get_block_ids(request_id)
        if ids is None:
            return []
        return [list(g) for g in ids] if ids and isinstance(ids[0], (list, tuple)) else [list(ids)]

    def update_connector_output(self, connector_output):
        self._receiving.difference_update(getattr(connector_output, "finished_recving", None) or ())
        # A request whose whole load failed is not offered the same hit
        # again (the pool may still list what failed): it computes.
        self._load_failed.update(getattr(connector_output, "failed_recving", None) or ())

    def request_finished(self, request, block_ids):
        """Nothing is saved here: a request's blocks went to the pool as
        their tokens were computed. vLLM keeps the blocks (True) while a
        save of this request may still read them; the workers report when
        none does (``get_finished``)."""
        self._local_hits.pop(request.request_id, None)
        self._pulls.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        tracked = self._running.pop(request.request_id, None)
        if request.request_id in self._receiving:
            # Ended while its load runs (an abort): vLLM keeps its blocks
            # until a worker reports the load, which it cancels.
            self._pending_cancels.add(request.request_id)
        return (tracked is not None and tracked.saving), None

    def request_finished_all_groups(self, request, block_ids):
        """HMA: the attention group's blocks are the ones saves read (a
        checkpoint is copied out within its step)."""
        attention = self.groups.attention
        return self.request_finished(request, block_ids[attention] if len(block_ids) > attention else [])

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
        if self.groups.hybrid:
            # The attention layers' KV as blocks; the state layers'
            # checkpoints through a second attachment of their own.
            names = [name for name in names if name in self.groups.attention_layers]
            if not names:
                raise ValueError("lake.vllm: none of the attention group's layers was handed to the connector")
        self._layer_index = {name: i for i, name in enumerate(names)}
        facts = [_tensor_facts(kv_caches[name]) for name in names]
        devices = {(f.device, f.device_index) for f in facts}
        if len(devices) != 1:
            raise ValueError(f"lake.vllm: the layers live on several devices: {sorted(devices)}")
        device_type, device_index = devices.pop()
        self._on_gpu = device_type == "cuda"
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"lake.vllm: KV caches on {device_type} are not served (CPU or CUDA)")
        mla = bool(getattr(getattr(self._vllm_config, "model_config", None), "use_mla", False))
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        for name, f in zip(names, facts):
            try:
                self.layouts[name] = describe_layout(
                    f.shape, f.stride, f.element_size, self.block_size, num_blocks=num_blocks, mla=mla
                )
            except ValueError as e:
                raise ValueError(f"lake.vllm: layer {name}: {e}") from None
        first = self.layouts[names[0]]
        geometry = lambda l: (l.planes, l.num_blocks, l.block_size, l.kv_heads, l.head_size, l.element_size)  # noqa: E731
        for name in names[1:]:
            if geometry(self.layouts[name]) != geometry(first):
                raise ValueError(f"lake.vllm: layer {name} differs from {names[0]}: {self.layouts[name]} vs {first}")
        if len({f.dtype for f in facts}) != 1:
            raise ValueError("lake.vllm: the layers' dtypes differ")
        mla = first.planes == 1
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
        pieces = [piece for f, n in zip(facts, names) for piece in self.layouts[n].pieces(f.data_ptr)]
        self.pool = self._attach(self.layout, f"vllm-worker-{rank}")
        self.memory_id = self.pool.register_kv_memory(
            self.layout,
            first.num_blocks,
            np.array(pieces, dtype=np.int64),
            keep_alive={name: kv_caches[name] for name in names},
            device=device_index if device_type == "cuda" else None,
        )
        logger.info("lake.vllm: %d layers registered, %s", len(names), self.layout)
        if self.groups.hybrid:
            self.states = StateCheckpoints(
                lambda layout: self._attach(layout, f"vllm-worker-{rank}-state"),
                self.groups,
                kv_caches,
            )
            logger.info(
                "lake.vllm: %d state layers registered, checkpoints of %d bytes (%s)",
                sum(len(layers) for layers in self.groups.state_layers),
                self.states.bytes,
                self.states.layout,
            )

    def _worker(self):
        if self.pool is None or self.memory_id is None:
            raise RuntimeError("lake.vllm: register_kv_caches was not called on this worker")
        return self.pool

    def start_load_kv(self, forward_context, **kwargs):
        """Submits this step's loads; they run on the agent's thread while
        the engine goes on."""
        meta = self._connector_metadata
        if meta is None:
            return
        for request_id in getattr(meta, "cancels", ()):
            receive = self._receives.get(request_id)
            if receive is not None:
                self._cancel_receive(receive)
                self._aborted.add(request_id)
        if not meta.loads:
            return
        pool = self._worker()
        for spec in meta.loads:
            block_ids = np.asarray(spec.block_ids, dtype=np.int64)
            try:
                self._start_load(pool, spec, block_ids)
            except lake.LakeError as e:
                # The pool is gone or refused: the blocks are recomputed;
                # vLLM goes on.
                self._fail_load(spec, block_ids)
                self._stats.record_load(0, len(block_ids), 0.0)
                logger.warning("lake.vllm: a load of %d blocks of %s failed (%s); vLLM recomputes them",
                               len(block_ids), spec.request_id, e)

    def _start_load(self, pool, spec, block_ids):
        """Submits one request's load (synchronous or not) of the blocks
        this rank still finds."""
        # This rank's own replicas (its shard); what went since the
        # scheduler planned is reported and recomputed.
        hits, table = pool.lookup(spec.keys)
        state = None
        if spec.state_block_ids is not None:
            state = self._state_source(spec, hits)
            if state is None:
                self._fail_load(spec, block_ids)
                return
        elif hits < len(block_ids):
            self._load_errors.update(int(b) for b in block_ids[hits:])
            logger.warning(
                "lake.vllm: %d of %d planned blocks are no longer cached for this rank; vLLM recomputes them",
                len(block_ids) - hits,
                len(block_ids),
            )
        if hits == 0:
            if spec.asynchronous:
                self._received.add(spec.request_id)
            return
        trace = self._trace_of(spec.request_id)
        if trace:
            lake.set_trace(trace)
        try:
            request = pool.submit_load(self.memory_id, spec.keys[:hits], table, block_ids[:hits])
        finally:
            if trace:
                lake.set_trace(0)
        if spec.asynchronous:
            receive = _Receive(request, block_ids[:hits], time.perf_counter())
            if state is not None:
                receive.state_slot, receive.state_block_ids = state[0], spec.state_block_ids
                try:
                    receive.state_request = self.states.pool.submit_load(
                        self.states.memory_id, lake.state_keys(spec.keys[-1:]), state[1], [state[0]]
                    )
                except lake.LakeError:
                    # The caller reports the request failed.
                    _cancel(pool, request)
                    self.states.give_slot(state[0])
                    raise
            self._receives[spec.request_id] = receive
            return
        self._loading[request] = block_ids[:hits]
        self._load_started = self._load_started or time.perf_counter()

    def _fail_load(self, spec, block_ids) -> None:
        """A load that cannot be made: vLLM recomputes its blocks — named by
        id, or for a hybrid model (whose groups' ids vLLM cannot map back)
        as a failed request."""
        if spec.state_block_ids is not None:
            self._failed_receives.add(spec.request_id)
            self._received.add(spec.request_id)
            return
        self._load_errors.update(int(b) for b in block_ids)
        if spec.asynchronous:
            self._received.add(spec.request_id)

    def _state_source(self, spec, hits: int):
        """A hybrid load's checkpoint: (staging slot, its location), or None
        where the load cannot be whole (blocks or checkpoint gone, no
        slot free, a state block vLLM did not give)."""
        why = None
        if hits < len(spec.keys):
            why = f"{len(spec.keys) - hits} of {len(spec.keys)} blocks are no longer cached"
        elif not all(spec.state_block_ids):
            why = f"vLLM gave no state block to load into ({spec.state_block_ids})"
        else:
            found, where = self.states.pool.lookup(lake.state_keys(spec.keys[-1:]))
            if found != 1:
                why = "its state checkpoint is no longer cached"
            else:
                slot = self.states.take_slot()
                if slot is not None:
                    return slot, where
                why = "every staging slot is in use"
        logger.warning("lake.vllm: the load of %s is not made (%s); reported failed to vLLM", spec.request_id, why)
        return None

    def _cancel_receive(self, receive) -> None:
        _cancel(self._worker(), receive.request)
        if receive.state_request is not None:
            _cancel(self.states.pool, receive.state_request)

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
        for ``get_block_ids_with_load_errors`` (vLLM recomputes them), each
        failed load logged with why. A load not done in 30 s is cancelled
        and reported failed, never waited for longer."""
        if not self._loading:
            return
        pool = self._worker()
        loaded = failed = 0
        for request, block_ids in self._loading.items():
            try:
                statuses = pool.wait(request, len(block_ids), timeout=LOAD_TIMEOUT_S)
            except TimeoutError:
                _cancel(pool, request)
                statuses = np.full(len(block_ids), -1, dtype=np.int32)
            except lake.LakeError as e:
                logger.warning("lake.vllm: waiting for a load: %s", e)
                statuses = np.full(len(block_ids), -1, dtype=np.int32)
            done, missed = self._settle_load(block_ids, statuses)
            loaded, failed = loaded + done, failed + missed
        self._stats.record_load(loaded, failed, time.perf_counter() - self._load_started)
        self._load_started = 0.0
        self._loading.clear()
        self._log_traces()

    def _settle_load(self, block_ids, statuses) -> tuple[int, int]:
        """Keeps a load's failed blocks for ``get_block_ids_with_load_errors``
        (vLLM recomputes them) and says why; (loaded, failed)."""
        failed = statuses != lake.OK
        if failed.any():
            self._load_errors.update(int(b) for b in block_ids[failed])
            logger.warning(
                "lake.vllm: %d of %d blocks not loaded (%s); vLLM recomputes them",
                int(failed.sum()),
                len(block_ids),
                ", ".join(sorted({lake.STATUS.get(int(x), "timed out") for x in statuses[failed]})),
            )
        return int((~failed).sum()), int(failed.sum())

    def _reap_receives(self) -> set[str]:
        """The asynchronous loads that ended (a load still running after
        LOAD_TIMEOUT_S is cancelled); their requests, for vLLM."""
        pool = self._worker()
        done, self._received = self._received, set()
        now = time.perf_counter()
        for request_id, receive in list(self._receives.items()):
            request, block_ids, started = receive.request, receive.block_ids, receive.started
            statuses = receive.statuses = receive.statuses if receive.statuses is not None else _try_wait(
                pool, request, len(block_ids)
            )
            if receive.state_request is not None and receive.state_status is None:
                state = _try_wait(self.states.pool, receive.state_request, 1)
                receive.state_status = None if state is None else int(state[0])
            if statuses is None or (receive.state_request is not None and receive.state_status is None):
                if now - started > LOAD_TIMEOUT_S and request_id not in self._timed_out:
                    logger.warning("lake.vllm: the load of %s took over %d s: cancelled", request_id, LOAD_TIMEOUT_S)
                    self._cancel_receive(receive)
                    self._timed_out.add(request_id)
                continue
            del self._receives[request_id]
            self._timed_out.discard(request_id)
            if receive.state_request is not None:
                self._settle_state_load(request_id, receive)
                done.add(request_id)
                continue
            if request_id in self._aborted:
                # Its request is gone: nothing to recompute, nothing to report.
                self._aborted.discard(request_id)
                dropped = int((statuses != lake.OK).sum())
                logger.info("lake.vllm: the load of aborted %s cancelled, %d of %d blocks dropped", request_id, dropped,
                            len(block_ids))
                done.add(request_id)
                continue
            loaded, failed = self._settle_load(block_ids, statuses)
            self._stats.record_load(loaded, failed, now - started)
            done.add(request_id)
        return done

    def _settle_state_load(self, request_id: str, receive) -> None:
        """A hybrid load that ended: its checkpoint goes into vLLM's state
        blocks if every block and the checkpoint arrived; otherwise the
        request is reported failed (vLLM recomputes it)."""
        try:
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                logger.info("lake.vllm: the load of aborted %s cancelled", request_id)
                return
            failed = int((receive.statuses != lake.OK).sum())
            if failed or receive.state_status != lake.OK:
                self._failed_receives.add(request_id)
                self._stats.record_load(0, len(receive.block_ids), time.perf_counter() - receive.started)
                logger.warning(
                    "lake.vllm: the load of %s failed (%d of %d blocks, checkpoint %s); reported failed to vLLM"
                    " (its kv_load_failure_policy recomputes or fails the request)",
                    request_id, failed, len(receive.block_ids), lake.STATUS.get(receive.state_status, "not loaded"),
                )
                return
            self.states.scatter(receive.state_slot, receive.state_block_ids)
            self._stats.record_load(len(receive.block_ids), 0, time.perf_counter() - receive.started)
            self._stats.record_states(loaded=1)
        finally:
            self.states.give_slot(receive.state_slot)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing per layer: a block is saved whole (every layer in one
        object) at ``wait_for_save``, gathered straight from the tensors."""
        return None

    def wait_for_save(self):
        """Submits this step's saves (blocks the step's forward completed);
        does not wait: vLLM keeps a request's blocks until ``get_finished``
        reports that no save of it reads them any more."""
        # Loads whose last layer was never waited for are settled here, at
        # the end of the forward pass, before vLLM asks for load errors.
        self._collect_loads()
        meta = self._connector_metadata
        if meta is not None and getattr(meta, "state_saves", None):
            self._save_states(meta.state_saves)
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
            self._saved_for.add(spec.request_id)
            try:
                request = pool.submit_save(
                    self.memory_id, spec.keys, spec.block_ids, parent=spec.parent, stream=stream
                )
            except lake.LakeError as e:
                # Saves are best effort: the pool gone or refusing costs
                # future hits, never this request.
                self._stats.record_save(0, len(spec.block_ids))
                logger.warning("lake.vllm: a save of %d blocks of %s was skipped (%s)", len(spec.block_ids),
                               spec.request_id, e)
                continue
            self._saves[request] = (spec.request_id, len(spec.block_ids))
            self._saves_of[spec.request_id] = self._saves_of.get(spec.request_id, 0) + 1

    def _save_states(self, specs) -> None:
        """A hybrid model's checkpoints this step's forward left in vLLM's
        state blocks: copied out to staging now (vLLM reuses those blocks
        from the next step), saved from there under their blocks."""
        if self.states is None:
            raise RuntimeError("lake.vllm: a state checkpoint to save, but no state layers were registered")
        for spec in specs:
            slot = self.states.take_slot()
            if slot is None:
                self._stats.record_states(skipped=1)
                continue
            self.states.gather(slot, spec.block_ids)
            try:
                request = self.states.pool.submit_save(
                    self.states.memory_id, lake.state_keys(spec.key[None]), [slot], parent=spec.key
                )
            except lake.LakeError as e:
                self.states.give_slot(slot)
                self._stats.record_states(skipped=1)
                logger.warning("lake.vllm: a state checkpoint of %s was skipped (%s)", spec.request_id, e)
                continue
            self._state_saves[request] = slot

    def _reap_state_saves(self) -> None:
        for request, slot in list(self._state_saves.items()):
            statuses = _try_wait(self.states.pool, request, 1)
            if statuses is None:
                continue
            del self._state_saves[request]
            self.states.give_slot(slot)
            saved = int(statuses[0]) == lake.OK
            self._stats.record_states(saved=int(saved), skipped=int(not saved))

    def handle_preemptions(self, kv_connector_metadata):
        """Before the step runs: the blocks of requests vLLM preempted go to
        others now, so their saves still reading them are waited for."""
        preempted = getattr(kv_connector_metadata, "preempted", None) or set()
        if not preempted or not self._saves:
            return
        deadline = time.monotonic() + 30.0
        while any(self._saves_of.get(r) for r in preempted):
            self._reap_saves()
            if time.monotonic() > deadline:
                raise RuntimeError(f"lake.vllm: saves of preempted requests {sorted(preempted)} did not end in 30 s")
            time.sleep(0.0002)

    def _reap_saves(self):
        """Takes the completions of saves that ended."""
        pool = self._worker()
        for request, (request_id, count) in list(self._saves.items()):
            statuses = _try_wait(pool, request, count)
            if statuses is None:
                continue
            del self._saves[request]
            left = self._saves_of[request_id] - 1
            if left:
                self._saves_of[request_id] = left
            else:
                del self._saves_of[request_id]
            saved = int((statuses == lake.OK).sum())
            refused = int(np.isin(statuses, _REFUSED).sum())
            self._stats.record_save(saved, count - saved - refused, refused)
            if saved < count:
                logger.info(
                    "lake.vllm: %d of %d blocks of a save of %s were skipped (%s)",
                    count - saved,
                    count,
                    request_id,
                    ", ".join(sorted({lake.STATUS.get(int(x), str(x)) for x in statuses[statuses != lake.OK]})),
                )

    def get_finished(self, finished_req_ids):
        """(finished requests none of whose saves reads its blocks any
        more, requests whose asynchronous load ended — loaded, failed or
        cancelled; a synchronous load ends within its step). A request is named
        once vLLM has said it finished (here or in an earlier call) and only
        if this worker ever saved for it — what the scheduler side promised
        in ``request_finished``."""
        if self._saves:
            self._reap_saves()
        if self._state_saves:
            self._reap_state_saves()
        self._finishing.update(r for r in finished_req_ids if r in self._saved_for)
        done = {r for r in self._finishing if not self._saves_of.get(r)}
        self._finishing -= done
        self._saved_for -= done
        received = self._reap_receives() if (self._receives or self._received) else set()
        return (done or None), (received or None)

    def get_transfer_results(self, finished_req_ids):
        """``get_finished``'s two sets, and the requests whose asynchronous
        load failed as a whole (a hybrid model's): vLLM recomputes them."""
        sending, receiving = self.get_finished(finished_req_ids)
        failed, self._failed_receives = self._failed_receives, set()
        if KVConnectorTransferResults is None:
            if failed:
                raise RuntimeError(f"lake.vllm: this vLLM takes no failed request loads ({sorted(failed)})")
            return sending, receiving
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(receiving or ()) | failed,
            failed_recving=failed,
        )

    def get_kv_connector_stats(self):
        """What this worker loaded and saved since the last call (vLLM's
        KV-connector stats: logged as "KV Transfer metrics")."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LakeConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return LakeConnectorStats(data=dict(data)) if data is not None else LakeConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """vLLM's /metrics gets Lake's counters: ``vllm:lake_blocks_loaded``,
        ``_load_failed``, ``_saved``, ``_save_skipped``, and the histogram
        ``vllm:lake_load_seconds`` of each step's wait for its loads."""
        return _LakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self):
        self._collect_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        if self.states is not None:
            self.states.close()
        if self.pool is not None:
            self.pool.close()


@dataclass
class _Receive:
    """An asynchronous load in flight: its request to the pool, the vLLM
    block ids it fills and when it started; a hybrid model's checkpoint
    load beside it (its request, staging slot, vLLM state blocks); the
    statuses as they arrive."""

    request: int
    block_ids: np.ndarray
    started: float
    state_request: int | None = None
    state_slot: int | None = None
    state_block_ids: list | None = None
    statuses: np.ndarray | None = None
    state_status: int | None = None


def _try_wait(pool, request: int, count: int):
    """A request's statuses once all arrived, else None; a pool that can no
    longer say (gone) ends it, every block failed."""
    try:
        return pool.try_wait(request, count)
    except lake.LakeError as e:
        logger.warning("lake.vllm: polling the pool: %s", e)
        return np.full(count, -1, dtype=np.int32)


def _cancel(pool, request: int) -> None:
    """Cancels what of a request has not started; a pool gone has nothing
    left to cancel."""
    try:
        pool.cancel(request)
    except lake.LakeError as e:
        logger.warning("lake.vllm: cancelling a load: %s", e)


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
    size = _tensor_parallel_size(vllm_config)
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
    size = _tensor_parallel_size(vllm_config)
    try:  # pragma: no cover - only where vLLM is installed
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception:
        rank = int(extra.get("tp_rank", 0))
    if not 0 <= rank < size:
        raise ValueError(f"lake.vllm: tensor-parallel rank {rank} is outside size {size}")
    return rank, size


def _tensor_parallel_size(vllm_config) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
