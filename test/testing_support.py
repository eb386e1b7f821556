"""Test data and helpers shared by several test modules (not fixtures)."""

# A tiny DeepSeek-V3.2 (NSA, MLA) config: the shapes of the real model, two dense layers.
TINY_DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 2048,
    "moe_intermediate_size": 256, "first_k_dense_replace": 2, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "vocab_size": 8192,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}
# DeepSeek-V3 (MLA without the NSA indexer): shared KV must refuse it.
TINY_DSV3 = {k: v for k, v in TINY_DSV32.items() if not k.startswith("index_")}
TINY_DSV3.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")



def shared_kv_kwargs(model_path, **overrides):
    """ServerArgs keywords of a valid shared-KV prefill server (CP2 in-seq-split)."""
    kwargs = dict(
        model_path=model_path, skip_tokenizer_init=True, device="cuda", tp_size=2,
        enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode="in-seq-split",
        disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
        enable_nsa_prefill_cp_shared_kv=True,
    )
    kwargs.update(overrides)
    return kwargs
