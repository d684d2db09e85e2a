//! The checks of an archive's bytes (security-critical): a block's checksum, the tree walk
//! of each record, the tables parsed at open (symbols, shapes, blocks), and payload
//! verification. Nothing is read through `access`/`lookup` before these passed.

use super::*;

impl<B: AsRef<[u8]>> Reader<B> {
    #[inline(always)]
    pub(crate) fn is_validated(&self, rec: u64) -> bool {
        let (word, bit) = ((rec / 64) as usize, 1u64 << (rec % 64));
        self.validated
            .get(word)
            .is_some_and(|w| w.load(Ordering::Acquire) & bit != 0)
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
    pub(super) fn validate_block(&self, rec: u64) -> Result<(), ArchiveError> {
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

    pub(super) fn validate_block_with(
        &self,
        rec: u64,
        b: usize,
        first: u64,
        last: u64,
        spans: &mut Vec<(usize, usize)>,
        queue: &mut Vec<(usize, Depth, usize)>,
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
            if self.flat_record(s, e) {
                continue;
            }
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
    pub(super) fn prefetch_next_block(&self, b: usize, end: usize) {
        if b + 1 >= self.blocks() {
            return;
        }
        let bytes = self.bytes();
        prefetch(
            bytes,
            self.header.blocks_off as usize + (b + 1) * BLOCK_ENTRY + 8,
        );
        prefetch_lines(
            bytes,
            end,
            end.saturating_add(NEXT_BLOCK_PREFETCH).min(self.rec_end),
        );
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
    pub(super) fn alone(&self) -> bool {
        self.block_first.is_empty()
    }

    /// The number of blocks.
    #[inline]
    pub(super) fn blocks(&self) -> usize {
        if self.alone() {
            self.header.count as usize
        } else {
            self.block_first.len()
        }
    }

    /// Where record `rec`'s block would be if every block held as many records (a block
    /// table is never empty when there are records).
    pub(super) fn block_guess(&self, rec: u64) -> usize {
        let n = self.blocks();
        let guess = (rec as u128 * n as u128) / self.header.count.max(1) as u128;
        (guess as usize).min(n - 1)
    }

    /// Walk the record at [start, end) breadth first, as it was written: every reference
    /// must point forward of the one before it and inside the record, no value may overlap
    /// the one written after it (so the record is a tree of disjoint values and the walk
    /// ends), containers nest at most as deep as a writer makes them ([`Depth`]). `visit`
    /// sees every tagged value (its position and tag).
    pub(super) fn walk(
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
    pub(super) fn walk_with(
        &self,
        queue: &mut Vec<(usize, Depth, usize)>,
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
        w.queue.push((start, Depth::ROOT, end));
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
                        w.push(self, after + i * REF, true, depth.child(), &mut visit)?;
                    }
                    after + n * REF
                }
                T_LIST_STRUCT | T_TUPLE_STRUCT => {
                    let (sh, n, after) = self.rows(pos, end)?;
                    let size = sh.shape.size as usize;
                    // The rows are dicts one level down, their values one more.
                    let row = depth.child();
                    if n > 0 {
                        row.dict_of(sh)?;
                    }
                    // Rows of plain slots (numbers, packed fields): nothing to follow.
                    if !sh.refs.is_empty() {
                        for i in 0..n {
                            w.slots(self, sh, after + i * size, row.child(), &mut visit)?;
                        }
                    }
                    after + n * size
                }
                T_DICT_SHAPED => {
                    let (id, after) = self.varint(body)?;
                    let sh = self.shape(id)?;
                    depth.dict_of(sh)?;
                    w.slots(self, sh, after, depth.child(), &mut visit)?;
                    after + sh.shape.size as usize
                }
                T_DICT => {
                    let (n, after) = self.count(body, 2 * REF)?;
                    for i in 0..n {
                        let at = after + 2 * i * REF;
                        w.push(self, at, true, depth.key(), &mut visit)?;
                        w.push(self, at + REF, true, depth.child(), &mut visit)?;
                    }
                    let mut stop = after + 2 * n * REF;
                    if crate::archive::value::dict_has_index(n) {
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

    /// The walk's checks of the commonest records, made without its queue: a shaped dict
    /// whose references all point at values that hold none of their own (numbers, strings,
    /// packed numbers, out-of-line bytes and arrays, a list of shaped dicts without
    /// references: an image and its annotations), or at a shaped dict or a list whose own
    /// references do (`{"meta": {...}}`, a list of tags). [`Self::walk_with`] would queue
    /// the dict, each list of rows and each inner container and walk them after; here a
    /// list of rows ends where its count says, known at once, and the inner containers'
    /// values, which the walk reaches after all of the root's, are checked in a second pass
    /// in the order the containers were found, both passes by one reading of the walk's
    /// rules (`Flat::value`). `true`: the walk accepts the record too (it checks the same
    /// rules: each reference forward of the one before and inside the record, no value
    /// overlapping the one written after it, no out-of-line extent shared, and depths that
    /// a record of this form never exceeds). `false`: a record of another form, or one that
    /// breaks a rule: the walk decides, and names what is wrong. The fuzzer holds it to
    /// that (`archive::fuzz`: every record accepted here, the walk accepts).
    #[inline]
    pub(super) fn flat_record(&self, start: usize, end: usize) -> bool {
        self.flat_record_checked(start, end).is_some()
    }

    #[inline(never)]
    fn flat_record_checked(&self, start: usize, end: usize) -> Option<()> {
        // The deepest container here is a packed field of a row of a list inside a dict or
        // list of the root's, at depth 4 (the root at 0, the inner container at 1, the list
        // of rows at 2, its rows at 3), which a writer makes.
        const _: () = assert!(MAX_DEPTH > 4);
        if self.byte(start).ok()? != T_DICT_SHAPED {
            return None;
        }
        let (id, body) = self.varint(start + 1).ok()?;
        let sh = self.shapes.get(usize::try_from(id).ok()?)?;
        // The first value must start after the dict's own slots.
        let mut f = Flat {
            stop: body.checked_add(sh.shape.size as usize)?,
            last: start,
            end,
            n_payloads: 0,
            inner: false,
        };
        let mut payloads = [(0u64, 0u64); FLAT_PAYLOADS];
        for &i in sh.refs.iter() {
            let i = usize::from(i);
            let tagged = sh.shape.encs[i] == Enc::Ref;
            f.value(
                self,
                &mut payloads,
                body + sh.shape.offsets[i] as usize,
                tagged,
                true,
            )?;
        }
        if f.inner {
            self.flat_inner(sh, body, &mut f, &mut payloads)?;
        }
        let (stop, n_payloads) = (f.stop, f.n_payloads);
        if stop > end {
            return None;
        }
        if n_payloads > 1 {
            let payloads = &mut payloads[..n_payloads];
            payloads.sort_unstable();
            if payloads
                .windows(2)
                .any(|w| w[0].0.saturating_add(w[0].1) > w[1].0)
            {
                return None;
            }
        }
        Some(())
    }

    /// A shaped dict or a list (`tag` at `t`) among a flat record's values: where its slots
    /// or items start and which they are; `None` for any other container. The one reading
    /// of their headers for both passes of [`Self::flat_record`].
    #[inline(always)]
    fn flat_inner_at(&self, tag: u8, t: usize) -> Option<(usize, Inner<'_>)> {
        match tag {
            T_DICT_SHAPED => {
                let (id, after) = self.varint(t + 1).ok()?;
                let sh = self.shapes.get(usize::try_from(id).ok()?)?;
                Some((after, Inner::Dict(sh)))
            }
            T_LIST | T_TUPLE => {
                let (n, after) = self.count(t + 1, REF).ok()?;
                Some((after, Inner::List(n)))
            }
            _ => None,
        }
    }

    /// Where a shaped dict or a list (`tag` at `t`) among a flat record's values ends.
    #[inline(never)]
    fn flat_inner_end(&self, tag: u8, t: usize) -> Option<usize> {
        match self.flat_inner_at(tag, t)? {
            (after, Inner::Dict(sh)) => after.checked_add(sh.shape.size as usize),
            // `count` checked that the items fit.
            (after, Inner::List(n)) => Some(after + n * REF),
        }
    }

    /// The second pass of [`Self::flat_record`]: the values of the root's dicts and lists
    /// (shape `sh`, slots at `body`), which the walk, going breadth first, reaches after all
    /// of the root's own, in the order those containers were found: the order of the root's
    /// references (read again: the first pass checked them). Values that hold references
    /// of their own are left to the walk.
    #[inline(never)]
    fn flat_inner(
        &self,
        sh: &ShapeInfo,
        body: usize,
        f: &mut Flat,
        payloads: &mut [(u64, u64); FLAT_PAYLOADS],
    ) -> Option<()> {
        for &i in sh.refs.iter() {
            let i = usize::from(i);
            if sh.shape.encs[i] != Enc::Ref {
                continue;
            }
            let t = self.follow_small(body + sh.shape.offsets[i] as usize)?;
            let Some((after, inner)) = self.flat_inner_at(self.byte(t).ok()?, t) else {
                continue;
            };
            match inner {
                Inner::Dict(sh) => {
                    for &j in sh.refs.iter() {
                        let j = usize::from(j);
                        let tagged = sh.shape.encs[j] == Enc::Ref;
                        let at = after + sh.shape.offsets[j] as usize;
                        f.value(self, payloads, at, tagged, false)?;
                    }
                }
                Inner::List(n) => {
                    for k in 0..n {
                        f.value(self, payloads, after + k * REF, true, false)?;
                    }
                }
            }
        }
        Some(())
    }

    /// The list of shaped dicts at `pos` (its tag read) in a record ending at `end`: the
    /// rows' shape, their count and where the first starts, `count` having checked that
    /// they end inside the records. The walk's and [`Self::flat_record`]'s reading of it.
    #[inline(always)]
    fn rows(&self, pos: usize, end: usize) -> Result<(&ShapeInfo, usize, usize), ArchiveError> {
        let (id, after) = self.varint(pos + 1)?;
        let sh = self.shape(id)?;
        let (n, after) = self.count(after, sh.shape.size as usize)?;
        if sh.shape.size == 0 && n > end.saturating_sub(after) {
            // Rows of no bytes: writers never make more of them than there are bytes left
            // (they write such lists as references), and reading a crafted count of 2^60
            // whole would never end.
            return corrupt(format!(
                "a list of {n} rows of no bytes in a record of {} bytes",
                end - pos
            ));
        }
        Ok((sh, n, after))
    }

    /// Where a list of shaped dicts at `pos` ends, for [`Self::flat_record`]: `None` if its
    /// rows hold references (the walk follows them) or it breaks a rule of the walk's.
    /// Inlined: a call of its own cost ~25 instructions a COCO record.
    #[inline(always)]
    fn flat_rows_end(&self, pos: usize, end: usize) -> Option<usize> {
        let (sh, n, after) = self.rows(pos, end).ok()?;
        sh.refs
            .is_empty()
            .then(|| after + n * sh.shape.size as usize)
    }

    /// Whether [`Self::flat_record`] accepts record `rec` (`None`: not), and if so, whether
    /// the walk does too: the fuzzer's check of the shortcut.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn flat_and_walk(&self, rec: u64) -> Option<bool> {
        let (s, e) = self.span(rec).ok()?;
        self.flat_record(s, e)
            .then(|| self.walk(s, e, |_, _| Ok(())).is_ok())
    }

    /// The out-of-line extent of a big bytes value or an array (`tag`) whose in-record part
    /// ends at `stop` ([`Self::leaf_end`]): the extent is its last 24 bytes. `None` for
    /// any other value.
    #[inline]
    pub(super) fn out_of_line(&self, tag: u8, stop: usize) -> Result<Option<Extent>, ArchiveError> {
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
    pub(super) fn leaf_end(&self, tag: u8, body: usize) -> Result<Option<usize>, ArchiveError> {
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

    /// Check the whole archive now, as every read would: each record's block (checksum and
    /// tree), then each of its values read through the functions reads use
    /// ([`Self::check_values`]), the hash indexes of its dicts ([`Self::confirm_miss`]),
    /// and for a dict archive its keys and table ([`Self::check_keys`]): O(archive size).
    /// Readers never need this for safety; what it passes, no read refuses.
    pub fn validate_all(&self) -> Result<(), ArchiveError> {
        for r in 0..self.header.count {
            self.validate_record(r)?;
            self.check_values(r)?;
            self.confirm_miss(r)?;
        }
        if self.header.kind == Kind::Dict {
            self.check_keys()?;
        }
        Ok(())
    }

    /// Read every value of record `rec` (its block checked) as reads do: the walk sees
    /// every tagged value, each is decoded (`tagged`) and checked by [`Self::check_item`].
    pub(super) fn check_values(&self, rec: u64) -> Result<(), ArchiveError> {
        let (s, e) = self.span(rec)?;
        self.walk(s, e, |pos, _| {
            self.check_item(self.tagged(rec as u32, pos)?)
        })
        .map_err(|e| ArchiveError::Corrupt(format!("record {rec}: {}", msg(e))))
    }

    /// What a read of `item` refuses, through the same functions: a str that is not UTF-8
    /// ([`stored_str`]), packed numbers and typed slots (`seq_get`, `struct_slot`: a bool
    /// that is not 0 or 1), the keys of a general dict (`item_key`: a value of a type that
    /// cannot be a key), an array's metadata (`array`), out-of-line bytes and array data
    /// against their checksum (`payload_checked`). Values behind references are tagged,
    /// and the walk brings them here on their own.
    fn check_item(&self, item: Item<'_>) -> Result<(), ArchiveError> {
        match item {
            Item::Str(b) => {
                stored_str(b)?;
            }
            Item::BytesExt(ext) => {
                self.payload_checked(ext)?;
            }
            Item::Array(a) => {
                self.array(a)?;
                self.payload_checked(self.array_extent(a)?)?;
            }
            Item::List(node) | Item::Tuple(node) => {
                let seq = self.seq(node)?;
                match seq.kind {
                    SeqKind::Refs => {}
                    SeqKind::Packed => {
                        for i in 0..seq.len {
                            self.seq_get(seq, i)?;
                        }
                    }
                    SeqKind::Struct => {
                        for i in 0..seq.len {
                            self.check_item(self.seq_get(seq, i)?)?;
                        }
                    }
                }
            }
            Item::Dict(node) => match self.dict_shape(node) {
                Some(id) => {
                    let sh = &self.shape(u64::from(id))?.shape;
                    for (&enc, &off) in sh.encs.iter().zip(sh.offsets.iter()) {
                        if enc != Enc::Ref {
                            self.check_item(self.struct_slot(node, enc, off)?)?;
                        }
                    }
                }
                None => {
                    let n = self.dict_len(node)?;
                    let mut keys = Vec::with_capacity(n.min(1 << 16));
                    for i in 0..n {
                        let k = self.item_key(self.dict_key(node, i)?)?;
                        // A key that equals nothing, itself included (a NaN, or a tuple
                        // holding one), is never a duplicate; left out, so that a dict of
                        // many NaNs (one hash) costs no comparison of each with each.
                        if k.key_eq(&k) {
                            keys.push((k.stable_hash(), k));
                        }
                    }
                    // No key twice in Python's sense (`True == 1 == 1.0`): such a dict reads
                    // back shorter than `len()` says, and `to_python` refuses it. Equal keys
                    // hash equal, so only neighbours of one hash are compared (distinct keys
                    // of one 64-bit hash: the first pair of a run is already a duplicate).
                    keys.sort_unstable_by_key(|&(h, _)| h);
                    for run in keys.chunk_by(|a, b| a.0 == b.0) {
                        for (j, (_, a)) in run.iter().enumerate() {
                            if run[j + 1..].iter().any(|(_, b)| a.key_eq(b)) {
                                return Err(ArchiveError::Corrupt(format!(
                                    "a dict of {n} entries holds the key {a:?} twice"
                                )));
                            }
                        }
                    }
                }
            },
            _ => {}
        }
        Ok(())
    }

    /// A dict archive's keys and table, as lookups read them: every key decodes from its
    /// offsets (`key`: in order, inside the keys region, no bytes left over), every filled
    /// slot of the table names an entry (`table_entry`) and its key hint, if any, is where
    /// that entry's key is (a str lookup compares the key there), and every key is found
    /// at its own entry (keys are unique; one that equals nothing, a NaN, is found by no
    /// lookup, as in a Python dict).
    pub(super) fn check_keys(&self) -> Result<(), ArchiveError> {
        let b = self.bytes();
        let cap = self.header.table_len() / table::SLOT as u64;
        let to = self.header.table_off as usize;
        let ko = self.header.keys_off as usize;
        for i in 0..cap as usize {
            let at = to + i * table::SLOT;
            let slot = table::Slot::read(&b[at..at + table::SLOT]);
            let Some(e) = slot.entry() else {
                continue;
            };
            let e = self.table_entry(e)?;
            if let Some(hint) = slot.key_hint() {
                if hint as u64 != u64_at(b, ko + e as usize * 8) {
                    return corrupt(format!(
                        "dict table slot {i}: its key hint is not where key {e} is"
                    ));
                }
            }
        }
        for i in 0..self.header.count {
            let k = self.key(i)?;
            if k.key_eq(&k) && self.lookup(&k)? != Some(i) {
                return corrupt(format!(
                    "key {i}: the dict table does not find it at its entry"
                ));
            }
        }
        Ok(())
    }
}

/// The state of a tree walk: the containers still to visit, the last reference target seen,
/// where the value found last ends, and the record's out-of-line extents.
pub(super) struct Walk<'q> {
    /// The containers still to walk, in the order they were written: (position, depth,
    /// where the value written after it starts, or the record's end).
    queue: &'q mut Vec<(usize, Depth, usize)>,
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
    pub(super) fn push<B: AsRef<[u8]>>(
        &mut self,
        r: &Reader<B>,
        at: usize,
        tagged: bool,
        depth: Depth,
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
        self.last = t;
        let stop = if tagged {
            let tag = r.byte(t)?;
            match r.leaf_end(tag, t + 1)? {
                Some(stop) => {
                    if matches!(tag, T_LIST_PACKED | T_TUPLE_PACKED) {
                        // A list of numbers: a container, as deep as any other.
                        depth.container()?;
                    }
                    visit(t, tag)?;
                    if let Some(ext) = r.out_of_line(tag, stop)? {
                        self.payloads.push((ext.offset, ext.len));
                    }
                    stop
                }
                None => {
                    depth.container()?;
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
    pub(super) fn finish(mut self) -> Result<(), ArchiveError> {
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

    /// The references of a dict's slots (shape `sh`, at `at`); `depth` of its values.
    #[inline]
    pub(super) fn slots<B: AsRef<[u8]>>(
        &mut self,
        r: &Reader<B>,
        sh: &ShapeInfo,
        at: usize,
        depth: Depth,
        visit: &mut impl FnMut(usize, u8) -> Result<(), ArchiveError>,
    ) -> Result<(), ArchiveError> {
        for &f in sh.refs.iter() {
            let f = f as usize;
            let tagged = sh.shape.encs[f] == Enc::Ref;
            self.push(r, at + sh.shape.offsets[f] as usize, tagged, depth, visit)?;
        }
        Ok(())
    }
}

/// How deep a value lies in its record, counted as the writer counts (docs/format.md,
/// "Depth"): `value` containers from the record's root (the root is at 0), and, inside a
/// dict key, `key` tuples from the dict (0: not in a key). A writer makes containers at
/// values 0 to `MAX_DEPTH - 1` (100 levels) and, in a key, at most `MAX_KEY_DEPTH` tuples
/// one in another: the reader refuses exactly what lies beyond, so whatever it reads a
/// writer takes back (`put(view)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Depth {
    value: u32,
    key: u32,
}

impl Depth {
    /// A record's root.
    pub(super) const ROOT: Depth = Depth { value: 0, key: 0 };

    /// A value inside a container at this depth.
    #[inline(always)]
    pub(super) fn child(self) -> Depth {
        if self.key == 0 {
            Depth {
                value: self.value + 1,
                key: 0,
            }
        } else {
            Depth {
                value: self.value,
                key: self.key + 1,
            }
        }
    }

    /// A key of a dict at this depth.
    #[inline(always)]
    pub(super) fn key(self) -> Depth {
        Depth {
            value: self.value,
            key: self.key + 1,
        }
    }

    /// A container (list, tuple, dict, packed numbers) at this depth is one a writer makes.
    #[inline(always)]
    pub(super) fn container(self) -> Result<(), ArchiveError> {
        if self.key == 0 && self.value as usize >= MAX_DEPTH {
            return corrupt(format!(
                "containers nested deeper than {MAX_DEPTH} levels (the most a writer makes)"
            ));
        }
        if self.key as usize > MAX_KEY_DEPTH {
            return corrupt(format!(
                "a dict key of tuples nested deeper than {MAX_KEY_DEPTH} levels (the most a \
                 writer makes)"
            ));
        }
        Ok(())
    }

    /// A dict of shape `sh` at this depth: itself a container, and so is a packed field of
    /// it, one level down.
    #[inline(always)]
    pub(super) fn dict_of(self, sh: &ShapeInfo) -> Result<(), ArchiveError> {
        self.container()?;
        if sh.packs {
            self.child().container()?;
        }
        Ok(())
    }
}

/// Out-of-line extents that [`Reader::flat_record`] keeps to compare; a record with more is
/// left to the walk.
const FLAT_PAYLOADS: usize = 4;

/// A dict or list among a flat record's values: a shaped dict's shape, or a list's length.
enum Inner<'a> {
    Dict(&'a ShapeInfo),
    List(usize),
}

/// [`Reader::flat_record`]'s state: the walk's `last` and the end of the value found last
/// (`stop`, where the next may start), how many out-of-line extents were seen, and whether
/// a second pass is needed.
struct Flat {
    stop: usize,
    last: usize,
    end: usize,
    n_payloads: usize,
    /// Whether a value of the root is a dict or a list (a second pass checks their values).
    inner: bool,
}

impl Flat {
    /// The reference at `at` (to a tagged value, or to the slot of an untagged str or
    /// bytes), by the walk's rules (`Walk::push`): forward of the one before, inside the
    /// record, not before the end of the value found before it. A value without
    /// references ends where it says, a list of rows without references where its count
    /// says, and, where `root` (a value of the root), a shaped dict or a list where its
    /// slots or items end, its values left to the second pass. `None`: anything else, or a
    /// rule broken (the walk then decides).
    #[inline(always)]
    fn value<B: AsRef<[u8]>>(
        &mut self,
        r: &Reader<B>,
        payloads: &mut [(u64, u64); FLAT_PAYLOADS],
        at: usize,
        tagged: bool,
        root: bool,
    ) -> Option<()> {
        let t = r.follow_small(at)?;
        if t <= self.last || t >= self.end || t < self.stop {
            return None;
        }
        self.last = t;
        self.stop = if tagged {
            let tag = r.byte(t).ok()?;
            match r.leaf_end(tag, t + 1).ok()? {
                Some(e) => {
                    if let Some(ext) = r.out_of_line(tag, e).ok()? {
                        *payloads.get_mut(self.n_payloads)? = (ext.offset, ext.len);
                        self.n_payloads += 1;
                    }
                    e
                }
                None if matches!(tag, T_LIST_STRUCT | T_TUPLE_STRUCT) => {
                    r.flat_rows_end(t, self.end)?
                }
                None if root => {
                    self.inner = true;
                    r.flat_inner_end(tag, t)?
                }
                None => return None,
            }
        } else {
            // The slot of an untagged str or bytes: a length and the bytes.
            let (n, after) = r.count(t, 1).ok()?;
            after + n
        };
        Some(())
    }
}

pub(super) fn msg(e: ArchiveError) -> String {
    match e {
        ArchiveError::Corrupt(m) => m,
        e => e.to_string(),
    }
}

pub(super) fn parse_symbols(bytes: &[u8], h: &Header) -> Result<Vec<(usize, usize)>, ArchiveError> {
    let so = h.symbols_off as usize;
    let sl = h.symbols_len() as usize;
    if sl < 8 {
        return corrupt("symbol table truncated");
    }
    let n = u32_at(bytes, so) as usize;
    let offs = so + 4;
    if n > crate::archive::encode::MAX_SYMBOLS || offs + (n + 1) * 4 > so + sl {
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

/// The shapes, each checked: fields within the limits, keys among the symbols and no key
/// twice (a writer never makes such a shape, and a dict of it would have two entries,
/// `len(v) == 2`, but one key as a Python dict: `to_python() == {'a': 2}`).
pub(super) fn parse_shapes(
    bytes: &[u8],
    h: &Header,
    symbols: &[(usize, usize)],
) -> Result<Vec<ShapeInfo>, ArchiveError> {
    let nsym = symbols.len();
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
    let mut names: Vec<&[u8]> = Vec::new();
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
        // No key twice, compared as strings (two symbols may hold the same one).
        names.clear();
        names.extend(keys.iter().map(|&k| {
            let (a, b) = symbols[k as usize];
            &bytes[a..b]
        }));
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return corrupt(format!(
                "shape {s} has the key {:?} twice",
                String::from_utf8_lossy(w[0])
            ));
        }
        let shape = Shape::new(keys.into(), encs.into());
        let refs = (0..nf as u16)
            .filter(|&i| shape.encs[i as usize].is_ref())
            .collect();
        let packs = shape.encs.iter().any(|e| matches!(e, Enc::Pack { .. }));
        out.push(ShapeInfo { shape, refs, packs });
    }
    Ok(out)
}

pub(super) fn parse_blocks(bytes: &[u8], h: &Header) -> Result<Vec<u64>, ArchiveError> {
    let n = h.blocks() as usize;
    // As many blocks as records, in order from record 0 (checked below): block b is record
    // b, and the table says nothing (`Reader::alone`); nothing is kept (an object's store has
    // one record in one block).
    let keep = n as u64 != h.count;
    let mut out = Vec::with_capacity(if keep { n } else { 0 });
    let mut before = 0;
    for b in 0..n {
        let first = u64_at(bytes, h.blocks_off as usize + b * BLOCK_ENTRY);
        let ok = if b == 0 {
            first == 0
        } else {
            first > before && first < h.count
        };
        if !ok {
            return corrupt("block table malformed");
        }
        before = first;
        if keep {
            out.push(first);
        }
    }
    if (h.count > 0) != (n > 0) {
        return corrupt("block table malformed");
    }
    Ok(out)
}
