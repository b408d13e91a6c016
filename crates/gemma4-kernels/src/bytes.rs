//! Immutable bytes that are either owned or part of a shared mapping.

use std::ops::Range;
use std::sync::Arc;

/// A byte range of some shared owner: a memory-mapped file, or a buffer.
/// Cloning shares the owner; nothing is copied.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    /// The whole of `owner`.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Self {
        let len = (*owner).as_ref().len();
        Self {
            owner,
            start: 0,
            len,
        }
    }

    pub fn from_vec(v: Vec<u8>) -> Self {
        Self::new(Arc::new(v))
    }

    /// A sub-range, or `None` when it does not fit.
    pub fn slice(&self, range: Range<usize>) -> Option<Self> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        Some(Self {
            owner: self.owner.clone(),
            start: self.start + range.start,
            len: range.len(),
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} at {})", self.len, self.start)
    }
}
