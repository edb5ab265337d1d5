//! Bounded-memory aggregation of `(key, count)` records: an in-memory buffer that is sorted and collapsed
//! (rayon parallel sort) when full, spilled to disk as a sorted run when collapsing no longer frees enough
//! room, and a k-way merge of all runs at the end.
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rayon::slice::ParallelSliceMut;

use super::error::Result;

const RECORD: usize = 16;

pub struct Sorter {
    buf: Vec<(u64, u64)>,
    cap: usize,
    /// `buf[..sorted_len]` is sorted and collapsed (unique keys).
    sorted_len: usize,
    runs: Vec<PathBuf>,
    tmp_dir: PathBuf,
    tag: String,
    pub spilled_records: u64,
}

impl Sorter {
    /// `memory_budget` bytes bound the record buffer (16 bytes per record).
    pub fn new(memory_budget: u64, tmp_dir: &Path) -> Sorter {
        let cap = ((memory_budget / RECORD as u64) as usize).max(1024);
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Sorter {
            buf: Vec::with_capacity(cap.min(1 << 20)),
            cap,
            sorted_len: 0,
            runs: Vec::new(),
            tmp_dir: tmp_dir.to_path_buf(),
            tag: format!("dart-ngram-{}-{seq}", std::process::id()),
            spilled_records: 0,
        }
    }

    #[inline]
    pub fn push(&mut self, key: u64, count: u64) -> Result<()> {
        if self.buf.len() >= self.cap {
            self.compact()?;
        }
        self.buf.push((key, count));
        Ok(())
    }

    fn collapse(&mut self) {
        if self.sorted_len == self.buf.len() {
            return;
        }
        self.buf.par_sort_unstable_by_key(|r| r.0);
        let mut w = 0usize;
        for r in 0..self.buf.len() {
            if w > 0 && self.buf[w - 1].0 == self.buf[r].0 {
                self.buf[w - 1].1 = self.buf[w - 1].1.saturating_add(self.buf[r].1);
            } else {
                self.buf[w] = self.buf[r];
                w += 1;
            }
        }
        self.buf.truncate(w);
        self.sorted_len = w;
    }

    /// Collapse duplicates; spill to a run if the buffer stays more than half full.
    fn compact(&mut self) -> Result<()> {
        self.collapse();
        if self.buf.len() * 2 > self.cap {
            let path = self
                .tmp_dir
                .join(format!("{}-run{}.bin", self.tag, self.runs.len()));
            let mut w = BufWriter::with_capacity(1 << 20, File::create(&path)?);
            for &(k, c) in &self.buf {
                w.write_all(&k.to_le_bytes())?;
                w.write_all(&c.to_le_bytes())?;
            }
            w.flush()?;
            self.spilled_records += self.buf.len() as u64;
            self.runs.push(path);
            self.buf.clear();
            self.sorted_len = 0;
        }
        Ok(())
    }

    /// Number of runs spilled so far.
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Consumes the sorter and calls `f` on every unique key in ascending order with its summed count.
    pub fn merge(mut self, mut f: impl FnMut(u64, u64) -> Result<()>) -> Result<()> {
        self.collapse();
        let mut sources: Vec<RunReader> = Vec::with_capacity(self.runs.len() + 1);
        for p in &self.runs {
            sources.push(RunReader::File(BufReader::with_capacity(
                256 << 10,
                File::open(p)?,
            )));
        }
        sources.push(RunReader::Mem(std::mem::take(&mut self.buf).into_iter()));
        let mut heap = BinaryHeap::with_capacity(sources.len());
        for (i, s) in sources.iter_mut().enumerate() {
            if let Some((k, c)) = s.next()? {
                heap.push(Reverse((k, i, c)));
            }
        }
        let mut cur: Option<(u64, u64)> = None;
        while let Some(Reverse((k, i, c))) = heap.pop() {
            match cur {
                Some((ck, cc)) if ck == k => cur = Some((ck, cc.saturating_add(c))),
                Some((ck, cc)) => {
                    f(ck, cc)?;
                    cur = Some((k, c));
                }
                None => cur = Some((k, c)),
            }
            if let Some((k2, c2)) = sources[i].next()? {
                heap.push(Reverse((k2, i, c2)));
            }
        }
        if let Some((ck, cc)) = cur {
            f(ck, cc)?;
        }
        Ok(())
    }
}

impl Drop for Sorter {
    fn drop(&mut self) {
        for p in &self.runs {
            let _ = std::fs::remove_file(p);
        }
    }
}

enum RunReader {
    File(BufReader<File>),
    Mem(std::vec::IntoIter<(u64, u64)>),
}

impl RunReader {
    fn next(&mut self) -> Result<Option<(u64, u64)>> {
        match self {
            RunReader::Mem(it) => Ok(it.next()),
            RunReader::File(r) => {
                let mut b = [0u8; RECORD];
                match r.read_exact(&mut b) {
                    Ok(()) => Ok(Some((
                        u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8])),
                        u64::from_le_bytes(b[8..].try_into().unwrap_or([0; 8])),
                    ))),
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_and_merges() {
        let dir = std::env::temp_dir();
        let mut s = Sorter::new(0, &dir); // minimum capacity 1024 → forces spills
        let mut expect = std::collections::BTreeMap::new();
        let mut x = 12345u64;
        for _ in 0..20_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let k = (x >> 33) % 5000;
            s.push(k, 2).unwrap();
            *expect.entry(k).or_insert(0u64) += 2;
        }
        assert!(s.runs() > 0);
        let mut got = Vec::new();
        s.merge(|k, c| {
            got.push((k, c));
            Ok(())
        })
        .unwrap();
        assert_eq!(got, expect.into_iter().collect::<Vec<_>>());
    }
}
