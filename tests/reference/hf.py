"""Small Hugging Face configs: random init, a few thousand parameters, byte-level data."""

SMALL = {
    "hf:llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "hf:gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4},
}
SMALL["hf:mixtral"] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
