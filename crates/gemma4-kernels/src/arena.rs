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

use std::ops::Range;
use std::sync::{Arc, Mutex, RwLock};

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
        LIVE.write()
            .unwrap_or_else(|e| e.into_inner())
            .push(base as usize..base as usize + len);
        Ok(Self {
            _map: map,
            base,
            len,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Out of the list before the mapping goes (the field drops after
        // this): a read-ahead in progress holds the read guard.
        let start = self.base as usize;
        LIVE.write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|r| r.start != start);
    }
}

/// The address ranges of the regions mapped now. [`read_ahead`] reads a
/// region's memory only under this lock's read guard, and a region leaves
/// the list under the write guard before it is unmapped.
static LIVE: RwLock<Vec<Range<usize>>> = RwLock::new(Vec::new());

/// Pulls `start..start + len` toward this core's caches by loading a word
/// of each cache line, if the range lies inside one live region (anything
/// else is left alone: it may be unmapped already). Checks `go_on` every
/// 4 KiB and returns `false` as soon as it says stop, `true` otherwise.
///
/// The pool's idle workers read the next product's weights this way while
/// the caller does single-threaded work between products.
pub(crate) fn read_ahead(start: usize, len: usize, go_on: &dyn Fn() -> bool) -> bool {
    const LINE: usize = 64;
    const PAGE: usize = 4096;
    let live = LIVE.read().unwrap_or_else(|e| e.into_inner());
    let end = start.saturating_add(len);
    if !live.iter().any(|r| r.start <= start && end <= r.end) {
        return true;
    }
    let mut at = start;
    let mut sink = 0u8;
    while at < end {
        if !go_on() {
            return false;
        }
        let stop = (at + PAGE).min(end);
        while at < stop {
            // SAFETY: `at` lies in a live region, which stays mapped while
            // `live` is held. The value is discarded; a volatile read keeps
            // the load (the point of it) from being optimized away.
            sink ^= unsafe { std::ptr::read_volatile(at as *const u8) };
            at += LINE;
        }
    }
    std::hint::black_box(sink);
    true
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

/// Bytes written front to back into a [`Piece`] reserved for them: a
/// `Vec<u8>` whose buffer lives in the arena, for the layouts the loader
/// quantizes a slice at a time (`--quant int8`, `q4`).
#[derive(Debug)]
pub struct Filling {
    piece: Piece,
    len: usize,
}

impl Filling {
    /// Room for `capacity` bytes (untouched pages cost nothing).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            piece: alloc_zeroed(capacity),
            len: 0,
        }
    }

    /// Appends `bytes`, moving to a larger piece (as a `Vec` grows) when
    /// they do not fit in the room reserved.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        if end > self.piece.len() {
            let mut grown = alloc_zeroed(end.max(2 * self.piece.len()));
            grown.as_mut_slice()[..self.len].copy_from_slice(self.as_slice());
            self.piece = grown;
        }
        self.piece.as_mut_slice()[self.len..end].copy_from_slice(bytes);
        self.len = end;
    }

    /// The bytes written so far.
    pub fn as_slice(&self) -> &[u8] {
        &self.piece.as_slice()[..self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    #[test]
    fn a_filling_keeps_its_bytes_as_it_grows() {
        let mut f = Filling::with_capacity(10);
        assert!(f.is_empty());
        f.extend_from_slice(&[1, 2, 3]);
        f.extend_from_slice(&[4; 20]);
        f.extend_from_slice(&[]);
        f.extend_from_slice(&[5]);
        let mut want = vec![1, 2, 3];
        want.extend([4; 20]);
        want.push(5);
        assert_eq!(f.as_slice(), &want[..]);
        assert_eq!(f.len(), 24);
    }

    /// How many 4 KiB steps `read_ahead` takes over a range (0: skipped).
    fn steps(start: usize, len: usize) -> usize {
        let n = std::cell::Cell::new(0);
        read_ahead(start, len, &|| {
            n.set(n.get() + 1);
            true
        });
        n.get()
    }

    #[test]
    fn read_ahead_reads_live_regions_only() {
        let piece = alloc_zeroed(REGION_BYTES + (1 << 20));
        let at = piece.as_slice().as_ptr() as usize;
        assert_eq!(steps(at, 3 << 12), 3);
        assert_eq!(
            steps(at + 100, piece.len() - 100),
            piece.len().div_ceil(4096)
        );
        // Past the region's end, or memory the arena does not hold: skipped.
        assert_eq!(steps(at, piece.len() + (4 << 20)), 0);
        let heap = vec![1u8; 1 << 16];
        assert_eq!(steps(heap.as_ptr() as usize, heap.len()), 0);
        // A region that is gone is not read (unless a test running
        // alongside has mapped a new one at its address since).
        drop(piece);
        let mapped_again = || {
            let live = LIVE.read().unwrap_or_else(|e| e.into_inner());
            live.iter()
                .any(|r| r.start <= at && at + (1 << 20) <= r.end)
        };
        assert!(steps(at, 1 << 20) == 0 || mapped_again());
        // A stop request ends the reading at once.
        let other = alloc_zeroed(1 << 20);
        assert!(!read_ahead(
            other.as_slice().as_ptr() as usize,
            other.len(),
            &|| false
        ));
    }
}
