//! What the core reads from a vLLM `Request`, and the request's hashes as one call
//! planned them.
//!
//! [`RequestLike`] is implemented by the Python bindings over vLLM's `Request` (lazy
//! attribute reads: most decode steps read only `request_id` and
//! `num_computed_tokens`) and by tests over plain structs. The facade reads every
//! field a call may need *before* the call changes anything, into
//! [`RequestNumbers`] and [`PlannedHashes`], so the apply phase never reads Python
//! and never fails on a malformed request.

use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::types::{BlockHash, BlockHashSource};

/// vLLM's `RequestStatus`, as far as the manager's rules distinguish it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// `WAITING` or `PREEMPTED`: the watermark applies to its admission.
    WaitingOrPreempted,
    /// Any other status.
    Other,
}

/// The fields of a vLLM `Request` the manager reads.
pub trait RequestLike {
    /// `request.block_hashes`.
    type Hashes: BlockHashSource + ?Sized;
    fn request_id(&self) -> &str;
    fn num_computed_tokens(&self) -> usize;
    /// `request.num_tokens` (prompt + accepted outputs).
    fn num_tokens(&self) -> Result<usize>;
    fn num_prompt_tokens(&self) -> Result<usize>;
    fn num_in_flight_tokens(&self) -> Result<usize>;
    /// `request.shared_prefix_boundary` (set by the Scheduler from the lookup).
    fn shared_prefix_boundary(&self) -> Result<usize>;
    fn status(&self) -> Result<RequestStatus>;
    /// `request.skip_reading_prefix_cache` (prompt logprobs, all-token pooling).
    fn skip_reading_prefix_cache(&self) -> Result<bool>;
    fn block_hashes(&self) -> Result<&Self::Hashes>;
    /// Called by `allocate_slots` once it has decided that the call may fit, before
    /// it changes anything: an `Err` refuses the call with the manager unchanged
    /// (the bindings check there that KV events can describe a new request).
    fn check_before_changes(&self) -> Result<()> {
        Ok(())
    }
    /// Explain mode only (a cold path, `crate::explain`): the token ids of blocks
    /// `[start, end)` of `block_size` tokens and the extra-key fields. `None` (the
    /// default): this request cannot tell, and explanations skip the comparison.
    fn explain_facts(
        &self,
        _block_size: usize,
        _start: usize,
        _end: usize,
    ) -> Result<Option<crate::explain::RequestFacts>> {
        Ok(None)
    }
}

/// The request's counts a call needs, read once before anything changes.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestNumbers {
    pub num_computed_tokens: usize,
    pub num_tokens: usize,
    pub num_prompt_tokens: usize,
    pub shared_prefix_boundary: usize,
}

/// The hashes a call may read while it caches, copied out of `request.block_hashes`
/// before the call changes anything: a contiguous run `[lo, lo + run.len())` plus a
/// few scattered points (prompt boundaries of partial entries). Reading any other
/// index is a bug of the caller's plan and fails with [`Error::Internal`].
#[derive(Clone, Debug, Default)]
pub struct PlannedHashes {
    len: usize,
    lo: usize,
    run: Vec<BlockHash>,
    points: SmallVec<[(usize, BlockHash); 2]>,
}

impl PlannedHashes {
    /// Plans nothing (a list of `len` hashes, none readable).
    pub fn empty(len: usize) -> Self {
        Self {
            len,
            ..Self::default()
        }
    }

    /// Copies `hashes[lo..hi]` and the hashes at `points` (those within range);
    /// `Err` if any of them is missing or malformed.
    pub fn read<H: BlockHashSource + ?Sized>(
        hashes: &H,
        lo: usize,
        hi: usize,
        points: impl IntoIterator<Item = usize>,
        mut run: Vec<BlockHash>,
    ) -> Result<Self> {
        let len = hashes.len();
        let hi = hi.min(len);
        run.clear();
        for i in lo..hi {
            run.push(hashes.get(i)?);
        }
        let mut planned = Self {
            len,
            lo,
            run,
            points: SmallVec::new(),
        };
        for p in points {
            if p < len && !planned.has(p) {
                planned.points.push((p, hashes.get(p)?));
            }
        }
        Ok(planned)
    }

    #[inline]
    fn has(&self, i: usize) -> bool {
        (self.lo..self.lo + self.run.len()).contains(&i) || self.points.iter().any(|p| p.0 == i)
    }

    /// Gives the run's buffer back for reuse.
    pub fn into_buffer(self) -> Vec<BlockHash> {
        self.run
    }
}

impl BlockHashSource for PlannedHashes {
    #[inline]
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn get(&self, i: usize) -> Result<BlockHash> {
        if let Some(h) = i
            .checked_sub(self.lo)
            .and_then(|k| self.run.as_slice().get(k))
        {
            return Ok(*h);
        }
        self.points
            .iter()
            .find(|p| p.0 == i)
            .map(|p| p.1)
            .ok_or_else(|| Error::Internal(format!("block hash {i} was read but not planned")))
    }
}

/// A request given as plain values (tests, benches, the Rust API).
#[derive(Clone, Debug, Default)]
pub struct PlainRequest {
    pub request_id: String,
    pub num_computed_tokens: usize,
    pub num_tokens: usize,
    pub num_prompt_tokens: usize,
    pub num_in_flight_tokens: usize,
    pub shared_prefix_boundary: usize,
    pub waiting: bool,
    pub skip_reading_prefix_cache: bool,
    pub block_hashes: Vec<BlockHash>,
}

impl RequestLike for PlainRequest {
    type Hashes = Vec<BlockHash>;
    fn request_id(&self) -> &str {
        &self.request_id
    }
    fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }
    fn num_tokens(&self) -> Result<usize> {
        Ok(self.num_tokens)
    }
    fn num_prompt_tokens(&self) -> Result<usize> {
        Ok(self.num_prompt_tokens)
    }
    fn num_in_flight_tokens(&self) -> Result<usize> {
        Ok(self.num_in_flight_tokens)
    }
    fn shared_prefix_boundary(&self) -> Result<usize> {
        Ok(self.shared_prefix_boundary)
    }
    fn status(&self) -> Result<RequestStatus> {
        Ok(if self.waiting {
            RequestStatus::WaitingOrPreempted
        } else {
            RequestStatus::Other
        })
    }
    fn skip_reading_prefix_cache(&self) -> Result<bool> {
        Ok(self.skip_reading_prefix_cache)
    }
    fn block_hashes(&self) -> Result<&Vec<BlockHash>> {
        Ok(&self.block_hashes)
    }
}
