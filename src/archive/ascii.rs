//! Reading a stored str into a new ASCII str (src/py/read, `ascii_str`): the bytes copied
//! and checked to be ASCII in one pass, the check made of what was written. A 1 KB
//! document's str so costs one pass over its bytes instead of a check, a copy and a check
//! of the copy (~950 instructions before; ~330 now with SSE2, ~170 with AVX2: callgrind,
//! 3.11).
// Its callers are in the Python layer's build for one interpreter (the stable ABI's build
// leaves strs to CPython's decoder); the tests call it in every build.
#![cfg_attr(any(not(feature = "python"), feature = "abi3"), allow(dead_code))]

/// The top bit of each byte of a word: a byte with it set is not ASCII.
pub const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// Copy `src` (a stored str's bytes) to `dst` and say whether every byte written is
/// ASCII. What is tested is what was written: each load is stored and tested from the same
/// register, and `src` is never read twice (it may lie in shared memory that another
/// process changes meanwhile). The ends of a short copy are two loads that overlap; a byte
/// of the overlap is written twice, both values tested.
///
/// # Safety
/// `dst` is valid for writes of `src.len()` bytes and does not overlap `src`.
#[inline(always)]
pub unsafe fn copy_ascii(src: &[u8], dst: *mut u8) -> bool {
    let (s, n) = (src.as_ptr(), src.len());
    // SAFETY: every load is of `src` (offsets below `n`, unaligned loads), every store of
    // `dst`, which the caller says holds `n` bytes.
    unsafe {
        if n > 16 {
            return copy_ascii_long(s, dst, n);
        }
        if n >= 8 {
            let (a, b) = (
                s.cast::<u64>().read_unaligned(),
                s.add(n - 8).cast::<u64>().read_unaligned(),
            );
            dst.cast::<u64>().write_unaligned(a);
            dst.add(n - 8).cast::<u64>().write_unaligned(b);
            return (a | b) & HIGH_BITS == 0;
        }
        if n >= 4 {
            let (a, b) = (
                s.cast::<u32>().read_unaligned(),
                s.add(n - 4).cast::<u32>().read_unaligned(),
            );
            dst.cast::<u32>().write_unaligned(a);
            dst.add(n - 4).cast::<u32>().write_unaligned(b);
            return (a | b) & HIGH_BITS as u32 == 0;
        }
        let mut all = 0u8;
        for i in 0..n {
            let c = s.add(i).read();
            dst.add(i).write(c);
            all |= c;
        }
        all.is_ascii()
    }
}

/// [`copy_ascii`] of more than 16 bytes: 32 at a time where the CPU has AVX2 (from 64
/// bytes on), else 16 at a time (SSE2, which every x86-64 has), the last load overlapping
/// those before; a word at a time elsewhere.
///
/// # Safety
/// As [`copy_ascii`]: `s` readable and `d` writable for `n > 16` bytes, not overlapping.
#[inline(never)]
unsafe fn copy_ascii_long(s: *const u8, d: *mut u8, n: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if n >= 64 && std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (just checked); the rest is the caller's promise.
            return unsafe { copy_ascii_avx2(s, d, n) };
        }
        // SAFETY: the caller's promise, `n > 16`.
        unsafe { copy_ascii_sse2(s, d, n) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: every load and store is of 8 bytes at an offset at most `n - 8`, unaligned.
    unsafe {
        let copy = |i: usize| -> u64 {
            let v = s.add(i).cast::<u64>().read_unaligned();
            d.add(i).cast::<u64>().write_unaligned(v);
            v
        };
        let mut all = 0u64;
        let mut i = 0;
        while i + 8 <= n {
            all |= copy(i);
            i += 8;
        }
        if i < n {
            all |= copy(n - 8);
        }
        all & HIGH_BITS == 0
    }
}

/// [`copy_ascii_long`] 16 bytes at a time.
///
/// # Safety
/// As [`copy_ascii`], with `n >= 16`.
#[cfg(target_arch = "x86_64")]
pub unsafe fn copy_ascii_sse2(s: *const u8, d: *mut u8, n: usize) -> bool {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_setzero_si128,
        _mm_storeu_si128,
    };
    // SAFETY: SSE2 is part of x86-64; every load and store is of 16 bytes at an offset at
    // most `n - 16`, unaligned.
    unsafe {
        let copy = |i: usize| -> __m128i {
            let v = _mm_loadu_si128(s.add(i).cast());
            _mm_storeu_si128(d.add(i).cast(), v);
            v
        };
        let mut all = _mm_setzero_si128();
        let mut i = 0;
        while i + 64 <= n {
            let (a, b, c, e) = (copy(i), copy(i + 16), copy(i + 32), copy(i + 48));
            all = _mm_or_si128(all, _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, e)));
            i += 64;
        }
        while i + 16 <= n {
            all = _mm_or_si128(all, copy(i));
            i += 16;
        }
        if i < n {
            all = _mm_or_si128(all, copy(n - 16));
        }
        _mm_movemask_epi8(all) == 0
    }
}

/// [`copy_ascii_long`] 32 bytes at a time.
///
/// # Safety
/// As [`copy_ascii`], with `n >= 32`, on a CPU with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub unsafe fn copy_ascii_avx2(s: *const u8, d: *mut u8, n: usize) -> bool {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_movemask_epi8, _mm256_or_si256, _mm256_setzero_si256,
        _mm256_storeu_si256,
    };
    // SAFETY: the CPU has AVX2 (the caller's promise); every load and store is of 32 bytes
    // at an offset at most `n - 32`, unaligned.
    unsafe {
        let copy = |i: usize| -> __m256i {
            let v = _mm256_loadu_si256(s.add(i).cast());
            _mm256_storeu_si256(d.add(i).cast(), v);
            v
        };
        let mut all = _mm256_setzero_si256();
        let mut i = 0;
        while i + 128 <= n {
            let (a, b, c, e) = (copy(i), copy(i + 32), copy(i + 64), copy(i + 96));
            all = _mm256_or_si256(
                all,
                _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, e)),
            );
            i += 128;
        }
        while i + 32 <= n {
            all = _mm256_or_si256(all, copy(i));
            i += 32;
        }
        if i < n {
            all = _mm256_or_si256(all, copy(n - 32));
        }
        _mm256_movemask_epi8(all) == 0
    }
}
