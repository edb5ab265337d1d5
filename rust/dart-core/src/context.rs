//! Per-request index of a sequence's own n-grams, for context chains (`prune::graft`): the tokens that
//! followed the latest earlier occurrence of the sequence's current suffix, longest suffix first.
//!
//! Each n-gram (n in `MIN_NGRAM..=MAX_NGRAM`) is recorded, once the token after it is known, with the
//! position of that token; a later occurrence overwrites an earlier one. The current suffix is never in
//! the index (its next token is not known yet), so a look-up finds an earlier occurrence only. Appending
//! costs O(new tokens), amortized; a look-up O(1) plus the chain it copies.
//!
//! Host memory is bounded: a sequence indexes its latest `WINDOW` to `2 * WINDOW` tokens (about 100 bytes
//! each), so a long-context request costs at most ~2 MB however long it runs.
use std::collections::HashMap;

pub const MIN_NGRAM: usize = 2;
pub const MAX_NGRAM: usize = 4;
/// Token ids are packed 24 bits each into the keys (DART refuses vocabularies of 2^24 tokens or more).
pub const MAX_TOKEN: u32 = (1 << 24) - 1;

/// The n-gram `tokens` (n ≤ 4, ids ≤ `MAX_TOKEN`) as one key; n is part of it.
fn key(tokens: &[u32]) -> u128 {
    tokens
        .iter()
        .fold(tokens.len() as u128, |k, &t| (k << 24) | u128::from(t))
}

/// Tokens a sequence keeps indexed at least. Once it holds twice as many, the older half leaves the index
/// (rebuilt from the newer half, O(1) amortized per token): repeats further back than this rarely pay, and
/// it caps a request's host memory.
pub const WINDOW: usize = 8192;

/// One sequence and its n-gram index over its latest tokens (its window).
#[derive(Debug, Clone)]
pub struct ContextSequence {
    window: usize,
    /// Tokens before `tokens[0]` that have left the window.
    dropped: usize,
    tokens: Vec<u32>,
    next_of: HashMap<u128, u32>,
}

impl Default for ContextSequence {
    fn default() -> Self {
        Self::with_window(WINDOW)
    }
}

impl ContextSequence {
    /// An empty sequence that keeps `window` (≥ `MAX_NGRAM`) to `2 * window` tokens indexed.
    pub fn with_window(window: usize) -> Self {
        Self {
            window: window.max(MAX_NGRAM),
            dropped: 0,
            tokens: Vec::new(),
            next_of: HashMap::new(),
        }
    }

    /// The whole sequence's length, including the tokens that left the window.
    pub fn len(&self) -> usize {
        self.dropped + self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The indexed tokens: the sequence's latest ones.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Whether `sequence` continues this one (compared over the window: the dropped tokens are gone).
    pub fn continued_by(&self, sequence: &[u32]) -> bool {
        sequence.len() >= self.len() && sequence[self.dropped..self.len()] == self.tokens[..]
    }

    /// Appends tokens (each ≤ `MAX_TOKEN`, checked by the caller), recording the n-grams they complete.
    pub fn extend(&mut self, new_tokens: &[u32]) {
        for &token in new_tokens {
            self.push(token);
            if self.tokens.len() >= 2 * self.window {
                self.slide();
            }
        }
    }

    fn push(&mut self, token: u32) {
        let at = self.tokens.len();
        // The n-grams ending just before `at` now have a known next token: the one at `at`.
        for n in MIN_NGRAM..=MAX_NGRAM.min(at) {
            self.next_of
                .insert(key(&self.tokens[at - n..at]), at as u32);
        }
        self.tokens.push(token);
    }

    /// Drops all but the latest `window` tokens and re-indexes those.
    fn slide(&mut self) {
        let keep = self.tokens.split_off(self.tokens.len() - self.window);
        self.dropped += self.tokens.len();
        self.tokens.clear();
        self.next_of.clear();
        for token in keep {
            self.push(token);
        }
    }

    /// The latest earlier occurrence (within the window) of the longest suffix n-gram found: its length n
    /// and the position just past it (< the sequence's length, so it is earlier); None when none recurs.
    fn occurrence(&self) -> Option<(usize, usize)> {
        let len = self.tokens.len();
        (MIN_NGRAM..=MAX_NGRAM.min(len)).rev().find_map(|n| {
            let at = self.next_of.get(&key(&self.tokens[len - n..]))?;
            Some((n, *at as usize))
        })
    }

    /// Up to `max_len` tokens that followed the latest earlier occurrence (within the window) of the
    /// longest suffix n-gram found; empty when none recurs.
    pub fn chain(&self, max_len: usize) -> &[u32] {
        match self.occurrence() {
            Some((_, at)) => &self.tokens[at..self.tokens.len().min(at + max_len)],
            None => &[],
        }
    }

    /// How many of the sequence's latest tokens the occurrence `chain` copies from also ends with, up to
    /// `cap`: 0 when no suffix recurs, at least `MIN_NGRAM` when one does. A long match says the sequence
    /// is copying an earlier passage (quoting, translating line by line, editing code), where the chain's
    /// next tokens are likely right whatever the drafter thinks.
    pub fn match_len(&self, cap: usize) -> usize {
        let Some((n, at)) = self.occurrence() else {
            return 0;
        };
        let last = self.tokens.len() - 1;
        let mut matched = n;
        while matched < cap
            && matched < at
            && self.tokens[at - 1 - matched] == self.tokens[last - matched]
        {
            matched += 1;
        }
        matched.min(cap)
    }
}

/// The sequences of the running requests, by request id.
#[derive(Debug, Default)]
pub struct ContextIndex {
    sequences: HashMap<String, ContextSequence>,
}

impl ContextIndex {
    /// Sets a request's sequence to `tokens`. One that extends what is indexed (a later prefill chunk, a
    /// retracted request coming back) only appends the difference.
    pub fn set(&mut self, rid: &str, tokens: &[u32]) {
        let seq = self.sequences.entry(rid.to_owned()).or_default();
        if !seq.continued_by(tokens) {
            *seq = ContextSequence::default();
        }
        let known = seq.len();
        seq.extend(&tokens[known..]);
    }

    /// Appends to a request's sequence (a request not indexed starts empty).
    pub fn extend(&mut self, rid: &str, tokens: &[u32]) {
        self.sequences
            .entry(rid.to_owned())
            .or_default()
            .extend(tokens);
    }

    pub fn get(&self, rid: &str) -> Option<&ContextSequence> {
        self.sequences.get(rid)
    }

    /// Forgets every request not in `rids`.
    pub fn keep_only(&mut self, rids: &[&str]) {
        if rids.len() == self.sequences.len()
            && rids.iter().all(|r| self.sequences.contains_key(*r))
        {
            return;
        }
        let keep: std::collections::HashSet<&str> = rids.iter().copied().collect();
        self.sequences.retain(|rid, _| keep.contains(rid.as_str()));
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(tokens: &[u32]) -> ContextSequence {
        let mut s = ContextSequence::default();
        s.extend(tokens);
        s
    }

    #[test]
    fn the_longest_recurring_suffix_gives_the_chain() {
        // suffix [2, 3, 4] occurred at 1..4, followed by 5, 9, 2, ...
        assert_eq!(seq(&[1, 2, 3, 4, 5, 9, 2, 3, 4]).chain(3), &[5, 9, 2]);
        // only the 2-gram [3, 4] recurs: the longer suffixes do not
        assert_eq!(seq(&[3, 4, 7, 8, 2, 3, 4]).chain(8), &[7, 8, 2, 3, 4]);
        // the latest occurrence wins
        assert_eq!(seq(&[5, 6, 1, 5, 6, 2, 5, 6]).chain(1), &[2]);
    }

    #[test]
    fn the_match_extends_back_from_the_chained_occurrence() {
        // [9, 1, 2, 3, 4] recurs: the 4-gram key finds the occurrence, and the 9 before it matches too
        let copying = seq(&[9, 1, 2, 3, 4, 8, 9, 1, 2, 3, 4]);
        assert_eq!(copying.match_len(16), 5);
        assert_eq!(copying.match_len(3), 3);
        // only [3, 4] recurs
        assert_eq!(seq(&[3, 4, 7, 8, 2, 3, 4]).match_len(16), 2);
        assert_eq!(seq(&[1, 2, 3, 4]).match_len(16), 0);
        assert_eq!(seq(&[]).match_len(16), 0);
        // a run overlapping itself: the latest occurrence ends one token back
        assert_eq!(seq(&[5, 5, 5, 5, 5, 5]).match_len(16), 5);
    }

    #[test]
    fn nothing_recurs_nothing_is_chained() {
        assert!(seq(&[1, 2, 3, 4]).chain(4).is_empty());
        assert!(seq(&[7]).chain(4).is_empty());
        assert!(seq(&[]).chain(4).is_empty());
        // a single recurring token is not enough
        assert!(seq(&[1, 2, 3, 1]).chain(4).is_empty());
    }

    #[test]
    fn a_self_overlapping_run_chains_itself() {
        assert_eq!(seq(&[8, 8, 8, 8]).chain(4), &[8]);
        assert_eq!(seq(&[1, 2, 1, 2, 1, 2]).chain(4), &[1, 2]);
    }

    #[test]
    fn extending_in_pieces_equals_extending_at_once() {
        let all = [4, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2];
        let mut pieces = ContextSequence::default();
        for part in all.chunks(3) {
            pieces.extend(part);
        }
        assert_eq!(pieces.chain(5), seq(&all).chain(5));
        assert_eq!(pieces.chain(5), &[3, 7, 1, 2]);
    }

    #[test]
    fn set_appends_a_continuation_and_restarts_a_different_sequence() {
        let mut index = ContextIndex::default();
        index.set("a", &[1, 2, 3]);
        index.set("a", &[1, 2, 3, 1, 2]);
        assert_eq!(index.get("a").unwrap().chain(2), &[3, 1]);
        index.set("a", &[9, 9]);
        assert_eq!(index.get("a").unwrap().tokens(), &[9, 9]);
        index.extend("b", &[5]);
        index.keep_only(&["b"]);
        assert!(index.get("a").is_none());
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn a_long_sequence_keeps_its_latest_window_indexed() {
        let all: Vec<u32> = (0..40).map(|i| i % 13).collect();
        let mut windowed = ContextSequence::with_window(8);
        for part in all.chunks(3) {
            windowed.extend(part);
        }
        assert_eq!(windowed.len(), 40);
        assert!(windowed.tokens().len() >= 8 && windowed.tokens().len() < 16);
        assert_eq!(windowed.tokens(), &all[40 - windowed.tokens().len()..]);
        // No 2-gram recurs within the last 8..16 tokens of a period-13 sequence; the full index finds one.
        assert!(windowed.chain(4).is_empty());
        assert_eq!(seq(&all).chain(4), &[1, 2, 3, 4]);
        // A repeat inside the window is still found.
        windowed.extend(&[99, 7, 8, 5, 99, 7]);
        assert_eq!(windowed.chain(2), &[8, 5]);
        assert!(windowed.continued_by(&[all.as_slice(), &[99, 7, 8, 5, 99, 7, 1]].concat()));
        assert!(!windowed.continued_by(&all));
    }

    #[test]
    fn keys_of_different_lengths_differ() {
        assert_ne!(key(&[0, 1]), key(&[0, 0, 1]));
        assert_ne!(key(&[MAX_TOKEN, 1]), key(&[1, MAX_TOKEN]));
    }
}
