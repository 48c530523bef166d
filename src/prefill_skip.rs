//! KV-sharing prefill skip: which tokens the KV-sharing layers must compute this step.
//!
//! In models whose later layers reuse an earlier layer's KV cache (YOCO, Gemma-3n:
//! vLLM's `--kv-sharing-fast-prefill`, PR #19719), those layers write no KV of their
//! own, so they only need the tokens whose logits are sampled. vLLM 0.33 rebuilds the
//! reduced batch on the device every step (`make_kv_sharing_fast_prefill_common_attn_metadata`
//! in `v1/attention/backends/utils.py`: a bucketize of the logits indices into
//! requests, a scatter-add, a cumsum and a copy back to the host), although every
//! number is known on the host when the batch is built. [`plan_prefill_skip`] computes
//! them on the host in one pass:
//!
//! ```text
//!  request          r0 (prefill, samples)   r1 (partial chunk)   r2 (decode, 2 drafts)
//!  query_start_loc  0 ...................15 ............... 20 ............... 23
//!  kept tokens                         [14]             (none)        [20, 21, 22]
//!  logits_indices   [14, 20, 21, 22] (+ the last one repeated up to the padded size)
//!  reduced q.s.l.   0 ... 1 ... 1 ... 4      max_query_len 3
//! ```
//!
//! Key properties:
//! - A request that samples keeps its last `1 + num_spec_tokens` tokens (vLLM's
//!   `logits_indices`: the bonus token and one per draft); a request that does not
//!   sample this step (a partial prefill chunk, whose sampled token vLLM discards)
//!   keeps none. With every request sampling, the result is exactly vLLM's.
//! - Padded requests (CUDA-graph padding, `num_reqs_padded > num_reqs`) keep nothing:
//!   their reduced `query_start_loc` entries repeat the total, as vLLM's bucketize
//!   gives them no index. Padded logits indices repeat the last real index (vLLM's
//!   `_prepare_kv_sharing_fast_prefill`), or are 0 when no token is kept.
//! - When no request has more than one scheduled token (a pure decode batch), vLLM
//!   runs the KV-sharing layers on the whole batch: every token is kept and the
//!   metadata is not reduced ([`PrefillSkip::reduced`] is false).
//! - `computed[t]` says whether token `t` (in batch order) goes through the
//!   KV-sharing layers: the hidden-state cache records the other tokens' rows of
//!   those layers' outputs as never written.
//! - Pure: the result depends only on the input; every input is validated first
//!   (counts in range, spec tokens only on sampling requests, a given
//!   `query_start_loc` consistent with the counts).

use crate::error::{Error, Result};

/// The host-side numbers of one batch, in batch (model runner) order.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillSkipInput<'a> {
    /// Scheduled tokens of every real request (each at least 1).
    pub num_scheduled_tokens: &'a [u32],
    /// Draft tokens of every request (empty: none anywhere).
    pub num_spec_tokens: &'a [u32],
    /// Whether each request samples this step (empty: all do, vLLM's rule).
    pub samples: &'a [bool],
    /// Requests including CUDA-graph padding (at least the real ones).
    pub num_reqs_padded: usize,
    /// Length to pad the logits indices to (0 or less than the kept count: no padding).
    pub num_logits_padded: usize,
    /// The batch's `query_start_loc` (`num_reqs_padded + 1` entries), checked
    /// against the counts when given.
    pub query_start_loc: Option<&'a [i64]>,
}

/// The reduced batch of the KV-sharing layers (see module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefillSkip {
    /// Kept token indices (the logits indices), padded: the first `num_logits` are real.
    pub logits_indices: Vec<i32>,
    pub num_logits: usize,
    /// The reduced `query_start_loc`, `num_reqs_padded + 1` entries.
    pub query_start_loc: Vec<i32>,
    /// Kept tokens of every real request (its last ones).
    pub num_kept: Vec<u32>,
    /// The largest per-request kept count.
    pub max_query_len: u32,
    /// Per token of the batch: computed by the KV-sharing layers.
    pub computed: Vec<bool>,
    /// False for a pure decode batch: the KV-sharing layers see the whole batch.
    pub reduced: bool,
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(format!("prefill skip: {msg}"))
}

/// Computes the reduced batch into `out` (its buffers are reused).
pub fn plan_prefill_skip(input: &PrefillSkipInput<'_>, out: &mut PrefillSkip) -> Result<()> {
    // One piece: every input is checked before `out` (reused buffers) is touched, and
    // the fill reads the `total` and `max_sched` those checks sum.
    let sched = input.num_scheduled_tokens;
    let n = sched.len();
    for (name, len) in [
        ("num_spec_tokens", input.num_spec_tokens.len()),
        ("samples", input.samples.len()),
    ] {
        if len != 0 && len != n {
            return Err(invalid(format!(
                "{name} has {len} entries for {n} requests"
            )));
        }
    }
    if input.num_reqs_padded < n {
        return Err(invalid(format!(
            "num_reqs_padded {} is below the {n} requests",
            input.num_reqs_padded
        )));
    }
    let spec = |i: usize| input.num_spec_tokens.get(i).copied().unwrap_or(0);
    let samples = |i: usize| input.samples.get(i).copied().unwrap_or(true);
    let mut total: u64 = 0;
    let mut max_sched = 0u32;
    for (i, &s) in sched.iter().enumerate() {
        if s == 0 {
            return Err(invalid(format!("request {i} has no scheduled token")));
        }
        if spec(i) > 0 && (!samples(i) || spec(i) >= s) {
            return Err(invalid(format!(
                "request {i}: {} draft tokens need a sampling request with more than that \
                 many scheduled tokens ({s})",
                spec(i)
            )));
        }
        total += u64::from(s);
        max_sched = max_sched.max(s);
    }
    if total > i32::MAX as u64 {
        return Err(invalid(format!("{total} tokens overflow int32 indices")));
    }
    if let Some(q) = input.query_start_loc {
        let want = input.num_reqs_padded + 1;
        let mut acc = 0i64;
        let ok = q.len() == want
            && q.first() == Some(&0)
            && (0..input.num_reqs_padded).all(|i| {
                acc += i64::from(sched.get(i).copied().unwrap_or(0));
                q[i + 1] == acc
            });
        if !ok {
            return Err(invalid(format!(
                "query_start_loc {q:?} does not match the scheduled counts {sched:?} \
                 ({want} entries expected)"
            )));
        }
    }

    // Apply: fill the buffers.
    let reduced = max_sched > 1;
    out.reduced = reduced;
    out.num_kept.clear();
    out.logits_indices.clear();
    out.query_start_loc.clear();
    out.computed.clear();
    out.computed.resize(total as usize, !reduced);
    out.query_start_loc.push(0);
    let mut start = 0u32;
    let mut kept_total = 0u32;
    let mut max_kept = 0u32;
    for (i, &s) in sched.iter().enumerate() {
        let end = start + s;
        let kept = match (reduced, samples(i)) {
            (false, _) => s,
            (true, true) => spec(i) + 1,
            (true, false) => 0,
        };
        for t in end - kept..end {
            out.logits_indices.push(t as i32);
            out.computed[t as usize] = true;
        }
        kept_total += kept;
        max_kept = max_kept.max(kept);
        out.num_kept.push(kept);
        out.query_start_loc.push(kept_total as i32);
        start = end;
    }
    out.query_start_loc
        .resize(input.num_reqs_padded + 1, kept_total as i32);
    out.num_logits = kept_total as usize;
    out.max_query_len = max_kept;
    let pad = out.logits_indices.last().copied().unwrap_or(0);
    if input.num_logits_padded > out.logits_indices.len() {
        out.logits_indices.resize(input.num_logits_padded, pad);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn run(input: PrefillSkipInput<'_>) -> PrefillSkip {
        let mut out = PrefillSkip::default();
        plan_prefill_skip(&input, &mut out).unwrap();
        out
    }

    #[test]
    fn mixed_batch_keeps_sampled_tokens() {
        // The module doc's example: a prefill, a partial chunk, a decode with 2 drafts.
        let out = run(PrefillSkipInput {
            num_scheduled_tokens: &[15, 5, 3],
            num_spec_tokens: &[0, 0, 2],
            samples: &[true, false, true],
            num_reqs_padded: 4,
            num_logits_padded: 6,
            query_start_loc: Some(&[0, 15, 20, 23, 23]),
        });
        assert_eq!(out.logits_indices, [14, 20, 21, 22, 22, 22]);
        assert_eq!(out.num_logits, 4);
        assert_eq!(out.query_start_loc, [0, 1, 1, 4, 4]);
        assert_eq!(out.num_kept, [1, 0, 3]);
        assert_eq!(out.max_query_len, 3);
        assert!(out.reduced);
        let kept: Vec<usize> = (0..23).filter(|&t| out.computed[t]).collect();
        assert_eq!(kept, [14, 20, 21, 22]);
    }

    #[test]
    fn pure_decode_batch_is_not_reduced() {
        let out = run(PrefillSkipInput {
            num_scheduled_tokens: &[1, 1, 1],
            samples: &[true, false, true],
            num_reqs_padded: 3,
            ..Default::default()
        });
        assert!(!out.reduced);
        assert_eq!(out.logits_indices, [0, 1, 2]);
        assert_eq!(out.query_start_loc, [0, 1, 2, 3]);
        assert_eq!(out.max_query_len, 1);
        assert!(out.computed.iter().all(|&c| c));
    }

    #[test]
    fn nothing_sampled_keeps_nothing() {
        let out = run(PrefillSkipInput {
            num_scheduled_tokens: &[4, 6],
            samples: &[false, false],
            num_reqs_padded: 2,
            num_logits_padded: 3,
            ..Default::default()
        });
        assert_eq!((out.num_logits, out.max_query_len), (0, 0));
        assert_eq!(out.logits_indices, [0, 0, 0]);
        assert_eq!(out.query_start_loc, [0, 0, 0]);
    }

    #[test]
    fn bad_input_is_refused() {
        let mut out = PrefillSkip::default();
        let bad = [
            PrefillSkipInput {
                num_scheduled_tokens: &[2, 0],
                num_reqs_padded: 2,
                ..Default::default()
            },
            PrefillSkipInput {
                num_scheduled_tokens: &[2, 3],
                num_reqs_padded: 1,
                ..Default::default()
            },
            PrefillSkipInput {
                num_scheduled_tokens: &[2, 3],
                num_spec_tokens: &[2, 0],
                num_reqs_padded: 2,
                ..Default::default()
            },
            PrefillSkipInput {
                num_scheduled_tokens: &[2, 3],
                num_spec_tokens: &[1, 0],
                samples: &[false, true],
                num_reqs_padded: 2,
                ..Default::default()
            },
            PrefillSkipInput {
                num_scheduled_tokens: &[2, 3],
                samples: &[true],
                num_reqs_padded: 2,
                ..Default::default()
            },
            PrefillSkipInput {
                num_scheduled_tokens: &[2, 3],
                num_reqs_padded: 2,
                query_start_loc: Some(&[0, 2, 4]),
                ..Default::default()
            },
        ];
        for input in bad {
            let e = plan_prefill_skip(&input, &mut out).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{input:?}");
        }
    }
}
