"""What differs between the transformers releases this project supports (``pyproject.toml``: 5.17
up to, not including, 6), in one place.

The KV-cache keyword of a forward pass: transformers 5.24 renamed ``past_key_values=`` to ``cache=``
(``Qwen2_5_VLTextModel.forward`` is decorated ``@deprecate_kwarg("past_key_values", "5.40.0",
new_name="cache")``). 5.17-5.23 take only ``past_key_values=`` and let an unknown ``cache=`` fall
into ``**kwargs``, where it is silently ignored: the forward then builds a fresh cache of its own,
so a prefix pass returns no keys/values and a decode step attends to nothing cached. 5.24+ still
accept ``past_key_values=``, with a deprecation warning. :func:`cache_kwargs` reads the keyword off
the forward's signature (``inspect.signature`` follows the decorators' ``functools.wraps``), so
every call site passes the cache under the name the installed release reads.

The model paths are tested on 5.17 (the H200 machine's), 5.19 (SGLang 0.5.23's pin) and the current
release (``make test-transformers-floor`` runs them on the floor; docs/sglang.md).
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=None)
def cache_keyword(module_type: type) -> str:
    """``"cache"`` when ``module_type.forward`` takes ``cache=`` (transformers >= 5.24), else
    ``"past_key_values"``.

    Raises:
        TypeError: the forward takes neither (not a transformers model with a KV cache).
    """
    params = inspect.signature(module_type.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{module_type.__name__}.forward takes neither cache= nor past_key_values=")


def cache_kwargs(module: torch.nn.Module, cache) -> dict:
    """``{keyword: cache}`` for ``module``'s forward under the installed transformers (module docstring).

    Args:
        module: a transformers model (``Qwen2_5_VLTextModel``, ``Qwen2_5_VLModel``, ...).
        cache: a ``transformers.cache_utils.Cache``.
    """
    return {cache_keyword(type(module)): cache}
