//! What the server does with its member loop's events: the gossiped group status, and the
//! lines a person watching the server reads (epochs, joins, hash mismatches, failed
//! rounds).

use tracing::warn;

use crate::base::lock;
use crate::collective::member::{hex8, MemberEvent, SyncReason};
use crate::server::events::ServerEvent;
use crate::server::served::ServedModel;

/// Applies `e` to `served`'s status and prints what a person should see.
pub fn on_event(served: &ServedModel, e: &MemberEvent) {
    if let Some(ev) = ServerEvent::of_member(e) {
        served.events.emit(ev);
    }
    let name = &served.name;
    match e {
        MemberEvent::Status(s) => *lock(&served.group) = Some(s.clone()),
        MemberEvent::Formed {
            epoch,
            members,
            steps,
            hash,
            ..
        } => println!(
            "group {name:?}: epoch {epoch} with {members} member(s), step {steps}, parameters {}",
            hex8(hash)
        ),
        MemberEvent::Syncing { steps, reason } => {
            let why = match reason {
                SyncReason::Differs { mine, group } => format!(
                    "its parameters {} differ from the group's {} at that step",
                    hex8(mine),
                    hex8(group)
                ),
                SyncReason::Behind { at } => format!("it is at step {at}"),
            };
            println!("group {name:?}: fetching the group's state (step {steps}) from its members: {why}");
        }
        MemberEvent::Synced {
            steps,
            version,
            bytes,
            seconds,
        } => println!(
            "group {name:?}: joined at step {steps} (policy version {version}), {bytes} bytes in {seconds:.2} s"
        ),
        MemberEvent::HashesDiffer { steps, mine } => println!(
            "group {name:?}: the members' parameter hashes differ at step {steps} (mine {}); \
             forming the next epoch, whose members off the majority re-sync",
            hex8(mine)
        ),
        MemberEvent::RoundFailed { epoch, error } => {
            println!("group {name:?}: a round of epoch {epoch} failed ({error}); forming the next")
        }
        MemberEvent::LeftOut { error } => {
            warn!(model = name, "{error}");
            eprintln!("training of {name:?}: {error}");
        }
        MemberEvent::Failed { .. } | MemberEvent::Stopped { .. } => *lock(&served.group) = None,
        _ => {}
    }
}
