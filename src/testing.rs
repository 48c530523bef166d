//! Fixtures shared by the cargo tests and the criterion benches: deterministic
//! hash chains and a small request model.

use crate::types::BlockHash;

/// A deterministic stand-in for a chained block hash: block `i` of chain `seed`.
pub fn chain_hash(seed: u64, i: u64) -> BlockHash {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    bytes[8..16].copy_from_slice(&i.to_le_bytes());
    bytes[16..24].copy_from_slice(
        &(seed ^ i.rotate_left(17))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .to_le_bytes(),
    );
    BlockHash::new(&bytes).expect("32 bytes")
}

/// The hashes of a prompt made of `shared` blocks of chain `prefix_seed` followed
/// by `own` blocks of chain `own_seed` (chained hashes: the suffix depends on the
/// prefix, which the distinct seeds model).
pub fn prompt_hashes(prefix_seed: u64, shared: u64, own_seed: u64, own: u64) -> Vec<BlockHash> {
    (0..shared)
        .map(|i| chain_hash(prefix_seed, i))
        .chain((0..own).map(|i| chain_hash(own_seed, shared + i)))
        .collect()
}
