//! Pruner knobs (defaults of the DART reference, §4.1) and their per-level resolution.
use super::error::{bail, Result};

/// All knobs of the tree search. Defaults are the reference's.
#[derive(Debug, Clone, PartialEq)]
pub struct PruneConfig {
    /// Candidates per depth: the first `topk` columns of the `[D, k]` inputs. `None` (default): all `k`
    /// columns (the reference feeds k = 25).
    pub topk: Option<usize>,
    /// Beam survivors per depth (W).
    pub beam_width: usize,
    /// Node budget M: nodes kept besides the root; every tree has exactly N = M + 1 nodes.
    pub num_nodes: usize,
    /// β, weight of the n-gram log-probability.
    pub ngram_weight: f64,
    /// λ_l = (l + 1)^(−exponent) unless `level_weights` is given.
    pub level_weight_exponent: f64,
    /// α_l = base^l unless `logit_weights` is given.
    pub logit_weight_base: f64,
    /// Added (in f32) to p and q before the logarithm.
    pub eps: f64,
    /// Use the n-gram term at level 0 (children of the root). The reference does not.
    pub ngram_at_level0: bool,
    /// Explicit λ_l per level (length ≥ D); overrides `level_weight_exponent`.
    pub level_weights: Option<Vec<f64>>,
    /// Explicit α_l per level (length ≥ D); overrides `logit_weight_base`.
    pub logit_weights: Option<Vec<f64>>,
}

impl Default for PruneConfig {
    fn default() -> Self {
        PruneConfig {
            topk: None,
            beam_width: 20,
            num_nodes: 60,
            ngram_weight: 0.5,
            level_weight_exponent: 0.7,
            logit_weight_base: 0.9,
            eps: 1e-10,
            ngram_at_level0: false,
            level_weights: None,
            logit_weights: None,
        }
    }
}

fn check_weight(name: &str, v: f64) -> Result<()> {
    if !(v.is_finite() && v >= 0.0) {
        bail!("{name} must be finite and >= 0 (got {v})");
    }
    Ok(())
}

impl PruneConfig {
    /// Checks the knobs that do not depend on the input shape.
    pub fn validate(&self) -> Result<()> {
        if self.topk == Some(0) {
            bail!("topk must be >= 1");
        }
        if self.beam_width == 0 {
            bail!("beam_width must be >= 1");
        }
        if self.num_nodes >= u32::MAX as usize / 2 {
            bail!("num_nodes is too large ({})", self.num_nodes);
        }
        check_weight("ngram_weight", self.ngram_weight)?;
        if !self.level_weight_exponent.is_finite() {
            bail!("level_weight_exponent must be finite");
        }
        check_weight("logit_weight_base", self.logit_weight_base)?;
        let eps = self.eps as f32;
        if !(self.eps.is_finite() && eps > 0.0 && eps < 1.0) {
            bail!(
                "eps must be in (0, 1) and > 0 as float32 (got {})",
                self.eps
            );
        }
        for (name, w) in [
            ("level_weights", &self.level_weights),
            ("logit_weights", &self.logit_weights),
        ] {
            if let Some(w) = w {
                for (l, &v) in w.iter().enumerate() {
                    check_weight(&format!("{name}[{l}]"), v)?;
                }
            }
        }
        Ok(())
    }

    /// Number of pool candidates a tree of `depth` levels with `k` columns produces (EOS included).
    pub fn candidate_count(&self, depth: usize, k: usize) -> u64 {
        let k = self.topk.unwrap_or(k).min(k) as u64;
        let (mut beam, mut total) = (1u64, 0u64);
        for _ in 0..depth {
            let children = beam.saturating_mul(k);
            total = total.saturating_add(children);
            beam = children.min(self.beam_width as u64);
        }
        total
    }

    /// Resolves the per-level weights and checks the knobs against an input of shape `[D, k]`.
    pub fn resolve(&self, depth: usize, k: usize) -> Result<Resolved> {
        self.validate()?;
        if depth == 0 {
            bail!("the depth D of token_ids/probs must be >= 1");
        }
        if depth > u8::MAX as usize {
            bail!("the depth D must be <= 255 (got {depth})");
        }
        if k == 0 {
            bail!("the top-k dimension of token_ids/probs must be >= 1");
        }
        let topk = self.topk.unwrap_or(k);
        if topk > k {
            bail!("topk = {topk} exceeds the k dimension of the inputs ({k})");
        }
        let cands = self.candidate_count(depth, k);
        if cands < self.num_nodes as u64 {
            bail!(
                "num_nodes = {} exceeds the {cands} candidates a tree of depth {depth} with topk = {topk} and \
                 beam_width = {} can have; lower num_nodes or raise topk/beam_width/depth",
                self.num_nodes,
                self.beam_width
            );
        }
        if cands >= u32::MAX as u64 {
            bail!("too many candidates per tree ({cands})");
        }
        let pick =
            |explicit: &Option<Vec<f64>>, name: &str, f: &dyn Fn(f64) -> f64| -> Result<Vec<f64>> {
                match explicit {
                    Some(w) if w.len() < depth => {
                        bail!("{name} has {} entries, need >= D = {depth}", w.len())
                    }
                    Some(w) => Ok(w[..depth].to_vec()),
                    None => (0..depth)
                        .map(|l| {
                            let v = f(l as f64);
                            check_weight(&format!("{name}[{l}]"), v)?;
                            Ok(v)
                        })
                        .collect(),
                }
            };
        let exp = self.level_weight_exponent;
        let base = self.logit_weight_base;
        let lambda = pick(&self.level_weights, "level_weights", &|l| {
            (l + 1.0).powf(-exp)
        })?;
        let alpha = pick(&self.logit_weights, "logit_weights", &|l| base.powf(l))?;
        Ok(Resolved {
            depth,
            k,
            topk,
            beam_width: self.beam_width,
            num_nodes: self.num_nodes,
            beta: self.ngram_weight,
            eps: self.eps as f32,
            ngram_at_level0: self.ngram_at_level0,
            lambda,
            alpha,
        })
    }
}

/// A validated configuration for one input shape, with per-level weights materialised.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub depth: usize,
    /// Columns per level in the input rows.
    pub k: usize,
    /// Columns used per level (the first `topk` of each row).
    pub topk: usize,
    pub beam_width: usize,
    pub num_nodes: usize,
    pub beta: f64,
    pub eps: f32,
    pub ngram_at_level0: bool,
    pub lambda: Vec<f64>,
    pub alpha: Vec<f64>,
}

impl Resolved {
    /// Nodes per output tree (root included).
    pub fn n(&self) -> usize {
        self.num_nodes + 1
    }
}
