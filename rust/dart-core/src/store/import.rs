//! Streaming import of the reference implementation's `.trie` files (dart-method §5.4) into our format.
//!
//! Pass 1 streams the file once and keeps, per node, only `(parent u64, token i32, count i32)` in a
//! temporary file (16 bytes/node on disk, not in RAM). Pass 2 maps that file and rebuilds each node's path
//! by following parent links (at most 3 hops), so any node order works, including parents with larger
//! indices than their children (merged tries). Paths go to the bounded-memory sorter and then the writer.
//!
//! Count hygiene: negative counts (the reference's `reduce` quirk, §5.6) are clamped to 0; level-2/3 nodes
//! with count 0 are dropped; context counts are raised to at least the sum of their children so that no
//! probability exceeds 1. For a consistent trie (a normal build) all of this is a no-op and the import is
//! exact.
use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use memmap2::Mmap;

use super::builder::BuildOptions;
use super::error::{corrupt, invalid, Result};
use super::format::{rd32, rd64, FLAG_IMPORTED};
use super::sorter::Sorter;
use super::writer::{StoreWriter, WriteStats, WriterOptions, C_SELF};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportStats {
    pub reference_order: u64,
    pub reference_nodes: u64,
    /// Nodes whose count was negative and got clamped to 0.
    pub clamped: u64,
    /// Nodes deeper than 3 (order > 3 tries), ignored.
    pub skipped_deep: u64,
    pub written: WriteStats,
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
fn read_i32(r: &mut impl Read) -> std::io::Result<i32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(i32::from_le_bytes(b))
}

fn truncated<T>(e: std::io::Error) -> Result<T> {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        corrupt("reference .trie file truncated")
    } else {
        Err(e.into())
    }
}

pub fn import_reference(src: &Path, dst: &Path, opts: &BuildOptions) -> Result<ImportStats> {
    let file = File::open(src)?;
    let file_len = file.metadata()?.len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    if file_len < 16 {
        return corrupt(format!("reference .trie file too short ({file_len} bytes)"));
    }
    let order = read_u64(&mut r)?;
    let n = read_u64(&mut r)?;
    if order == 0 || order > 64 {
        return corrupt(format!(
            "reference .trie order {order} is implausible (not a .trie file?)"
        ));
    }
    if n == 0 || n.checked_mul(24).is_none_or(|b| b > file_len - 16) {
        return corrupt(format!(
            "reference .trie node count {n} does not fit the file ({file_len} bytes)"
        ));
    }
    let tmp = opts.tmp_dir.join(format!(
        "dart-ngram-import-{}-{}.bin",
        std::process::id(),
        n
    ));
    let res = import_with_tmp(&mut r, file_len, order, n, &tmp, dst, opts);
    let _ = fs::remove_file(&tmp);
    res
}

fn import_with_tmp(
    r: &mut BufReader<File>,
    file_len: u64,
    order: u64,
    n: u64,
    tmp: &Path,
    dst: &Path,
    opts: &BuildOptions,
) -> Result<ImportStats> {
    let mut stats = ImportStats {
        reference_order: order,
        reference_nodes: n,
        ..Default::default()
    };
    // Pass 1: node table to disk, children lists skipped (parent links carry the same information).
    {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(tmp)?);
        let mut pos = 16u64;
        for i in 0..n {
            let (token, parent, count, nchild) =
                match (|| Ok((read_i32(r)?, read_u64(r)?, read_i32(r)?, read_u64(r)?)))() {
                    Ok(x) => x,
                    Err(e) => return truncated(e),
                };
            pos += 24;
            let skip = nchild.checked_mul(12).filter(|s| *s <= file_len - pos);
            let Some(skip) = skip else {
                return corrupt(format!(
                    "reference node {i}: child count {nchild} runs past the end of the file"
                ));
            };
            if i > 0 && parent >= n {
                return corrupt(format!(
                    "reference node {i}: parent index {parent} out of range ({n} nodes)"
                ));
            }
            r.seek_relative(skip as i64)?;
            pos += skip;
            w.write_all(&parent.to_le_bytes())?;
            w.write_all(&token.to_le_bytes())?;
            w.write_all(&count.to_le_bytes())?;
        }
        if pos != file_len {
            return corrupt(format!(
                "reference .trie has {} trailing bytes",
                file_len - pos
            ));
        }
        w.flush()?;
    }
    let f = File::open(tmp)?;
    // SAFETY: read-only map of our private temporary file, written completely above and not modified
    // while mapped.
    let map = unsafe { Mmap::map(&f)? };
    let node = |i: u64| -> (u64, i32, i32) {
        let i = i as usize;
        (
            rd64(&map, 2 * i),
            rd32(&map, 4 * i + 2) as i32,
            rd32(&map, 4 * i + 3) as i32,
        )
    };

    let v = opts.vocab_size;
    let wopts = WriterOptions {
        vocab_size: v,
        tokenizer_fingerprint: opts.tokenizer_fingerprint,
        min_count: opts.min_count,
        flags: FLAG_IMPORTED,
        tmp_dir: opts.tmp_dir.clone(),
    };
    let mut unigram = vec![0u64; v as usize];
    let budget = opts
        .memory_budget
        .saturating_sub(v.saturating_mul(32))
        .max(1 << 20);
    let mut sorter = Sorter::new(budget, &opts.tmp_dir);
    let codec = super::writer::KeyCodec::new(v)?;
    // Pass 2: rebuild each node's path (≤ 3 hops to the root, index 0).
    for i in 1..n {
        let (_, _, raw) = node(i);
        let mut path = [0u32; 3];
        let mut depth = 0usize;
        let mut cur = i;
        let mut deep = false;
        while cur != 0 {
            if depth == 3 {
                deep = true;
                break;
            }
            let (parent, token, _) = node(cur);
            if token < 0 || token as u64 >= v {
                return invalid(format!(
                    "reference node {cur}: token id {token} out of range for vocab size {v} (wrong --vocab-size?)"
                ));
            }
            path[depth] = token as u32;
            depth += 1;
            cur = parent;
        }
        if deep {
            if order <= 3 {
                return corrupt(format!(
                    "reference node {i} is not within 3 levels of the root (cycle?)"
                ));
            }
            stats.skipped_deep += 1;
            continue;
        }
        let count = if raw < 0 {
            stats.clamped += 1;
            0
        } else {
            raw as u64
        };
        path[..depth].reverse();
        match depth {
            1 => unigram[path[0] as usize] += count,
            2 => sorter.push(codec.key(path[0], path[1], C_SELF), count)?,
            3 => sorter.push(codec.key(path[0], path[1], codec.c_token(path[2])), count)?,
            _ => {}
        }
    }
    drop(map);
    let mut w = StoreWriter::new(wopts, unigram)?;
    sorter.merge(|k, c| w.push(k, c))?;
    stats.written = w.finish(dst)?;
    Ok(stats)
}
