"""efficient_attention: exact and efficient attention in PyTorch, for the course.

Everything is importable from the top level::

    import efficient_attention as ea
    out = ea.softmax_attention(q, k, v, causal=True)
"""

from importlib import import_module

# The one list of the package's public modules: each is imported, bound as an attribute
# (``ea.linearized``) and its ``__all__`` re-exported at the top level.
_MODULES = (
    "attention",
    "attention_sinks",
    "delta_rule",
    "distributed",
    "embeddings",
    "fmm",
    "kernels",
    "kv_cache",
    "linearized",
    "lowrank",
    "memory",
    "models",
    "nystrom",
    "paged_cache",
    "performer",
    "purification",
    "quantized_cache",
    "random_features",
    "recurrent",
    "sparse",
    "speculative",
    "tiling",
)

__version__ = "0.1.0"


def _export() -> list[str]:
    names: set[str] = set()
    for module_name in _MODULES:
        module = import_module(f".{module_name}", __name__)
        globals()[module_name] = module
        for name in module.__all__:
            globals()[name] = getattr(module, name)
        names.update(module.__all__)
    # No module shares its name with a function it exports, so every package attribute
    # named after a module is that module (``import efficient_attention.linearized as m``).
    clashes = names & set(_MODULES)
    if clashes:
        raise ImportError(f"modules and exported names clash: {sorted(clashes)}")
    return sorted(names)


__all__ = _export()
