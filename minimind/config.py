"""MiniMindConfig: the hyper-parameters of a MiniMind-3 model, dense or MoE."""

import math

from transformers import PretrainedConfig


class MiniMindConfig(PretrainedConfig):
    """Configuration of a MiniMind-3 (Qwen3-style) decoder; defaults are the public 64M model."""

    model_type = "minimind"
    keys_to_ignore_at_inference = ["past_key_values"]

    # Declarative parallel plans, keyed like transformers' (module paths under the base model).
    # Sluice's TP pass reads these; the model itself never looks at them.
    base_model_tp_plan = {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        # Per-head norms are replicated but each TP rank sees only its heads: their gradients are partial.
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.mlp.experts.*.gate_proj": "colwise",
        "layers.*.mlp.experts.*.up_proj": "colwise",
        "layers.*.mlp.experts.*.down_proj": "rowwise",
    }
    # Expert parallelism (Sluice's EP pass): the module holding each MoE layer's experts, split over the ep group.
    base_model_ep_plan = {"layers.*.mlp.experts": "ep_dispatch_experts"}
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(
        self,
        vocab_size: int = 6400,
        hidden_size: int = 768,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1e6,
        inference_rope_scaling: bool = False,
        head_dim: int | None = None,
        dropout: float = 0.0,
        flash_attn: bool = True,
        use_moe: bool = False,
        num_experts: int = 4,
        num_experts_per_tok: int = 1,
        moe_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        router_aux_loss_coef: float = 5e-4,
        initializer_range: float = 0.02,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        pad_token_id: int = 0,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        kwargs.pop("rope_scaling", None)  # derived from inference_rope_scaling (see yarn_scaling)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        # SwiGLU width: hidden * pi rounded up to a multiple of 64 (2432 for hidden 768).
        self.intermediate_size = intermediate_size or math.ceil(hidden_size * math.pi / 64) * 64
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.inference_rope_scaling = inference_rope_scaling
        self.dropout = dropout
        self.flash_attn = flash_attn  # kept for MiniMind config compatibility; SDPA picks the kernel
        self.use_moe = use_moe
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or self.intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        self.initializer_range = initializer_range
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def yarn_scaling(self) -> dict | None:
        """MiniMind's YaRN settings, active only for long-context inference."""
        if not self.inference_rope_scaling:
            return None
        return {"factor": 16, "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1,
                "attention_factor": 1.0}
