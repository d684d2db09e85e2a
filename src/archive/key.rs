//! Dict keys: a canonical, type-preserving byte encoding and a hash that is stable on
//! every machine and in every process (xxh3 with fixed seeds), so a hash index written
//! by one process is valid for all readers.
//!
//! Keys compare like Python keys: `True == 1 == 1.0` (bool, int and integral floats are
//! normalised to one integer class before hashing and comparing).

use std::borrow::Cow;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::ArchiveError;

/// A dict key, borrowed from an archive or built from a Python object.
#[derive(Debug, Clone, PartialEq)]
pub enum Key<'a> {
    None,
    Bool(bool),
    Int(i64),
    /// Two's-complement little-endian, minimal length (never fits in i64).
    BigInt(Cow<'a, [u8]>),
    Float(f64),
    Str(Cow<'a, str>),
    Bytes(Cow<'a, [u8]>),
    Tuple(Vec<Key<'a>>),
}

const T_NONE: u8 = 0;
const T_FALSE: u8 = 1;
const T_TRUE: u8 = 2;
const T_INT: u8 = 3;
const T_BIGINT: u8 = 4;
const T_FLOAT: u8 = 5;
pub(crate) const T_STR: u8 = 6;
const T_BYTES: u8 = 7;
const T_TUPLE: u8 = 8;

const SEED_NONE: u64 = 0x5348_4d00;
const SEED_INT: u64 = 0x5348_4d01;
const SEED_BIGINT: u64 = 0x5348_4d02;
const SEED_FLOAT: u64 = 0x5348_4d03;
const SEED_STR: u64 = 0x5348_4d04;
const SEED_BYTES: u64 = 0x5348_4d05;
const SEED_TUPLE: u64 = 0x5348_4d06;

/// Integral floats in this range are keyed as ints (Python: `hash(2.0) == hash(2)`).
const I64_FLOAT_LIMIT: f64 = 9_223_372_036_854_775_808.0; // 2**63

/// The integer a key equals, when it belongs to Python's bool/int/integral-float class.
fn as_int(k: &Key<'_>) -> Option<i64> {
    match *k {
        Key::Bool(b) => Some(b as i64),
        Key::Int(i) => Some(i),
        Key::Float(f) if f.fract() == 0.0 && (-I64_FLOAT_LIMIT..I64_FLOAT_LIMIT).contains(&f) => {
            Some(f as i64)
        }
        _ => None,
    }
}

/// How many bytes the integer of two's-complement little-endian `b` takes at least (its
/// sign-extension bytes dropped; 0 for no bytes).
pub fn bigint_min_len(b: &[u8]) -> usize {
    let Some(&last) = b.last() else {
        return 0;
    };
    let sign = if last & 0x80 != 0 { 0xff } else { 0x00 };
    let mut n = b.len();
    while n > 1 && b[n - 1] == sign && (b[n - 2] & 0x80) == (sign & 0x80) {
        n -= 1;
    }
    n
}

/// Whether `b` is the `BigInt` form of an integer: its shortest two's-complement
/// little-endian bytes, more than 8 of them (writers store an integer that fits in an i64
/// as `Int`). A key in any other form is forged: it would never compare equal to the int it
/// holds, which Python finds by value.
pub fn bigint_is_canonical(b: &[u8]) -> bool {
    b.len() > 8 && bigint_min_len(b) == b.len()
}

/// The exact integer an integral float beyond i64 equals, as minimal two's-complement
/// little-endian bytes (the `BigInt` form), so `float(2**64)` and `2**64` are one key.
fn float_bigint(f: f64) -> Option<Vec<u8>> {
    if !f.is_finite() || f.fract() != 0.0 || (-I64_FLOAT_LIMIT..I64_FLOAT_LIMIT).contains(&f) {
        return None;
    }
    let bits = f.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i64 - 1075; // value = mantissa * 2^exp, exp >= 11 here
    let mantissa = (bits & ((1u64 << 52) - 1)) | (1u64 << 52);
    let shift = exp as usize;
    // magnitude = mantissa << shift, as little-endian bytes
    let nbytes = (53 + shift) / 8 + 2;
    let mut mag = vec![0u8; nbytes];
    let (byte, bit) = (shift / 8, shift % 8);
    let wide = (mantissa as u128) << bit;
    for i in 0..16 {
        if byte + i < nbytes {
            mag[byte + i] = (wide >> (8 * i)) as u8;
        }
    }
    if f < 0.0 {
        // two's complement: invert and add one
        let mut carry = 1u16;
        for b in mag.iter_mut() {
            let v = (!*b) as u16 + carry;
            *b = v as u8;
            carry = v >> 8;
        }
    }
    mag.truncate(bigint_min_len(&mag)); // the shortest form, as every BigInt key
    Some(mag)
}

/// Stable hash of a str key (shared with the reader's fast path for str lookups).
pub fn hash_str(s: &str) -> u64 {
    xxh3_64_with_seed(s.as_bytes(), SEED_STR)
}

/// Stable hash of an integer-class key.
pub fn hash_int(i: i64) -> u64 {
    xxh3_64_with_seed(&i.to_le_bytes(), SEED_INT)
}

impl Key<'_> {
    /// The stable hash: equal keys (in Python's sense) hash equal.
    pub fn stable_hash(&self) -> u64 {
        if let Some(i) = as_int(self) {
            return hash_int(i);
        }
        if let Key::Float(f) = self {
            if let Some(b) = float_bigint(*f) {
                return xxh3_64_with_seed(&b, SEED_BIGINT);
            }
        }
        match self {
            Key::None => xxh3_64_with_seed(&[], SEED_NONE),
            Key::BigInt(b) => xxh3_64_with_seed(b, SEED_BIGINT),
            Key::Float(f) => xxh3_64_with_seed(&f.to_le_bytes(), SEED_FLOAT),
            Key::Str(s) => hash_str(s),
            Key::Bytes(b) => xxh3_64_with_seed(b, SEED_BYTES),
            Key::Tuple(items) => {
                let mut buf = Vec::with_capacity(items.len() * 8);
                for it in items {
                    buf.extend_from_slice(&it.stable_hash().to_le_bytes());
                }
                xxh3_64_with_seed(&buf, SEED_TUPLE)
            }
            Key::Bool(_) | Key::Int(_) => unreachable!("handled by as_int"),
        }
    }

    /// Python equality of keys (`True == 1 == 1.0`; NaN equals nothing).
    pub fn key_eq(&self, other: &Key<'_>) -> bool {
        if let (Some(a), Some(b)) = (as_int(self), as_int(other)) {
            return a == b;
        }
        match (self, other) {
            (Key::None, Key::None) => true,
            (Key::BigInt(a), Key::BigInt(b)) => a == b,
            (Key::BigInt(a), Key::Float(f)) | (Key::Float(f), Key::BigInt(a)) => {
                float_bigint(*f).is_some_and(|b| b == a.as_ref())
            }
            (Key::Float(a), Key::Float(b)) => a == b,
            (Key::Str(a), Key::Str(b)) => a == b,
            (Key::Bytes(a), Key::Bytes(b)) => a == b,
            (Key::Tuple(a), Key::Tuple(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.key_eq(y))
            }
            _ => false,
        }
    }

    /// Append the canonical encoding (type-preserving) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        fn len_prefixed(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
            out.push(tag);
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        match self {
            Key::None => out.push(T_NONE),
            Key::Bool(false) => out.push(T_FALSE),
            Key::Bool(true) => out.push(T_TRUE),
            Key::Int(i) => {
                out.push(T_INT);
                out.extend_from_slice(&i.to_le_bytes());
            }
            Key::BigInt(b) => len_prefixed(out, T_BIGINT, b),
            Key::Float(f) => {
                out.push(T_FLOAT);
                out.extend_from_slice(&f.to_le_bytes());
            }
            Key::Str(s) => len_prefixed(out, T_STR, s.as_bytes()),
            Key::Bytes(b) => len_prefixed(out, T_BYTES, b),
            Key::Tuple(items) => {
                out.push(T_TUPLE);
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for it in items {
                    it.encode(out);
                }
            }
        }
    }
}

/// Decode one key from the front of `bytes`; returns the key and the rest.
/// Every length is bounds-checked: malformed bytes give an error, never a panic.
pub fn decode_key(bytes: &[u8]) -> Result<(Key<'_>, &[u8]), ArchiveError> {
    decode_depth(bytes, 0)
}

const MAX_KEY_DEPTH: usize = 64;

fn bad(what: &str) -> ArchiveError {
    ArchiveError::Corrupt(format!("malformed key encoding: {what}"))
}

fn take(bytes: &[u8], n: usize) -> Result<(&[u8], &[u8]), ArchiveError> {
    if bytes.len() < n {
        return Err(bad("truncated"));
    }
    Ok(bytes.split_at(n))
}

fn take_len(bytes: &[u8]) -> Result<(usize, &[u8]), ArchiveError> {
    let (l, rest) = take(bytes, 4)?;
    Ok((u32::from_le_bytes(l.try_into().unwrap()) as usize, rest))
}

fn decode_depth(bytes: &[u8], depth: usize) -> Result<(Key<'_>, &[u8]), ArchiveError> {
    if depth > MAX_KEY_DEPTH {
        return Err(bad("nested too deep"));
    }
    let (&tag, rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
    Ok(match tag {
        T_NONE => (Key::None, rest),
        T_FALSE => (Key::Bool(false), rest),
        T_TRUE => (Key::Bool(true), rest),
        T_INT => {
            let (b, rest) = take(rest, 8)?;
            (Key::Int(i64::from_le_bytes(b.try_into().unwrap())), rest)
        }
        T_FLOAT => {
            let (b, rest) = take(rest, 8)?;
            (Key::Float(f64::from_le_bytes(b.try_into().unwrap())), rest)
        }
        T_BIGINT | T_STR | T_BYTES => {
            let (n, rest) = take_len(rest)?;
            let (b, rest) = take(rest, n)?;
            let key = match tag {
                T_BIGINT if bigint_is_canonical(b) => Key::BigInt(Cow::Borrowed(b)),
                T_BIGINT => return Err(bad("an int that is not in its shortest form")),
                T_BYTES => Key::Bytes(Cow::Borrowed(b)),
                _ => Key::Str(Cow::Borrowed(
                    std::str::from_utf8(b).map_err(|_| bad("invalid UTF-8"))?,
                )),
            };
            (key, rest)
        }
        T_TUPLE => {
            let (n, mut rest) = take_len(rest)?;
            if n > rest.len() {
                return Err(bad("tuple length"));
            }
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let (k, r) = decode_depth(rest, depth + 1)?;
                items.push(k);
                rest = r;
            }
            (Key::Tuple(items), rest)
        }
        _ => return Err(bad("unknown tag")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(k: Key<'_>) {
        let mut buf = Vec::new();
        k.encode(&mut buf);
        let (d, rest) = decode_key(&buf).unwrap();
        assert!(rest.is_empty());
        assert_eq!(d, k);
    }

    #[test]
    fn encode_decode() {
        roundtrip(Key::None);
        roundtrip(Key::Bool(true));
        roundtrip(Key::Int(-5));
        roundtrip(Key::Float(2.5));
        roundtrip(Key::Str("héllo".into()));
        roundtrip(Key::Bytes(Cow::Borrowed(b"\x00\x01")));
        roundtrip(Key::BigInt(Cow::Owned(vec![0, 0, 0, 0, 0, 0, 0, 0, 1])));
        roundtrip(Key::Tuple(vec![
            Key::Int(1),
            Key::Str("a".into()),
            Key::Tuple(vec![]),
        ]));
    }

    #[test]
    fn python_equality_classes() {
        let one = [Key::Bool(true), Key::Int(1), Key::Float(1.0)];
        for a in &one {
            for b in &one {
                assert!(a.key_eq(b));
                assert_eq!(a.stable_hash(), b.stable_hash());
            }
        }
        assert!(!Key::Float(f64::NAN).key_eq(&Key::Float(f64::NAN)));
        assert!(!Key::Str("1".into()).key_eq(&Key::Int(1)));
        assert_ne!(
            Key::Str("a".into()).stable_hash(),
            Key::Bytes(Cow::Borrowed(b"a")).stable_hash()
        );
    }

    #[test]
    fn big_integral_floats_equal_their_ints() {
        // 2**64 as minimal two's complement: 9 bytes, 1 in the top.
        let two64 = Key::BigInt(Cow::Owned(vec![0, 0, 0, 0, 0, 0, 0, 0, 1]));
        let f = Key::Float(18446744073709551616.0);
        assert!(f.key_eq(&two64) && two64.key_eq(&f));
        assert_eq!(f.stable_hash(), two64.stable_hash());
        // -(2**64)
        let neg = Key::BigInt(Cow::Owned(vec![0, 0, 0, 0, 0, 0, 0, 0, 0xff]));
        let nf = Key::Float(-18446744073709551616.0);
        assert!(nf.key_eq(&neg));
        // -(2**63) fits in i64 and is an Int
        assert!(Key::Float(-9223372036854775808.0).key_eq(&Key::Int(i64::MIN)));
        assert!(!Key::Float(1e300).key_eq(&two64));
    }

    #[test]
    fn big_int_keys_are_read_in_their_shortest_form_only() {
        let enc = |b: &[u8]| {
            let mut out = vec![T_BIGINT];
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend_from_slice(b);
            out
        };
        let two64 = [0, 0, 0, 0, 0, 0, 0, 0, 1];
        assert!(matches!(decode_key(&enc(&two64)), Ok((Key::BigInt(_), []))));
        // 2**64 with a sign byte too many, an int that fits in an i64, no bytes: forged
        for forged in [
            &[0, 0, 0, 0, 0, 0, 0, 0, 1, 0][..],
            &[5; 8],
            &[0xff; 9],
            &[],
        ] {
            assert!(
                matches!(decode_key(&enc(forged)), Err(ArchiveError::Corrupt(_))),
                "{forged:?}"
            );
        }
        // -2**71 takes 9 bytes (0x80 on top), like the float of the same value
        let neg71 = [0, 0, 0, 0, 0, 0, 0, 0, 0x80];
        assert!(bigint_is_canonical(&neg71));
        assert!(!bigint_is_canonical(&[0, 0, 0, 0, 0, 0, 0, 0, 0x80, 0xff]));
        let k = Key::BigInt(Cow::Owned(neg71.to_vec()));
        let f = Key::Float(-(2f64.powi(71)));
        assert!(f.key_eq(&k) && k.key_eq(&f));
        assert_eq!(f.stable_hash(), k.stable_hash());
        assert_eq!(bigint_min_len(&[]), 0);
        assert_eq!(bigint_min_len(&[0xff, 0xff]), 1);
        assert_eq!(bigint_min_len(&[0x80, 0x00]), 2);
    }

    #[test]
    fn hash_is_stable() {
        // Pinned: a change here breaks every archive ever written.
        assert_eq!(hash_str("doc-1"), Key::Str("doc-1".into()).stable_hash());
        assert_eq!(hash_int(7), Key::Int(7).stable_hash());
        let pinned = hash_str("shmstore");
        assert_eq!(pinned, xxh3_64_with_seed(b"shmstore", SEED_STR));
    }

    #[test]
    fn malformed_never_panics() {
        let mut buf = Vec::new();
        Key::Tuple(vec![Key::Str("abc".into()), Key::Int(3)]).encode(&mut buf);
        for cut in 0..buf.len() {
            assert!(decode_key(&buf[..cut]).is_err());
        }
        for i in 0..buf.len() {
            for v in [0u8, 0xff, 9, 200] {
                let mut b = buf.clone();
                b[i] = v;
                let _ = decode_key(&b);
            }
        }
    }
}
