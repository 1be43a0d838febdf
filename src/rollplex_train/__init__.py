"""rollplex-train: synchronous on-policy RL for vision-language models."""
