//! Read side: the store used straight from a read-only memory map, no parsing beyond the header.
//!
//! Safety model: every section range is validated once at open (inside the file, aligned, sizes consistent
//! with the header counts). Per-node child ranges read from the file are clamped at use, so a corrupted
//! file can give wrong probabilities but never an out-of-bounds access or a panic. `verify()` checks the
//! full checksums and the structure (monotone offsets, sorted siblings) on demand.
use std::fs::File;
use std::ops::Range;
use std::path::Path;

use memmap2::Mmap;

use super::error::{corrupt, Result};
use super::format::{
    rd32, rd64, xxh64, Header, Packing, Section, HEADER_LEN, SECTIONS, SECTION_NAMES,
};
use crate::model::NextTokenModel;

enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    #[inline]
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A level-2 or level-3 node: its index in its level and its exact count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Node {
    pub index: usize,
    pub count: u64,
}

pub struct NgramStore {
    data: Backing,
    header: Header,
    packing: Packing,
    ranges: [Range<usize>; SECTIONS.len()],
    n2: usize,
    n3: usize,
}

impl NgramStore {
    /// Opens a store file. Cost is O(1) in the file size: the header is validated, nothing else is read.
    pub fn open(path: impl AsRef<Path>) -> Result<NgramStore> {
        let file = File::open(path.as_ref())?;
        // SAFETY: the map is read-only (PROT_READ, MAP_SHARED), so this process never writes through it and
        // all processes share one page-cache copy. The remaining hazard of any file mmap is another process
        // truncating or rewriting the file while it is mapped (SIGBUS / changing bytes). Store files are
        // written once to a temporary name and atomically renamed into place by our writer, never modified
        // in place; replacing a store means a new inode, which leaves existing maps intact. Changing bytes
        // under us could only yield wrong counts: every access is bounds-checked against ranges validated
        // at open, which do not depend on the mapped bytes after this point.
        let map = unsafe { Mmap::map(&file)? };
        #[cfg(unix)]
        {
            // Queries are random look-ups: tell the kernel not to read ahead large chunks.
            let _ = map.advise(memmap2::Advice::Random);
        }
        Self::from_backing(Backing::Mmap(map))
    }

    /// Builds a store over bytes already in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<NgramStore> {
        Self::from_backing(Backing::Owned(bytes))
    }

    fn from_backing(data: Backing) -> Result<NgramStore> {
        let bytes = data.bytes();
        let header = Header::decode(bytes)?;
        let ranges = std::array::from_fn(|i| {
            let s = header.sections[i];
            s.offset as usize..(s.offset + s.len) as usize
        });
        let n2 = usize::try_from(header.n2).or_else(|_| corrupt("n2 exceeds address space"))?;
        let n3 = usize::try_from(header.n3).or_else(|_| corrupt("n3 exceeds address space"))?;
        let store = NgramStore {
            packing: Packing::new(header.token_bits),
            header,
            data,
            ranges,
            n2,
            n3,
        };
        // Cheap O(1) end-point checks of the CSR arrays.
        let v = store.header.vocab_size as usize;
        if rd64(store.sec(Section::L1Off), 0) != 0
            || rd64(store.sec(Section::L1Off), v) != store.header.n2
        {
            return corrupt("level-1 offsets do not span the level-2 array");
        }
        if store.l2_child(0) != 0 || store.l2_child(n2) != store.header.n3 {
            return corrupt("level-2 offsets do not span the level-3 array");
        }
        Ok(store)
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn file_bytes(&self) -> u64 {
        self.header.file_len
    }

    pub fn vocab_size(&self) -> u64 {
        self.header.vocab_size
    }

    #[inline]
    fn sec(&self, s: Section) -> &[u8] {
        // Ranges were validated against the file length at open.
        &self.data.bytes()[self.ranges[s as usize].clone()]
    }

    #[inline]
    fn l2_child(&self, i: usize) -> u64 {
        let b = self.sec(Section::L2Child);
        if self.header.l2_off_width == 4 {
            rd32(b, i) as u64
        } else {
            rd64(b, i)
        }
    }

    /// Unigram count C(a); 0 for unseen or out-of-range tokens.
    #[inline]
    pub fn unigram_count(&self, a: u32) -> u64 {
        if (a as u64) < self.header.vocab_size {
            rd64(self.sec(Section::L1Cnt), a as usize)
        } else {
            0
        }
    }

    /// Level-2 index range of the children of token `a` (clamped: never outside the level-2 array).
    #[inline]
    fn l1_children(&self, a: u32) -> Range<usize> {
        if (a as u64) >= self.header.vocab_size {
            return 0..0;
        }
        let b = self.sec(Section::L1Off);
        clamp(rd64(b, a as usize), rd64(b, a as usize + 1), self.n2)
    }

    #[inline]
    fn l2_children(&self, i: usize) -> Range<usize> {
        if i >= self.n2 {
            return 0..0;
        }
        clamp(self.l2_child(i), self.l2_child(i + 1), self.n3)
    }

    /// Binary search of `token` among the packed words `range` of `words`; returns the word's index.
    #[inline]
    fn find(&self, words: &[u8], range: Range<usize>, token: u32) -> Option<(usize, u32)> {
        let cb = self.packing.count_bits;
        if cb < 32 && (token as u64) >= (1u64 << (32 - cb)) {
            return None;
        }
        let key = token << cb;
        let (mut lo, mut hi) = (range.start, range.end);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if rd32(words, mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo < range.end {
            let w = rd32(words, lo);
            if self.packing.token(w) == token {
                return Some((lo, w));
            }
        }
        None
    }

    fn exact_count(&self, ovf: Section, index: usize, w: u32) -> u64 {
        let c = self.packing.count(w);
        if c != self.packing.escape {
            return c as u64;
        }
        let b = self.sec(ovf);
        let (mut lo, mut hi) = (0usize, b.len() / 16);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if rd64(b, 2 * mid) < index as u64 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo < b.len() / 16 && rd64(b, 2 * lo) == index as u64 {
            rd64(b, 2 * lo + 1)
        } else {
            c as u64 // corrupt file: fall back to the saturated value
        }
    }

    /// The level-2 node for the bigram `a b`.
    #[inline]
    pub fn bigram(&self, a: u32, b: u32) -> Option<Node> {
        let words = self.sec(Section::L2Words);
        let (i, w) = self.find(words, self.l1_children(a), b)?;
        Some(Node {
            index: i,
            count: self.exact_count(Section::Ovf2, i, w),
        })
    }

    /// The level-3 node for `c` under the level-2 node `parent`.
    #[inline]
    pub fn trigram_child(&self, parent: Node, c: u32) -> Option<Node> {
        let words = self.sec(Section::L3Words);
        let (i, w) = self.find(words, self.l2_children(parent.index), c)?;
        Some(Node {
            index: i,
            count: self.exact_count(Section::Ovf3, i, w),
        })
    }

    /// Count of any 1-, 2- or 3-gram (0 if absent or pruned).
    pub fn count(&self, ngram: &[u32]) -> u64 {
        match *ngram {
            [a] => self.unigram_count(a),
            [a, b] => self.bigram(a, b).map_or(0, |n| n.count),
            [a, b, c] => self
                .bigram(a, b)
                .and_then(|n| self.trigram_child(n, c))
                .map_or(0, |n| n.count),
            _ => 0,
        }
    }

    /// All continuations of `ctx` at one level: (token, count) pairs and the context count.
    fn bigram_continuations(&self, b: u32) -> (Vec<(u32, u64)>, u64) {
        let r = self.l1_children(b);
        let words = self.sec(Section::L2Words);
        let v = r.map(|i| {
            let w = rd32(words, i);
            (self.packing.token(w), self.exact_count(Section::Ovf2, i, w))
        });
        (v.collect(), self.unigram_count(b))
    }

    fn trigram_continuations(&self, ctx: Node) -> Vec<(u32, u64)> {
        let words = self.sec(Section::L3Words);
        self.l2_children(ctx.index)
            .map(|i| {
                let w = rd32(words, i);
                (self.packing.token(w), self.exact_count(Section::Ovf3, i, w))
            })
            .collect()
    }

    /// The `k` most likely next tokens under the back-off rule of [`NextTokenModel`], probability descending
    /// (ties by token id ascending).
    pub fn top_next(&self, prev2: Option<u32>, prev1: u32, k: usize) -> Vec<(u32, f32)> {
        let mut out: Vec<(u32, f32)> = Vec::new();
        let tri = prev2
            .and_then(|a| self.bigram(a, prev1))
            .filter(|n| n.count > 0);
        if let Some(ctx) = tri {
            for (t, c) in self.trigram_continuations(ctx) {
                out.push((t, prob(c, ctx.count)));
            }
        }
        let seen: std::collections::HashSet<u32> = out.iter().map(|p| p.0).collect();
        let (bi, cb) = self.bigram_continuations(prev1);
        for (t, c) in bi {
            if !seen.contains(&t) {
                out.push((t, prob(c, cb)));
            }
        }
        out.retain(|p| p.1 > 0.0);
        out.sort_unstable_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
        out.truncate(k);
        out
    }

    /// Full integrity check: section checksums, then the structure (monotone CSR offsets, strictly sorted
    /// sibling tokens within the vocabulary, consistent overflow tables, unigram total). O(file size).
    pub fn verify(&self) -> Result<()> {
        for (i, s) in SECTIONS.iter().enumerate() {
            if xxh64(self.sec(*s), 0) != self.header.sections[i].checksum {
                return corrupt(format!("checksum mismatch in section {}", SECTION_NAMES[i]));
            }
        }
        let v = self.header.vocab_size as usize;
        let l1 = self.sec(Section::L1Off);
        let mut prev = 0u64;
        let (mut total, mut n1) = (0u64, 0u64);
        for a in 0..v {
            let (s, e) = (rd64(l1, a), rd64(l1, a + 1));
            if s != prev || e < s {
                return corrupt(format!("level-1 offsets not monotone at token {a}"));
            }
            prev = e;
            self.check_siblings(Section::L2Words, s as usize..e as usize, 2)?;
            let c = self.unigram_count(a as u32);
            total = total
                .checked_add(c)
                .map_or_else(|| corrupt("unigram total overflows"), Ok)?;
            n1 += (c > 0) as u64;
        }
        if total != self.header.total_tokens || n1 != self.header.n1 {
            return corrupt("unigram totals do not match the header");
        }
        let mut prev = 0u64;
        for i in 0..self.n2 {
            let (s, e) = (self.l2_child(i), self.l2_child(i + 1));
            if s != prev || e < s {
                return corrupt(format!("level-2 offsets not monotone at node {i}"));
            }
            prev = e;
            self.check_siblings(Section::L3Words, s as usize..e as usize, 3)?;
        }
        for (ovf, words, n) in [
            (Section::Ovf2, Section::L2Words, self.n2),
            (Section::Ovf3, Section::L3Words, self.n3),
        ] {
            let b = self.sec(ovf);
            let mut last: Option<u64> = None;
            for j in 0..b.len() / 16 {
                let (idx, cnt) = (rd64(b, 2 * j), rd64(b, 2 * j + 1));
                let ok = idx < n as u64
                    && last.is_none_or(|l| idx > l)
                    && self.packing.count(rd32(self.sec(words), idx as usize))
                        == self.packing.escape
                    && cnt >= self.packing.escape as u64;
                if !ok {
                    return corrupt(format!(
                        "overflow table {} inconsistent at entry {j}",
                        SECTION_NAMES[ovf as usize]
                    ));
                }
                last = Some(idx);
            }
        }
        Ok(())
    }

    fn check_siblings(&self, s: Section, r: Range<usize>, level: u32) -> Result<()> {
        let words = self.sec(s);
        let mut last: Option<u32> = None;
        for i in r {
            let w = rd32(words, i);
            let t = self.packing.token(w);
            if (t as u64) >= self.header.vocab_size
                || self.packing.count(w) == 0
                || last.is_some_and(|l| t <= l)
            {
                return corrupt(format!(
                    "level-{level} node {i}: token unsorted, out of range, or zero count"
                ));
            }
            last = Some(t);
        }
        Ok(())
    }

    /// Touches every page of the file (for resident-size measurements and cache warming); returns a
    /// checksum-like value so the reads are not optimised away.
    pub fn touch_all(&self) -> u64 {
        let b = self.data.bytes();
        let mut acc = 0u64;
        let mut i = 0;
        while i < b.len() {
            acc = acc.wrapping_add(b[i] as u64);
            i += 4096;
        }
        acc
    }

    /// Header bytes (for tools that want to print or copy it).
    pub fn header_bytes(&self) -> &[u8] {
        &self.data.bytes()[..HEADER_LEN]
    }
}

#[inline]
fn clamp(s: u64, e: u64, n: usize) -> Range<usize> {
    if s <= e && e <= n as u64 {
        s as usize..e as usize
    } else {
        0..0 // corrupt offsets: treat as no children
    }
}

#[inline]
fn prob(c: u64, ctx: u64) -> f32 {
    if ctx == 0 {
        0.0
    } else {
        (c as f64 / ctx as f64) as f32
    }
}

impl NextTokenModel for NgramStore {
    fn next_probs(&self, prev2: Option<u32>, prev1: u32, tokens: &[u32], out: &mut [f32]) {
        let n = tokens.len().min(out.len());
        // Context walks happen once; each query token is then one or two binary searches.
        let tri = prev2.and_then(|a| self.bigram(a, prev1));
        let uni = self.unigram_count(prev1);
        let l1 = self.l1_children(prev1);
        let l2w = self.sec(Section::L2Words);
        for i in 0..n {
            let t = tokens[i];
            if let Some(ctx) = tri {
                if let Some(node) = self.trigram_child(ctx, t) {
                    out[i] = prob(node.count, ctx.count);
                    continue;
                }
            }
            out[i] = match self.find(l2w, l1.clone(), t) {
                Some((j, w)) => prob(self.exact_count(Section::Ovf2, j, w), uni),
                None => 0.0,
            };
        }
    }
}
