"""Ray cluster start/attach and the worker actor shells."""
