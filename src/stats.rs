//! Per-operation latency counters of the drop-in, opt-in and process-wide.
//!
//! `hscache.stats()` in Python reads them, so an operator can see what KV-cache
//! bookkeeping costs per scheduler call in production. Off by default (a disabled
//! timer costs one relaxed atomic load); `hscache.enable_stats()` or `HSCACHE_STATS=1`
//! turns them on. Each operation keeps a call count, the total time and a log2
//! histogram (bucket `i` holds calls of `[2^i, 2^(i+1))` ns) from which percentiles
//! are estimated at the bucket's upper bound.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The timed operations (the Scheduler's per-step calls).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    AllocateSlots,
    GetComputedBlocks,
    Free,
    PopBlocksForFree,
    FreeBlocks,
    CacheBlocks,
    GetBlocks,
}

impl Op {
    /// Every operation, in report order.
    pub const ALL: [Op; 7] = [
        Op::AllocateSlots,
        Op::GetComputedBlocks,
        Op::Free,
        Op::PopBlocksForFree,
        Op::FreeBlocks,
        Op::CacheBlocks,
        Op::GetBlocks,
    ];

    /// vLLM's name of the operation.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllocateSlots => "allocate_slots",
            Op::GetComputedBlocks => "get_computed_blocks",
            Op::Free => "free",
            Op::PopBlocksForFree => "pop_blocks_for_free",
            Op::FreeBlocks => "block_pool.free_blocks",
            Op::CacheBlocks => "cache_blocks",
            Op::GetBlocks => "get_blocks",
        }
    }
}

const BUCKETS: usize = 40;

struct OpStats {
    calls: AtomicU64,
    total_ns: AtomicU64,
    buckets: [AtomicU64; BUCKETS],
}

impl OpStats {
    const fn new() -> Self {
        Self {
            calls: AtomicU64::new(0),
            total_ns: AtomicU64::new(0),
            buckets: [const { AtomicU64::new(0) }; BUCKETS],
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static STATS: [OpStats; Op::ALL.len()] = [const { OpStats::new() }; Op::ALL.len()];

/// Turns recording on or off.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether recording is on.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Records one call of `op` that took `ns` nanoseconds.
pub fn record(op: Op, ns: u64) {
    let s = &STATS[op as usize];
    s.calls.fetch_add(1, Ordering::Relaxed);
    s.total_ns.fetch_add(ns, Ordering::Relaxed);
    let bucket = (63 - ns.max(1).leading_zeros() as usize).min(BUCKETS - 1);
    s.buckets[bucket].fetch_add(1, Ordering::Relaxed);
}

/// Zeroes every counter.
pub fn reset() {
    for s in &STATS {
        s.calls.store(0, Ordering::Relaxed);
        s.total_ns.store(0, Ordering::Relaxed);
        for b in &s.buckets {
            b.store(0, Ordering::Relaxed);
        }
    }
}

/// One operation's counters.
#[derive(Clone, Debug, PartialEq)]
pub struct OpSnapshot {
    pub name: &'static str,
    pub calls: u64,
    pub total_ns: u64,
    /// Percentile estimates (upper bound of the log2 bucket), in ns.
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
}

fn percentile(buckets: &[u64; BUCKETS], calls: u64, q: f64) -> u64 {
    if calls == 0 {
        return 0;
    }
    let target = ((calls as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, &n) in buckets.iter().enumerate() {
        seen += n;
        if seen >= target {
            return 1u64 << (i + 1);
        }
    }
    1u64 << BUCKETS
}

/// The counters of every operation that was called at least once.
pub fn snapshot() -> Vec<OpSnapshot> {
    Op::ALL
        .iter()
        .filter_map(|&op| {
            let s = &STATS[op as usize];
            let calls = s.calls.load(Ordering::Relaxed);
            if calls == 0 {
                return None;
            }
            let mut buckets = [0u64; BUCKETS];
            for (b, a) in buckets.iter_mut().zip(&s.buckets) {
                *b = a.load(Ordering::Relaxed);
            }
            Some(OpSnapshot {
                name: op.name(),
                calls,
                total_ns: s.total_ns.load(Ordering::Relaxed),
                p50_ns: percentile(&buckets, calls, 0.5),
                p90_ns: percentile(&buckets, calls, 0.9),
                p99_ns: percentile(&buckets, calls, 0.99),
            })
        })
        .collect()
}

/// Times one call of an operation when recording is on (records on drop).
pub struct Timer {
    op: Op,
    start: Option<Instant>,
}

impl Timer {
    /// Starts timing `op` if recording is on.
    #[inline]
    pub fn start(op: Op) -> Self {
        Self {
            op,
            start: enabled().then(Instant::now),
        }
    }
}

impl Drop for Timer {
    #[inline]
    fn drop(&mut self) {
        if let Some(t) = self.start {
            record(self.op, t.elapsed().as_nanos() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_log2_buckets() {
        let mut b = [0u64; BUCKETS];
        b[9] = 90; // 512..1024 ns
        b[12] = 10; // 4096..8192 ns
        assert_eq!(percentile(&b, 100, 0.5), 1024);
        assert_eq!(percentile(&b, 100, 0.9), 1024);
        assert_eq!(percentile(&b, 100, 0.99), 8192);
        assert_eq!(percentile(&b, 0, 0.5), 0);
    }
}
