"""The exceptions hscache raises, each a subclass of the builtin a vLLM caller expects.

Every one except ``InternalError`` is raised before any state changes: after catching
it, the manager is exactly as it was before the call. ``InternalError`` means a broken
invariant (a bug, or state changed behind the manager's back) or a panic inside the core
(caught at the boundary, never pyo3's ``PanicException``); the manager that raised it is
poisoned and refuses every later call, saying why. ``InvariantError`` (an ``InternalError``
and an ``AssertionError``) is what ``check_invariants()`` raises, and what any mutating call
raises when ``HSCACHE_CHECK_INVARIANTS=1`` finds a broken invariant after it ran (the
manager is then poisoned too).
"""

from hscache._core import (
    BlockHashError,
    BlockIdError,
    DoubleFreeError,
    EncoderCacheFullError,
    FreeQueueError,
    InternalError,
    InvalidArgumentError,
    InvariantError,
    OutOfBlocksError,
    UnknownEncoderEntryError,
    UnknownRequestError,
    UnsupportedError,
)

__all__ = [
    "BlockHashError",
    "BlockIdError",
    "DoubleFreeError",
    "EncoderCacheFullError",
    "FreeQueueError",
    "InternalError",
    "InvalidArgumentError",
    "InvariantError",
    "OutOfBlocksError",
    "UnknownEncoderEntryError",
    "UnknownRequestError",
    "UnsupportedConfigError",
    "UnsupportedError",
]


class UnsupportedConfigError(UnsupportedError):
    """NotImplementedError: with ``HSCACHE_STRICT=1``, a KV-cache configuration the core
    does not serve (instead of falling back to vLLM's manager); the message names why."""


UnknownRequestError.__doc__ = "KeyError: the operation needs a request the manager does not know."
BlockIdError.__doc__ = "ValueError: a block id outside ``0..num_gpu_blocks``."
DoubleFreeError.__doc__ = "ValueError: a block was freed while its reference count was 0."
BlockHashError.__doc__ = "ValueError: a block hash that is not bytes of length 1 to 32."
OutOfBlocksError.__doc__ = "ValueError: more blocks were requested than the free queue holds."
InvalidArgumentError.__doc__ = (
    "ValueError (and AssertionError, what vLLM's own checks raise): an argument out of "
    "range (negative or past max_model_len) or inconsistent."
)
FreeQueueError.__doc__ = "RuntimeError: a block is not in the free queue where it must be."
EncoderCacheFullError.__doc__ = (
    "ValueError: encoder-cache allocate without room (can_allocate was not consulted)."
)
UnknownEncoderEntryError.__doc__ = (
    "KeyError: an encoder-cache entry is missing where vLLM would raise KeyError."
)
UnsupportedError.__doc__ = "NotImplementedError: valid input the core does not implement yet."
InternalError.__doc__ = (
    "RuntimeError: a broken internal invariant or an internal panic; the manager is "
    "poisoned (see module docs)."
)
InvariantError.__doc__ = (
    "RuntimeError and AssertionError: a structural invariant is broken; the message names "
    "the first inconsistency (``check_invariants()``, or the check after every call that "
    "``HSCACHE_CHECK_INVARIANTS=1`` turns on, which also poisons the manager)."
)
