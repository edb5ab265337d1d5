//! Encodes a selected node set as SGLang's verify step needs it: N nodes in depth-ascending order with
//! the root first, `tokens`, `parents` (root: -1), `depth` (root: 0) and the N×N ancestor mask
//! (row i true at i and at every ancestor of i, the root included).
use super::search::{Node, NO_PARENT};

/// Output slices of one tree (each exactly N or N×N long).
#[derive(Debug)]
pub struct TreeOut<'a> {
    pub tokens: &'a mut [i64],
    pub parents: &'a mut [i32],
    pub depth: &'a mut [i32],
    pub tree_mask: &'a mut [bool],
}

/// Writes the root plus the `selected` arena indices (ascending, prefix-closed) into `out`.
/// `out_index` is scratch (arena index → output index).
pub fn encode(arena: &[Node], selected: &[u32], out_index: &mut Vec<u32>, out: TreeOut<'_>) {
    let n = selected.len() + 1;
    debug_assert!(out.tokens.len() == n && out.parents.len() == n && out.depth.len() == n);
    debug_assert_eq!(out.tree_mask.len(), n * n);
    out_index.clear();
    out_index.resize(arena.len(), NO_PARENT);
    out_index[0] = 0;
    out.tokens[0] = i64::from(arena[0].token);
    out.parents[0] = -1;
    out.depth[0] = 0;
    let mask = out.tree_mask;
    mask.fill(false);
    mask[0] = true;
    for (i, &a) in selected.iter().enumerate() {
        let i = i + 1;
        let node = arena[a as usize];
        let parent = out_index[node.parent as usize];
        // Prefix-closure (module docs of `search`): the parent was selected and has an earlier index.
        debug_assert!(
            parent != NO_PARENT && (parent as usize) < i,
            "selection is not prefix-closed"
        );
        let parent = parent as usize;
        out_index[a as usize] = i as u32;
        out.tokens[i] = i64::from(node.token);
        out.parents[i] = parent as i32;
        out.depth[i] = i32::from(node.depth);
        mask.copy_within(parent * n..parent * n + parent + 1, i * n);
        mask[i * n + i] = true;
    }
}
