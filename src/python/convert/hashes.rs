//! `request.block_hashes` (a Python `list[bytes]`) as a core `BlockHashSource`,
//! read in place: no copy of the list, one 32-byte copy per hash read.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::error::{Error, Result};
use crate::python::errors::BlockHashError;
use crate::types::{BlockHash, BlockHashSource};

#[derive(Clone)]
pub(crate) struct PyListHashes<'py> {
    list: Bound<'py, PyList>,
}

impl<'py> PyListHashes<'py> {
    /// Wraps `obj`, a list (vLLM's contract for `block_hashes`) or a tuple (copied
    /// into a list: vLLM's hasher only indexes and measures it, so it takes one).
    pub(crate) fn new(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(t) = obj.cast::<pyo3::types::PyTuple>() {
            return Ok(Self {
                list: PyList::new(obj.py(), t.iter())?,
            });
        }
        let list = obj.cast::<PyList>().map_err(|_| {
            BlockHashError::new_err(format!(
                "request.block_hashes must be a list of bytes, got {}",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        Ok(Self { list: list.clone() })
    }
}

impl BlockHashSource for PyListHashes<'_> {
    fn len(&self) -> usize {
        self.list.len()
    }

    fn get(&self, i: usize) -> Result<BlockHash> {
        let item = self
            .list
            .get_item(i)
            .map_err(|_| Error::InvalidArgument(format!("block hash index {i} out of range")))?;
        let bytes = item.cast::<PyBytes>().map_err(|_| {
            Error::InvalidArgument(format!("request.block_hashes[{i}] is not bytes"))
        })?;
        BlockHash::new(bytes.as_bytes())
    }
}

/// One hash given as a Python bytes object.
pub(crate) fn hash_from_bytes(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let bytes = obj
        .cast::<PyBytes>()
        .map_err(|_| BlockHashError::new_err("a block hash must be bytes"))?;
    Ok(BlockHash::new(bytes.as_bytes())?)
}

/// vLLM's `BlockHashWithGroupId` bytes (digest + 4-byte big-endian group id).
pub(crate) fn key_from_bytes(
    obj: &Bound<'_, PyAny>,
) -> PyResult<crate::types::BlockHashWithGroupId> {
    let bytes = obj
        .cast::<PyBytes>()
        .map_err(|_| BlockHashError::new_err("a block hash key must be bytes"))?
        .as_bytes();
    if bytes.len() < 5 {
        return Err(BlockHashError::new_err(format!(
            "a block hash key has a digest and a 4-byte group id; got {} bytes",
            bytes.len()
        )));
    }
    let (digest, gid) = bytes.split_at(bytes.len() - 4);
    Ok(crate::types::BlockHashWithGroupId {
        hash: BlockHash::new(digest)?,
        group_id: u32::from_be_bytes([gid[0], gid[1], gid[2], gid[3]]),
    })
}
