"""A deterministic CPU stand-in for a decode engine (the F4 case).

Its "model": a block's KV is a function of the previous block's KV and
the block's tokens (a chain, like attention's); the next token is a
function of the last full block's KV and the tokens after it. So an
engine that resumes from restored KV produces the same tokens only if
every restored byte is right.

Run as a process (``python3 f4_engine.py DP MIRROR CP BLOCK_BYTES SEED
PROMPT_TOKENS NEW_TOKENS``) it prefills, then decodes one token at a
time, printing each as it is produced (the stream a client sees) and
saving each block as it fills (write-back to the pool). The test kills
it mid-generation."""

import hashlib
import sys
import time

import numpy as np

import lake

TOKENS = 16
VOCAB = 50_000
# The pool refusing a save for now: full, only its load reserve free, or
# refusing saves for a while after such a refusal.
TRY_AGAIN = (lake.NO_SPACE, lake.LOAD_RESERVE, lake.SAVE_PRESSURE)


def namespace(seed):
    return lake.Namespace(hashlib.blake2b(f"f4-{seed}".encode(), digest_size=32).digest(), TOKENS, b"f4".ljust(32, b"\0"))


def prompt(seed, count):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, VOCAB, count)]


def block_kv(previous: bytes, tokens, block_bytes: int) -> bytes:
    """The KV of a block: the previous block's and its tokens, expanded."""
    seed = hashlib.blake2b(previous[:64] + np.asarray(tokens, dtype=np.uint32).tobytes(), digest_size=32).digest()
    out = bytearray()
    counter = 0
    while len(out) < block_bytes:
        out += hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    return bytes(out[:block_bytes])


def next_token(last_kv: bytes, since) -> int:
    digest = hashlib.blake2b(last_kv[:64] + np.asarray(since, dtype=np.uint32).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class Engine:
    """The model's state: tokens so far and the KV of every full block."""

    def __init__(self, block_bytes, tokens=(), kv=()):
        self.block_bytes = block_bytes
        self.tokens = list(tokens)
        self.kv = list(kv)
        # KV of full blocks not computed yet (a resume recomputes what was lost).
        while len(self.kv) < len(self.tokens) // TOKENS:
            self._extend()

    def _extend(self):
        i = len(self.kv)
        previous = self.kv[-1] if self.kv else b""
        self.kv.append(block_kv(previous, self.tokens[i * TOKENS : (i + 1) * TOKENS], self.block_bytes))

    def step(self) -> int:
        """Decodes one token; returns it. A block that fills gets its KV."""
        last = self.kv[-1] if self.kv else b""
        token = next_token(last, self.tokens[len(self.kv) * TOKENS :])
        self.tokens.append(token)
        if len(self.tokens) % TOKENS == 0:
            self._extend()
        return token


def reference(block_bytes, seed, prompt_tokens, new_tokens):
    """The whole generation, uninterrupted, with no pool."""
    engine = Engine(block_bytes, prompt(seed, prompt_tokens))
    return [engine.step() for _ in range(new_tokens)]


def main(dp, mirror, cp, block_bytes, seed, prompt_tokens, new_tokens):
    block_bytes, seed, prompt_tokens, new_tokens = int(block_bytes), int(seed), int(prompt_tokens), int(new_tokens)
    ns = namespace(seed)
    pool = lake.Pool(dp, mirror, ns, cp_socket=cp, segment_bytes=4096, name="f4-decode")
    memory = np.zeros((1, block_bytes), dtype=np.uint8)
    memory_id = pool.register_host_memory(memory)
    engine = Engine(block_bytes, prompt(seed, prompt_tokens))
    saved = 0

    def save_full_blocks():
        nonlocal saved
        keys = ns.keys(np.asarray(engine.tokens[: len(engine.kv) * TOKENS], dtype=np.uint32))
        while saved < len(engine.kv):
            memory[0] = np.frombuffer(engine.kv[saved], dtype=np.uint8)
            parent = keys[saved - 1] if saved else None
            # A save the pool skips for want of an L1 slot (its tier
            # manager is still demoting) is tried again, for a while.
            deadline = time.monotonic() + 10
            while True:
                statuses = pool.wait(pool.submit_save(memory_id, keys[saved : saved + 1], [0], parent=parent), 1)
                if statuses[0] == lake.OK:
                    break
                if statuses[0] not in TRY_AGAIN or time.monotonic() > deadline:
                    raise SystemExit(f"save of block {saved} failed: {statuses[0]}")
                time.sleep(0.01)
            saved += 1

    save_full_blocks()
    print("ready", flush=True)
    for _ in range(new_tokens):
        print(engine.step(), flush=True)
        save_full_blocks()
        time.sleep(0.002)
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:8])
