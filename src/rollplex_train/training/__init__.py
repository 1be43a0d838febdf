"""Training engines: the protocol, the torch backend, the Megatron adapter."""
