//! Block accounting for the paged KV cache: free lists, per-sequence block
//! tables per cache group, reference counts for prefix sharing, and
//! releasing sliding-window blocks no query can see any more.
//!
//! This module never touches tensors: it hands out block ids, and the model
//! writes into the pools those ids address.
//!
//! When asked to, it also records [`KvEvent`]s: which prefixes enter each
//! group's cache and which leave it, for routers that send each request to
//! the replica already holding its prefix. Prefixes are hashed as vLLM
//! hashes them ([`crate::block_hash`]).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use gemma4_model::config::AttentionKind;
use gemma4_model::paged::{GroupBlocks, KvGroup};

use crate::block_hash::{self, BlockHash, MediaKey, MediaSpan};

/// Accounting for one cache group.
#[derive(Debug)]
struct GroupState {
    /// Sliding groups: the window (a query at p sees keys > p − window).
    window: Option<usize>,
    total: usize,
    /// Unowned blocks holding nothing worth keeping, lowest id first.
    free: BTreeSet<u32>,
    /// Unowned blocks that still hold a registered prefix, oldest release first;
    /// reused only when `free` is empty.
    free_cached: VecDeque<u32>,
    refcount: Vec<u32>,
    /// Prefix hash each block currently holds, if registered.
    hash_of: Vec<Option<BlockHash>>,
    /// Prefix hash → block holding it (owned or free-but-intact).
    cached: HashMap<BlockHash, u32>,
}

impl GroupState {
    fn free_count(&self) -> usize {
        self.free.len() + self.free_cached.len()
    }

    /// A free block, and the prefix hash it held (now forgotten), if any.
    fn take_free(&mut self) -> Option<(u32, Option<BlockHash>)> {
        let b = match self.free.pop_first() {
            Some(b) => b,
            None => self.free_cached.pop_front()?,
        };
        // Reusing the block overwrites whatever prefix it held.
        let evicted = self.hash_of[b as usize].take();
        if let Some(h) = evicted {
            self.cached.remove(&h);
        }
        self.refcount[b as usize] = 1;
        Some((b, evicted))
    }

    fn incref(&mut self, b: u32) {
        if self.refcount[b as usize] == 0 && !self.free.remove(&b) {
            self.free_cached.retain(|&x| x != b);
        }
        self.refcount[b as usize] += 1;
    }

    fn decref(&mut self, b: u32) {
        let rc = &mut self.refcount[b as usize];
        *rc = rc.saturating_sub(1);
        if *rc == 0 {
            if self.hash_of[b as usize].is_some() {
                self.free_cached.push_back(b);
            } else {
                self.free.insert(b);
            }
        }
    }

    /// First logical block a query at `pos` (or later) can still see.
    fn first_needed_block(&self, pos: usize, block_size: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w) / block_size,
            None => 0,
        }
    }
}

/// A sequence's KV blocks, one table per group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqKv {
    pub tables: Vec<GroupBlocks>,
    /// Full blocks whose prefix hash has been registered (or adopted).
    registered_blocks: usize,
    /// Hash of the last registered block (the chain's parent; the root hash
    /// before the first).
    last_hash: BlockHash,
    /// The prompt's media: the blocks they overlap are keyed on them.
    media: Arc<[MediaSpan]>,
    /// The LoRA adapter it runs with: every block is keyed on it.
    adapter: Option<AdapterKey>,
}

/// A LoRA adapter as the prefix cache and KV events know it: vLLM's
/// integer id (from 1) and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterKey {
    pub id: u32,
    pub name: Arc<str>,
}

/// Usage figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockUsage {
    pub total: usize,
    pub used: usize,
}

/// A change to what one cache group holds, one full block of a sequence's
/// tokens at a time. Every group reports its own: reusing a prefix needs
/// the full-attention group's blocks and the sliding-window group's blocks
/// of the window's reach, and the latter leave much sooner. Hashes are the
/// external form ([`block_hash::external`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// A block of `token_ids` entered `group`'s cache under `hash`,
    /// following the block `parent` (none for a sequence's first block).
    BlockStored {
        group: usize,
        /// The group's window, for a sliding-window group.
        sliding_window: Option<usize>,
        hash: u64,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        /// The media the block overlaps: identifier and start, relative to
        /// the block.
        media: Vec<MediaKey>,
        /// The LoRA adapter whose sequence computed it.
        adapter: Option<AdapterKey>,
    },
    /// The block `group` held under `hash` was reused for other tokens.
    BlockRemoved { group: usize, hash: u64 },
}

/// The block allocator for every group.
#[derive(Debug)]
pub struct KvManager {
    block_size: usize,
    groups: Vec<GroupState>,
    prefix_caching: bool,
    /// Events not yet taken, when they are recorded.
    events: Option<Vec<KvEvent>>,
    /// The parent hash of every prompt's first block.
    root: BlockHash,
}

impl KvManager {
    pub fn new(
        groups: &[KvGroup],
        blocks_per_group: &[usize],
        block_size: usize,
        window: usize,
        prefix_caching: bool,
    ) -> Self {
        let groups: Vec<GroupState> = groups
            .iter()
            .zip(blocks_per_group)
            .map(|(g, &n)| GroupState {
                window: (g.kind == AttentionKind::Sliding).then_some(window),
                total: n,
                free: (0..n as u32).collect(),
                free_cached: VecDeque::new(),
                refcount: vec![0; n],
                hash_of: vec![None; n],
                cached: HashMap::new(),
            })
            .collect();
        Self {
            block_size,
            groups,
            prefix_caching,
            events: None,
            root: block_hash::root_hash(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Records [`KvEvent`]s from now on, for [`KvManager::take_events`].
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record(&mut self, event: KvEvent) {
        if let Some(events) = &mut self.events {
            events.push(event);
        }
    }

    /// Per group: total and used (owned by at least one sequence) blocks.
    pub fn usage(&self) -> Vec<BlockUsage> {
        self.groups
            .iter()
            .map(|g| BlockUsage {
                total: g.total,
                used: g.total - g.free_count(),
            })
            .collect()
    }

    /// An empty table set for a new sequence.
    pub fn empty(&self) -> SeqKv {
        self.empty_with_media(Arc::from([]))
    }

    /// An empty table set whose cached blocks are keyed on `media` as well
    /// as on the tokens, where they overlap (prompts whose placeholders
    /// stand for media).
    pub fn empty_with_media(&self, media: Arc<[MediaSpan]>) -> SeqKv {
        self.empty_keyed(media, None)
    }

    /// [`empty_with_media`](Self::empty_with_media) for a sequence that
    /// runs with a LoRA adapter: its blocks are keyed on it too, so no
    /// other adapter's sequence (nor the base model's) adopts them.
    pub fn empty_keyed(&self, media: Arc<[MediaSpan]>, adapter: Option<AdapterKey>) -> SeqKv {
        SeqKv {
            tables: vec![GroupBlocks::default(); self.groups.len()],
            registered_blocks: 0,
            last_hash: self.root,
            media,
            adapter,
        }
    }

    /// Blocks each group would need to hold positions `..new_len` for queries from `query_pos` on.
    fn blocks_needed(&self, seq: &SeqKv, new_len: usize, query_pos: usize) -> Vec<usize> {
        let bs = self.block_size;
        self.groups
            .iter()
            .zip(&seq.tables)
            .map(|(g, t)| {
                let first = g.first_needed_block(query_pos, bs).max(t.first_block);
                let have_end = t.first_block + t.blocks.len();
                let need_end = new_len.div_ceil(bs);
                need_end.saturating_sub(have_end.max(first))
            })
            .collect()
    }

    /// Makes room for positions `..new_len`, where the step's first query is
    /// at `query_pos`. Sliding groups first release blocks no query from
    /// `query_pos` on can see. Returns false (changing nothing but the
    /// releases) when a group has too few free blocks.
    pub fn allocate(&mut self, seq: &mut SeqKv, new_len: usize, query_pos: usize) -> bool {
        self.release_out_of_window(seq, query_pos);
        let needed = self.blocks_needed(seq, new_len, query_pos);
        if needed
            .iter()
            .zip(&self.groups)
            .any(|(&n, g)| n > g.free_count())
        {
            return false;
        }
        let bs = self.block_size;
        let mut evicted = Vec::new();
        for (group, ((g, t), n)) in self
            .groups
            .iter_mut()
            .zip(seq.tables.iter_mut())
            .zip(needed)
            .enumerate()
        {
            if t.blocks.is_empty() {
                // A fresh sliding table starts at the first block the window needs.
                t.first_block = g.first_needed_block(query_pos, bs);
            }
            for _ in 0..n {
                let Some((b, held)) = g.take_free() else {
                    return false;
                };
                t.blocks.push(b);
                evicted.extend(held.map(|h| (group, h)));
            }
        }
        for (group, hash) in evicted {
            let hash = block_hash::external(&hash);
            self.record(KvEvent::BlockRemoved { group, hash });
        }
        true
    }

    /// Releases sliding-group blocks entirely before the window of a query at `query_pos`.
    pub fn release_out_of_window(&mut self, seq: &mut SeqKv, query_pos: usize) {
        let bs = self.block_size;
        for (g, t) in self.groups.iter_mut().zip(seq.tables.iter_mut()) {
            let first = g.first_needed_block(query_pos, bs);
            while t.first_block < first && !t.blocks.is_empty() {
                let b = t.blocks.remove(0);
                g.decref(b);
                t.first_block += 1;
            }
        }
    }

    /// Returns every block of a finished, cancelled or preempted sequence,
    /// the last first: a chain's tail is reused before its head, so what is
    /// left of a prefix stays adoptable (as vLLM's free queue orders them).
    pub fn release(&mut self, seq: &mut SeqKv) {
        for (g, t) in self.groups.iter_mut().zip(seq.tables.iter_mut()) {
            for b in t.blocks.drain(..).rev() {
                g.decref(b);
            }
            t.first_block = 0;
        }
        seq.registered_blocks = 0;
        seq.last_hash = self.root;
    }

    /// The media keys of block `index` of a sequence.
    fn media_keys(&self, seq: &SeqKv, index: usize) -> Vec<MediaKey> {
        let bs = self.block_size;
        block_hash::media_keys(&seq.media, index * bs, (index + 1) * bs)
    }

    /// Reuses cached blocks for the longest block-aligned prefix of `tokens`
    /// that every group holds (the sliding group only the blocks its window
    /// needs). At least one token is always left to compute. Returns the
    /// number of tokens whose KV is now in place.
    pub fn adopt_prefix(
        &mut self,
        seq: &mut SeqKv,
        tokens: &[u32],
        resumable: impl Fn(usize) -> bool,
    ) -> usize {
        if !self.prefix_caching || tokens.len() < 2 {
            return 0;
        }
        let bs = self.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        let mut hashes = Vec::with_capacity(max_blocks);
        let mut parent = self.root;
        for b in 0..max_blocks {
            let media = self.media_keys(seq, b);
            parent = block_hash::block_hash(
                &parent,
                &tokens[b * bs..(b + 1) * bs],
                seq.adapter.as_ref().map(|a| &*a.name),
                &media,
            );
            hashes.push(parent);
        }
        // Longest k such that each group has the blocks it needs for a resume at k·bs.
        let mut best = 0;
        for k in (1..=max_blocks).rev() {
            if !resumable(k * bs) {
                continue;
            }
            let ok = self.groups.iter().all(|g| {
                let first = g.first_needed_block(k * bs, bs);
                (first..k).all(|b| g.cached.contains_key(&hashes[b]))
            });
            if ok {
                best = k;
                break;
            }
        }
        if best == 0 {
            return 0;
        }
        for (g, t) in self.groups.iter_mut().zip(seq.tables.iter_mut()) {
            let first = g.first_needed_block(best * bs, bs);
            t.first_block = first;
            t.blocks.clear();
            for h in &hashes[first..best] {
                if let Some(&b) = g.cached.get(h) {
                    g.incref(b);
                    t.blocks.push(b);
                }
            }
        }
        seq.registered_blocks = best;
        seq.last_hash = hashes[best - 1];
        best * bs
    }

    /// Registers the full blocks among the first `computed` tokens so later
    /// sequences with the same prefix can adopt them.
    pub fn register_full_blocks(&mut self, seq: &mut SeqKv, tokens: &[u32], computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let full = computed.min(tokens.len()) / bs;
        while seq.registered_blocks < full {
            let b = seq.registered_blocks;
            let block_tokens = &tokens[b * bs..(b + 1) * bs];
            let media = self.media_keys(seq, b);
            let adapter = seq.adapter.as_ref().map(|a| &*a.name);
            let h = block_hash::block_hash(&seq.last_hash, block_tokens, adapter, &media);
            let mut stored = Vec::new();
            for (group, (g, t)) in self.groups.iter_mut().zip(&seq.tables).enumerate() {
                let Some(&phys) = b.checked_sub(t.first_block).and_then(|i| t.blocks.get(i)) else {
                    continue;
                };
                if g.hash_of[phys as usize].is_none() && !g.cached.contains_key(&h) {
                    g.hash_of[phys as usize] = Some(h);
                    g.cached.insert(h, phys);
                    stored.push((group, g.window));
                }
            }
            for (group, sliding_window) in stored {
                self.record(KvEvent::BlockStored {
                    group,
                    sliding_window,
                    hash: block_hash::external(&h),
                    parent: (b > 0).then(|| block_hash::external(&seq.last_hash)),
                    token_ids: block_tokens.to_vec(),
                    media: media.clone(),
                    adapter: seq.adapter.clone(),
                });
            }
            seq.last_hash = h;
            seq.registered_blocks += 1;
        }
    }

    /// Blocks one sequence of `tokens` positions needs in each group at most.
    pub fn blocks_for_len(&self, tokens: usize) -> Vec<usize> {
        let bs = self.block_size;
        self.groups
            .iter()
            .map(|g| match g.window {
                Some(w) => tokens.div_ceil(bs).min(w.div_ceil(bs) + 1),
                None => tokens.div_ceil(bs),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups() -> Vec<KvGroup> {
        vec![
            KvGroup {
                kind: AttentionKind::Sliding,
                layers: vec![0],
                heads: vec![(1, 1)],
            },
            KvGroup {
                kind: AttentionKind::Full,
                layers: vec![1],
                heads: vec![(1, 2)],
            },
        ]
    }

    #[test]
    fn sliding_blocks_are_released_as_the_window_moves() {
        let mut m = KvManager::new(&groups(), &[8, 64], 4, 8, false);
        let mut s = m.empty();
        for pos in 0..200 {
            assert!(m.allocate(&mut s, pos + 1, pos));
            assert!(
                s.tables[0].blocks.len() <= 8usize.div_ceil(4) + 1,
                "pos {pos}"
            );
        }
        assert_eq!(s.tables[1].blocks.len(), 50);
        m.release(&mut s);
        assert!(m.usage().iter().all(|u| u.used == 0));
    }

    #[test]
    fn allocation_fails_cleanly_when_full() {
        let mut m = KvManager::new(&groups(), &[8, 2], 4, 8, false);
        let mut s = m.empty();
        assert!(m.allocate(&mut s, 8, 0));
        assert!(!m.allocate(&mut s, 9, 8));
        m.release(&mut s);
        assert_eq!(m.usage()[1].used, 0);
    }

    #[test]
    fn prefixes_are_shared_and_counted() {
        let mut m = KvManager::new(&groups(), &[16, 16], 4, 8, true);
        let tokens: Vec<u32> = (0..13).collect();
        let mut a = m.empty();
        assert!(m.allocate(&mut a, 13, 0));
        m.register_full_blocks(&mut a, &tokens, 13);
        let mut b = m.empty();
        let hit = m.adopt_prefix(&mut b, &tokens, |_| true);
        assert_eq!(hit, 12);
        assert_eq!(b.tables[1].blocks, a.tables[1].blocks[..3].to_vec());
        // The sliding group adopted only what a query at 12 can see (keys ≥ 5: blocks 1 and 2).
        assert_eq!(b.tables[0].first_block, 1);
        m.release(&mut a);
        m.release(&mut b);
        assert!(m.usage().iter().all(|u| u.used == 0));
        // Freed blocks keep their prefix until reused.
        let mut c = m.empty();
        assert_eq!(m.adopt_prefix(&mut c, &tokens, |_| true), 12);
        m.release(&mut c);
    }

    /// The external hashes of `tokens`' full blocks, chained as vLLM chains them.
    fn chain_of(tokens: &[u32], bs: usize) -> Vec<u64> {
        let mut parent = block_hash::root_hash();
        tokens
            .chunks_exact(bs)
            .map(|block| {
                parent = block_hash::block_hash(&parent, block, None, &[]);
                block_hash::external(&parent)
            })
            .collect()
    }

    fn stored(group: usize, hash: u64, parent: Option<u64>, token_ids: Vec<u32>) -> KvEvent {
        KvEvent::BlockStored {
            group,
            sliding_window: (group == 0).then_some(8),
            hash,
            parent,
            token_ids,
            media: vec![],
            adapter: None,
        }
    }

    #[test]
    fn every_group_reports_its_blocks_and_tails_leave_first() {
        // 4 full-attention blocks: a second prompt's blocks must evict the first's.
        let mut m = KvManager::new(&groups(), &[16, 4], 4, 8, true);
        m.record_events();
        let first: Vec<u32> = (0..9).collect();
        let hashes = chain_of(&first[..8], 4);
        let mut a = m.empty();
        assert!(m.allocate(&mut a, 9, 0));
        m.register_full_blocks(&mut a, &first, 9);
        assert_eq!(
            m.take_events(),
            vec![
                stored(0, hashes[0], None, vec![0, 1, 2, 3]),
                stored(1, hashes[0], None, vec![0, 1, 2, 3]),
                stored(0, hashes[1], Some(hashes[0]), vec![4, 5, 6, 7]),
                stored(1, hashes[1], Some(hashes[0]), vec![4, 5, 6, 7]),
            ]
        );
        // The same prefix again stores nothing new.
        let mut b = m.empty();
        assert_eq!(m.adopt_prefix(&mut b, &first, |_| true), 8);
        m.register_full_blocks(&mut b, &first, 8);
        assert_eq!(m.take_events(), vec![]);
        m.release(&mut a);
        m.release(&mut b);
        // Another prompt of 16 tokens takes every full-attention block, the
        // cached ones last and the chain's tail first; the sliding group
        // still has blocks that hold nothing, so it keeps its copies.
        let second: Vec<u32> = (100..116).collect();
        let mut c = m.empty();
        assert!(m.allocate(&mut c, 16, 0));
        assert_eq!(
            m.take_events(),
            vec![
                KvEvent::BlockRemoved {
                    group: 1,
                    hash: hashes[1]
                },
                KvEvent::BlockRemoved {
                    group: 1,
                    hash: hashes[0]
                }
            ]
        );
        // A prefix the sliding group holds and the full group lost is not adopted.
        let mut d = m.empty();
        assert_eq!(m.adopt_prefix(&mut d, &first, |_| true), 0);
        m.register_full_blocks(&mut c, &second, 16);
        assert_eq!(m.take_events().len(), 8);
        // Without recording, nothing accumulates.
        let mut quiet = KvManager::new(&groups(), &[16, 4], 4, 8, true);
        let mut e = quiet.empty();
        assert!(quiet.allocate(&mut e, 9, 0));
        quiet.register_full_blocks(&mut e, &first, 9);
        assert_eq!(quiet.take_events(), vec![]);
    }

    #[test]
    fn blocks_over_media_are_keyed_on_it() {
        let mut m = KvManager::new(&groups(), &[32, 32], 4, 8, true);
        m.record_events();
        // Positions 5..10 hold an image: blocks 1 and 2 overlap it.
        let tokens: Vec<u32> = (0..13).collect();
        let image = |identifier: &str| -> Arc<[MediaSpan]> {
            Arc::from([MediaSpan {
                identifier: identifier.into(),
                start: 5,
                end: 10,
            }])
        };
        let mut a = m.empty_with_media(image("cat"));
        assert!(m.allocate(&mut a, 13, 0));
        m.register_full_blocks(&mut a, &tokens, 13);
        let media: Vec<Vec<MediaKey>> = m
            .take_events()
            .into_iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    group: 1, media, ..
                } => Some(media),
                _ => None,
            })
            .collect();
        assert_eq!(
            media,
            vec![vec![], vec![("cat".into(), 1)], vec![("cat".into(), -3)]]
        );
        // Another image in the same place shares only the block before it.
        let mut b = m.empty_with_media(image("dog"));
        assert_eq!(m.adopt_prefix(&mut b, &tokens, |_| true), 4);
        let mut c = m.empty_with_media(image("cat"));
        assert_eq!(m.adopt_prefix(&mut c, &tokens, |_| true), 12);
        // Text alone with the same tokens shares the block before it too.
        let mut d = m.empty();
        assert_eq!(m.adopt_prefix(&mut d, &tokens, |_| true), 4);
    }
}
