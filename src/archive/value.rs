//! The value model: what one record of an archive can hold.
//!
//! A record is serialized with rkyv into the segment; readers access it in place
//! (`ArchivedValue`) without deserializing. Large byte payloads (numpy array data, big
//! `bytes`) are written *out of line*, before the record's rkyv bytes and inside the same
//! record span, so that they are 64-byte aligned and never pass through a temporary buffer.

use rkyv::{Archive, Deserialize, Serialize};

/// Where an out-of-line payload lives, relative to the start of its record span.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

/// A numpy array: dtype as numpy's array-interface `typestr` (e.g. `<f8`), C-order shape,
/// and the extent of its C-contiguous data.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ArrayMeta {
    pub typestr: String,
    pub shape: Vec<u64>,
    pub data: Extent,
}

/// One stored value. The variants mirror the Python types shmstore accepts.
///
/// With rkyv's `unaligned` format an archived `Value` is 9 bytes (a tag and 8 bytes);
/// anything larger (array metadata, extents, indexed dicts) sits behind a `Box`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(serialize_bounds(
    __S: rkyv::ser::Writer + rkyv::ser::Allocator,
    __S::Error: rkyv::rancor::Source,
))]
#[rkyv(deserialize_bounds(__D::Error: rkyv::rancor::Source))]
#[rkyv(bytecheck(bounds(__C: rkyv::validation::ArchiveContext, __C::Error: rkyv::rancor::Source)))]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside i64: two's-complement little-endian bytes, minimal length.
    BigInt(Vec<u8>),
    Float(f64),
    /// A complex number (real, imaginary); boxed to keep `Value` at 9 bytes.
    Complex(Box<[f64; 2]>),
    Str(String),
    /// A str interned in the archive's symbol table (used for dict keys).
    Sym(u32),
    Bytes(Vec<u8>),
    /// Large bytes stored out of line.
    BytesExt(Box<Extent>),
    List(#[rkyv(omit_bounds)] Vec<Value>),
    Tuple(#[rkyv(omit_bounds)] Vec<Value>),
    /// A small dict: keys and values interleaved (`k0, v0, k1, v1, ...`), in insertion
    /// order, looked up by a linear scan.
    Dict(#[rkyv(omit_bounds)] Vec<Value>),
    /// A dict with more than [`DICT_INDEX_MIN`] entries, with a hash index.
    IndexedDict(#[rkyv(omit_bounds)] Box<IndexedDict>),
    Array(Box<ArrayMeta>),
}

/// Entries as in [`Value::Dict`], plus an open-addressing table of `entry + 1` (0 = empty)
/// over the stable key hash; its size is a power of two.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
#[rkyv(serialize_bounds(
    __S: rkyv::ser::Writer + rkyv::ser::Allocator,
    __S::Error: rkyv::rancor::Source,
))]
#[rkyv(deserialize_bounds(__D::Error: rkyv::rancor::Source))]
#[rkyv(bytecheck(bounds(__C: rkyv::validation::ArchiveContext, __C::Error: rkyv::rancor::Source)))]
pub struct IndexedDict {
    #[rkyv(omit_bounds)]
    pub items: Vec<Value>,
    pub index: Vec<u32>,
}

/// Dicts with more entries than this get a hash index inside the record.
pub const DICT_INDEX_MIN: usize = 8;

/// Item size in bytes of an array-interface typestr, if shmstore stores that dtype.
///
/// Accepted: bool (`|b1`), signed/unsigned ints of 1/2/4/8 bytes, floats of 2/4/8 bytes,
/// complex of 8/16 bytes, in either byte order.
pub fn typestr_itemsize(typestr: &str) -> Option<usize> {
    let b = typestr.as_bytes();
    if b.len() < 3 || !matches!(b[0], b'<' | b'>' | b'|' | b'=') {
        return None;
    }
    let size: usize = typestr[2..].parse().ok()?;
    let ok = match b[1] {
        b'b' => size == 1,
        b'i' | b'u' => matches!(size, 1 | 2 | 4 | 8),
        b'f' => matches!(size, 2 | 4 | 8),
        b'c' => matches!(size, 8 | 16),
        _ => false,
    };
    ok.then_some(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archived_value_is_small() {
        assert_eq!(std::mem::size_of::<ArchivedValue>(), 9);
    }

    #[test]
    fn typestrs() {
        assert_eq!(typestr_itemsize("<f8"), Some(8));
        assert_eq!(typestr_itemsize("|b1"), Some(1));
        assert_eq!(typestr_itemsize("<c16"), Some(16));
        assert_eq!(typestr_itemsize(">i2"), Some(2));
        assert_eq!(typestr_itemsize("|O8"), None);
        assert_eq!(typestr_itemsize("<f3"), None);
        assert_eq!(typestr_itemsize("<U4"), None);
        assert_eq!(typestr_itemsize(""), None);
    }
}
