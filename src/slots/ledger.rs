//! `StepLedger`: the consume-once table of saved steps, the step ids vllm-omni's
//! runners hand back (`hscache.omni.OmniHiddenStateCache`).
//!
//! vllm-omni 0.30's runners save every step's outputs for a step id and must consume
//! that id exactly once, by `materialize` or `discard_step`, possibly a step late on
//! another thread. The ledger decides whether an id may be consumed: it was issued by
//! this ledger, not consumed yet. Ids are unique in the process (one counter for every
//! ledger), so an id of another cache is refused rather than taken for one of ours.
//! At most `limit` ids may be outstanding: one more means a step id was never
//! consumed (vllm-omni's staging pool has the same bound, its depth).
//!
//! Nothing changes on an `Err`.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

static NEXT_STEP_ID: AtomicU64 = AtomicU64::new(1);

/// The steps saved and not yet consumed (see module docs).
#[derive(Debug)]
pub struct StepLedger {
    /// Outstanding ids, oldest first (a handful: `limit` is small).
    outstanding: Vec<u64>,
    limit: usize,
}

impl StepLedger {
    /// A ledger that lets at most `limit` (> 0) steps wait for their consumption.
    pub fn new(limit: usize) -> Result<Self> {
        if limit == 0 {
            return Err(Error::InvalidArgument(
                "a step ledger needs a limit of at least one outstanding step".into(),
            ));
        }
        Ok(Self {
            outstanding: Vec::with_capacity(limit),
            limit,
        })
    }

    /// Issues the id of a newly saved step; refused when `limit` steps are outstanding.
    pub fn issue(&mut self) -> Result<u64> {
        self.check_room()?;
        let id = NEXT_STEP_ID.fetch_add(1, Ordering::Relaxed);
        self.outstanding.push(id);
        Ok(id)
    }

    /// Whether another step may be issued (`Err` says which ids are outstanding).
    pub fn check_room(&self) -> Result<()> {
        if self.outstanding.len() >= self.limit {
            return Err(Error::InvalidArgument(format!(
                "{} saved steps are unconsumed ({:?}); consume each step id once",
                self.outstanding.len(),
                self.outstanding
            )));
        }
        Ok(())
    }

    /// Whether `step_id` is outstanding here (may be consumed).
    pub fn contains(&self, step_id: u64) -> bool {
        self.outstanding.contains(&step_id)
    }

    /// Consumes `step_id`: refused unless it is outstanding here.
    pub fn consume(&mut self, step_id: u64) -> Result<()> {
        match self.outstanding.iter().position(|&s| s == step_id) {
            Some(i) => {
                self.outstanding.remove(i);
                Ok(())
            }
            None => Err(Error::InvalidArgument(format!(
                "step id {step_id} is not an unconsumed step of this cache (consumed \
                 already, never saved, or another cache's); unconsumed: {:?}",
                self.outstanding
            ))),
        }
    }

    /// The outstanding ids, oldest first.
    pub fn outstanding(&self) -> &[u64] {
        &self.outstanding
    }

    /// The most outstanding ids allowed.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_consumed_once_and_bounded() {
        let mut a = StepLedger::new(2).unwrap();
        let mut b = StepLedger::new(2).unwrap();
        let x = a.issue().unwrap();
        let y = a.issue().unwrap();
        assert!(a.issue().is_err());
        assert_eq!(a.outstanding(), &[x, y]);
        let z = b.issue().unwrap();
        assert!(a.consume(z).is_err(), "another ledger's id");
        assert_eq!(a.outstanding(), &[x, y]);
        a.consume(y).unwrap();
        assert!(a.consume(y).is_err(), "consumed twice");
        assert!(a.contains(x) && !a.contains(y));
        a.issue().unwrap();
        assert!(StepLedger::new(0).is_err());
    }
}
