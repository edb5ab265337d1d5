//! Direct build from token-id documents: count every window `t[s..s+3]` (shorter at the document end),
//! exactly as the reference does, with bounded memory (see [`super::sorter`]).
use std::path::{Path, PathBuf};

use super::error::{invalid, Result};
use super::sorter::Sorter;
use super::writer::{KeyCodec, StoreWriter, WriteStats, WriterOptions};

#[derive(Clone, Debug)]
pub struct BuildOptions {
    pub vocab_size: u64,
    pub tokenizer_fingerprint: u64,
    /// Level-2/3 n-grams seen fewer than `min_count` times are dropped (1 = keep all). Unigram counts
    /// and context counts are never reduced, so the remaining probabilities are unchanged and still ≤ 1;
    /// dropped continuations simply become unseen (probability 0).
    pub min_count: u64,
    /// Bytes for the in-memory record buffer (16 bytes per distinct or pending n-gram record). Arrays of
    /// size O(vocab) come on top (≈ 32 bytes × vocab).
    pub memory_budget: u64,
    pub tmp_dir: PathBuf,
}

impl BuildOptions {
    pub fn new(vocab_size: u64) -> BuildOptions {
        BuildOptions {
            vocab_size,
            tokenizer_fingerprint: 0,
            min_count: 1,
            memory_budget: 1 << 30,
            tmp_dir: std::env::temp_dir(),
        }
    }
}

pub struct StoreBuilder {
    opts: BuildOptions,
    codec: KeyCodec,
    unigram: Vec<u64>,
    sorter: Sorter,
    pub tokens: u64,
    pub documents: u64,
}

impl StoreBuilder {
    pub fn new(opts: BuildOptions) -> Result<StoreBuilder> {
        let codec = KeyCodec::new(opts.vocab_size)?;
        let fixed = opts.vocab_size.saturating_mul(32);
        let budget = opts.memory_budget.saturating_sub(fixed).max(1 << 20);
        Ok(StoreBuilder {
            sorter: Sorter::new(budget, &opts.tmp_dir),
            unigram: vec![0; opts.vocab_size as usize],
            codec,
            opts,
            tokens: 0,
            documents: 0,
        })
    }

    /// Counts all 1-, 2- and 3-gram windows of one document. Rejects ids outside the vocabulary before
    /// counting anything of it.
    pub fn add_document(&mut self, doc: &[u32]) -> Result<()> {
        let v = self.opts.vocab_size;
        if let Some(&bad) = doc.iter().find(|&&t| t as u64 >= v) {
            return invalid(format!("token id {bad} out of range for vocab size {v}"));
        }
        let n = doc.len();
        for s in 0..n {
            self.unigram[doc[s] as usize] += 1;
            if s + 1 < n {
                let cf = if s + 2 < n {
                    self.codec.c_token(doc[s + 2])
                } else {
                    self.codec.c_end()
                };
                self.sorter
                    .push(self.codec.key(doc[s], doc[s + 1], cf), 1)?;
            }
        }
        self.tokens += n as u64;
        self.documents += 1;
        Ok(())
    }

    pub fn vocab_size(&self) -> u64 {
        self.opts.vocab_size
    }

    /// Runs spilled to disk so far (progress reporting).
    pub fn spilled_runs(&self) -> usize {
        self.sorter.runs()
    }

    pub fn finish(self, path: &Path) -> Result<WriteStats> {
        let wopts = WriterOptions {
            vocab_size: self.opts.vocab_size,
            tokenizer_fingerprint: self.opts.tokenizer_fingerprint,
            min_count: self.opts.min_count,
            flags: 0,
            tmp_dir: self.opts.tmp_dir.clone(),
        };
        let mut w = StoreWriter::new(wopts, self.unigram)?;
        self.sorter.merge(|k, c| w.push(k, c))?;
        w.finish(path)
    }
}
