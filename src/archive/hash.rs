//! The format's checksum, xxh3-64 (seed 0, the default secret), of a whole buffer, with the
//! loop over long inputs in AVX2 when the CPU has it; and the copy of an array's payload
//! into an arena chunk, which computes that checksum on the way ([`copy_hashed`]).
//!
//! The xxhash-rust crate picks its vector width when it is compiled, and wheels are
//! compiled for the x86-64 baseline (SSE2, 16 bytes per instruction). An input longer than
//! 240 bytes (a block of records, a document, an array's payload) spends nearly all of its
//! time in xxh3's loop over 64-byte stripes; here that loop runs 32 bytes per instruction
//! when the CPU has AVX2 (asked once per process; every x86-64 CPU since 2013-2015 has it),
//! and every other input goes to the crate. Both give the same value for every input: the
//! tests compare them on every length across the algorithm's boundaries and on random data.
//!
//! The algorithm, from xxHash's specification (doc/xxhash_spec.md in Cyan4973/xxHash),
//! for an input of more than 240 bytes: eight 64-bit accumulators start from fixed primes;
//! each 64-byte stripe, read as eight words, is mixed into them with 8 bytes of secret
//! further along per stripe (`accumulate`); every 16 stripes (a block) the accumulators are
//! scrambled with the secret's last 64 bytes; the last stripe of the input is always mixed
//! in (it may overlap the one before); then the accumulators are merged and avalanched.
//!
//! [`copy_hashed`] stores each stripe to the destination right after loading it for the
//! hash, with non-temporal stores: the source is read once instead of twice (hash, then
//! copy), and the hash costs no more than the copy (a 64 KiB payload read from memory: ~3.5
//! µs for both, against ~5.3 µs for the crate's hash followed by the copy).

/// Inputs up to this many bytes take xxh3's short and middle paths (the crate's).
const MID_MAX: usize = 240;

/// xxh3-64 of `data` (seed 0, default secret): the same value as
/// `xxhash_rust::xxh3::xxh3_64(data)`, faster on long inputs when the CPU has AVX2.
#[inline]
pub fn xxh3_64(data: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if data.len() > MID_MAX && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (just checked), the only requirement of `long_avx2`.
        return unsafe { long_avx2(data) };
    }
    xxhash_rust::xxh3::xxh3_64(data)
}

/// xxh3-64 of `data` (as [`xxh3_64`]), computed in pieces of `piece` bytes: `each` is called
/// with every piece, in order, right after the piece is hashed, so a large payload is read
/// from memory once for both (the piece is still in cache when `each` writes it out). With
/// AVX2 the stripe loop is [`xxh3_64`]'s; otherwise the crate's streaming hasher.
pub fn xxh3_64_pieces<E>(
    data: &[u8],
    piece: usize,
    mut each: impl FnMut(&[u8]) -> Result<(), E>,
) -> Result<u64, E> {
    let piece = piece.max(1);
    #[cfg(target_arch = "x86_64")]
    if data.len() > MID_MAX && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (just checked), the only requirement of `long_pieces`.
        return unsafe { avx2::long_pieces(data, piece, each) };
    }
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    for p in data.chunks(piece) {
        h.update(p);
        each(p)?;
    }
    Ok(h.digest())
}

/// xxh3-64 of one buffer computed in steps that any thread may take in turn
/// ([`Resumable::advance`]), so that a payload's hashing can move from the thread that
/// writes it to a helper thread part-way (src/archive/builder.rs). The value is always
/// [`xxh3_64`]'s.
pub struct Resumable<'a> {
    data: &'a [u8],
    /// Bytes of `data` mixed in so far (whole blocks with AVX2, anything with the crate).
    done: usize,
    state: ResumableState,
}

enum ResumableState {
    /// Inputs of up to [`MID_MAX`] bytes: hashed whole at the end.
    Short,
    #[cfg(target_arch = "x86_64")]
    Avx2(avx2::Acc),
    Crate(Box<xxhash_rust::xxh3::Xxh3Default>),
}

impl<'a> Resumable<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        let state = if data.len() <= MID_MAX {
            ResumableState::Short
        } else {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (just checked).
                let acc = unsafe { avx2::Acc::new() };
                return Resumable {
                    data,
                    done: 0,
                    state: ResumableState::Avx2(acc),
                };
            }
            ResumableState::Crate(Box::default())
        };
        Resumable {
            data,
            done: 0,
            state,
        }
    }

    /// Mix in the input up to byte `upto` (at least; the AVX2 loop takes whole blocks).
    pub fn advance(&mut self, upto: usize) {
        let upto = upto.min(self.data.len());
        match &mut self.state {
            ResumableState::Short => {}
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the state exists only where the CPU has AVX2 (`new`), and the input
            // is longer than MID_MAX.
            ResumableState::Avx2(acc) => unsafe { acc.advance(self.data, upto) },
            ResumableState::Crate(h) => {
                if upto > self.done {
                    h.update(&self.data[self.done..upto]);
                    self.done = upto;
                }
            }
        }
    }

    /// The checksum (the rest of the input is mixed in first).
    pub fn finish(mut self) -> u64 {
        self.advance(self.data.len());
        match self.state {
            ResumableState::Short => xxhash_rust::xxh3::xxh3_64(self.data),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as in `advance`.
            ResumableState::Avx2(acc) => unsafe { acc.finish(self.data) },
            ResumableState::Crate(h) => h.digest(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// xxh3's default secret (its specification's `kSecret`).
    const SECRET: [u8; 192] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    ];
    const P32_1: u64 = 0x9E37_79B1;
    const P32_2: u64 = 0x85EB_CA77;
    const P32_3: u64 = 0xC2B2_AE3D;
    const P64_1: u64 = 0x9E37_79B1_85EB_CA87;
    const P64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P64_3: u64 = 0x1656_67B1_9E37_79F9;
    const P64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    const P64_5: u64 = 0x27D4_EB2F_1656_67C5;
    /// Bytes per stripe.
    const STRIPE: usize = 64;
    /// Stripes per block: the secret advances 8 bytes per stripe and a stripe reads 64.
    const STRIPES: usize = (SECRET.len() - STRIPE) / 8;
    const BLOCK: usize = STRIPE * STRIPES;
    /// Where the last stripe's secret starts (`SECRET.len() - STRIPE - 7`) and where the
    /// merge's does.
    const LAST_AT: usize = SECRET.len() - STRIPE - 7;
    const MERGE_AT: usize = 11;

    /// Mix the stripe at `input` into the accumulators with the secret at `secret`; with
    /// `COPY`, also store it to `dst` (non-temporal).
    ///
    /// # Safety
    /// AVX2; `input` and `secret` readable for 64 bytes; with `COPY`, `dst` 32-byte aligned
    /// and writable for 64 bytes, not overlapping `input`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn accumulate<const COPY: bool>(
        acc: &mut [__m256i; 2],
        input: *const u8,
        secret: *const u8,
        dst: *mut u8,
    ) {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: 32-byte unaligned loads inside the 64 readable bytes the caller
            // promises at each pointer (j is 0 or 1).
            let (d, k) = unsafe {
                (
                    _mm256_loadu_si256(input.add(32 * j).cast()),
                    _mm256_loadu_si256(secret.add(32 * j).cast()),
                )
            };
            if COPY {
                // SAFETY: a 32-byte aligned store inside the 64 writable bytes the caller
                // promises at `dst` (aligned: `dst` is, and 32 * j is a multiple of 32).
                unsafe { _mm256_stream_si256(dst.add(32 * j).cast(), d) };
            }
            // Per 64-bit lane i: acc[i] += lo32(d ^ k) * hi32(d ^ k), acc[i ^ 1] += d[i].
            let dk = _mm256_xor_si256(d, k);
            let product = _mm256_mul_epu32(dk, _mm256_srli_epi64::<32>(dk));
            let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(d);
            *a = _mm256_add_epi64(*a, _mm256_add_epi64(product, swapped));
        }
    }

    /// Scramble the accumulators with the secret at `secret` (after each block).
    ///
    /// # Safety
    /// AVX2; `secret` readable for 64 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scramble(acc: &mut [__m256i; 2], secret: *const u8) {
        let prime = _mm256_set1_epi32(P32_1 as i32);
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: a 32-byte unaligned load inside the 64 bytes the caller promises.
            let k = unsafe { _mm256_loadu_si256(secret.add(32 * j).cast()) };
            // acc = (acc ^ (acc >> 47) ^ k) * P32_1, the 64-bit product from two 32-bit ones.
            let x = _mm256_xor_si256(_mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a)), k);
            let lo = _mm256_mul_epu32(x, prime);
            let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), prime);
            *a = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
        }
    }

    /// xxh3-64 of an input of more than 240 bytes; with `COPY`, `data` is also copied to
    /// `dst` (the stripes with non-temporal stores, the last bytes plainly, then a store
    /// fence).
    ///
    /// # Safety
    /// The CPU has AVX2; with `COPY`, `dst` is 32-byte aligned and writable for
    /// `data.len()` bytes, not overlapping `data`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn long<const COPY: bool>(data: &[u8], dst: *mut u8) -> u64 {
        let len = data.len();
        debug_assert!(len > super::MID_MAX);
        let (p, s) = (data.as_ptr(), SECRET.as_ptr());
        // SAFETY: AVX2 is the caller's promise.
        let mut acc = unsafe { start() };
        // Whole blocks, then the stripes of the last, partial block: neither reaches the
        // input's last byte ((len - 1) / BLOCK blocks, then stripes ending at or before
        // len - 1); the last 64 bytes are mixed in on their own after them.
        let blocks = (len - 1) / BLOCK;
        let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
        // SAFETY: every stripe read lies in `data`: block n's stripes end
        // at (n + 1) * BLOCK <= blocks * BLOCK <= len - 1, the partial block's at
        // blocks * BLOCK + stripes * STRIPE <= len - 1, and the last stripe is
        // [len - 64, len) with len > 240. Every secret read lies in SECRET (192 bytes):
        // stripe i of a block reads [8i, 8i + 64) with i < STRIPES = 16 (at most 184), the
        // scramble [128, 192), the last stripe [121, 185). AVX2 is the caller's promise.
        // With COPY, stripe [o, o + 64) of `data` is stored to [o, o + 64) of `dst`, which
        // the caller vouches for (32-byte aligned since `dst` is and o is a multiple of 64);
        // the bytes after the last whole stripe, [done, len) with done <= len - 1 (as
        // above), are copied plainly, and the fence orders the streaming stores before any
        // later store (the chunk header, the unlock).
        unsafe {
            for n in 0..blocks {
                for i in 0..STRIPES {
                    let o = n * BLOCK + i * STRIPE;
                    accumulate::<COPY>(&mut acc, p.add(o), s.add(i * 8), dst.wrapping_add(o));
                }
                scramble(&mut acc, s.add(SECRET.len() - STRIPE));
            }
            for i in 0..stripes {
                let o = blocks * BLOCK + i * STRIPE;
                accumulate::<COPY>(&mut acc, p.add(o), s.add(i * 8), dst.wrapping_add(o));
            }
            accumulate::<false>(&mut acc, p.add(len - STRIPE), s.add(LAST_AT), dst);
            if COPY {
                let done = blocks * BLOCK + stripes * STRIPE;
                std::ptr::copy_nonoverlapping(p.add(done), dst.add(done), len - done);
                _mm_sfence();
            }
        }
        // SAFETY: AVX2 is the caller's promise.
        unsafe { finish(acc, len) }
    }

    /// [`long`] without COPY, over `data` in pieces of `piece` bytes: the whole blocks
    /// that end inside a piece are mixed in, then `each` gets the piece; the stripes after
    /// the last whole block and the input's last stripe (in the last piece, or reaching
    /// back into the one before it) once every piece is done.
    ///
    /// # Safety
    /// The CPU has AVX2; `data.len() > 240`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn long_pieces<E>(
        data: &[u8],
        piece: usize,
        mut each: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<u64, E> {
        let len = data.len();
        debug_assert!(len > super::MID_MAX && piece > 0);
        let (p, s) = (data.as_ptr(), SECRET.as_ptr());
        // SAFETY: AVX2 is the caller's promise.
        let mut acc = unsafe { start() };
        let blocks = (len - 1) / BLOCK;
        let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
        let mut n = 0;
        let mut start = 0;
        while start < len {
            let end = start.saturating_add(piece).min(len);
            // SAFETY: as in `long`: block n (< blocks) lies in [0, len - 1), and its secret
            // reads in SECRET; AVX2 is the caller's promise.
            unsafe {
                while n < blocks && (n + 1) * BLOCK <= end {
                    for i in 0..STRIPES {
                        let o = n * BLOCK + i * STRIPE;
                        accumulate::<false>(&mut acc, p.add(o), s.add(i * 8), std::ptr::null_mut());
                    }
                    scramble(&mut acc, s.add(SECRET.len() - STRIPE));
                    n += 1;
                }
            }
            each(&data[start..end])?;
            start = end;
        }
        // SAFETY: as in `long` (every block was mixed in above: block blocks - 1 ends at or
        // before len - 1, inside the last piece at the latest).
        unsafe {
            for i in 0..stripes {
                let o = blocks * BLOCK + i * STRIPE;
                accumulate::<false>(&mut acc, p.add(o), s.add(i * 8), std::ptr::null_mut());
            }
            accumulate::<false>(
                &mut acc,
                p.add(len - STRIPE),
                s.add(LAST_AT),
                std::ptr::null_mut(),
            );
        }
        // SAFETY: AVX2 is the caller's promise.
        Ok(unsafe { finish(acc, len) })
    }

    /// [`long_pieces`]'s state between pieces, for [`super::Resumable`]: the accumulators
    /// and how many whole blocks are mixed in.
    pub(super) struct Acc {
        acc: [__m256i; 2],
        blocks_done: usize,
    }

    impl Acc {
        /// # Safety
        /// The CPU has AVX2.
        pub(super) unsafe fn new() -> Acc {
            Acc {
                // SAFETY: the caller's promise.
                acc: unsafe { start() },
                blocks_done: 0,
            }
        }

        /// Mix in the whole blocks of `data` that end at or before `upto` (and before the
        /// input's last byte, as in `long_pieces`).
        ///
        /// # Safety
        /// The CPU has AVX2; `data.len() > 240`, the same `data` on every call.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn advance(&mut self, data: &[u8], upto: usize) {
            let len = data.len();
            let blocks = (len - 1) / BLOCK;
            let (p, s) = (data.as_ptr(), SECRET.as_ptr());
            while self.blocks_done < blocks && (self.blocks_done + 1) * BLOCK <= upto {
                let n = self.blocks_done;
                // SAFETY: as in `long_pieces`: block n (< blocks) lies in [0, len - 1).
                unsafe {
                    for i in 0..STRIPES {
                        let o = n * BLOCK + i * STRIPE;
                        accumulate::<false>(
                            &mut self.acc,
                            p.add(o),
                            s.add(i * 8),
                            std::ptr::null_mut(),
                        );
                    }
                    scramble(&mut self.acc, s.add(SECRET.len() - STRIPE));
                }
                self.blocks_done += 1;
            }
        }

        /// The hash, once every whole block is mixed in (`advance` to `data.len()`).
        ///
        /// # Safety
        /// As `advance`.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn finish(mut self, data: &[u8]) -> u64 {
            let len = data.len();
            // SAFETY: as `advance` (the caller's promise).
            unsafe { self.advance(data, len) };
            let blocks = (len - 1) / BLOCK;
            let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
            let (p, s) = (data.as_ptr(), SECRET.as_ptr());
            // SAFETY: as in `long_pieces` (every block is mixed in).
            unsafe {
                for i in 0..stripes {
                    let o = blocks * BLOCK + i * STRIPE;
                    accumulate::<false>(
                        &mut self.acc,
                        p.add(o),
                        s.add(i * 8),
                        std::ptr::null_mut(),
                    );
                }
                accumulate::<false>(
                    &mut self.acc,
                    p.add(len - STRIPE),
                    s.add(LAST_AT),
                    std::ptr::null_mut(),
                );
                finish(self.acc, len)
            }
        }
    }

    /// The accumulators' starting values.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn start() -> [__m256i; 2] {
        let init: [u64; 8] = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1];
        // SAFETY: `init` is 64 readable bytes.
        unsafe {
            [
                _mm256_loadu_si256(init.as_ptr().cast()),
                _mm256_loadu_si256(init.as_ptr().add(4).cast()),
            ]
        }
    }

    /// The hash of an input of `len` bytes whose stripes are all in `acc`.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn finish(acc: [__m256i; 2], len: usize) -> u64 {
        let mut a = [0u64; 8];
        // SAFETY: `a` is 64 writable bytes.
        unsafe {
            _mm256_storeu_si256(a.as_mut_ptr().cast(), acc[0]);
            _mm256_storeu_si256(a.as_mut_ptr().add(4).cast(), acc[1]);
        }
        merge(&a, (len as u64).wrapping_mul(P64_1))
    }

    /// The accumulators merged into one value, then avalanched.
    fn merge(a: &[u64; 8], start: u64) -> u64 {
        let word = |at: usize| u64::from_le_bytes(SECRET[at..at + 8].try_into().unwrap());
        let mut r = start;
        for i in 0..4 {
            let at = MERGE_AT + 16 * i;
            let m = (a[2 * i] ^ word(at)) as u128 * (a[2 * i + 1] ^ word(at + 8)) as u128;
            r = r.wrapping_add(m as u64 ^ (m >> 64) as u64);
        }
        r ^= r >> 37;
        r = r.wrapping_mul(0x1656_6791_9E37_79F9);
        r ^ (r >> 32)
    }
}

/// See [`avx2::long`] (hash only).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn long_avx2(data: &[u8]) -> u64 {
    // SAFETY: the caller's promise; without COPY `dst` is never used.
    unsafe { avx2::long::<false>(data, std::ptr::null_mut()) }
}

/// Copy `src` to `dst` and return `xxh3_64(src)`, reading `src` once: with AVX2 (and a
/// 32-byte aligned `dst`, as a payload in an arena chunk is) the hash's loop stores each
/// stripe as it goes; otherwise the hash, then [`stream_copy`]. The bytes at `dst` are
/// written with non-temporal stores where the platform has them and are in memory, in
/// order with every later store, when it returns.
///
/// # Safety
/// `dst` is writable for `src.len()` bytes, and the two ranges do not overlap.
pub unsafe fn copy_hashed(src: &[u8], dst: *mut u8) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if src.len() > MID_MAX && (dst as usize) % 32 == 0 && std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 (just checked), `dst` 32-byte aligned (just checked), writable for
        // `src.len()` bytes and not overlapping `src` (the caller's promise).
        return unsafe { avx2::long::<true>(src, dst) };
    }
    let sum = xxh3_64(src);
    // SAFETY: the caller's promise.
    unsafe { stream_copy(src.as_ptr(), dst, src.len()) };
    sum
}

/// Copy `len` bytes from `src` to `dst` with non-temporal stores where the platform has
/// them (x86-64: SSE2, always present), then a store fence, so the bytes are in memory, in
/// order with every store after the copy (the chunk header, the unlock); elsewhere a plain
/// copy. For bytes meant for other processes (an arena chunk): filling this process's
/// cache with them first would cost a read of every line written.
///
/// # Safety
/// As for `copy_nonoverlapping`: `src` readable and `dst` writable for `len` bytes, the
/// two ranges not overlapping.
pub unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64. Every load reads `src[i..i + 16]` and every store
    // writes `dst[i..i + 16]` with `i + 64 <= len` (the loop bound), inside the ranges the
    // caller vouches for; the stores are 16-byte aligned (after the `head` bytes copied
    // plainly), as `_mm_stream_si128` requires, the loads unaligned (`loadu`). The rest
    // (< 64 bytes) is copied plainly, and `_mm_sfence` orders the streaming stores before
    // any later store.
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = ((16 - (dst as usize) % 16) % 16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let a = _mm_loadu_si128(src.add(i).cast::<__m128i>());
            let b = _mm_loadu_si128(src.add(i + 16).cast::<__m128i>());
            let c = _mm_loadu_si128(src.add(i + 32).cast::<__m128i>());
            let d = _mm_loadu_si128(src.add(i + 48).cast::<__m128i>());
            _mm_stream_si128(dst.add(i).cast::<__m128i>(), a);
            _mm_stream_si128(dst.add(i + 16).cast::<__m128i>(), b);
            _mm_stream_si128(dst.add(i + 32).cast::<__m128i>(), c);
            _mm_stream_si128(dst.add(i + 48).cast::<__m128i>(), d);
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's promise.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes (splitmix64).
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = x;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u8
            })
            .collect()
    }

    #[test]
    fn every_length_across_the_boundaries_hashes_as_the_crate_does() {
        // Every length up to five blocks and a bit (the short and middle paths, the first
        // long inputs, stripes, partial and whole blocks), each at two offsets of one
        // buffer so that unaligned starts are covered too.
        let buf = bytes(5 * 1024 + 300, 1);
        for len in 0..=5 * 1024 + 200 {
            for off in [0, 13] {
                let d = &buf[off..off + len];
                assert_eq!(xxh3_64(d), xxhash_rust::xxh3::xxh3_64(d), "length {len}");
            }
        }
    }

    #[test]
    fn hashing_in_pieces_gives_the_crate_s_value_and_hands_over_every_piece_in_order() {
        let data = bytes(3 * 1024 * 1024 + 777, 5);
        let lens = [
            0,
            1,
            64,
            240,
            241,
            1023,
            1024,
            1025,
            2048,
            5000,
            1 << 20,
            data.len(),
        ];
        for &len in &lens {
            let input = &data[..len];
            for piece in [1, 64, 100, 1000, 1024, 4096, 1 << 20, usize::MAX] {
                if piece < 64 && len > 5000 {
                    continue; // a byte at a time over megabytes: slow, and no new case
                }
                let mut seen = Vec::with_capacity(len);
                let mut calls = 0;
                let sum = xxh3_64_pieces(input, piece, |p| {
                    assert!(!p.is_empty() && p.len() <= piece);
                    seen.extend_from_slice(p);
                    calls += 1;
                    Ok::<(), ()>(())
                })
                .unwrap();
                assert_eq!(
                    sum,
                    xxhash_rust::xxh3::xxh3_64(input),
                    "len {len} piece {piece}"
                );
                assert_eq!(seen, input, "len {len} piece {piece}");
                assert_eq!(calls, len.div_ceil(piece), "len {len} piece {piece}");
            }
        }
        // An error from `each` stops at once and is returned.
        let mut calls = 0;
        let r = xxh3_64_pieces(&data, 4096, |_| {
            calls += 1;
            if calls == 3 {
                Err("full")
            } else {
                Ok(())
            }
        });
        assert_eq!((r, calls), (Err("full"), 3));
    }

    #[test]
    fn long_random_inputs_hash_as_the_crate_does() {
        for (i, len) in [4096, 65_536, 65_537, 1 << 20, 3_000_001]
            .into_iter()
            .enumerate()
        {
            let d = bytes(len, 7 + i as u64);
            assert_eq!(xxh3_64(&d), xxhash_rust::xxh3::xxh3_64(&d), "length {len}");
        }
        // Words at the extremes (carries of the 32x32 products and of the sums).
        for fill in [0x00u8, 0xff, 0x80] {
            let d = vec![fill; 10_000];
            assert_eq!(
                xxh3_64(&d),
                xxhash_rust::xxh3::xxh3_64(&d),
                "fill {fill:#x}"
            );
        }
    }

    /// `copy_hashed` of `src` into a fresh 64-byte aligned buffer at `dst_off`: the copy
    /// and the hash, checked against the source and the crate.
    fn check_copy(src: &[u8], dst_off: usize) {
        let mut buf = vec![0xAAu8; src.len() + 128];
        let base = (64 - buf.as_ptr() as usize % 64) % 64 + dst_off;
        // SAFETY: `buf[base..base + src.len()]` is inside `buf` (128 spare bytes cover
        // `base` < 128) and does not overlap `src`, another allocation.
        let sum = unsafe { copy_hashed(src, buf.as_mut_ptr().add(base)) };
        let len = src.len();
        assert_eq!(
            sum,
            xxhash_rust::xxh3::xxh3_64(src),
            "length {len} at {dst_off}"
        );
        assert_eq!(
            &buf[base..base + len],
            src,
            "length {len} at {dst_off}: copy"
        );
        assert!(
            buf[..base].iter().all(|&b| b == 0xAA),
            "length {len}: wrote before"
        );
        assert!(
            buf[base + len..].iter().all(|&b| b == 0xAA),
            "length {len}: wrote after"
        );
    }

    #[test]
    fn copy_hashed_copies_and_hashes_as_the_crate_does_at_every_length() {
        // Aligned destinations take the fused loop (with AVX2), unaligned ones the hash
        // then the copy; sources at two offsets.
        let buf = bytes(5 * 1024 + 300, 5);
        for len in 0..=5 * 1024 + 200 {
            for (src_off, dst_off) in [(0, 0), (13, 0), (0, 8), (7, 32)] {
                check_copy(&buf[src_off..src_off + len], dst_off);
            }
        }
        for (i, len) in [65_536, 65_537, 1 << 20, 1_000_003].into_iter().enumerate() {
            check_copy(&bytes(len, 11 + i as u64), 0);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_resumable_hash_gives_the_crate_s_value_whatever_the_steps() {
        for (i, len) in [
            0usize,
            17,
            240,
            241,
            1023,
            1024,
            1025,
            65_536,
            1 << 20,
            3_000_001,
        ]
        .into_iter()
        .enumerate()
        {
            let d = bytes(len, i as u64 + 40);
            let want = xxhash_rust::xxh3::xxh3_64(&d);
            assert_eq!(Resumable::new(&d).finish(), want, "{len}: no step");
            for step in [1usize, 63, 1000, 1024, 4096, 1 << 20] {
                let mut h = Resumable::new(&d);
                let mut at = 0;
                while at < len {
                    at = (at + step).min(len);
                    h.advance(at);
                }
                assert_eq!(h.finish(), want, "{len} in steps of {step}");
            }
            // Part of it, then the rest at once (as when a helper thread takes over).
            let mut h = Resumable::new(&d);
            h.advance(len / 3);
            h.advance(len / 3);
            assert_eq!(h.finish(), want, "{len}: a third, then the rest");
        }
    }

    #[test]
    fn the_avx2_loop_is_the_one_tested_here() {
        // The comparisons above test the AVX2 loop only on a CPU that has AVX2; say so if
        // this one does not (they then compare the crate with itself).
        if !std::is_x86_feature_detected!("avx2") {
            eprintln!("this CPU has no AVX2: the AVX2 loop was not tested");
            return;
        }
        let d = bytes(1000, 3);
        // SAFETY: the CPU has AVX2 (checked above).
        assert_eq!(unsafe { long_avx2(&d) }, xxhash_rust::xxh3::xxh3_64(&d));
        let mut out = vec![0u8; 1000 + 32];
        let at = (32 - out.as_ptr() as usize % 32) % 32;
        // SAFETY: AVX2; `out[at..at + 1000]` is 32-byte aligned, writable and apart from `d`.
        let sum = unsafe { avx2::long::<true>(&d, out.as_mut_ptr().add(at)) };
        assert_eq!(
            (sum, &out[at..at + 1000]),
            (xxhash_rust::xxh3::xxh3_64(&d), &d[..])
        );
    }
}
