//! The one interface between the n-gram store and the pruner.

/// A next-token probability model conditioned on (at most) the two previous tokens.
///
/// Semantics of the DART reference (maximum-likelihood trigram with back-off to the bigram, no smoothing):
/// `P(t | a, b) = C(a b t) / C(a b)` if the trigram context `a b` exists and has child `t`; otherwise
/// `C(b t) / C(b)` if `b` has child `t`; otherwise 0. `prev2 = None` means only one context token is known.
pub trait NextTokenModel: Sync {
    /// Writes `P(tokens[i] | prev2, prev1)` into `out[i]` for every i. `out.len() == tokens.len()`.
    fn next_probs(&self, prev2: Option<u32>, prev1: u32, tokens: &[u32], out: &mut [f32]);
}
