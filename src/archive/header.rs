//! The fixed 128-byte header at offset 0 of every archive. See docs/format.md.

use xxhash_rust::xxh3::Xxh3Default;

use super::ArchiveError;

pub const MAGIC: [u8; 8] = *b"SHMSTOR\0";
pub const VERSION: u16 = 3;
pub const HEADER_LEN: usize = 128;
/// Record spans start on this boundary.
pub const SPAN_ALIGN: u64 = 8;
/// Out-of-line payloads (array data) start on this boundary (absolute position).
pub const PAYLOAD_ALIGN: u64 = 64;
/// Size of one index entry: span start, span end, span checksum (u64 each).
pub const INDEX_ENTRY: usize = 24;

/// What the archive's records mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A sequence of records (`SharedList`).
    List = 1,
    /// Records addressed by key through a hash table (`SharedDict`).
    Dict = 2,
    /// Exactly one record (`put` / `Ref`).
    Object = 3,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::List),
            2 => Some(Kind::Dict),
            3 => Some(Kind::Object),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::List => "list",
            Kind::Dict => "dict",
            Kind::Object => "object",
        }
    }
}

/// The parsed header. All offsets are absolute byte positions in the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub total_len: u64,
    pub count: u64,
    pub index_off: u64,
    pub symbols_off: u64,
    pub symbols_len: u64,
    pub keys_off: u64,
    pub keys_len: u64,
    pub table_off: u64,
    pub table_len: u64,
    pub created_unix_ms: u64,
    pub creator_pid: u32,
    /// xxh3 of header bytes [0, 120) followed by the metadata region [index_off, total_len).
    pub checksum: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[10] = self.kind as u8;
        b[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        let fields = [
            self.total_len,
            self.count,
            self.index_off,
            self.symbols_off,
            self.symbols_len,
            self.keys_off,
            self.keys_len,
            self.table_off,
            self.table_len,
            self.created_unix_ms,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        b[96..100].copy_from_slice(&self.creator_pid.to_le_bytes());
        b[120..128].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Parse and check the header against the archive bytes: magic, version, sizes,
    /// region bounds and the metadata checksum. O(metadata size), not O(archive size).
    pub fn parse(bytes: &[u8]) -> Result<Header, ArchiveError> {
        let corrupt = |m: String| Err(ArchiveError::Corrupt(m));
        if bytes.len() < HEADER_LEN {
            return corrupt(format!(
                "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            ));
        }
        if bytes[0..8] == UNSEALED_MAGIC {
            return Err(ArchiveError::Unsealed);
        }
        if bytes[0..8] != MAGIC {
            return corrupt("not a shmstore archive (bad magic)".into());
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != VERSION {
            return Err(ArchiveError::Version(version));
        }
        let kind = Kind::from_u8(bytes[10])
            .ok_or_else(|| ArchiveError::Corrupt(format!("unknown kind {}", bytes[10])))?;
        let hl = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
        if hl != HEADER_LEN {
            return corrupt(format!("bad header length {hl}"));
        }
        let f = |i: usize| u64::from_le_bytes(bytes[16 + 8 * i..24 + 8 * i].try_into().unwrap());
        let h = Header {
            kind,
            total_len: f(0),
            count: f(1),
            index_off: f(2),
            symbols_off: f(3),
            symbols_len: f(4),
            keys_off: f(5),
            keys_len: f(6),
            table_off: f(7),
            table_len: f(8),
            created_unix_ms: f(9),
            creator_pid: u32::from_le_bytes(bytes[96..100].try_into().unwrap()),
            checksum: u64::from_le_bytes(bytes[120..128].try_into().unwrap()),
        };
        if h.total_len != bytes.len() as u64 {
            return corrupt(format!(
                "truncated or resized: header says {} bytes, found {}",
                h.total_len,
                bytes.len()
            ));
        }
        // Regions, in order: index | symbols | keys | table, ending at total_len.
        let index_len = h.count.checked_mul(INDEX_ENTRY as u64);
        let regions_ok = index_len.is_some_and(|il| {
            h.index_off >= HEADER_LEN as u64
                && h.index_off.checked_add(il) == Some(h.symbols_off)
                && h.symbols_off.checked_add(h.symbols_len) == Some(h.keys_off)
                && h.keys_off.checked_add(h.keys_len) == Some(h.table_off)
                && h.table_off.checked_add(h.table_len) == Some(h.total_len)
        });
        if !regions_ok {
            return corrupt("region offsets are inconsistent".into());
        }
        if kind == Kind::Object && h.count != 1 {
            return corrupt(format!("object archive with {} records", h.count));
        }
        if h.checksum != meta_checksum(bytes, h.index_off) {
            return corrupt("header/index checksum mismatch".into());
        }
        Ok(h)
    }
}

/// Checksum over the header (minus the checksum field) and the metadata region.
pub fn meta_checksum(bytes: &[u8], index_off: u64) -> u64 {
    checksum_parts(&bytes[..120], &bytes[index_off as usize..])
}

/// The metadata checksum from its two parts: header bytes [0, 120) and the metadata.
pub fn checksum_parts(head: &[u8], meta: &[u8]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(head);
    h.update(meta);
    h.digest()
}

/// Magic of an archive still being written (never valid for readers).
pub const UNSEALED_MAGIC: [u8; 8] = *b"SHMSTOR\x01";

/// Recompute every checksum of an edited archive, as a forger would: each record's span
/// checksum (where the index entry still points inside the file) and the metadata checksum
/// (where `index_off` still does). Used by tests and the fuzzer (`archive::fuzz`) to get
/// arbitrary structure past the checksums, so that the structural checks are what is tested.
pub fn reseal(bytes: &mut [u8]) {
    if bytes.len() < HEADER_LEN {
        return;
    }
    let field = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let (count, index_off) = (field(bytes, 24), field(bytes, 32));
    let len = bytes.len() as u64;
    for rec in 0..count {
        let Some(at) = rec
            .checked_mul(INDEX_ENTRY as u64)
            .and_then(|o| o.checked_add(index_off))
            .filter(|&at| at.checked_add(INDEX_ENTRY as u64).is_some_and(|e| e <= len))
        else {
            break;
        };
        let at = at as usize;
        let (s, e) = (field(bytes, at), field(bytes, at + 8));
        if s <= e && e <= len {
            let h = xxhash_rust::xxh3::xxh3_64(&bytes[s as usize..e as usize]);
            bytes[at + 16..at + 24].copy_from_slice(&h.to_le_bytes());
        }
    }
    if index_off <= len {
        let sum = meta_checksum(bytes, index_off);
        bytes[120..128].copy_from_slice(&sum.to_le_bytes());
    }
}
