//! `/agentjet/group/2` on a node: registered once, each request goes to the member of the
//! group it names (a node may be a member of several groups: a server training several
//! adapters). A request for a group this node is not in is refused.
//!
//! Owns: the node's members by group. The answers are [`super::proto`]'s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::proto::{self, serve_one, Ballot, Reply, Request, Shared, GROUP};
use crate::swarm::frame::{read_frame, write_frame};
use crate::swarm::{PeerId, SwarmError, SwarmHandle};

/// Whether a peer may send this member group requests.
pub(super) type Trusted = Arc<dyn Fn(&PeerId) -> bool + Send + Sync>;

/// One node's group members, by group name: a node may be a member of several groups (a
/// server training several adapters), and `/agentjet/group/2` is registered once per node.
type Members = Arc<MembersTable>;
type MembersTable = Mutex<HashMap<String, (Arc<Shared>, Duration, Trusted)>>;

/// Serves `group`'s requests to this node with `shared` (replacing an earlier member of
/// the same group); a request for a group this node is not in is refused.
pub(super) fn serve_group(
    swarm: &SwarmHandle,
    group: &str,
    shared: Arc<Shared>,
    wait: Duration,
    trusted: Trusted,
) -> Result<(), SwarmError> {
    // Weak: the handler (which ends with its node) holds the table.
    static NODES: Mutex<Vec<(PeerId, Weak<MembersTable>)>> = Mutex::new(Vec::new());
    // Held across the registration, so two members of one node cannot both find no table.
    let mut nodes = crate::base::lock(&NODES);
    nodes.retain(|(_, t)| t.strong_count() > 0);
    let entry = (shared, wait, trusted);
    // A node of this swarm registers the protocol once: the first member registers it
    // with a table of its own; later members (the registration refused) join that table.
    let members: Members = Default::default();
    crate::base::lock(&members).insert(group.to_string(), entry.clone());
    let table = members.clone();
    let registered = swarm.serve(GROUP, move |peer, mut s| {
        let members = members.clone();
        async move {
            let req: Request = match read_frame(&mut s, proto::LIMIT).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(%peer, "dropped a bad group request: {e}");
                    return Err(e);
                }
            };
            let entry = crate::base::lock(&members).get(req.group()).cloned();
            let Some((shared, wait, trusted)) = entry else {
                let reply = Reply::Refused {
                    reason: format!("not a member of group {:?}", req.group()),
                    promised: Ballot::default(),
                };
                write_frame(&mut s, &reply, proto::LIMIT).await?;
                let _ = futures::io::AsyncWriteExt::close(&mut s).await;
                return Ok(());
            };
            let ok = trusted(&peer);
            serve_one(shared, peer, s, req, wait, ok).await
        }
    });
    match registered {
        Ok(()) => {
            nodes.retain(|(p, _)| *p != swarm.peer_id);
            nodes.push((swarm.peer_id, Arc::downgrade(&table)));
            Ok(())
        }
        Err(e) => match nodes
            .iter()
            .find(|(p, _)| *p == swarm.peer_id)
            .and_then(|(_, t)| t.upgrade())
        {
            Some(m) => {
                crate::base::lock(&m).insert(group.to_string(), entry);
                Ok(())
            }
            None => Err(e),
        },
    }
}
