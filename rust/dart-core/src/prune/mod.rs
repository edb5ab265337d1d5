//! Batched DART tree pruner (beam search over an arena). Owned by the pruner work.
