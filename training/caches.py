"""Where compiled code is kept between runs, so a second run skips what the first one built.

torch.compile keeps Inductor's FX graphs, AOTAutograd's graphs and its autotuning results under
TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>, which a reboot or a temp cleaner
empties; Triton keeps its built kernels in TRITON_CACHE_DIR (default ~/.triton/cache) and our flash
kernel its tuning picks in $XDG_CACHE_HOME/nanoflash/autotune (kernels/flash_attention/tune_cache.py).
``keep_compiled_code`` moves Inductor's folder beside ours, $XDG_CACHE_HOME/nanoflash/inductor
(~/.cache/nanoflash/inductor), and turns its FX-graph and AOTAutograd caches on, each only where the
environment does not already say otherwise. train.py calls it first thing, before anything compiles.
"""
import os


def keep_compiled_code(environ=os.environ) -> None:
    """Set the compile caches' environment defaults (see the module docstring) in ``environ``."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "nanoflash", "inductor"))
    environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
