//! A bounded map that forgets its oldest entries first: the responses a later call may
//! continue (`previous_response_id`) and the tool-call arguments as the model wrote them
//! (so that an Anthropic `tool_use` block, whose `input` comes back parsed, renders again
//! as the same text).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::base::lock;

pub(super) struct Recent<V> {
    cap: usize,
    inner: Mutex<(HashMap<String, V>, VecDeque<String>)>,
}

impl<V: Clone> Recent<V> {
    pub(super) fn new(cap: usize) -> Recent<V> {
        Recent {
            cap: cap.max(1),
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
        }
    }

    pub(super) fn put(&self, key: String, value: V) {
        let mut g = lock(&self.inner);
        let (map, order) = &mut *g;
        if map.insert(key.clone(), value).is_none() {
            order.push_back(key);
        }
        while map.len() > self.cap {
            match order.pop_front() {
                Some(old) => {
                    map.remove(&old);
                }
                None => break,
            }
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<V> {
        lock(&self.inner).0.get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_entry_is_forgotten_first_and_a_replaced_key_keeps_its_place() {
        let r = Recent::new(2);
        r.put("a".into(), 1);
        r.put("b".into(), 2);
        r.put("a".into(), 3);
        assert_eq!(r.get("a"), Some(3));
        r.put("c".into(), 4);
        assert_eq!(
            (r.get("a"), r.get("b"), r.get("c")),
            (None, Some(2), Some(4))
        );
    }
}
