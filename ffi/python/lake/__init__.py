"""Lake's engine surface for Python, over the C ABI (``liblake.so``).

numpy in, numpy out: keys are ``(n, 16) uint8`` arrays, block tables and
completions are structured arrays; no Python object per block on the hot
paths. Every call checks its arguments before they cross into C; every C
status other than ``LAKE_OK`` raises :class:`LakeError` with the library's
message.

The library is found through ``LAKE_LIBRARY`` (a path to ``liblake.so``),
else beside this file (the wheel, ``lake-kv``, carries it), else in
``target/release`` or ``target/debug`` of the checkout this package sits
in.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import numpy as np

__all__ = [
    "LakeError",
    "Layout",
    "StateLayout",
    "Namespace",
    "KeyChain",
    "Pool",
    "KEY_DTYPE",
    "LOCATION_DTYPE",
    "WHERE_DTYPE",
    "COMPLETION_DTYPE",
    "RAIL_DTYPE",
    "STATUS",
]

STATUS = {
    0: "LAKE_OK",
    1: "LAKE_NULL_ARGUMENT",
    2: "LAKE_INVALID_ARGUMENT",
    3: "LAKE_BAD_STRUCT_SIZE",
    4: "LAKE_BUFFER_TOO_SMALL",
    5: "LAKE_NOT_ATTACHED",
    6: "LAKE_VERSION_MISMATCH",
    7: "LAKE_NO_SPACE",
    8: "LAKE_EVICTED",
    9: "LAKE_BAD_CRC",
    10: "LAKE_IO",
    11: "LAKE_BUSY",
    12: "LAKE_CANCELLED",
    13: "LAKE_INTERNAL",
    14: "LAKE_LAYOUT_MISMATCH",
    15: "LAKE_UNAVAILABLE",
    16: "LAKE_PREFIX_BROKEN",
    17: "LAKE_LOAD_RESERVE",
    18: "LAKE_STOPPING",
    19: "LAKE_SAVE_PRESSURE",
    20: "LAKE_OVER_QUOTA",
}
OK, BUFFER_TOO_SMALL, EVICTED, BAD_CRC, CANCELLED = 0, 4, 8, 9, 12
LAYOUT_MISMATCH, UNAVAILABLE, PREFIX_BROKEN = 14, 15, 16
NO_SPACE, LOAD_RESERVE, STOPPING, SAVE_PRESSURE, OVER_QUOTA = 7, 17, 18, 19, 20

#: Element type codes of :class:`Layout` (``dtype`` accepts the name or a
#: numpy/torch dtype's name).
DTYPES = {"float16": 1, "bfloat16": 2, "float32": 3, "float8_e4m3fn": 4, "float8_e5m2": 5, "int8": 6, "uint8": 6}
DTYPE_BYTES = {1: 2, 2: 2, 3: 4, 4: 1, 5: 1, 6: 1}

KEY_DTYPE = np.dtype((np.uint8, 16))
LOCATION_DTYPE = np.dtype(
    [
        ("tier", np.uint8),
        ("tiers", np.uint8),
        ("kind", np.uint8),
        ("epoch_tag", np.uint8),
        ("region", np.uint16),
        ("reserved", np.uint16),
        ("slot", np.uint32),
        ("generation", np.uint32),
    ]
)
COMPLETION_DTYPE = np.dtype([("request_id", np.uint64), ("index", np.uint32), ("status", np.int32)])
# LakeBlockWhere: where a block of a cluster lookup is (``lookup_cluster``):
# the node holding it, its fastest tier there (1 L1, 2 L2, 3 L3), whether
# it is this node's (then ``location`` is its block-table entry).
WHERE_DTYPE = np.dtype(
    [
        ("node", np.uint32),
        ("tier", np.uint8),
        ("local", np.uint8),
        ("reserved", np.uint16),
        ("location", LOCATION_DTYPE),
    ]
)
# LakeRailStat: one rail of the compute network to one peer (``push_rails``).
RAIL_DTYPE = np.dtype(
    [
        ("peer", np.uint32),
        ("rail", np.uint32),
        ("up", np.uint32),
        ("reserved", np.uint32),
        ("bytes", np.uint64),
        ("breaks", np.uint64),
        ("address", "S64"),
    ]
)
# A traced load's or push's block as the agent saw it (``LakeTraceSpan``);
# ``op``: SPAN_LOAD or SPAN_PUSH.
TRACE_SPAN_DTYPE = np.dtype(
    [
        ("trace", np.uint64),
        ("key", "V16"),
        ("tier", np.uint32),
        ("status", np.int32),
        ("took_ns", np.uint64),
        ("data_plane_us", np.uint32),
        ("op", np.uint32),
    ]
)
SPAN_LOAD, SPAN_PUSH = 0, 1
assert LOCATION_DTYPE.itemsize == 16 and COMPLETION_DTYPE.itemsize == 16 and WHERE_DTYPE.itemsize == 24
assert TRACE_SPAN_DTYPE.itemsize == 48


def pool_record(directory: str, setting: str = "pool_dir") -> dict:
    """What ``lake serve --dir DIR`` recorded in ``DIR/pool.json`` at its
    start: its sockets (``dp_socket``, ``cp_socket``, ``admin_socket``), its
    mirror and arena, its metrics address, its block size and L1 classes.
    An engine configured with the directory alone finds the rest here.
    ``setting`` names the engine's setting in errors."""
    import json

    path = Path(directory) / "pool.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{setting}: no {path}: is `lake serve --dir {directory}` running?") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{setting}: {path}: {e}") from None
    missing = [name for name in ("dp_socket", "mirror", "cp_socket") if not record.get(name)]
    if missing:
        raise ValueError(f"{path} names no {', '.join(missing)}: was it written by `lake serve`?")
    return record


def pool_settings(extra: dict, where: str) -> dict:
    """An engine's settings that name a pool by its directory
    (``pool_dir``, what ``lake serve --dir`` was given), with its
    ``dp_socket``, ``mirror`` and ``cp_socket`` filled in from the pool's
    record; or that name those by hand. ``where`` names the settings in
    errors."""
    extra = dict(extra)
    if "pool_dir" in extra:
        record = pool_record(str(extra["pool_dir"]), f"{where}['pool_dir']")
        for name in ("dp_socket", "mirror", "cp_socket"):
            extra.setdefault(name, record[name])
    for name in ("dp_socket", "mirror"):
        if name not in extra:
            raise ValueError(f"{where} needs 'pool_dir' (the pool's `lake serve --dir`) or {name!r}")
    return extra


# How long an engine waits for the blocks it pulls from other nodes
# before it computes what has not landed (``pull_timeout_s``).
PULL_TIMEOUT_S = 2.0


def pull_settings(extra: dict, where: str) -> tuple[bool, float, int]:
    """An engine's pull settings: ``pull`` (true, the default: a prefix
    other nodes of a cluster hold is brought here before the engine is
    told its hit), ``pull_timeout_s`` (how long it waits for that) and
    ``compute_ns_per_block`` (what computing a block costs the engine; 0,
    unknown: every pull is worth it). ``where`` names the settings in
    errors."""
    pull = extra.get("pull", True)
    if not isinstance(pull, bool):
        raise ValueError(f"{where}['pull'] is true or false")
    timeout = extra.get("pull_timeout_s", PULL_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
        raise ValueError(f"{where}['pull_timeout_s'] is seconds in (0, 60], not {timeout!r}")
    compute = extra.get("compute_ns_per_block", 0)
    if isinstance(compute, bool) or not isinstance(compute, int) or compute < 0:
        raise ValueError(f"{where}['compute_ns_per_block'] is ns, at least 0, not {compute!r}")
    return pull, float(timeout), compute


# A pull found dearer than computing is tried again after this long: what
# a pull costs changes with the network's and the holders' load.
PULL_REMEASURE_S = 30.0


class PullGate:
    """Whether an engine pulls other nodes' blocks: what a pulled block
    cost, as the engine measured its own pulls, against what computing one
    costs it (``compute_ns_per_block``; 0, unknown: every pull is worth
    it). Once pulls are found dearer, none is asked until the figure is
    ``PULL_REMEASURE_S`` old; the next pull measures it again."""

    def __init__(self, compute_ns_per_block: int):
        self.compute_ns = compute_ns_per_block
        # What a pulled block costs as measured (ns; 0: none yet).
        self.ns_per_block = 0
        self.measured_at = 0.0

    def dearer(self) -> bool:
        """Whether a pulled block, as last measured, costs more than
        computing one."""
        return bool(self.compute_ns) and self.ns_per_block > self.compute_ns

    def shut(self, now: float) -> bool:
        """Whether no pull is asked at ``now`` (``time.monotonic()``):
        pulls are dearer, as measured lately."""
        return self.dearer() and now - self.measured_at < PULL_REMEASURE_S

    def measured(self, now: float, seconds: float, blocks: int):
        """A pull brought ``blocks`` in ``seconds``. Measured again after
        a pause, the new figure replaces the old one, which no pull could
        change meanwhile; otherwise it moves the figure a quarter way."""
        if blocks <= 0:
            return
        cost = int(seconds * 1e9) // blocks
        if not self.ns_per_block or self.dearer():
            self.ns_per_block = cost
        else:
            self.ns_per_block = (3 * self.ns_per_block + cost) // 4
        self.measured_at = now


class LakeError(Exception):
    """A call returned a status other than ``LAKE_OK``."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{STATUS.get(status, status)}: {message}")
        self.status = status
        self.name = STATUS.get(status, str(status))
        self.message = message


class _NamespaceOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("tenant_key", ctypes.c_uint8 * 32),
        ("block_tokens", ctypes.c_uint32),
        ("model_fingerprint", ctypes.c_uint8 * 32),
        ("extra_keys_digest", ctypes.c_uint8 * 32),
        ("key_scheme", ctypes.c_uint32),
    ]


class _AttachOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dp_socket", ctypes.c_char_p),
        ("mirror_path", ctypes.c_char_p),
        ("cp_socket", ctypes.c_char_p),
        ("name", ctypes.c_char_p),
        ("namespace", ctypes.c_void_p),
        ("layout_fingerprint", ctypes.c_uint64),
        ("segment_bytes", ctypes.c_uint64),
        ("pin_agent", ctypes.c_uint32),
        ("agent_core", ctypes.c_uint32),
        ("copy_threads", ctypes.c_uint32),
        ("shard_code", ctypes.c_uint64),
        ("object_kind", ctypes.c_uint32),
        ("block_bytes", ctypes.c_uint64),
    ]


class _LayoutOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_uint32)
        for name in (
            "layers",
            "planes",
            "kv_heads",
            "shard_start",
            "shard_end",
            "head_dim",
            "dtype",
            "block_tokens",
            "layers_per_segment",
        )
    ]


class _LayoutInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("fingerprint", ctypes.c_uint64),
        ("block_bytes", ctypes.c_uint64),
        ("segment_bytes", ctypes.c_uint64),
        ("heads", ctypes.c_uint32),
        ("head_bytes", ctypes.c_uint32),
        ("shard_code", ctypes.c_uint64),
    ]


class _StateLayoutOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_uint32)
        for name in ("layers", "state_bytes_per_layer", "dtype", "shard_start", "shard_end", "layers_per_segment")
    ]


class _StateLayoutInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("fingerprint", ctypes.c_uint64),
        ("block_bytes", ctypes.c_uint64),
        ("segment_bytes", ctypes.c_uint64),
    ]


class _KvMemoryOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("layout", ctypes.c_void_p),
        ("block_count", ctypes.c_uint32),
        ("pieces", ctypes.c_void_p),
        ("piece_count", ctypes.c_size_t),
        ("memory_kind", ctypes.c_uint32),
        ("device", ctypes.c_uint32),
        ("gpu_path", ctypes.c_uint32),
        ("layer_groups", ctypes.c_uint32),
    ]


#: One (layer, plane) of engine memory: address of block 0, then the byte
#: strides of blocks, tokens and heads (``LakeKvPiece``).
PIECE_DTYPE = np.dtype(
    [("address", np.uint64), ("block_stride", np.int64), ("token_stride", np.int64), ("head_stride", np.int64)]
)


class _Stats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (name, ctypes.c_uint64)
        for name in (
            "lookups",
            "hit_blocks",
            "l1_loads",
            "l2_loads",
            "load_failures",
            "saves",
            "saves_skipped",
            "bytes_loaded",
            "bytes_saved",
        )
    ]


def _find_library() -> str:
    explicit = os.environ.get("LAKE_LIBRARY")
    if explicit:
        return explicit
    here = Path(__file__).resolve()
    bundled = here.parent / "liblake.so"
    if bundled.is_file():  # installed from the wheel
        return str(bundled)
    for parent in here.parents:
        for profile in ("release", "debug"):
            candidate = parent / "target" / profile / "liblake.so"
            if candidate.exists():
                return str(candidate)
    raise OSError("liblake.so not found: build it (cargo build -p lake-ffi) or set LAKE_LIBRARY")


_lib = None


def _library():
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(_find_library())
    p, u8p, sz, u32, u64 = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint64
    signatures = {
        "lake_wire_version_max": ([], ctypes.c_uint16),
        "lake_namespace_new": ([p, ctypes.POINTER(p)], ctypes.c_int),
        "lake_namespace_free": ([p], None),
        "lake_namespace_id": ([p, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_keychain_new": ([p, ctypes.POINTER(p)], ctypes.c_int),
        "lake_keychain_extend": ([p, p, sz, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_keychain_free": ([p], None),
        "lake_page_keys": ([p, p, sz, sz, p], ctypes.c_int),
        "lake_attach": ([p, ctypes.POINTER(p)], ctypes.c_int),
        "lake_detach": ([p], None),
        "lake_register_host_memory": ([p, u8p, sz, u32, ctypes.POINTER(u32)], ctypes.c_int),
        "lake_layout_describe": ([p, p], ctypes.c_int),
        "lake_register_kv_memory": ([p, p, ctypes.POINTER(u32)], ctypes.c_int),
        "lake_lookup": ([p, p, sz, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_lookup_shards": ([p, p, sz, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_lookup_cluster": ([p, p, sz, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_pull": ([p, p, sz, u32, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_lookup_state": ([p, p, sz, p, sz, ctypes.POINTER(sz), ctypes.POINTER(sz), p], ctypes.c_int),
        "lake_state_layout_describe": ([p, p], ctypes.c_int),
        "lake_shard_code": ([u32, u32, u32, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_submit_load": ([p, u32, p, p, p, sz, u32, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_submit_save": ([p, u32, p, p, p, sz, u32, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_submit_save_on_stream": ([p, u32, p, p, p, sz, u32, u64, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_lease": ([p, p, sz, u32, ctypes.POINTER(sz), ctypes.POINTER(u64), ctypes.POINTER(p)], ctypes.c_int),
        "lake_lease_release": ([p], None),
        "lake_report_resident": ([p, p, sz, u32], ctypes.c_int),
        "lake_wait_layer": ([p, u64, u32, u64], ctypes.c_int),
        "lake_slot_space": ([p, ctypes.POINTER(ctypes.c_uint16), ctypes.POINTER(u64)], ctypes.c_int),
        "lake_push": ([p, ctypes.c_char_p, p, p, sz, ctypes.c_uint16, u64, u32, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_push_rails": ([p, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_set_trace": ([u64], None),
        "lake_trace_spans": ([p, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_route": ([p, p, p, p, sz], ctypes.c_int),
        "lake_load_costs": ([p, ctypes.POINTER(u64), sz], ctypes.c_int),
        "lake_report_prefill": ([p, u64, u64], ctypes.c_int),
        "lake_compute_cost": ([p, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_pull_cost": ([p, ctypes.POINTER(u64)], ctypes.c_int),
        "lake_cancel": ([p, u64], ctypes.c_int),
        "lake_poll": ([p, p, sz, ctypes.POINTER(sz)], ctypes.c_int),
        "lake_stats": ([p, p], ctypes.c_int),
        "lake_alive": ([p], ctypes.c_int),
        "lake_save_pressure": ([p, ctypes.POINTER(ctypes.c_uint8)], ctypes.c_int),
        "lake_lookup_pinned": ([p, p, sz, p, sz, ctypes.POINTER(sz), ctypes.POINTER(p)], ctypes.c_int),
        "lake_load_pinned": ([p, p, u32, p, sz, p], ctypes.c_int),
        "lake_pins_release": ([p], None),
        "lake_last_error": ([ctypes.c_char_p, sz], sz),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result
    _lib = lib
    return lib


def _check(status: int) -> None:
    if status != OK:
        buffer = ctypes.create_string_buffer(512)
        _library().lake_last_error(buffer, len(buffer))
        raise LakeError(status, buffer.value.decode("utf-8", "replace"))


class _NodeLoad(ctypes.Structure):
    _fields_ = [
        ("node", ctypes.c_uint32),
        ("roles", ctypes.c_uint32),
        ("queue_ns", ctypes.c_uint64),
        ("compute_ns_per_block", ctypes.c_uint64),
        ("load_ns_per_block", ctypes.c_uint64 * 4),
        ("cnic_ns_per_block", ctypes.c_uint64),
    ]


class _NodeHits(ctypes.Structure):
    _fields_ = [("node", ctypes.c_uint32), ("through", ctypes.c_uint32 * 4), ("reserved", ctypes.c_uint32)]


class _RouteRequest(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("keys", ctypes.c_void_p),
        ("count", ctypes.c_size_t),
        ("local_node", ctypes.c_uint32),
        ("local_l0_blocks", ctypes.c_uint32),
        ("l3_blocks", ctypes.c_uint32),
        ("policy", ctypes.c_uint32),
        ("others", ctypes.c_void_p),
        ("others_count", ctypes.c_size_t),
        ("loads", ctypes.c_void_p),
        ("loads_count", ctypes.c_size_t),
        ("avoid", ctypes.c_void_p),
        ("avoid_count", ctypes.c_size_t),
        ("pull_ns_per_block", ctypes.c_uint64),
    ]


class _RoutePlan(ctypes.Structure):
    _fields_ = [
        ("mode", ctypes.c_uint32),
        ("prefill_node", ctypes.c_uint32),
        ("decode_node", ctypes.c_uint32),
        ("hit_blocks", ctypes.c_uint32),
        ("recomputed_blocks", ctypes.c_uint32),
        ("moves", ctypes.c_uint32),
        ("ttft_ns", ctypes.c_uint64),
    ]


class _RouteMove(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("first", "last", "from_node", "from_tier", "to_node", "network")]


ROUTE_MODES = ("colocated", "pd", "d_direct")
ROUTE_NETWORKS = ("local", "storage", "compute")
ROUTE_POLICIES = {"any": 0, "always_pd": 1, "always_colocated": 2}
# A ``load_ns_per_block`` entry of this node in ``route``: the cost this
# pool's agent measured on its own loads (``load_costs``), live.
COST_MEASURED = 2**64 - 1


def _ptr(array: np.ndarray):
    return array.ctypes.data_as(ctypes.c_void_p) if array.size else None


def _keys(keys) -> np.ndarray:
    array = np.ascontiguousarray(keys, dtype=np.uint8)
    if array.ndim != 2 or array.shape[1] != 16:
        raise ValueError(f"keys must have shape (n, 16), not {array.shape}")
    return array


def _blocks(blocks, count: int) -> np.ndarray:
    array = np.ascontiguousarray(blocks, dtype=np.uint32)
    if array.ndim != 1 or array.shape[0] != count:
        raise ValueError(f"engine blocks must have shape ({count},), not {array.shape}")
    return array


def _is_hex(text: str) -> bool:
    return len(text) % 2 == 0 and len(text) > 0 and all(c in "0123456789abcdefABCDEF" for c in text)


def _digest(value: bytes, what: str) -> ctypes.Array:
    if len(value) != 32:
        raise ValueError(f"{what} must be 32 bytes, not {len(value)}")
    return (ctypes.c_uint8 * 32).from_buffer_copy(value)


class Layout:
    """A block's geometry as this engine rank holds it; Lake gives back the
    fingerprint blocks are saved under (readers with another layout — another
    tensor-parallel shard, dtype or block size — never get these bytes) and
    the sizes.

    ``shard`` is ``(first_head, end_head)`` of the model's ``kv_heads`` this
    rank holds, or ``None`` when every rank holds them all (MLA)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        block_tokens: int,
        planes: int = 2,
        shard: tuple[int, int] | None = None,
        layers_per_segment: int = 1,
    ):
        code = dtype if isinstance(dtype, int) else DTYPES.get(str(dtype).replace("torch.", ""))
        if code not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {dtype!r}: one of {sorted(DTYPES)}")
        options = _LayoutOptions()
        options.struct_size = ctypes.sizeof(_LayoutOptions)
        options.layers, options.planes, options.kv_heads = layers, planes, kv_heads
        options.shard_start, options.shard_end = shard if shard is not None else (0, 0)
        options.head_dim, options.dtype, options.block_tokens = head_dim, code, block_tokens
        options.layers_per_segment = layers_per_segment
        info = _LayoutInfo()
        info.struct_size = ctypes.sizeof(_LayoutInfo)
        _check(_library().lake_layout_describe(ctypes.byref(options), ctypes.byref(info)))
        self._options = options
        self.layers, self.planes, self.kv_heads, self.head_dim = layers, planes, kv_heads, head_dim
        self.dtype, self.block_tokens, self.shard = code, block_tokens, shard
        self.fingerprint = info.fingerprint
        self.block_bytes = info.block_bytes
        self.segment_bytes = info.segment_bytes
        self.heads = info.heads
        self.head_bytes = info.head_bytes
        #: What names this rank's replicas apart from other ranks' (0: the
        #: whole block). A pool attached with this layout uses it.
        self.shard_code = info.shard_code

    def __repr__(self):
        return (
            f"Layout(layers={self.layers}, planes={self.planes}, heads={self.heads}/{self.kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, block_tokens={self.block_tokens}, "
            f"fingerprint={self.fingerprint:#x})"
        )


class StateLayout:
    """A hybrid model's recurrent-state checkpoint as this rank holds it:
    ``layers`` linear-attention (GDN, Mamba) layers of
    ``state_bytes_per_layer`` bytes each (conv and recurrent state, in the
    engine's own order). Checkpoints are objects of their own (DESIGN §3):
    a :class:`Pool` attached with this layout saves and loads them only,
    under a fingerprint apart from every KV layout's. Give it the rank's KV
    ``shard_code`` so :meth:`Pool.lookup_state` reads the rank's own KV
    chain; ``shard`` is the state heads this rank holds (``None``: all)."""

    #: ``LakeAttachOptions.object_kind`` of a pool attached with it.
    object_kind = 2

    def __init__(
        self,
        layers: int,
        state_bytes_per_layer: int,
        dtype="float32",
        shard: tuple[int, int] | None = None,
        layers_per_segment: int = 1,
        shard_code: int = 0,
    ):
        code = dtype if isinstance(dtype, int) else DTYPES.get(str(dtype).replace("torch.", ""))
        if code not in DTYPE_BYTES:
            raise ValueError(f"unknown state dtype {dtype!r}: one of {sorted(DTYPES)}")
        options = _StateLayoutOptions()
        options.struct_size = ctypes.sizeof(_StateLayoutOptions)
        options.layers, options.state_bytes_per_layer, options.dtype = layers, state_bytes_per_layer, code
        options.shard_start, options.shard_end = shard if shard is not None else (0, 0)
        options.layers_per_segment = layers_per_segment
        info = _StateLayoutInfo()
        info.struct_size = ctypes.sizeof(_StateLayoutInfo)
        _check(_library().lake_state_layout_describe(ctypes.byref(options), ctypes.byref(info)))
        self.layers, self.state_bytes_per_layer, self.dtype, self.shard = layers, state_bytes_per_layer, code, shard
        self.fingerprint = info.fingerprint
        self.block_bytes = info.block_bytes
        self.segment_bytes = info.segment_bytes
        self.shard_code = shard_code

    def __repr__(self):
        return (
            f"StateLayout(layers={self.layers}, state_bytes_per_layer={self.state_bytes_per_layer}, "
            f"dtype={self.dtype}, fingerprint={self.fingerprint:#x})"
        )


def set_trace(trace: int) -> None:
    """The trace id the loads this thread submits from now on carry (0:
    none): the data plane logs each block it loads under it with its time,
    and ``Pool.trace_spans()`` hands each over as the agent saw it."""
    _library().lake_set_trace(int(trace))


def state_keys(keys) -> np.ndarray:
    """The names of the recurrent-state checkpoints taken after each of
    ``keys``' blocks: every bit of the block's key flipped."""
    return np.bitwise_not(_keys(keys))


def shard_code(kv_heads: int, start: int, end: int) -> int:
    """The shard code of heads ``start..end`` of a model's ``kv_heads`` (0
    for all of them): what :class:`Layout` gives the rank holding them, for
    a scheduler that plans for every rank (:meth:`Pool.lookup_shards`)."""
    code = ctypes.c_uint64()
    _check(_library().lake_shard_code(kv_heads, start, end, ctypes.byref(code)))
    return code.value


#: Priorities of loads and saves (``LakeStatus``-style codes of the ABI).
PRIORITY = {"critical_load": 0, "prefill_to_decode": 1, "write_back": 2, "demotion": 3, "replication": 4}

#: Key schemes of :class:`Namespace`.
KEY_SCHEMES = {"tokens": 1, "engine_prefix_hash": 3}


class Namespace:
    """A tenant's namespace for one model: two requests share KV only inside one.

    ``key_scheme`` is ``"tokens"`` (keys chained over token ids: :meth:`keys`)
    or ``"engine_prefix_hash"`` (each key derived from an engine page hash
    that already names its prefix, such as SGLang's: :meth:`page_keys`)."""

    def __init__(
        self,
        tenant_key: bytes,
        block_tokens: int,
        model_fingerprint: bytes,
        extra_keys_digest=bytes(32),
        key_scheme: str = "tokens",
    ):
        if key_scheme not in KEY_SCHEMES:
            raise ValueError(f"key_scheme is one of {sorted(KEY_SCHEMES)}, not {key_scheme!r}")
        options = _NamespaceOptions()
        options.key_scheme = KEY_SCHEMES[key_scheme]
        options.struct_size = ctypes.sizeof(_NamespaceOptions)
        options.tenant_key = _digest(tenant_key, "tenant_key")
        options.block_tokens = block_tokens
        options.model_fingerprint = _digest(model_fingerprint, "model_fingerprint")
        options.extra_keys_digest = _digest(extra_keys_digest, "extra_keys_digest")
        handle = ctypes.c_void_p()
        _check(_library().lake_namespace_new(ctypes.byref(options), ctypes.byref(handle)))
        self._handle = handle
        self.block_tokens = block_tokens

    @property
    def id(self) -> int:
        value = ctypes.c_uint64()
        _check(_library().lake_namespace_id(self._handle, ctypes.byref(value)))
        return value.value

    def keys(self, tokens) -> np.ndarray:
        """The keys of every full block of a prompt."""
        return KeyChain(self).extend(tokens)

    def page_keys(self, hashes) -> np.ndarray:
        """The keys of pages named by engine page hashes (bytes, or strings:
        hex digests are decoded, other strings taken as UTF-8)."""
        raw = [bytes.fromhex(h) if isinstance(h, str) and _is_hex(h) else h.encode() if isinstance(h, str) else bytes(h) for h in hashes]
        out = np.zeros((len(raw), 16), dtype=np.uint8)
        if not raw:
            return out
        lengths = {len(r) for r in raw}
        groups = [(0, len(raw))] if len(lengths) == 1 else [(i, i + 1) for i in range(len(raw))]
        for start, end in groups:
            joined = np.frombuffer(b"".join(raw[start:end]), dtype=np.uint8)
            _check(
                _library().lake_page_keys(
                    self._handle, _ptr(joined), len(raw[start]), end - start, out[start:end].ctypes.data
                )
            )
        return out

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle and _lib is not None:
            _lib.lake_namespace_free(handle)
            self._handle = None


class KeyChain:
    """Block keys of a growing prompt, hashing only what is new."""

    def __init__(self, namespace: Namespace):
        self._namespace = namespace
        handle = ctypes.c_void_p()
        _check(_library().lake_keychain_new(namespace._handle, ctypes.byref(handle)))
        self._handle = handle

    def extend(self, tokens) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        if tokens.ndim != 1:
            raise ValueError("tokens must be one-dimensional")
        written = ctypes.c_size_t()
        capacity = (tokens.shape[0] // self._namespace.block_tokens) + 1
        out = np.zeros((capacity, 16), dtype=np.uint8)
        _check(
            _library().lake_keychain_extend(
                self._handle, _ptr(tokens), tokens.shape[0], _ptr(out), capacity, ctypes.byref(written)
            )
        )
        return out[: written.value]

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle and _lib is not None:
            _lib.lake_keychain_free(handle)
            self._handle = None


class _Handle:
    """A library object freed once: by ``release()``, at the end of a
    ``with`` block, or when collected. Subclasses name the freeing call."""

    _free = ""
    _handle = None

    def release(self) -> None:
        if self._handle:
            getattr(_library(), self._free)(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        self.release() if _lib is not None and getattr(self, "_handle", None) else None


class Pins(_Handle):
    """L1 blocks pinned by :meth:`Pool.lookup_pinned`."""

    _free = "lake_pins_release"

    def __init__(self, pool, handle, count):
        self._pool, self._handle, self.count = pool, handle, count

    def load(self, memory_id: int, engine_blocks) -> np.ndarray:
        """Copies the pinned blocks into engine blocks now, in this thread;
        one status per block (``LAKE_EVICTED`` for one the lookup did not pin)."""
        if not self._handle:
            raise LakeError(2, "these pins were released")
        blocks = np.ascontiguousarray(engine_blocks, dtype=np.uint32)
        if blocks.ndim != 1:
            raise ValueError("engine blocks must be one-dimensional")
        statuses = np.zeros(blocks.shape[0], dtype=np.int32)
        _check(
            _library().lake_load_pinned(
                self._pool._h(), self._handle, memory_id, _ptr(blocks), blocks.shape[0], _ptr(statuses)
            )
        )
        return statuses



class Lease(_Handle):
    """Replicas held for a planned load (:meth:`Pool.lease`): ``granted``
    keys covered, until ``deadline_unix_ns`` or :meth:`release`."""

    _free = "lake_lease_release"

    def __init__(self, handle, granted: int, deadline_unix_ns: int):
        self._handle, self.granted, self.deadline_unix_ns = handle, granted, deadline_unix_ns


class Pool:
    """An attached pool: lookups read shared memory; loads and saves run on the agent's thread."""

    def __init__(
        self,
        dp_socket: str,
        mirror: str,
        namespace: Namespace,
        cp_socket: str | None = None,
        layout_fingerprint: int = 0,
        segment_bytes: int = 4096,
        name: str = "python-engine",
        layout: Layout | StateLayout | None = None,
        agent_core: int | None = None,
        copy_threads: int = 0,
    ):
        shard, kind, block_bytes = 0, 1, 0
        if layout is not None:
            layout_fingerprint, segment_bytes = layout.fingerprint, layout.segment_bytes
            shard = layout.shard_code
            kind = getattr(layout, "object_kind", 1)
            # Checked at attach: a block no L1 class of the pool holds is
            # refused now, not at every save.
            block_bytes = layout.block_bytes
        options = _AttachOptions()
        options.struct_size = ctypes.sizeof(_AttachOptions)
        options.dp_socket = os.fsencode(dp_socket)
        options.mirror_path = os.fsencode(mirror)
        options.cp_socket = os.fsencode(cp_socket) if cp_socket else None
        options.name = name.encode()
        options.namespace = namespace._handle
        options.layout_fingerprint = layout_fingerprint
        options.segment_bytes = segment_bytes
        if agent_core is not None:
            if agent_core < 0:
                raise ValueError(f"agent_core must be a core number, not {agent_core}")
            options.pin_agent, options.agent_core = 1, agent_core
        options.copy_threads = copy_threads
        options.shard_code = shard
        options.object_kind = kind
        options.block_bytes = block_bytes
        handle = ctypes.c_void_p()
        _check(_library().lake_attach(ctypes.byref(options), ctypes.byref(handle)))
        self._handle = handle
        self._namespace = namespace
        self._memories: list = []
        # Completions taken by try_wait, by request: (statuses, how many).
        self._partial: dict[int, tuple[np.ndarray, int]] = {}
        self._lock = threading.Lock()

    def _h(self):
        if not self._handle:
            raise LakeError(5, "this pool was closed")
        return self._handle

    def register_host_memory(self, blocks: np.ndarray) -> int:
        """Registers a ``(count, block_bytes) uint8`` C-contiguous array; it is kept alive here."""
        if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim != 2:
            raise ValueError("engine memory must be a 2-D uint8 numpy array (blocks, block_bytes)")
        if not blocks.flags["C_CONTIGUOUS"] or not blocks.flags["WRITEABLE"]:
            raise ValueError("engine memory must be C-contiguous and writeable")
        memory_id = ctypes.c_uint32()
        _check(
            _library().lake_register_host_memory(
                self._h(), _ptr(blocks), blocks.shape[1], blocks.shape[0], ctypes.byref(memory_id)
            )
        )
        self._memories.append(blocks)
        return memory_id.value

    def register_kv_memory(
        self,
        layout: Layout,
        block_count: int,
        pieces,
        keep_alive=None,
        device=None,
        gpu_path: str = "copy_engine",
        layer_groups: int = 0,
    ) -> int:
        """Registers an engine's paged KV cache in host memory, described as
        one piece per (layer, plane), layer-major (``PIECE_DTYPE`` records or
        an ``(n, 4)`` array of address, block, token and head byte strides).
        Loads scatter into it and saves gather from it in the engine's own
        order. ``keep_alive`` (the tensors) is held as long as the pool.
        ``device``: the CUDA device ordinal when the pieces are GPU memory
        (moved by Lake's kernels), ``None`` for host memory; ``gpu_path``:
        ``"copy_engine"`` (the bus crossed by the copy engines, the layout
        changed in HBM; keeps the bus while the GPU computes) or
        ``"direct"`` (one kernel across the bus; fastest on an idle GPU);
        ``layer_groups``: the groups a GPU load's layers go in (0: 8; 1:
        every block whole, fastest over the copy engines, for an engine that
        waits for the whole load rather than layer by layer)."""
        array = np.asarray(pieces)
        if array.dtype != PIECE_DTYPE:
            array = np.asarray(pieces, dtype=np.int64)
            if array.ndim != 2 or array.shape[1] != 4:
                raise ValueError(f"pieces must be PIECE_DTYPE records or shape (n, 4), not {array.shape}")
            records = np.zeros(array.shape[0], dtype=PIECE_DTYPE)
            records["address"] = array[:, 0].astype(np.uint64)
            for i, name in enumerate(("block_stride", "token_stride", "head_stride"), start=1):
                records[name] = array[:, i]
            array = records
        array = np.ascontiguousarray(array)
        options = _KvMemoryOptions()
        options.struct_size = ctypes.sizeof(_KvMemoryOptions)
        options.layout = ctypes.addressof(layout._options)
        options.block_count = block_count
        options.pieces = array.ctypes.data if array.size else None
        options.piece_count = array.shape[0]
        if device is not None:
            options.memory_kind, options.device = 1, int(device)
            paths = {"copy_engine": 0, "direct": 1}
            if gpu_path not in paths:
                raise ValueError(f"gpu_path is one of {sorted(paths)}, not {gpu_path!r}")
            options.gpu_path = paths[gpu_path]
            options.layer_groups = int(layer_groups)
        memory_id = ctypes.c_uint32()
        _check(_library().lake_register_kv_memory(self._h(), ctypes.byref(options), ctypes.byref(memory_id)))
        self._memories.append(keep_alive)
        return memory_id.value

    def lookup(self, keys):
        """``(hits, table)``: the longest cached prefix and its block table."""
        keys = _keys(keys)
        table = np.zeros(keys.shape[0], dtype=LOCATION_DTYPE)
        hits = ctypes.c_size_t()
        _check(
            _library().lake_lookup(self._h(), _ptr(keys), keys.shape[0], _ptr(table), keys.shape[0], ctypes.byref(hits))
        )
        return hits.value, table[: hits.value]

    def lookup_cluster(self, keys):
        """``(hits, where)``: the longest prefix of ``keys`` held anywhere in
        the pool, and where each of its blocks is (:data:`WHERE_DTYPE`):
        this node's blocks (``local`` 1, with the block-table entry
        :meth:`lookup` gives), then blocks only other nodes hold (their
        ``node`` and fastest ``tier``), from the cluster view the pool keeps
        beside its mirror. A pool keeping no view answers as :meth:`lookup`."""
        keys = _keys(keys)
        where = np.zeros(keys.shape[0], dtype=WHERE_DTYPE)
        hits = ctypes.c_size_t()
        _check(
            _library().lake_lookup_cluster(
                self._h(), _ptr(keys), keys.shape[0], _ptr(where), keys.shape[0], ctypes.byref(hits)
            )
        )
        return hits.value, where[: hits.value]

    def pull(self, keys, timeout_s=1.0) -> int:
        """Makes as much of ``keys`` this node's as the pool can within
        ``timeout_s``: the blocks of its longest prefix held anywhere that
        only other nodes hold are copied into this node's L1 (their holders
        send them over the storage network). Returns this node's hit then:
        :meth:`lookup` and load it as usual. A block that left its holder
        first never lands; the hit ends before it."""
        keys = _keys(keys)
        hits = ctypes.c_size_t()
        timeout_ms = max(0, min(int(timeout_s * 1000), 0xFFFFFFFF))
        _check(_library().lake_pull(self._h(), _ptr(keys), keys.shape[0], timeout_ms, ctypes.byref(hits)))
        return hits.value

    def lookup_shards(self, keys, shard_codes) -> int:
        """The longest prefix of ``keys`` cached for every shard of
        ``shard_codes`` (a tensor-parallel group's ranks, :func:`shard_code`):
        the shortest of their hits. Shared memory only; no access report."""
        keys = _keys(keys)
        codes = np.ascontiguousarray(shard_codes, dtype=np.uint64)
        if codes.ndim != 1 or codes.size == 0:
            raise ValueError(f"shard_codes must be a non-empty 1-D array, not shape {codes.shape}")
        hits = ctypes.c_size_t()
        _check(
            _library().lake_lookup_shards(
                self._h(), _ptr(keys), keys.shape[0], _ptr(codes), codes.shape[0], ctypes.byref(hits)
            )
        )
        return hits.value

    def lookup_state(self, keys):
        """Where a hybrid model resumes: ``(hits, table, state_blocks,
        state_location)`` — the longest cached KV prefix and its block table
        (as :meth:`lookup`), and the deepest position at most ``hits`` whose
        block has a recurrent-state checkpoint (0: none) with that
        checkpoint's location (a one-entry table; load it under
        ``state_keys(keys[state_blocks - 1 : state_blocks])``). On a pool
        attached with a :class:`StateLayout`; shared memory only."""
        keys = _keys(keys)
        table = np.zeros(keys.shape[0], dtype=LOCATION_DTYPE)
        state = np.zeros(1, dtype=LOCATION_DTYPE)
        hits, blocks = ctypes.c_size_t(), ctypes.c_size_t()
        _check(
            _library().lake_lookup_state(
                self._h(), _ptr(keys), keys.shape[0], _ptr(table), keys.shape[0], ctypes.byref(hits),
                ctypes.byref(blocks), _ptr(state),
            )
        )
        return hits.value, table[: hits.value], blocks.value, state

    def lookup_pinned(self, keys):
        """``(hits, table, pins)``: like :meth:`lookup`, with the L1 hits
        pinned until ``pins.release()`` (or the ``with`` block ends)."""
        keys = _keys(keys)
        table = np.zeros(keys.shape[0], dtype=LOCATION_DTYPE)
        hits = ctypes.c_size_t()
        handle = ctypes.c_void_p()
        _check(
            _library().lake_lookup_pinned(
                self._h(), _ptr(keys), keys.shape[0], _ptr(table), keys.shape[0], ctypes.byref(hits),
                ctypes.byref(handle),
            )
        )
        return hits.value, table[: hits.value], Pins(self, handle, hits.value)

    def submit_load(self, memory_id: int, keys, table, engine_blocks, priority: int = PRIORITY["critical_load"]) -> int:
        """Loads the looked-up blocks into engine blocks on the agent's
        thread; ``priority`` (see ``PRIORITY``) puts a request's own loads
        ahead of prefetches and saves."""
        keys = _keys(keys)
        table = np.ascontiguousarray(table, dtype=LOCATION_DTYPE)
        if table.shape != (keys.shape[0],):
            raise ValueError("one location per key")
        blocks = _blocks(engine_blocks, keys.shape[0])
        request = ctypes.c_uint64()
        _check(
            _library().lake_submit_load(
                self._h(), memory_id, _ptr(keys), _ptr(table), _ptr(blocks), keys.shape[0], priority,
                ctypes.byref(request),
            )
        )
        return request.value

    def submit_save(
        self, memory_id: int, keys, engine_blocks, parent=None, priority: int = PRIORITY["write_back"], stream=None
    ) -> int:
        """Saves engine blocks as ``keys`` (the first under ``parent``).
        ``stream``: for GPU memory, the raw CUDA stream (``torch.cuda.
        current_stream().cuda_stream``) whose queued work writes the blocks —
        the save's reads wait for it on the GPU; without it the engine's
        writes must have landed already."""
        keys = _keys(keys)
        blocks = _blocks(engine_blocks, keys.shape[0])
        parent_array = None if parent is None else np.ascontiguousarray(parent, dtype=np.uint8).reshape(16)
        request = ctypes.c_uint64()
        args = (
            self._h(),
            memory_id,
            None if parent_array is None else _ptr(parent_array),
            _ptr(keys),
            _ptr(blocks),
            keys.shape[0],
            priority,
        )
        if stream is None:
            _check(_library().lake_submit_save(*args, ctypes.byref(request)))
        else:
            _check(_library().lake_submit_save_on_stream(*args, int(stream), ctypes.byref(request)))
        return request.value

    def lease(self, keys, ttl_ms: int = 10_000) -> "Lease":
        """Holds the replicas of the leading run of ``keys`` that has one
        (L2 blocks, which no pin covers) for ``ttl_ms``, so a load planned
        now finds them; a round trip to lake-cp."""
        keys = _keys(keys)
        granted, deadline, handle = ctypes.c_size_t(), ctypes.c_uint64(), ctypes.c_void_p()
        _check(
            _library().lake_lease(
                self._h(), _ptr(keys), keys.shape[0], ttl_ms, ctypes.byref(granted), ctypes.byref(deadline),
                ctypes.byref(handle),
            )
        )
        return Lease(handle, granted.value, deadline.value)

    def report_resident(self, keys, resident: bool = True) -> None:
        """Tells lake-cp the engine now keeps ``keys`` in its own GPU memory
        (or, with ``resident=False``, has freed them): advisory L0 replicas
        for routing, forgotten when the engine detaches. Returns at once."""
        keys = _keys(keys)
        _check(_library().lake_report_resident(self._h(), _ptr(keys), keys.shape[0], 1 if resident else 0))

    def wait_layer(self, request_id: int, layer: int, stream: int = 0) -> None:
        """Makes CUDA stream ``stream`` (a raw handle: PyTorch's
        ``torch.cuda.current_stream().cuda_stream``) wait, on the GPU, until
        layer ``layer`` of GPU load ``request_id`` has landed; the host
        returns at once. The load's completions still say whether every
        block passed its CRC check."""
        _check(_library().lake_wait_layer(self._h(), request_id, layer, stream))

    def slot_space(self) -> tuple:
        """This node's L1 as a push target: (region, epoch), for the node
        that pushes blocks here (``push``)."""
        region, epoch = ctypes.c_uint16(), ctypes.c_uint64()
        _check(_library().lake_slot_space(self._h(), ctypes.byref(region), ctypes.byref(epoch)))
        return region.value, epoch.value

    def push(self, address: str, keys, table, region: int, epoch: int, priority: int = 1) -> int:
        """Pushes looked-up L1 blocks (``lookup``'s keys and table) to the
        node at ``address`` ("IP:PORT", its transport; or its rails, one
        per NIC, "LOCAL>IP:PORT,LOCAL>IP:PORT"), into any slot of its L1
        (``slot_space`` there): P→D. Returns the request id; one
        completion per block (``wait``)."""
        keys = _keys(keys)
        table = np.ascontiguousarray(table, dtype=LOCATION_DTYPE)
        if table.shape != (keys.shape[0],):
            raise ValueError("one location per key")
        request = ctypes.c_uint64()
        _check(
            _library().lake_push(
                self._h(), address.encode(), _ptr(keys), _ptr(table), keys.shape[0], region, epoch, priority,
                ctypes.byref(request),
            )
        )
        return request.value

    def trace_spans(self) -> np.ndarray:
        """The traced loads' and pushes' blocks done since the last call
        (``TRACE_SPAN_DTYPE``: trace, key, tier, status, took_ns — the
        agent's wait — data_plane_us — the data plane's own time, or for a
        push the peer pool's; 0 from one built before trace ids — and op,
        ``SPAN_LOAD`` or ``SPAN_PUSH``), oldest first."""
        out = np.zeros(256, dtype=TRACE_SPAN_DTYPE)
        count = ctypes.c_size_t()
        _check(_library().lake_trace_spans(self._h(), _ptr(out), out.shape[0], ctypes.byref(count)))
        return out[: count.value]

    def push_rails(self) -> np.ndarray:
        """What each rail of the compute network carried for this pool's
        pushes (``RAIL_DTYPE``: peer, rail, up, bytes, breaks, address),
        peers in the order first pushed to."""
        count = ctypes.c_size_t()
        _check(_library().lake_push_rails(self._h(), None, 0, ctypes.byref(count)))
        out = np.zeros(count.value, dtype=RAIL_DTYPE)
        if count.value:
            _check(_library().lake_push_rails(self._h(), _ptr(out), count.value, ctypes.byref(count)))
        return out[: count.value]

    def route(
        self, keys, loads, others=(), local_node=0, local_l0_blocks=0, l3_blocks=0, avoid=(), policy="any",
        pull_ns_per_block=0,
    ):
        """Where a request with block ``keys`` should run (``lake_route``):
        this node's hits from its mirror, ``others`` as ``{"node": n,
        "through": [l0, l1, l2, l3]}`` (none: the pool's cluster view
        gives them, where it keeps one), every node in ``loads`` as
        ``{"node", "prefill", "decode", "queue_ns", "compute_ns_per_block",
        "load_ns_per_block": [l0, l1, l2, l3], "cnic_ns_per_block"}``;
        ``avoid``: nodes a failed execution ran on; ``pull_ns_per_block``:
        what pulling a block only other nodes hold costs (0: none is
        pulled; ``COST_MEASURED``: into this node, what this pool measured,
        :meth:`pull_cost`). Returns the plan as a dict (``mode``:
        "colocated", "pd" or "d_direct"; its ``moves``)."""
        if policy not in ROUTE_POLICIES:
            raise ValueError(f"policy {policy!r}: one of {sorted(ROUTE_POLICIES)}")
        keys = _keys(keys)
        load_array = (_NodeLoad * max(len(loads), 1))()
        for i, load in enumerate(loads):
            roles = (1 if load.get("prefill", True) else 0) | (2 if load.get("decode", True) else 0)
            load_array[i] = _NodeLoad(
                load["node"], roles, load.get("queue_ns", 0), load["compute_ns_per_block"],
                (ctypes.c_uint64 * 4)(*load["load_ns_per_block"]), load["cnic_ns_per_block"],
            )
        other_array = (_NodeHits * max(len(others), 1))()
        for i, other in enumerate(others):
            other_array[i] = _NodeHits(other["node"], (ctypes.c_uint32 * 4)(*other["through"]), 0)
        avoid_array = (ctypes.c_uint32 * max(len(avoid), 1))(*avoid)
        request = _RouteRequest(
            ctypes.sizeof(_RouteRequest), _ptr(keys), keys.shape[0], local_node, local_l0_blocks, l3_blocks,
            ROUTE_POLICIES[policy], ctypes.cast(other_array, ctypes.c_void_p), len(others),
            ctypes.cast(load_array, ctypes.c_void_p), len(loads), ctypes.cast(avoid_array, ctypes.c_void_p), len(avoid),
            pull_ns_per_block,
        )
        plan = _RoutePlan()
        moves = (_RouteMove * 16)()
        _check(_library().lake_route(self._h(), ctypes.byref(request), ctypes.byref(plan), moves, 16))
        return {
            "mode": ROUTE_MODES[plan.mode],
            "prefill_node": plan.prefill_node,
            "decode_node": plan.decode_node,
            "hit_blocks": plan.hit_blocks,
            "recomputed_blocks": plan.recomputed_blocks,
            "ttft_ns": plan.ttft_ns,
            "moves": [
                {
                    "blocks": (m.first, m.last),
                    "from": (m.from_node, m.from_tier),
                    "to": m.to_node,
                    "network": ROUTE_NETWORKS[m.network],
                }
                for m in moves[: min(plan.moves, 16)]
            ],
        }

    def cancel(self, request_id: int) -> None:
        _check(_library().lake_cancel(self._h(), request_id))

    def poll(self, capacity: int = 256) -> np.ndarray:
        """Raw completions, as the library hands them out (what this takes,
        :meth:`wait` and :meth:`try_wait` will not see: use one or the other)."""
        out = np.zeros(capacity, dtype=COMPLETION_DTYPE)
        written = ctypes.c_size_t()
        _check(_library().lake_poll(self._h(), _ptr(out), capacity, ctypes.byref(written)))
        return out[: written.value]

    def try_wait(self, request_id: int, count: int):
        """The per-block statuses of a request once all ``count`` arrived,
        else ``None``; never blocks. Completions of other requests seen
        meanwhile are kept for theirs. Thread-safe (one request, one waiter)."""
        with self._lock:
            while True:
                # Drained in batches, each sorted into its requests with
                # numpy (a Python loop per block costs microseconds each:
                # milliseconds for a long prompt).
                batch = self.poll(4096)
                whole = len(batch)
                while len(batch):
                    request = batch["request_id"][0]
                    picked = batch["request_id"] == request
                    mine, batch = batch[picked], batch[~picked]
                    statuses, left = self._partial.get(int(request), (None, 0))
                    if statuses is None:
                        # Its waiter has not asked yet: the array grows on demand.
                        statuses, left = np.full(0, -1, dtype=np.int32), 0
                    top = int(mine["index"].max()) + 1
                    if top > len(statuses):
                        grown = np.full(top, -1, dtype=np.int32)
                        grown[: len(statuses)] = statuses
                        statuses = grown
                    statuses[mine["index"]] = mine["status"]
                    self._partial[int(request)] = (statuses, left + len(mine))
                if whole < 4096:
                    break
            statuses, seen = self._partial.get(request_id, (None, 0))
            if seen < count:
                return None
            del self._partial[request_id]
            return statuses[:count]

    def wait(self, request_id: int, count: int, timeout: float = 10.0) -> np.ndarray:
        """The per-block statuses of a request, once all ``count`` arrived
        (completions of other requests seen meanwhile are kept for theirs).
        Thread-safe: each thread waits for its own requests."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = self.try_wait(request_id, count)
            if statuses is not None:
                return statuses
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id}: not complete in {timeout} s")
            time.sleep(0.0002)

    def load_costs(self) -> list:
        """What loading one block from each tier (L0, L1, L2, L3) has cost
        this pool's agent, in ns, as it measured on its own loads (0: not
        measured yet) — the live inputs ``route`` takes for this node where
        its ``load_ns_per_block`` says ``COST_MEASURED``."""
        costs = (ctypes.c_uint64 * 4)()
        _check(_library().lake_load_costs(self._h(), costs, 4))
        return list(costs)

    def report_prefill(self, blocks: int, elapsed_ns: int) -> None:
        """The engine computed ``blocks`` blocks of a prompt in ``elapsed_ns``:
        folded into what computing a block costs it (``compute_cost``), which
        ``route`` takes for this node where its ``compute_ns_per_block`` says
        ``COST_MEASURED``. Both must be at least 1."""
        _check(_library().lake_report_prefill(self._h(), int(blocks), int(elapsed_ns)))

    def compute_cost(self) -> int:
        """What computing one block costs this engine as it reported its
        prefills, in ns (0: none reported yet)."""
        out = ctypes.c_uint64()
        _check(_library().lake_compute_cost(self._h(), ctypes.byref(out)))
        return out.value

    def pull_cost(self) -> int:
        """What a block pulled into this node has cost, as this pool
        measured its pulls (:meth:`pull`), in ns (0: none measured yet)."""
        out = ctypes.c_uint64()
        _check(_library().lake_pull_cost(self._h(), ctypes.byref(out)))
        return out.value

    def stats(self) -> dict:
        stats = _Stats()
        stats.struct_size = ctypes.sizeof(_Stats)
        _check(_library().lake_stats(self._h(), ctypes.byref(stats)))
        return {name: getattr(stats, name) for name, _ in _Stats._fields_[1:]}

    def alive(self) -> bool:
        return bool(self._handle) and _library().lake_alive(self._handle) == OK

    def save_pressure(self) -> bool:
        """Whether the pool refuses saves now (it refused one for want of
        room in the last 100 ms, or it is stopping); read from shared
        memory, no request. A save submitted meanwhile is skipped whole
        (``SAVE_PRESSURE`` per block)."""
        out = ctypes.c_uint8()
        _check(_library().lake_save_pressure(self._h(), ctypes.byref(out)))
        return bool(out.value)

    def close(self) -> None:
        if self._handle:
            _library().lake_detach(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close() if _lib is not None and getattr(self, "_handle", None) else None
