//! A writer of the reference implementation's `.trie` format (dart-method §5.4), for tests and tools:
//! it lets tests produce reference files without the reference code.
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// One reference node: token (root: -1), parent index, count, and `(child token, child index)` pairs.
#[derive(Clone, Debug, Default)]
pub struct RefNode {
    pub token: i32,
    pub parent: u64,
    pub count: i32,
    pub children: Vec<(i32, u64)>,
}

/// Builds the reference trie of `docs` (every window of ≤ 3 tokens, every node on the path counted, the
/// root too), in creation order like the reference.
pub fn reference_trie(docs: &[Vec<u32>]) -> Vec<RefNode> {
    let mut nodes = vec![RefNode {
        token: -1,
        parent: 0,
        count: 0,
        children: vec![],
    }];
    let mut index: HashMap<(u64, i32), u64> = HashMap::new();
    for d in docs {
        for s in 0..d.len() {
            let mut cur = 0u64;
            nodes[0].count += 1;
            for &t in &d[s..(s + 3).min(d.len())] {
                let t = t as i32;
                let next = *index.entry((cur, t)).or_insert_with(|| {
                    let id = nodes.len() as u64;
                    nodes.push(RefNode {
                        token: t,
                        parent: cur,
                        count: 0,
                        children: vec![],
                    });
                    nodes[cur as usize].children.push((t, id));
                    id
                });
                nodes[next as usize].count += 1;
                cur = next;
            }
        }
    }
    nodes
}

pub fn write_reference_trie(path: &Path, order: u64, nodes: &[RefNode]) -> std::io::Result<()> {
    let mut w = BufWriter::new(File::create(path)?);
    w.write_all(&order.to_le_bytes())?;
    w.write_all(&(nodes.len() as u64).to_le_bytes())?;
    for n in nodes {
        w.write_all(&n.token.to_le_bytes())?;
        w.write_all(&n.parent.to_le_bytes())?;
        w.write_all(&n.count.to_le_bytes())?;
        w.write_all(&(n.children.len() as u64).to_le_bytes())?;
        for &(t, c) in &n.children {
            w.write_all(&t.to_le_bytes())?;
            w.write_all(&c.to_le_bytes())?;
        }
    }
    w.flush()
}
