"""transformers' flash-attention functions, replaced for a block (kvpatch's flash reference runs
transformers' own flash_attention_2 code on other kernels)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Where transformers keeps the flash functions it loaded (4.56-5.24): the module globals below,
# filled on first use. ``_loaded_implementation`` (5.0+) names what they are; 5.4+ adds the paged
# kernel and its kwargs processor.
_FLASH_GLOBALS = (
    "_flash_fn",
    "_flash_varlen_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_loaded_implementation",
    "_flash_with_kvcache_fn",
    "_process_with_kvcache_kwargs_fn",
)
_installed_flash: tuple[Callable, Callable] | None = None


@contextmanager
def flash_functions(flash_attn_func: Callable, flash_attn_varlen_func: Callable) -> Iterator[None]:
    """Make transformers' flash_attention_2 call these two functions (flash-attn's signatures) in
    the block, as if flash-attn had been loaded; restores what was loaded before on exit."""
    global _installed_flash
    import transformers.modeling_flash_attention_utils as flash_utils

    if _installed_flash is not None:
        raise RuntimeError("flash functions are already installed; nest no second set")
    saved = {
        name: getattr(flash_utils, name) for name in _FLASH_GLOBALS if hasattr(flash_utils, name)
    }
    given = {
        "_flash_fn": flash_attn_func,
        "_flash_varlen_fn": flash_attn_varlen_func,
        "_pad_fn": flash_utils._pad_input,
        "_unpad_fn": flash_utils._unpad_input,
        "_process_flash_kwargs_fn": flash_utils._lazy_define_process_function(
            flash_attn_varlen_func
        ),
        "_loaded_implementation": "flash_attention_2",
        "_flash_with_kvcache_fn": None,  # no paged cache: transformers then builds a dict
        "_process_with_kvcache_kwargs_fn": dict,
    }
    for name in saved:
        setattr(flash_utils, name, given[name])
    _installed_flash = (flash_attn_func, flash_attn_varlen_func)
    try:
        yield
    finally:
        _installed_flash = None
        for name, value in saved.items():
            setattr(flash_utils, name, value)


def flash_functions_installed() -> bool:
    """Whether :func:`flash_functions` is in effect."""
    return _installed_flash is not None
