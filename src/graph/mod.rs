//! Reachability in a snapshot of an object graph, decided the way CPython's cycle collector
//! decides it. Pure Rust (no pyo3): the binding layer (`src/py/graph.rs`) takes the snapshot
//! of Python objects; this module only sees numbers.
//!
//! Given, for each candidate node, how many references point at it from anywhere
//! (`refcounts`) and the edges between candidates (CSR `offsets`/`targets`), a node whose
//! refcount exceeds its in-degree from other candidates is referenced from outside the set
//! (a stack frame, an older object, a C global): it is alive, and so is everything it reaches.
//! The rest is unreachable: garbage that only reference cycles keep alive.

/// Indices of the nodes no externally referenced node reaches, in increasing order.
///
/// `refcounts[i]` counts every reference to node `i`; the edges of node `i` are
/// `targets[offsets[i]..offsets[i + 1]]` (one entry per reference, duplicates included,
/// as `tp_traverse` reports them).
///
/// # Panics
/// If `offsets` does not have `refcounts.len() + 1` non-decreasing entries ending at
/// `targets.len()`, or a target is out of range.
pub fn unreachable(refcounts: &[isize], offsets: &[usize], targets: &[u32]) -> Vec<usize> {
    let n = refcounts.len();
    assert_eq!(
        offsets.len(),
        n + 1,
        "offsets must have one entry per node plus one"
    );
    assert_eq!(
        offsets[n],
        targets.len(),
        "offsets must end at targets.len()"
    );
    let mut external = refcounts.to_vec();
    for &t in targets {
        external[t as usize] -= 1;
    }
    let mut reached = vec![false; n];
    let mut stack: Vec<usize> = Vec::new();
    for (i, &e) in external.iter().enumerate() {
        if e > 0 {
            reached[i] = true;
            stack.push(i);
        }
    }
    while let Some(v) = stack.pop() {
        for &w in &targets[offsets[v]..offsets[v + 1]] {
            let w = w as usize;
            if !reached[w] {
                reached[w] = true;
                stack.push(w);
            }
        }
    }
    (0..n).filter(|&i| !reached[i]).collect()
}

/// Node index by address: an open-addressing table (linear probing, load <= 1/2) of the
/// candidates' addresses. Most lookups are misses (referents that are not candidates: ints,
/// strings, types); a miss here ends at the first empty slot, one cache line, where a general
/// hash map would touch its control bytes and then a bucket.
pub struct AddrIndex {
    keys: Vec<usize>,
    values: Vec<u32>,
    shift: u32,
}

impl AddrIndex {
    /// Index `addrs[i] -> i`. Addresses must be non-zero; a repeated address keeps its first
    /// index.
    pub fn new(addrs: &[usize]) -> Self {
        let slots = (addrs.len() * 2).max(16).next_power_of_two();
        let mut index = AddrIndex {
            keys: vec![0; slots],
            values: vec![0; slots],
            shift: 64 - slots.trailing_zeros(),
        };
        for (i, &a) in addrs.iter().enumerate() {
            assert!(a != 0, "address 0 cannot be indexed");
            let mut s = index.slot(a);
            loop {
                let k = index.keys[s];
                if k == 0 {
                    index.keys[s] = a;
                    index.values[s] = i as u32;
                    break;
                }
                if k == a {
                    break;
                }
                s = (s + 1) & (slots - 1);
            }
        }
        index
    }

    #[inline]
    fn slot(&self, addr: usize) -> usize {
        // Objects are 16-byte aligned: drop the always-zero bits, then Fibonacci hashing.
        (((addr >> 4) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// The index of `addr`, if it was indexed.
    #[inline]
    pub fn get(&self, addr: usize) -> Option<u32> {
        let mask = self.keys.len() - 1;
        let mut s = self.slot(addr);
        loop {
            let k = self.keys[s];
            if k == addr {
                return Some(self.values[s]);
            }
            if k == 0 {
                return None;
            }
            s = (s + 1) & mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{unreachable, AddrIndex};

    #[test]
    fn addr_index_finds_what_it_holds_and_nothing_else() {
        let addrs: Vec<usize> = (1..5000).map(|i| i * 48).collect();
        let index = AddrIndex::new(&addrs);
        for (i, &a) in addrs.iter().enumerate() {
            assert_eq!(index.get(a), Some(i as u32));
        }
        assert_eq!(index.get(8), None);
        assert_eq!(index.get(5000 * 48), None);
        assert_eq!(AddrIndex::new(&[]).get(16), None);
    }

    /// Build CSR arrays from an adjacency list.
    fn csr(adj: &[&[u32]]) -> (Vec<usize>, Vec<u32>) {
        let mut offsets = vec![0];
        let mut targets = Vec::new();
        for edges in adj {
            targets.extend_from_slice(edges);
            offsets.push(targets.len());
        }
        (offsets, targets)
    }

    #[test]
    fn self_cycle_without_outside_reference_is_unreachable() {
        let (o, t) = csr(&[&[0]]);
        assert_eq!(unreachable(&[1], &o, &t), vec![0]);
    }

    #[test]
    fn cycle_with_outside_reference_is_alive_with_what_it_reaches() {
        // 0 <-> 1 (0 also referenced from a frame), 1 -> 2
        let (o, t) = csr(&[&[1], &[0, 2], &[]]);
        assert!(unreachable(&[2, 1, 1], &o, &t).is_empty());
    }

    #[test]
    fn garbage_keeps_what_hangs_off_it_unreachable_too() {
        // 0 <-> 1 is garbage and holds 2; 3 is alive (external) and points nowhere
        let (o, t) = csr(&[&[1], &[0, 2], &[], &[]]);
        assert_eq!(unreachable(&[1, 1, 1, 1], &o, &t), vec![0, 1, 2]);
    }

    #[test]
    fn duplicate_edges_count_once_each() {
        // 0 holds 1 twice (a list [x, x]) and 1 holds 0: refcounts match, all garbage
        let (o, t) = csr(&[&[1, 1], &[0]]);
        assert_eq!(unreachable(&[1, 2], &o, &t), vec![0, 1]);
        // one more reference to 1 from outside: everything alive
        assert!(unreachable(&[1, 3], &o, &t).is_empty());
    }

    #[test]
    fn alive_node_pointing_into_a_cycle_keeps_it() {
        // 2 is external and points to 0; 0 <-> 1
        let (o, t) = csr(&[&[1], &[0], &[0]]);
        assert!(unreachable(&[2, 1, 1], &o, &t).is_empty());
    }

    #[test]
    fn empty_graph() {
        assert!(unreachable(&[], &[0], &[]).is_empty());
    }
}
