//! Sets the installed vLLM's rules ([`VllmRules`]) on a manager: they live in the
//! device pool, which every manager method already receives (see `src/pool/rules.rs`).

use super::KVCacheManager;
use crate::error::Result;
use crate::pool::rules::VllmRules;

impl KVCacheManager {
    /// Applies the rules of the installed vLLM release series; call right after
    /// construction, before any request (the Python glue does, from its version
    /// profile). Without it the manager follows vLLM 0.33. HiSparse's host pool (a
    /// vLLM `BlockPool` too) follows the same rules.
    pub fn set_vllm_rules(&mut self, rules: VllmRules) -> Result<()> {
        self.coordinator.block_pool_mut().set_vllm_rules(rules);
        // Rules a manager reads where it has no pool (hash-read planning).
        for m in self.coordinator.managers.iter_mut() {
            m.base_mut().partial_tail_at_prompt_floor = rules.partial_tail_at_prompt_floor;
        }
        if self.host_pool().is_some() {
            self.host_pool_call(|pool| {
                pool.set_vllm_rules(rules);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The rules the manager follows.
    pub fn vllm_rules(&self) -> VllmRules {
        self.coordinator.block_pool().vllm_rules()
    }
}
