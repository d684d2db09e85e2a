//! The value model: what one record of an archive can hold, as plain Rust data.
//!
//! Writers build a `Value` tree per record and the encoder (`encode`) lays it out in the
//! compact format of docs/format.md; readers never build `Value`s: they read the bytes in
//! place (`reader`). Large byte payloads (numpy array data, big `bytes`) are written *out
//! of line* by the builder before the record, 64-byte aligned, and the record holds their
//! [`Extent`].

/// Where an out-of-line payload lives (absolute position in the archive), and the xxh3-64
/// of its bytes (checked by `verify()`, not on the read path: docs/format.md, "Integrity").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub checksum: u64,
}

/// A numpy array: dtype as numpy's array-interface `typestr` (e.g. `<f8`), C-order shape,
/// and the extent of its C-contiguous data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayMeta {
    pub typestr: String,
    pub shape: Vec<u64>,
    pub data: Extent,
}

/// One stored value. The variants mirror the Python types shmstore accepts.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside i64: two's-complement little-endian bytes, minimal length.
    BigInt(Vec<u8>),
    Float(f64),
    /// A complex number (real, imaginary).
    Complex([f64; 2]),
    Str(String),
    /// A str already interned in the encoder's symbol table (`Encoder::intern`), as writers
    /// pass dict keys: no copy of the key per dict. Only meaningful to the encoder that
    /// interned it.
    Sym(u32),
    Bytes(Vec<u8>),
    /// Large bytes stored out of line.
    BytesExt(Extent),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// A dict: (key, value) pairs in insertion order.
    Dict(Vec<(Value, Value)>),
    Array(Box<ArrayMeta>),
}

/// General-layout dicts with more entries than this get a hash index inside the record.
pub const DICT_INDEX_MIN: usize = 8;

/// Containers (list, tuple, dict) nested in one record: the Python writer refuses deeper
/// input, and readers refuse deeper records as corrupt.
pub const MAX_DEPTH: usize = 100;
/// Tuples nested inside one dict key (on top of [`MAX_DEPTH`]).
pub const MAX_KEY_DEPTH: usize = 32;
/// The deepest container nesting on any path of a well-formed record (values, then the
/// tuples of a key): the bound of decoders that count levels. The tree check refuses, as
/// corrupt, values deeper than [`MAX_DEPTH`] and keys deeper than [`MAX_KEY_DEPTH`]
/// separately (docs/format.md, "Depth").
pub const MAX_VALUE_DEPTH: usize = MAX_DEPTH + MAX_KEY_DEPTH;

/// Whether a general-layout dict of `entries` entries is stored with a hash index.
pub fn dict_has_index(entries: usize) -> bool {
    entries > DICT_INDEX_MIN
}

/// Item size in bytes of an array-interface typestr, if shmstore stores that dtype.
///
/// Accepted: bool (`|b1`), signed/unsigned ints of 1/2/4/8 bytes, floats of 2/4/8 bytes,
/// complex of 8/16 bytes, in either byte order.
pub fn typestr_itemsize(typestr: &str) -> Option<usize> {
    let b = typestr.as_bytes();
    // Bytes, not chars: the typestr comes from the file and may hold any UTF-8.
    if !(3..=4).contains(&b.len())
        || !matches!(b[0], b'<' | b'>' | b'|' | b'=')
        || !b[2..].iter().all(u8::is_ascii_digit)
        || b[2] == b'0'
    {
        return None;
    }
    let size = b[2..]
        .iter()
        .fold(0usize, |acc, d| acc * 10 + usize::from(d - b'0'));
    let ok = match b[1] {
        b'b' => size == 1,
        b'i' | b'u' => matches!(size, 1 | 2 | 4 | 8),
        b'f' => matches!(size, 2 | 4 | 8),
        b'c' => matches!(size, 8 | 16),
        _ => false,
    };
    ok.then_some(size)
}

/// A typestr that passed [`typestr_itemsize`] (3 or 4 ASCII bytes), held inline: a stored
/// array read is described without an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeStr {
    bytes: [u8; 4],
    len: u8,
}

impl TypeStr {
    /// Unsigned bytes, `|u1`.
    pub const BYTES: TypeStr = TypeStr {
        bytes: *b"|u1\0",
        len: 3,
    };

    /// `s` and its item size, if it is a typestr stored arrays may have.
    pub fn new(s: &str) -> Option<(TypeStr, usize)> {
        let size = typestr_itemsize(s)?;
        let mut bytes = [0; 4];
        bytes[..s.len()].copy_from_slice(s.as_bytes());
        Some((
            TypeStr {
                bytes,
                len: s.len() as u8,
            },
            size,
        ))
    }

    pub fn as_str(&self) -> &str {
        // ASCII (`typestr_itemsize` accepts nothing else), so always UTF-8.
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // From crafted files: never a panic on non-ASCII or odd digits.
        assert_eq!(typestr_itemsize("<\u{e9}8"), None);
        assert_eq!(typestr_itemsize("<f\u{e9}"), None);
        assert_eq!(typestr_itemsize("\u{e9}f8"), None);
        assert_eq!(typestr_itemsize("<f+8"), None);
        assert_eq!(typestr_itemsize("<f0008"), None);
        assert_eq!(typestr_itemsize("<i08"), None);
    }

    /// `TypeStr` holds exactly the typestrs `typestr_itemsize` accepts, as they were given.
    #[test]
    fn inline_typestrs() {
        let mut accepted = 0;
        for order in ["<", ">", "|", "=", "!", "\u{e9}"] {
            for kind in ["b", "i", "u", "f", "c", "O", "U", "M"] {
                for size in ["", "0", "1", "2", "3", "4", "8", "16", "32", "08", "100"] {
                    let s = format!("{order}{kind}{size}");
                    let inline = TypeStr::new(&s);
                    assert_eq!(inline.map(|(_, n)| n), typestr_itemsize(&s), "{s}");
                    if let Some((t, _)) = inline {
                        assert_eq!(t.as_str(), s);
                        accepted += 1;
                    }
                }
            }
        }
        assert_eq!(accepted, 4 * 14);
        assert_eq!(TypeStr::BYTES.as_str(), "|u1");
        assert_eq!(TypeStr::new("|u1").map(|(t, _)| t), Some(TypeStr::BYTES));
    }
}
