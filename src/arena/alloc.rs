//! The arena's allocator: best-fit with coalescing over size bins (the BFC idea).
//!
//! The region `[0, end)` is tiled by chunks, each free or used, every size a multiple of
//! [`ALIGN`]. Free chunks sit in bins by size class (powers of two); within a bin they are
//! ordered by (size, offset), so the first chunk of the first non-empty bin at or above the
//! request's class that is big enough is the smallest free chunk that fits (best fit, lowest
//! offset among equals). A chunk larger than needed is split; a freed chunk is merged with
//! free neighbours at once, so two free chunks are never adjacent. When nothing fits, the
//! region grows at its end (up to `capacity`), reusing a free last chunk.
//!
//! No system call and no allocation proportional to object sizes: the bookkeeping is two
//! ordered maps. `FirstFit` (first fit, no coalescing) exists only as the comparison of the
//! fragmentation benchmark.

use std::collections::{BTreeMap, BTreeSet};

/// Every chunk starts and ends on this boundary (the archive's payload alignment).
pub const ALIGN: u64 = 64;
/// Size classes: bin `b` holds free chunks of `[2^b, 2^(b+1))` bytes.
const BINS: usize = 64;

/// A region allocator; see the module docs.
#[derive(Debug)]
pub struct Bfc {
    /// offset -> (size, free), for every chunk.
    chunks: BTreeMap<u64, (u64, bool)>,
    /// Free chunks by size class, each ordered by (size, offset).
    bins: Vec<BTreeSet<(u64, u64)>>,
    end: u64,
    capacity: u64,
    used: u64,
}

fn bin_of(size: u64) -> usize {
    (63 - size.max(1).leading_zeros()) as usize
}

/// `size` rounded up to [`ALIGN`]; `None` for 0 or on overflow.
pub fn round(size: u64) -> Option<u64> {
    if size == 0 {
        return None;
    }
    size.checked_add(ALIGN - 1).map(|s| s & !(ALIGN - 1))
}

impl Bfc {
    /// An empty region that may grow to `capacity` bytes (rounded down to [`ALIGN`]).
    pub fn new(capacity: u64) -> Self {
        Bfc {
            chunks: BTreeMap::new(),
            bins: (0..BINS).map(|_| BTreeSet::new()).collect(),
            end: 0,
            capacity: capacity & !(ALIGN - 1),
            used: 0,
        }
    }

    /// Bytes of the region in use so far (its high end).
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Bytes in used chunks.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The most the region may grow to.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The size of the used chunk at `off`, if one starts there.
    pub fn size_at(&self, off: u64) -> Option<u64> {
        match self.chunks.get(&off) {
            Some(&(size, false)) => Some(size),
            _ => None,
        }
    }

    fn insert_free(&mut self, off: u64, size: u64) {
        self.chunks.insert(off, (size, true));
        self.bins[bin_of(size)].insert((size, off));
    }

    fn remove_free(&mut self, off: u64, size: u64) {
        self.bins[bin_of(size)].remove(&(size, off));
    }

    /// The smallest free chunk of at least `size` bytes (lowest offset among equals).
    fn best_fit(&self, size: u64) -> Option<(u64, u64)> {
        self.bins[bin_of(size)..]
            .iter()
            .find_map(|bin| bin.range((size, 0)..).next().copied())
    }

    /// Allocate `size` bytes (rounded up to [`ALIGN`]); returns (offset, chunk size), or
    /// `None` when the region cannot hold it.
    pub fn alloc(&mut self, size: u64) -> Option<(u64, u64)> {
        let size = round(size)?;
        let (off, have) = match self.best_fit(size) {
            Some((have, off)) => {
                self.remove_free(off, have);
                (off, have)
            }
            None => {
                // Grow at the end, starting inside a free last chunk if there is one.
                let (start, have) = match self.chunks.last_key_value() {
                    Some((&o, &(s, true))) => (o, s),
                    _ => (self.end, 0),
                };
                let new_end = start.checked_add(size)?;
                if new_end > self.capacity {
                    return None;
                }
                if have > 0 {
                    self.remove_free(start, have);
                }
                self.end = new_end;
                (start, size)
            }
        };
        self.chunks.insert(off, (size, false));
        if have > size {
            self.insert_free(off + size, have - size);
        }
        self.used += size;
        Some((off, size))
    }

    /// Free the used chunk at `off`; returns its size, or `None` if no used chunk starts
    /// there (a double free changes nothing).
    pub fn free(&mut self, off: u64) -> Option<u64> {
        let (size, free) = *self.chunks.get(&off)?;
        if free {
            return None;
        }
        self.used -= size;
        let (mut start, mut len) = (off, size);
        // Merge with a free chunk after it...
        if let Some(&(nsize, true)) = self.chunks.get(&(off + size)) {
            self.remove_free(off + size, nsize);
            self.chunks.remove(&(off + size));
            len += nsize;
        }
        // ...and before it.
        if let Some((&poff, &(psize, true))) = self.chunks.range(..off).next_back() {
            self.remove_free(poff, psize);
            self.chunks.remove(&off);
            start = poff;
            len += psize;
        }
        self.insert_free(start, len);
        Some(size)
    }

    /// Shrink the used chunk at `off` to `size` bytes (rounded up to [`ALIGN`]; at most its
    /// size): the rest becomes free, merged with a free chunk after it. For a chunk reserved
    /// for more than what was written into it. Returns the new size, or `None` if no used
    /// chunk starts at `off` or `size` is 0 or larger than the chunk.
    pub fn shrink(&mut self, off: u64, size: u64) -> Option<u64> {
        let size = round(size)?;
        let (have, free) = *self.chunks.get(&off)?;
        if free || size > have {
            return None;
        }
        if size == have {
            return Some(size);
        }
        self.chunks.insert(off, (size, false));
        self.used -= have - size;
        let (tail, mut len) = (off + size, have - size);
        if let Some(&(nsize, true)) = self.chunks.get(&(off + have)) {
            self.remove_free(off + have, nsize);
            self.chunks.remove(&(off + have));
            len += nsize;
        }
        self.insert_free(tail, len);
        Some(size)
    }

    /// Check every invariant of the module docs; the first broken one as text.
    #[cfg(test)]
    pub fn check(&self) -> Result<(), String> {
        let mut pos = 0;
        let mut prev_free = false;
        let mut used = 0;
        let mut nfree = 0;
        for (&off, &(size, free)) in &self.chunks {
            if off != pos {
                return Err(format!("gap or overlap at {off} (expected {pos})"));
            }
            if size == 0 || size % ALIGN != 0 {
                return Err(format!("chunk at {off} has size {size}"));
            }
            if free && prev_free {
                return Err(format!("two adjacent free chunks at {off}"));
            }
            if free {
                nfree += 1;
                if !self.bins[bin_of(size)].contains(&(size, off)) {
                    return Err(format!("free chunk at {off} not in its bin"));
                }
            } else {
                used += size;
            }
            prev_free = free;
            pos = off + size;
        }
        if pos != self.end {
            return Err(format!("chunks end at {pos}, region at {}", self.end));
        }
        if used != self.used {
            return Err(format!("used {used} vs counted {}", self.used));
        }
        if self.bins.iter().map(BTreeSet::len).sum::<usize>() != nfree {
            return Err("a bin holds a chunk that is not free".into());
        }
        Ok(())
    }
}

/// First fit without coalescing, for comparison only: free chunks are kept as they were
/// freed, in address order; a request takes the first that is large enough (split), else
/// grows the region.
#[derive(Debug, Default)]
pub struct FirstFit {
    free: BTreeMap<u64, u64>,
    /// size -> how many free chunks have it: skips the scan when none is large enough.
    sizes: BTreeMap<u64, u64>,
    used: BTreeMap<u64, u64>,
    end: u64,
}

impl FirstFit {
    pub fn end(&self) -> u64 {
        self.end
    }

    pub fn alloc(&mut self, size: u64) -> Option<(u64, u64)> {
        let size = round(size)?;
        let fits = self.sizes.last_key_value().is_some_and(|(&s, _)| s >= size);
        let hit = fits
            .then(|| self.free.iter().find(|(_, &s)| s >= size))
            .flatten()
            .map(|(&o, &s)| (o, s));
        let off = match hit {
            Some((o, s)) => {
                self.free.remove(&o);
                self.count(s, false);
                if s > size {
                    self.free.insert(o + size, s - size);
                    self.count(s - size, true);
                }
                o
            }
            None => {
                let o = self.end;
                self.end = self.end.checked_add(size)?;
                o
            }
        };
        self.used.insert(off, size);
        Some((off, size))
    }

    pub fn free(&mut self, off: u64) -> Option<u64> {
        let size = self.used.remove(&off)?;
        self.free.insert(off, size);
        self.count(size, true);
        Some(size)
    }

    fn count(&mut self, size: u64, add: bool) {
        let n = self.sizes.entry(size).or_insert(0);
        if add {
            *n += 1;
        } else {
            *n -= 1;
            if *n == 0 {
                self.sizes.remove(&size);
            }
        }
    }
}

/// What [`simulate`] measured.
#[derive(Debug, Clone, Copy)]
pub struct SimStats {
    pub ops: u64,
    pub peak_live: u64,
    pub peak_end: u64,
}

/// A small deterministic generator (splitmix64), for simulations and tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-uniform in `[lo, hi]`.
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        ((a + (b - a) * self.unit()).exp() as u64).clamp(lo, hi)
    }
}

/// `ops` random put/free operations: sizes log-uniform in `[lo, hi]`; while fewer than
/// `live_target` objects are live a put is twice as likely as a free, above it a free is; a
/// free picks a uniformly random live object. `best_fit` picks [`Bfc`], else [`FirstFit`].
/// Returns the peak of the live bytes (as requested) and of the region's end.
pub fn simulate(
    best_fit: bool,
    ops: u64,
    lo: u64,
    hi: u64,
    live_target: usize,
    seed: u64,
) -> SimStats {
    let mut rng = Rng(seed);
    let mut bfc = Bfc::new(u64::MAX);
    let mut ff = FirstFit::default();
    let mut live: Vec<(u64, u64)> = Vec::new();
    let (mut live_bytes, mut peak_live, mut peak_end) = (0u64, 0u64, 0u64);
    for _ in 0..ops {
        let p_put = if live.len() < live_target {
            2.0 / 3.0
        } else {
            1.0 / 3.0
        };
        if live.is_empty() || rng.unit() < p_put {
            let size = rng.log_uniform(lo, hi);
            let got = if best_fit {
                bfc.alloc(size)
            } else {
                ff.alloc(size)
            };
            let (off, _) = got.expect("an unbounded region always fits");
            live.push((off, size));
            live_bytes += size;
        } else {
            let i = (rng.next_u64() % live.len() as u64) as usize;
            let (off, size) = live.swap_remove(i);
            if best_fit {
                bfc.free(off);
            } else {
                ff.free(off);
            }
            live_bytes -= size;
        }
        peak_live = peak_live.max(live_bytes);
        peak_end = peak_end.max(if best_fit { bfc.end() } else { ff.end() });
    }
    SimStats {
        ops,
        peak_live,
        peak_end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_reuse_and_coalesce() {
        let mut a = Bfc::new(1 << 20);
        let (x, _) = a.alloc(100).unwrap();
        let (y, ys) = a.alloc(1000).unwrap();
        let (z, _) = a.alloc(64).unwrap();
        assert_eq!((x, y, ys, z), (0, 128, 1024, 1152));
        a.free(y).unwrap();
        // Best fit: the 1024-byte hole takes a 500-byte request, split.
        assert_eq!(a.alloc(500), Some((128, 512)));
        a.check().unwrap();
        a.free(128).unwrap();
        a.free(x).unwrap();
        // x and the hole merged into one free chunk of 128 + 1024 bytes.
        assert_eq!(a.best_fit(1), Some((1152, 0)));
        a.free(z).unwrap();
        // Everything merged: one free chunk covering the region.
        assert_eq!(a.chunks.len(), 1);
        assert_eq!(a.used(), 0);
        a.check().unwrap();
        assert_eq!(a.free(z), None, "double free is refused");
    }

    #[test]
    fn shrink_frees_the_tail_and_merges_it() {
        let mut a = Bfc::new(1 << 20);
        let (x, _) = a.alloc(4096).unwrap();
        let (y, _) = a.alloc(4096).unwrap();
        let (z, _) = a.alloc(64).unwrap();
        a.free(z).unwrap();
        // The last chunk: its tail merges with the free space after it.
        assert_eq!(a.shrink(y, 100), Some(128));
        a.check().unwrap();
        assert_eq!(a.best_fit(1), Some((4096 - 128 + 64, y + 128)));
        // A middle chunk: its tail is a free chunk of its own.
        assert_eq!(a.shrink(x, 1000), Some(1024));
        a.check().unwrap();
        assert_eq!(a.used(), 1024 + 128);
        assert_eq!(a.alloc(3072), Some((1024, 3072)), "the tail is reused");
        // Refused: larger than the chunk, zero, free space, no chunk there.
        assert_eq!(a.shrink(x, 2048), None);
        assert_eq!(a.shrink(x, 0), None);
        assert_eq!(a.shrink(y + 128, 64), None);
        assert_eq!(a.shrink(7, 64), None);
        a.check().unwrap();
    }

    #[test]
    fn capacity_is_a_hard_limit() {
        let mut a = Bfc::new(1024);
        assert!(a.alloc(1024).is_some());
        assert!(a.alloc(1).is_none());
        assert!(a.alloc(0).is_none());
        assert!(a.alloc(u64::MAX).is_none());
        a.free(0).unwrap();
        assert_eq!(a.alloc(512), Some((0, 512)));
        assert_eq!(a.alloc(512), Some((512, 512)));
        a.check().unwrap();
    }

    /// Property test: random operations against a brute-force model. After every step the
    /// tiling/coalescing/bin invariants hold, every allocation is the smallest free chunk
    /// that fits (lowest offset among equals) or the region's growth when none fits, and no
    /// two live allocations overlap.
    #[test]
    fn random_ops_keep_best_fit_and_coalescing_invariants() {
        for seed in 0..40u64 {
            let mut rng = Rng(seed);
            let cap = 1 << 22;
            let mut a = Bfc::new(cap);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for _ in 0..600 {
                if live.is_empty() || rng.unit() < 0.55 {
                    let want = rng.log_uniform(1, 1 << 16);
                    let size = round(want).unwrap();
                    // The model's answer: the smallest free chunk that fits.
                    let expect = a
                        .chunks
                        .iter()
                        .filter(|(_, &(s, f))| f && s >= size)
                        .map(|(&o, &(s, _))| (s, o))
                        .min();
                    match a.alloc(want) {
                        Some((off, got)) => {
                            assert_eq!(got, size);
                            match expect {
                                Some((_, o)) => assert_eq!(off, o, "seed {seed}: not best fit"),
                                None => assert!(off + size == a.end(), "seed {seed}: no growth"),
                            }
                            for &(o, s) in &live {
                                assert!(off + size <= o || o + s <= off, "overlap");
                            }
                            // Sometimes written shorter than reserved: shrunk at once.
                            let size = if rng.unit() < 0.3 {
                                let to = round(rng.log_uniform(1, size)).unwrap();
                                assert_eq!(a.shrink(off, to), Some(to));
                                to
                            } else {
                                size
                            };
                            live.push((off, size));
                        }
                        None => assert!(expect.is_none(), "seed {seed}: a fitting chunk missed"),
                    }
                } else {
                    let i = (rng.next_u64() % live.len() as u64) as usize;
                    let (off, size) = live.swap_remove(i);
                    assert_eq!(a.free(off), Some(size));
                }
                if let Err(e) = a.check() {
                    panic!("seed {seed}: {e}");
                }
                assert_eq!(a.used(), live.iter().map(|l| l.1).sum::<u64>());
            }
            for (off, _) in live.drain(..) {
                a.free(off).unwrap();
            }
            a.check().unwrap();
            assert!(a.chunks.len() <= 1, "all free chunks merged into one");
        }
    }

    #[test]
    fn first_fit_without_coalescing_fragments_more() {
        let b = simulate(true, 50_000, 64, 1 << 20, 200, 7);
        let f = simulate(false, 50_000, 64, 1 << 20, 200, 7);
        assert_eq!(b.peak_live, f.peak_live, "same operations both ways");
        assert!(b.peak_end < f.peak_end, "{b:?} vs {f:?}");
    }
}
