//! Block ids of every KV-cache group, concatenated: [`GroupedBlocks`] (a view) and
//! [`GroupedBlockIds`] (its owned builder).
//!
//! vLLM hands a tuple of per-group lists (`KVCacheBlocks.blocks`); the core keeps
//! one flat id array and the end of each group, so a step's blocks cross the FFI
//! boundary in one array and a group is a slice. Group `g` is
//! `ids[ends[g - 1]..ends[g]]` (`ends[-1]` = 0).

use smallvec::SmallVec;

use crate::types::BlockId;

/// Block ids of every KV-cache group, borrowed (see module docs).
#[derive(Clone, Copy, Debug)]
pub struct GroupedBlocks<'a> {
    pub ids: &'a [BlockId],
    pub ends: &'a [usize],
}

impl<'a> GroupedBlocks<'a> {
    /// No groups at all (vLLM's empty `KVCacheBlocks` singleton: no lookup result).
    pub const EMPTY: GroupedBlocks<'static> = GroupedBlocks {
        ids: &[],
        ends: &[],
    };

    /// Group `g`'s blocks (empty past the last group).
    #[inline]
    pub fn group(&self, g: usize) -> &'a [BlockId] {
        let start = if g == 0 {
            0
        } else {
            self.ends.get(g - 1).copied().unwrap_or(0)
        };
        let end = self.ends.get(g).copied().unwrap_or(start);
        self.ids.get(start..end).unwrap_or(&[])
    }

    /// Number of groups.
    #[inline]
    pub fn num_groups(&self) -> usize {
        self.ends.len()
    }
}

/// Block ids of every KV-cache group, owned: the one way to build a
/// [`GroupedBlocks`] group after group. Ids go into the open group (the last,
/// not yet ended); [`Self::end_group`] closes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupedBlockIds {
    ids: Vec<BlockId>,
    ends: SmallVec<[usize; 4]>,
}

impl GroupedBlockIds {
    pub fn new() -> Self {
        Self::default()
    }

    /// Room for `num_ids` ids.
    pub fn with_capacity(num_ids: usize) -> Self {
        Self {
            ids: Vec::with_capacity(num_ids),
            ends: SmallVec::new(),
        }
    }

    /// Every group and id dropped (the buffers are kept).
    pub fn clear(&mut self) {
        self.ids.clear();
        self.ends.clear();
    }

    /// Appends `ids` to the open group.
    #[inline]
    pub fn extend(&mut self, ids: &[BlockId]) {
        self.ids.extend_from_slice(ids);
    }

    /// The open group's id buffer, for code that appends in place (what it pushes
    /// belongs to the open group; it must not remove ids).
    #[inline]
    pub fn open_group_mut(&mut self) -> &mut Vec<BlockId> {
        &mut self.ids
    }

    /// Closes the open group.
    #[inline]
    pub fn end_group(&mut self) {
        self.ends.push(self.ids.len());
    }

    /// Appends `ids` as one whole group.
    #[inline]
    pub fn push_group(&mut self, ids: &[BlockId]) {
        self.extend(ids);
        self.end_group();
    }

    /// Appends every group of `other`.
    pub fn extend_groups(&mut self, other: GroupedBlocks<'_>) {
        let base = self.ids.len();
        self.ids.extend_from_slice(other.ids);
        self.ends.extend(other.ends.iter().map(|&e| base + e));
    }

    /// The groups, borrowed.
    #[inline]
    pub fn view(&self) -> GroupedBlocks<'_> {
        GroupedBlocks {
            ids: &self.ids,
            ends: &self.ends,
        }
    }

    /// Group `g`'s blocks (empty past the last group).
    #[inline]
    pub fn group(&self, g: usize) -> &[BlockId] {
        self.view().group(g)
    }

    /// Number of ended groups.
    #[inline]
    pub fn num_groups(&self) -> usize {
        self.ends.len()
    }

    /// Every id, group after group.
    #[inline]
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    /// The ids and the end of each group.
    pub fn into_parts(self) -> (Vec<BlockId>, SmallVec<[usize; 4]>) {
        (self.ids, self.ends)
    }
}

impl<'a> FromIterator<&'a [BlockId]> for GroupedBlockIds {
    /// One group per slice.
    fn from_iter<I: IntoIterator<Item = &'a [BlockId]>>(groups: I) -> Self {
        let mut out = Self::new();
        for g in groups {
            out.push_group(g);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_built_in_pieces_read_back_as_pushed() {
        let mut b = GroupedBlockIds::new();
        b.push_group(&[1, 2]);
        b.end_group();
        b.extend(&[3]);
        b.open_group_mut().push(4);
        b.end_group();
        let mut c: GroupedBlockIds = [&[9][..]].into_iter().collect();
        c.extend_groups(b.view());
        assert_eq!(c.num_groups(), 4);
        let groups: Vec<&[BlockId]> = (0..5).map(|g| c.group(g)).collect();
        assert_eq!(groups, [&[9][..], &[1, 2], &[], &[3, 4], &[]]);
        assert_eq!(GroupedBlocks::EMPTY.group(0), &[] as &[BlockId]);
        let (ids, ends) = c.into_parts();
        assert_eq!(
            (ids.as_slice(), ends.as_slice()),
            (&[9, 1, 2, 3, 4][..], &[1, 3, 3, 5][..])
        );
    }
}
