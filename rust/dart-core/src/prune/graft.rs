//! Grafts a context chain onto a searched tree: the tokens that followed the latest earlier occurrence of
//! the request's current suffix in its own prompt and output (found by the caller). Text that repeats its
//! context (code being edited, names, quoted passages, lists) is predicted there better than by any drafter,
//! and the target's verify makes a wrong chain cost nothing but the nodes it takes.
//!
//! The chain is walked from the root through the selected nodes; its first token not in the tree and those
//! after it (at most `max_new`) become new nodes, each displacing the lowest-ranked selected node off the
//! chain's path. The lowest-ranked node (the largest order key) off the path is always a leaf: a child ranks
//! below its parent (`search`), and the path is closed under parents. So the tree keeps its size and stays
//! prefix-closed.
use super::search::{order_key, Node, SearchScratch};

/// Reusable buffers of [`graft_chain`].
#[derive(Debug, Default)]
pub struct GraftScratch {
    on_path: Vec<bool>,
    keys: Vec<u64>,
    drop: Vec<bool>,
}

/// Grafts `chain` (tokens after the root) onto the tree in `s` (`s.selected`: arena indices without the
/// root, ascending). Afterwards `s.selected` has the same length, sorted by (depth, arena index), which
/// puts every parent before its children. Returns the number of new nodes.
pub fn graft_chain(
    s: &mut SearchScratch,
    chain: &[u32],
    max_new: usize,
    g: &mut GraftScratch,
) -> usize {
    let mut at = 0u32; // the root's arena index
    let mut matched = 0;
    g.on_path.clear();
    g.on_path.resize(s.arena.len(), false);
    g.on_path[0] = true;
    for &token in chain {
        let child = s.selected.iter().copied().find(|&a| {
            let node = s.arena[a as usize];
            node.parent == at && node.token == token
        });
        let Some(child) = child else { break };
        g.on_path[child as usize] = true;
        at = child;
        matched += 1;
    }
    // Off-path nodes, lowest-ranked first.
    g.keys.clear();
    g.keys.extend(
        s.selected
            .iter()
            .filter(|&&a| !g.on_path[a as usize])
            .map(|&a| order_key(s.arena[a as usize].score, a)),
    );
    let new = (chain.len() - matched).min(max_new).min(g.keys.len());
    if new == 0 {
        return 0;
    }
    g.keys.sort_unstable_by(|a, b| b.cmp(a));
    g.drop.clear();
    g.drop.resize(s.arena.len(), false);
    for &key in &g.keys[..new] {
        g.drop[(key & 0xFFFF_FFFF) as usize] = true;
    }
    s.selected.retain(|&a| !g.drop[a as usize]);
    for &token in &chain[matched..matched + new] {
        let parent = s.arena[at as usize];
        s.arena.push(Node {
            parent: at,
            token,
            score: parent.score,
            depth: parent.depth.saturating_add(1),
            eos: false,
        });
        at = (s.arena.len() - 1) as u32;
        s.selected.push(at);
    }
    let arena = &s.arena;
    s.selected
        .sort_unstable_by_key(|&a| (arena[a as usize].depth, a));
    new
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prune::search::NO_PARENT;

    fn node(parent: u32, token: u32, score: f32, depth: u8) -> Node {
        Node {
            parent,
            token,
            score,
            depth,
            eos: false,
        }
    }

    /// root(0) -> 10 (-1) -> 11 (-2); root -> 12 (-1.5); 10 -> 13 (-3)
    fn tree() -> SearchScratch {
        let mut s = SearchScratch::default();
        s.arena = vec![
            node(NO_PARENT, 0, 0.0, 0),
            node(0, 10, -1.0, 1),
            node(0, 12, -1.5, 1),
            node(1, 11, -2.0, 2),
            node(1, 13, -3.0, 2),
        ];
        s.selected = vec![1, 2, 3, 4];
        s
    }

    fn tokens(s: &SearchScratch) -> Vec<u32> {
        s.selected
            .iter()
            .map(|&a| s.arena[a as usize].token)
            .collect()
    }

    #[test]
    fn chain_in_the_tree_changes_nothing() {
        let mut s = tree();
        assert_eq!(
            graft_chain(&mut s, &[10, 11], 4, &mut GraftScratch::default()),
            0
        );
        assert_eq!(s.selected, vec![1, 2, 3, 4]);
    }

    #[test]
    fn new_tokens_displace_the_lowest_ranked_nodes_off_the_path() {
        let mut s = tree();
        // 10 is matched; 5 and 6 take the places of 13 (-3) and 11 (-2), not of 12 (-1.5).
        assert_eq!(
            graft_chain(&mut s, &[10, 5, 6], 4, &mut GraftScratch::default()),
            2
        );
        assert_eq!(tokens(&s), vec![10, 12, 5, 6]);
        let depths: Vec<u8> = s
            .selected
            .iter()
            .map(|&a| s.arena[a as usize].depth)
            .collect();
        assert_eq!(depths, vec![1, 1, 2, 3]);
        assert_eq!(s.arena[s.selected[3] as usize].parent, s.selected[2]);
    }

    #[test]
    fn max_new_and_the_tree_size_cut_the_chain() {
        let mut s = tree();
        assert_eq!(
            graft_chain(&mut s, &[7, 8, 9], 1, &mut GraftScratch::default()),
            1
        );
        assert_eq!(tokens(&s), vec![10, 12, 7, 11]);
        let mut s = tree();
        // Every node may go: the whole tree becomes the chain.
        assert_eq!(
            graft_chain(&mut s, &[7, 8, 9, 6, 5], 8, &mut GraftScratch::default()),
            4
        );
        assert_eq!(tokens(&s), vec![7, 8, 9, 6]);
    }

    #[test]
    fn a_displaced_parent_takes_its_children_first() {
        let mut s = tree();
        // Three new nodes under 12: 13, 11 and then 10 go (10 only once its children are gone).
        assert_eq!(
            graft_chain(&mut s, &[12, 1, 2, 3], 3, &mut GraftScratch::default()),
            3
        );
        assert_eq!(tokens(&s), vec![12, 1, 2, 3]);
    }
}
