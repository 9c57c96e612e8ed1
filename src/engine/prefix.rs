//! The prefix cache's index: a radix tree keyed by token ids whose nodes hold the keys and
//! values of their tokens (any [`Span`]: the engine stores LibTorch KV blocks, the tests
//! plain vectors), under a byte budget, evicted least-recently-used at node granularity
//! (leaves first, so a cached prefix never loses its beginning while its end stays).
//!
//! A request's prompt finds its longest cached prefix with [`PrefixTree::lookup`]; what a
//! finished sequence computed goes in with [`PrefixTree::insert`], which stores only the
//! positions the tree does not hold yet. A weight update empties the tree
//! ([`PrefixTree::clear`]): keys and values computed by old weights are never reused.
//!
//! Owns: which token sequences are cached, and their bytes. Never computes KV.

use std::collections::HashMap;

/// What a node stores for its tokens: one position per token.
pub trait Span: Sized {
    type Error;
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// Keeps positions `0..at`, returns `at..` (`0 < at < len`).
    fn split_off(&mut self, at: usize) -> Result<Self, Self::Error>;
    /// Whether a sequence can continue after this span's first `take` positions (a model
    /// with recurrent state can only where the state was kept).
    fn resumable(&self, _take: usize) -> bool {
        true
    }
}

struct Node<S> {
    tokens: Vec<u32>,
    /// `None` only at the root.
    span: Option<S>,
    parent: usize,
    children: HashMap<u32, usize>,
    /// Tick of the last lookup or insert that went through this node.
    used: u64,
}

const ROOT: usize = 0;

/// Counters since the tree was made (they survive [`PrefixTree::clear`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCounters {
    pub evicted_nodes: u64,
    pub evicted_positions: u64,
    pub cleared: u64,
}

/// A radix tree over token ids; see the module documentation.
pub struct PrefixTree<S> {
    nodes: Vec<Option<Node<S>>>,
    free: Vec<usize>,
    bytes: usize,
    positions: usize,
    budget: usize,
    tick: u64,
    counters: PrefixCounters,
}

/// One piece of a lookup's match: `take` positions from the start of node `node`'s span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub node: usize,
    pub take: usize,
}

impl<S: Span> PrefixTree<S> {
    /// An empty tree that holds at most `budget` bytes.
    pub fn new(budget: usize) -> PrefixTree<S> {
        PrefixTree {
            nodes: vec![Some(Node {
                tokens: Vec::new(),
                span: None,
                parent: ROOT,
                children: HashMap::new(),
                used: 0,
            })],
            free: Vec::new(),
            bytes: 0,
            positions: 0,
            budget,
            tick: 0,
            counters: PrefixCounters::default(),
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Token positions held.
    pub fn positions(&self) -> usize {
        self.positions
    }
    pub fn budget(&self) -> usize {
        self.budget
    }
    /// Changes the budget, evicting down to it now.
    pub fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        self.evict_to(budget);
    }
    pub fn counters(&self) -> PrefixCounters {
        self.counters
    }
    /// Nodes held, the root not counted.
    pub fn nodes(&self) -> usize {
        self.nodes.iter().flatten().count() - 1
    }

    fn node(&self, i: usize) -> &Node<S> {
        self.nodes[i].as_ref().expect("a live node index")
    }
    fn node_mut(&mut self, i: usize) -> &mut Node<S> {
        self.nodes[i].as_mut().expect("a live node index")
    }

    /// The span of a node a lookup returned.
    pub fn span(&self, node: usize) -> Option<&S> {
        self.nodes.get(node)?.as_ref()?.span.as_ref()
    }

    /// The longest cached prefix of `tokens`, at most `max` positions, as the nodes to
    /// copy from in order; marks them used.
    pub fn lookup(&mut self, tokens: &[u32], max: usize) -> Vec<Piece> {
        self.tick += 1;
        let tokens = &tokens[..tokens.len().min(max)];
        let mut out = Vec::new();
        let (mut at, mut i) = (ROOT, 0usize);
        while i < tokens.len() {
            let Some(&child) = self.node(at).children.get(&tokens[i]) else {
                break;
            };
            let common = common_prefix(&self.node(child).tokens, &tokens[i..]);
            let tick = self.tick;
            self.node_mut(child).used = tick;
            out.push(Piece {
                node: child,
                take: common,
            });
            i += common;
            if common < self.node(child).tokens.len() {
                break;
            }
            at = child;
        }
        out
    }

    /// Stores `tokens` (a sequence whose positions `0..tokens.len()` are computed), asking
    /// `make(start, len)` for the spans of the positions the tree does not hold yet; then
    /// evicts down to the budget. Returns the positions added.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        mut make: impl FnMut(usize, usize) -> Result<S, S::Error>,
    ) -> Result<usize, S::Error> {
        self.tick += 1;
        let tick = self.tick;
        let (mut at, mut i) = (ROOT, 0usize);
        while i < tokens.len() {
            let Some(&child) = self.node(at).children.get(&tokens[i]) else {
                break;
            };
            let common = common_prefix(&self.node(child).tokens, &tokens[i..]);
            self.node_mut(child).used = tick;
            if common < self.node(child).tokens.len() {
                if i + common == tokens.len() {
                    // Ends inside this node: all of it is held already.
                    i += common;
                    break;
                }
                self.split(child, common)?;
            }
            i += common;
            at = child;
        }
        let added = tokens.len() - i;
        if added > 0 {
            let span = make(i, added)?;
            self.bytes += span.bytes();
            self.positions += added;
            let leaf = self.alloc(Node {
                tokens: tokens[i..].to_vec(),
                span: Some(span),
                parent: at,
                children: HashMap::new(),
                used: tick,
            });
            self.node_mut(at).children.insert(tokens[i], leaf);
        }
        self.evict_to(self.budget);
        Ok(added)
    }

    /// Splits node `n` after `at` tokens: `n` keeps the head, a new child the tail (with
    /// `n`'s children).
    fn split(&mut self, n: usize, at: usize) -> Result<(), S::Error> {
        let node = self.node_mut(n);
        let tail_tokens = node.tokens.split_off(at);
        let span = node.span.as_mut().expect("only the root has no span");
        let before = span.bytes();
        let tail_span = span.split_off(at)?;
        let after = span.bytes() + tail_span.bytes();
        let children = std::mem::take(&mut node.children);
        let used = node.used;
        let first = tail_tokens[0];
        let tail = self.alloc(Node {
            tokens: tail_tokens,
            span: Some(tail_span),
            parent: n,
            children,
            used,
        });
        let moved: Vec<usize> = self.node(tail).children.values().copied().collect();
        for c in moved {
            self.node_mut(c).parent = tail;
        }
        self.node_mut(n).children.insert(first, tail);
        self.bytes = self.bytes + after - before;
        Ok(())
    }

    fn alloc(&mut self, node: Node<S>) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    fn remove_leaf(&mut self, n: usize) {
        let Some(node) = self.nodes[n].take() else {
            return;
        };
        self.free.push(n);
        let bytes = node.span.as_ref().map_or(0, |s| s.bytes());
        self.bytes -= bytes;
        self.positions -= node.tokens.len();
        self.counters.evicted_nodes += 1;
        self.counters.evicted_positions += node.tokens.len() as u64;
        if let Some(&first) = node.tokens.first() {
            self.node_mut(node.parent).children.remove(&first);
        }
    }

    /// Evicts least-recently-used leaves until at most `budget` bytes are held. Returns
    /// the bytes given back.
    pub fn evict_to(&mut self, budget: usize) -> usize {
        let start = self.bytes;
        while self.bytes > budget {
            let mut leaves: Vec<(u64, usize)> = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(i, n)| {
                    n.as_ref()
                        .filter(|n| n.children.is_empty())
                        .map(|n| (n.used, i))
                })
                .collect();
            if leaves.is_empty() {
                break;
            }
            leaves.sort_unstable();
            for (_, leaf) in leaves {
                if self.bytes <= budget {
                    break;
                }
                self.remove_leaf(leaf);
            }
        }
        start - self.bytes
    }

    /// Drops everything (a weight update: KV of old weights must not be reused).
    pub fn clear(&mut self) {
        let root = self.nodes[ROOT].take().map(|mut r| {
            r.children.clear();
            r
        });
        self.nodes.clear();
        self.nodes.push(root);
        self.free.clear();
        self.bytes = 0;
        self.positions = 0;
        self.counters.cleared += 1;
    }
}

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each position is its token id; 10 bytes a position.
    #[derive(Debug)]
    struct Vals(Vec<u32>);
    impl Span for Vals {
        type Error = ();
        fn bytes(&self) -> usize {
            10 * self.0.len()
        }
        fn split_off(&mut self, at: usize) -> Result<Vals, ()> {
            Ok(Vals(self.0.split_off(at)))
        }
    }

    fn put(t: &mut PrefixTree<Vals>, tokens: &[u32]) -> usize {
        t.insert(tokens, |s, n| Ok(Vals(tokens[s..s + n].to_vec())))
            .unwrap()
    }

    /// The positions a lookup would copy, in order.
    fn got(t: &mut PrefixTree<Vals>, tokens: &[u32], max: usize) -> Vec<u32> {
        let pieces = t.lookup(tokens, max);
        pieces
            .iter()
            .flat_map(|p| t.span(p.node).unwrap().0[..p.take].to_vec())
            .collect()
    }

    #[test]
    fn longest_prefix_is_found_across_splits_and_only_new_positions_are_stored() {
        let mut t = PrefixTree::new(1 << 20);
        assert_eq!(put(&mut t, &[1, 2, 3, 4, 5]), 5);
        // A sibling that shares 1,2,3: the node splits, only 7,8 are new.
        assert_eq!(put(&mut t, &[1, 2, 3, 7, 8]), 2);
        assert_eq!(t.positions(), 7);
        assert_eq!(t.bytes(), 70);
        assert_eq!(got(&mut t, &[1, 2, 3, 4, 5, 6], 99), vec![1, 2, 3, 4, 5]);
        assert_eq!(got(&mut t, &[1, 2, 3, 7, 9], 99), vec![1, 2, 3, 7]);
        assert_eq!(got(&mut t, &[1, 2, 9], 99), vec![1, 2]);
        assert_eq!(got(&mut t, &[5, 1], 99), Vec::<u32>::new());
        // `max` caps the match (the engine always leaves one token to prefill).
        assert_eq!(got(&mut t, &[1, 2, 3, 4, 5], 4), vec![1, 2, 3, 4]);
        // A continuation of a cached sequence adds only its tail.
        assert_eq!(put(&mut t, &[1, 2, 3, 4, 5, 6, 7]), 2);
        assert_eq!(got(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8], 99).len(), 7);
        // Inserting what is there adds nothing.
        assert_eq!(put(&mut t, &[1, 2, 3]), 0);
        assert_eq!(t.positions(), 9);
    }

    #[test]
    fn eviction_takes_least_recently_used_leaves_and_keeps_the_budget() {
        // 100 bytes = 10 positions.
        let mut t = PrefixTree::new(100);
        put(&mut t, &[1, 2, 3, 4]);
        put(&mut t, &[1, 2, 5, 6]);
        put(&mut t, &[9, 9]);
        assert_eq!(t.positions(), 8);
        // Touch [1,2,3,4]: [1,2,5,6]'s leaf (5,6) and [9,9] are now older.
        got(&mut t, &[1, 2, 3, 4], 99);
        // 4 new positions: 12 > 10, the oldest leaf goes ([1,2,5,6]'s tail, then [9,9]).
        put(&mut t, &[7, 7, 7, 7]);
        assert!(t.bytes() <= 100, "{}", t.bytes());
        assert_eq!(got(&mut t, &[1, 2, 3, 4], 99), vec![1, 2, 3, 4]);
        assert_eq!(got(&mut t, &[7, 7, 7, 7], 99), vec![7, 7, 7, 7]);
        assert_eq!(got(&mut t, &[1, 2, 5, 6], 99), vec![1, 2]);
        assert!(t.counters().evicted_nodes >= 1);
        // A sequence larger than the budget is not kept, and nothing panics.
        put(&mut t, &(100..120).collect::<Vec<_>>());
        assert!(t.bytes() <= 100);
        // Evicting to zero empties the tree; the root stays usable.
        t.evict_to(0);
        assert_eq!((t.bytes(), t.positions(), t.nodes()), (0, 0, 0));
        put(&mut t, &[1, 2]);
        assert_eq!(got(&mut t, &[1, 2, 3], 99), vec![1, 2]);
    }

    #[test]
    fn clear_forgets_everything_and_counts() {
        let mut t = PrefixTree::new(1 << 20);
        put(&mut t, &[1, 2, 3]);
        t.clear();
        assert_eq!((t.bytes(), t.positions(), t.nodes()), (0, 0, 0));
        assert!(t.lookup(&[1, 2, 3], 99).is_empty());
        assert_eq!(t.counters().cleared, 1);
        assert_eq!(put(&mut t, &[1, 2, 3]), 3);
    }
}
