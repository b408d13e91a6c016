//! Memory for the weight copies the loader makes (the interleaved layouts):
//! large anonymous mappings advised for 2 MiB pages, handed out piece after
//! piece.
//!
//! A decode step streams every weight byte once. On 4 KiB pages that walk
//! takes a TLB miss every 4 KiB; on 2 MiB pages, one every 512 of them.
//! Where transparent huge pages are on `madvise` (a common default) a plain
//! `Vec` never gets them, so the copies live here instead. One piece per
//! matrix would leave most matrices (a few hundred KiB to a few MiB) on
//! small pages; consecutive pieces of one mapping share its huge pages.

use std::sync::{Arc, Mutex};

/// The huge page size the mappings are aligned to.
const HUGE_PAGE: usize = 2 << 20;
/// Bytes of one mapping, unless a single piece needs more.
const REGION_BYTES: usize = 64 << 20;
/// Pieces start on cache lines (the kernels load 64 bytes at a time).
const ALIGN: usize = 64;

/// One anonymous mapping, zero-filled by the kernel, shared by its pieces.
struct Region {
    _map: memmap2::MmapMut,
    /// First byte of the usable, [`HUGE_PAGE`]-aligned part of the mapping.
    base: *mut u8,
    len: usize,
}

// SAFETY: `base` points into `_map`, which lives as long as the region; each
// byte range is handed to exactly one `Piece` (see `alloc_zeroed`), so no two
// threads write the same bytes through it.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    fn map(len: usize) -> std::io::Result<Self> {
        // Over-map by one huge page so that the usable part can start on a
        // huge page boundary; the slack is never touched, so never resident.
        let mut map = memmap2::MmapMut::map_anon(len + HUGE_PAGE)?;
        let at = map.as_mut_ptr();
        let skip = at.align_offset(HUGE_PAGE).min(HUGE_PAGE);
        #[cfg(target_os = "linux")]
        {
            // Advice only: where huge pages are off the pages stay small.
            let _ = map.advise_range(memmap2::Advice::HugePage, skip, len);
        }
        // SAFETY: skip + len ≤ the mapping's length.
        let base = unsafe { at.add(skip) };
        Ok(Self {
            _map: map,
            base,
            len,
        })
    }
}

/// A zero-filled byte buffer of fixed length, owned alone (not `Clone`):
/// a piece of a shared mapping, or a heap buffer where mapping failed.
pub struct Piece {
    store: Store,
    len: usize,
}

enum Store {
    Mapped { region: Arc<Region>, start: usize },
    Heap(Vec<u8>),
}

impl Piece {
    fn mapped(region: Arc<Region>, start: usize, len: usize) -> Self {
        Self {
            store: Store::Mapped { region, start },
            len,
        }
    }

    /// Where no mapping is to be had (address space exhausted, a platform
    /// without anonymous maps): an ordinary allocation.
    fn heap(len: usize) -> Self {
        Self {
            store: Store::Heap(vec![0; len]),
            len,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.store {
            // SAFETY: `start + len ≤ region.len` and only this piece holds
            // the range (it may read it while others write theirs).
            Store::Mapped { region, start } => unsafe {
                std::slice::from_raw_parts(region.base.add(*start), self.len)
            },
            Store::Heap(v) => v,
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.store {
            // SAFETY: as in `as_slice`; `&mut self` makes this the only view
            // of the range.
            Store::Mapped { region, start } => unsafe {
                std::slice::from_raw_parts_mut(region.base.add(*start), self.len)
            },
            Store::Heap(v) => v,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.store {
            Store::Mapped { .. } => "mapped",
            Store::Heap(_) => "heap",
        };
        write!(f, "Piece({} bytes, {kind})", self.len)
    }
}

/// The mapping pieces are cut from and how much of it is handed out; a
/// region is unmapped once this and all its pieces are gone.
static CURRENT: Mutex<Option<(Arc<Region>, usize)>> = Mutex::new(None);

/// `len` zero bytes for a weight copy: after the last piece handed out when
/// they fit in its mapping, else at the start of a new one (a piece of a
/// region's size or more gets a mapping of its own).
pub fn alloc_zeroed(len: usize) -> Piece {
    if len >= REGION_BYTES {
        return match Region::map(len.next_multiple_of(HUGE_PAGE)) {
            Ok(region) => Piece::mapped(Arc::new(region), 0, len),
            Err(_) => Piece::heap(len),
        };
    }
    let mut current = CURRENT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let fits =
        |(region, used): &(Arc<Region>, usize)| used.next_multiple_of(ALIGN) + len <= region.len;
    if !current.as_ref().is_some_and(fits) {
        match Region::map(REGION_BYTES) {
            Ok(region) => *current = Some((Arc::new(region), 0)),
            Err(_) => return Piece::heap(len),
        }
    }
    let Some((region, used)) = current.as_mut() else {
        unreachable!("a region was just mapped")
    };
    let start = used.next_multiple_of(ALIGN);
    *used = start + len;
    Piece::mapped(region.clone(), start, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_zeroed_aligned_and_disjoint() {
        let mut pieces: Vec<Piece> = [100, 1, 4096, 3 << 20, 0, 77]
            .into_iter()
            .map(alloc_zeroed)
            .collect();
        for (i, p) in pieces.iter_mut().enumerate() {
            assert!(p.as_slice().iter().all(|&b| b == 0));
            assert_eq!(p.as_slice().as_ptr() as usize % ALIGN, 0);
            p.as_mut_slice().fill(i as u8 + 1);
        }
        for (i, p) in pieces.iter().enumerate() {
            assert!(p.as_slice().iter().all(|&b| b == i as u8 + 1), "piece {i}");
        }
        // A piece larger than a region gets a mapping of its own.
        let big = alloc_zeroed(REGION_BYTES + 5);
        assert_eq!(big.len(), REGION_BYTES + 5);
        assert_eq!(big.as_slice()[REGION_BYTES + 4], 0);
    }
}
