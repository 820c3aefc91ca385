"""A tiny Qwen3 written to a directory: a config and seeded random
safetensors, so real vLLM loads real weights with nothing fetched.

The weights are drawn wide enough (std 0.2 where transformers' default
is 0.02) that the next token depends on the whole context: with vLLM's
dummy weights, or the default scale, the logits are nearly uniform and
wrong KV would go unseen."""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1024
HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
SEED = 20261203


def config(max_positions: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": VOCAB + 1,
    }


def write(directory: Path, max_positions: int = 32768) -> Path:
    """Writes the model once; a directory already holding it is kept."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / "model.safetensors"
    if weights.exists():
        return directory
    generator = torch.Generator().manual_seed(SEED)

    def normal(*shape, std=0.2):
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0), "model.norm.weight": ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(HIDDEN),
            p + "post_attention_layernorm.weight": ones(HIDDEN),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, std=0.05),
            p + "self_attn.q_norm.weight": ones(HEAD_DIM),
            p + "self_attn.k_norm.weight": ones(HEAD_DIM),
            p + "mlp.gate_proj.weight": normal(2 * HIDDEN, HIDDEN, std=0.05),
            p + "mlp.up_proj.weight": normal(2 * HIDDEN, HIDDEN, std=0.05),
            p + "mlp.down_proj.weight": normal(HIDDEN, 2 * HIDDEN, std=0.05),
        }
    tensors["lm_head.weight"] = normal(VOCAB, HIDDEN, std=0.5)
    (directory / "config.json").write_text(json.dumps(config(max_positions), indent=1))
    partial = directory / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    partial.rename(weights)
    return directory


def hybrid_config(max_positions: int):
    """A tiny Qwen3-Next: a Gated DeltaNet layer (vLLM keeps its conv and
    recurrent state in a state group) and a full-attention layer. vLLM
    wants one mixture-of-experts layer in it; its CPU build runs Gated
    DeltaNet in bfloat16 only. Two value heads keep the layer's state
    (35 KB in float32, the state dtype vLLM's CPU build takes on a CPU
    with AVX-512 BF16) within one 128-token attention page, so vLLM keeps
    the tests' block size on every CPU instead of doubling it."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        moe_intermediate_size=HIDDEN,
        shared_expert_intermediate_size=HIDDEN,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=0.2,
        partial_rotary_factor=0.25,
        bos_token_id=0,
        eos_token_id=VOCAB - 1,
    )


def write_hybrid(directory: Path, max_positions: int = 32768) -> Path:
    """Writes the tiny hybrid once (transformers' own initialisation,
    seeded), with weights that make the next token depend on the prefix:
    unit-scale embeddings, a wide output head, sharp attention (q/k norms
    of 3) and a slowly decaying state (A_log -4)."""
    import torch
    from transformers import Qwen3NextForCausalLM

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(hybrid_config(max_positions))
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("embed_tokens.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif name.endswith("lm_head.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.fill_(3.0)
            elif name.endswith("A_log"):
                tensor.fill_(-4.0)
    # Written aside, then renamed over the (absent or empty) directory.
    partial = directory.parent / (directory.name + ".partial")
    model.to(torch.bfloat16).save_pretrained(partial)
    partial.rename(directory)
    return directory


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
