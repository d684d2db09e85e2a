//! Streaming archive builder: records are encoded one at a time (`encode`) and written
//! straight into the output (a segment file), so building needs memory for one record plus
//! the metadata (index, blocks, symbols, shapes, keys, hash table), never a second copy of
//! the whole archive.

use std::io::{self, Seek, SeekFrom, Write};

use xxhash_rust::xxh3::Xxh3Default;

use super::encode::Encoder;
use super::header::{
    checksum_parts, Header, Kind, HEADER_LEN, INDEX_ENTRY, LONG_RECORD, MAX_RECORD_START,
    PAYLOAD_ALIGN, UNSEALED_MAGIC,
};
use super::key::Key;
use super::value::{Extent, Value};
use super::{table, ArchiveError};

/// A block (the unit of first-touch validation: docs/format.md, "Integrity") closes after
/// this many records ...
pub const BLOCK_RECORDS: u64 = 64;
/// ... or once its records hold this many bytes ...
pub const BLOCK_BYTES: u64 = 4096;
/// ... and a record of at least this many bytes is a block of its own, so that the first
/// read of a large record (a document) hashes that record only, not its neighbours too.
/// Small records share blocks: fewer, larger blocks cost less per record on a first pass.
pub const ALONE_BYTES: u64 = 512;
/// Payloads are hashed and written in pieces of this size (the piece is hashed while it is
/// in cache, then written).
const PAYLOAD_PIECE: usize = 1 << 20;
/// Payloads of at least this size may be hashed on a second thread while this one writes
/// them, when the process may run on more than one CPU: the write (the kernel giving the
/// file its pages) is the long part, and the hash then costs no time of its own — if a core
/// is free for the helper. See [`hash_beside`].
const HASH_BESIDE: usize = 16 << 20;
/// Bytes the helper hashes between two looks at whether the write failed.
const HELPER_STEP: usize = 16 << 20;

/// What a [`Builder`] writes into.
pub trait Sink: Write + Seek {
    /// Write `bytes` at the current position and return their checksum
    /// (`hash::xxh3_64`). By default the hash, then the write; an arena chunk computes it
    /// while copying.
    fn write_hashed(&mut self, bytes: &[u8]) -> io::Result<u64> {
        let sum = super::hash::xxh3_64(bytes);
        self.write_all(bytes)?;
        Ok(sum)
    }
}

impl Sink for io::Cursor<Vec<u8>> {}

/// Write `bytes` into `out` while they are hashed, on a helper thread if one gets a core:
/// the checksum, or `None` (nothing written) when the payload is too small for a helper to
/// pay, when only one CPU is available, or when no thread can be started.
///
/// Whether a core is free is not guessed from load figures: the writing thread hashes each
/// piece itself (while it is in cache, then writes it) until the helper has actually started
/// running, and from then on only writes, the helper hashing the rest. On an idle machine
/// the helper starts within microseconds and the hash costs no time of its own; on a
/// machine with no free core it may never run before the write ends, and the writer has
/// then done the single-thread path's work (hash each piece, then write it), not waited for
/// a time slice. Either way the checksum is the same ([`super::hash::Resumable`] carries the
/// hash from one thread to the other between pieces).
fn hash_beside<W: Write>(out: &mut W, bytes: &[u8]) -> io::Result<Option<u64>> {
    if bytes.len() < HASH_BESIDE
        || std::thread::available_parallelism().map_or(true, |n| n.get() < 2)
    {
        return Ok(None);
    }
    hash_handing_over(out, bytes, || {})
}

/// [`hash_beside`]'s work; `helper_starts` runs on the helper thread before it announces
/// itself (tests hold it back there, as a busy machine would).
fn hash_handing_over<W: Write>(
    out: &mut W,
    bytes: &[u8],
    helper_starts: impl Fn() + Sync,
) -> io::Result<Option<u64>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    let state = Mutex::new(super::hash::Resumable::new(bytes));
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    // Set by the helper once it runs: from then on the writer leaves the hash to it.
    let running = AtomicBool::new(false);
    // Set by the writer when the write failed: the helper stops.
    let stop = AtomicBool::new(false);
    let written = std::thread::scope(|s| {
        let helper = std::thread::Builder::new()
            .name("shmstore-hash".into())
            .spawn_scoped(s, || {
                helper_starts();
                running.store(true, Ordering::Release);
                let mut at = 0;
                while at < bytes.len() && !stop.load(Ordering::Relaxed) {
                    at = at.saturating_add(HELPER_STEP).min(bytes.len());
                    lock().advance(at);
                }
            });
        if helper.is_err() {
            return Ok(false);
        }
        for (k, piece) in bytes.chunks(PAYLOAD_PIECE).enumerate() {
            if !running.load(Ordering::Acquire) {
                // No helper running yet: hash the piece here, while it is about to be
                // read for the write anyway.
                lock().advance(k * PAYLOAD_PIECE + piece.len());
            }
            if let Err(e) = out.write_all(piece) {
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
        // The scope joins the helper (done with the hash, or with nothing left to do).
        Ok(true)
    })?;
    if !written {
        return Ok(None);
    }
    Ok(Some(
        state
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .finish(),
    ))
}

/// Builds one archive into `W`.
pub struct Builder<W: Sink> {
    out: W,
    pos: u64,
    kind: Kind,
    index: Vec<u8>,
    blocks: Vec<u8>,
    count: u64,
    enc: Encoder,
    // The open block: its first record, bytes so far and running checksum.
    block_first: u64,
    block_bytes: u64,
    block_hash: Xxh3Default,
    // Dict kind only: encoded keys, their offsets, and a growing table of (hash, entry).
    keys: Vec<u8>,
    key_offsets: Vec<u64>,
    key_table: KeyTable,
    creator_pid: u32,
}

impl<W: Sink> Builder<W> {
    /// Start an archive; writes an *unsealed* header that readers refuse.
    pub fn new(mut out: W, kind: Kind, creator_pid: u32) -> Result<Self, ArchiveError> {
        let mut placeholder = [0u8; HEADER_LEN];
        placeholder[..8].copy_from_slice(&UNSEALED_MAGIC);
        out.write_all(&placeholder)?;
        Ok(Builder {
            out,
            pos: HEADER_LEN as u64,
            kind,
            // Room for a few records and blocks at once (an object archive has one of each),
            // grown from there.
            index: Vec::with_capacity(64),
            blocks: Vec::with_capacity(64),
            count: 0,
            enc: Encoder::default(),
            block_first: 0,
            block_bytes: 0,
            block_hash: Xxh3Default::new(),
            keys: Vec::new(),
            // Dict kind only (every use is under `kind == Dict`): no allocation for others.
            key_offsets: if kind == Kind::Dict {
                vec![0]
            } else {
                Vec::new()
            },
            key_table: KeyTable::default(),
            creator_pid,
        })
    }

    fn write_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> io::Result<()> {
        const ZEROS: [u8; 64] = [0; 64];
        let pad = (align - self.pos % align) % align;
        self.write_raw(&ZEROS[..pad as usize])
    }

    /// Write an out-of-line payload (64-byte aligned) for the record being built; the
    /// record refers to it by the returned extent. Hashed as it is written: in one call up
    /// to `PAYLOAD_PIECE` bytes; from `HASH_BESIDE` on a second thread while this one
    /// writes; piece by piece otherwise.
    pub fn write_payload(&mut self, bytes: &[u8]) -> Result<Extent, ArchiveError> {
        self.pad_to(PAYLOAD_ALIGN)?;
        let offset = self.pos;
        let checksum = if bytes.len() <= PAYLOAD_PIECE {
            // One piece: hashed in one call (`hash::xxh3_64`'s vector loop), as the sink
            // copies it or before.
            let sum = self.out.write_hashed(bytes)?;
            self.pos += bytes.len() as u64;
            sum
        } else if let Some(sum) = hash_beside(&mut self.out, bytes)? {
            self.pos += bytes.len() as u64;
            sum
        } else {
            // Piece by piece: each piece is hashed, then written while it is in cache.
            let (out, pos) = (&mut self.out, &mut self.pos);
            super::hash::xxh3_64_pieces(bytes, PAYLOAD_PIECE, |piece| {
                out.write_all(piece)?;
                *pos += piece.len() as u64;
                Ok::<(), io::Error>(())
            })?
        };
        Ok(Extent {
            offset,
            len: bytes.len() as u64,
            checksum,
        })
    }

    /// Dict kind: register the key of the next record. Call before [`Self::finish_record`].
    /// Fails on a duplicate key, before anything of the record is written.
    /// Intern a dict key in the symbol table, for a `Value::Sym` (`None`: too long, or the
    /// table is full; then the key goes as a `Value::Str`).
    pub fn intern(&mut self, s: &str) -> Option<u32> {
        self.enc.intern(s)
    }

    pub fn add_key(&mut self, key: &Key<'_>) -> Result<(), ArchiveError> {
        if self.kind != Kind::Dict || self.key_offsets.len() as u64 != self.count + 1 {
            return Err(ArchiveError::Invalid(
                "add_key: not a dict, or a key is pending".into(),
            ));
        }
        let hash = key.stable_hash();
        let entry = self.count;
        if entry >= u32::MAX as u64 {
            return Err(ArchiveError::Invalid("more than 4294967294 entries".into()));
        }
        let keys = &self.keys;
        let offs = &self.key_offsets;
        let existing = self.key_table.find(hash, |e| {
            let (k, _) = super::key::decode_key(&keys[offs[e as usize] as usize..])
                .expect("keys written by this builder decode");
            k.key_eq(key)
        });
        if let Some(e) = existing {
            return Err(ArchiveError::DuplicateKey(e));
        }
        key.encode(&mut self.keys);
        self.key_offsets.push(self.keys.len() as u64);
        self.key_table.insert(hash, entry as u32);
        Ok(())
    }

    fn check_next(&self) -> Result<(), ArchiveError> {
        if self.kind == Kind::Dict && self.key_offsets.len() as u64 != self.count + 2 {
            return Err(ArchiveError::Invalid(
                "dict record written without its key".into(),
            ));
        }
        if self.kind == Kind::Object && self.count == 1 {
            return Err(ArchiveError::Invalid(
                "an object archive holds one record".into(),
            ));
        }
        Ok(())
    }

    /// Encode `value` and write it as the next record.
    pub fn finish_record(&mut self, value: &Value) -> Result<(), ArchiveError> {
        self.check_next()?;
        let bytes = self.enc.take_record(value)?;
        let res = self.put_record(&bytes);
        self.enc.reuse(bytes);
        res
    }

    /// Write already-encoded record bytes as the next record, unchecked. Only for the fuzzer
    /// (`archive::fuzz`), which crafts records no `Value` encodes to.
    #[doc(hidden)]
    pub fn finish_raw_record(&mut self, bytes: &[u8]) -> Result<(), ArchiveError> {
        self.check_next()?;
        self.put_record(bytes)
    }

    fn put_record(&mut self, bytes: &[u8]) -> Result<(), ArchiveError> {
        let len = bytes.len() as u64;
        if len >= LONG_RECORD {
            self.write_raw(&len.to_le_bytes())?;
        }
        if len >= ALONE_BYTES {
            self.close_block();
        }
        let start = self.pos;
        if start >= MAX_RECORD_START {
            return Err(ArchiveError::Invalid("archive larger than 256 TiB".into()));
        }
        self.write_raw(bytes)?;
        self.block_hash.update(bytes);
        self.block_bytes += len;
        self.index
            .extend_from_slice(&(start << 16 | len.min(LONG_RECORD)).to_le_bytes());
        self.count += 1;
        if self.count - self.block_first >= BLOCK_RECORDS
            || self.block_bytes >= BLOCK_BYTES
            || len >= ALONE_BYTES
        {
            self.close_block();
        }
        Ok(())
    }

    fn close_block(&mut self) {
        if self.count == self.block_first {
            return;
        }
        self.blocks
            .extend_from_slice(&self.block_first.to_le_bytes());
        self.blocks
            .extend_from_slice(&self.block_hash.digest().to_le_bytes());
        self.block_first = self.count;
        self.block_bytes = 0;
        self.block_hash.reset();
    }

    /// Write the metadata and seal the header. Returns the output and the total size.
    pub fn finish(mut self, created_unix_ms: u64) -> Result<(W, u64), ArchiveError> {
        if self.kind == Kind::Object && self.count != 1 {
            return Err(ArchiveError::Invalid(
                "an object archive needs one record".into(),
            ));
        }
        self.close_block();
        self.pad_to(8)?;
        let index_off = self.pos;
        let mut meta = std::mem::take(&mut self.index);
        debug_assert_eq!(meta.len() as u64, self.count * INDEX_ENTRY as u64);
        let blocks_off = index_off + meta.len() as u64;
        meta.extend_from_slice(&self.blocks);
        // Symbols: count u32, offsets u32 * (n + 1), utf-8 blob; padded to 8.
        let symbols_off = index_off + meta.len() as u64;
        let symbols = self.enc.symbols();
        meta.extend_from_slice(&(symbols.len() as u32).to_le_bytes());
        let mut acc = 0u32;
        meta.extend_from_slice(&acc.to_le_bytes());
        for s in symbols {
            acc += s.len() as u32;
            meta.extend_from_slice(&acc.to_le_bytes());
        }
        for s in symbols {
            meta.extend_from_slice(s.as_bytes());
        }
        pad8(&mut meta);
        // Shapes: count u32, then each shape (`Shape::encode`); padded to 8.
        let shapes_off = index_off + meta.len() as u64;
        meta.extend_from_slice(&(self.enc.shapes().len() as u32).to_le_bytes());
        for shape in self.enc.shapes() {
            shape.encode(&mut meta);
        }
        pad8(&mut meta);
        // Keys (dict): offsets u64 * (count + 1), encoded keys; padded to 8.
        let keys_off = index_off + meta.len() as u64;
        if self.kind == Kind::Dict {
            for o in &self.key_offsets {
                meta.extend_from_slice(&o.to_le_bytes());
            }
            meta.extend_from_slice(&self.keys);
            pad8(&mut meta);
        }
        // Table (dict): see `table`.
        let table_off = index_off + meta.len() as u64;
        if self.kind == Kind::Dict {
            let index = &meta[..self.count as usize * INDEX_ENTRY];
            let rec_start = |e: u32| super::u64_at(index, e as usize * INDEX_ENTRY) >> 16;
            let slots = self
                .key_table
                .final_slots(self.count, &self.key_offsets, rec_start);
            meta.extend_from_slice(&slots);
        }
        let total_len = index_off + meta.len() as u64;
        let mut header = Header {
            kind: self.kind,
            total_len,
            count: self.count,
            index_off,
            blocks_off,
            symbols_off,
            shapes_off,
            keys_off,
            table_off,
            created_unix_ms,
            creator_pid: self.creator_pid,
            checksum: 0,
        };
        header.checksum = checksum_parts(&header.encode()[..120], &meta);
        self.write_raw(&meta)?;
        self.out.seek(SeekFrom::Start(0))?;
        self.out.write_all(&header.encode())?;
        self.out.flush()?;
        Ok((self.out, total_len))
    }
}

fn pad8(v: &mut Vec<u8>) {
    while v.len() % 8 != 0 {
        v.push(0);
    }
}

/// An in-memory open-addressing table of (hash, entry) used while building a dict.
#[derive(Default)]
struct KeyTable {
    slots: Vec<(u64, u32)>, // (hash, entry + 1); entry + 1 == 0 means empty
    len: usize,
}

impl KeyTable {
    fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let cap = self.slots.len();
        let mut i = table::home(hash, cap as u64) as usize;
        loop {
            let (h, e) = self.slots[i];
            if e == 0 {
                return None;
            }
            if h == hash && eq(e - 1) {
                return Some(e - 1);
            }
            i = table::next(i, cap);
        }
    }

    fn insert(&mut self, hash: u64, entry: u32) {
        if (self.len + 1) * 2 > self.slots.len() {
            let cap = (self.slots.len() * 2).max(16);
            let old = std::mem::replace(&mut self.slots, vec![(0, 0); cap]);
            self.len = 0;
            for (h, e) in old.into_iter().filter(|s| s.1 != 0) {
                self.insert_slot(h, e);
            }
        }
        self.insert_slot(hash, entry + 1);
    }

    fn insert_slot(&mut self, hash: u64, e1: u32) {
        let cap = self.slots.len();
        let mut i = table::home(hash, cap as u64) as usize;
        while self.slots[i].1 != 0 {
            i = table::next(i, cap);
        }
        self.slots[i] = (hash, e1);
        self.len += 1;
    }

    /// The on-disk table (`table`): linear probing from `table::home`, wrapping.
    fn final_slots(
        &self,
        count: u64,
        key_offsets: &[u64],
        rec_start: impl Fn(u32) -> u64,
    ) -> Vec<u8> {
        let cap = table::capacity(count) as usize;
        let mut used = vec![false; cap];
        let mut out = vec![0u8; cap * table::SLOT];
        for &(h, e1) in self.slots.iter().filter(|s| s.1 != 0) {
            let mut i = table::home(h, cap as u64) as usize;
            while used[i] {
                i = table::next(i, cap);
            }
            used[i] = true;
            let e = e1 - 1;
            table::Slot::new(h, e, key_offsets[e as usize], rec_start(e))
                .write(&mut out[i * table::SLOT..(i + 1) * table::SLOT]);
        }
        out
    }
}

#[cfg(test)]
mod hand_over_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A sink that counts the pieces written to it.
    struct Counting<'a> {
        out: Vec<u8>,
        pieces: &'a AtomicUsize,
    }

    impl Write for Counting<'_> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.out.extend_from_slice(buf);
            self.pieces.fetch_add(1, Ordering::SeqCst);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn payload(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect()
    }

    #[test]
    fn the_checksum_is_the_same_whoever_hashes_which_piece() {
        // A payload of 5.5 pieces, its hash taken over by the helper at once, after the
        // writer hashed some pieces itself, or only once the write is over (a machine with
        // no free core): always the hash of the whole, and every byte written in order.
        let bytes = payload(5 * PAYLOAD_PIECE + PAYLOAD_PIECE / 2 + 7);
        let want = super::super::hash::xxh3_64(&bytes);
        for hold_until in [0usize, 1, 3, usize::MAX] {
            let pieces = AtomicUsize::new(0);
            let mut sink = Counting {
                out: Vec::new(),
                pieces: &pieces,
            };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            let sum = hash_handing_over(&mut sink, &bytes, || {
                // Held back until the writer has written `hold_until` pieces (all of them
                // for usize::MAX: the helper only starts once the writer is done).
                let want_pieces = hold_until.min(6);
                while pieces.load(Ordering::SeqCst) < want_pieces
                    && std::time::Instant::now() < deadline
                {
                    std::thread::yield_now();
                }
            })
            .unwrap();
            assert_eq!(sum, Some(want), "helper held until piece {hold_until}");
            assert!(sink.out == bytes, "written in order");
        }
    }

    #[test]
    fn a_failed_write_stops_the_helper_and_is_the_error() {
        struct Failing;
        impl Write for Failing {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::Error::other("disk full"))
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let bytes = payload(3 * PAYLOAD_PIECE);
        let err = hash_handing_over(&mut Failing, &bytes, || {}).unwrap_err();
        assert_eq!(err.to_string(), "disk full");
    }
}
