"""A hybrid model's KV cache groups under vLLM's hybrid allocator, and the
worker's recurrent-state checkpoints (Mamba, Gated DeltaNet) moved
between vLLM's state blocks and the pool.

vLLM (``mamba_cache_mode="align"``, its prefix caching of a hybrid model)
keeps the state after token ``k * block_size`` in the state group's block
``k - 1`` of a request, written by the step that ends there. Lake keeps
it as a checkpoint object (DESIGN §3): keyed by the KV block it follows
with every bit flipped (``lake.state_keys``), that block its parent, one
object holding every state layer's bytes. vLLM's state blocks are pages
spread over one tensor per layer, so a checkpoint crosses a small host
staging area: gathered there before a save, scattered from there after a
load."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import lake

# Checkpoints in flight per worker (each a staging slot of one checkpoint's
# bytes); a save finding none free is skipped and counted.
STAGING_SLOTS = 16


@dataclass(frozen=True)
class KVGroups:
    """Which of vLLM's KV cache groups Lake stores and how: the one
    full-attention group's blocks as KV blocks, each state group's block
    at a boundary as part of that boundary's checkpoint."""

    attention: int = 0
    states: tuple = ()
    # Layer names of the attention group and of every state group, in
    # group order (a checkpoint holds them in this order).
    attention_layers: tuple = ()
    state_layers: tuple = ()

    @property
    def hybrid(self) -> bool:
        return bool(self.states)


def kv_groups(kv_cache_config, block_size: int) -> KVGroups:
    """Reads vLLM's ``KVCacheConfig``: one group is a plain model's; a
    hybrid model must have one full-attention group and state groups in
    ``align`` mode at the same block size. Anything else is refused at
    start, naming what and the way out."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        names = tuple(getattr(groups[0], "layer_names", ())) if groups else ()
        return KVGroups(attention_layers=names)
    attention, states, other = [], [], []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind == "MambaSpec":
            states.append(index)
            mode = getattr(spec, "mamba_cache_mode", "align")
            if mode != "align":
                raise ValueError(
                    f"lake.vllm: the model's state group {index} is cached in mode {mode!r}: Lake stores"
                    " recurrent state only as vLLM's prefix caching keeps it (mamba_cache_mode 'align');"
                    " run vLLM with prefix caching on"
                )
        elif kind in ("FullAttentionSpec", "MLAAttentionSpec"):
            attention.append(index)
        else:
            other.append(f"group {index}: {kind}")
        if int(spec.block_size) != block_size:
            raise ValueError(
                f"lake.vllm: KV cache group {index} ({kind}) has blocks of {spec.block_size} tokens, not vLLM's"
                f" {block_size}: not served"
            )
    if other or len(attention) != 1:
        what = "; ".join(other) or f"{len(attention)} full-attention groups"
        raise ValueError(
            f"lake.vllm: vLLM's hybrid allocator split this model's KV cache into groups Lake does not store"
            f" ({what}): served are one full-attention group and Mamba/linear-attention state groups; run"
            " vLLM with --disable-hybrid-kv-cache-manager for a model without recurrent state"
        )
    return KVGroups(
        attention=attention[0],
        states=tuple(states),
        attention_layers=tuple(groups[attention[0]].layer_names),
        state_layers=tuple(tuple(groups[i].layer_names) for i in states),
    )


def _block_parts(cache) -> list:
    """A state layer's tensors, each indexed by block on its first
    dimension (vLLM hands one raw byte view per layer, or its conv and
    recurrent state tensors), checked to hold one block contiguously."""
    parts = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    for part in parts:
        block = part[0]
        if not block.is_contiguous():
            raise ValueError(
                f"lake.vllm: a state tensor {tuple(part.shape)} (strides {part.stride()}) does not hold a block"
                " contiguously: not served"
            )
    return parts


class StateCheckpoints:
    """A worker's side of recurrent-state checkpoints: the state layers'
    tensors, a second attachment to the pool under a ``lake.StateLayout``
    and the staging slots checkpoints cross."""

    def __init__(self, connector_attach, groups: KVGroups, kv_caches: dict):
        import torch

        self.groups = groups
        # Per state group: (layer name, its parts) in order.
        self._layers = []
        sizes = set()
        for names in groups.state_layers:
            layers = []
            for name in names:
                if name not in kv_caches:
                    raise ValueError(f"lake.vllm: state layer {name} was not handed to the connector")
                parts = _block_parts(kv_caches[name])
                sizes.add(sum(p[0].numel() * p.element_size() for p in parts))
                layers.append((name, parts))
            self._layers.append(layers)
        if len(sizes) != 1:
            raise ValueError(f"lake.vllm: the state layers' blocks differ in size ({sorted(sizes)} bytes): not served")
        self.layer_bytes = sizes.pop()
        count = sum(len(layers) for layers in self._layers)
        self.layout = lake.StateLayout(layers=count, state_bytes_per_layer=self.layer_bytes, dtype="uint8")
        self.pool = connector_attach(self.layout)
        self._staging = np.zeros((STAGING_SLOTS, self.layout.block_bytes), dtype=np.uint8)
        self._staging_tensor = torch.from_numpy(self._staging)
        self.memory_id = self.pool.register_host_memory(self._staging)
        self._free = list(range(STAGING_SLOTS))

    @property
    def bytes(self) -> int:
        return self.layer_bytes * sum(len(layers) for layers in self._layers)

    def take_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_slot(self, slot: int) -> None:
        assert slot not in self._free, f"staging slot {slot} given back twice"
        self._free.append(slot)

    def _views(self, block_ids):
        """(staging byte range, the state's bytes in vLLM's block) for every
        part of every state layer; ``block_ids``: one per state group."""
        if len(block_ids) != len(self._layers):
            raise ValueError(f"{len(block_ids)} state blocks for {len(self._layers)} state groups")
        offset = 0
        for block, layers in zip(block_ids, self._layers):
            for _, parts in layers:
                for part in parts:
                    view = part[int(block)].reshape(-1).view(dtype=_byte_dtype())
                    yield offset, view
                    offset += view.numel()

    def gather(self, slot: int, block_ids) -> None:
        """Copies the state in vLLM's ``block_ids`` into staging ``slot``."""
        row = self._staging_tensor[slot]
        for offset, view in self._views(block_ids):
            row[offset : offset + view.numel()].copy_(view)

    def scatter(self, slot: int, block_ids) -> None:
        """Copies staging ``slot`` into vLLM's state ``block_ids``."""
        row = self._staging_tensor[slot]
        for offset, view in self._views(block_ids):
            view.copy_(row[offset : offset + view.numel()])

    def close(self):
        self.pool.close()


def _byte_dtype():
    import torch

    return torch.uint8
