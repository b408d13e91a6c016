//! A small reader for the metadata section of GGUF files (versions 2 and 3).
//!
//! Only the key/value metadata is read; the tensor table and the tensor data
//! that follow it are never touched, so this is cheap even for large models.
//!
//! Layout (all little-endian): the magic `GGUF`, a `u32` version, a `u64`
//! tensor count, a `u64` key/value count, then that many pairs of a string key,
//! a `u32` value type and the value. Strings are a `u64` byte length followed
//! by UTF-8 bytes; arrays are a `u32` element type, a `u64` length and the
//! elements.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use crate::error::{Result, TextError};

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: every element has the same type.
    Array(Vec<GgufValue>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl GgufValue {
    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            GgufValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// Any integer value that fits in a `u32`.
    pub fn as_u32(&self) -> Option<u32> {
        let wide: i128 = match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        };
        u32::try_from(wide).ok()
    }

    /// Any integer value as an `i64` (saturating for huge `u64`s).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(i64::try_from(v).unwrap_or(i64::MAX)),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any numeric value as an `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// The metadata of one GGUF file.
#[derive(Debug, Clone)]
pub struct GgufMetadata {
    path: PathBuf,
    version: u32,
    tensor_count: u64,
    entries: HashMap<String, GgufValue>,
}

/// Upper bound on a single length field, to fail cleanly on corrupt files
/// instead of trying to allocate absurd amounts of memory.
const MAX_STRING_BYTES: u64 = 1 << 30;
const MAX_ARRAY_LEN: u64 = 1 << 31;
const MAX_NESTING: usize = 8;

impl GgufMetadata {
    /// Reads the metadata of the GGUF file at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| TextError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_reader(BufReader::with_capacity(1 << 20, file), path)
    }

    /// Reads GGUF metadata from any byte stream; `path` is only used in messages.
    pub(crate) fn from_reader(inner: impl Read, path: &Path) -> Result<Self> {
        let mut reader = Reader { inner, path };
        let magic = reader.bytes4()?;
        if &magic != b"GGUF" {
            return Err(reader.error("the file does not start with the magic bytes \"GGUF\""));
        }
        let version = reader.u32()?;
        if version != 2 && version != 3 {
            return Err(reader.error(format!(
                "GGUF version {version} is not supported (only versions 2 and 3 are)"
            )));
        }
        let tensor_count = reader.u64()?;
        let kv_count = reader.u64()?;
        let mut entries = HashMap::new();
        for _ in 0..kv_count {
            let key = reader.string()?;
            let value_type = reader.u32()?;
            let value = reader.value(value_type, 0)?;
            entries.insert(key, value);
        }
        Ok(GgufMetadata {
            path: path.to_path_buf(),
            version,
            tensor_count,
            entries,
        })
    }

    /// The file this metadata was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The number of tensors the file declares.
    pub fn tensor_count(&self) -> u64 {
        self.tensor_count
    }

    /// The value stored under `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.entries.get(key)
    }

    /// The string stored under `key`, if there is one.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    /// All keys, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}

struct Reader<'a, R> {
    inner: R,
    path: &'a Path,
}

impl<R: Read> Reader<'_, R> {
    fn error(&self, message: impl Into<String>) -> TextError {
        TextError::Gguf {
            path: self.path.to_path_buf(),
            message: message.into(),
        }
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<()> {
        self.inner.read_exact(buf).map_err(|err| {
            if err.kind() == std::io::ErrorKind::UnexpectedEof {
                self.error("the file ends in the middle of the metadata")
            } else {
                TextError::Io {
                    path: self.path.to_path_buf(),
                    source: err,
                }
            }
        })
    }

    fn bytes4(&mut self) -> Result<[u8; 4]> {
        let mut buf = [0u8; 4];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn bytes8(&mut self) -> Result<[u8; 8]> {
        let mut buf = [0u8; 8];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    fn u8(&mut self) -> Result<u8> {
        let mut buf = [0u8; 1];
        self.fill(&mut buf)?;
        Ok(buf[0])
    }

    fn u16(&mut self) -> Result<u16> {
        let mut buf = [0u8; 2];
        self.fill(&mut buf)?;
        Ok(u16::from_le_bytes(buf))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes4()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes8()?))
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > MAX_STRING_BYTES {
            return Err(self.error(format!("a string claims to be {len} bytes long")));
        }
        let mut buf = Vec::new();
        let read = (&mut self.inner)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(|source| TextError::Io {
                path: self.path.to_path_buf(),
                source,
            })?;
        if read as u64 != len {
            return Err(self.error("the file ends in the middle of a string"));
        }
        String::from_utf8(buf).map_err(|_| self.error("a metadata string is not valid UTF-8"))
    }

    fn value(&mut self, value_type: u32, depth: usize) -> Result<GgufValue> {
        Ok(match value_type {
            0 => GgufValue::U8(self.u8()?),
            1 => GgufValue::I8(i8::from_le_bytes([self.u8()?])),
            2 => GgufValue::U16(self.u16()?),
            3 => GgufValue::I16(i16::from_le_bytes(self.u16()?.to_le_bytes())),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.bytes4()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.bytes4()?)),
            7 => match self.u8()? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                other => return Err(self.error(format!("invalid boolean byte {other}"))),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(self.error("arrays are nested too deeply"));
                }
                let elem_type = self.u32()?;
                let len = self.u64()?;
                if len > MAX_ARRAY_LEN {
                    return Err(self.error(format!("an array claims {len} elements")));
                }
                // Grow as elements arrive rather than trusting the length up front.
                let mut items = Vec::with_capacity(len.min(1 << 16) as usize);
                for _ in 0..len {
                    items.push(self.value(elem_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes8()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes8()?)),
            other => return Err(self.error(format!("unknown metadata value type {other}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push_string(buf: &mut Vec<u8>, s: &str) {
        buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
        buf.extend_from_slice(s.as_bytes());
    }

    fn parse(bytes: &[u8]) -> Result<GgufMetadata> {
        GgufMetadata::from_reader(bytes, Path::new("test.gguf"))
    }

    fn header(kv_count: u64) -> Vec<u8> {
        let mut buf = b"GGUF".to_vec();
        buf.extend_from_slice(&3u32.to_le_bytes());
        buf.extend_from_slice(&0u64.to_le_bytes());
        buf.extend_from_slice(&kv_count.to_le_bytes());
        buf
    }

    #[test]
    fn reads_scalars_strings_and_arrays() -> Result<()> {
        let mut buf = header(3);
        push_string(&mut buf, "general.architecture");
        buf.extend_from_slice(&8u32.to_le_bytes());
        push_string(&mut buf, "gemma4");
        push_string(&mut buf, "tokenizer.ggml.bos_token_id");
        buf.extend_from_slice(&4u32.to_le_bytes());
        buf.extend_from_slice(&2u32.to_le_bytes());
        push_string(&mut buf, "tokenizer.ggml.tokens");
        buf.extend_from_slice(&9u32.to_le_bytes());
        buf.extend_from_slice(&8u32.to_le_bytes());
        buf.extend_from_slice(&2u64.to_le_bytes());
        push_string(&mut buf, "<pad>");
        push_string(&mut buf, "▁a");
        let meta = parse(&buf)?;
        assert_eq!(meta.get_str("general.architecture"), Some("gemma4"));
        assert_eq!(
            meta.get("tokenizer.ggml.bos_token_id")
                .and_then(GgufValue::as_u32),
            Some(2)
        );
        let tokens = meta
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::as_array)
            .map(|a| a.iter().filter_map(GgufValue::as_str).collect::<Vec<_>>());
        assert_eq!(tokens, Some(vec!["<pad>", "▁a"]));
        Ok(())
    }

    #[test]
    fn rejects_bad_magic_and_truncation() {
        assert!(matches!(
            parse(b"GGML\x03\x00\x00\x00"),
            Err(TextError::Gguf { .. })
        ));
        let mut buf = header(1);
        push_string(&mut buf, "general.name");
        buf.extend_from_slice(&8u32.to_le_bytes());
        buf.extend_from_slice(&100u64.to_le_bytes());
        buf.extend_from_slice(b"short");
        assert!(matches!(parse(&buf), Err(TextError::Gguf { .. })));
    }

    #[test]
    fn rejects_huge_lengths_without_allocating() {
        let mut buf = header(1);
        push_string(&mut buf, "k");
        buf.extend_from_slice(&9u32.to_le_bytes());
        buf.extend_from_slice(&4u32.to_le_bytes());
        buf.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(parse(&buf), Err(TextError::Gguf { .. })));
    }
}
