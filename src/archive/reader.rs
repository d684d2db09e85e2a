//! Reader over an archive's bytes (a read-only mapping), reading records in place.
//!
//! Every read is checked: positions, lengths and references that come from the bytes are
//! bounds-checked against the records region before use, so no byte sequence can make a
//! read leave the mapping, panic or loop. On top of that, integrity is checked lazily:
//! - at open: the header, region bounds, one checksum over the metadata (index, blocks,
//!   symbols, shapes, keys, table), and the symbols and shapes themselves: O(metadata);
//! - at the first access of a record in this process: its *block* (up to
//!   [`BLOCK_RECORDS`](super::builder::BLOCK_RECORDS) records) is checksummed and each of
//!   its records walked once as a tree (every reference points forward, no two at the same
//!   value, depth within the format's limit), so later reads need no budget against
//!   shared or cyclic structure. Then a bit per record is set and later accesses are free;
//! - out-of-line payloads (array data, big bytes) have their own checksum, checked by
//!   [`Reader::verify`] and never on the read path: any bit pattern of a numeric array is a
//!   valid array, so reading one needs no hash (docs/format.md, "Integrity").

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use xxhash_rust::xxh3::Xxh3Default;

use super::hash::xxh3_64;

use super::builder::BLOCK_RECORDS;
use super::format::*;
use super::header::{record_span, Header, Kind, BLOCK_ENTRY, HEADER_LEN, PAYLOAD_ALIGN};
use super::key::{decode_key, Key};
use super::value::{typestr_itemsize, Extent, MAX_KEY_DEPTH, MAX_VALUE_DEPTH};
use super::{table, u32_at, u64_at, ArchiveError};

/// How a node's bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// A tagged value starts at the node's position.
    Tagged,
    /// The slots of a dict of this shape start at the node's position.
    Struct(u32),
    /// A packed field: `count` elements of `elem` start at the node's position.
    Pack { elem: Elem, count: u8, tuple: bool },
}

/// A position of a container (or any value) in a record. Any `Node` is safe to read: reads
/// through it are bounds-checked, so one rebuilt from a pickle can at worst be `Corrupt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    rec: u32,
    pub(crate) form: Form,
    pos: u64,
}

impl Node {
    /// The record this node belongs to.
    pub fn record(self) -> u32 {
        self.rec
    }
    /// Absolute byte position in the archive.
    pub fn pos(self) -> u64 {
        self.pos
    }
    #[cfg(test)]
    pub fn form(self) -> Form {
        self.form
    }
    /// The form as two integers, for pickles (`Reader::node_from`).
    pub fn form_code(self) -> (u8, u32) {
        match self.form {
            Form::Tagged => (0, 0),
            Form::Struct(s) => (1, s),
            Form::Pack { elem, count, tuple } => {
                (2, (elem as u32) << 16 | (count as u32) << 8 | tuple as u32)
            }
        }
    }
}

/// An out-of-line array: where its data lives and how to read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayAt {
    /// Position of the array's metadata (after its tag).
    pos: u64,
    rec: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayView<'a> {
    pub typestr: &'a str,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the archive (64-byte aligned).
    pub offset: usize,
    pub nbytes: usize,
}

/// One value read from a record.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Item<'a> {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside i64 (two's complement, little-endian).
    BigInt(&'a [u8]),
    Float(f64),
    Complex(f64, f64),
    /// UTF-8 as stored (checked when converted).
    Str(&'a [u8]),
    /// A str of the symbol table.
    Sym(u32),
    Bytes(&'a [u8]),
    BytesExt(Extent),
    Array(ArrayAt),
    List(Node),
    Tuple(Node),
    Dict(Node),
}

/// A shape as read from the metadata, with what the reader needs precomputed.
#[derive(Debug)]
pub struct ShapeInfo {
    pub shape: Shape,
    /// Field indexes whose slot holds a reference.
    refs: Box<[u16]>,
}

pub struct Reader<B> {
    backing: B,
    header: Header,
    /// One bit per record: its block's checksum and its tree checked in this process.
    validated: Vec<AtomicU64>,
    /// One bit per record: the hash indexes of its general dicts checked (`confirm_miss`).
    indexes_checked: Vec<AtomicU64>,
    /// The block checked last in this process (`usize::MAX` before the first): a block
    /// checked right after the one before it is read in order, and the next one's bytes
    /// are worth loading ahead (`prefetch_next_block`).
    last_checked: AtomicUsize,
    /// First record of each block; empty when every record is a block of its own
    /// ([`Self::alone`]): block `b` is then record `b`, and a store of a million documents
    /// does not keep 8 MB of this table in every process that reads it.
    pub(crate) block_first: Vec<u64>,
    /// Absolute [start, end) of each symbol's UTF-8 bytes.
    symbols: Vec<(usize, usize)>,
    shapes: Vec<ShapeInfo>,
    /// End of the records region (= index_off): every record byte lies before it.
    rec_end: usize,
}

fn corrupt<T>(msg: impl Into<String>) -> Result<T, ArchiveError> {
    Err(ArchiveError::Corrupt(msg.into()))
}

#[cold]
#[inline(never)]
fn count_past_end<T>(n: u64, at: usize) -> Result<T, ArchiveError> {
    corrupt(format!("count {n} at {at} runs past the records"))
}

type Scratch = (Vec<(usize, usize)>, Vec<(usize, usize, usize)>);

thread_local! {
    /// Reused by `validate_block` (spans of a block's records, the walk queue).
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new()))
    };
}

/// How many bytes of a record `root` asks the cache for ahead of reading them.
const ROOT_PREFETCH: usize = 512;
/// Bytes of the next block that a block's check asks for ahead (`prefetch_next_block`): a
/// block closes at 4 KiB of records, and a record of 512 bytes or more is alone, so this
/// covers every block of small records whole.
const NEXT_BLOCK_PREFETCH: usize = 4096 + 512;

/// Most dimensions an array may have (numpy's limit since numpy 2).
pub const MAX_NDIM: usize = 64;

/// How many bytes from a record's start a dict lookup prefetches.
const PREFETCH_AHEAD: usize = 1024;

/// Start loading the cache line of `bytes[at]`; out-of-range positions are ignored.
#[inline(always)]
pub fn prefetch(bytes: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < bytes.len() {
        let p = bytes[at..].as_ptr();
        // SAFETY: `_mm_prefetch` needs SSE, which every x86_64 CPU has (it is in the
        // target's baseline). A prefetch is a hint: it never faults and has no effect on
        // program state, and `p` points inside `bytes` anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, at);
}

impl<B: AsRef<[u8]>> Reader<B> {
    /// Check the header and metadata; records are checked lazily on first access.
    pub fn open(backing: B) -> Result<Self, ArchiveError> {
        let bytes = backing.as_ref();
        let header = Header::parse(bytes)?;
        if header.kind == Kind::Dict {
            let slot = table::SLOT as u64;
            if header.table_len() % slot != 0
                || header.table_len() / slot != table::capacity(header.count)
                || header.keys_len() < (header.count + 1) * 8
            {
                return corrupt("dict table/keys region malformed");
            }
        }
        let symbols = parse_symbols(bytes, &header)?;
        let shapes = parse_shapes(bytes, &header, symbols.len())?;
        let mut block_first = parse_blocks(bytes, &header)?;
        // Blocks are in order and start at record 0 (checked by `parse_blocks`), so as
        // many blocks as records means block b = record b: the table says nothing.
        if block_first.len() as u64 == header.count {
            block_first = Vec::new();
        }
        let words = header.count.div_ceil(64) as usize;
        Ok(Reader {
            validated: (0..words).map(|_| AtomicU64::new(0)).collect(),
            indexes_checked: (0..words).map(|_| AtomicU64::new(0)).collect(),
            last_checked: AtomicUsize::new(usize::MAX),
            block_first,
            rec_end: header.index_off as usize,
            backing,
            header,
            symbols,
            shapes,
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn kind(&self) -> Kind {
        self.header.kind
    }

    #[inline(always)]
    pub fn len(&self) -> u64 {
        self.header.count
    }

    pub fn bytes(&self) -> &[u8] {
        self.backing.as_ref()
    }

    pub fn backing(&self) -> &B {
        &self.backing
    }

    pub fn shapes(&self) -> &[ShapeInfo] {
        &self.shapes
    }

    // --- checked access to the records region -------------------------------------------

    /// `n` bytes at `at`, inside the records region.
    #[inline]
    fn get(&self, at: usize, n: usize) -> Result<&[u8], ArchiveError> {
        match at.checked_add(n) {
            Some(e) if e <= self.rec_end => Ok(&self.bytes()[at..e]),
            _ => corrupt(format!("read of {n} bytes at {at} past the records")),
        }
    }

    #[inline]
    fn byte(&self, at: usize) -> Result<u8, ArchiveError> {
        if at < self.rec_end {
            Ok(self.bytes()[at])
        } else {
            corrupt(format!("read at {at} past the records"))
        }
    }

    #[inline(always)]
    fn varint(&self, at: usize) -> Result<(u64, usize), ArchiveError> {
        get_varint(&self.bytes()[..self.rec_end], at)
    }

    #[inline]
    fn u64(&self, at: usize) -> Result<u64, ArchiveError> {
        Ok(u64::from_le_bytes(self.get(at, 8)?.try_into().unwrap()))
    }

    /// The target of the forward reference at `at`.
    #[inline]
    fn follow(&self, at: usize) -> Result<usize, ArchiveError> {
        let d = u32::from_le_bytes(self.get(at, REF)?.try_into().unwrap());
        if d == 0 {
            return corrupt(format!("reference at {at} points at itself"));
        }
        let t = at + d as usize;
        if t >= self.rec_end {
            return corrupt(format!("reference at {at} points past the records"));
        }
        Ok(t)
    }

    /// A count (varint) of items of `each` bytes following at `after`: checked to fit.
    #[inline(always)]
    fn count(&self, at: usize, each: usize) -> Result<(usize, usize), ArchiveError> {
        let (n, after) = self.varint(at)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(each))
            .and_then(|b| b.checked_add(after))
            .is_some_and(|e| e <= self.rec_end);
        if !fits {
            return count_past_end(n, at);
        }
        Ok((n as usize, after))
    }

    #[inline]
    fn shape(&self, id: u64) -> Result<&ShapeInfo, ArchiveError> {
        self.shapes
            .get(id as usize)
            .ok_or_else(|| ArchiveError::Corrupt(format!("shape {id} out of range")))
    }

    // --- records and validation ---------------------------------------------------------

    /// [start, end) of record `rec`, checked to lie in the records region.
    #[inline(always)]
    fn span(&self, rec: u64) -> Result<(usize, usize), ArchiveError> {
        match record_span(self.bytes(), self.header.index_off, rec) {
            Some((s, l))
                if s >= HEADER_LEN as u64
                    && l > 0
                    && s.checked_add(l).is_some_and(|e| e <= self.rec_end as u64) =>
            {
                Ok((s as usize, (s + l) as usize))
            }
            _ => corrupt(format!("record {rec}: span out of bounds")),
        }
    }

    #[inline(always)]
    pub(crate) fn is_validated(&self, rec: u64) -> bool {
        let (word, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
        self.validated[word].load(Ordering::Acquire) & bit != 0
    }

    /// Run the checks of record `rec`'s block now (normally done on first access).
    #[inline(always)]
    pub fn validate_record(&self, rec: u64) -> Result<(), ArchiveError> {
        if rec >= self.header.count {
            return Err(ArchiveError::Invalid(format!("record {rec} out of range")));
        }
        if self.is_validated(rec) {
            return Ok(());
        }
        self.validate_block(rec)
    }

    /// Check the block holding record `rec` (its first access in this process).
    #[cold]
    #[inline(never)]
    fn validate_block(&self, rec: u64) -> Result<(), ArchiveError> {
        let b = self.block_of(rec);
        let (first, last) = if self.alone() {
            (rec, rec + 1) // a block per record
        } else {
            let first = self.block_first[b];
            let next = self.block_first.get(b + 1).copied();
            (first, next.unwrap_or(self.header.count))
        };
        // This thread's scratch vectors (the checks of a block never re-enter), so that a
        // block's check allocates nothing once the thread has checked one.
        SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
            Ok(mut scratch) => {
                let (spans, queue) = &mut *scratch;
                self.validate_block_with(rec, b, first, last, spans, queue)
            }
            Err(_) => {
                self.validate_block_with(rec, b, first, last, &mut Vec::new(), &mut Vec::new())
            }
        })
    }

    fn validate_block_with(
        &self,
        rec: u64,
        b: usize,
        first: u64,
        last: u64,
        spans: &mut Vec<(usize, usize)>,
        queue: &mut Vec<(usize, usize, usize)>,
    ) -> Result<(), ArchiveError> {
        // The records' spans, read once (a block written by us holds at most
        // BLOCK_RECORDS; a forged one that claims more is read span by span instead).
        let k = (last - first) as usize;
        let cached = k <= BLOCK_RECORDS as usize;
        spans.clear();
        let span = |r: u64, spans: &[(usize, usize)]| -> Result<(usize, usize), ArchiveError> {
            if cached {
                Ok(spans[(r - first) as usize])
            } else {
                self.span(r)
            }
        };
        if cached {
            for r in first..last {
                spans.push(self.span(r)?);
            }
        }
        // The checksum of the block's records, one after another. They usually lie back to
        // back (no payload or long-record length between them): then one call over the
        // whole range, which is the same hash and faster than feeding them one by one.
        let (s0, mut end) = span(first, spans)?;
        let mut contiguous = true;
        for r in first + 1..last {
            let (s, e) = span(r, spans)?;
            contiguous &= s == end;
            end = e;
        }
        let sum = if contiguous {
            xxh3_64(&self.bytes()[s0..end])
        } else {
            let mut h = Xxh3Default::new();
            for r in first..last {
                let (s, e) = span(r, spans)?;
                h.update(&self.bytes()[s..e]);
            }
            h.digest()
        };
        let at = self.header.blocks_off as usize + b * BLOCK_ENTRY;
        if sum != u64_at(self.bytes(), at + 8) {
            return corrupt(format!(
                "record {rec}: checksum mismatch in records {first}..{last} (the data was \
                 modified)"
            ));
        }
        for r in first..last {
            let (s, e) = span(r, spans)?;
            self.walk_with(queue, s, e, |_, _| Ok(()))
                .map_err(|e| ArchiveError::Corrupt(format!("record {r}: {}", msg(e))))?;
        }
        // The block's bits, a word at a time (a block spans at most two words).
        let mut r = first;
        while r < last {
            let (word, lo) = ((r / 64) as usize, r % 64);
            let hi = (last - r + lo).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            self.validated[word].fetch_or(mask, Ordering::AcqRel);
            r += hi - lo;
        }
        // Read in order (this block follows the one checked before it): load the next
        // block ahead. In random order (a doc store's lookups) that would be ~4.6 KB of
        // loads of a neighbour that is not read next.
        if self.last_checked.swap(b, Ordering::Relaxed).wrapping_add(1) == b {
            self.prefetch_next_block(b, end);
        }
        Ok(())
    }

    /// After block `b` (whose records end at `end`) was checked: start loading the bytes the
    /// next block's check reads first, its checksum and its records, which in order follow
    /// this block's. A pass in order then hashes bytes that are already on their way from
    /// memory instead of waiting for each line in the hash's tight loop (the pass's Python
    /// code between two checks gives them the time). Only when the blocks are checked in
    /// order: in random order it would load a block that is not read next.
    #[inline]
    fn prefetch_next_block(&self, b: usize, end: usize) {
        if b + 1 >= self.blocks() {
            return;
        }
        let bytes = self.bytes();
        prefetch(
            bytes,
            self.header.blocks_off as usize + (b + 1) * BLOCK_ENTRY + 8,
        );
        let stop = end.saturating_add(NEXT_BLOCK_PREFETCH).min(self.rec_end);
        let mut at = end;
        while at < stop {
            prefetch(bytes, at);
            at += 64;
        }
    }

    /// The block holding record `rec` (< count). Blocks hold similar numbers of records, so
    /// the search starts where `rec` would be if they were all alike and widens from there
    /// (a few cache misses instead of a binary search over a table that may be megabytes).
    pub(crate) fn block_of(&self, rec: u64) -> usize {
        if self.alone() {
            // Every record is a block of its own (a store of documents): no table to read,
            // which in random order is a cache miss less on a record's first read.
            return rec as usize;
        }
        let f = &self.block_first;
        let n = f.len();
        let guess = self.block_guess(rec);
        // Widen a window around the guess until it holds the answer, then search it.
        let (mut lo, mut hi) = (guess, guess + 1);
        let mut step = 1;
        while lo > 0 && f[lo] > rec {
            lo = lo.saturating_sub(step);
            step *= 2;
        }
        step = 1;
        while hi < n && f[hi] <= rec {
            hi = (hi + step).min(n);
            step *= 2;
        }
        lo + f[lo..hi].partition_point(|&x| x <= rec) - 1
    }

    /// Whether every record is a block of its own (no table of blocks is kept then; an
    /// archive without records has neither blocks nor a table).
    #[inline]
    fn alone(&self) -> bool {
        self.block_first.is_empty()
    }

    /// The number of blocks.
    #[inline]
    fn blocks(&self) -> usize {
        if self.alone() {
            self.header.count as usize
        } else {
            self.block_first.len()
        }
    }

    /// Where record `rec`'s block would be if every block held as many records (a block
    /// table is never empty when there are records).
    fn block_guess(&self, rec: u64) -> usize {
        let n = self.blocks();
        let guess = (rec as u128 * n as u128) / self.header.count.max(1) as u128;
        (guess as usize).min(n - 1)
    }

    /// Walk the record at [start, end) breadth first, as it was written: every reference
    /// must point forward of the one before it and inside the record, no value may overlap
    /// the one written after it (so the record is a tree of disjoint values and the walk
    /// ends), containers nest at most `MAX_VALUE_DEPTH` deep. `visit` sees
    /// every tagged value (its position and tag).
    fn walk(
        &self,
        start: usize,
        end: usize,
        visit: impl FnMut(usize, u8) -> Result<(), ArchiveError>,
    ) -> Result<(), ArchiveError> {
        self.walk_with(&mut Vec::new(), start, end, visit)
    }

    /// `walk` with the caller's queue (emptied first), so that checking a block of records
    /// allocates it once. Queued positions only grow (each reference points past the one
    /// before), so the queue is a vector read from the front, never shifted.
    fn walk_with(
        &self,
        queue: &mut Vec<(usize, usize, usize)>,
        start: usize,
        end: usize,
        mut visit: impl FnMut(usize, u8) -> Result<(), ArchiveError>,
    ) -> Result<(), ArchiveError> {
        // A record that is one value without references (a document, a label): no queue.
        let tag = self.byte(start)?;
        if let Some(stop) = self.leaf_end(tag, start + 1)? {
            visit(start, tag)?;
            return if stop <= end {
                Ok(())
            } else {
                corrupt("a value runs past its record")
            };
        }
        queue.clear();
        let mut w = Walk {
            queue,
            last: start,
            end,
            prev: Prev::Queued(0),
            payloads: Vec::new(),
        };
        w.queue.push((start, 0, end));
        let mut next = 0;
        while let Some(&(pos, depth, _)) = w.queue.get(next) {
            next += 1;
            // Only containers are queued: a reference to a leaf is checked where it is
            // found (`Walk::push`).
            let tag = self.byte(pos)?;
            visit(pos, tag)?;
            let body = pos + 1;
            let stop = match tag {
                T_LIST | T_TUPLE => {
                    let (n, after) = self.count(body, REF)?;
                    for i in 0..n {
                        w.push(self, after + i * REF, true, depth + 1, &mut visit)?;
                    }
                    after + n * REF
                }
                T_LIST_STRUCT | T_TUPLE_STRUCT => {
                    let (id, after) = self.varint(body)?;
                    let sh = self.shape(id)?;
                    let size = sh.shape.size as usize;
                    let (n, after) = self.count(after, size)?;
                    if size == 0 && n > end.saturating_sub(after) {
                        // Rows of no bytes: writers never make more of them than there are
                        // bytes left (they write such lists as references), and reading a
                        // crafted count of 2^60 whole would never end.
                        return corrupt(format!(
                            "a list of {n} rows of no bytes in a record of {} bytes",
                            end - pos
                        ));
                    }
                    if sh.refs.is_empty() {
                        // Rows of plain slots (numbers, packed fields): nothing to follow.
                        w.depth(depth + 2)?;
                    } else {
                        for i in 0..n {
                            w.slots(self, sh, after + i * size, depth + 2, &mut visit)?;
                        }
                    }
                    after + n * size
                }
                T_DICT_SHAPED => {
                    let (id, after) = self.varint(body)?;
                    let sh = self.shape(id)?;
                    w.slots(self, sh, after, depth + 1, &mut visit)?;
                    after + sh.shape.size as usize
                }
                T_DICT => {
                    let (n, after) = self.count(body, 2 * REF)?;
                    for i in 0..2 * n {
                        w.push(self, after + i * REF, true, depth + 1, &mut visit)?;
                    }
                    let mut stop = after + 2 * n * REF;
                    if super::value::dict_has_index(n) {
                        let cap = table::record_index_capacity(n);
                        let idx = self.get(stop, cap * 4)?;
                        if idx.chunks_exact(4).any(|s| u32_at(s, 0) as usize > n) {
                            return corrupt("a dict index names an entry it does not have");
                        }
                        stop += cap * 4;
                    }
                    stop
                }
                // Leaves are never queued (a leaf root is checked at the top).
                t => return corrupt(format!("unknown tag {t}")),
            };
            // Where the value written after this one starts (the record's end for the last).
            let limit = w.queue[next - 1].2;
            if stop > limit {
                return corrupt(if limit == end {
                    "a value runs past its record"
                } else {
                    "a value overlaps the value written after it"
                });
            }
        }
        w.finish()
    }

    /// The out-of-line extent of a big bytes value or an array (`tag`) whose in-record part
    /// ends at `stop` ([`Self::leaf_end`]): the extent is its last 24 bytes. `None` for
    /// any other value.
    #[inline]
    fn out_of_line(&self, tag: u8, stop: usize) -> Result<Option<Extent>, ArchiveError> {
        if tag == T_BYTES_EXT || tag == T_ARRAY {
            Ok(Some(self.ext_at(stop - 24)?))
        } else {
            Ok(None)
        }
    }

    /// Where a value without references ends (`tag` at `body - 1`), its bounds checked
    /// against the records region (the caller checks it against the record); `None` for a
    /// container or an unknown tag.
    #[inline(always)]
    fn leaf_end(&self, tag: u8, body: usize) -> Result<Option<usize>, ArchiveError> {
        Ok(Some(match tag {
            T_NONE | T_FALSE | T_TRUE => body,
            T_I8 => body + 1,
            T_I16 => body + 2,
            T_I32 => body + 4,
            T_I64 | T_F64 => body + 8,
            T_COMPLEX => body + 16,
            T_BYTES_EXT => body + 24,
            T_BIGINT | T_STR | T_BYTES => {
                let (n, after) = self.count(body, 1)?;
                after + n
            }
            T_SYM => {
                let (id, after) = self.varint(body)?;
                if id >= self.symbols.len() as u64 {
                    return corrupt(format!("symbol {id} out of range"));
                }
                after
            }
            T_ARRAY => self.array_meta_end(body)?,
            T_LIST_PACKED | T_TUPLE_PACKED => {
                let elem = Elem::from_u8(self.byte(body)?)
                    .ok_or_else(|| ArchiveError::Corrupt("bad packed element".into()))?;
                let (n, after) = self.count(body + 1, elem.size())?;
                after + n * elem.size()
            }
            _ => return Ok(None),
        }))
    }

    /// Run the checks of every record now, and verify every out-of-line payload against
    /// its checksum: O(archive size). Readers never need this for safety.
    pub fn validate_all(&self) -> Result<(), ArchiveError> {
        for r in 0..self.header.count {
            self.validate_record(r)?;
        }
        self.verify_payloads()
    }

    /// Check the checksum of every out-of-line payload (array data, big bytes).
    pub fn verify_payloads(&self) -> Result<(), ArchiveError> {
        for r in 0..self.header.count {
            let (s, e) = self.span(r)?;
            let mut found = Vec::new();
            self.walk(s, e, |pos, tag| {
                if let Some(stop) = self.leaf_end(tag, pos + 1)? {
                    found.extend(self.out_of_line(tag, stop)?);
                }
                Ok(())
            })?;
            for ext in found {
                let data = self.payload(ext)?;
                if xxh3_64(data) != ext.checksum {
                    return corrupt(format!(
                        "record {r}: the out-of-line data at {} ({} bytes) was modified",
                        ext.offset, ext.len
                    ));
                }
            }
        }
        Ok(())
    }

    /// The root value of record `rec` (checked on first access in this process).
    #[inline(always)]
    pub fn root(&self, rec: u64) -> Result<Node, ArchiveError> {
        self.validate_record(rec)?;
        let (start, end) = self.span(rec)?;
        // A record is read front to back, but its reads depend on one another (a field's
        // position comes from what precedes it): ask for its first lines at once, so that
        // in random order their misses overlap instead of following one another.
        let b = self.bytes();
        let mut at = start;
        while at < end.min(start + ROOT_PREFETCH) {
            prefetch(b, at);
            at += 64;
        }
        Ok(Node {
            rec: rec as u32,
            form: Form::Tagged,
            pos: start as u64,
        })
    }

    /// Start loading record `rec` (its index entry, then its first bytes) without waiting.
    pub fn prefetch_record(&self, rec: u64) {
        let b = self.bytes();
        if rec < self.header.count {
            let at = self.header.index_off as usize + rec as usize * 8;
            prefetch(b, at);
        }
    }

    /// Start loading what checking record `rec`'s block reads first: where the block is
    /// expected in the table of first records ([`Self::block_of`]'s guess) and its checksum.
    pub fn prefetch_block(&self, rec: u64) {
        if self.blocks() == 0 || rec >= self.header.count {
            return;
        }
        let guess = self.block_guess(rec);
        #[cfg(target_arch = "x86_64")]
        if !self.alone() {
            let p = self.block_first[guess..].as_ptr();
            // SAFETY: as in `prefetch`: a hint that never faults, and `p` points into the
            // vector (`guess < n`).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p as *const i8,
                )
            };
        }
        let at = self.header.blocks_off as usize + guess * BLOCK_ENTRY + 8;
        prefetch(self.bytes(), at);
    }

    /// Second step of [`Self::prefetch_record`]: the record's bytes (its index entry is
    /// read, which waits for it if it was not prefetched).
    pub fn prefetch_body(&self, rec: u64) {
        if let Some((s, _)) = record_span(self.bytes(), self.header.index_off, rec) {
            let s = s as usize;
            prefetch(self.bytes(), s);
            prefetch(self.bytes(), s.saturating_add(64));
        }
    }

    /// Rebuild a node from an untrusted (record, position, form), e.g. from a pickle.
    pub fn node_from(&self, rec: u64, pos: u64, form: (u8, u32)) -> Result<Node, ArchiveError> {
        self.validate_record(rec)?;
        let (s, e) = self.span(rec)?;
        if pos < s as u64 || pos >= e as u64 {
            return corrupt(format!("position {pos} is not inside record {rec}"));
        }
        let form = match form {
            (0, 0) => Form::Tagged,
            (1, s) => {
                self.shape(s as u64)?;
                Form::Struct(s)
            }
            (2, c) => match Enc::decode([6, (c >> 16) as u8, (c >> 8) as u8, c as u8]) {
                Some(Enc::Pack { elem, count, tuple }) => Form::Pack { elem, count, tuple },
                _ => return corrupt("bad node form"),
            },
            _ => return corrupt("bad node form"),
        };
        Ok(Node {
            rec: rec as u32,
            form,
            pos,
        })
    }

    // --- values -------------------------------------------------------------------------

    /// The value a node names: a container node as List/Tuple/Dict, a tagged one decoded.
    #[inline(always)]
    pub fn item(&self, node: Node) -> Result<Item<'_>, ArchiveError> {
        match node.form {
            Form::Tagged => self.tagged(node.rec, node.pos as usize),
            Form::Struct(_) => Ok(Item::Dict(node)),
            Form::Pack { tuple: true, .. } => Ok(Item::Tuple(node)),
            Form::Pack { .. } => Ok(Item::List(node)),
        }
    }

    /// The tagged value at `pos` of record `rec`.
    #[inline(always)]
    pub fn tagged(&self, rec: u32, pos: usize) -> Result<Item<'_>, ArchiveError> {
        let tag = self.byte(pos)?;
        let b = pos + 1;
        let node = |form| Node {
            rec,
            form,
            pos: pos as u64,
        };
        let blob = |at: usize| -> Result<&[u8], ArchiveError> {
            let (n, after) = self.count(at, 1)?;
            self.get(after, n)
        };
        Ok(match tag {
            T_NONE => Item::None,
            T_FALSE => Item::Bool(false),
            T_TRUE => Item::Bool(true),
            T_I8 => Item::Int(self.byte(b)? as i8 as i64),
            T_I16 => Item::Int(i16::from_le_bytes(self.get(b, 2)?.try_into().unwrap()) as i64),
            T_I32 => Item::Int(i32::from_le_bytes(self.get(b, 4)?.try_into().unwrap()) as i64),
            T_I64 => Item::Int(self.u64(b)? as i64),
            T_BIGINT => Item::BigInt(blob(b)?),
            T_F64 => Item::Float(f64::from_bits(self.u64(b)?)),
            T_COMPLEX => Item::Complex(
                f64::from_bits(self.u64(b)?),
                f64::from_bits(self.u64(b + 8)?),
            ),
            T_STR => Item::Str(blob(b)?),
            T_SYM => {
                let (id, _) = self.varint(b)?;
                if id >= self.symbols.len() as u64 {
                    return corrupt(format!("symbol {id} out of range"));
                }
                Item::Sym(id as u32)
            }
            T_BYTES => Item::Bytes(blob(b)?),
            T_BYTES_EXT => Item::BytesExt(self.ext_at(b)?),
            T_ARRAY => Item::Array(ArrayAt { pos: b as u64, rec }),
            T_LIST | T_LIST_PACKED | T_LIST_STRUCT => Item::List(node(Form::Tagged)),
            T_TUPLE | T_TUPLE_PACKED | T_TUPLE_STRUCT => Item::Tuple(node(Form::Tagged)),
            T_DICT_SHAPED => {
                let (id, after) = self.varint(b)?;
                self.shape(id)?;
                Item::Dict(Node {
                    rec,
                    form: Form::Struct(id as u32),
                    pos: after as u64,
                })
            }
            T_DICT => Item::Dict(node(Form::Tagged)),
            t => return corrupt(format!("unknown tag {t}")),
        })
    }

    fn ext_at(&self, at: usize) -> Result<Extent, ArchiveError> {
        Ok(Extent {
            offset: self.u64(at)?,
            len: self.u64(at + 8)?,
            checksum: self.u64(at + 16)?,
        })
    }

    /// The end of an array's metadata starting at `at` (checked to be readable).
    fn array_meta_end(&self, at: usize) -> Result<usize, ArchiveError> {
        let tl = self.byte(at)? as usize;
        let nd_at = at + 1 + tl;
        let nd = self.byte(nd_at)? as usize;
        let end = nd_at + 1 + nd * 8 + 24;
        self.get(at, end - at)?;
        Ok(end)
    }

    // --- sequences ----------------------------------------------------------------------

    /// Whether a list/tuple node is a tuple.
    pub fn is_tuple(&self, node: Node) -> bool {
        match node.form {
            Form::Pack { tuple, .. } => tuple,
            Form::Struct(_) => false,
            Form::Tagged => matches!(
                self.byte(node.pos as usize),
                Ok(T_TUPLE | T_TUPLE_PACKED | T_TUPLE_STRUCT)
            ),
        }
    }

    /// A sequence node's layout, read once: its length and how to reach item `i`.
    #[inline(always)]
    pub fn seq(&self, node: Node) -> Result<SeqAt, ArchiveError> {
        let pos = node.pos as usize;
        let seq = |kind, shape, elem: Elem, step, (len, at): (usize, usize)| SeqAt {
            rec: node.rec,
            shape,
            kind,
            elem,
            step,
            len,
            at,
        };
        match node.form {
            Form::Pack { elem, count, .. } => Ok(seq(
                SeqKind::Packed,
                0,
                elem,
                elem.size(),
                (count as usize, pos),
            )),
            Form::Struct(_) => corrupt("a dict is not a sequence"),
            Form::Tagged => {
                let tag = self.byte(pos)?;
                match tag {
                    T_LIST | T_TUPLE => Ok(seq(
                        SeqKind::Refs,
                        0,
                        Elem::I8,
                        REF,
                        self.count(pos + 1, REF)?,
                    )),
                    T_LIST_PACKED | T_TUPLE_PACKED => {
                        let elem = Elem::from_u8(self.byte(pos + 1)?)
                            .ok_or_else(|| ArchiveError::Corrupt("bad packed element".into()))?;
                        let n = self.count(pos + 2, elem.size())?;
                        Ok(seq(SeqKind::Packed, 0, elem, elem.size(), n))
                    }
                    T_LIST_STRUCT | T_TUPLE_STRUCT => {
                        let (id, at) = self.varint(pos + 1)?;
                        let size = self.shape(id)?.shape.size as usize;
                        let n = self.count(at, size)?;
                        Ok(seq(SeqKind::Struct, id as u32, Elem::I8, size, n))
                    }
                    _ => corrupt("not a sequence"),
                }
            }
        }
    }

    pub fn seq_len(&self, node: Node) -> Result<usize, ArchiveError> {
        Ok(self.seq(node)?.len)
    }

    /// Item `i` of a sequence node (`Invalid` if `i` is out of range).
    #[inline]
    pub fn seq_item(&self, node: Node, i: usize) -> Result<Item<'_>, ArchiveError> {
        self.seq_get(self.seq(node)?, i)
    }

    /// Item `i` of a sequence whose layout is known (`Invalid` if `i` is out of range).
    #[inline(always)]
    pub fn seq_get(&self, seq: SeqAt, i: usize) -> Result<Item<'_>, ArchiveError> {
        if i >= seq.len {
            return Err(ArchiveError::Invalid(format!("index {i} out of range")));
        }
        // `i < len` and `at + len * step` was checked to be inside the records.
        let at = seq.at + i * seq.step;
        match seq.kind {
            SeqKind::Refs => self.tagged(seq.rec, self.follow(at)?),
            SeqKind::Packed => self.scalar(seq.elem, at),
            SeqKind::Struct => Ok(Item::Dict(Node {
                rec: seq.rec,
                form: Form::Struct(seq.shape),
                pos: at as u64,
            })),
        }
    }

    /// The element type and bytes of a packed sequence (`None` for other layouts), for
    /// reading all of its elements at once. The bytes hold exactly `seq.len` elements
    /// (checked when the layout was read).
    #[inline]
    pub fn packed(&self, seq: SeqAt) -> Option<(Elem, &[u8])> {
        if seq.kind != SeqKind::Packed {
            return None;
        }
        let bytes = self.get(seq.at, seq.len.checked_mul(seq.step)?).ok()?;
        Some((seq.elem, bytes))
    }

    #[inline(always)]
    fn scalar(&self, elem: Elem, at: usize) -> Result<Item<'_>, ArchiveError> {
        match read_elem(elem, self.get(at, elem.size())?) {
            Some(Scalar::Bool(b)) => Ok(Item::Bool(b)),
            Some(Scalar::Int(i)) => Ok(Item::Int(i)),
            Some(Scalar::Float(f)) => Ok(Item::Float(f)),
            None => corrupt("a packed bool is not 0 or 1"),
        }
    }

    // --- dicts --------------------------------------------------------------------------

    /// Number of entries of a dict node.
    pub fn dict_len(&self, node: Node) -> Result<usize, ArchiveError> {
        match node.form {
            Form::Struct(id) => Ok(self.shape(id as u64)?.shape.keys.len()),
            Form::Tagged if self.byte(node.pos as usize)? == T_DICT => {
                Ok(self.count(node.pos as usize + 1, 2 * REF)?.0)
            }
            _ => corrupt("not a dict"),
        }
    }

    /// The key symbols of a shaped dict node (`None` for the general layout).
    #[inline]
    pub fn dict_shape_keys(&self, node: Node) -> Option<&[u32]> {
        match node.form {
            Form::Struct(id) => self.shapes.get(id as usize).map(|s| &s.shape.keys[..]),
            _ => None,
        }
    }

    /// The shape id of a shaped dict node (`None` for any other node).
    #[inline(always)]
    pub fn dict_shape(&self, node: Node) -> Option<u32> {
        match node.form {
            Form::Struct(id) => Some(id),
            _ => None,
        }
    }

    /// The number of shapes, and shape `id` (its keys, slot encodings and offsets).
    pub fn shape_count(&self) -> usize {
        self.shapes.len()
    }

    pub fn shape_def(&self, id: u32) -> Option<&Shape> {
        self.shapes.get(id as usize).map(|s| &s.shape)
    }

    /// The value in the slot of a shaped dict node that a field of its shape (`enc` at
    /// `off`, from [`Self::shape_def`]) names: what `dict_value` reads, for a caller that
    /// found the field itself.
    #[inline(always)]
    pub fn struct_slot(&self, node: Node, enc: Enc, off: u32) -> Result<Item<'_>, ArchiveError> {
        let at = (node.pos as usize)
            .checked_add(off as usize)
            .ok_or_else(|| ArchiveError::Corrupt("a slot beyond the address space".into()))?;
        self.slot(node.rec, enc, at)
    }

    /// Value of entry `i` of a dict node.
    #[inline(always)]
    pub fn dict_value(&self, node: Node, i: usize) -> Result<Item<'_>, ArchiveError> {
        match node.form {
            Form::Struct(id) => {
                let sh = &self.shape(id as u64)?.shape;
                let (Some(&enc), Some(&off)) = (sh.encs.get(i), sh.offsets.get(i)) else {
                    return Err(ArchiveError::Invalid(format!("entry {i} out of range")));
                };
                self.slot(node.rec, enc, node.pos as usize + off as usize)
            }
            _ => {
                let (n, at) = self.count(node.pos as usize + 1, 2 * REF)?;
                if i >= n {
                    return Err(ArchiveError::Invalid(format!("entry {i} out of range")));
                }
                self.tagged(node.rec, self.follow(at + (2 * i + 1) * REF)?)
            }
        }
    }

    /// Key of entry `i` of a dict node.
    pub fn dict_key(&self, node: Node, i: usize) -> Result<Item<'_>, ArchiveError> {
        match node.form {
            Form::Struct(id) => match self.shape(id as u64)?.shape.keys.get(i) {
                Some(&k) => Ok(Item::Sym(k)),
                None => Err(ArchiveError::Invalid(format!("entry {i} out of range"))),
            },
            _ => {
                let (n, at) = self.count(node.pos as usize + 1, 2 * REF)?;
                if i >= n {
                    return Err(ArchiveError::Invalid(format!("entry {i} out of range")));
                }
                self.tagged(node.rec, self.follow(at + 2 * i * REF)?)
            }
        }
    }

    /// A typed slot's value.
    #[inline(always)]
    fn slot(&self, rec: u32, enc: Enc, at: usize) -> Result<Item<'_>, ArchiveError> {
        Ok(match enc {
            Enc::None => Item::None,
            Enc::Bool => match self.byte(at)? {
                0 => Item::Bool(false),
                1 => Item::Bool(true),
                _ => return corrupt("a bool slot is not 0 or 1"),
            },
            Enc::Int(e) => self.scalar(e, at)?,
            Enc::F64 => Item::Float(f64::from_bits(self.u64(at)?)),
            Enc::Str | Enc::Bytes => {
                let t = self.follow(at)?;
                let (n, after) = self.count(t, 1)?;
                let b = self.get(after, n)?;
                if enc == Enc::Str {
                    Item::Str(b)
                } else {
                    Item::Bytes(b)
                }
            }
            Enc::Pack { elem, count, tuple } => {
                let node = Node {
                    rec,
                    form: Form::Pack { elem, count, tuple },
                    pos: at as u64,
                };
                if tuple {
                    Item::Tuple(node)
                } else {
                    Item::List(node)
                }
            }
            Enc::Ref => self.tagged(rec, self.follow(at)?)?,
        })
    }

    /// Entry number of the str `key` in a dict node.
    pub fn dict_find_str(&self, node: Node, key: &str) -> Result<Option<usize>, ArchiveError> {
        if let Form::Struct(id) = node.form {
            let keys = &self.shape(id as u64)?.shape.keys;
            for (i, &k) in keys.iter().enumerate() {
                if self.symbol(k)? == key {
                    return Ok(Some(i));
                }
            }
            return Ok(None);
        }
        let hash = super::key::hash_str(key);
        self.general_find(node, hash, |k| {
            Ok(match k {
                Item::Sym(id) => self.symbol(id)? == key,
                Item::Str(s) => s == key.as_bytes(),
                _ => false,
            })
        })
    }

    /// Entry number of `key` in a dict node.
    pub fn dict_find(&self, node: Node, key: &Key<'_>) -> Result<Option<usize>, ArchiveError> {
        if let Key::Str(s) = key {
            return self.dict_find_str(node, s);
        }
        if let Form::Struct(_) = node.form {
            return Ok(None); // shaped dicts have str keys only
        }
        self.general_find(node, key.stable_hash(), |k| {
            Ok(self.item_key(k)?.key_eq(key))
        })
    }

    /// Whether a general dict node has a hash index.
    pub fn dict_indexed(&self, node: Node) -> bool {
        node.form == Form::Tagged && self.dict_len(node).is_ok_and(super::value::dict_has_index)
    }

    fn general_find(
        &self,
        node: Node,
        hash: u64,
        mut matches: impl FnMut(Item<'_>) -> Result<bool, ArchiveError>,
    ) -> Result<Option<usize>, ArchiveError> {
        let (n, at) = self.count(node.pos as usize + 1, 2 * REF)?;
        let key = |e: usize| self.tagged(node.rec, self.follow(at + 2 * e * REF)?);
        if !super::value::dict_has_index(n) {
            for e in 0..n {
                if matches(key(e)?)? {
                    return Ok(Some(e));
                }
            }
            return Ok(None);
        }
        let cap = table::record_index_capacity(n);
        let idx = self.get(at + 2 * n * REF, cap * 4)?;
        let mut i = table::home(hash, cap as u64) as usize;
        for _ in 0..cap {
            let e = u32_at(idx, i * 4) as usize;
            if e == 0 {
                return Ok(None);
            }
            if e > n {
                return corrupt("dict index out of range");
            }
            if matches(key(e - 1)?)? {
                return Ok(Some(e - 1));
            }
            i = table::next(i, cap);
        }
        Ok(None)
    }

    /// A lookup in record `rec` missed in an indexed dict: make sure that is because the key
    /// is absent, not because a forged index hides it. The first miss in a record checks
    /// every indexed dict of the record (each entry must be found from its key's hash);
    /// later misses are free. `Corrupt` if an index does not find one of its entries.
    pub fn confirm_miss(&self, rec: u64) -> Result<(), ArchiveError> {
        self.validate_record(rec)?;
        let (word, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
        if self.indexes_checked[word].load(Ordering::Acquire) & bit != 0 {
            return Ok(());
        }
        let (s, e) = self.span(rec)?;
        let mut dicts = Vec::new();
        self.walk(s, e, |pos, tag| {
            if tag == T_DICT {
                dicts.push(pos);
            }
            Ok(())
        })?;
        for pos in dicts {
            let node = Node {
                rec: rec as u32,
                form: Form::Tagged,
                pos: pos as u64,
            };
            let n = self.dict_len(node)?;
            if !super::value::dict_has_index(n) {
                continue;
            }
            for i in 0..n {
                let k = self.item_key(self.dict_key(node, i)?)?;
                let found =
                    self.general_find(node, k.stable_hash(), |c| Ok(self.item_key(c)?.key_eq(&k)))?;
                if found != Some(i) {
                    return corrupt(format!(
                        "record {rec}: a dict's hash index does not find its entry {i}"
                    ));
                }
            }
        }
        self.indexes_checked[word].fetch_or(bit, Ordering::AcqRel);
        Ok(())
    }

    /// A stored dict key as a `Key` (`Corrupt` for a value that cannot be a key).
    pub fn item_key<'s>(&'s self, item: Item<'s>) -> Result<Key<'s>, ArchiveError> {
        self.item_key_depth(item, 0)
    }

    fn item_key_depth<'s>(&'s self, item: Item<'s>, depth: usize) -> Result<Key<'s>, ArchiveError> {
        use std::borrow::Cow::Borrowed;
        Ok(match item {
            Item::None => Key::None,
            Item::Bool(b) => Key::Bool(b),
            Item::Int(i) => Key::Int(i),
            Item::BigInt(b) if super::key::bigint_is_canonical(b) => Key::BigInt(Borrowed(b)),
            Item::BigInt(_) => {
                return corrupt("an int dict key that is not in its shortest form");
            }
            Item::Float(f) => Key::Float(f),
            Item::Str(s) => match std::str::from_utf8(s) {
                Ok(s) => Key::Str(Borrowed(s)),
                Err(_) => return corrupt("a str key is not UTF-8"),
            },
            Item::Sym(id) => Key::Str(Borrowed(self.symbol(id)?)),
            Item::Bytes(b) => Key::Bytes(Borrowed(b)),
            Item::Tuple(node) if depth < MAX_KEY_DEPTH => {
                let n = self.seq_len(node)?;
                Key::Tuple(
                    (0..n)
                        .map(|i| self.item_key_depth(self.seq_item(node, i)?, depth + 1))
                        .collect::<Result<_, _>>()?,
                )
            }
            _ => return corrupt("a dict key of a type that cannot be a key"),
        })
    }

    // --- symbols and the dict archive's keys ----------------------------------------------

    /// Number of interned symbols.
    pub fn symbol_count(&self) -> usize {
        self.symbols.len()
    }

    /// An interned string.
    #[inline]
    pub fn symbol(&self, id: u32) -> Result<&str, ArchiveError> {
        let &(s, e) = self
            .symbols
            .get(id as usize)
            .ok_or_else(|| ArchiveError::Corrupt(format!("symbol {id} out of range")))?;
        // SAFETY: every symbol's bytes were checked to be UTF-8 in `parse_symbols` when the
        // reader opened, and the archive bytes never change afterwards.
        Ok(unsafe { std::str::from_utf8_unchecked(&self.bytes()[s..e]) })
    }

    /// Dict archives: the key of entry `i`.
    pub fn key(&self, i: u64) -> Result<Key<'_>, ArchiveError> {
        if self.header.kind != Kind::Dict || i >= self.header.count {
            return Err(ArchiveError::Invalid(format!("no key {i}")));
        }
        let (k, rest) = decode_key(self.key_bytes(i)?)?;
        if !rest.is_empty() {
            return corrupt(format!("key {i}: trailing bytes"));
        }
        Ok(k)
    }

    /// Dict archives: the entry number of `key`, if present. Bounded probing: a corrupted
    /// table can give a wrong answer or an error, never a hang.
    pub fn lookup(&self, key: &Key<'_>) -> Result<Option<u64>, ArchiveError> {
        if self.header.kind != Kind::Dict {
            return Ok(None);
        }
        if let Key::Str(s) = key {
            // Hot path (doc_id -> text): a str can only equal a stored str, whose canonical
            // encoding is unique, so compare encoded bytes; no decoding, no UTF-8 check.
            let b = self.bytes();
            let keys_end = self.header.table_off as usize;
            return self.probe(super::key::hash_str(s), |e, at| {
                let k = match at {
                    Some(at) if at < keys_end => &b[at..keys_end],
                    _ => self.key_bytes(e)?,
                };
                Ok(k.len() >= s.len() + 5
                    && k[0] == super::key::T_STR
                    && k[1..5] == (s.len() as u32).to_le_bytes()
                    && &k[5..5 + s.len()] == s.as_bytes())
            });
        }
        self.probe(key.stable_hash(), |e, _| Ok(self.key(e)?.key_eq(key)))
    }

    /// The encoded bytes of key `i` (bounds-checked).
    fn key_bytes(&self, i: u64) -> Result<&[u8], ArchiveError> {
        let b = self.bytes();
        let ko = self.header.keys_off as usize;
        let blob = ko + (self.header.count as usize + 1) * 8;
        let end = self.header.table_off as usize;
        let s = u64_at(b, ko + i as usize * 8) as usize;
        let e = u64_at(b, ko + (i as usize + 1) * 8) as usize;
        if s > e || blob.checked_add(e).is_none_or(|x| x > end) {
            return corrupt(format!("key {i}: offsets out of bounds"));
        }
        Ok(&b[blob + s..blob + e])
    }

    fn probe(
        &self,
        h: u64,
        mut matches: impl FnMut(u64, Option<usize>) -> Result<bool, ArchiveError>,
    ) -> Result<Option<u64>, ArchiveError> {
        let b = self.bytes();
        let cap = self.header.table_len() / table::SLOT as u64; // checked at open: >= 8
        let to = self.header.table_off as usize;
        let blob = self.header.keys_off as usize + (self.header.count as usize + 1) * 8;
        let mut i = table::home(h, cap);
        for _ in 0..cap {
            let at = to + i as usize * table::SLOT;
            let slot = table::Slot::read(&b[at..at + table::SLOT]);
            let Some(e) = slot.entry() else {
                return Ok(None);
            };
            if slot.tag == h as u32 {
                if e >= self.header.count {
                    return corrupt(format!(
                        "dict table slot points at entry {e} of {}",
                        self.header.count
                    ));
                }
                // Hints (docs/format.md, "The dict table"): start loading the key and the
                // record now, so that the misses on the key, the index and the record
                // overlap instead of following one another. The record hint is only
                // prefetched; the key hint also tells `matches` where the key is
                // (bounds-checked there, like the offsets).
                let key_at = slot.key_hint().map(|k| blob.saturating_add(k));
                if let Some(at) = key_at {
                    prefetch(b, at);
                }
                if let Some(start) = slot.start_hint() {
                    for line in (start..start.saturating_add(PREFETCH_AHEAD)).step_by(64) {
                        prefetch(b, line);
                    }
                }
                // And what reading the record will look at first: its index entry and, if it
                // is not checked yet in this process, its block's entries.
                self.prefetch_record(e);
                if !self.is_validated(e) {
                    self.prefetch_block(e);
                }
                if matches(e, key_at)? {
                    return Ok(Some(e));
                }
            }
            i = table::next(i as usize, cap as usize) as u64;
        }
        Ok(None)
    }

    // --- out-of-line data ---------------------------------------------------------------

    /// The bytes of an out-of-line payload (in the records region, 64-byte aligned).
    pub fn payload(&self, ext: Extent) -> Result<&[u8], ArchiveError> {
        let ok = usize::try_from(ext.offset)
            .ok()
            .zip(usize::try_from(ext.len).ok());
        match ok {
            Some((o, l))
                if o >= HEADER_LEN
                    && o % PAYLOAD_ALIGN as usize == 0
                    && o.checked_add(l).is_some_and(|e| e <= self.rec_end) =>
            {
                Ok(&self.bytes()[o..o + l])
            }
            _ => corrupt("out-of-line data out of bounds"),
        }
    }

    /// The bytes of an out-of-line `bytes` value, checked against their checksum: reading
    /// them copies them anyway, so the hash costs little next to the copy (array data, which
    /// is mapped and not copied, is checked by [`Self::verify_payloads`] only).
    pub fn payload_checked(&self, ext: Extent) -> Result<&[u8], ArchiveError> {
        let data = self.payload(ext)?;
        if xxh3_64(data) != ext.checksum {
            return corrupt(format!(
                "the out-of-line data at {} ({} bytes) was modified",
                ext.offset, ext.len
            ));
        }
        Ok(data)
    }

    /// Check an array's metadata against its data and return where it lives.
    pub fn array(&self, a: ArrayAt) -> Result<ArrayView<'_>, ArchiveError> {
        let at = a.pos as usize;
        let rec = a.rec;
        let end = self.array_meta_end(at)?;
        let tl = self.byte(at)? as usize;
        let typestr = std::str::from_utf8(self.get(at + 1, tl)?)
            .map_err(|_| ArchiveError::Corrupt(format!("record {rec}: array dtype not UTF-8")))?;
        let Some(itemsize) = typestr_itemsize(typestr) else {
            return corrupt(format!("array with unsupported dtype {typestr:?}"));
        };
        let nd = self.byte(at + 1 + tl)? as usize;
        if nd > MAX_NDIM {
            return corrupt(format!(
                "record {rec}: array with {nd} dimensions (at most {MAX_NDIM})"
            ));
        }
        let dims = at + 2 + tl;
        let shape = (0..nd)
            .map(|i| Ok(self.u64(dims + i * 8)? as usize))
            .collect::<Result<Vec<usize>, ArchiveError>>()?;
        // numpy's own rule (it skips zero dimensions): the product of the other dimensions
        // times the item size must fit in an isize, else it refuses the array. An empty
        // array of shape (0, 2**62) holds no data but is still no array numpy can make.
        let too_big = || ArchiveError::Corrupt(format!("record {rec}: array shape overflows"));
        let span = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(itemsize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or_else(too_big)?;
        let n = if shape.contains(&0) { 0 } else { span };
        let ext = self.ext_at(end - 24)?;
        let data = self.payload(ext)?;
        if n != data.len() {
            return corrupt(format!("record {rec}: array metadata inconsistent"));
        }
        let offset = ext.offset as usize;
        Ok(ArrayView {
            typestr,
            shape,
            offset,
            nbytes: n,
        })
    }
}

/// The state of a tree walk: the containers still to visit, the last reference target seen,
/// where the value found last ends, and the record's out-of-line extents.
struct Walk<'q> {
    /// The containers still to walk, in the order they were written: (position, depth,
    /// where the value written after it starts, or the record's end).
    queue: &'q mut Vec<(usize, usize, usize)>,
    /// The position of the value found last.
    last: usize,
    end: usize,
    /// The value found last, whose end the next value's start must not precede.
    prev: Prev,
    /// The out-of-line extents of the record's big bytes and arrays (offset, length).
    payloads: Vec<(u64, u64)>,
}

/// The value a walk found last: a leaf (its end is known) or a queued container (its end is
/// known when it is walked, and checked against the start of the value after it then).
#[derive(Clone, Copy)]
enum Prev {
    Leaf(usize),
    Queued(usize),
}

impl Walk<'_> {
    /// The reference at `at`, `depth` containers down: it must point forward of the one
    /// before it and inside the record, at or after the end of the value written before it
    /// (values never overlap, so no byte is read as part of two values: a crafted record
    /// cannot make one string of its bytes into many). A container it points to is queued;
    /// anything else (numbers, strings, packed sequences, the slot of an untagged string)
    /// is checked now, which spares the queue the many small leaves of a record.
    #[inline]
    fn push<B: AsRef<[u8]>>(
        &mut self,
        r: &Reader<B>,
        at: usize,
        tagged: bool,
        depth: usize,
        visit: &mut impl FnMut(usize, u8) -> Result<(), ArchiveError>,
    ) -> Result<(), ArchiveError> {
        let t = r.follow(at)?;
        if t <= self.last || t >= self.end {
            return corrupt("a reference does not point forward inside the record");
        }
        match self.prev {
            Prev::Leaf(stop) if t < stop => {
                return corrupt("a value overlaps the value written after it");
            }
            Prev::Leaf(_) => {}
            Prev::Queued(i) => self.queue[i].2 = t,
        }
        self.depth(depth)?;
        self.last = t;
        let stop = if tagged {
            let tag = r.byte(t)?;
            match r.leaf_end(tag, t + 1)? {
                Some(stop) => {
                    visit(t, tag)?;
                    if let Some(ext) = r.out_of_line(tag, stop)? {
                        self.payloads.push((ext.offset, ext.len));
                    }
                    stop
                }
                None => {
                    self.prev = Prev::Queued(self.queue.len());
                    self.queue.push((t, depth, self.end));
                    return Ok(());
                }
            }
        } else {
            let (n, after) = r.count(t, 1)?;
            after + n
        };
        if stop > self.end {
            return corrupt("a value runs past its record");
        }
        self.prev = Prev::Leaf(stop);
        Ok(())
    }

    /// After the last value: the record's out-of-line extents must not overlap either (a
    /// crafted record must not name one big payload many times).
    fn finish(mut self) -> Result<(), ArchiveError> {
        if self.payloads.len() > 1 {
            self.payloads.sort_unstable();
            for w in self.payloads.windows(2) {
                if w[0].0.saturating_add(w[0].1) > w[1].0 {
                    return corrupt("two values of the record share out-of-line bytes");
                }
            }
        }
        Ok(())
    }

    /// Values `depth` containers down are within the format's limit.
    #[inline]
    fn depth(&self, depth: usize) -> Result<(), ArchiveError> {
        if depth > MAX_VALUE_DEPTH + 1 {
            return corrupt(format!(
                "values nested deeper than {MAX_VALUE_DEPTH} levels"
            ));
        }
        Ok(())
    }

    /// The references of a dict's slots (shape `sh`, at `at`); `depth` of its values.
    #[inline]
    fn slots<B: AsRef<[u8]>>(
        &mut self,
        r: &Reader<B>,
        sh: &ShapeInfo,
        at: usize,
        depth: usize,
        visit: &mut impl FnMut(usize, u8) -> Result<(), ArchiveError>,
    ) -> Result<(), ArchiveError> {
        self.depth(depth)?;
        for &f in sh.refs.iter() {
            let f = f as usize;
            let tagged = sh.shape.encs[f] == Enc::Ref;
            self.push(r, at + sh.shape.offsets[f] as usize, tagged, depth, visit)?;
        }
        Ok(())
    }
}

/// A sequence's layout (`Reader::seq`). Plain fields rather than an enum with data, so
/// that building and reading one stays in registers.
#[derive(Debug, Clone, Copy)]
pub struct SeqAt {
    rec: u32,
    /// The shape of a struct sequence's elements.
    shape: u32,
    kind: SeqKind,
    /// The element type of a packed sequence (unused otherwise).
    elem: Elem,
    /// Bytes per element: a reference, a packed element, a struct.
    step: usize,
    pub len: usize,
    at: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum SeqKind {
    Refs,
    Packed,
    Struct,
}

fn msg(e: ArchiveError) -> String {
    match e {
        ArchiveError::Corrupt(m) => m,
        e => e.to_string(),
    }
}

fn parse_symbols(bytes: &[u8], h: &Header) -> Result<Vec<(usize, usize)>, ArchiveError> {
    let so = h.symbols_off as usize;
    let sl = h.symbols_len() as usize;
    if sl < 8 {
        return corrupt("symbol table truncated");
    }
    let n = u32_at(bytes, so) as usize;
    let offs = so + 4;
    if n > super::encode::MAX_SYMBOLS || offs + (n + 1) * 4 > so + sl {
        return corrupt("symbol table malformed");
    }
    let blob = offs + (n + 1) * 4;
    let mut out = Vec::with_capacity(n);
    let mut prev = u32_at(bytes, offs) as usize;
    for i in 0..n {
        let next = u32_at(bytes, offs + (i + 1) * 4) as usize;
        if next < prev || blob + next > so + sl {
            return corrupt("symbol table offsets malformed");
        }
        let s = &bytes[blob + prev..blob + next];
        if std::str::from_utf8(s).is_err() {
            return corrupt(format!("symbol {i} is not UTF-8"));
        }
        out.push((blob + prev, blob + next));
        prev = next;
    }
    Ok(out)
}

fn parse_shapes(bytes: &[u8], h: &Header, nsym: usize) -> Result<Vec<ShapeInfo>, ArchiveError> {
    let start = h.shapes_off as usize;
    let end = h.keys_off as usize;
    let region = &bytes[start..end];
    if region.len() < 4 {
        return corrupt("shape table truncated");
    }
    let n = u32_at(region, 0) as usize;
    if n > MAX_SHAPES {
        return corrupt("shape table malformed");
    }
    let mut at = 4;
    let mut out = Vec::with_capacity(n.min(region.len() / 2));
    for s in 0..n {
        let bad = || ArchiveError::Corrupt(format!("shape {s} malformed"));
        let nf = region.get(at..at + 2).ok_or_else(bad)?;
        let nf = u16::from_le_bytes([nf[0], nf[1]]) as usize;
        at += 2;
        if nf == 0 || nf > MAX_SHAPE_FIELDS {
            return Err(bad());
        }
        let fields = region.get(at..at + nf * 8).ok_or_else(bad)?;
        at += nf * 8;
        let mut keys = Vec::with_capacity(nf);
        let mut encs = Vec::with_capacity(nf);
        for f in fields.chunks_exact(8) {
            let k = u32_at(f, 0);
            if k as usize >= nsym {
                return Err(bad());
            }
            keys.push(k);
            encs.push(Enc::decode(f[4..8].try_into().unwrap()).ok_or_else(bad)?);
        }
        let shape = Shape::new(keys.into(), encs.into());
        let refs = (0..nf as u16)
            .filter(|&i| shape.encs[i as usize].is_ref())
            .collect();
        out.push(ShapeInfo { shape, refs });
    }
    Ok(out)
}

fn parse_blocks(bytes: &[u8], h: &Header) -> Result<Vec<u64>, ArchiveError> {
    let n = h.blocks() as usize;
    let mut out = Vec::with_capacity(n);
    for b in 0..n {
        let first = u64_at(bytes, h.blocks_off as usize + b * BLOCK_ENTRY);
        let ok = if b == 0 {
            first == 0
        } else {
            first > out[b - 1] && first < h.count
        };
        if !ok {
            return corrupt("block table malformed");
        }
        out.push(first);
    }
    if (h.count > 0) != (n > 0) {
        return corrupt("block table malformed");
    }
    Ok(out)
}
