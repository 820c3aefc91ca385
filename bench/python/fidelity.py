"""Fidelity and TTFT harness, on the GPU machine.

An engine of our own around a transformers causal LM with random weights
from a fixed seed: its KV lives in a paged cache on the GPU (vLLM's
flash-attention layout, one ``(2, blocks, 16, kv_heads, head_dim)`` tensor
per layer), registered with Lake as GPU memory; Lake's kernels move blocks
between it and the pool (L1 in shared memory, L2 files), exactly as the
vLLM connector does. The model runs on a ``DynamicCache`` built from paged
blocks.

``fidelity`` (a small Qwen3-shaped model, fast): a multi-turn agent
workload — conversations sharing a system prompt, each turn the previous
context + the reply + a new message, round robin so that L1 (sized below
the working set) demotes older conversations to L2. Every turn:

- the prefix is looked up in the mirror and loaded from the pool (L1 and
  L2 hits counted) into fresh engine blocks: bitwise identical to the
  blocks the engine saved;
- the logits of the prompt's last token with the restored prefix are
  bitwise identical to the same engine's own prefix-cache-hit path (its
  retained blocks), and agree with a full recomputation within tolerance
  (same top-1 token counted);
- TTFT with Lake (lookup + load + the suffix) and without (the whole
  prompt) is timed;
- the context's new full blocks are saved (the engine goes on with the
  restored cache, as a real one does).

A speculative-decoding draft model runs beside the target (``--no-draft``
leaves it out): a second, smaller KV layout in its own namespace, pooled,
restored and checked exactly like the target's, turn by turn.

``hybrid`` (milestone c): the same workload on a hybrid linear-attention
model, transformers' Qwen3-Next (Gated DeltaNet layers, full attention
every fourth layer; small, dense, random weights): the attention layers'
KV pooled as blocks, the linear layers' conv and recurrent state as
checkpoint objects of their own (``lake.StateLayout``) after every
``--checkpoint-every`` blocks and each context's last full block. A turn
resumes from the deepest checkpoint at or below its KV hit
(``Pool.lookup_state``); KV and state restored are bitwise the engine's
own, and so are the logits (its own checkpoint and blocks, the same
chunking); against a full recomputation within tolerance, same top-1.

``ttft`` (the Qwen3-8B shape: 36 layers, 32 heads, 8 KV heads, head dim
128, bf16): prefill of N tokens against a full-prefix hit from L1 (the
KV of N tokens loaded, one token computed), whole and layer by layer
(each decoder layer's attention waits on the GPU, not the host, for its
layer to land: ``Pool.wait_layer``); the bound is prefill time over the
time to move the KV bytes at the raw H2D rate of the same run.

    python3 bench/python/fidelity.py fidelity --lake target/release/lake --out DIR
    python3 bench/python/fidelity.py hybrid --lake target/release/lake --out DIR
    python3 bench/python/fidelity.py ttft --lake target/release/lake --out DIR --tokens 8192 32768

Writes ``DIR/fidelity.json`` / ``DIR/hybrid.json`` / ``DIR/ttft.json`` (one JSON object a line)
and, for fidelity, ``DIR/ttft_per_turn.png``. Exits non-zero when a
bitwise check fails."""

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import lake

BLOCK = 16

SHAPES = {
    "small": dict(
        num_hidden_layers=4,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=32000,
    ),
    # A speculative-decoding draft beside the small target: same vocabulary,
    # a second, smaller KV layout.
    "draft": dict(
        num_hidden_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=512,
        vocab_size=32000,
    ),
    "qwen3-8b": dict(
        num_hidden_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
    ),
}

# A hybrid linear-attention model (transformers' Qwen3-Next: Gated DeltaNet
# layers, a full-attention layer every fourth), small and dense (no MoE).
HYBRID = dict(
    num_hidden_layers=8,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1408,
    vocab_size=32000,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_config(shape):
    if shape == "hybrid":
        from transformers import Qwen3NextConfig

        layers = HYBRID["num_hidden_layers"]
        config = Qwen3NextConfig(
            **HYBRID, mlp_only_layers=list(range(layers)), max_position_embeddings=65536, tie_word_embeddings=False
        )
    else:
        from transformers import Qwen3Config

        config = Qwen3Config(**SHAPES[shape], max_position_embeddings=65536, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def build_model(shape, dtype, seed):
    if shape == "hybrid":
        from transformers import Qwen3NextForCausalLM as Model
    else:
        from transformers import Qwen3ForCausalLM as Model

    config = build_config(shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = Model(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    return model, config


class Pool:
    """A `lake serve` of its own: a whole single-node pool in a process."""

    def __init__(self, binary, block_bytes, l1_slots, l2_slots):
        self.dir = tempfile.mkdtemp(prefix="lake-fidelity-")
        args = [binary, "serve", "--metrics", "127.0.0.1:0", "--dir", self.dir, "--block-bytes", str(block_bytes)]
        args += ["--l1-slots", str(l1_slots), "--l2-slots", str(l2_slots), "--agents", "8"]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        serving = json.loads(line)
        self.dp, self.cp, self.mirror = serving["dp_socket"], serving["cp_socket"], serving["mirror"]

    def stop(self):
        """Stops the pool; prints what it did (its last line)."""
        self.process.terminate()
        rest, _ = self.process.communicate(timeout=60)
        print(rest.strip().splitlines()[-1] if rest.strip() else "{}", flush=True)


class PagedCache:
    """The engine's paged KV cache: one flash-attention tensor per layer
    (per attention layer of ``model_layers``, a hybrid's; default all)."""

    def __init__(self, config, blocks, dtype, model_layers=None):
        self.heads, self.dim = config.num_key_value_heads, config.head_dim
        self.model_layers = list(range(config.num_hidden_layers)) if model_layers is None else list(model_layers)
        shape = (2, blocks, BLOCK, self.heads, self.dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in self.model_layers]
        self.free = list(range(blocks - 1, -1, -1))

    def alloc(self, n):
        if n > len(self.free):
            raise RuntimeError(f"engine cache full: {n} blocks asked, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, ids):
        self.free.extend(ids)

    def pieces(self):
        out = []
        for t in self.layers:
            s, e = t.stride(), t.element_size()
            out += [(t.data_ptr() + p * s[0] * e, s[1] * e, s[2] * e, s[3] * e) for p in (0, 1)]
        return np.array(out, dtype=np.int64)

    def write(self, cache, first_block, ids):
        """Blocks ``first_block..`` of a DynamicCache's context into ``ids``."""
        if not ids:
            return
        index = torch.as_tensor(ids, device="cuda")
        start, end = first_block * BLOCK, (first_block + len(ids)) * BLOCK
        every = layer_kv(cache)
        for layer, (k, v) in enumerate(every[m] for m in self.model_layers):
            for plane, x in ((0, k), (1, v)):
                # (1, heads, tokens, dim) -> (blocks, 16, heads, dim)
                paged = x[0, :, start:end].transpose(0, 1).reshape(len(ids), BLOCK, self.heads, self.dim)
                self.layers[layer][plane].index_copy_(0, index, paged)

    def layer(self, layer, ids):
        """One layer's K and V of blocks ``ids`` (a list, or an index tensor
        already on the GPU) as (1, heads, tokens, dim)."""
        index = ids if torch.is_tensor(ids) else torch.as_tensor(ids, device="cuda")
        out = []
        for plane in (0, 1):
            x = self.layers[layer][plane].index_select(0, index)
            out.append(x.reshape(len(ids) * BLOCK, self.heads, self.dim).transpose(0, 1).unsqueeze(0).contiguous())
        return out

    def layer_into(self, layer, index, keys, values):
        """One layer's K and V of the blocks of ``index`` (on the GPU)
        copied into ``keys`` and ``values`` (1, heads, tokens, dim): one
        gather and one strided copy a plane."""
        for plane, out in ((0, keys), (1, values)):
            x = self.layers[layer][plane].index_select(0, index)
            out[0].copy_(x.view(-1, self.heads, self.dim).transpose(0, 1))

    def dynamic(self, ids):
        """A DynamicCache holding blocks ``ids`` (empty for none)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        if ids:
            for layer in range(len(self.layers)):
                k, v = self.layer(layer, ids)
                cache.update(k, v, layer)
        return cache

    def placeholder(self, tokens):
        """A DynamicCache of ``tokens`` unwritten tokens per layer, to be
        filled layer by layer as each lands (its length is right from the
        start, so positions and masks are)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in range(len(self.layers)):
            shape = (1, self.heads, tokens, self.dim)
            empty = torch.empty(shape, dtype=self.layers[0].dtype, device="cuda")
            cache.update(empty, torch.empty_like(empty), layer)
        return cache

    def equal(self, a, b):
        ia, ib = torch.as_tensor(a, device="cuda"), torch.as_tensor(b, device="cuda")
        return all(torch.equal(t[:, ia], t[:, ib]) for t in self.layers)


def layer_kv(cache):
    """(keys, values) per layer, whatever this transformers calls them
    (``None`` for a hybrid's linear-attention layers)."""
    if hasattr(cache, "layers"):
        return [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


@torch.inference_mode()
def forward(model, tokens, cache, start):
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)[None], device="cuda")
    positions = torch.arange(start, start + len(tokens), device="cuda")[None]
    out = model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def synced(fn):
    torch.cuda.synchronize()
    begin = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - begin) * 1e3


def attach(pool, namespace, layout, engine, gpu_path):
    handle = lake.Pool(pool.dp, pool.mirror, namespace, cp_socket=pool.cp, layout=layout, name="fidelity")
    memory = handle.register_kv_memory(
        layout, len(engine.layers[0][0]), engine.pieces(), keep_alive=engine.layers, device=0, gpu_path=gpu_path
    )
    return handle, memory


def layout_of(config, dtype):
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    return lake.Layout(
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=name,
        block_tokens=BLOCK,
    )


def wait_published(handle, keys, count):
    for _ in range(1000):
        hits, table = handle.lookup(keys)
        if hits >= count:
            return hits, table
        time.sleep(0.005)
    return handle.lookup(keys)


def save_context(engine, cache, context_keys, hits, ids, row):
    """After a turn: the context's full blocks the engine does not hold yet
    (another conversation's, or a prefix the cap left to compute, are not
    saved twice) written into its paged cache from ``cache``, saved to the
    pool and retained; the loaded copies ``ids`` released (the engine keeps
    its own); returns once the saved blocks are published."""
    paged, handle, memory = engine.paged, engine.handle, engine.memory
    blocks = len(context_keys)
    first = hits
    while first < blocks and context_keys[first].tobytes() in engine.retained:
        first += 1
    new_ids = paged.alloc(blocks - first)
    if new_ids:
        paged.write(cache, first, new_ids)
        parent = context_keys[first - 1] if first else None
        # The save's reads wait, on the GPU, for the writes above.
        stream = torch.cuda.current_stream().cuda_stream
        request = handle.submit_save(memory, context_keys[first:], new_ids, parent=parent, stream=stream)
        saved = handle.wait(request, blocks - first, timeout=60)
        row["saves_skipped"] = int((saved != lake.OK).sum())
    for k, block in zip(context_keys[first:], new_ids):
        engine.retained[k.tobytes()] = block
    paged.release(ids)
    wait_published(handle, context_keys, blocks)


class Engine:
    """One model of the engine — the target, or the speculative-decoding
    draft beside it — with its own paged cache, namespace (its model
    fingerprint), layout and pool attachment, and its own prefix cache
    (every block it computed and saved: the reference the pool is held
    to)."""

    def __init__(self, name, shape, dtype, seed, pool, tenant, gpu_path):
        self.name = name
        self.model, self.config = build_model(shape, dtype, seed)
        self.layout = layout_of(self.config, dtype)
        self.paged = PagedCache(self.config, 4096, dtype)
        self.namespace = lake.Namespace(tenant, BLOCK, f"fidelity-{name}".encode().ljust(32, b"\0"))
        self.handle, self.memory = attach(pool, self.namespace, self.layout, self.paged, gpu_path)
        self.retained = {}

    def turn(self, prompt, reply):
        """One turn of a conversation: the prompt's prefix restored from
        the pool and checked, then the reply, then the context's new full
        blocks saved. Returns the row and the count of failed bitwise
        checks."""
        model, paged, handle, memory = self.model, self.paged, self.handle, self.memory
        full = len(prompt) // BLOCK
        keys = self.namespace.keys(np.asarray(prompt[: full * BLOCK], dtype=np.uint32))
        # Without Lake: the whole prompt.
        reference, ttft_plain = synced(lambda: forward(model, prompt, None, 0))

        # With Lake: the cached prefix, loaded, then the suffix.
        def with_lake():
            hits, table = handle.lookup(keys)
            # The engine computes at least the last prompt token.
            hits = min(hits, (len(prompt) - 1) // BLOCK)
            ids = paged.alloc(hits)
            if hits:
                statuses = handle.wait(handle.submit_load(memory, keys[:hits], table[:hits], ids), hits, timeout=60)
                if not (statuses == lake.OK).all():
                    bad = int(np.argmax(statuses != lake.OK))
                    paged.release(ids[bad:])
                    ids, hits = ids[:bad], bad
            # The restored cache (empty on a miss) goes on to hold the
            # whole prompt.
            cache = paged.dynamic(ids)
            logits = forward(model, prompt[hits * BLOCK :], cache, hits * BLOCK)
            return hits, table, ids, cache, logits

        (hits, table, ids, cache, logits), ttft_lake = synced(with_lake)
        tiers = np.asarray(table["tier"][:hits])
        row = {
            "model": self.name,
            "prompt_tokens": len(prompt),
            "hit_blocks": hits,
            "from_l1": int((tiers == 1).sum()),
            "from_l2": int((tiers == 2).sum()),
            "ttft_plain_ms": round(ttft_plain, 3),
            "ttft_lake_ms": round(ttft_lake, 3),
        }
        failures = 0
        # Bitwise: the restored blocks are the engine's own, and so are the
        # logits of its own prefix-cache-hit path.
        own = [self.retained[k.tobytes()] for k in keys[:hits]]
        if hits:
            row["kv_bitwise"] = bool(paged.equal(ids, own))
            own_logits = forward(model, prompt[hits * BLOCK :], paged.dynamic(own), hits * BLOCK)
            row["logits_bitwise_vs_own_hit"] = bool(torch.equal(own_logits, logits))
            failures += (not row["kv_bitwise"]) + (not row["logits_bitwise_vs_own_hit"])
        diff = (logits.float() - reference.float()).abs().max().item()
        row["max_abs_logit_diff_vs_recompute"] = round(diff, 6)
        row["top1_same_as_recompute"] = bool(int(logits.argmax()) == int(reference.argmax()))
        # The model is not degenerate: logits spread, top-1 varies.
        row["top1"] = int(logits.argmax())
        row["logit_std"] = round(float(logits.float().std()), 5)
        # The reply, computed on the restored cache (teacher-forced), then
        # the context's new full blocks saved and retained.
        forward(model, reply, cache, len(prompt))
        context = prompt + reply
        blocks = len(context) // BLOCK
        context_keys = self.namespace.keys(np.asarray(context[: blocks * BLOCK], dtype=np.uint32))
        save_context(self, cache, context_keys, hits, ids, row)
        return row, failures


class HybridEngine:
    """A hybrid linear-attention model (Qwen3-Next: Gated DeltaNet layers
    with a full-attention layer every fourth) as an engine would pool it:
    the attention layers' KV as blocks (a layout of those layers alone),
    and the linear layers' conv and recurrent state as checkpoint objects
    of their own (a :class:`lake.StateLayout`, its own attachment), taken
    after every ``every``-th block and after each context's last full
    block, keyed by that block (``lake.state_keys``). A prompt resumes from
    the deepest checkpoint at or below its KV hit (``Pool.lookup_state``):
    the KV of the blocks before it and the state are loaded, the rest is
    computed. The reference is the engine's own: every block and
    checkpoint it computed, retained on the GPU."""

    def __init__(self, dtype, seed, every):
        from transformers import DynamicCache

        self.name, self.every = "hybrid", every
        self.model, self.config = build_model("hybrid", dtype, seed)
        types = self.config.layer_types
        self.full = [i for i, t in enumerate(types) if t == "full_attention"]
        self.linear = [i for i, t in enumerate(types) if t == "linear_attention"]
        self.layout = lake.Layout(
            layers=len(self.full),
            kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
            block_tokens=BLOCK,
        )
        self.paged = PagedCache(self.config, 4096, dtype, model_layers=self.full)
        # The state's geometry, as this transformers keeps it.
        probe = DynamicCache(config=self.config)
        forward(self.model, [1] * BLOCK, probe, 0)
        # Per linear layer: (shape, dtype, bytes) of its conv and recurrent state.
        self.shapes = []
        for i in self.linear:
            layer = probe.layers[i]
            states = (layer.conv_states[0], layer.recurrent_states[0])
            self.shapes.append([(t.shape, t.dtype, t.numel() * t.element_size()) for t in states])
        per_layer = sum(n for _, _, n in self.shapes[0])
        self.state_layout = lake.StateLayout(
            layers=len(self.linear), state_bytes_per_layer=per_layer, dtype="float32", shard_code=self.layout.shard_code
        )
        self.slot_bytes = max(self.layout.block_bytes, self.state_layout.block_bytes)
        self.retained, self.checkpoints = {}, {}

    def attach(self, pool, tenant, gpu_path):
        self.namespace = lake.Namespace(tenant, BLOCK, b"fidelity-hybrid".ljust(32, b"\0"))
        self.handle, self.memory = attach(pool, self.namespace, self.layout, self.paged, gpu_path)
        self.state_handle = lake.Pool(
            pool.dp, pool.mirror, self.namespace, cp_socket=pool.cp, layout=self.state_layout, name="fidelity-state"
        )
        # Pinned host slots the checkpoints cross in (two: one loaded, one saved).
        self.state_host = torch.zeros((2, self.state_layout.block_bytes), dtype=torch.uint8, pin_memory=True)
        self.state_memory = self.state_handle.register_host_memory(self.state_host.numpy())

    def snapshot(self, cache):
        """The linear layers' state now, as checkpoint bytes (on the GPU)."""
        parts = []
        for i in self.linear:
            layer = cache.layers[i]
            for t in (layer.conv_states[0], layer.recurrent_states[0]):
                parts.append(t.contiguous().view(torch.uint8).reshape(-1))
        return torch.cat(parts)

    def cache(self, ids, state):
        """A cache resuming after ``len(ids)`` blocks: their KV in the
        attention layers, checkpoint ``state`` (GPU bytes) in the others."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        if not ids:
            return cache
        for j, m in enumerate(self.full):
            k, v = self.paged.layer(j, ids)
            cache.update(k, v, m)
        offset = 0
        for i, shapes in zip(self.linear, self.shapes):
            tensors = []
            for shape, kind, n in shapes:
                tensors.append(state[offset : offset + n].clone().view(kind).reshape(shape))
                offset += n
            layer = cache.layers[i]
            layer.lazy_initialization(conv_states=tensors[0], recurrent_states=tensors[1])
            layer.conv_states[0].copy_(tensors[0])
            layer.recurrent_states[0].copy_(tensors[1])
            layer.has_previous_state[0] = True
        return cache

    def run(self, tokens, cache, start, cuts):
        """Forward ``tokens`` from position ``start``, split at the block
        positions ``cuts`` (a checkpoint is taken at each); returns the
        last token's logits and ``{position: state bytes}``."""
        taken, at, logits = {}, start, None
        ends = {c * BLOCK for c in cuts if start < c * BLOCK <= start + len(tokens)} | {start + len(tokens)}
        for cut in sorted(ends):
            if cut > at:
                logits = forward(self.model, tokens[at - start : cut - start], cache, at)
                at = cut
            if cut % BLOCK == 0 and cut // BLOCK in cuts:
                taken[cut // BLOCK] = self.snapshot(cache)
        return logits, taken

    def turn(self, prompt, reply):
        model, paged, handle, memory = self.model, self.paged, self.handle, self.memory
        context = prompt + reply
        blocks = len(context) // BLOCK
        context_keys = self.namespace.keys(np.asarray(context[: blocks * BLOCK], dtype=np.uint32))
        full = len(prompt) // BLOCK
        keys = context_keys[:full]
        cap = (len(prompt) - 1) // BLOCK
        reference, ttft_plain = synced(lambda: forward(model, prompt, None, 0))

        def cuts(start):
            return {p for p in range(start + 1, blocks + 1) if p % self.every == 0 or p == blocks}

        def with_lake():
            hits, table, at, where = self.state_handle.lookup_state(keys[:cap])
            ids, state = paged.alloc(at), None
            if at:
                request = handle.submit_load(memory, keys[:at], table[:at], ids)
                checkpoint = lake.state_keys(keys[at - 1 : at])
                state_request = self.state_handle.submit_load(self.state_memory, checkpoint, where, [0])
                statuses = handle.wait(request, at, timeout=60)
                state_ok = (self.state_handle.wait(state_request, 1, timeout=60) == lake.OK).all()
                if not ((statuses == lake.OK).all() and state_ok):
                    # A hybrid cannot resume part way without its state: compute it all.
                    paged.release(ids)
                    ids, at = [], 0
                else:
                    state = self.state_host[0].to("cuda", non_blocking=True)
            cache = self.cache(ids, state)
            logits, taken = self.run(prompt[at * BLOCK :], cache, at * BLOCK, cuts(at))
            return hits, table, at, where, ids, state, cache, logits, taken

        (hits, table, at, where, ids, state, cache, logits, taken), ttft_lake = synced(with_lake)
        tiers = np.asarray(table["tier"][:at])
        row = {
            "model": self.name,
            "prompt_tokens": len(prompt),
            "kv_hit_blocks": hits,
            "hit_blocks": at,
            "from_l1": int((tiers == 1).sum()),
            "from_l2": int((tiers == 2).sum()),
            "state_tier": int(where["tier"][0]) if at else 0,
            "ttft_plain_ms": round(ttft_plain, 3),
            "ttft_lake_ms": round(ttft_lake, 3),
        }
        failures = 0
        if at:
            own = [self.retained[k.tobytes()] for k in keys[:at]]
            own_state = self.checkpoints[keys[at - 1].tobytes()]
            row["kv_bitwise"] = bool(paged.equal(ids, own))
            row["state_bitwise"] = bool(torch.equal(state, own_state))
            own_logits, _ = self.run(prompt[at * BLOCK :], self.cache(own, own_state), at * BLOCK, cuts(at))
            row["logits_bitwise_vs_own_hit"] = bool(torch.equal(own_logits, logits))
            failures += sum(not row[k] for k in ("kv_bitwise", "state_bitwise", "logits_bitwise_vs_own_hit"))
        diff = (logits.float() - reference.float()).abs().max().item()
        row["max_abs_logit_diff_vs_recompute"] = round(diff, 6)
        row["top1_same_as_recompute"] = bool(int(logits.argmax()) == int(reference.argmax()))
        # How near a tie the recomputation's top two are: a top-1 that
        # differs where this is within the logit difference is a near-tie
        # the chunking broke the other way, not a wrong state.
        top2 = reference.float().topk(2).values
        row["recompute_top1_margin"] = round(float(top2[0] - top2[1]), 6)
        row["top1"] = int(logits.argmax())
        row["logit_std"] = round(float(logits.float().std()), 5)
        # The reply (teacher-forced), checkpointing on the way; then the
        # new blocks saved, and once they are published, the checkpoints
        # under them.
        _, later = self.run(reply, cache, len(prompt), cuts(at))
        taken.update(later)
        save_context(self, cache, context_keys, at, ids, row)
        saved_states = 0
        for position, bytes_ in sorted(taken.items()):
            key = context_keys[position - 1]
            if key.tobytes() in self.checkpoints:
                continue
            self.checkpoints[key.tobytes()] = bytes_
            self.state_host[1].copy_(bytes_)
            request = self.state_handle.submit_save(
                self.state_memory, lake.state_keys(key[None]), [1], parent=key, priority=lake.PRIORITY["write_back"]
            )
            saved_states += int((self.state_handle.wait(request, 1, timeout=60) == lake.OK).all())
        row["checkpoints_saved"] = saved_states
        # Published before the conversation's next turn looks for them.
        deepest = max((p for p in taken if p % self.every == 0 or p == blocks), default=0)
        for _ in range(1000):
            if self.state_handle.lookup_state(context_keys[:deepest])[2] >= deepest:
                break
            time.sleep(0.005)
        return row, failures

    def close(self):
        detach(self.state_handle)


def summary_of(rows, name, args):
    rows = [r for r in rows if r["model"] == name]
    return {
        "summary": "fidelity",
        "model": name,
        "dtype": args.dtype,
        "gpu_path": args.gpu_path,
        "turns": len(rows),
        "hit_blocks": sum(r["hit_blocks"] for r in rows),
        "from_l1": sum(r["from_l1"] for r in rows),
        "from_l2": sum(r["from_l2"] for r in rows),
        "kv_bitwise_failures": sum(1 for r in rows if r.get("kv_bitwise") is False),
        "logits_bitwise_failures": sum(1 for r in rows if r.get("logits_bitwise_vs_own_hit") is False),
        "top1_agreement": round(sum(r["top1_same_as_recompute"] for r in rows) / len(rows), 4),
        "distinct_top1": len({r["top1"] for r in rows}),
        "logit_std_min": min(r["logit_std"] for r in rows),
        "max_abs_logit_diff_vs_recompute": max(r["max_abs_logit_diff_vs_recompute"] for r in rows),
        "saves_skipped": sum(r.get("saves_skipped", 0) for r in rows),
        **(
            {
                "kv_hit_blocks": sum(r["kv_hit_blocks"] for r in rows),
                "state_from_l1": sum(1 for r in rows if r["state_tier"] == 1),
                "state_from_l2": sum(1 for r in rows if r["state_tier"] == 2),
                "state_bitwise_failures": sum(1 for r in rows if r.get("state_bitwise") is False),
                "checkpoints_saved": sum(r["checkpoints_saved"] for r in rows),
                "top1_differs_beyond_twice_the_logit_diff": sum(
                    1
                    for r in rows
                    if not r["top1_same_as_recompute"]
                    and r["recompute_top1_margin"] > 2 * r["max_abs_logit_diff_vs_recompute"]
                ),
            }
            if name == "hybrid"
            else {}
        ),
        "ttft_plain_ms_median": float(np.median([r["ttft_plain_ms"] for r in rows])),
        "ttft_lake_ms_median": float(np.median([r["ttft_lake_ms"] for r in rows])),
    }


def fidelity(args):
    dtype = DTYPES[args.dtype]
    rng = np.random.default_rng(args.seed)
    tenant = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    if args.mode == "hybrid":
        hybrid = HybridEngine(dtype, args.seed, args.checkpoint_every)
        # The slots fit the larger of a KV block and a checkpoint.
        pool = Pool(args.lake, hybrid.slot_bytes, args.l1_slots, 2048)
        hybrid.attach(pool, tenant, args.gpu_path)
        engines = [hybrid]
    else:
        # The pool's slots fit the larger (the target's) blocks.
        target_layout = layout_of(build_config("small"), dtype)
        pool = Pool(args.lake, target_layout.block_bytes, args.l1_slots, 4096)
        engines = [Engine("small", "small", dtype, args.seed, pool, tenant, args.gpu_path)]
        if args.draft:
            engines.append(Engine("draft", "draft", dtype, args.seed + 1, pool, tenant, args.gpu_path))
    vocab = engines[0].config.vocab_size
    system = rng.integers(0, vocab, args.system_tokens).tolist()
    conversations = [list(system) for _ in range(args.conversations)]
    rows, failures = [], 0
    # Warm the kernels and the models (not timed).
    for engine in engines:
        forward(engine.model, system[:64], None, 0)
    for turn in range(args.turns):
        for c in range(len(conversations)):
            message = rng.integers(0, vocab, int(rng.integers(24, 96))).tolist()
            reply = rng.integers(0, vocab, int(rng.integers(16, 48))).tolist()
            prompt = conversations[c] + message
            for engine in engines:
                row, failed = engine.turn(prompt, reply)
                row = {"turn": turn, "conversation": c, **row}
                failures += failed
                rows.append(row)
                print(json.dumps(row), flush=True)
            conversations[c] = prompt + reply
    summaries = [summary_of(rows, engine.name, args) for engine in engines]
    for summary in summaries:
        print(json.dumps(summary), flush=True)
    with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
        for r in rows + summaries:
            f.write(json.dumps(r) + "\n")
    if args.mode == "fidelity":
        plot([r for r in rows if r["model"] == "small"], os.path.join(args.out, "ttft_per_turn.png"))
    for engine in engines:
        if hasattr(engine, "close"):
            engine.close()
        detach(engine.handle)
    pool.stop()
    return failures


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", flush=True)
        return
    turns = sorted({r["turn"] for r in rows})
    plain = [np.median([r["ttft_plain_ms"] for r in rows if r["turn"] == t]) for t in turns]
    withlake = [np.median([r["ttft_lake_ms"] for r in rows if r["turn"] == t]) for t in turns]
    tokens = [np.median([r["prompt_tokens"] for r in rows if r["turn"] == t]) for t in turns]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(turns, plain, "o-", label="recompute the whole prompt")
    ax.plot(turns, withlake, "s-", label="Lake: load the cached prefix, compute the rest")
    ax.set_xlabel("turn (median over conversations)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT per turn, small random Qwen3-shaped model, H200")
    for t, p, n in zip(turns, plain, tokens):
        ax.annotate(f"{int(n)} tok", (t, p), textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ttft(args):
    dtype = torch.bfloat16
    began = time.perf_counter()
    model, config = build_model("qwen3-8b", dtype, args.seed)
    note(f"model built in {time.perf_counter() - began:.1f} s")
    layout = layout_of(config, dtype)
    rng = np.random.default_rng(args.seed)
    most = max(args.tokens) // BLOCK
    engine = PagedCache(config, 2 * most + 8, dtype)
    # L1 holds every size's blocks with room above the tier's high-water
    # mark: nothing measured is demoted under the measurement.
    pool = Pool(args.lake, layout.block_bytes, int(sum(t // BLOCK for t in args.tokens) * 1.15) + 128, 64)
    failures = 0
    forward(model, rng.integers(0, config.vocab_size, 128).tolist(), None, 0)
    out = open(os.path.join(args.out, "ttft.json"), "w")
    for n in args.tokens:
        namespace = lake.Namespace(bytes(rng.integers(0, 256, 32, dtype=np.uint8)), BLOCK, b"ttft-8b".ljust(32, b"\0"))
        handle, memory = attach(pool, namespace, layout, engine, args.gpu_path)
        prompt = rng.integers(0, config.vocab_size, n + 1).tolist()
        blocks = n // BLOCK
        keys = namespace.keys(np.asarray(prompt[:n], dtype=np.uint32))
        prefill = []
        for _ in range(args.repeats):
            logits_full, ms = synced(lambda: forward(model, prompt, None, 0))
            prefill.append(ms)
        note(f"{n} tokens: prefill {prefill} ms, logit std {float(logits_full.float().std()):.4f}")
        # The engine computed the prompt once and saved its blocks.
        from transformers import DynamicCache

        cache = DynamicCache()
        forward(model, prompt[:n], cache, 0)
        own = engine.alloc(blocks)
        engine.write(cache, 0, own)
        torch.cuda.current_stream().synchronize()
        del cache
        statuses = handle.wait(handle.submit_save(memory, keys, own), blocks, timeout=300)
        assert (statuses == lake.OK).all(), f"saves skipped: {np.unique(statuses, return_counts=True)}"
        hits, _ = wait_published(handle, keys, blocks)
        assert hits == blocks, f"{hits} of {blocks} published"
        note(f"{n} tokens: saved and published")
        own_logits = forward(model, prompt[n:], engine.dynamic(own), n)
        # The engine's own path twice: is it deterministic at all?
        own_again = forward(model, prompt[n:], engine.dynamic(own), n)
        checks = {"own_path_deterministic": bool(torch.equal(own_logits, own_again))}
        # Where a whole load's time goes (one untimed run, each stage synced).
        ids = engine.alloc(blocks)
        (found, table), t_lookup = synced(lambda: handle.lookup(keys))
        _, t_load = synced(lambda: handle.wait(handle.submit_load(memory, keys, table, ids), blocks, timeout=300))
        restored, t_build = synced(lambda: engine.dynamic(ids))
        _, t_forward = synced(lambda: forward(model, prompt[n:], restored, n))
        checks["stages_ms"] = {
            "lookup": round(t_lookup, 2),
            "load": round(t_load, 2),
            "build_cache": round(t_build, 2),
            "forward_one_token": round(t_forward, 2),
        }
        del restored
        engine.release(ids)
        whole, layered = [], []
        for r in range(args.repeats):
            ids = engine.alloc(blocks)

            def lake_whole():
                found, table = handle.lookup(keys)
                statuses = handle.wait(handle.submit_load(memory, keys, table, ids), blocks, timeout=300)
                assert found == blocks and (statuses == lake.OK).all()
                return forward(model, prompt[n:], engine.dynamic(ids), n)

            logits, ms = synced(lake_whole)
            whole.append(ms)
            kv_ok, logits_ok = engine.equal(ids, own), bool(torch.equal(logits, own_logits))
            checks[f"whole{r}"] = {"kv_bitwise": kv_ok, "logits_bitwise": logits_ok}
            failures += not kv_ok
            engine.release(ids)
            ids = engine.alloc(blocks)

            def lake_layered():
                found, table = handle.lookup(keys)
                # The index goes to the GPU before the load: a copy from
                # pageable memory inside a hook would hold the host until
                # the stream reached it, behind that layer's wait.
                index = torch.as_tensor(ids, device="cuda")
                request = handle.submit_load(memory, keys, table, ids)
                stream = torch.cuda.current_stream().cuda_stream
                cache = engine.placeholder(n)
                hooks = []
                for layer_index, block in enumerate(model.model.layers):
                    def pre(module, inputs, layer_index=layer_index):
                        # The layer's attention waits on the GPU (not the
                        # host) for its KV to land, then takes it.
                        handle.wait_layer(request, layer_index, stream)
                        engine.layer_into(layer_index, index, *layer_kv(cache)[layer_index])
                    hooks.append(block.register_forward_pre_hook(pre))
                try:
                    logits = forward(model, prompt[n:], cache, n)
                finally:
                    for h in hooks:
                        h.remove()
                statuses = handle.wait(request, blocks, timeout=300)
                assert found == blocks and (statuses == lake.OK).all()
                return logits

            logits, ms = synced(lake_layered)
            layered.append(ms)
            kv_ok, logits_ok = engine.equal(ids, own), bool(torch.equal(logits, own_logits))
            checks[f"layered{r}"] = {"kv_bitwise": kv_ok, "logits_bitwise": logits_ok}
            failures += not kv_ok
            engine.release(ids)
        nbytes = blocks * layout.block_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        h2d = min(synced(lambda: device.copy_(host, non_blocking=True))[1] for _ in range(3))
        kv_ms = h2d
        best_prefill = min(prefill)
        row = {
            "tokens": n,
            "kv_bytes": nbytes,
            "prefill_ms": round(best_prefill, 2),
            "ttft_lake_whole_ms": round(min(whole), 2),
            "ttft_lake_layered_ms": round(min(layered), 2),
            "raw_h2d_ms": round(kv_ms, 2),
            "raw_h2d_gbps": round(nbytes / kv_ms / 1e6, 2),
            "bound": round(best_prefill / kv_ms, 2),
            "speedup_whole": round(best_prefill / min(whole), 2),
            "speedup_layered": round(best_prefill / min(layered), 2),
            "ratio_whole": round(kv_ms / min(whole), 3),
            "ratio_layered": round(kv_ms / min(layered), 3),
            "ratio_goal": 0.8,
            "kv_bitwise_failures": failures,
            "checks": checks,
            "top1_same_as_recompute": bool(int(own_logits.argmax()) == int(logits_full.argmax())),
        }
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        engine.release(own)
        detach(handle)
        del host, device
        torch.cuda.empty_cache()
    out.close()
    pool.stop()
    return failures


def detach(handle):
    """Detaches, saying how long it took (a hang prints where, and exits)."""
    began = time.perf_counter()
    faulthandler.dump_traceback_later(30, exit=True)
    handle.close()
    faulthandler.cancel_dump_traceback_later()
    note(f"detached in {time.perf_counter() - began:.2f} s")


def note(text):
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["fidelity", "hybrid", "ttft"])
    parser.add_argument("--lake", required=True, help="the `lake` binary")
    parser.add_argument("--out", default=".")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--gpu-path", default="copy_engine", choices=["direct", "copy_engine"])
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--l1-slots", type=int, default=160)
    parser.add_argument(
        "--no-draft", dest="draft", action="store_false", help="fidelity without the speculative-decoding draft model"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=8, help="hybrid: blocks between recurrent-state checkpoints"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch's deterministic algorithms (and cuBLAS's fixed workspace): the same inputs give the same bits",
    )
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU here (the harness runs on the GPU machine)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    failures = ttft(args) if args.mode == "ttft" else fidelity(args)
    if failures:
        print(f"FAILED: {failures} bitwise checks", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
