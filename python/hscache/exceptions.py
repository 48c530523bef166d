"""The exceptions hscache raises, each a subclass of the builtin a vLLM caller expects.

Every one is raised before any state changes: after catching it, the manager is
exactly as it was before the call.
"""

from hscache._core import (
    BlockHashError,
    BlockIdError,
    DoubleFreeError,
    EncoderCacheFullError,
    FreeQueueError,
    InvalidArgumentError,
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
    "InvalidArgumentError",
    "OutOfBlocksError",
    "UnknownEncoderEntryError",
    "UnknownRequestError",
    "UnsupportedError",
]

UnknownRequestError.__doc__ = "KeyError: the operation needs a request the manager does not know."
BlockIdError.__doc__ = "ValueError: a block id outside ``0..num_gpu_blocks``."
DoubleFreeError.__doc__ = "ValueError: a block was freed while its reference count was 0."
BlockHashError.__doc__ = "ValueError: a block hash that is not bytes of length 1 to 32."
OutOfBlocksError.__doc__ = "ValueError: more blocks were requested than the free queue holds."
InvalidArgumentError.__doc__ = (
    "ValueError: an argument out of range (negative or past max_model_len) or inconsistent."
)
FreeQueueError.__doc__ = "RuntimeError: a block is not in the free queue where it must be."
EncoderCacheFullError.__doc__ = (
    "ValueError: encoder-cache allocate without room (can_allocate was not consulted)."
)
UnknownEncoderEntryError.__doc__ = (
    "KeyError: an encoder-cache entry is missing where vLLM would raise KeyError."
)
UnsupportedError.__doc__ = "NotImplementedError: valid input the core does not implement yet."
