//! Prefix-cache block hashes, computed as vLLM computes them with its
//! `sha256_cbor` algorithm, so a router that hashes prompts the way vLLM
//! does agrees with the hashes our KV events carry.
//!
//! A block's hash is SHA-256 over the canonical CBOR encoding of the triple
//! `(parent hash, token ids, extra keys)`: the parent is the previous
//! block's 32-byte hash (for the first block, the hash of the CBOR string
//! `"vllm-none-hash"`), the token ids an array of integers, and the extra
//! keys `null`, or an array holding the LoRA adapter's name (when the
//! sequence runs with one; every block of it is so keyed) and then one
//! `["mm", identifier, offset]` for each media item the block overlaps
//! (`offset`: where the item starts, relative to the block's first
//! position). Events carry a hash as vLLM's
//! integer block hashes do: its last 8 bytes, big-endian.

use sha2::{Digest, Sha256};

/// A block's hash: 32 bytes of SHA-256.
pub type BlockHash = [u8; 32];

/// A media item of a prompt: the blocks it overlaps are keyed on it, so two
/// prompts whose placeholders are the same tokens but whose media differ
/// never share those blocks (nor any after them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaSpan {
    /// A digest of the item's content (hex), the same on every replica.
    pub identifier: String,
    /// Prompt positions `[start, end)` the item occupies.
    pub start: usize,
    pub end: usize,
}

/// A media key of one block: the item's identifier and where it starts,
/// relative to the block.
pub type MediaKey = (String, i64);

/// A digest of a media item's content, fed through [`std::hash::Hash`]:
/// SHA-256, so it is the same on every replica and no client can make two
/// items collide.
#[derive(Default)]
pub struct ContentDigest(Sha256);

impl ContentDigest {
    /// The digest as an identifier: 64 hex digits.
    pub fn identifier(self) -> String {
        self.0
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

impl std::hash::Hasher for ContentDigest {
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// Unused: the digest is read whole by [`ContentDigest::identifier`].
    fn finish(&self) -> u64 {
        0
    }
}

/// The parent hash of a prompt's first block.
pub fn root_hash() -> BlockHash {
    let mut out = Vec::new();
    text(&mut out, "vllm-none-hash");
    Sha256::digest(&out).into()
}

/// The media keys of the block covering positions `[start, end)`.
pub fn media_keys(media: &[MediaSpan], start: usize, end: usize) -> Vec<MediaKey> {
    media
        .iter()
        .filter(|m| m.start < end && m.end > start)
        .map(|m| (m.identifier.clone(), m.start as i64 - start as i64))
        .collect()
}

/// The hash of a block of `tokens` after the block hashed `parent`, of a
/// sequence running with the LoRA adapter named `adapter`, if any.
pub fn block_hash(
    parent: &BlockHash,
    tokens: &[u32],
    adapter: Option<&str>,
    media: &[MediaKey],
) -> BlockHash {
    let mut out = Vec::with_capacity(48 + 5 * tokens.len());
    head(&mut out, 4, 3);
    head(&mut out, 2, 32);
    out.extend_from_slice(parent);
    head(&mut out, 4, tokens.len() as u64);
    for &t in tokens {
        head(&mut out, 0, u64::from(t));
    }
    let extra = media.len() + usize::from(adapter.is_some());
    if extra == 0 {
        out.push(0xf6); // null
    } else {
        head(&mut out, 4, extra as u64);
        if let Some(name) = adapter {
            text(&mut out, name);
        }
        for (identifier, offset) in media {
            head(&mut out, 4, 3);
            text(&mut out, "mm");
            text(&mut out, identifier);
            integer(&mut out, *offset);
        }
    }
    Sha256::digest(&out).into()
}

/// A hash as KV events carry it: its last 8 bytes, big-endian.
pub fn external(hash: &BlockHash) -> u64 {
    let mut last = [0u8; 8];
    last.copy_from_slice(&hash[24..]);
    u64::from_be_bytes(last)
}

/// A CBOR head: major type and argument, in the shortest form.
fn head(out: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    match value {
        0..=23 => out.push(m | value as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, value as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }
}

fn text(out: &mut Vec<u8>, s: &str) {
    head(out, 3, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn integer(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        head(out, 0, v as u64);
    } else {
        head(out, 1, (-1 - v) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(h: &BlockHash) -> String {
        h.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Values from Python: `hashlib.sha256(cbor2.dumps(obj, canonical=True))`
    /// over the same objects, as vLLM's `sha256_cbor` hashes them.
    #[test]
    fn hashes_agree_with_cbor2_and_hashlib() {
        let root = root_hash();
        assert_eq!(
            hex(&root),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
        let first = block_hash(&root, &[1, 2, 300, 70000], None, &[]);
        assert_eq!(
            hex(&first),
            "67516cd611fd0d7e4c5c7f6fdbf4d93a304496db502c69895dc6a82deea8ae72"
        );
        assert_eq!(external(&first), 6757273206147034738);
        let media = [("abc".to_string(), -3), ("def".to_string(), 2)];
        let second = block_hash(&first, &[5, 6, 7, 8], None, &media);
        assert_eq!(
            hex(&second),
            "9fa3c61bddabc52051d638c336269ac97f96e546e46d0d8d7194a3ed26f991ac"
        );
        assert_eq!(external(&second), 8184346661795500460);
    }

    /// A LoRA adapter's name leads the extra keys, before any media key
    /// (values from cbor2 and hashlib over the same objects).
    #[test]
    fn an_adapter_keys_every_block() {
        let root = root_hash();
        let tokens = [1, 2, 3, 4];
        assert_eq!(
            hex(&block_hash(&root, &tokens, Some("tone"), &[])),
            "ba8d0755bf8d889042c2cbee285a578877176c89cfdd07a70f30c6864fb893d1"
        );
        let media = [("abc".to_string(), -3)];
        assert_eq!(
            hex(&block_hash(&root, &tokens, Some("tone"), &media)),
            "ce20773503256c48d1a56c05f83fcf9d277e17e62c556262bef416811b9768c5"
        );
        assert_ne!(
            block_hash(&root, &tokens, Some("tone"), &[]),
            block_hash(&root, &tokens, None, &[])
        );
    }

    #[test]
    fn a_block_is_keyed_on_the_media_it_overlaps() {
        let media = [
            MediaSpan {
                identifier: "a".into(),
                start: 3,
                end: 9,
            },
            MediaSpan {
                identifier: "b".into(),
                start: 12,
                end: 13,
            },
        ];
        assert_eq!(media_keys(&media, 0, 4), vec![("a".to_string(), 3)]);
        assert_eq!(media_keys(&media, 8, 12), vec![("a".to_string(), -5)]);
        assert_eq!(media_keys(&media, 9, 12), vec![]);
        assert_eq!(media_keys(&media, 12, 16), vec![("b".to_string(), 0)]);
    }
}
