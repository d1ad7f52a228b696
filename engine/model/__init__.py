"""A model: its config and per-layer description, weights, linears over packed codes, RoPE, the forward."""
