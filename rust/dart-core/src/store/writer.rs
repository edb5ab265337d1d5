//! Write side: turns a key-sorted stream of n-gram records into a store file.
//!
//! Records are `(a, b, c-field)` keys (see [`KeyCodec`]) with counts. Within one bigram `a b` the c-field
//! says what the record is: `SELF` = an explicit count of the bigram node (import), a token `c` = the
//! trigram `a b c`, `END` = windows `a b` that stop at a document end (direct build). The bigram count is
//! `max(SELF, Σ children + END)`, which is exact for consistent input and keeps every probability ≤ 1 for
//! inconsistent input (see STORE_FORMAT.md). Level-2/3 arrays stream to temporary files, then the final
//! file is assembled, checksummed, and atomically renamed into place.
use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::{invalid, Result};
use super::format::{
    check_vocab, token_bits_for, xxh64, Header, Packing, Section, SectionEntry, ALIGN, HEADER_LEN,
    NUM_SECTIONS, ORDER, SECTIONS, VERSION,
};

/// Packs `(a, b, c-field)` into a u64 so that numeric order = lexicographic order.
#[derive(Clone, Copy, Debug)]
pub struct KeyCodec {
    bits: u32,
    vocab: u64,
}

pub const C_SELF: u64 = 0;

impl KeyCodec {
    pub fn new(vocab_size: u64) -> Result<KeyCodec> {
        check_vocab(vocab_size)?;
        let bits = token_bits_for(vocab_size + 2);
        if 3 * bits > 64 {
            return invalid(format!(
                "vocab size {vocab_size} too large for the builder (max 2^21 - 2)"
            ));
        }
        Ok(KeyCodec {
            bits,
            vocab: vocab_size,
        })
    }
    #[inline]
    pub fn c_token(&self, c: u32) -> u64 {
        c as u64 + 1
    }
    #[inline]
    pub fn c_end(&self) -> u64 {
        self.vocab + 1
    }
    #[inline]
    pub fn key(&self, a: u32, b: u32, cfield: u64) -> u64 {
        ((a as u64) << (2 * self.bits)) | ((b as u64) << self.bits) | cfield
    }
    #[inline]
    pub fn split(&self, k: u64) -> (u32, u32, u64) {
        let m = (1u64 << self.bits) - 1;
        (
            (k >> (2 * self.bits)) as u32,
            ((k >> self.bits) & m) as u32,
            k & m,
        )
    }
}

/// Figures about a written store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    pub n1: u64,
    pub n2: u64,
    pub n3: u64,
    pub total_tokens: u64,
    pub file_bytes: u64,
    /// Level-2/3 nodes removed by `min_count` (or with a non-positive count).
    pub pruned: u64,
}

pub struct WriterOptions {
    pub vocab_size: u64,
    pub tokenizer_fingerprint: u64,
    pub min_count: u64,
    pub flags: u64,
    pub tmp_dir: PathBuf,
}

pub struct StoreWriter {
    opts: WriterOptions,
    codec: KeyCodec,
    packing: Packing,
    unigram: Vec<u64>,
    l2_per_token: Vec<u64>,
    l2_mass: Vec<u64>,
    l2w: BufWriter<File>,
    l2c: BufWriter<File>,
    l3w: BufWriter<File>,
    tmp: [PathBuf; 3],
    tag: String,
    ovf2: Vec<(u64, u64)>,
    ovf3: Vec<(u64, u64)>,
    n2: u64,
    n3: u64,
    pruned: u64,
    cur: Option<(u32, u32)>,
    self_count: u64,
    end_count: u64,
    children: Vec<(u32, u64)>,
}

impl StoreWriter {
    pub fn new(opts: WriterOptions, unigram: Vec<u64>) -> Result<StoreWriter> {
        let codec = KeyCodec::new(opts.vocab_size)?;
        if unigram.len() as u64 != opts.vocab_size {
            return invalid("unigram array length differs from the vocab size");
        }
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("dart-ngram-w{}-{seq}", std::process::id());
        let tmp = ["l2w", "l2c", "l3w"].map(|n| opts.tmp_dir.join(format!("{tag}-{n}.bin")));
        let open = |p: &Path| -> Result<BufWriter<File>> {
            Ok(BufWriter::with_capacity(1 << 20, File::create(p)?))
        };
        let v = opts.vocab_size as usize;
        Ok(StoreWriter {
            packing: Packing::new(token_bits_for(opts.vocab_size)),
            codec,
            unigram,
            l2_per_token: vec![0; v],
            l2_mass: vec![0; v],
            l2w: open(&tmp[0])?,
            l2c: open(&tmp[1])?,
            l3w: open(&tmp[2])?,
            tmp,
            tag,
            ovf2: Vec::new(),
            ovf3: Vec::new(),
            n2: 0,
            n3: 0,
            pruned: 0,
            cur: None,
            self_count: 0,
            end_count: 0,
            children: Vec::new(),
            opts,
        })
    }

    pub fn codec(&self) -> KeyCodec {
        self.codec
    }

    /// Feeds one record; keys must arrive in strictly ascending order (the sorter guarantees it).
    pub fn push(&mut self, key: u64, count: u64) -> Result<()> {
        let (a, b, cf) = self.codec.split(key);
        if a as u64 >= self.opts.vocab_size
            || b as u64 >= self.opts.vocab_size
            || cf > self.codec.c_end()
        {
            return invalid(format!("record key out of range: ({a}, {b}, {cf})"));
        }
        if self.cur != Some((a, b)) {
            self.flush_group()?;
            self.cur = Some((a, b));
        }
        if cf == C_SELF {
            self.self_count = self.self_count.saturating_add(count);
        } else if cf == self.codec.c_end() {
            self.end_count = self.end_count.saturating_add(count);
        } else {
            self.children.push(((cf - 1) as u32, count));
        }
        Ok(())
    }

    fn flush_group(&mut self) -> Result<()> {
        let Some((a, b)) = self.cur.take() else {
            return Ok(());
        };
        let sum: u64 = self
            .children
            .iter()
            .fold(self.end_count, |s, c| s.saturating_add(c.1));
        let count = self.self_count.max(sum);
        let min = self.opts.min_count.max(1);
        if count < min {
            self.pruned += 1 + self.children.iter().filter(|c| c.1 > 0).count() as u64;
        } else {
            let i2 = self.n2;
            self.l2w
                .write_all(&self.packing.pack(b, count).to_le_bytes())?;
            if count >= self.packing.escape as u64 {
                self.ovf2.push((i2, count));
            }
            self.l2c.write_all(&self.n3.to_le_bytes())?;
            self.n2 += 1;
            self.l2_per_token[a as usize] += 1;
            self.l2_mass[a as usize] = self.l2_mass[a as usize].saturating_add(count);
            for &(c, cc) in &self.children {
                if cc < min {
                    self.pruned += (cc > 0) as u64;
                    continue;
                }
                self.l3w
                    .write_all(&self.packing.pack(c, cc).to_le_bytes())?;
                if cc >= self.packing.escape as u64 {
                    self.ovf3.push((self.n3, cc));
                }
                self.n3 += 1;
            }
        }
        self.children.clear();
        self.self_count = 0;
        self.end_count = 0;
        Ok(())
    }

    /// Writes the final file at `path` (through a temporary name and an atomic rename).
    pub fn finish(mut self, path: &Path) -> Result<WriteStats> {
        self.flush_group()?;
        for w in [&mut self.l2w, &mut self.l2c, &mut self.l3w] {
            w.flush()?;
        }
        let res = self.assemble(path);
        for p in &self.tmp {
            let _ = fs::remove_file(p);
        }
        res
    }

    fn assemble(&mut self, path: &Path) -> Result<WriteStats> {
        let v = self.opts.vocab_size;
        // Context counts must cover their children (keeps P ≤ 1 for imported, inconsistent counts).
        for (u, m) in self.unigram.iter_mut().zip(&self.l2_mass) {
            *u = (*u).max(*m);
        }
        let total: u64 = self.unigram.iter().fold(0u64, |s, &c| s.saturating_add(c));
        let n1 = self.unigram.iter().filter(|&&c| c > 0).count() as u64;
        let width: u32 = if self.n3 <= u32::MAX as u64 { 4 } else { 8 };
        let mut header = Header {
            version: VERSION,
            order: ORDER,
            token_bits: token_bits_for(v),
            l2_off_width: width,
            vocab_size: v,
            tokenizer_fingerprint: self.opts.tokenizer_fingerprint,
            total_tokens: total,
            n1,
            n2: self.n2,
            n3: self.n3,
            min_count: self.opts.min_count.max(1),
            flags: self.opts.flags,
            file_len: 0,
            sections: [SectionEntry::default(); NUM_SECTIONS],
        };
        let mut off = HEADER_LEN as u64;
        for (i, s) in SECTIONS.iter().enumerate() {
            off = off.div_ceil(ALIGN) * ALIGN;
            let len = match s {
                Section::Ovf2 => self.ovf2.len() as u64 * 16,
                Section::Ovf3 => self.ovf3.len() as u64 * 16,
                s => header.expected_len(*s).unwrap_or(0),
            };
            header.sections[i] = SectionEntry {
                offset: off,
                len,
                checksum: 0,
            };
            off += len;
        }
        header.file_len = off;

        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let fname = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp_out = dir.join(format!(".{fname}.{}.tmp", self.tag));
        let result = self
            .write_body(&mut header, &tmp_out)
            .and_then(|_| Ok(fs::rename(&tmp_out, path)?));
        if result.is_err() {
            let _ = fs::remove_file(&tmp_out);
        }
        result?;
        Ok(WriteStats {
            n1,
            n2: self.n2,
            n3: self.n3,
            total_tokens: total,
            file_bytes: header.file_len,
            pruned: self.pruned,
        })
    }

    fn write_body(&mut self, header: &mut Header, out: &Path) -> Result<()> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .read(true)
            .open(out)?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&[0u8; HEADER_LEN])?;
        let mut pos = HEADER_LEN as u64;
        let mut l1 = Vec::with_capacity(self.unigram.len() + 1);
        let mut acc = 0u64;
        l1.push(0u64);
        for &c in &self.l2_per_token {
            acc += c;
            l1.push(acc);
        }
        for (i, s) in SECTIONS.iter().enumerate() {
            let e = header.sections[i];
            while pos < e.offset {
                w.write_all(&[0])?;
                pos += 1;
            }
            match s {
                Section::L1Off => write_u64s(&mut w, &l1)?,
                Section::L1Cnt => write_u64s(&mut w, &self.unigram)?,
                Section::L2Words => copy_file(&self.tmp[0], &mut w)?,
                Section::L3Words => copy_file(&self.tmp[2], &mut w)?,
                Section::L2Child => {
                    let narrow = header.l2_off_width == 4;
                    copy_offsets(&self.tmp[1], &mut w, narrow)?;
                    // Sentinel end offset.
                    if narrow {
                        w.write_all(&(self.n3 as u32).to_le_bytes())?;
                    } else {
                        w.write_all(&self.n3.to_le_bytes())?;
                    }
                }
                Section::Ovf2 | Section::Ovf3 => {
                    let t = if *s == Section::Ovf2 {
                        &self.ovf2
                    } else {
                        &self.ovf3
                    };
                    for &(i, c) in t {
                        w.write_all(&i.to_le_bytes())?;
                        w.write_all(&c.to_le_bytes())?;
                    }
                }
            }
            pos += e.len;
        }
        let mut f = w.into_inner().map_err(|e| e.into_error())?;
        f.flush()?;
        // Checksums over the written sections (read back through a private read-only map).
        {
            // SAFETY: read-only map of our own temporary file, which nothing else writes while mapped.
            let map = unsafe { Mmap::map(&f)? };
            for e in header.sections.iter_mut() {
                e.checksum = xxh64(&map[e.offset as usize..(e.offset + e.len) as usize], 0);
            }
        }
        f.seek(SeekFrom::Start(0))?;
        f.write_all(&header.encode())?;
        f.sync_all()?;
        Ok(())
    }
}

fn write_u64s(w: &mut impl Write, v: &[u64]) -> std::io::Result<()> {
    for x in v {
        w.write_all(&x.to_le_bytes())?;
    }
    Ok(())
}

fn copy_file(src: &Path, w: &mut impl Write) -> Result<()> {
    let mut r = BufReader::with_capacity(1 << 20, File::open(src)?);
    std::io::copy(&mut r, w)?;
    Ok(())
}

/// Copies the temporary u64 offsets, narrowing them to u32 when `narrow`.
fn copy_offsets(src: &Path, w: &mut impl Write, narrow: bool) -> Result<()> {
    let mut r = BufReader::with_capacity(1 << 20, File::open(src)?);
    let mut b = [0u8; 8];
    loop {
        match r.read_exact(&mut b) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let x = u64::from_le_bytes(b);
        if narrow {
            w.write_all(&(x as u32).to_le_bytes())?;
        } else {
            w.write_all(&b)?;
        }
    }
}
