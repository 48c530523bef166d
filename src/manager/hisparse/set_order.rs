//! CPython's `set` iteration order, where vLLM iterates a `set` of request ids.

/// CPython's iteration order of a fresh `set` into which keys with the given
/// `hash()` values (distinct keys) were added in order: the indices of `hashes` in
/// the set's table order. Mirrors `Objects/setobject.c` (see
/// `encoder_cache/input_ids.rs` for the table's rules).
pub fn cpython_set_order(hashes: &[u64]) -> Vec<usize> {
    use crate::encoder_cache::input_ids::probe;
    const EMPTY: usize = usize::MAX;
    let mut table = vec![EMPTY; 8];
    let mut used = 0usize;
    for (k, &h) in hashes.iter().enumerate() {
        let mask = table.len() - 1;
        if let Some(s) = probe(mask, h).find(|&s| table[s] == EMPTY) {
            table[s] = k;
        }
        used += 1;
        if used * 5 >= mask * 3 {
            let min_used = if used > 50_000 { used * 2 } else { used * 4 };
            let mut size = 8;
            while size <= min_used {
                size <<= 1;
            }
            let old = std::mem::replace(&mut table, vec![EMPTY; size]);
            for k in old.into_iter().filter(|&k| k != EMPTY) {
                if let Some(s) = probe(size - 1, hashes[k]).find(|&s| table[s] == EMPTY) {
                    table[s] = k;
                }
            }
        }
    }
    table.into_iter().filter(|&k| k != EMPTY).collect()
}
