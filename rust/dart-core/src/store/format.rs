//! On-disk layout of the DART 3-gram store (see `STORE_FORMAT.md`): header encode/decode, section table,
//! packed `(token, count)` words, little-endian accessors and the XXH64 checksum.
use super::error::{corrupt, invalid, Result, StoreError};

pub const MAGIC: [u8; 8] = *b"DARTNGRM";
pub const VERSION: u32 = 1;
pub const ORDER: u32 = 3;
/// Fixed header length: 104 bytes of fields, 7 × 24 bytes of section table, 8 bytes header checksum.
pub const HEADER_LEN: usize = TABLE_AT + NUM_SECTIONS * 24 + 8;
const TABLE_AT: usize = 104;
/// Largest vocabulary the format accepts: leaves at least 4 bits for the inline count.
pub const MAX_VOCAB: u64 = 1 << 28;
/// Sections start on 8-byte boundaries (cheap, and keeps the layout usable by zero-copy readers).
pub const ALIGN: u64 = 8;

pub const NUM_SECTIONS: usize = 7;
/// Section order in the table (also the order in which the writer lays them out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// `u64[V+1]`: L2 child range of every token (level 1 indexed directly by token id).
    L1Off = 0,
    /// `u64[V]`: unigram count C(a).
    L1Cnt = 1,
    /// `u32[n2]`: packed (token b, count C(ab)) of level-2 nodes, sorted by (a, b).
    L2Words = 2,
    /// `u32[n2+1]` or `u64[n2+1]` (see `l2_off_width`): L3 child range of every level-2 node.
    L2Child = 3,
    /// `u32[n3]`: packed (token c, count C(abc)) of level-3 nodes, sorted by (a, b, c).
    L3Words = 4,
    /// `(u64 index, u64 count)[]` sorted by index: exact counts of level-2 nodes whose inline count saturated.
    Ovf2 = 5,
    /// Same for level-3 nodes.
    Ovf3 = 6,
}

pub const SECTION_NAMES: [&str; NUM_SECTIONS] = [
    "l1_off", "l1_cnt", "l2_words", "l2_child", "l3_words", "ovf2", "ovf3",
];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SectionEntry {
    pub offset: u64,
    pub len: u64,
    /// XXH64 (seed 0) of the section bytes; checked only by `verify()`, not at open.
    pub checksum: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub order: u32,
    /// Bits of the token id inside a packed word; the low `32 - token_bits` bits hold the count.
    pub token_bits: u32,
    /// 4 or 8: width of the `L2Child` offsets (4 while n3 < 2^32).
    pub l2_off_width: u32,
    pub vocab_size: u64,
    pub tokenizer_fingerprint: u64,
    /// Sum of unigram counts = number of counted tokens (the reference's root count), 64-bit.
    pub total_tokens: u64,
    /// Tokens with a non-zero unigram count.
    pub n1: u64,
    pub n2: u64,
    pub n3: u64,
    /// `--min-count` used at build time (1 = nothing pruned). Informational.
    pub min_count: u64,
    pub flags: u64,
    /// Whole file length; a mismatch with the real length means truncation/extension.
    pub file_len: u64,
    pub sections: [SectionEntry; NUM_SECTIONS],
}

/// Header flag: built by importing a reference `.trie` file.
pub const FLAG_IMPORTED: u64 = 1;

pub fn token_bits_for(vocab_size: u64) -> u32 {
    let max_id = vocab_size.saturating_sub(1);
    (64 - max_id.leading_zeros()).max(1)
}

/// Packing of a level-2/3 node into one u32: token in the high bits so that words sorted by value are
/// sorted by token (siblings have distinct tokens), count in the low bits, saturating at `escape`.
#[derive(Clone, Copy, Debug)]
pub struct Packing {
    pub count_bits: u32,
    /// All-ones count: the exact count lives in the overflow section.
    pub escape: u32,
}

impl Packing {
    pub fn new(token_bits: u32) -> Packing {
        let count_bits = 32 - token_bits;
        Packing {
            count_bits,
            escape: ((1u64 << count_bits) - 1) as u32,
        }
    }
    #[inline]
    pub fn pack(&self, token: u32, count: u64) -> u32 {
        (token << self.count_bits) | (count.min(self.escape as u64) as u32)
    }
    #[inline]
    pub fn token(&self, w: u32) -> u32 {
        w >> self.count_bits
    }
    #[inline]
    pub fn count(&self, w: u32) -> u32 {
        w & self.escape
    }
}

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Reads a little-endian u32 at element index `i`; out-of-range reads give 0 instead of panicking.
#[inline]
pub fn rd32(b: &[u8], i: usize) -> u32 {
    match i.checked_mul(4).and_then(|o| b.get(o..o + 4)) {
        Some(s) => u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        None => 0,
    }
}

/// Reads a little-endian u64 at element index `i`; out-of-range reads give 0.
#[inline]
pub fn rd64(b: &[u8], i: usize) -> u64 {
    match i.checked_mul(8).and_then(|o| b.get(o..o + 8)) {
        Some(s) => u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]),
        None => 0,
    }
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        put_u32(&mut b, 8, self.version);
        put_u32(&mut b, 12, HEADER_LEN as u32);
        put_u32(&mut b, 16, self.order);
        put_u32(&mut b, 20, self.token_bits);
        put_u64(&mut b, 24, self.vocab_size);
        put_u64(&mut b, 32, self.tokenizer_fingerprint);
        put_u64(&mut b, 40, self.total_tokens);
        put_u64(&mut b, 48, self.n1);
        put_u64(&mut b, 56, self.n2);
        put_u64(&mut b, 64, self.n3);
        put_u64(&mut b, 72, self.min_count);
        put_u32(&mut b, 80, self.l2_off_width);
        put_u32(&mut b, 84, 0); // reserved
        put_u64(&mut b, 88, self.flags);
        put_u64(&mut b, 96, self.file_len);
        for (i, s) in self.sections.iter().enumerate() {
            let o = TABLE_AT + i * 24;
            put_u64(&mut b, o, s.offset);
            put_u64(&mut b, o + 8, s.len);
            put_u64(&mut b, o + 16, s.checksum);
        }
        let ck = xxh64(&b[..HEADER_LEN - 8], 0);
        put_u64(&mut b, HEADER_LEN - 8, ck);
        b
    }

    /// Parses and validates the header against the real file length. O(1): only the header is read.
    pub fn decode(b: &[u8]) -> Result<Header> {
        if b.len() < 16 {
            if b.len() >= 8 && b[0..8] != MAGIC {
                return Err(StoreError::BadMagic);
            }
            return corrupt(format!("file too short for a header ({} bytes)", b.len()));
        }
        if b[0..8] != MAGIC {
            return Err(StoreError::BadMagic);
        }
        let version = rd32(b, 2);
        if version != VERSION {
            return Err(StoreError::UnsupportedVersion(version));
        }
        let header_len = rd32(b, 3) as usize;
        if header_len != HEADER_LEN {
            return corrupt(format!("header length {header_len}, expected {HEADER_LEN}"));
        }
        if b.len() < HEADER_LEN {
            return corrupt(format!(
                "file truncated inside the header ({} bytes)",
                b.len()
            ));
        }
        let stored = u64::from_le_bytes(b[HEADER_LEN - 8..HEADER_LEN].try_into().unwrap_or([0; 8]));
        if xxh64(&b[..HEADER_LEN - 8], 0) != stored {
            return corrupt("header checksum mismatch");
        }
        let f64_at = |o: usize| rd64(&b[o..o + 8], 0);
        let mut sections = [SectionEntry::default(); NUM_SECTIONS];
        for (i, s) in sections.iter_mut().enumerate() {
            let o = TABLE_AT + i * 24;
            *s = SectionEntry {
                offset: f64_at(o),
                len: f64_at(o + 8),
                checksum: f64_at(o + 16),
            };
        }
        let h = Header {
            version,
            order: rd32(b, 4),
            token_bits: rd32(b, 5),
            vocab_size: f64_at(24),
            tokenizer_fingerprint: f64_at(32),
            total_tokens: f64_at(40),
            n1: f64_at(48),
            n2: f64_at(56),
            n3: f64_at(64),
            min_count: f64_at(72),
            l2_off_width: rd32(b, 20),
            flags: f64_at(88),
            file_len: f64_at(96),
            sections,
        };
        h.validate(b.len() as u64)?;
        Ok(h)
    }

    /// Expected byte length of every section given the counts in the header.
    pub fn expected_len(&self, s: Section) -> Option<u64> {
        let v = self.vocab_size;
        let w = self.l2_off_width as u64;
        match s {
            Section::L1Off => v.checked_add(1)?.checked_mul(8),
            Section::L1Cnt => v.checked_mul(8),
            Section::L2Words => self.n2.checked_mul(4),
            Section::L2Child => self.n2.checked_add(1)?.checked_mul(w),
            Section::L3Words => self.n3.checked_mul(4),
            Section::Ovf2 | Section::Ovf3 => None,
        }
    }

    fn validate(&self, real_len: u64) -> Result<()> {
        if self.order != ORDER {
            return corrupt(format!("order {} (only order 3 is supported)", self.order));
        }
        if self.vocab_size == 0 || self.vocab_size > MAX_VOCAB {
            return corrupt(format!(
                "vocab size {} out of range 1..={MAX_VOCAB}",
                self.vocab_size
            ));
        }
        if self.token_bits != token_bits_for(self.vocab_size) {
            return corrupt(format!(
                "token_bits {} does not match vocab size {}",
                self.token_bits, self.vocab_size
            ));
        }
        if self.l2_off_width != 4 && self.l2_off_width != 8 {
            return corrupt(format!(
                "l2_off_width {} (must be 4 or 8)",
                self.l2_off_width
            ));
        }
        if self.l2_off_width == 4 && self.n3 > u32::MAX as u64 {
            return corrupt("32-bit level-2 offsets but more than 2^32 trigram nodes");
        }
        if self.n1 > self.vocab_size {
            return corrupt("more unigram nodes than vocabulary entries");
        }
        if self.file_len != real_len {
            return corrupt(format!(
                "file length {real_len} differs from the recorded {} (truncated or extended)",
                self.file_len
            ));
        }
        let mut spans: Vec<(u64, u64)> = Vec::with_capacity(NUM_SECTIONS);
        for (i, s) in self.sections.iter().enumerate() {
            let name = SECTION_NAMES[i];
            let sec = SECTIONS[i];
            match self.expected_len(sec) {
                Some(e) if e != s.len => {
                    return corrupt(format!(
                        "section {name}: length {} but header counts imply {e}",
                        s.len
                    ));
                }
                None if matches!(
                    sec,
                    Section::L1Off
                        | Section::L1Cnt
                        | Section::L2Words
                        | Section::L2Child
                        | Section::L3Words
                ) =>
                {
                    return corrupt(format!("section {name}: size overflows"));
                }
                _ => {}
            }
            if matches!(sec, Section::Ovf2 | Section::Ovf3) && s.len % 16 != 0 {
                return corrupt(format!(
                    "section {name}: length {} not a multiple of 16",
                    s.len
                ));
            }
            let end = s.offset.checked_add(s.len);
            if s.offset % ALIGN != 0
                || s.offset < HEADER_LEN as u64
                || end.is_none_or(|e| e > real_len)
            {
                return corrupt(format!(
                    "section {name}: bytes {}..+{} outside the file ({real_len} bytes) or misaligned",
                    s.offset, s.len
                ));
            }
            spans.push((s.offset, s.offset + s.len));
        }
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[0].1 > w[1].0) {
            return corrupt("sections overlap");
        }
        Ok(())
    }
}

pub const SECTIONS: [Section; NUM_SECTIONS] = [
    Section::L1Off,
    Section::L1Cnt,
    Section::L2Words,
    Section::L2Child,
    Section::L3Words,
    Section::Ovf2,
    Section::Ovf3,
];

/// Validates caller-supplied build parameters (shared by builder and importer).
pub fn check_vocab(vocab_size: u64) -> Result<()> {
    if vocab_size == 0 || vocab_size > MAX_VOCAB {
        return invalid(format!(
            "vocab size {vocab_size} out of range 1..={MAX_VOCAB}"
        ));
    }
    Ok(())
}

// ---- XXH64 (public-domain algorithm by Yann Collet), one-shot. Used for section and header checksums.
const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

#[inline]
fn round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}
#[inline]
fn merge_round(acc: u64, val: u64) -> u64 {
    (acc ^ round(0, val)).wrapping_mul(P1).wrapping_add(P4)
}

pub fn xxh64(data: &[u8], seed: u64) -> u64 {
    let len = data.len();
    let mut rest = data;
    let mut h: u64;
    if len >= 32 {
        let (mut v1, mut v2, mut v3, mut v4) = (
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        );
        let mut chunks = rest.chunks_exact(32);
        for c in &mut chunks {
            v1 = round(v1, rd64(c, 0));
            v2 = round(v2, rd64(c, 1));
            v3 = round(v3, rd64(c, 2));
            v4 = round(v4, rd64(c, 3));
        }
        rest = chunks.remainder();
        h = v1
            .rotate_left(1)
            .wrapping_add(v2.rotate_left(7))
            .wrapping_add(v3.rotate_left(12))
            .wrapping_add(v4.rotate_left(18));
        h = merge_round(h, v1);
        h = merge_round(h, v2);
        h = merge_round(h, v3);
        h = merge_round(h, v4);
    } else {
        h = seed.wrapping_add(P5);
    }
    h = h.wrapping_add(len as u64);
    while rest.len() >= 8 {
        h ^= round(0, rd64(rest, 0));
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        h ^= (rd32(rest, 0) as u64).wrapping_mul(P1);
        h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        rest = &rest[4..];
    }
    for &byte in rest {
        h ^= (byte as u64).wrapping_mul(P5);
        h = h.rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^= h >> 32;
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh64_known_vectors() {
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition", 0),
            0xFBCE_A83C_8A37_8BF1
        );
    }

    #[test]
    fn packing_orders_by_token() {
        let p = Packing::new(token_bits_for(151_936));
        assert_eq!(p.count_bits, 14);
        let a = p.pack(5, 1_000_000);
        let b = p.pack(6, 1);
        assert!(a < b);
        assert_eq!(p.token(a), 5);
        assert_eq!(p.count(a), p.escape);
        assert_eq!(p.count(b), 1);
    }
}
