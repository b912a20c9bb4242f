"""Tiny random HuggingFace MoE models for the transformers integration tests (CPU and GPU)."""
from __future__ import annotations

import copy

import torch

VOCAB = 96


def tiny_config(name: str, **overrides):
    """A transformers config of model ``name`` small enough for CPU tests: 2 decoder layers,
    8 experts, top-2 (every layer an MoE layer)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4 if name == "deepseek_v3" else 2,
                  max_position_embeddings=128, tie_word_embeddings=False)
    if name == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, head_dim=8, intermediate_size=48,
                                   moe_intermediate_size=24, num_experts=8,
                                   num_experts_per_tok=2, norm_topk_prob=True,
                                   decoder_sparse_step=1, mlp_only_layers=[])
    elif name == "mixtral":
        config = tf.MixtralConfig(**common, head_dim=8, intermediate_size=24, num_local_experts=8,
                                  num_experts_per_tok=2)
    elif name == "olmoe":
        config = tf.OlmoeConfig(**common, intermediate_size=24, num_experts=8,
                                num_experts_per_tok=2, eos_token_id=VOCAB - 1,
                                pad_token_id=VOCAB - 2)
    elif name == "qwen2_moe":
        config = tf.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=40, num_experts=8,
                                   num_experts_per_tok=2, decoder_sparse_step=1,
                                   mlp_only_layers=[])
    elif name == "deepseek_v3":
        config = tf.DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=24,
                                     n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                     topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
                                     kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                     qk_nope_head_dim=8, v_head_dim=8)
    else:
        raise ValueError(f"name: unknown tiny model {name!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(name: str, seed: int, dtype=torch.float32, device="cpu", **overrides):
    """A freshly initialised (seeded) causal LM of ``name`` on ``device`` in ``dtype``, with
    transformers' ``grouped_mm`` experts backend and SDPA attention."""
    import transformers as tf

    config = tiny_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                    experts_implementation="grouped_mm")
        # Routers start at zero in some models (every token ties); give them random weights.
        for module_name, p in model.named_parameters():
            if p.dim() == 2 and p.abs().sum() == 0:
                with torch.no_grad():
                    p.normal_(0.0, 0.5)
    return model.to(device=device, dtype=dtype)


def seed_of(gen: torch.Generator) -> int:
    """A fresh seed drawn from the test's generator."""
    return int(torch.randint(1 << 20, (1,), generator=gen))


def twin(model, implementation: str):
    """A deep copy of ``model`` running its experts through ``implementation`` (registering
    the "graphstash" backend first when that is the one)."""
    import graphstash.integrations.transformers as gst

    if implementation == gst.IMPLEMENTATION:
        gst.register()
    other = copy.deepcopy(model)
    other.set_experts_implementation(implementation)
    return other


def batch(gen: torch.Generator, batch_size: int = 2, seq_len: int = 24, device="cpu"):
    """Token ids ``[batch_size, seq_len]`` (labels are the same ids: a causal LM shifts them)."""
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=gen)
    return ids.to(device)
