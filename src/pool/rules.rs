//! `VllmRules`: the decisions where the supported vLLM releases differ inside the core.
//!
//! The Python glue reads the installed vLLM's version profile
//! (`python/hscache/vllm/version.py`) and hands the series to the manager at
//! construction; the pool keeps the rules, so every manager method, which already
//! receives the pool, reads them without more plumbing. vLLM 0.33's rules are the
//! default; each 0.32 rule is one field, read only off the hot path (on the null
//! block's branch, or where a 0.33-only check would run).

use crate::error::{Error, Result};

/// What one vLLM release series decides differently (see module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VllmRules {
    /// vLLM 0.32: `BlockPool.touch` / `free_blocks` add / drop a reference on the
    /// null block (its free-queue membership never changes), and `pop_blocks_for_free`
    /// hands back a table's leading null blocks; the count may go negative (the null
    /// blocks a sliding window puts in a table were never touched). 0.33 skips the
    /// null block and trims the leading nulls.
    pub null_block_ref_counted: bool,
    /// vLLM 0.33: with EAGLE, a shared-prefix junction also keeps the block below it
    /// reachable under sparse retention (`shared_prefix_boundary - block_size`).
    pub eagle_junction_keeps_lower_block: bool,
    /// vLLM 0.33: a Mamba prompt / junction checkpoint already keyed at the same
    /// length is not cached again (0.32 re-caches it, which marks it cached this step).
    pub skip_keyed_mamba_checkpoint: bool,
    /// vLLM 0.30: full attention registers its partial prompt tail (a block larger
    /// than the hash block) at `floor(prompt / hash block)` hash blocks; 0.32 / 0.33
    /// stop at `prompt - 1` tokens (the whole prompt with EAGLE) and at the hashes
    /// the request has. Read by the managers (set on their bases with the rules).
    pub partial_tail_at_prompt_floor: bool,
    /// vLLM 0.30: the hybrid coordinator's EAGLE probe (one drop unit past the
    /// candidate hit) is capped at `max_cache_hit_length`, and the per-group lookup
    /// (connectors) probes no further than it; 0.32 / 0.33 cap at the hashed tokens.
    pub eagle_probe_capped_at_max_hit: bool,
    /// vLLM 0.30: `allocate_slots` with no new tokens is an error unless it allocates
    /// for external computed tokens (0.32 / 0.33 also accept adopting local hits).
    pub zero_new_tokens_needs_external: bool,
}

impl VllmRules {
    /// vLLM 0.33.0.
    pub const V033: Self = Self {
        null_block_ref_counted: false,
        eagle_junction_keeps_lower_block: true,
        skip_keyed_mamba_checkpoint: true,
        partial_tail_at_prompt_floor: false,
        eagle_probe_capped_at_max_hit: false,
        zero_new_tokens_needs_external: false,
    };
    /// vLLM 0.32.x.
    pub const V032: Self = Self {
        null_block_ref_counted: true,
        eagle_junction_keeps_lower_block: false,
        skip_keyed_mamba_checkpoint: false,
        partial_tail_at_prompt_floor: false,
        eagle_probe_capped_at_max_hit: false,
        zero_new_tokens_needs_external: false,
    };

    /// vLLM 0.30.x: the pool decides as 0.32 does (same null-block counting, junction
    /// and Mamba re-caching; read from 0.30.0's `block_pool.py` and managers), full
    /// attention keys its partial prompt tail at `floor(prompt / hash block)` and the
    /// EAGLE probe stops at the hit cap. Its untagged block-hash keys are a hasher
    /// setting (`ExtraKeysForm`), not a pool rule.
    pub const V030: Self = Self {
        partial_tail_at_prompt_floor: true,
        eagle_probe_capped_at_max_hit: true,
        zero_new_tokens_needs_external: true,
        ..Self::V032
    };

    /// The rules of a release series (`"0.33"`, `"0.32"` or `"0.30"`).
    pub fn for_series(series: &str) -> Result<Self> {
        match series {
            "0.33" => Ok(Self::V033),
            "0.32" => Ok(Self::V032),
            "0.30" => Ok(Self::V030),
            other => Err(Error::InvalidArgument(format!(
                "vllm_series must be \"0.33\", \"0.32\" or \"0.30\", got {other:?}"
            ))),
        }
    }
}

impl Default for VllmRules {
    fn default() -> Self {
        Self::V033
    }
}

#[cfg(test)]
mod tests {
    use super::VllmRules;
    use crate::pool::BlockPool;
    use crate::types::NULL_BLOCK_ID;

    fn pool(rules: VllmRules) -> BlockPool {
        let mut p = BlockPool::new(6, true, 4, false, true).expect("a small pool");
        p.set_vllm_rules(rules);
        p
    }

    #[test]
    fn v033_skips_the_null_block() {
        let mut p = pool(VllmRules::V033);
        p.touch(&[NULL_BLOCK_ID, NULL_BLOCK_ID]).expect("touch");
        p.free_blocks(&[NULL_BLOCK_ID; 3]).expect("free");
        assert_eq!(p.null_ref_cnt(), 0);
        assert_eq!(p.vllm_ref_cnt(NULL_BLOCK_ID), 0);
        assert!(p.take_metrics_ops().is_empty());
        p.check_invariants().expect("invariants");
    }

    #[test]
    fn v032_counts_the_null_block_without_queueing_it() {
        let mut p = pool(VllmRules::V032);
        let free = p.get_num_free_blocks();
        let order: Vec<_> = p.free_block_queue().iter().collect();
        p.touch(&[NULL_BLOCK_ID, NULL_BLOCK_ID]).expect("touch");
        assert_eq!(p.vllm_ref_cnt(NULL_BLOCK_ID), 2);
        assert_eq!(p.take_metrics_ops().len(), 2); // vLLM 0.32 reports the accesses
        p.free_blocks(&[NULL_BLOCK_ID; 3]).expect("free");
        assert_eq!(p.null_ref_cnt(), -1); // vLLM 0.32 lets it go negative
        assert_eq!(p.ref_cnt(NULL_BLOCK_ID), 0);
        assert_eq!(p.get_num_free_blocks(), free);
        assert_eq!(p.free_block_queue().iter().collect::<Vec<_>>(), order);
        p.check_invariants().expect("invariants");
    }

    #[test]
    fn a_failed_free_leaves_the_null_count_alone() {
        let mut p = pool(VllmRules::V032);
        let mut out = Vec::new();
        p.get_new_blocks(1, &mut out).expect("a block");
        let b = out[0];
        p.free_blocks(&[b]).expect("free");
        // A double free of `b` after a null: nothing changes, the null count included.
        assert!(p.free_blocks(&[NULL_BLOCK_ID, b]).is_err());
        assert_eq!(p.null_ref_cnt(), 0);
        p.check_invariants().expect("invariants");
    }

    #[test]
    fn series_names() {
        assert_eq!(VllmRules::for_series("0.32").ok(), Some(VllmRules::V032));
        assert_eq!(VllmRules::for_series("0.33").ok(), Some(VllmRules::V033));
        assert_eq!(VllmRules::for_series("0.30").ok(), Some(VllmRules::V030));
        assert!(VllmRules::for_series("0.31").is_err());
        assert_eq!(VllmRules::default(), VllmRules::V033);
    }
}
