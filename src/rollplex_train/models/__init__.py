"""Loading HF VLM checkpoints, M-RoPE positions, log-prob passes, tiny checkpoint builder."""
