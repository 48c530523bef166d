//! `KVCacheManager::read`: the manager's read-only calls behind the panic shield
//! (`crate::shield`); its mutating calls go through `KVCacheManager::shielded`
//! (`mod.rs`), which also poisons.
//!
//! Here rather than in `shield.rs` so that the shield, which the manager uses,
//! does not name the manager back (no import circle).

use super::KVCacheManager;
use crate::error::Error;
use crate::shield::catch;

impl KVCacheManager {
    /// Runs a read-only call on the manager: refused on a poisoned manager (its
    /// tables may be half-updated), and a panic inside it is [`Error::Internal`]
    /// without poisoning (nothing changed). Mutating calls use
    /// [`KVCacheManager::shielded`].
    #[inline]
    pub fn read<R, E: From<Error>>(
        &self,
        what: &str,
        op: impl FnOnce(&Self) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        if let Some(reason) = self.poisoned() {
            return Err(Error::Poisoned(reason.to_owned()).into());
        }
        catch(what, || op(self))
    }
}
