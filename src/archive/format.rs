//! The vocabulary of a record's bytes (docs/format.md, "Records"): value tags, packed
//! element types, the field encodings of shapes, varints. Shared by the encoder and the
//! reader, so that both speak one language.

use super::ArchiveError;

// Tags of a tagged value (the first byte of every value that is not in a typed slot).
pub const T_NONE: u8 = 0;
pub const T_FALSE: u8 = 1;
pub const T_TRUE: u8 = 2;
pub const T_I8: u8 = 3;
pub const T_I16: u8 = 4;
pub const T_I32: u8 = 5;
pub const T_I64: u8 = 6;
/// varint length + two's-complement little-endian bytes (an int outside i64).
pub const T_BIGINT: u8 = 7;
pub const T_F64: u8 = 8;
pub const T_COMPLEX: u8 = 9;
/// varint length + UTF-8 bytes.
pub const T_STR: u8 = 10;
/// varint symbol id (a str of the archive's symbol table).
pub const T_SYM: u8 = 11;
/// varint length + bytes.
pub const T_BYTES: u8 = 12;
/// u64 offset, u64 length, u64 xxh3 of out-of-line bytes.
pub const T_BYTES_EXT: u8 = 13;
/// u8 typestr length + typestr, u8 ndim + u64 × ndim shape, u64 offset, u64 nbytes, u64 xxh3.
pub const T_ARRAY: u8 = 14;
/// varint count + count × u32 forward refs to tagged values.
pub const T_LIST: u8 = 16;
pub const T_TUPLE: u8 = 17;
/// u8 element type + varint count + count × element (raw little-endian).
pub const T_LIST_PACKED: u8 = 18;
pub const T_TUPLE_PACKED: u8 = 19;
/// varint shape id + varint count + count × (the shape's slots): a list of same-shape dicts.
pub const T_LIST_STRUCT: u8 = 20;
pub const T_TUPLE_STRUCT: u8 = 21;
/// varint shape id + the shape's slots.
pub const T_DICT_SHAPED: u8 = 22;
/// varint count + count × (u32 key ref, u32 value ref) [+ index: u32 × capacity, when
/// count > `DICT_INDEX_MIN`]: any keys.
pub const T_DICT: u8 = 23;

/// Size of a forward reference: a u32 distance from the reference's own position to the
/// value it names, always > 0 (values only point forward, so a record is a tree laid out
/// breadth first: docs/format.md, "Records").
pub const REF: usize = 4;

/// Element type of a packed list/tuple or of a packed field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Elem {
    Bool = 1,
    I8 = 2,
    I16 = 3,
    I32 = 4,
    I64 = 5,
    F64 = 6,
}

impl Elem {
    pub fn from_u8(b: u8) -> Option<Elem> {
        Some(match b {
            1 => Elem::Bool,
            2 => Elem::I8,
            3 => Elem::I16,
            4 => Elem::I32,
            5 => Elem::I64,
            6 => Elem::F64,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Elem::Bool | Elem::I8 => 1,
            Elem::I16 => 2,
            Elem::I32 => 4,
            Elem::I64 | Elem::F64 => 8,
        }
    }
    /// The narrowest int element holding `i`.
    pub fn int_for(i: i64) -> Elem {
        if i8::try_from(i).is_ok() {
            Elem::I8
        } else if i16::try_from(i).is_ok() {
            Elem::I16
        } else if i32::try_from(i).is_ok() {
            Elem::I32
        } else {
            Elem::I64
        }
    }
    pub fn is_int(self) -> bool {
        matches!(self, Elem::I8 | Elem::I16 | Elem::I32 | Elem::I64)
    }
}

/// One packed element at the start of `b` (`b.len() >= elem.size()`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
}

/// Read one element (`None` if `b` is too short or a bool byte is not 0/1).
#[inline(always)]
pub fn read_elem(elem: Elem, b: &[u8]) -> Option<Scalar> {
    Some(match elem {
        Elem::Bool => match *b.first()? {
            0 => Scalar::Bool(false),
            1 => Scalar::Bool(true),
            _ => return None,
        },
        Elem::I8 => Scalar::Int(*b.first()? as i8 as i64),
        Elem::I16 => Scalar::Int(i16::from_le_bytes(b.get(..2)?.try_into().ok()?) as i64),
        Elem::I32 => Scalar::Int(i32::from_le_bytes(b.get(..4)?.try_into().ok()?) as i64),
        Elem::I64 => Scalar::Int(i64::from_le_bytes(b.get(..8)?.try_into().ok()?)),
        Elem::F64 => Scalar::Float(f64::from_le_bytes(b.get(..8)?.try_into().ok()?)),
    })
}

/// Most elements in a packed *field* (a slot of fixed size); longer lists are values.
pub const MAX_FIELD_PACK: usize = 16;
/// Most fields in a shape; dicts with more keys use the general layout.
pub const MAX_SHAPE_FIELDS: usize = 64;
/// Most shapes in one archive; later new key sets use the general layout.
pub const MAX_SHAPES: usize = 1 << 16;

/// How one field of a shape is stored in its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Enc {
    /// Always None (0 bytes).
    None,
    /// Always a bool (1 byte).
    Bool,
    /// Always an int that fits this element (1/2/4/8 bytes).
    Int(Elem),
    /// Always a float (8 bytes).
    F64,
    /// Always a str: a ref to varint length + UTF-8.
    Str,
    /// Always (small) bytes: a ref to varint length + bytes.
    Bytes,
    /// Always a list (or tuple) of exactly `count` elements of `elem`, inline.
    Pack { elem: Elem, count: u8, tuple: bool },
    /// Anything: a ref to a tagged value.
    Ref,
}

impl Enc {
    /// Slot size in bytes.
    pub fn size(self) -> usize {
        match self {
            Enc::None => 0,
            Enc::Bool => 1,
            Enc::Int(e) => e.size(),
            Enc::F64 => 8,
            Enc::Str | Enc::Bytes | Enc::Ref => REF,
            Enc::Pack { elem, count, .. } => elem.size() * count as usize,
        }
    }

    /// Whether the slot holds a ref.
    pub fn is_ref(self) -> bool {
        matches!(self, Enc::Str | Enc::Bytes | Enc::Ref)
    }

    /// The narrowest encoding that holds both (a field generalises, never narrows).
    pub fn join(self, other: Enc) -> Enc {
        match (self, other) {
            (a, b) if a == b => a,
            (Enc::Int(a), Enc::Int(b)) => Enc::Int(wider(a, b)),
            (
                Enc::Pack {
                    elem: a,
                    count: n,
                    tuple: t,
                },
                Enc::Pack {
                    elem: b,
                    count: m,
                    tuple: u,
                },
            ) if n == m && t == u && a.is_int() && b.is_int() => Enc::Pack {
                elem: wider(a, b),
                count: n,
                tuple: t,
            },
            _ => Enc::Ref,
        }
    }

    /// Metadata form: code, element, count, flags (4 bytes).
    pub fn encode(self) -> [u8; 4] {
        match self {
            Enc::None => [0, 0, 0, 0],
            Enc::Bool => [1, 0, 0, 0],
            Enc::Int(e) => [2, e as u8, 0, 0],
            Enc::F64 => [3, 0, 0, 0],
            Enc::Str => [4, 0, 0, 0],
            Enc::Bytes => [5, 0, 0, 0],
            Enc::Pack { elem, count, tuple } => [6, elem as u8, count, tuple as u8],
            Enc::Ref => [7, 0, 0, 0],
        }
    }

    pub fn decode(b: [u8; 4]) -> Option<Enc> {
        let enc = match b {
            [0, 0, 0, 0] => Enc::None,
            [1, 0, 0, 0] => Enc::Bool,
            [2, e, 0, 0] => Enc::Int(Elem::from_u8(e).filter(|e| e.is_int())?),
            [3, 0, 0, 0] => Enc::F64,
            [4, 0, 0, 0] => Enc::Str,
            [5, 0, 0, 0] => Enc::Bytes,
            [6, e, n, t @ (0 | 1)] if (1..=MAX_FIELD_PACK as u8).contains(&n) => Enc::Pack {
                elem: Elem::from_u8(e)?,
                count: n,
                tuple: t == 1,
            },
            [7, 0, 0, 0] => Enc::Ref,
            _ => return None,
        };
        Some(enc)
    }
}

fn wider(a: Elem, b: Elem) -> Elem {
    if a.size() >= b.size() {
        a
    } else {
        b
    }
}

/// Append `v` as a LEB128 varint.
#[inline]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Read a LEB128 varint at `b[at..]`: (value, position after it). At most 10 bytes; a value
/// past u64, or running off the end, is `Corrupt`.
#[inline(always)]
pub fn get_varint(b: &[u8], at: usize) -> Result<(u64, usize), ArchiveError> {
    // Most varints here (counts, shape ids, symbol ids) fit one byte, and the length of a
    // str or bytes under 16 KiB two.
    match b.get(at) {
        Some(&byte) if byte < 0x80 => Ok((byte as u64, at + 1)),
        Some(&low) => match b.get(at + 1) {
            Some(&high) if high < 0x80 => Ok((((high as u64) << 7) | (low & 0x7f) as u64, at + 2)),
            _ => get_varint_long(b, at),
        },
        None => get_varint_long(b, at),
    }
}

/// [`get_varint`] of one or two bytes (a value below 16,384), for the smallest read paths:
/// `None` for a longer or truncated varint (the caller then takes the long way, which reads
/// or reports it). No error value and no call, so a path that inlines it has nothing that
/// could unwind.
#[inline(always)]
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub fn get_varint_small(b: &[u8], at: usize) -> Option<(u64, usize)> {
    let low = *b.get(at)?;
    if low < 0x80 {
        return Some((low as u64, at + 1));
    }
    let high = *b.get(at + 1)?;
    (high < 0x80).then(|| (((high as u64) << 7) | (low & 0x7f) as u64, at + 2))
}

#[inline(never)]
fn get_varint_long(b: &[u8], at: usize) -> Result<(u64, usize), ArchiveError> {
    let mut v = 0u64;
    let mut i = at;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = b.get(i) else {
            return Err(ArchiveError::Corrupt("truncated varint".into()));
        };
        i += 1;
        let bits = (byte & 0x7f) as u64;
        if shift == 63 && bits > 1 {
            break;
        }
        v |= bits << shift;
        if byte & 0x80 == 0 {
            return Ok((v, i));
        }
    }
    Err(ArchiveError::Corrupt("varint too long".into()))
}

/// A shape: an ordered set of str keys (symbol ids) and how each value is stored.
/// A dict of this shape is its slots: field `i` at `offsets[i]`, `size` bytes in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    pub keys: Box<[u32]>,
    pub encs: Box<[Enc]>,
    pub offsets: Box<[u32]>,
    pub size: u32,
}

impl Shape {
    pub fn new(keys: Box<[u32]>, encs: Box<[Enc]>) -> Shape {
        let mut offsets = Vec::with_capacity(encs.len());
        let mut at = 0u32;
        for e in encs.iter() {
            offsets.push(at);
            at += e.size() as u32;
        }
        Shape {
            keys,
            encs,
            offsets: offsets.into(),
            size: at,
        }
    }

    /// Metadata form: u16 field count, then per field u32 symbol id + 4-byte encoding.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.keys.len() as u16).to_le_bytes());
        for (k, e) in self.keys.iter().zip(self.encs.iter()) {
            out.extend_from_slice(&k.to_le_bytes());
            out.extend_from_slice(&e.encode());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_refuse_garbage() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            assert_eq!(get_varint(&b, 0).unwrap(), (v, b.len()));
        }
        assert!(get_varint(&[0x80], 0).is_err());
        assert!(get_varint(&[0xff; 11], 0).is_err());
        // 2^64 does not fit.
        let mut b = vec![0x80; 9];
        b.push(0x02);
        assert!(get_varint(&b, 0).is_err());
        // The one- and two-byte paths read what the general loop reads, for every pair of
        // bytes (non-canonical ones too), alone, followed by more, or cut short.
        for b0 in 0..=255u8 {
            for b1 in 0..=255u8 {
                for b in [&[b0, b1][..], &[b0, b1, 0x01], &[b0, b1, 0x81, 0x01]] {
                    assert_eq!(get_varint(b, 0).ok(), get_varint_long(b, 0).ok(), "{b:?}");
                }
            }
            assert_eq!(get_varint(&[b0], 0).ok(), get_varint_long(&[b0], 0).ok());
        }
    }

    #[test]
    fn small_varints_read_as_the_general_reader_or_not_at_all() {
        // Every pair of bytes, alone, followed by more, cut short, and at an offset: the
        // small reader gives what `get_varint` gives for one or two bytes, and nothing for
        // a longer varint or one past the end (never a different value).
        for b0 in 0..=255u8 {
            for b1 in 0..=255u8 {
                for b in [
                    &[b0, b1][..],
                    &[b0, b1, 0x01],
                    &[0x05, b0, b1, 0x81, 0x01],
                    &[b0],
                ] {
                    for at in 0..b.len() + 1 {
                        let small = get_varint_small(b, at);
                        let general = get_varint(b, at).ok();
                        match small {
                            Some(got) => assert_eq!(Some(got), general, "{b:?} at {at}"),
                            None => assert!(
                                general.is_none_or(|(_, end)| end > at + 2),
                                "{b:?} at {at}: {general:?} not read"
                            ),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn encodings_round_trip_and_join_upward() {
        let all = [
            Enc::None,
            Enc::Bool,
            Enc::Int(Elem::I16),
            Enc::F64,
            Enc::Str,
            Enc::Bytes,
            Enc::Pack {
                elem: Elem::F64,
                count: 4,
                tuple: false,
            },
            Enc::Ref,
        ];
        for e in all {
            assert_eq!(Enc::decode(e.encode()), Some(e));
        }
        assert_eq!(Enc::decode([6, 6, 0, 0]), None);
        assert_eq!(Enc::decode([2, 6, 0, 0]), None);
        assert_eq!(
            Enc::Int(Elem::I8).join(Enc::Int(Elem::I32)),
            Enc::Int(Elem::I32)
        );
        assert_eq!(Enc::Int(Elem::I8).join(Enc::F64), Enc::Ref);
        assert_eq!(Enc::Bool.join(Enc::Int(Elem::I8)), Enc::Ref);
        assert_eq!(Enc::None.join(Enc::Str), Enc::Ref);
    }
}
