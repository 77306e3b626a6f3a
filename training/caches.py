"""Where compiled code is kept between runs, so a second run skips what the first one built.

torch.compile keeps Inductor's FX graphs, AOTAutograd's graphs and its autotuning results under
TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>, which a reboot or a temp cleaner
empties; Triton keeps its built kernels in TRITON_CACHE_DIR (default ~/.triton/cache) and our flash
kernel its tuning picks in $XDG_CACHE_HOME/nanoflash/autotune (kernels/flash_attention/tune_cache.py).
``keep_compiled_code`` moves Inductor's folder beside ours, $XDG_CACHE_HOME/nanoflash/inductor
(~/.cache/nanoflash/inductor), and turns its FX-graph and AOTAutograd caches on, each only where the
environment does not already say otherwise. train.py calls it first thing, before anything compiles.

``cache_custom_autograd_graphs`` lets AOTAutograd's cache keep graphs that hold a custom
autograd.Function (the flash kernel's FlashAttnFunction, the loss's ChunkedLinearCrossEntropy), which
torch otherwise bypasses: every run then traced and partitioned the model's training graph again. It
is safe for ours: dynamo traces a Function's forward and backward into the graph, so a changed
Function is another cache key; the kernels they call are custom ops, run (not cached) as the run
goes. The environment's TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD still decides where set.
"""
import os


def keep_compiled_code(environ=os.environ) -> None:
    """Set the compile caches' environment defaults (see the module docstring) in ``environ``."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "nanoflash", "inductor"))
    environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


def cache_custom_autograd_graphs() -> None:
    """Let AOTAutograd's cache keep graphs with custom autograd.Functions (see the module docstring),
    where this torch has the setting."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
