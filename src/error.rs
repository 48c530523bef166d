//! Typed errors of the core and their stable kinds.
//!
//! Every fallible core operation validates its input completely before it mutates
//! anything, so an `Err` always leaves the state exactly as it was. The Python
//! bindings map each [`ErrorKind`] to one exception class (`src/python/errors.rs`),
//! so callers can test the kind without parsing messages.
//!
//! The lowest layer of the crate: it imports no other module (block ids are plain
//! `u32`s here, the same type as [`crate::types::BlockId`]).

/// Everything that can go wrong in the core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The operation needs a request the manager does not know.
    #[error("unknown request id {0:?}")]
    UnknownRequest(String),
    /// A block id outside `0..num_blocks`.
    #[error("block id {block_id} is out of range: the pool has {num_blocks} blocks")]
    BlockIdOutOfRange { block_id: i64, num_blocks: u32 },
    /// Freeing a block whose reference count is already zero.
    #[error("double free: block {0} has reference count 0")]
    DoubleFree(u32),
    /// A block hash that is empty or longer than [`crate::types::MAX_HASH_LEN`] bytes.
    #[error("block hash has {0} bytes; expected 1 to 32 bytes")]
    BadHashLength(usize),
    /// More blocks requested than the free queue holds.
    #[error("cannot get {requested} free blocks from the pool: only {available} are free")]
    NotEnoughFreeBlocks { requested: usize, available: usize },
    /// The free queue has no block to pop.
    #[error("no free blocks available")]
    NoFreeBlocks,
    /// A block that should be in the free queue is not (or vice versa).
    #[error("block {0} is not in the free queue")]
    NotInFreeQueue(u32),
    /// A block that is already in the free queue was appended again.
    #[error("block {0} is already in the free queue")]
    AlreadyInFreeQueue(u32),
    /// An argument outside its valid range (negative counts, counts past
    /// `max_model_len`, inconsistent combinations).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Encoder cache: `allocate` without room (the caller skipped `can_allocate`).
    #[error(
        "encoder cache cannot hold {requested} more embeddings: {num_free_slots} free, \
         {num_freeable_slots} free or freeable"
    )]
    EncoderCacheFull {
        requested: i64,
        num_free_slots: i64,
        num_freeable_slots: i64,
    },
    /// Encoder cache: an entry is missing from one of vLLM's maps where vLLM's own
    /// code would raise `KeyError` (the state was edited from outside, e.g.
    /// `cached = {}`).
    #[error("encoder cache entry {identifier:?} is missing from `{map}`")]
    UnknownEncoderEntry {
        identifier: String,
        map: &'static str,
    },
    /// A valid request the core does not implement (yet).
    #[error("not supported by hscache: {0}")]
    Unsupported(String),
    /// A broken internal invariant (a bug of hscache, or state changed behind the
    /// core's back). The manager that hit it is poisoned.
    #[error("internal error: {0}")]
    Internal(String),
    /// A structural invariant is broken (`check_invariants`, or the check after
    /// every operation with `HSCACHE_CHECK_INVARIANTS=1`); names the first
    /// inconsistency found.
    #[error("invariant violated: {0}")]
    Invariant(String),
    /// An earlier internal error left this manager in an unknown state; every call
    /// refuses to run.
    #[error("this KV-cache manager is poisoned by an earlier internal error: {0}")]
    Poisoned(String),
    /// A panic inside an earlier call left this object (encoder cache, hasher, block
    /// pool view, hidden-state mirror, ...) in an unknown state; every call refuses.
    #[error("this {object} is poisoned by an earlier internal error: {reason}")]
    ObjectPoisoned {
        object: &'static str,
        reason: String,
    },
    /// An allocation the input asked for could not be made (the process keeps
    /// running; nothing changed).
    #[error("memory allocation of {bytes} bytes failed ({what})")]
    OutOfMemory { bytes: u128, what: &'static str },
}

/// Stable, message-independent classification of [`Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    UnknownRequest,
    BlockIdOutOfRange,
    DoubleFree,
    BadHashLength,
    NotEnoughFreeBlocks,
    NoFreeBlocks,
    FreeQueueCorrupt,
    InvalidArgument,
    EncoderCacheFull,
    UnknownEncoderEntry,
    Unsupported,
    Internal,
    Invariant,
    OutOfMemory,
}

impl Error {
    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::UnknownRequest(_) => ErrorKind::UnknownRequest,
            Error::BlockIdOutOfRange { .. } => ErrorKind::BlockIdOutOfRange,
            Error::DoubleFree(_) => ErrorKind::DoubleFree,
            Error::BadHashLength(_) => ErrorKind::BadHashLength,
            Error::NotEnoughFreeBlocks { .. } => ErrorKind::NotEnoughFreeBlocks,
            Error::NoFreeBlocks => ErrorKind::NoFreeBlocks,
            Error::NotInFreeQueue(_) | Error::AlreadyInFreeQueue(_) => ErrorKind::FreeQueueCorrupt,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::EncoderCacheFull { .. } => ErrorKind::EncoderCacheFull,
            Error::UnknownEncoderEntry { .. } => ErrorKind::UnknownEncoderEntry,
            Error::Unsupported(_) => ErrorKind::Unsupported,
            Error::Internal(_) | Error::Poisoned(_) | Error::ObjectPoisoned { .. } => {
                ErrorKind::Internal
            }
            Error::Invariant(_) => ErrorKind::Invariant,
            Error::OutOfMemory { .. } => ErrorKind::OutOfMemory,
        }
    }
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, Error>;
