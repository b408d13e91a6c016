//! Read-only memory-mapped weight files, shared by the tensors that view them.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gemma4_kernels::Bytes;
use memmap2::{Mmap, UncheckedAdvice};

use crate::error::WeightError;

/// A mapped file. Tensors borrow byte ranges of it through [`Bytes`].
pub struct MappedFile {
    map: Mmap,
    /// The open file, for reads that should not map pages ([`Self::read_at`]).
    file: std::fs::File,
    path: PathBuf,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MappedFile({}, {} bytes)",
            self.path.display(),
            self.map.len()
        )
    }
}

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<Arc<Self>, WeightError> {
        let shown = path.display().to_string();
        let file = std::fs::File::open(path).map_err(|source| WeightError::Io {
            path: shown.clone(),
            source,
        })?;
        // SAFETY: the map is read-only; a checkpoint modified while in use is
        // outside what any loader can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| WeightError::Io {
            path: shown,
            source,
        })?;
        Ok(Arc::new(Self {
            map,
            file,
            path: path.to_path_buf(),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// `range` of the file as shared bytes; `None` past the end.
    pub fn bytes(self: &Arc<Self>, range: Range<usize>) -> Option<Bytes> {
        Bytes::new(self.clone()).slice(range)
    }

    /// Copies `buf.len()` bytes from `offset` of the file without mapping
    /// them: the bytes come from the page cache and never count as this
    /// process's resident memory (a mapped page would, and the kernel maps
    /// whole folios, often 64 pages, around the one that was touched).
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> std::io::Result<()> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            self.file.read_exact_at(buf, offset as u64)
        }
        #[cfg(not(unix))]
        {
            let src = self
                .map
                .get(offset..offset + buf.len())
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    /// Drops the pages of `range` from this process's resident set, after
    /// their contents were copied or quantized elsewhere. The data stays in
    /// the file (and the page cache); a later read faults it back in.
    pub fn release(&self, range: Range<usize>) {
        let page = 4096;
        let start = range.start.div_ceil(page) * page;
        let end = (range.end / page) * page;
        if end > start {
            // SAFETY: the mapping is private and read-only, so dropping its
            // pages loses nothing: they are re-read from the file on access.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }
}
